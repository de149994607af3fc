//! The storage and driver shared by the packed-weight kernels (`bf16`, `q8_0`, `q4_k`): a weight
//! `[n, k]` is stored as panels of 16 rows, each panel one contiguous run of 64-byte lines whose
//! 32-bit lane `r` belongs to the panel's row `r`. A product `x[m, k] · wᵀ` walks the panels
//! across the thread team (`team`) — one contiguous share of panels per thread at batch 1, so
//! each core streams one sequential range that the hardware prefetchers follow, the thread
//! done first taking runs off the other's tail (`team::split`) — and within a panel takes the
//! activation rows eight at a time, so a panel (tens of KiB) is read from memory once and
//! re-read from the core's cache for the other rows: the same code is decode (m = 1),
//! batched decode and prefill.

/// Weight rows per panel (the 32-bit lanes of a 512-bit register).
pub const PANEL: usize = 16;
/// Activation rows one pass over a panel handles.
pub const PASS_ROWS: usize = 8;
/// Activation rows taken through a task's panels at a time (whole passes).
pub(crate) const ROW_BLOCK: usize = 8 * PASS_ROWS;

/// `$rows::<M, 2>($args…)` with `M = $mg` (1 to `PASS_ROWS`) as a constant: the panel kernels'
/// dispatch on the number of activation rows. The two accumulator chains are the same for
/// every `M`, so a row's sums are added in one order whatever else shares its step.
macro_rules! panel_rows {
    ($rows:ident, $mg:expr, ($($arg:expr),*)) => {
        match $mg {
            1 => $rows::<1, 2>($($arg),*),
            2 => $rows::<2, 2>($($arg),*),
            3 => $rows::<3, 2>($($arg),*),
            4 => $rows::<4, 2>($($arg),*),
            5 => $rows::<5, 2>($($arg),*),
            6 => $rows::<6, 2>($($arg),*),
            7 => $rows::<7, 2>($($arg),*),
            _ => $rows::<{ $crate::cpu::panels::PASS_ROWS }, 2>($($arg),*),
        }
    };
}
pub(crate) use panel_rows;

/// `rows`, `cols`, `bytes` and `concat` of a packed weight that is a newtype over `Panels` (every
/// panel format has the same four).
macro_rules! panel_weight {
    ($t:ident) => {
        impl $t {
            pub fn rows(&self) -> usize {
                self.0.n
            }

            pub fn cols(&self) -> usize {
                self.0.k
            }

            /// Bytes held.
            pub fn bytes(&self) -> usize {
                self.0.bytes()
            }

            /// The parts' rows one after another (q/k/v, gate/up); `None` unless they share `k`
            /// and every part is whole panels.
            pub fn concat(parts: &[&$t]) -> Option<$t> {
                $crate::cpu::panels::Panels::concat(&parts.iter().map(|p| &p.0).collect::<Vec<_>>()).map($t)
            }
        }
    };
}
pub(crate) use panel_weight;

/// A 64-byte line, aligned as the cache is.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Line(pub [u8; 64]);

/// Lines as their sixteen 32-bit lanes (lane `r` holds row `r`'s bytes, little-endian), so a
/// packer writes a row's four bytes with one store instead of four checked byte copies.
pub fn lanes(l: &mut [Line]) -> &mut [[u32; 16]] {
    // SAFETY: a Line is 64 bytes, 64-aligned, any bit pattern valid; [u32; 16] is 64 bytes with
    // weaker alignment, so the cast keeps length and alignment.
    unsafe { std::slice::from_raw_parts_mut(l.as_mut_ptr() as *mut [u32; 16], l.len()) }
}

/// A weight `[n, k]` as panels of 16 rows, each `per_panel` lines, on huge pages (what every
/// packed format shares; the format decides what a panel's lines hold).
pub struct Panels {
    pub n: usize,
    pub k: usize,
    per_panel: usize,
    lines: super::arena::Huge<Line>,
}

impl Panels {
    /// `pack(p, lines)` fills panel `p`'s lines (pre-filled with `fill`), panels in parallel:
    /// each worker fills and packs its panels, so the fresh pages are first touched there too.
    pub fn new(n: usize, k: usize, per_panel: usize, fill: Line, pack: impl Fn(usize, &mut [Line]) + Sync) -> Panels {
        // In bands, so a mapped source can be released behind the copy (`pages::releasing`).
        let pp = per_panel.max(1);
        let band = (super::pages::BAND_BYTES / (pp * 64)).max(1);
        let lines = super::pages::weight_filled(n.div_ceil(PANEL) * per_panel, pp, band, fill, pack, |done| super::pages::copied((done * PANEL).min(n), n));
        Panels { n, k, per_panel, lines }
    }

