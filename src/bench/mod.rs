//! The five-agent prefix-cache workload (`merg bench-agents`): per dialogue, MPA → CAEF → PSP →
//! SGRG → GRA, then one refinement round re-running CAEF → PSP → SGRG, each agent's prompt
//! being the shared part (system, dialogue, keyframe) followed by its own instruction and the
//! upstream outputs. All dialogues advance stage by stage as one batch, as `merg eval` would
//! run them. The same workload runs with the prefix cache on and off in one process.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::chat::{ContentPart, Message};
use crate::engine::{ChatRequest, Engine, EngineConfig, EngineStats, KvMemory, SchedulerConfig};
use crate::generate::{SamplingParams, VisionInput};
use crate::checkpoint::Checkpoint;
use crate::vision::Media;

pub mod server;

/// Agent instructions, in pipeline order, the refinement round re-running agents 2–4.
const AGENTS: [(&str, &str); 5] = [
    ("MPA", "You are the multimodal perception agent. List concrete textual cues from the dialogue and visual cues from the keyframe (facial expression, posture, scene), each tied to its source turn or frame. Answer in JSON."),
    ("CAEF", "You are the consistency-aware emotion forecaster. Given the evidence, judge whether the text and visual cues agree, and forecast the emotion the reply should carry: one of neutral, joy, surprise, anger, sadness, disgust, fear. Answer in JSON."),
    ("PSP", "You are the pragmatic strategy planner. Plan the reply as a communication goal, an interpersonal stance, a tactic and a tone, consistent with the forecasted emotion. Answer in JSON."),
    ("SGRG", "You are the strategy-grounded response generator. Write the next turn for the listener, realising the plan, the forecasted emotion and the evidence, in one or two natural sentences."),
    ("GRA", "You are the global reflection agent. Audit the evidence, the emotion, the plan and the reply in order; for each say pass or fail with a correction, and name the earliest faulty agent. Answer in JSON."),
];
const REFINE: [usize; 3] = [1, 2, 3];

/// Every dialogue's agent calls in order: the five agents, then the refinement round.
fn schedule() -> Vec<usize> {
    (0..AGENTS.len()).chain(REFINE).collect()
}

/// Short sitcom-style dialogues (speaker, utterance); lengths resemble MELD's.
const DIALOGUES: [&[(&str, &str)]; 4] = [
    &[("Monica", "Okay, everybody relax. This is not even a date."), ("Joey", "C'mon, you're going out with the guy! There's gotta be something wrong with him!"), ("Chandler", "All right Joey, be nice. So does he have a hump? A hump and a hairpiece?"), ("Phoebe", "Wait, does he eat chalk?"), ("Monica", "Just, 'cause, I don't want her to go through what I went through with Carl. Oh!"), ("Ross", "Hi."), ("Joey", "This guy says hello, I wanna kill myself.")],
    &[("Rachel", "I can't believe it, I just got the job at Ralph Lauren!"), ("Ross", "That's amazing, Rach! When do you start?"), ("Rachel", "Monday! But I have to tell Mr. Kaplan today and he's going to freak out."), ("Chandler", "Just say you found something closer to your heart. Works for me every time I quit."), ("Rachel", "You've never quit anything."), ("Chandler", "Exactly, it hasn't failed me yet.")],
    &[("Phoebe", "So my grandmother's cab finally died this morning."), ("Joey", "Oh no, Pheebs, I'm sorry. Are you okay?"), ("Phoebe", "Yeah, I mean, it was really old, but it was where I grew up, you know?"), ("Monica", "We could all chip in and help you fix it up."), ("Phoebe", "That's really sweet, but I think it's time to let it go.")],
    &[("Ross", "Did you eat my sandwich? The one with the moist maker?"), ("Chandler", "I might have had a bite. It was in the office fridge!"), ("Ross", "It had my name on it! It was the only good thing in my life right now!"), ("Chandler", "Okay, okay, I'm sorry. I'll make you another one."), ("Ross", "You can't just make another one. My sandwich!")],
];

#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub prefix_caching: bool,
    pub wall_s: f64,
    pub requests: usize,
    pub stats: EngineStats,
}

