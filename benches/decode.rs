//! Prefill and decode cost of the dense single-sequence path on dummy weights of a small
//! real-vocabulary config (models/dummy-small-qwen2.5-vl.json). On a GPU use
//! `merg bench --config models/qwen2.5-vl-7b-instruct.json --device cuda` instead.

use candle_core::{DType, Device};
use criterion::{criterion_group, criterion_main, Criterion};
use merg::config::ModelConfig;
use merg::models::{DenseKvCache, QwenVl, VisionInput};

fn bench(c: &mut Criterion) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dummy-small-qwen2.5-vl.json");
    let cfg = ModelConfig::from_file(&path).unwrap();
    let model = QwenVl::dummy(&cfg, DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..128u32).map(|i| 100 + (i * 7919) % 5000).collect();
    let pre = model.prepare(&ids, &VisionInput::default()).unwrap();
    let mut g = c.benchmark_group("dense");
    g.sample_size(10);
    g.bench_function("prefill_128_tokens", |b| {
        b.iter(|| {
            let mut kv = DenseKvCache::new();
            model.forward(&pre.embeds, &pre.positions, &mut kv, 1).unwrap()
        })
    });
    g.bench_function("decode_16_tokens_after_128", |b| {
        b.iter(|| {
            let mut kv = DenseKvCache::new();
            model.forward(&pre.embeds, &pre.positions, &mut kv, 1).unwrap();
            for i in 0..16 {
                model.decode_step(7, ids.len() + i, pre.rope_delta, &mut kv).unwrap();
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
