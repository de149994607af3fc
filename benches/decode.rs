//! Prefill and decode cost of the dense single-sequence path on dummy weights of a small
//! real-vocabulary config (models/dummy-small-qwen2.5-vl.json). On a GPU use
//! `merg bench --config models/qwen2.5-vl-7b-instruct.json --device cuda` instead.

use candle_core::{DType, Device};
use criterion::{criterion_group, criterion_main, Criterion};
use merg::generate::{decode_inputs, forward_logits, prepare, VisionInput};
use merg::models::{registry, DenseCache, Model};
use merg::weights::Weights;

fn bench(c: &mut Criterion) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dummy-small-qwen2.5-vl.json");
    let cfg = registry::read_config(&path).unwrap();
    let model = registry::load(&cfg, Weights::dummy(DType::F32, &Device::Cpu)).unwrap();
    let model: &dyn Model = &*model;
    let ids: Vec<u32> = (0..128u32).map(|i| 100 + (i * 7919) % 5000).collect();
    let pre = prepare(model, &ids, &VisionInput::default()).unwrap();
    let mut g = c.benchmark_group("dense");
    g.sample_size(10);
    g.bench_function("prefill_128_tokens", |b| b.iter(|| forward_logits(model, &pre, &mut DenseCache::new(), 1).unwrap()));
    g.bench_function("decode_16_tokens_after_128", |b| {
        b.iter(|| {
            let mut kv = DenseCache::new();
            forward_logits(model, &pre, &mut kv, 1).unwrap();
            for i in 0..16 {
                let step = decode_inputs(model, 7, ids.len() + i, pre.rope_delta).unwrap();
                forward_logits(model, &step, &mut kv, 1).unwrap();
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
