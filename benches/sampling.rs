//! The host sampler on a real vocabulary's row (151,936 logits, Qwen2's): greedy, and the
//! pipeline's default temperature 0.7 / top-p 0.9, with and without top-k. Seeded logits
//! shaped like a model's (a few likely tokens over a long tail).

use criterion::{criterion_group, criterion_main, Criterion};
use merg::generate::{Sampler, SamplingParams};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn row(vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..vocab).map(|_| rng.random::<f32>() * 8.0 - 4.0 + if rng.random::<f32>() < 1e-3 { 12.0 } else { 0.0 }).collect()
}

fn bench(c: &mut Criterion) {
    let logits = row(151_936, 7);
    let mut g = c.benchmark_group("sample_row_151936");
    for (name, p) in [
        ("greedy", SamplingParams::default()),
        ("t0.7_p0.9", SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() }),
        ("t0.7_p1.0", SamplingParams { temperature: 0.7, ..Default::default() }),
        ("t0.7_k40_p0.9", SamplingParams { temperature: 0.7, top_k: 40, top_p: 0.9, ..Default::default() }),
    ] {
        let mut s = Sampler::new(p);
        g.bench_function(name, |b| b.iter(|| s.sample_row(&logits, None).unwrap()));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
