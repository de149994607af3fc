//! Each decode kernel (one activation row) against the bandwidth of its own moment: products
//! over a weight far larger than any L3 ([131072, 2048]; the 0.5B shape's Q8_0 output head,
//! [151936, 896], too), each between two STREAM triad passes (`cpu::roofline::paired`), the
//! median share of the passes either side and its quartiles. On a shared host whose triad
//! moves by half within minutes this is the figure that holds (a share against a triad taken
//! seconds earlier can read anywhere from 50 to 120 %); each line names the median triad it
//! was set against. What runs is what a model uses at this level (`MERG_CPU_KERNELS=avx2`
//! forces the AVX2 one): the VNNI panels for Q8_0, Q4_K and Q6_K and the f32 / bf16 panels
//! where the machine has them, the block kernels (`cpu::blocks`) for every block format; and a
//! 0.5B Q4_K_M decode step's products back to back (`step_products`).

use candle_core::quantized::GgmlDType;
use half::bf16;
use merg::cpu::blocks::{Format, PackedBlocks};
use merg::cpu::quant::Kernel;
use merg::cpu::{bf16::PackedBf16, fp32::PackedF32, q4_k::PackedQ4K, q6_k::PackedQ6K, q8_0::PackedQ8};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;

/// `[n, k]` of the weights, and products per figure: the real sizes under `cargo bench`; a
/// few rows and steps when `cargo test` runs this once unoptimised, which only shows it runs.
fn sizes() -> (usize, usize, usize) {
    match std::env::args().any(|a| a == "--bench") {
        true => (131072, 2048, 24),
        false => (512, 2048, 2),
    }
}

/// Runs `product` `steps` times between triad passes and prints the line.
fn measure(name: &str, bytes: usize, steps: usize, mut product: impl FnMut()) {
    let p = merg::cpu::roofline::paired(steps, |_| -> Result<f64, ()> {
        product();
        Ok(bytes as f64)
    })
    .expect("a product cannot fail");
    println!(
        "{name:<28} {:6.1} % of the triad (quartiles {:5.1}-{:5.1} %, triad median {:5.1} GB/s, {:.0} MiB, cores' round trip {:.0}/{:.0} ns)",
        p.median_pct,
        p.quartile_pcts[0],
        p.quartile_pcts[1],
        p.triad_median_gbs,
        bytes as f64 / (1u64 << 20) as f64,
        p.core_round_trip_ns[0],
        p.core_round_trip_ns[1]
    );
}

fn main() {
    let (n, k, steps) = sizes();
    println!("decode products against triad passes either side, {} threads, {} kernels", rayon::current_num_threads(), merg::cpu::level().name());
    let mut rng = StdRng::seed_from_u64(1);
    let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut out = vec![0f32; n.max(151936)];
    if merg::cpu::q8_0::available() {
        let w = PackedQ8::pack(&common::random_blocks(Format::Q8_0, n, k), n, k).expect("whole blocks");
        measure("Q8_0 VNNI panels", w.bytes(), steps, || w.matmul(&x, 1, &mut out));
        let head = if n > 4096 { 151936 } else { n };
        let w = PackedQ8::pack(&common::random_blocks(Format::Q8_0, head, 896), head, 896).expect("whole blocks");
        measure("Q8_0 VNNI panels, k 896", w.bytes(), steps, || w.matmul(&x[..896], 1, &mut out));
        let w = PackedQ4K::pack(&common::random_blocks(Format::Q4K, n, k), n, k).expect("whole blocks");
        measure("Q4_K VNNI panels", w.bytes(), steps, || w.matmul(&x, 1, &mut out));
    }
    if merg::cpu::q6_k::available() {
        let w = PackedQ6K::pack(&common::random_blocks(Format::Q6K, n, k), n, k).expect("whole blocks");
        measure("Q6_K VNNI panels", w.bytes(), steps, || w.matmul(&x, 1, &mut out));
    }
    // The dense panels at half the rows: an f32 [131072, 2048] would be 1 GiB.
    if merg::cpu::bf16::available() {
        let w: Vec<bf16> = (0..n / 2 * k).map(|i| bf16::from_f32((i % 97) as f32 * 1e-3)).collect();
        let p = PackedBf16::pack(&w, n / 2, k);
        drop(w);
        measure("bf16 panels", p.bytes(), steps, || p.matmul(&xb, 1, &mut out[..n / 2]));
    }
    if merg::cpu::fp32::available() {
        let w: Vec<f32> = (0..n / 2 * k).map(|i| (i % 97) as f32 * 1e-3).collect();
        let p = PackedF32::pack(&w, n / 2, k);
        drop(w);
        measure("f32 panels", p.bytes(), steps, || p.matmul(&x, 1, &mut out[..n / 2]));
    }
    if !merg::cpu::blocks::available() {
        println!("no AVX2: the block formats run on candle's kernels");
        return;
    }
    for f in [Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q4K, Format::Q5K, Format::Q6K] {
        let w = PackedBlocks::pack(f, &common::random_blocks(f, n, k), n, k).expect("whole blocks");
        measure(&format!("{f:?} block kernel"), w.bytes(), steps, || w.matmul(&x, 1, &mut out));
    }
    step_products(n > 4096, steps);
}

