//! The block-quantized CPU kernels (`merg::cpu::blocks`) per format: decode (one activation
//! row against an output-head-sized weight, [131072, 2048], far larger than any L3 so the
//! bytes come from memory as in a model's decode step; weight bytes per second — compare with
//! `merg bench`'s triad roofline) and prefill (256 rows against a 3B model's MLP width,
//! [11008, 2048]; multiply-adds per second), with candle's f32 GEMM on the prefill shape in
//! the same run as the yardstick.
//! `MERG_CPU_KERNELS=avx2` forces the AVX2 level on an AVX-512 machine. With AVX-512 VNNI, Q6_K
//! Q6_K and Q8_0 are measured a second time in `cpu::q6_k`'s and `cpu::q8_0`'s panels (what a
//! model uses there) on the same bytes.
//!
//! The blocks are random bytes with sane f16 scales (`common::random_blocks`: quantizing 22M
//! values with candle would take longer than the measurement).

use candle_core::{Device, Tensor};
use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use merg::cpu::blocks::{Format, PackedBlocks};
use merg::cpu::q6_k::PackedQ6K;
use merg::cpu::q8_0::PackedQ8;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

const K: usize = 2048;

/// The prefill and decode weights' rows: the real shapes under `cargo bench`; a few rows when
/// `cargo test` runs this once unoptimised (no `--bench`), which only shows that it runs.
fn rows() -> (usize, usize) {
    if std::env::args().any(|a| a == "--bench") {
        (11008, 131072)
    } else {
        (256, 512)
    }
}

/// The decode weight and the prefill one in the file's blocks.
fn weights(f: Format, (n, n_decode): (usize, usize)) -> (PackedBlocks, PackedBlocks) {
    let bytes = common::random_blocks(f, n_decode, K);
    let pack = |n| PackedBlocks::pack(f, &bytes, n, K).expect("whole blocks");
    (pack(n_decode), pack(n))
}

fn bench(c: &mut Criterion) {
    if !merg::cpu::blocks::available() {
        eprintln!("no AVX2: nothing to measure");
        return;
    }
    let (n, n_decode) = rows();
    let mut rng = StdRng::seed_from_u64(1);
    let x: Vec<f32> = (0..256 * K).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0f32; (256 * n).max(n_decode)];
    let mut g = c.benchmark_group(format!("blocks_{}", merg::cpu::level().name()));
    g.sample_size(10);
    for f in [Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q4K, Format::Q5K, Format::Q6K] {
        decode_and_prefill(&mut g, &format!("{f:?}"), weights(f, (n, n_decode)), PackedBlocks::bytes, PackedBlocks::matmul, (&x, &mut out), n);
    }
    if merg::cpu::q6_k::available() {
        let bytes = common::random_blocks(Format::Q6K, n_decode, K);
        let pack = |rows| PackedQ6K::pack(&bytes, rows, K).expect("whole blocks");
        decode_and_prefill(&mut g, "Q6K_vnni", (pack(n_decode), pack(n)), PackedQ6K::bytes, PackedQ6K::matmul, (&x, &mut out), n);
    }
    if merg::cpu::q8_0::available() {
        let bytes = common::random_blocks(Format::Q8_0, n_decode, K);
        let pack = |rows| PackedQ8::pack(&bytes, rows, K).expect("whole blocks");
        decode_and_prefill(&mut g, "Q8_0_vnni", (pack(n_decode), pack(n)), PackedQ8::bytes, PackedQ8::matmul, (&x, &mut out), n);
    }
    let xt = Tensor::from_slice(&x, (256, K), &Device::Cpu).unwrap();
    let wt = Tensor::from_slice(&x[..K * 256], (256, K), &Device::Cpu).unwrap().repeat((n / 256, 1)).unwrap();
    g.throughput(Throughput::Elements((256 * (n / 256 * 256) * K) as u64));
    g.bench_function("f32_gemm_prefill256_macs", |b| b.iter(|| xt.matmul(&wt.t().unwrap()).unwrap()));
    g.finish();
}

/// `{name}_decode_bytes` (one row against `big`, weight bytes a second), then, with `big`
/// dropped, `{name}_prefill256_macs` (256 rows against `w`, `[n, K]`).
fn decode_and_prefill<W>(g: &mut BenchmarkGroup<WallTime>, name: &str, (big, w): (W, W), bytes: fn(&W) -> usize, matmul: fn(&W, &[f32], usize, &mut [f32]), (x, out): (&[f32], &mut [f32]), n: usize) {
    g.throughput(Throughput::Bytes(bytes(&big) as u64));
    g.bench_function(format!("{name}_decode_bytes"), |b| b.iter(|| matmul(&big, x, 1, out)));
    drop(big);
    g.throughput(Throughput::Elements((256 * n * K) as u64));
    g.bench_function(format!("{name}_prefill256_macs"), |b| b.iter(|| matmul(&w, x, 256, out)));
}

criterion_group!(benches, bench);
criterion_main!(benches);
