//! Token generation for one sequence: greedy or seeded temperature / top-k / top-p sampling,
//! stop tokens, and the log-probability of every emitted token under the model (temperature 1,
//! before any filtering), which is what perplexity needs.

use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use candle_core::Device;

use crate::chat::Message;
use crate::models::{DenseCache, MediaGrid, Model, PromptInputs, StepCache};
use crate::processor::{check_placeholders, Processor};
use crate::vision::Media;

mod sampler;
pub use sampler::{check_mask, Sampler};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f64,
    /// 1.0 = off.
    pub top_p: f64,
    /// 0 = off.
    pub top_k: usize,
    pub seed: u64,
    pub max_new_tokens: usize,
    pub stop_token_ids: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, max_new_tokens: 128, stop_token_ids: vec![] }
    }
}

impl SamplingParams {
    /// Each value against its rule; the error names the field.
    pub fn validate(&self) -> Result<(), crate::setting::InvalidSetting> {
        use crate::setting::{at_least_one, check};
        check(self.temperature >= 0.0 && self.temperature.is_finite(), "temperature", self.temperature, "a number ≥ 0 (0 = greedy)")?;
        check(self.top_p > 0.0 && self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")?;
        at_least_one("max_new_tokens", self.max_new_tokens)
    }
}

/// The model produced a NaN or infinite logit on a row being sampled.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the model produced a non-finite logit ({0}) for this request")]
pub struct NonFiniteLogits(pub f32);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was produced (it is included in `tokens`).
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// The caller aborted the request; the tokens so far are kept.
    Aborted,
    /// The model's context window is full.
    Context,
}

/// How a generation ended, in words for messages ("… stopped at the token limit").
impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FinishReason::Stop => "ended at a stop token",
            FinishReason::Length => "stopped at the token limit",
            FinishReason::Aborted => "was aborted",
            FinishReason::Context => "filled the context window",
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Natural-log probability of each token in `tokens` under the unmodified model.
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
}

/// Restricts which tokens may come next (e.g. a JSON schema). `allowed` returns a mask over the
/// model's vocabulary (`None` = no restriction); `commit` advances it with the chosen token.
pub trait TokenConstraint: Send {
    fn allowed(&mut self, vocab_size: usize) -> Result<Option<Vec<bool>>>;
    fn commit(&mut self, token: u32) -> Result<()>;
    /// The constrained output is complete: generation ends without another token.
    fn is_finished(&self) -> bool;
}

/// Vision input of one request in the form HF's processor gives it: the patches of all
/// images, the patches of all videos, and each item's grid in prompt order.
#[derive(Clone, Debug, Default)]
pub struct VisionInput {
    pub image_patches: Option<Tensor>,
    pub video_patches: Option<Tensor>,
    pub media: Vec<MediaGrid>,
}

impl VisionInput {
    /// Each item's own patches (rows t·h·w of its kind's tensor), in prompt order.
    pub fn items(&self) -> Result<Vec<(Tensor, MediaGrid)>> {
        let mut offsets = [0usize, 0];
        let mut out = Vec::with_capacity(self.media.len());
        for g in &self.media {
            let (all, off) = match g.is_video {
                false => (&self.image_patches, &mut offsets[0]),
                true => (&self.video_patches, &mut offsets[1]),
            };
            let Some(all) = all else { bail!("a {} grid but no such patches", if g.is_video { "video" } else { "image" }) };
            let n: usize = g.thw.iter().product();
            if *off + n > all.dim(0)? {
                bail!("grid {:?} needs {n} patches past row {off} of {}", g.thw, all.dim(0)?);
            }
            out.push((all.narrow(0, *off, n)?, g.clone()));
            *off += n;
        }
        Ok(out)
    }
}

