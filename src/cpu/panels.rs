//! The driver shared by the packed-weight kernels (`q8_0`, `bf16`): a weight `[n, k]` is stored
//! as panels of 16 rows, each panel one contiguous run of 64-byte lines whose 32-bit lane `r`
//! belongs to the panel's row `r`. A product `x[m, k] · wᵀ` walks the panels across the rayon
//! pool — one contiguous run of panels per thread at batch 1, so each core streams one
//! sequential range that the hardware prefetchers follow — and within a panel takes the
//! activation rows eight at a time, so a panel (tens of KiB) is read from memory once and
//! re-read from the core's cache for the other rows: the same code is decode (m = 1),
//! batched decode and prefill.

/// Weight rows per panel (the 32-bit lanes of a 512-bit register).
pub const PANEL: usize = 16;
/// Activation rows one pass over a panel handles.
pub const PASS_ROWS: usize = 8;

/// A 64-byte line, aligned as the cache is.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Line(pub [u8; 64]);

/// `out[m, n]` from `kernel(panel, first_row, rows, res)`, which writes `res[r * 16 + lane]`
/// for activation rows `first_row..first_row + rows` (at most `PASS_ROWS`) of one panel.
pub fn run(n: usize, m: usize, out: &mut [f32], kernel: impl Fn(usize, usize, usize, &mut [f32]) + Sync) {
    assert!(out.len() >= m * n, "panel product: output shorter than [{m}, {n}]");
    let panels = n.div_ceil(PANEL);
    let per_task = super::matvec::rows_per_task(panels, m).min(panels).max(1);
    // Results panel-major ([panel][m][16]) so each task writes one contiguous run.
    let mut t = vec![0f32; panels * m * PANEL];
    super::team::chunks_mut(&mut t, per_task * m * PANEL, |c, chunk| {
        for (i, res) in chunk.chunks_exact_mut(m * PANEL).enumerate() {
            for g in (0..m).step_by(PASS_ROWS) {
                let mg = (m - g).min(PASS_ROWS);
                kernel(c * per_task + i, g, mg, &mut res[g * PANEL..(g + mg) * PANEL]);
            }
        }
    });
    for p in 0..panels {
        let cols = PANEL.min(n - p * PANEL);
        for r in 0..m {
            out[r * n + p * PANEL..][..cols].copy_from_slice(&t[(p * m + r) * PANEL..][..cols]);
        }
    }
}
