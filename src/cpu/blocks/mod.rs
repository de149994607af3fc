//! Block-quantized weights (llama.cpp's block formats, the file's bits) and their AVX2
//! products with any number of activation rows: the kernels of every x86 machine with AVX2 +
//! FMA, and at the AVX-512 level of the formats its VNNI panels do not take
//! (`cpu::quant::kernel`). Zen 3 and most Intel client CPUs have no VNNI, so the integer dots
//! are `vpmaddubsw` + `vpmaddwd`. The activations are quantized once per product (`act`).
//! Every format is held eight rows interleaved, with one kernel for every count of activation
//! rows, so decode and prefill give a row the same numbers (the prefix cache relies on it):
//! Q4_K and Q5_K (`q4k8`: one widening multiply per sub-block for eight rows instead of one per
//! row), Q6_K (`q6k8`) and the 32-value formats (`rows8`: the file's blocks regrouped, eight
//! rows' dots scaled and summed as one vector; at the AVX-512 level with VNNI a 16-row panel's
//! two groups with their blocks alternating, one 512-bit pass for both). Products walk 16-row
//! panels across the thread team with `panels::run`, so a panel stays in the core's cache
//! while every activation row passes over it; `simd` holds the pieces the kernels share,
//! `kquants` the k-quants' packed sub-block scales.

pub mod act;
mod kquants;
mod q4k8;
mod q6k8;
mod rows8;
pub(crate) mod simd;

use candle_core::quantized::GgmlDType;

use super::panels::PANEL;
use act::{Q8, Q8K};

/// A block format these kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Format {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    const ALL: [Format; 8] = [Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1, Format::Q4K, Format::Q5K, Format::Q6K];

    pub fn of(dtype: GgmlDType) -> Option<Format> {
        Some(match dtype {
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4_0 => Format::Q4_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q5_0 => Format::Q5_0,
            GgmlDType::Q5_1 => Format::Q5_1,
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q5K => Format::Q5K,
            GgmlDType::Q6K => Format::Q6K,
            _ => return None,
        })
    }

    fn from_id(id: u8) -> Format {
        Format::ALL[id as usize]
    }

    /// Values per block.
    pub const fn values(self) -> usize {
        match self {
            Format::Q4K | Format::Q5K | Format::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block (ggml's `block_*` sizes).
    pub const fn bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q4K => 144,
            Format::Q5K => 176,
            Format::Q6K => 210,
        }
    }
}

/// Whether this machine runs these kernels at the level in use (AVX2, FMA and F16C).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::level() >= super::Level::Avx2 && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the 32-value 4/5-bit kernels (`rows8`) take 256-bit `vpdpbusd` and `vpternlogd`
/// (the AVX-512 level with VNNI, as `q8_0`'s panels, and VL and BW): the same exact integer
/// sums as `vpmaddubsw` + `vpmaddwd` and the AVX2 bit spreads, so the same bits at either
/// level.
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    super::q8_0::available() && std::is_x86_feature_detected!("avx512vl") && std::is_x86_feature_detected!("avx512bw")
}

/// Whether `format` is held as 16-row panels whose two groups' blocks alternate
/// (`rows8::interleave`): the 4/5-bit 32-value formats where `vnni()` holds, whose 512-bit pass
/// takes every activation row count, decode included.
fn paired(format: Format) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(format, Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1) && vnni()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = format;
        false
    }
}

/// Rows held as one unit (a part of `pack_groups`): a panel where `paired`, else a group.
/// Every part of a joined weight but the last must be whole units (`concat`).
fn unit_rows(format: Format) -> usize {
    if paired(format) {
        PANEL
    } else {
        GROUP_ROWS
    }
}

/// A weight `[n, k]` as groups of eight interleaved rows of one block format (`q4k8`, `q6k8`,
/// `rows8`: the file's blocks regrouped), on huge pages.
pub struct PackedBlocks {
    format: Format,
    n: usize,
    k: usize,
    data: super::arena::Huge<u8>,
}

/// Rows in a group of `q4k8`, `q6k8` and `rows8`.
pub const GROUP_ROWS: usize = q4k8::ROWS;
const _: () = assert!(rows8::ROWS == GROUP_ROWS && q6k8::ROWS == GROUP_ROWS);

impl std::fmt::Debug for PackedBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}] in {:?} blocks", self.n, self.k, self.format)
    }
}