/// Token ids and HF-style vision input of a chat request, from the same processor the engine
/// uses (the dense reference's inputs; the engine prepares through `RequestPreparer`).
pub fn reference_inputs(processor: &Processor, messages: &[Message], media: &[Media], device: &Device) -> Result<(Vec<u32>, VisionInput)> {
    check_placeholders(messages, media)?;
    let items = media.iter().map(|m| processor.preprocess(m)).collect::<Result<Vec<_>>>()?;
    let grids: Vec<MediaGrid> = items.iter().map(|i| i.grid.clone()).collect();
    let ids = processor.encode_prompt(messages, &grids)?;
    let cat = |video: bool| -> Result<Option<Tensor>> {
        let ts = items.iter().filter(|i| i.grid.is_video == video).map(|i| i.patches.to_tensor(device)).collect::<Result<Vec<_>>>()?;
        Ok(if ts.is_empty() { None } else { Some(Tensor::cat(&ts, 0)?) })
    };
    Ok((ids, VisionInput { image_patches: cat(false)?, video_patches: cat(true)?, media: grids }))
}

/// Encodes each media item with the model's vision tower and prepares the decoder inputs
/// (the same calls the engine makes, without its caches).
pub fn prepare(model: &dyn Model, ids: &[u32], vision: &VisionInput) -> Result<PromptInputs> {
    let items = vision.items()?;
    let feats = items.iter().map(|(p, g)| model.encode_media(p, g)).collect::<Result<Vec<_>>>()?;
    model.prepare_prompt(ids, &vision.media, &feats)
}

/// f32 logits `[keep, vocab]` of the last `keep` of the `T` tokens run through `cache`.
pub fn forward_logits(model: &dyn Model, inputs: &PromptInputs, cache: &mut dyn StepCache, keep: usize) -> Result<Tensor> {
    cache.set_bidirectional(&inputs.bidirectional)?;
    let hidden = model.forward(&inputs.embeds, &inputs.positions, inputs.deepstack.as_ref(), cache)?;
    let t = hidden.dim(0)?;
    let keep = keep.min(t);
    model.logits(&hidden.narrow(0, t - keep, keep)?)
}

/// Decoder inputs of one generated token `tok` continuing after `past` tokens.
pub fn decode_inputs(model: &dyn Model, tok: u32, past: usize, rope_delta: i64) -> Result<PromptInputs> {
    Ok(PromptInputs { embeds: model.embed_tokens(&[tok])?, positions: model.decode_positions(past, 1, rope_delta), rope_delta, deepstack: None, bidirectional: vec![] })
}

/// Prompt + continuation for one request on a private dense cache: the reference the paged
/// engine is tested against.
pub fn generate(
    model: &dyn Model,
    ids: &[u32],
    vision: &VisionInput,
    params: &SamplingParams,
    max_context: Option<usize>,
) -> Result<Generation> {
    generate_constrained(model, ids, vision, params, max_context, None)
}

/// `generate` with an optional token constraint (e.g. a JSON schema).
pub fn generate_constrained(
    model: &dyn Model,
    ids: &[u32],
    vision: &VisionInput,
    params: &SamplingParams,
    max_context: Option<usize>,
    mut constraint: Option<&mut dyn TokenConstraint>,
) -> Result<Generation> {
    params.validate()?;
    let ctx = max_context.unwrap_or(model.spec().max_context);
    if ids.is_empty() {
        bail!("empty prompt");
    }
    if ids.len() >= ctx {
        bail!("prompt is {} tokens but the context window is {ctx}; shorten the dialogue or use fewer frames", ids.len());
    }
    let inputs = prepare(model, ids, vision)?;
    let mut cache = DenseCache::new();
    let mut logits = forward_logits(model, &inputs, &mut cache, 1)?.squeeze(0)?;
    let mut sampler = Sampler::new(params.clone());
    let vocab = model.spec().vocab_size;
    let mut out = Generation { tokens: vec![], logprobs: vec![], finish: FinishReason::Length, prompt_tokens: ids.len() };
    let mut past = ids.len();
    loop {
        let (tok, lp, finish) =
            sample_step(&mut sampler, constraint.as_deref_mut(), &logits, vocab, out.tokens.len() + 1, past + 1, ctx)?;
        out.tokens.push(tok);
        out.logprobs.push(lp);
        if let Some(f) = finish {
            out.finish = f;
            break;
        }
        let step = decode_inputs(model, tok, past, inputs.rope_delta)?;
        logits = forward_logits(model, &step, &mut cache, 1)?.squeeze(0)?;
        past += 1;
    }
    Ok(out)
}

