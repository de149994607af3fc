//! Sampling every sequence of a step with one read-back from the device.
//!
//! The logits of a step (`[R, vocab]`, one row per sequence that samples) stay on the device.
//! Off the CPU (and with `MERG_CPU_KERNELS=generic`), a greedy row is settled there: the
//! constraint's mask applied, its argmax, the model's log-sum-exp, the chosen logit and a
//! finiteness check come back as four numbers. Only rows that sample with a temperature come
//! back whole (the seeded sampler runs on the host, so a seed means the same on every device).
//! Everything that crosses goes through `read_back`, which counts, in one transfer per step.
//! On the CPU the rows are already in host memory and are read once per step as they are.

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use crate::generate::{check_mask, settle_step, FinishReason, NonFiniteLogits};

use super::sequence::Sequence;

/// The only way step code reads a tensor back to the host: one f32 transfer, counted.
#[allow(clippy::disallowed_methods)]
pub fn read_back(t: &Tensor, count: &mut u64) -> candle_core::Result<Vec<f32>> {
    *count += 1;
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()
}

/// What a row needs: its constraint's mask (None: unrestricted) and whether it comes back whole.
struct Need {
    mask: Option<Vec<bool>>,
    whole: bool,
}

/// Samples one token for each of `seqs` from `logits` `[R, vocab]` (row i for seqs[i]); each
/// result is (token, log-prob, finished) or that sequence's own error.
pub fn sample_rows(logits: &Tensor, seqs: &mut [&mut Sequence], vocab: usize, reads: &mut u64) -> Vec<Result<(u32, f32, bool)>> {
    let on_device = !crate::cpu::host_paths(logits.device());
    let needs: Vec<Result<Need>> = seqs.iter_mut().map(|s| need(s, vocab, on_device)).collect();
    let picks = match on_device {
        true => pick_on_device(logits, &needs, vocab, reads),
        false => pick_on_host(logits, seqs, &needs, vocab, reads),
    };
    let picks = match picks {
        Ok(p) => p,
        Err(e) => return seqs.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
    };
    seqs.iter_mut().zip(needs).zip(picks).map(|((s, need), pick)| settle(s, need?, pick)).collect()
}

fn need(s: &mut Sequence, vocab: usize, on_device: bool) -> Result<Need> {
    let mask = match s.constraint.as_deref_mut() {
        Some(c) => c.allowed(vocab)?,
        None => None,
    };
    if let Some(m) = &mask {
        check_mask(m)?;
    }
    Ok(Need { mask, whole: !on_device || !s.sampler.is_greedy() })
}

/// A row's outcome before the sampler sees it.
enum Pick {
    /// Settled on the device: (token, log-prob).
    Chosen(u32, f32),
    /// The whole row, for the host sampler.
    Row(Vec<f32>),
    /// The row held a NaN or an infinity.
    NonFinite,
}

fn pick_on_host(logits: &Tensor, seqs: &mut [&mut Sequence], needs: &[Result<Need>], vocab: usize, reads: &mut u64) -> Result<Vec<Result<Pick>>> {
    let all = read_back(logits, reads)?;
    Ok(seqs
        .iter_mut()
        .zip(needs)
        .enumerate()
        .map(|(i, (s, need))| {
            let mask = need.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?.mask.as_deref();
            let (tok, lp) = s.sampler.sample_row(&all[i * vocab..(i + 1) * vocab], mask)?;
            Ok(Pick::Chosen(tok, lp))
        })
        .collect())
}