impl PackedBlocks {
    /// `n` rows of `k` values from the file's blocks. `None` when `k` is not whole blocks or
    /// `blocks` is shorter than the shape says.
    pub fn pack(format: Format, blocks: &[u8], n: usize, k: usize) -> Option<PackedBlocks> {
        if !Self::whole_blocks(format, blocks, n, k) {
            return None;
        }
        let len = n * (k / format.values()) * format.bytes();
        Some(Self::pack_groups(format, n, k, |g, out| Self::pack_group(format, &blocks[..len], k, g, out)))
    }

    /// Whether `blocks` holds `n` rows of `k` values of `format` in whole blocks (at least).
    pub fn whole_blocks(format: Format, blocks: &[u8], n: usize, k: usize) -> bool {
        k > 0 && k.is_multiple_of(format.values()) && blocks.len() >= n * (k / format.values()) * format.bytes()
    }

    /// Group `g` (rows `8g..`) of the file's rows of `format` in `blocks` (whole rows of `k`
    /// values) into `out`, as this level holds it.
    pub fn pack_group(format: Format, blocks: &[u8], k: usize, g: usize, out: &mut [u8]) {
        let nb = k / format.values();
        let n = blocks.len() / (nb * format.bytes()).max(1);
        match format {
            Format::Q4K | Format::Q5K => q4k8::pack_group(format == Format::Q5K, blocks, n, nb, g, out),
            Format::Q6K => q6k8::pack_group(blocks, n, nb, g, out),
            _ => rows8::pack_group(format, blocks, n, nb, g, out),
        }
    }

    /// A grouped weight from `group(g, out)`, which writes group `g` as `pack_group` does: one
    /// part per group (per panel where `paired`), written by the worker that packs it; a
    /// mapped source's rows behind each band are released as it goes (`pages::copied`).
    pub fn pack_groups(format: Format, n: usize, k: usize, group: impl Fn(usize, &mut [u8]) + Sync) -> PackedBlocks {
        let unit = unit_rows(format);
        let part = Self::held_bytes(format, unit, k);
        let band = (super::pages::BAND_BYTES / part).max(1);
        let fill = |i: usize, out: &mut [u8]| match unit {
            PANEL => Self::panel_into(format, n, k, i, out, &group),
            _ => group(i, out),
        };
        let data = super::pages::weight_filled(Self::held_bytes(format, n, k), part, band, 0u8, fill, |done| super::pages::copied((done * unit).min(n), n));
        PackedBlocks { format, n, k, data }
    }

    /// Panel `p`'s groups (those with rows below `n`) from `group` into `out` (zeros) as this
    /// level holds them: one after the other, or interleaved where `paired`.
    fn panel_into(format: Format, n: usize, k: usize, p: usize, out: &mut [u8], group: &(impl Fn(usize, &mut [u8]) + Sync)) {
        let gb = Self::group_bytes(format, k);
        let paired = paired(format);
        let mut staged = if paired { vec![0u8; PANEL / GROUP_ROWS * gb] } else { vec![] };
        let groups = if paired { &mut staged[..] } else { &mut *out };
        for (h, g) in groups.chunks_exact_mut(gb).take(PANEL / GROUP_ROWS).enumerate() {
            if (p * PANEL / GROUP_ROWS + h) * GROUP_ROWS < n {
                group(p * PANEL / GROUP_ROWS + h, g);
            }
        }
        if paired {
            rows8::interleave(format, k, &staged, out);
        }
    }

    /// `pack_groups(format, n, k, group).matmul(x, m, out)` without the packed copy, the same
    /// bits: each 16-row panel's two groups are staged as the product reaches them
    /// (`panels::Staged`). For a weight still in its file. Call only when `available()`.
    pub fn matmul_staged(format: Format, n: usize, k: usize, group: impl Fn(usize, &mut [u8]) + Sync, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedBlocks::matmul_staged needs AVX2, FMA and F16C");
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedBlocks::matmul_staged: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        let gb = Self::group_bytes(format, k);
        let per_panel = (PANEL / GROUP_ROWS * gb).div_ceil(64);
        let staged = super::panels::Staged::new(per_panel, |p, lines: &mut [super::panels::Line]| {
            // SAFETY: a Line is 64 plain bytes; the lines hold `per_panel · 64` bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut u8, lines.len() * 64) };
            let held = &mut bytes[..PANEL / GROUP_ROWS * gb];
            held.fill(0);
            Self::panel_into(format, n, k, p, held, &group);
        });
        grouped_product(format, n, k, x, m, out, |p, f| {
            staged.with(p, |lines| {
                // SAFETY: as above, read-only.
                f(unsafe { std::slice::from_raw_parts(lines.as_ptr() as *const u8, lines.len() * 64) })
            })
        });
    }

