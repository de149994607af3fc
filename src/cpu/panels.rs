//! The storage and driver shared by the packed-weight kernels (`bf16`, `q8_0`, `q4_k`): a weight
//! `[n, k]` is stored as panels of 16 rows, each panel one contiguous run of 64-byte lines whose
//! 32-bit lane `r` belongs to the panel's row `r`. A product `x[m, k] · wᵀ` walks the panels
//! across the thread team (`team`) — one contiguous run of panels per thread at batch 1, so each core streams one
//! sequential range that the hardware prefetchers follow — and within a panel takes the
//! activation rows eight at a time, so a panel (tens of KiB) is read from memory once and
//! re-read from the core's cache for the other rows: the same code is decode (m = 1),
//! batched decode and prefill.

/// Weight rows per panel (the 32-bit lanes of a 512-bit register).
pub const PANEL: usize = 16;
/// Activation rows one pass over a panel handles.
pub const PASS_ROWS: usize = 8;

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
    lines: Vec<Line>,
}

impl Panels {
    /// `pack(p, lines)` fills panel `p`'s lines (pre-filled with `fill`), panels in parallel:
    /// each worker fills and packs its panels, so the fresh pages are first touched there too.
    pub fn new(n: usize, k: usize, per_panel: usize, fill: Line, pack: impl Fn(usize, &mut [Line]) + Sync) -> Panels {
        // In bands, so a mapped source can be released behind the copy (`pages::releasing`).
        let pp = per_panel.max(1);
        let band = (super::pages::BAND_BYTES / (pp * 64)).max(1);
        let lines = super::pages::huge_filled(n.div_ceil(PANEL) * per_panel, pp, band, fill, pack, |done| super::pages::copied((done * PANEL).min(n), n));
        Panels { n, k, per_panel, lines }
    }

    /// The parts' rows one after another, as one weight (q/k/v, gate/up); `None` unless they
    /// share `k` and every part is whole panels.
    pub fn concat(parts: &[&Panels]) -> Option<Panels> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.k != first.k || p.per_panel != first.per_panel || p.n % PANEL != 0) {
            return None;
        }
        let lines = super::pages::huge_concat(&parts.iter().map(|p| p.lines.as_slice()).collect::<Vec<_>>());
        Some(Panels { n: parts.iter().map(|p| p.n).sum(), k: first.k, per_panel: first.per_panel, lines })
    }

    /// Panel `p`'s lines.
    pub fn panel(&self, p: usize) -> &[Line] {
        &self.lines[p * self.per_panel..(p + 1) * self.per_panel]
    }

    pub fn bytes(&self) -> usize {
        self.lines.len() * 64
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
    let per_task = super::matvec::rows_per_task(panels, m).min(panels).max(1);
    // Results panel-major ([panel][m][16]) so each task writes one contiguous run.
    let mut t = vec![0f32; panels * m * PANEL];
    let stride = m * PANEL;
    super::team::chunks_mut(&mut t, per_task * stride, |c, chunk| {
        let count = chunk.len() / stride;
        let mut i = 0;
        while i < count {
            // Two panels where a pair kernel is given and the task holds the next one too.
            let pair = pair.as_ref().filter(|_| i + 1 < count);
            let width = if pair.is_some() { 2 } else { 1 };
            let (a, b) = chunk[i * stride..(i + width) * stride].split_at_mut(stride);
            for g in (0..m).step_by(PASS_ROWS) {
                let mg = (m - g).min(PASS_ROWS);
                let r = g * PANEL..(g + mg) * PANEL;
                match pair {
                    Some(pair) => pair(c * per_task + i, g, mg, &mut a[r.clone()], &mut b[r]),
                    None => kernel(c * per_task + i, g, mg, &mut a[r]),
                }
            }
            i += width;
        }
    });
    for p in 0..panels {
        let cols = PANEL.min(n - p * PANEL);
        for r in 0..m {
            out[r * n + p * PANEL..][..cols].copy_from_slice(&t[(p * m + r) * PANEL..][..cols]);
        }
    }
}
