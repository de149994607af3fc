//! The block-quantized CPU kernels (`merg::cpu::blocks`) on one weight of a 3B model's MLP
//! width ([11008, 2048]) per format: decode (one activation row, weight bytes per second —
//! compare with `merg bench`'s triad roofline) and prefill (256 rows, multiply-adds per
//! second), with candle's f32 GEMM on the same shape in the same run as the yardstick.
//! `MERG_CPU_KERNELS=avx2` forces the AVX2 level on an AVX-512 machine.
//!
//! The blocks are random bytes with sane f16 scales (quantizing 22M values with candle would
//! take longer than the measurement).

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use merg::cpu::blocks::{Format, PackedBlocks};
use rand::{rngs::StdRng, Rng, SeedableRng};

const N: usize = 11008;
const K: usize = 2048;

/// Offsets of a block's f16 scales (d, and dmin/m where the format has one).
fn scale_offsets(f: Format) -> &'static [usize] {
    match f {
        Format::Q8_0 | Format::Q4_0 | Format::Q5_0 => &[0],
        Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K => &[0, 2],
        Format::Q6K => &[208],
    }
}

fn weight(f: Format) -> PackedBlocks {
    let mut rng = StdRng::seed_from_u64(f as u64);
    let mut bytes: Vec<u8> = (0..N * K / f.values() * f.bytes()).map(|_| rng.random()).collect();
    for blk in bytes.chunks_exact_mut(f.bytes()) {
        for &at in scale_offsets(f) {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.random_range(1e-3..1e-2)).to_le_bytes());
        }
    }
    PackedBlocks::pack(f, &bytes, N, K).expect("whole blocks")
}

fn bench(c: &mut Criterion) {
    if !merg::cpu::blocks::available() {
        eprintln!("no AVX2: nothing to measure");
        return;
    }
    let mut rng = StdRng::seed_from_u64(1);
    let x: Vec<f32> = (0..256 * K).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0f32; 256 * N];
    let mut g = c.benchmark_group(format!("blocks_{}", merg::cpu::level().name()));
    g.sample_size(10);
    for f in [Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q4K, Format::Q5K, Format::Q6K] {
        let w = weight(f);
        g.throughput(Throughput::Bytes(w.bytes() as u64));
        g.bench_function(format!("{f:?}_decode_bytes"), |b| b.iter(|| w.matmul(&x, 1, &mut out)));
        g.throughput(Throughput::Elements((256 * N * K) as u64));
        g.bench_function(format!("{f:?}_prefill256_macs"), |b| b.iter(|| w.matmul(&x, 256, &mut out)));
    }
    let xt = Tensor::from_slice(&x, (256, K), &Device::Cpu).unwrap();
    let wt = Tensor::from_slice(&x[..K * 256], (256, K), &Device::Cpu).unwrap().repeat((N / 256, 1)).unwrap();
    g.throughput(Throughput::Elements((256 * (N / 256 * 256) * K) as u64));
    g.bench_function("f32_gemm_prefill256_macs", |b| b.iter(|| xt.matmul(&wt.t().unwrap()).unwrap()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