    /// Bytes an `[n, k]` weight of `format` is held in at this level: whole units
    /// (`unit_rows`), the last padded with zero rows.
    pub fn held_bytes(format: Format, n: usize, k: usize) -> usize {
        let unit = unit_rows(format);
        n.div_ceil(unit) * (unit / GROUP_ROWS) * Self::group_bytes(format, k)
    }

    /// Bytes of one group of eight rows of `k` values (half a panel where `paired`).
    fn group_bytes(format: Format, k: usize) -> usize {
        match format {
            Format::Q4K | Format::Q5K => q4k8::bytes(format == Format::Q5K, GROUP_ROWS, k),
            Format::Q6K => q6k8::bytes(GROUP_ROWS, k),
            f => rows8::group_bytes(f, k),
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// Bytes held: the blocks' (Q4_K: 1184 for every 1152 of the file, Q5_K 1440 for 1408,
    /// `q4k8`; groups of eight rows padded).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The parts' rows one after another (q/k/v, gate/up); `None` unless they share the
    /// format and `k` and every part but the last is whole groups (`unit_rows`).
    pub fn concat(parts: &[&PackedBlocks]) -> Option<PackedBlocks> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.k != first.k) {
            return None;
        }
        if parts[..parts.len() - 1].iter().any(|p| !p.n.is_multiple_of(unit_rows(first.format))) {
            return None;
        }
        let data = super::pages::weight_concat(&parts.iter().map(|p| &*p.data).collect::<Vec<_>>());
        Some(PackedBlocks { format: first.format, n: parts.iter().map(|p| p.n).sum(), k: first.k, data })
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedBlocks::matmul needs AVX2, FMA and F16C");
        let (n, k) = (self.n, self.k);
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedBlocks::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        let gb = Self::group_bytes(self.format, k);
        grouped_product(self.format, n, k, x, m, out, |p, f| f(&self.data[p * PANEL / GROUP_ROWS * gb..]));
    }
}

/// `$row::<F, rows>($args…)` for the format `$f` names, with `rows` (1–4) as a constant, for
/// each listed format (the last one also takes any other).
#[cfg(target_arch = "x86_64")]
macro_rules! by_format_and_rows {
    ($($row:ident)::+, $f:expr, $rows:expr, ($($arg:expr),*), [$($fmt:ident),*], $last:ident) => {{
        macro_rules! go {
            ($F:ident) => {{
                const F: u8 = Format::$F as u8;
                match $rows {
                    1 => $($row)::+::<F, 1>($($arg),*),
                    2 => $($row)::+::<F, 2>($($arg),*),
                    3 => $($row)::+::<F, 3>($($arg),*),
                    _ => $($row)::+::<F, 4>($($arg),*),
                }
            }};
        }
        match $f {
            $(Format::$fmt => go!($fmt),)*
            _ => go!($last),
        }
    }};
}

/// A 32-value format's group (`rows8`) against `rows` (1–4) activation rows from `r0`.
fn rows8_pass(f: Format, w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], rows: usize) {
    #[cfg(target_arch = "x86_64")]
    by_format_and_rows!(rows8::rows, f, rows, (w, nb, a, r0, out, PANEL), [Q8_0, Q4_0, Q4_1, Q5_0], Q5_1);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (f, w, nb, a, r0, out, rows);
}