/// A decode step's products as the 0.5B shape's Q4_K_M file has them, at this level's kernels
/// (per layer q/k Q5_0 [1024, 896], v Q8_0 [128, 896], o Q5_0 [896, 896], gate/up Q5_0
/// [9728, 896], down Q6_K and Q4_K in turn [896, 4864]; the Q8_0 head [151936, 896]) back to
/// back with nothing between them: the model's step less its one-thread work, so the two set
/// side by side (`merg bench`'s paired share) show what the work between products costs and
/// what 120 short products cost on their own (without the head). `real`: 24 layers, else one
/// and a short head (`cargo test`).
fn step_products(real: bool, steps: usize) {
    if !merg::cpu::blocks::available() {
        return;
    }
    type Product = Box<dyn Fn(&[f32], &mut [f32])>;
    // The kernel a model's weight of this type takes at this level (`cpu::quant::kernel`).
    fn packed(dtype: GgmlDType, n: usize, k: usize) -> (usize, Product) {
        let f = Format::of(dtype).expect("a block format");
        let blocks = common::random_blocks(f, n, k);
        match (merg::cpu::quant::kernel(dtype), dtype) {
            (Some(Kernel::Vnni), GgmlDType::Q8_0) => boxed(PackedQ8::pack(&blocks, n, k).expect("whole blocks"), PackedQ8::bytes, PackedQ8::matmul),
            (Some(Kernel::Vnni), GgmlDType::Q4K) => boxed(PackedQ4K::pack(&blocks, n, k).expect("whole blocks"), PackedQ4K::bytes, PackedQ4K::matmul),
            (Some(Kernel::Vnni), GgmlDType::Q6K) => boxed(PackedQ6K::pack(&blocks, n, k).expect("whole blocks"), PackedQ6K::bytes, PackedQ6K::matmul),
            _ => boxed(PackedBlocks::pack(f, &blocks, n, k).expect("whole blocks"), PackedBlocks::bytes, PackedBlocks::matmul),
        }
    }
    fn boxed<W: 'static>(w: W, bytes: fn(&W) -> usize, matmul: fn(&W, &[f32], usize, &mut [f32])) -> (usize, Product) {
        (bytes(&w), Box::new(move |x, out| matmul(&w, x, 1, out)))
    }
    let (layers, head) = if real { (24, 151936) } else { (1, 512) };
    let mut products = vec![];
    for l in 0..layers {
        let down = if l % 2 == 0 { GgmlDType::Q6K } else { GgmlDType::Q4K };
        for (dtype, n, k) in [(GgmlDType::Q5_0, 1024, 896), (GgmlDType::Q8_0, 128, 896), (GgmlDType::Q5_0, 896, 896), (GgmlDType::Q5_0, 9728, 896), (down, 896, 4864)] {
            products.push((k, packed(dtype, n, k)));
        }
    }
    let mut rng = StdRng::seed_from_u64(2);
    let x: Vec<f32> = (0..4864).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0f32; head.max(9728)];
    let mut run = |name: &str, all: &[(usize, (usize, Product))]| {
        let bytes = all.iter().map(|(_, (b, _))| b).sum();
        measure(name, bytes, steps, || all.iter().for_each(|(k, (_, p))| p(&x[..*k], &mut out)));
    };
    run(&format!("0.5B step less head, {}", products.len()), &products);
    products.push((896, packed(GgmlDType::Q8_0, head, 896)));
    run(&format!("0.5B step, {} products", products.len()), &products);
}
