//! Sampling every sequence of a step with one read-back from the device.
//!
//! The logits of a step (`[R, vocab]`, one row per sequence that samples) stay on the device.
//! Off the CPU (and with `MERG_CPU_KERNELS=generic`), a greedy row is settled there: the
//! constraint's mask applied, its argmax, the model's log-sum-exp, the chosen logit and a
//! finiteness check come back as four numbers. A row sampled with a temperature is ranked
//! there (`ranking`) and drawn there (`draw`), with the uniform its seeded sampler draws on
//! the host: the walk's token, its logit and a flag come back, the same token the host
//! sampler draws from the whole row (so a seed means the same on every device). A walk past
//! the head fetches the row in a second transfer (a nucleus of over `HEAD` tokens: rare) and
//! the host finishes it with the same uniform. Everything that crosses goes through
//! `read_back`, which counts; one transfer per step otherwise.
//! On the CPU the rows are already in host memory and are read once per step as they are.

use anyhow::Result;
use candle_core::{DType, Tensor, D};

use crate::generate::{check_mask, settle_step, FinishReason, NonFiniteLogits};

use super::draw::{draw, Walk};
use super::ranking::top_m;
use super::sequence::Sequence;

/// Tokens of a sampled row's order a device ranks and sends back: a top-p nucleus or a
/// draw rarely walks further (the walk goes on from the whole row when it does).
pub const HEAD: usize = 256;

/// The only way step code reads a tensor back to the host: one f32 transfer, counted.
#[allow(clippy::disallowed_methods)]
pub fn read_back(t: &Tensor, count: &mut u64) -> candle_core::Result<Vec<f32>> {
    *count += 1;
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()
}

/// How a row comes back from the device.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    /// Greedy: settled there (argmax, log-sum-exp, the chosen logit).
    Settled,
    /// Sampled: ranked and drawn there (the token, its logit, past-the-head).
    Head,
    /// Sampled with a top-k wider than the head, or on the host: the whole row.
    Whole,
}

/// What a row needs: its constraint's mask (None: unrestricted), how it comes back and, for
/// a draw on the device, the walk (its uniform already drawn from the sequence's stream).
struct Need {
    mask: Option<Vec<bool>>,
    form: Form,
    walk: Option<Walk>,
}

