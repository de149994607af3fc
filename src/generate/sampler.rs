//! The seeded sampler: greedy, or temperature, top-k and top-p and one draw walking the
//! candidates in order (logit descending, then id ascending, so a seed picks the same token on
//! every platform). The walk reads only the head of that order it needs (`Ranked` builds the
//! head lazily, never sorting a 150k vocabulary). A device runs the same walk over the head
//! it ranked (`engine::draw`) with a uniform drawn here (`draw_uniform`), and finishes here on
//! the whole row, with that uniform, when the walk goes past the head.

use anyhow::{bail, Result};
use candle_core::Tensor;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{NonFiniteLogits, SamplingParams};
use crate::cpu::reduce;

pub struct Sampler {
    pub(super) params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// Picks the next token from f32 logits `[vocab]`; returns (token, model log-prob).
    pub fn sample(&mut self, logits: &Tensor) -> Result<(u32, f32)> {
        self.sample_masked(logits, None)
    }

    /// As `sample`, choosing only among `allowed` tokens. The log-prob stays the unmasked
    /// model's, so perplexity means the same with and without constraints.
    pub fn sample_masked(&mut self, logits: &Tensor, allowed: Option<&[bool]>) -> Result<(u32, f32)> {
        self.sample_row(&logits.to_vec1::<f32>()?, allowed)
    }

    /// Greedy (temperature 0): the pick is the argmax, which a device can find without the row.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0
    }

    /// 1 / temperature (infinite for greedy, which never uses it).
    pub fn inv_temperature(&self) -> f32 {
        1.0 / self.params.temperature as f32
    }

    /// The settings it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The uniform of the next draw, from the seeded stream: what `sample_row` draws first, for
    /// a draw made elsewhere (a device's) and finished, if need be, by `sample_row_drawn`.
    pub fn draw_uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Tokens top-k leaves of a `vocab`-token row (all of them without top-k).
    pub fn candidates(&self, vocab: usize) -> usize {
        match self.params.top_k {
            0 => vocab,
            k => k.min(vocab),
        }
    }

    /// Tokens a walk may need, when a head of that many is surely enough (top-k within it);
    /// None when the walk can go anywhere (no top-k: the nucleus has no fixed size).
    pub fn head_needed(&self) -> Option<usize> {
        (self.params.top_k > 0).then_some(self.params.top_k)
    }

    /// As `sample_masked`, on a row already on the host.
    pub fn sample_row(&mut self, raw: &[f32], allowed: Option<&[bool]>) -> Result<(u32, f32)> {
        let u = (!self.is_greedy()).then(|| self.rng.random::<f64>());
        self.sample_row_drawn(raw, allowed, u)
    }

    /// As `sample_row`, with the uniform already drawn (`NeedsRow`'s); None for greedy.
    pub fn sample_row_drawn(&mut self, raw: &[f32], allowed: Option<&[bool]>, u: Option<f64>) -> Result<(u32, f32)> {
        if raw.is_empty() {
            bail!("empty logits");
        }
        // One pass over the row being sampled: a reply must never be built on NaN.
        if !reduce::all_finite(raw) {
            let bad = raw.iter().copied().find(|x| !x.is_finite()).unwrap_or(f32::NAN);
            return Err(NonFiniteLogits(bad).into());
        }
        let (top, max) = reduce::max_index(raw);
        let lse = max + reduce::sum_exp(raw, 1.0, max).ln() as f32;
        let masked;
        let pick_from = match allowed {
            Some(mask) => {
                check_mask(mask)?;
                masked = raw
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| if mask.get(i).copied().unwrap_or(false) { x } else { f32::NEG_INFINITY })
                    .collect::<Vec<f32>>();
                &masked
            }
            None => raw,
        };
        let tok = match u {
            None if allowed.is_none() => top as u32,
            None => reduce::max_index(pick_from).0 as u32,
            Some(u) => {
                let mut ranked = Ranked::new(pick_from);
                let n = self.walk(&mut ranked, u);
                ranked.at_full(n)
            }
        };
        Ok((tok, raw[tok as usize] - lse))
    }

    /// Top-k, top-p and the draw `u` over a row in sampling order: the chosen token's place.
    fn walk(&self, order: &mut Ranked, u: f64) -> usize {
        let (inv_t, vocab) = (self.inv_temperature(), order.logits.len());
        let limit = self.candidates(vocab);
        let max = order.logit(0) * inv_t;
        let w = |x: f32| ((x * inv_t - max) as f64).exp();
        // The normaliser over what top-k leaves (every token without top-k).
        let total: f64 = match limit == vocab {
            true => reduce::sum_exp(order.logits, inv_t, max),
            false => (0..limit).map(|n| w(order.logit(n))).sum(),
        };
        let mut weight = |n: usize| w(order.logit(n));
        // Top-p keeps the shortest head whose mass reaches top_p; `mass` is that head's (1 when
        // nothing is cut: the candidates' sum is the normaliser itself).
        let (keep, mass) = match self.params.top_p < 1.0 {
            true => {
                let mut cum = 0.0;
                let mut keep = limit;
                for n in 0..limit {
                    cum += weight(n) / total;
                    if cum >= self.params.top_p {
                        keep = n + 1;
                        break;
                    }
                }
                (keep, cum)
            }
            false => (limit, 1.0),
        };
        let mut r = u * mass;
        // The last candidate that can be drawn at all (a masked token weighs nothing).
        let mut last = 0;
        for n in 0..keep {
            let w = weight(n);
            if w > 0.0 {
                last = n;
            }
            r -= w / total;
            if r <= 0.0 {
                return n;
            }
        }
        // Rounding left a sliver: the last candidate kept, as a full walk would end.
        last
    }
}