    /// The parts' rows one after another, as one weight (q/k/v, gate/up); `None` unless they
    /// share `k` and every part is whole panels.
    pub fn concat(parts: &[&Panels]) -> Option<Panels> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.k != first.k || p.per_panel != first.per_panel || p.n % PANEL != 0) {
            return None;
        }
        let lines = super::pages::weight_concat(&parts.iter().map(|p| &*p.lines).collect::<Vec<_>>());
        Some(Panels { n: parts.iter().map(|p| p.n).sum(), k: first.k, per_panel: first.per_panel, lines })
    }

    /// Panel `p`'s lines.
    pub fn panel(&self, p: usize) -> &[Line] {
        &self.lines[p * self.per_panel..(p + 1) * self.per_panel]
    }

    pub fn bytes(&self) -> usize {
        self.lines.len() * 64
    }

    /// Lines per panel (what a format's panel holds, per `k`).
    pub fn per_panel(&self) -> usize {
        self.per_panel
    }
}

/// Fills `lines` (one per 32-bit word of a row) so that lane `r` of line `i` holds word `i` of
/// `rows[r]` (little-endian; lanes of rows past `rows.len()` zero): the transpose that the
/// layouts of plain values are (an f32 per lane, a bf16 pair per lane). Every byte of `lines`
/// is written. Each row must hold at least `4 · lines.len()` bytes.
pub fn transpose_words(rows: &[&[u8]], lines: &mut [Line]) {
    assert!(rows.len() <= PANEL && rows.iter().all(|r| r.len() >= 4 * lines.len()), "transpose_words: short rows");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::level() >= super::Level::Avx2 {
        // SAFETY: the level means avx2 was detected; the rows were checked above.
        done = unsafe { avx2::transpose(rows, lines) };
    }
    let lanes = lanes(&mut lines[done..]);
    for r in 0..PANEL {
        let row = rows.get(r).map(|b| &b[4 * done..]);
        for (i, line) in lanes.iter_mut().enumerate() {
            line[r] = row.map_or(0, |b| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])).to_le();
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{Line, PANEL};
    use std::arch::x86_64::*;

    /// `transpose_words` for the first multiple of eight words, eight rows by eight words at a
    /// time (three rounds of shuffles); returns the words done.
    #[target_feature(enable = "avx2")]
    pub unsafe fn transpose(rows: &[&[u8]], lines: &mut [Line]) -> usize {
        let words = lines.len() / 8 * 8;
        let out = lines.as_mut_ptr() as *mut f32;
        for h in 0..PANEL / 8 {
            let rs = &rows[(8 * h).min(rows.len())..(8 * h + 8).min(rows.len())];
            for i in (0..words).step_by(8) {
                let v: [__m256; 8] = std::array::from_fn(|j| match rs.get(j) {
                    Some(r) => _mm256_loadu_ps(r.as_ptr().add(4 * i) as *const f32),
                    None => _mm256_setzero_ps(),
                });
                for (j, t) in transpose8(v).into_iter().enumerate() {
                    _mm256_store_ps(out.add((i + j) * PANEL + 8 * h), t);
                }
            }
        }
        words
    }

    /// Rows of eight 32-bit words to columns (bit patterns kept: shuffles only); also packs
    /// `blocks::rows8`'s Q8_0 groups.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
        let t = [
            _mm256_unpacklo_ps(v[0], v[1]),
            _mm256_unpackhi_ps(v[0], v[1]),
            _mm256_unpacklo_ps(v[2], v[3]),
            _mm256_unpackhi_ps(v[2], v[3]),
            _mm256_unpacklo_ps(v[4], v[5]),
            _mm256_unpackhi_ps(v[4], v[5]),
            _mm256_unpacklo_ps(v[6], v[7]),
            _mm256_unpackhi_ps(v[6], v[7]),
        ];
        let u = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xee>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xee>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xee>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xee>(t[5], t[7]),
        ];
        [
            _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
            _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
            _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
            _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
            _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
            _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
            _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
            _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
        ]
    }
}