#[derive(Clone, Debug, Serialize)]
pub struct AgentsReport {
    pub dialogues: usize,
    pub keyframes: usize,
    pub new_tokens: usize,
    pub with_cache: RunReport,
    /// The first cache-off run (none with zero repeats).
    pub without_cache: Option<RunReport>,
    /// Share of submitted prompt tokens served from the cache (with cache on).
    pub cache_hit_fraction: f64,
    /// Prompt tokens computed with cache / without.
    pub computed_ratio: Option<f64>,
    /// Wall time with cache / without: the median over the repeated (on, off) pairs.
    pub wall_ratio: Option<f64>,
    /// Dialogues completed per minute with the cache on.
    pub dialogues_per_minute: f64,
    /// Each pair's ratio, in run order (a shared 2-core box is noisy: single runs vary ±20 %).
    pub wall_ratios: Vec<f64>,
    /// Each pair's wall times, (cache on, cache off) seconds, in run order.
    pub pair_walls_s: Vec<(f64, f64)>,
}

fn dialogue_text(d: &[(&str, &str)], listener: &str) -> String {
    let mut s = String::from("Dialogue history:\n");
    for (spk, utt) in d {
        s.push_str(&format!("{spk}: {utt}\n"));
    }
    s.push_str(&format!("The next turn is spoken by {listener}.\n"));
    s
}

fn request(d: usize, agent: usize, upstream: &[(usize, String)], keyframes: &[image::RgbImage], new_tokens: usize) -> ChatRequest {
    let dlg = DIALOGUES[d % DIALOGUES.len()];
    let listener = dlg[dlg.len() - 2].0;
    // Shared part first (system, keyframe, dialogue); agent-specific text last.
    let mut content = vec![];
    let mut media = vec![];
    for img in keyframes {
        content.push(ContentPart::Image);
        media.push(Media::Image(img.clone()));
    }
    let mut text = dialogue_text(dlg, listener);
    for (a, out) in upstream {
        text.push_str(&format!("{} output: {out}\n", AGENTS[*a].0));
    }
    text.push_str(AGENTS[agent].1);
    content.push(ContentPart::Text(text));
    let system = "You are part of a multi-agent system that writes empathetic replies in multimodal dialogues. Be concrete and faithful to the evidence.";
    ChatRequest {
        messages: vec![Message::text("system", system), Message::new("user", content)],
        media,
        sampling: SamplingParams { max_new_tokens: new_tokens, stop_token_ids: vec![u32::MAX], ..Default::default() },
        schema: None,
        constraint: None,
    }
}

/// Keeps `agent`'s output for a dialogue's later agents; a refinement round replaces the
/// stage's earlier output.
fn record(outputs: &mut Vec<(usize, String)>, agent: usize, text: String) {
    outputs.retain(|(a, _)| *a != agent);
    outputs.push((agent, text));
}

/// Runs the workload on a fresh engine from `make_checkpoint`.
pub fn run_once(
    make_checkpoint: &dyn Fn() -> Result<Checkpoint>,
    cfg: &EngineConfig,
    dialogues: usize,
    new_tokens: usize,
    keyframes: &[image::RgbImage],
) -> Result<RunReport> {
    let mut engine = Engine::new(make_checkpoint()?, cfg.clone())?;
    let schedule = schedule();
    let mut outputs: Vec<Vec<(usize, String)>> = vec![vec![]; dialogues];
    let t0 = Instant::now();
    let mut requests = 0;
    for &agent in &schedule {
        let reqs = (0..dialogues).map(|d| request(d, agent, &outputs[d], keyframes, new_tokens)).collect::<Vec<_>>();
        requests += reqs.len();
        for (d, r) in engine.run_all(reqs).into_iter().enumerate() {
            record(&mut outputs[d], agent, r?.text);
        }
    }
    Ok(RunReport { prefix_caching: cfg.prefix_caching, wall_s: t0.elapsed().as_secs_f64(), requests, stats: engine.stats() })
}

