//! The seeded draw of a sampled row, on the device. The host sampler walks a row in sampling
//! order (logit descending, then id ascending), cuts it by top-k and top-p and stops where a
//! uniform `u` falls (`generate::sampler`). Here the same walk runs over the head a device
//! ranked (`ranking::top_m`) as tensor operations: each candidate's place in that order and
//! the mass before it come from a head × head comparison (256² per row, no sort needed, ties
//! ordered by id exactly as the host orders them), and the cuts and the draw are masked
//! minima over those places. Only the chosen id, its logit and a flag come back. The flag
//! says the walk went past the head (a nucleus wider than the head), which the host then
//! finishes on the whole row with the same `u`, so a seed picks the same token on every device.
//! The uniform is drawn on the host from the sequence's seeded generator and sent with the
//! row's settings; the sums run in f64, as the host's do (they may differ from its
//! sequential sums in the last bits, which moves a draw only when `u` falls that close to a
//! boundary).

use candle_core::{DType, Tensor, D};

use super::ranking::weight_totals;

/// A row's walk settings, as the host sampler holds them.
#[derive(Clone, Copy, Debug)]
pub struct Walk {
    pub inv_t: f32,
    /// Tokens top-k leaves (the row's size without top-k).
    pub limit: usize,
    /// Top-p; 1 or more cuts nothing.
    pub top_p: f64,
    /// The uniform in [0, 1) the draw uses.
    pub u: f64,
}

/// The draw of each row of `x` `[h, vocab]` (f32, masked entries −∞): `[h, 3]` f32 (token id,
/// its logit, 1 when the walk went past the head). `vals` `[h, m]` f32 and `ids` `[h, m]` u32
/// are the rows' heads (`ranking::top_m`), best first (ties in any order).
pub fn draw(x: &Tensor, vals: &Tensor, ids: &Tensor, walks: &[Walk]) -> candle_core::Result<Tensor> {
    let ((h, m), vocab) = (vals.dims2()?, x.dim(1)?);
    let dev = vals.device();
    // One upload of every row's settings: inv_t, limit, limit == vocab, top_p, top_p < 1, u.
    let cols: Vec<f64> = walks
        .iter()
        .flat_map(|w| [w.inv_t as f64, w.limit as f64, (w.limit == vocab) as u8 as f64, w.top_p, (w.top_p < 1.0) as u8 as f64, w.u])
        .collect();
    let cols = Tensor::from_vec(cols, (h, 6), dev)?;
    let col = |k: usize| cols.narrow(1, k, 1);
    let (inv_t, limit, whole_k, top_p, cut, u) = (col(0)?.to_dtype(DType::F32)?, col(1)?, col(2)?.gt(0.5)?, col(3)?, col(4)?.gt(0.5)?, col(5)?);
    let full = |v: f64| Tensor::full(v, (h, 1), dev);
    // Places are f64 counts; `m` (past the head) marks "none".
    let big = full(m as f64)?;

    // before[i, j] = 1 when candidate j comes before candidate i in sampling order.
    let (vi, vj) = (vals.unsqueeze(2)?, vals.unsqueeze(1)?);
    let (ii, ij) = (ids.unsqueeze(2)?, ids.unsqueeze(1)?);
    let before = (vj.broadcast_gt(&vi)? + vj.broadcast_eq(&vi)?.mul(&ij.broadcast_lt(&ii)?)?)?.to_dtype(DType::F64)?;
    let rank = before.sum(D::Minus1)?;
    // Weights as the host computes them: the shift in f32, the exponential in f64.
    let top = vals.max_keepdim(1)?;
    let w = vals.broadcast_mul(&inv_t)?.broadcast_sub(&top.mul(&inv_t)?)?.to_dtype(DType::F64)?.exp()?;
    // The whole row's normaliser, for a walk without top-k.
    let totals = weight_totals(x, &top, &inv_t)?;
    let zeros = w.zeros_like()?;
    let in_k = rank.broadcast_lt(&limit)?;
    let total_k = in_k.where_cond(&w, &zeros)?.sum_keepdim(1)?;
    let total = whole_k.where_cond(&totals, &total_k)?;
    let q = w.broadcast_div(&total)?;
    // Mass up to and including each candidate.
    let cum = (before.broadcast_mul(&q.unsqueeze(1)?)?.sum(D::Minus1)? + &q)?;
    let at = |r: &Tensor| rank.broadcast_eq(r)?.where_cond(&cum, &zeros)?.sum_keepdim(1);
    let first = |hit: &Tensor| hit.where_cond(&rank, &rank.ones_like()?.affine(0.0, m as f64)?)?.min_keepdim(1);

    // Top-p: the shortest prefix (within top-k) whose mass reaches top_p.
    let reach = cum.broadcast_ge(&top_p)?.mul(&in_k)?;
    let c = first(&reach)?;
    let found = c.lt(&big)?;
    let keep_p = found.where_cond(&(&c + 1.0)?, &limit)?;
    let mass_p = found.where_cond(&at(&c)?, &at(&(&limit - 1.0)?)?)?;
    // No prefix of the head reaches top_p and top-k leaves more than the head: past it.
    let past_p = cut.mul(&found.eq(0u8)?.mul(&limit.gt(&big)?)?)?;
    let keep = cut.where_cond(&keep_p, &limit)?;
    let mass = cut.where_cond(&mass_p, &full(1.0)?)?;

    // The draw: the first kept candidate whose mass reaches u·mass.
    let kept = rank.broadcast_lt(&keep)?;
    let hit = cum.broadcast_ge(&u.mul(&mass)?)?.mul(&kept)?;
    let n = first(&hit)?;
    let drawn = n.lt(&big)?;
    // Rounding left a sliver: the last kept candidate with any weight, as the host ends.
    let last = kept.mul(&w.gt(0.0)?)?.where_cond(&rank, &rank.ones_like()?.affine(0.0, -1.0)?)?.max_keepdim(1)?;
    let chosen = drawn.where_cond(&n, &last)?;
    let past = (past_p + drawn.eq(0u8)?.mul(&keep.gt(&big)?)?)?.gt(0u8)?;

    let sel = rank.broadcast_eq(&chosen)?;
    let zf = vals.zeros_like()?;
    let id = sel.where_cond(&ids.to_dtype(DType::F32)?, &zf)?.sum_keepdim(1)?;
    let logit = sel.where_cond(vals, &zf)?.sum_keepdim(1)?;
    // A token tied with the head's last value may have a lower-id twin the ranking cut off
    // (ties at the cut keep either id): the host settles that draw on the whole row.
    let past = match m < vocab {
        true => (past + logit.eq(&vals.min_keepdim(1)?)?)?.gt(0u8)?,
        false => past,
    };
    Tensor::cat(&[id, logit, past.to_dtype(DType::F32)?], 1)
}