/// A slice of plain values as its bytes.
pub fn as_bytes<T: candle_core::WithDType>(v: &[T]) -> &[u8] {
    // SAFETY: every WithDType (u8, u32, i64, f16, bf16, f32, f64) is plain data without padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// A weight not yet in panels, read where it lies (a mapped file): `stage(p, lines)` writes
/// every byte of panel `p`'s lines exactly as the format's packer does, into the calling
/// thread's scratch, so a kernel run on a staged panel gives the same bits as on the packed
/// one. A product's passes over one panel follow each other on one thread (`run`), so a panel
/// is staged once per product, not once per pass.
pub struct Staged<S> {
    /// This product's own number: scratch left by another product is never taken for it.
    id: u64,
    per_panel: usize,
    stage: S,
}

thread_local! {
    /// (product id, panel, its lines) last staged on this thread.
    static SCRATCH: std::cell::RefCell<(u64, usize, Vec<Line>)> = const { std::cell::RefCell::new((0, 0, Vec::new())) };
}

impl<S: Fn(usize, &mut [Line]) + Sync> Staged<S> {
    pub fn new(per_panel: usize, stage: S) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Staged { id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed), per_panel, stage }
    }

    /// `f` of panel `p`'s lines, staged unless this thread staged them last.
    pub fn with<R>(&self, p: usize, f: impl FnOnce(&[Line]) -> R) -> R {
        SCRATCH.with_borrow_mut(|(id, at, lines)| {
            if (*id, *at) != (self.id, p) || lines.len() != self.per_panel {
                lines.resize(self.per_panel, Line([0; 64]));
                (self.stage)(p, lines);
                (*id, *at) = (self.id, p);
            }
            f(lines)
        })
    }
}

impl std::fmt::Debug for Panels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}] in panels", self.n, self.k)
    }
}

/// `out[m, n]` from `kernel(panel, first_row, rows, res)`, which writes `res[r * 16 + lane]`
/// for activation rows `first_row..first_row + rows` (at most `PASS_ROWS`) of one panel.
pub fn run(n: usize, m: usize, out: &mut [f32], kernel: impl Fn(usize, usize, usize, &mut [f32]) + Sync) {
    run_pairs(n, m, out, kernel, None::<fn(usize, usize, usize, &mut [f32], &mut [f32])>)
}

/// As `run`, with `pair(panel, first_row, rows, res, res_next)` doing panels `panel` and
/// `panel + 1` in one pass where a task holds both (each activation broadcast serves twice the
/// weights). A pair kernel must compute every output exactly as `kernel` does, so the split
/// into pairs never changes a result.
pub fn run_pairs(n: usize, m: usize, out: &mut [f32], kernel: impl Fn(usize, usize, usize, &mut [f32]) + Sync, pair: Option<impl Fn(usize, usize, usize, &mut [f32], &mut [f32]) + Sync>) {
    assert!(out.len() >= m * n, "panel product: output shorter than [{m}, {n}]");
    let panels = n.div_ceil(PANEL);
    let rows = Rows(out.as_mut_ptr());
    // Panels `first..end` against all `m` rows. Each pass lands in a zeroed scratch of at most
    // PASS_ROWS × 16 values per panel and goes straight to its rows of `out` while in L1 (a
    // [m][panels][16] buffer for the whole product cost a memset and a copy of the output
    // through memory: at prefill, output bytes ÷ weight bytes is m ÷ k-ish, a few % of a bf16
    // product).
    let walk = |first: usize, end: usize| {
        // A long prompt's activations go ROW_BLOCK rows at a time through all of the task's
        // panels, so those rows stay in cache while the panels stream; one pass over all `m`
        // rows per panel re-read the whole activation matrix (90 MB of f32 at a 2,048-token
        // down_proj) from memory for every 16 weight rows. The passes are the same either way.
        for r0 in (0..m).step_by(ROW_BLOCK) {
            let r1 = (r0 + ROW_BLOCK).min(m);
            let mut p = first;
            while p < end {
                // Two panels where a pair kernel is given and the task holds the next one too.
                let pair = pair.as_ref().filter(|_| p + 1 < end);
                for g in (r0..r1).step_by(PASS_ROWS) {
                    let mg = (r1 - g).min(PASS_ROWS);
                    let mut res = [[0f32; PASS_ROWS * PANEL]; 2];
                    let [a, b] = &mut res;
                    match pair {
                        Some(pair) => pair(p, g, mg, &mut a[..mg * PANEL], &mut b[..mg * PANEL]),
                        None => kernel(p, g, mg, &mut a[..mg * PANEL]),
                    }
                    for (i, r) in res.iter().take(if pair.is_some() { 2 } else { 1 }).enumerate() {
                        let cols = PANEL.min(n - (p + i) * PANEL);
                        for j in 0..mg {
                            // SAFETY: row `g + j`'s columns of panel `p + i` lie inside `out`
                            // (asserted `m · n` long) and belong to this run alone, and `out`
                            // is borrowed mutably until `run` returns, after every run.
                            unsafe { rows.write((g + j) * n + (p + i) * PANEL, &r[j * PANEL..j * PANEL + cols]) };
                        }
                    }
                }
                p += if pair.is_some() { 2 } else { 1 };
            }
        }
    };
    if m == 1 {
        // One row (decode): each thread streams its own share of the panels, in runs of whole
        // pairs, about sixteen to a share, so the thread done first takes the other's tail
        // (`team::split`).
        let threads = rayon::current_num_threads().max(1);
        let grain = panels.div_ceil(threads * 16).max(4).next_multiple_of(2);
        super::team::split(panels, grain, &walk);
        return;
    }
    let per_task = super::matvec::rows_per_task(panels, m).min(panels).max(1);
    super::team::run(panels.div_ceil(per_task), &|c| walk(c * per_task, ((c + 1) * per_task).min(panels)));
}