pub fn run_agents(
    make_checkpoint: &dyn Fn() -> Result<Checkpoint>,
    cfg: &EngineConfig,
    dialogues: usize,
    new_tokens: usize,
    keyframes: &[image::RgbImage],
    repeats: usize,
) -> Result<AgentsReport> {
    let on = EngineConfig { prefix_caching: true, ..cfg.clone() };
    let off = EngineConfig { prefix_caching: false, ..cfg.clone() };
    // Alternate on/off so slow phases of a shared machine hit both sides alike; with no
    // repeats, the cache-on run alone (a side-by-side needs only that one).
    let with_cache = run_once(make_checkpoint, &on, dialogues, new_tokens, keyframes)?;
    let mut pairs = vec![];
    for i in 0..repeats {
        let a = if i == 0 { with_cache.clone() } else { run_once(make_checkpoint, &on, dialogues, new_tokens, keyframes)? };
        let b = run_once(make_checkpoint, &off, dialogues, new_tokens, keyframes)?;
        pairs.push((a, b));
    }
    let wall_ratios: Vec<f64> = pairs.iter().map(|(a, b)| a.wall_s / b.wall_s).collect();
    let pair_walls_s = pairs.iter().map(|(a, b)| (a.wall_s, b.wall_s)).collect();
    let without_cache = pairs.into_iter().next().map(|(_, b)| b);
    let mut sorted = wall_ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let p = &with_cache.stats.prefix;
    Ok(AgentsReport {
        dialogues,
        keyframes: keyframes.len(),
        new_tokens,
        cache_hit_fraction: p.cached_tokens as f64 / p.prompt_tokens.max(1) as f64,
        computed_ratio: without_cache.as_ref().map(|w| p.computed_tokens as f64 / w.stats.prefix.computed_tokens.max(1) as f64),
        wall_ratio: sorted.get(sorted.len() / 2).copied(),
        dialogues_per_minute: dialogues as f64 * 60.0 / with_cache.wall_s,
        wall_ratios,
        pair_walls_s,
        with_cache,
        without_cache,
    })
}

/// `batch` sequences decoding together on the paged engine (`merg bench --batch`).
#[derive(Clone, Debug, Serialize)]
pub struct BatchedDecode {
    pub batch: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Engine steps after every sequence had its first token (each one a batched decode).
    pub decode_steps: usize,
    pub decode_s: f64,
    /// Tokens generated per second by all sequences together, over those steps.
    pub tokens_per_s: f64,
}

/// Aggregate decode speed of `batch` sequences with `prompt_tokens`-token prompts (distinct,
/// so nothing is shared) generating `decode_tokens` each: the clock starts once every
/// sequence has its first token, so prefill is left out.
pub fn batched_decode(ckpt: Checkpoint, batch: usize, prompt_tokens: usize, decode_tokens: usize) -> Result<BatchedDecode> {
    anyhow::ensure!(batch > 0 && prompt_tokens > 0 && decode_tokens > 1, "a batched decode needs sequences, a prompt and at least two new tokens");
    let spec = ckpt.model.spec().clone();
    let block = 16;
    let per_seq = (prompt_tokens + decode_tokens + 1).div_ceil(block);
    let cfg = EngineConfig {
        block_size: block,
        kv_memory: KvMemory::Blocks(batch * per_seq + 1),
        prefix_caching: false,
        scheduler: SchedulerConfig { max_num_seqs: batch, ..Default::default() },
        ..Default::default()
    };
    let mut engine = Engine::new(ckpt, cfg)?;
    // Ordinary ids below the vision specials (a placeholder id would demand image features).
    let hi = spec.special.vision_start.min(spec.vocab_size as u32).max(2);
    for s in 0..batch {
        let ids: Vec<u32> = (0..prompt_tokens as u32).map(|i| 1 + (i * 7919 + s as u32 * 104_729) % (hi - 1)).collect();
        let inputs = crate::generate::prepare(&**engine.model(), &ids, &VisionInput::default())?;
        // No stop token: every sequence runs its full length.
        let sampling = SamplingParams { max_new_tokens: decode_tokens, stop_token_ids: vec![u32::MAX], ..Default::default() };
        engine.add_inputs(ids, vec![], inputs, sampling, None)?;
    }
    let mut started = std::collections::HashSet::new();
    let (mut t0, mut tokens, mut steps) = (None, 0usize, 0usize);
    while engine.has_pending() {
        let out = engine.step()?;
        if let Some((id, e)) = out.failed.first() {
            anyhow::bail!("batched decode: sequence {id} failed: {e}");
        }
        if t0.is_some() {
            tokens += out.tokens.len();
            steps += 1;
        }
        started.extend(out.tokens.iter().map(|t| t.0));
        if t0.is_none() && started.len() == batch {
            t0 = Some(Instant::now());
        }
    }
    let decode_s = t0.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    Ok(BatchedDecode { batch, prompt_tokens, decode_tokens, decode_steps: steps, decode_s, tokens_per_s: tokens as f64 / decode_s.max(1e-9) })
}