/// The product: Q4_K and Q5_K in `q4k8`'s groups, Q6_K in `q6k8`'s, a 32-value format in
/// `rows8`'s; `panel(p, f)` hands `f` the bytes of 16-row panel `p`'s groups.
fn grouped_product(format: Format, n: usize, k: usize, x: &[f32], m: usize, out: &mut [f32], panel: impl Fn(usize, &mut dyn FnMut(&[u8])) + Sync) {
    let nb = k / format.values();
    if matches!(format, Format::Q4K | Format::Q5K | Format::Q6K) {
        let (q6, q5) = (format == Format::Q6K, format == Format::Q5K);
        let a = Q8K::quantize(x, m, k);
        return groups(format, n, k, m, out, panel, None, |w, r0, o, rows| {
            #[cfg(target_arch = "x86_64")]
            macro_rules! pass {
                ($kernel:ident $(, $five:literal)?) => {
                    match rows {
                        1 => $kernel::rows::<$($five,)? 1>(w, nb, &a, r0, o, PANEL),
                        2 => $kernel::rows::<$($five,)? 2>(w, nb, &a, r0, o, PANEL),
                        3 => $kernel::rows::<$($five,)? 3>(w, nb, &a, r0, o, PANEL),
                        _ => $kernel::rows::<$($five,)? 4>(w, nb, &a, r0, o, PANEL),
                    }
                };
            }
            #[cfg(target_arch = "x86_64")]
            if q6 {
                pass!(q6k8)
            } else if q5 {
                pass!(q4k8, true)
            } else {
                pass!(q4k8, false)
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (w, nb, &a, r0, o, rows, q6, q5);
        });
    }
    let a = Q8::quantize(x, m, k);
    // The 4/5-bit formats at the AVX-512 level: a whole interleaved panel a pass
    // (`rows8::panel`), every activation row count. On a Zen 5 VM, 512-bit passes over a
    // panel's two groups ran 1.3-1.6× the eight-row kernel's rate at 8 rows and 256 rows; for
    // one row, with the groups held one after the other (two streams), a 0.5B Q4_K_M file
    // decoded at 0.94× the eight-row kernel's rate.
    let panel_pass = |w: *const u8, r0: usize, o: &mut [f32], rows: usize| {
        #[cfg(target_arch = "x86_64")]
        rows8::panel(format, w, nb, &a, r0, o, PANEL, rows);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (w, r0, o, rows);
    };
    let wide: Option<PanelPass> = if paired(format) { Some(&panel_pass) } else { None };
    groups(format, n, k, m, out, panel, wide, |w, r0, o, rows| rows8_pass(format, w, nb, &a, r0, o, rows));
}

/// A pass over an interleaved panel (`paired`): `(panel, first_row, out, rows)`, for all of a
/// pass's rows (at most `panels::PASS_ROWS`).
type PanelPass<'a> = &'a (dyn Fn(*const u8, usize, &mut [f32], usize) + Sync);

/// The groups of eight interleaved rows: the two groups of each 16-row panel against the
/// activation rows of a pass, four at a time; `pass(group, first_row, out, rows)` writes
/// `out[r * 16 + lane]` for the group's eight rows; `wide`, where given, takes each whole
/// (interleaved) panel instead.
#[allow(clippy::too_many_arguments)]
fn groups(format: Format, n: usize, k: usize, m: usize, out: &mut [f32], panel: impl Fn(usize, &mut dyn FnMut(&[u8])) + Sync, wide: Option<PanelPass>, pass: impl Fn(*const u8, usize, &mut [f32], usize) + Sync) {
    let group_bytes = PackedBlocks::group_bytes(format, k);
    super::panels::run(n, m, out, |p, g, mg, res| {
        panel(p, &mut |bytes| {
            if let Some(wide) = wide {
                return wide(bytes[..2 * group_bytes].as_ptr(), g, res, mg);
            }
            for h in 0..PANEL / GROUP_ROWS {
                if (p * PANEL / GROUP_ROWS + h) * GROUP_ROWS >= n {
                    break;
                }
                let w = bytes[h * group_bytes..][..group_bytes].as_ptr();
                for r in (0..mg).step_by(4) {
                    pass(w, g + r, &mut res[r * PANEL + h * GROUP_ROWS..], (mg - r).min(4));
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::packed_matches_candle;

    /// Every format against candle's own quantized matmul (which quantizes the activations
    /// the same way): rows that are not whole 16-row groups, 1 to 40 activation rows (every
    /// remainder of the four-row passes), one and several blocks per row.
    #[test]
    fn every_format_matches_candle() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX2: candle's kernels run instead");
            return Ok(());
        }
        let dtypes = [GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];
        for dtype in dtypes {
            let f = Format::of(dtype).expect("a format");
            // candle's Q4_1, Q5_0 and Q5_1 references take an even number of blocks (a debug
            // assertion); Q4_0, Q8_0 and the k-quants keep the odd counts (the kernels' tail).
            let even = matches!(f, Format::Q4_1 | Format::Q5_0 | Format::Q5_1);
            let k = |blocks: usize| blocks * f.values() * if even { 2 } else { 1 };
            let shapes = [(1, k(1), 37), (1, k(3), 21), (1, k(4), 130), (2, k(2), 16), (3, k(1), 20), (5, k(3), 9), (8, k(2), 17), (13, k(3), 18), (40, k(2), 33)];
            packed_matches_candle(dtype, &shapes, |b, n, k| PackedBlocks::pack(f, b, n, k), PackedBlocks::bytes, |n, k| PackedBlocks::held_bytes(f, n, k), PackedBlocks::matmul)?;
        }
        Ok(())
    }

    /// A row's numbers do not depend on the activation rows beside it (1 to 13 rows, bit for
    /// bit: decode and prefill agree, which the prefix cache needs), and joined weights (q/k/v)
    /// give each part's numbers; in groups of eight rows a part that is not whole groups is
    /// not joined.
    #[test]
    fn rows_are_batch_invariant_and_join() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n) = (512, 40);
        for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let f = Format::of(dtype).expect("a format");
            let (x, blocks, _) = crate::cpu::testing::quantized_case(dtype, 13, k, n)?;
            let w = PackedBlocks::pack(f, &blocks, n, k).expect("whole blocks");
            let mut all = vec![0f32; 13 * n];
            w.matmul(&x, 13, &mut all);
            for m in [1, 2, 5, 8, 9] {
                let mut some = vec![0f32; m * n];
                w.matmul(&x, m, &mut some);
                assert_eq!(some, all[..m * n], "{f:?}: {m} rows");
            }
            let row_bytes = k / f.values() * f.bytes();
            let (a, b) = (PackedBlocks::pack(f, &blocks, 16, k).unwrap(), PackedBlocks::pack(f, &blocks[16 * row_bytes..], 24, k).unwrap());
            let joined = PackedBlocks::concat(&[&a, &b]).expect("whole groups");
            let mut got = vec![0f32; 13 * n];
            joined.matmul(&x, 13, &mut got);
            assert_eq!(got, all, "{f:?} joined");
            let odd = PackedBlocks::pack(f, &blocks, 5, k).unwrap();
            assert!(PackedBlocks::concat(&[&odd, &b]).is_none(), "{f:?}");
            // Interleaved panels join only as whole panels.
            let eight = PackedBlocks::pack(f, &blocks, 8, k).unwrap();
            assert_eq!(PackedBlocks::concat(&[&eight, &b]).is_some(), unit_rows(f) == GROUP_ROWS, "{f:?}");
        }
        Ok(())
    }

    /// A grouped weight staged from the file's rows as the product goes gives the packed
    /// copy's bits: decode and prefill row counts, a last panel of one group and a last group
    /// of fewer than eight rows.
    #[test]
    fn staged_groups_give_the_packed_bits() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let k = 512;
        for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let f = Format::of(dtype).expect("a format");
            for n in [40, 45] {
                let (x, blocks, _) = crate::cpu::testing::quantized_case(dtype, 20, k, n)?;
                let group = |g: usize, out: &mut [u8]| PackedBlocks::pack_group(f, &blocks, k, g, out);
                let packed = PackedBlocks::pack_groups(f, n, k, group);
                for m in [1, 3, 9, 20] {
                    let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
                    packed.matmul(&x, m, &mut want);
                    PackedBlocks::matmul_staged(f, n, k, group, &x, m, &mut got);
                    assert_eq!(got, want, "{f:?}, {n} rows, {m} activation rows");
                }
            }
        }
        Ok(())
    }

    /// The word-wise scale unpacking equals ggml's one-at-a-time reading (`q4_k::scale_min`).
    #[test]
    fn scales_mins_equal_ggml_reading() {
        for seed in 0..256u32 {
            let q: Vec<u8> = (0..12u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(40_503)) >> 11) as u8).collect();
            let (sc, m) = kquants::scales_mins(&q);
            for j in 0..8 {
                assert_eq!((sc[j], m[j]), crate::cpu::q4_k::scale_min(j, &q), "seed {seed} sub-block {j}");
            }
        }
    }

    /// Rows that are not whole blocks, or too few bytes, are refused rather than misread.
    #[test]
    fn refuses_partial_blocks() {
        assert!(PackedBlocks::pack(Format::Q4_0, &[0u8; 18 * 4], 2, 48).is_none());
        assert!(PackedBlocks::pack(Format::Q6K, &[0u8; 210 * 3], 2, 512).is_none());
        assert!(PackedBlocks::pack(Format::Q6K, &[0u8; 210 * 4], 2, 512).is_some());
    }
}