/// Token ids in sampling order, ranked lazily: `at_full(n)` selects and sorts only the head up to
/// `n` (each time at least four times the head before), so a walk that stops early costs one
/// selection pass, not a sort of the vocabulary. The selection runs over `candidates`, not
/// the whole row: a selection with its indirect compare over 151,936 ids was ~0.3 ms of a
/// sampled token on the 2-core Zen 5 box.
struct Ranked<'a> {
    logits: &'a [f32],
    /// Every id of the first `idx.len()` places (and maybe more): the whole row once `whole`.
    idx: Vec<u32>,
    whole: bool,
    sorted: usize,
}

/// Values a run of the row has when its maxima bound the head (`candidates`).
const RUN: usize = 64;

impl<'a> Ranked<'a> {
    fn new(logits: &'a [f32]) -> Self {
        Ranked { logits, idx: Vec::new(), whole: false, sorted: 0 }
    }

    fn at_full(&mut self, n: usize) -> u32 {
        if n >= self.sorted {
            let want = (n + 1).max(self.sorted * 4).max(64).min(self.logits.len());
            if want > self.idx.len() && !self.whole {
                self.candidates(want);
            }
            let want = want.min(self.idx.len());
            let logits = self.logits;
            let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
            let rest = &mut self.idx[self.sorted..];
            let head = want - self.sorted;
            if head < rest.len() {
                rest.select_nth_unstable_by(head - 1, order);
            }
            rest[..head].sort_unstable_by(order);
            self.sorted = want;
        }
        self.idx[n]
    }

    /// Makes `idx` hold every id of the first `want` places, ranking anew: the ids whose logit
    /// reaches the `want`-th largest of the runs' maxima (those maxima are `want` values of
    /// the row, so the `want`-th largest value is no lower, and every id of the first `want`
    /// places passes; an id left out is below every one kept). The whole row when there are
    /// too few runs. The order is the row's, so places already handed out stay where they were.
    fn candidates(&mut self, want: usize) {
        let logits = self.logits;
        let mut maxima: Vec<f32> = logits.chunks(RUN).map(|c| c.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })).collect();
        self.sorted = 0;
        if maxima.len() <= want {
            self.idx = (0..logits.len() as u32).collect();
            self.whole = true;
            return;
        }
        let (_, &mut bound, _) = maxima.select_nth_unstable_by(want - 1, |a, b| b.total_cmp(a));
        self.idx = (0..logits.len() as u32).filter(|&i| logits[i as usize] >= bound).collect();
    }

    /// The logit at place `n` of the order.
    fn logit(&mut self, n: usize) -> f32 {
        self.logits[self.at_full(n) as usize]
    }
}

/// A constraint's mask must leave a token: otherwise the request fails (alone) with this error.
pub fn check_mask(mask: &[bool]) -> Result<()> {
    if !mask.iter().any(|&a| a) {
        bail!("the output constraint allows no token");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every place asked for, in a walk's order of asking, is the full sort's (value
    /// descending, id ascending; quantized values tie, masked ones are −∞), and the first head
    /// of a vocabulary-sized row is ranked among a few candidates, not the whole row.
    #[test]
    fn ranked_places_are_the_full_sorts() {
        let mut rng = StdRng::seed_from_u64(5);
        for vocab in [7, 64, 4095, 20_000, 151_936] {
            // Ties on the smaller rows (values in eighths); distinct values on the large ones,
            // where a bound too high would leave fewer than the head's 64 candidates.
            let step = if vocab < 20_000 { 8.0 } else { 1e6 };
            let mut logits: Vec<f32> = (0..vocab).map(|_| (rng.random::<f32>() * 8.0 * step).round() / step).collect();
            logits.iter_mut().step_by(5).for_each(|x| *x = f32::NEG_INFINITY);
            let mut full: Vec<u32> = (0..vocab as u32).collect();
            full.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            let mut ranked = Ranked::new(&logits);
            for n in [0, 5, 63, 64, 255, 300, 1000, 70_000, vocab - 1].into_iter().filter(|&n| n < vocab) {
                assert_eq!(ranked.at_full(n), full[n], "vocab {vocab}, place {n}");
                if n == 0 && vocab >= 20_000 {
                    assert!((64..vocab / 8).contains(&ranked.idx.len()), "vocab {vocab}: {} candidates for the first head", ranked.idx.len());
                }
            }
        }
    }
}