/// The output's base pointer, shared by the tasks, which write disjoint columns of it.
struct Rows(*mut f32);
// SAFETY: only used as `run_pairs` says: disjoint writes while the slice is borrowed.
unsafe impl Sync for Rows {}

impl Rows {
    /// Copies `v` to `at..at + v.len()`. Caller: in bounds, and no other thread touches it.
    unsafe fn write(&self, at: usize, v: &[f32]) {
        std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(at), v.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lane `r` of line `i` is word `i` of row `r`, zero past the last row, for word counts on
    /// and off the eight-word blocks (the AVX2 shuffles and the scalar tail), with rows longer
    /// than the lines and starting at odd byte offsets.
    #[test]
    fn transpose_words_puts_word_i_of_row_r_in_lane_r_of_line_i() {
        let bytes: Vec<u8> = (0..16 * 4 * 40 + 3).map(|i| (i * 7 + i / 251) as u8).collect();
        for (rows, words) in [(16, 40), (16, 19), (11, 8), (3, 5), (9, 1)] {
            let rs: Vec<&[u8]> = (0..rows).map(|r| &bytes[1 + r * 4 * 40..]).collect();
            let mut lines = vec![Line([0xaa; 64]); words];
            transpose_words(&rs, &mut lines);
            for (i, line) in lines.iter().enumerate() {
                for r in 0..PANEL {
                    let want = rs.get(r).map_or([0; 4], |b| [b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
                    assert_eq!(line.0[4 * r..4 * r + 4], want, "{rows} rows, {words} words: line {i} lane {r}");
                }
            }
        }
    }

    /// Every (panel, activation row) result lands once, in its place, across row blocks
    /// (150 rows: two whole blocks and part of a third), with and without the pair kernel, for
    /// a width that is not whole panels.
    #[test]
    fn every_pass_lands_once_across_row_blocks() {
        let (n, m) = (16 * 5 + 3, 2 * ROW_BLOCK + 22);
        // Output (row, column) gets row · 1000 + column + 1; passes must see whole PASS_ROWS runs.
        let kernel = |p: usize, g: usize, mg: usize, res: &mut [f32]| {
            assert!(g.is_multiple_of(PASS_ROWS) && mg <= PASS_ROWS && res.iter().all(|&v| v == 0.0));
            for r in 0..mg {
                for lane in 0..PANEL {
                    res[r * PANEL + lane] = ((g + r) * 1000 + p * PANEL + lane + 1) as f32;
                }
            }
        };
        let pair = |p: usize, g: usize, mg: usize, a: &mut [f32], b: &mut [f32]| {
            kernel(p, g, mg, a);
            kernel(p + 1, g, mg, b);
        };
        for paired in [false, true] {
            let mut out = vec![0f32; m * n];
            run_pairs(n, m, &mut out, kernel, Some(pair).filter(|_| paired));
            for (i, v) in out.iter().enumerate() {
                assert_eq!(*v, ((i / n) * 1000 + i % n + 1) as f32, "paired {paired}: row {} column {}", i / n, i % n);
            }
        }
    }
}