/// Greedy rows settled on the device, sampled rows brought back whole: one transfer.
fn pick_on_device(logits: &Tensor, needs: &[Result<Need>], vocab: usize, reads: &mut u64) -> Result<Vec<Result<Pick>>> {
    let (r, dev) = (needs.len(), logits.device());
    let logits = logits.to_dtype(DType::F32)?;
    let masked = match needs.iter().any(|n| matches!(n, Ok(Need { mask: Some(_), .. }))) {
        false => logits.clone(),
        true => {
            let bias: Vec<f32> = needs
                .iter()
                .flat_map(|n| match n {
                    Ok(Need { mask: Some(m), .. }) => (0..vocab).map(|i| if m.get(i).copied().unwrap_or(false) { 0.0 } else { f32::NEG_INFINITY }).collect(),
                    _ => vec![0f32; vocab],
                })
                .collect();
            logits.add(&Tensor::from_vec(bias, (r, vocab), dev)?)?
        }
    };
    let ids = masked.argmax_keepdim(D::Minus1)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?;
    let chosen = logits.gather(&ids, D::Minus1)?;
    // 0 for a finite row; NaN as soon as one entry is NaN or infinite (x·0 is NaN for those).
    let finite = logits.affine(0.0, 0.0)?.sum_keepdim(D::Minus1)?;
    let small = Tensor::cat(&[ids.to_dtype(DType::F32)?, lse, chosen, finite], 1)?.flatten_all()?;
    let whole: Vec<u32> = (0..r as u32).filter(|&i| matches!(needs[i as usize], Ok(Need { whole: true, .. }))).collect();
    let both = match whole.is_empty() {
        true => small,
        false => Tensor::cat(&[small, logits.index_select(&Tensor::new(whole.as_slice(), dev)?, 0)?.flatten_all()?], 0)?,
    };
    let host = read_back(&both, reads)?;
    let (small, rows) = host.split_at(4 * r);
    let mut next_row = 0;
    Ok((0..r)
        .map(|i| {
            let n = needs[i].as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let [id, lse, chosen, finite] = [0, 1, 2, 3].map(|k| small[4 * i + k]);
            if !finite.is_finite() {
                return Ok(Pick::NonFinite);
            }
            if n.whole {
                next_row += 1;
                return Ok(Pick::Row(rows[(next_row - 1) * vocab..next_row * vocab].to_vec()));
            }
            Ok(Pick::Chosen(id as u32, chosen - lse))
        })
        .collect())
}

fn settle(s: &mut Sequence, need: Need, pick: Result<Pick>) -> Result<(u32, f32, bool)> {
    let picked = match pick? {
        Pick::Chosen(tok, lp) => (tok, lp),
        Pick::Row(row) => s.sampler.sample_row(&row, need.mask.as_deref())?,
        Pick::NonFinite => return Err(NonFiniteLogits(f32::NAN).into()),
    };
    let (generated, total) = (s.generated().len() + 1, s.tokens.len() + 1);
    let (tok, lp, finish): (u32, f32, Option<FinishReason>) = settle_step(&s.sampler, s.constraint.as_deref_mut(), picked, generated, total, s.max_context)?;
    s.tokens.push(tok);
    s.logprobs.push(lp);
    s.finish = finish;
    Ok((tok, lp, finish.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The device form, run on the CPU: a masked greedy row picks the best allowed token with
    /// the unmasked model's log-prob, a sampled row comes back whole, a row with a NaN is
    /// reported, and all of it is one read-back.
    #[test]
    fn device_picks_equal_the_host_sampler() -> Result<()> {
        let rows = vec![vec![0.5f32, 3.0, 1.0, -2.0], vec![0.1, 0.2, 0.3, 0.4], vec![1.0, f32::NAN, 0.0, 0.0]];
        let logits = Tensor::new(rows.clone(), &Device::Cpu)?;
        let needs = vec![
            Ok(Need { mask: Some(vec![true, false, true, true]), whole: false }),
            Ok(Need { mask: None, whole: true }),
            Ok(Need { mask: None, whole: false }),
        ];
        let mut reads = 0;
        let picks = pick_on_device(&logits, &needs, 4, &mut reads)?;
        assert_eq!(reads, 1);
        let mut host = crate::generate::Sampler::new(Default::default());
        let (tok, lp) = host.sample_row(&rows[0], Some(&[true, false, true, true]))?;
        match &picks[0] {
            Ok(Pick::Chosen(t, l)) => assert!(*t == tok && (l - lp).abs() < 1e-6, "{t} {l} vs {tok} {lp}"),
            _ => panic!("row 0 not chosen on the device"),
        }
        assert!(matches!(&picks[1], Ok(Pick::Row(r)) if *r == rows[1]));
        assert!(matches!(&picks[2], Ok(Pick::NonFinite)));
        Ok(())
    }
}