/// One sampling step, shared by the dense reference above and the paged engine: picks a token under
/// the optional constraint and says whether generation ends with it. `generated` and `total`
/// count the tokens after this one (generated only / prompt + generated).
pub fn sample_step(
    sampler: &mut Sampler,
    mut constraint: Option<&mut (dyn TokenConstraint + '_)>,
    logits: &Tensor,
    vocab: usize,
    generated: usize,
    total: usize,
    ctx: usize,
) -> Result<(u32, f32, Option<FinishReason>)> {
    let mask = match constraint.as_deref_mut() {
        Some(c) => c.allowed(vocab)?,
        None => None,
    };
    let picked = sampler.sample_masked(logits, mask.as_deref())?;
    settle_step(sampler, constraint, picked, generated, total, ctx)
}

/// The end of a sampling step once `(token, log-prob)` is picked: the constraint commits it,
/// and the step says whether generation ends (stop token, length, context, constraint done).
pub fn settle_step(
    sampler: &Sampler,
    constraint: Option<&mut (dyn TokenConstraint + '_)>,
    (tok, lp): (u32, f32),
    generated: usize,
    total: usize,
    ctx: usize,
) -> Result<(u32, f32, Option<FinishReason>)> {
    if let Some(c) = constraint {
        c.commit(tok)?;
        if c.is_finished() {
            return Ok((tok, lp, Some(FinishReason::Stop)));
        }
    }
    let finish = if sampler.params.stop_token_ids.contains(&tok) {
        Some(FinishReason::Stop)
    } else if generated >= sampler.params.max_new_tokens {
        Some(FinishReason::Length)
    } else if total >= ctx {
        Some(FinishReason::Context)
    } else {
        None
    };
    Ok((tok, lp, finish))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn greedy_picks_max_and_reports_logprob() {
        let mut s = Sampler::new(SamplingParams::default());
        let (t, lp) = s.sample(&logits(&[0.0, 2.0, 1.0])).unwrap();
        assert_eq!(t, 1);
        let expected = 2.0 - (1f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((lp - expected).abs() < 1e-6);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let p = SamplingParams { temperature: 1.0, top_k: 2, seed: 7, ..Default::default() };
        let l = logits(&[1.0, 1.1, 0.9, 1.05, -3.0]);
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..200).map(|_| s.sample(&l).unwrap().0).collect::<Vec<_>>()
        };
        let a = draw(&p);
        assert_eq!(a, draw(&p));
        assert!(a.iter().all(|&t| t == 1 || t == 3), "top-k=2 keeps ids 1 and 3 only");
        assert!(a.contains(&1) && a.contains(&3));
        let other = draw(&SamplingParams { seed: 8, ..p.clone() });
        assert_ne!(a, other);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let p = SamplingParams { temperature: 1.0, top_p: 0.5, seed: 1, ..Default::default() };
        let mut s = Sampler::new(p);
        let l = logits(&[5.0, 0.0, 0.0, 0.0]); // id 0 holds > 95 % of the mass
        assert!((0..100).all(|_| s.sample(&l).unwrap().0 == 0));
    }

    #[test]
    fn mask_restricts_choice_but_not_logprob() {
        let mut s = Sampler::new(SamplingParams::default());
        let l = logits(&[3.0, 1.0, 2.0]);
        let (t, lp) = s.sample_masked(&l, Some(&[false, true, true])).unwrap();
        assert_eq!(t, 2);
        let expected = 2.0 - (3f32.exp() + 1f32.exp() + 2f32.exp()).ln();
        assert!((lp - expected).abs() < 1e-6);
        assert!(s.sample_masked(&l, Some(&[false, false, false])).is_err());
        let mut hot = Sampler::new(SamplingParams { temperature: 1.5, seed: 4, ..Default::default() });
        assert!((0..50).all(|_| hot.sample_masked(&l, Some(&[false, true, false])).unwrap().0 == 1));
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
    }
}
