//! What the block-format benches share.

use merg::cpu::blocks::Format;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Random blocks of `f` for a `[n, k]` weight, with sane f16 scales (quantizing millions of
/// values with candle would take longer than the measurement); seeded by the format.
pub fn random_blocks(f: Format, n: usize, k: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(f as u64);
    let mut bytes: Vec<u8> = (0..n * k / f.values() * f.bytes()).map(|_| rng.random()).collect();
    // Offsets of a block's f16 scales (d, and dmin/m where the format has one).
    let scales: &[usize] = match f {
        Format::Q8_0 | Format::Q4_0 | Format::Q5_0 => &[0],
        Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K => &[0, 2],
        Format::Q6K => &[208],
    };
    for blk in bytes.chunks_exact_mut(f.bytes()) {
        for &at in scales {
            blk[at..at + 2].copy_from_slice(&half::f16::from_f32(rng.random_range(1e-3..1e-2)).to_le_bytes());
        }
    }
    bytes
}