/// Samples one token for each of `seqs` from `logits` `[R, vocab]` (row i for seqs[i]); each
/// result is (token, log-prob, finished) or that sequence's own error.
pub fn sample_rows(logits: &Tensor, seqs: &mut [&mut Sequence], vocab: usize, reads: &mut u64) -> Vec<Result<(u32, f32, bool)>> {
    let on_device = !crate::cpu::host_paths(logits.device());
    let needs: Vec<Result<Need>> = seqs.iter_mut().map(|s| need(s, vocab, on_device)).collect();
    let picks = match on_device {
        true => pick_on_device(logits, &needs, vocab, reads).and_then(|p| fetch_late(logits, p, vocab, reads)),
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
    let form = match (on_device, s.sampler.is_greedy(), s.sampler.head_needed()) {
        (false, _, _) => Form::Whole,
        (true, true, _) => Form::Settled,
        (true, false, Some(k)) if k > HEAD => Form::Whole,
        (true, false, _) => Form::Head,
    };
    let walk = (form == Form::Head).then(|| walk_of(&mut s.sampler, vocab));
    Ok(Need { mask, form, walk })
}

/// A sampler's walk over a `vocab`-token row, with the uniform of its next draw.
fn walk_of(sampler: &mut crate::generate::Sampler, vocab: usize) -> Walk {
    let (inv_t, limit, top_p) = (sampler.inv_temperature(), sampler.candidates(vocab), sampler.params().top_p);
    Walk { inv_t, limit, top_p, u: sampler.draw_uniform() }
}

/// A row's outcome before the sampler sees it.
enum Pick {
    /// Settled: (token, log-prob).
    Chosen(u32, f32),
    /// The whole row, for the host sampler; with the uniform already drawn for it, if any.
    Row(Vec<f32>, Option<f64>),
    /// Drawn on the device past the head of the order: the row must come back, for the host to
    /// finish the walk with this uniform.
    Late(f64),
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

/// Rows with this form, as device indices.
fn rows_of(needs: &[Result<Need>], form: Form) -> Vec<u32> {
    (0..needs.len() as u32).filter(|&i| matches!(&needs[i as usize], Ok(n) if n.form == form)).collect()
}

/// Greedy rows settled on the device, sampled rows ranked there (their heads) or brought
/// back whole: one transfer.
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
    let mut parts = vec![Tensor::cat(&[ids.to_dtype(DType::F32)?, lse, chosen, finite], 1)?.flatten_all()?];
    let heads = rows_of(needs, Form::Head);
    let m = HEAD.min(vocab);
    if !heads.is_empty() {
        let x = masked.index_select(&Tensor::new(heads.as_slice(), dev)?, 0)?;
        let walks: Vec<Walk> = heads.iter().map(|&i| needs[i as usize].as_ref().ok().and_then(|n| n.walk).expect("a head row has its walk")).collect();
        let (vals, top_ids) = top_m(&x, m)?;
        parts.push(draw(&x, &vals, &top_ids, &walks)?.flatten_all()?);
    }
    let whole = rows_of(needs, Form::Whole);
    if !whole.is_empty() {
        parts.push(logits.index_select(&Tensor::new(whole.as_slice(), dev)?, 0)?.flatten_all()?);
    }
    let host = read_back(&Tensor::cat(&parts, 0)?, reads)?;
    let (small, rest) = host.split_at(4 * r);
    let (head_part, rows) = rest.split_at(heads.len() * 3);
    let (mut next_head, mut next_row) = (0, 0);
    Ok((0..r)
        .map(|i| {
            let n = needs[i].as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let [id, lse, chosen, finite] = [0, 1, 2, 3].map(|k| small[4 * i + k]);
            if !finite.is_finite() {
                return Ok(Pick::NonFinite);
            }
            Ok(match n.form {
                Form::Settled => Pick::Chosen(id as u32, chosen - lse),
                Form::Head => {
                    let [tok, logit, past] = [0, 1, 2].map(|k| head_part[3 * next_head + k]);
                    next_head += 1;
                    // The masked logit of an allowed token is the model's own.
                    match past > 0.0 {
                        false => Pick::Chosen(tok as u32, logit - lse),
                        true => Pick::Late(n.walk.map_or(0.0, |w| w.u)),
                    }
                }
                Form::Whole => {
                    next_row += 1;
                    Pick::Row(rows[(next_row - 1) * vocab..next_row * vocab].to_vec(), None)
                }
            })
        })
        .collect())
}

/// The rows whose walk went past their head come back whole, together, in one more
/// transfer (rare: a nucleus wider than `HEAD` tokens), each with the uniform of its draw.
fn fetch_late(logits: &Tensor, picks: Vec<Result<Pick>>, vocab: usize, reads: &mut u64) -> Result<Vec<Result<Pick>>> {
    let late: Vec<u32> = (0..picks.len() as u32).filter(|&i| matches!(picks[i as usize], Ok(Pick::Late(_)))).collect();
    if late.is_empty() {
        return Ok(picks);
    }
    let rows = read_back(&logits.index_select(&Tensor::new(late.as_slice(), logits.device())?, 0)?, reads)?;
    let mut next = 0;
    Ok(picks
        .into_iter()
        .map(|p| match p {
            Ok(Pick::Late(u)) => {
                next += 1;
                Ok(Pick::Row(rows[(next - 1) * vocab..next * vocab].to_vec(), Some(u)))
            }
            other => other,
        })
        .collect())
}

fn settle(s: &mut Sequence, need: Need, pick: Result<Pick>) -> Result<(u32, f32, bool)> {
    let picked = match pick? {
        Pick::Chosen(tok, lp) => (tok, lp),
        Pick::Row(row, None) => s.sampler.sample_row(&row, need.mask.as_deref())?,
        Pick::Row(row, Some(u)) => s.sampler.sample_row_drawn(&row, need.mask.as_deref(), Some(u))?,
        Pick::Late(_) => anyhow::bail!("a sampled row's walk went past its head and the row was not fetched"),
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
    use crate::generate::{Sampler, SamplingParams};
    use candle_core::Device;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn need(mask: Option<Vec<bool>>, form: Form, walk: Option<Walk>) -> Result<Need> {
        Ok(Need { mask, form, walk })
    }

    /// The device form, run on the CPU: a masked greedy row picks the best allowed token with
    /// the unmasked model's log-prob, a whole row comes back whole, a row with a NaN is
    /// reported, and all of it is one read-back.
    #[test]
    fn device_picks_equal_the_host_sampler() -> Result<()> {
        let rows = vec![vec![0.5f32, 3.0, 1.0, -2.0], vec![0.1, 0.2, 0.3, 0.4], vec![1.0, f32::NAN, 0.0, 0.0]];
        let logits = Tensor::new(rows.clone(), &Device::Cpu)?;
        let needs = vec![need(Some(vec![true, false, true, true]), Form::Settled, None), need(None, Form::Whole, None), need(None, Form::Settled, None)];
        let mut reads = 0;
        let picks = pick_on_device(&logits, &needs, 4, &mut reads)?;
        assert_eq!(reads, 1);
        let mut host = Sampler::new(Default::default());
        let (tok, lp) = host.sample_row(&rows[0], Some(&[true, false, true, true]))?;
        match &picks[0] {
            Ok(Pick::Chosen(t, l)) => assert!(*t == tok && (l - lp).abs() < 1e-6, "{t} {l} vs {tok} {lp}"),
            _ => panic!("row 0 not chosen on the device"),
        }
        assert!(matches!(&picks[1], Ok(Pick::Row(r, None)) if *r == rows[1]));
        assert!(matches!(&picks[2], Ok(Pick::NonFinite)));
        Ok(())
    }

    /// A sampled row ranked and drawn on the device (one read-back: the token, its logit, a
    /// flag) gives the token and log-prob the host sampler draws from the whole row with the
    /// same seed; a walk past the head finishes on the row with the same uniform.
    #[test]
    fn device_heads_draw_what_the_host_draws() -> Result<()> {
        let mut gen = StdRng::seed_from_u64(11);
        let (mut past_head, mut drawn) = (0, 0);
        for case in 0..24u64 {
            let vocab = [3000, 151_936][case as usize % 2];
            let p = SamplingParams {
                temperature: [0.7, 1.0, 3.0][case as usize % 3],
                top_p: [0.9, 0.5, 1.0, 0.999][(case / 3) as usize % 4],
                top_k: [0, 40][(case / 12) as usize % 2],
                seed: case,
                ..Default::default()
            };
            let mut row: Vec<f32> = (0..vocab).map(|_| gen.random::<f32>() * 8.0 - 4.0 + if gen.random::<f32>() < 0.002 { 8.0 } else { 0.0 }).collect();
            // Every fourth row in steps of 1/8, as bf16 logits tie: the order among ties is by id.
            if case % 4 == 3 {
                row.iter_mut().for_each(|x| *x = (*x * 8.0).round() / 8.0);
            }
            let mask: Option<Vec<bool>> = (case % 5 == 0).then(|| (0..vocab).map(|i| i % 3 != 0).collect());
            let logits = Tensor::new(vec![row.clone()], &Device::Cpu)?;
            let (mut host, mut dev) = (Sampler::new(p.clone()), Sampler::new(p.clone()));
            for _ in 0..2 {
                let want = host.sample_row(&row, mask.as_deref())?;
                let mut reads = 0;
                let walk = walk_of(&mut dev, vocab);
                let picks = pick_on_device(&logits, &[need(mask.clone(), Form::Head, Some(walk))], vocab, &mut reads)?;
                assert_eq!(reads, 1);
                let got = match &picks[0] {
                    Ok(Pick::Chosen(t, lp)) => {
                        drawn += 1;
                        (*t, *lp)
                    }
                    Ok(Pick::Late(u)) => {
                        past_head += 1;
                        dev.sample_row_drawn(&row, mask.as_deref(), Some(*u))?
                    }
                    _ => panic!("case {case}: neither drawn nor past the head"),
                };
                assert_eq!(got.0, want.0, "case {case}: {p:?}");
                assert!((got.1 - want.1).abs() < 1e-4, "case {case}: log-prob {} vs {}", got.1, want.1);
            }
        }
        // Both ways occur: heads that suffice and walks that go past them.
        assert!(drawn > 20 && past_head > 0, "{drawn} drawn from heads, {past_head} past them");
        Ok(())
    }
}
