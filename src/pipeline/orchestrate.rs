//! Rounds, reflection and selection.
//!
//! Round 0 runs MPA → CAEF → PSP → SGRG (ablated agents skipped), then GRA audits c1..c4. While
//! some enabled stage fails and fewer than `t_max` refinement rounds have run, the next round
//! re-runs from the earliest failing stage with GRA's corrections; earlier outputs are kept,
//! later ones regenerated. The final reply is the round maximising (c1, c2, c3, c4, −t)
//! lexicographically (ties favour earlier rounds), or the last round with selection off.
//!
//! Fallbacks (recorded in the trace): an agent output that does not parse counts as absent
//! for downstream agents; a reply that does not parse is retried once greedily with twice the
//! budget, then the item fails; a GRA verdict that does not parse ends refinement and gives
//! that round the tuple (false, false, false, false).

use std::time::Instant;

use anyhow::{bail, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::caef::{self, Forecast};
use super::frames::{FrameReport, Keyframe};
use super::gra::{self, Verdict};
use super::hearing::{self, AudioReport, Clip};
use super::model::{reply_logprobs, AgentCall, AgentModel};
use super::mpa::{self, Evidence};
use super::prompt::{Prompts, SharedContext};
use super::psp::{self, Plan};
use super::retrieval::{context_text, Exemplar, Memory};
use super::sgrg::{self, ReplyOut};
use super::trace::{AgentRecord, RoundRecord, Totals, Trace};
use super::{Baseline, Mode, PipelineConfig, Stage};
use crate::dialogue::Dialogue;
use crate::generate::{FinishReason, SamplingParams};

pub struct Pipeline<'a> {
    pub model: &'a dyn AgentModel,
    pub prompts: &'a Prompts,
    pub memory: Option<&'a Memory>,
    pub cfg: &'a PipelineConfig,
}

/// Outputs of the four stages within one round.
#[derive(Clone, Default)]
struct State {
    evidence: Option<Evidence>,
    forecast: Option<Forecast>,
    plan: Option<Plan>,
    reply: Option<(String, Vec<f32>)>,
}

/// Variables every agent template can use.
#[derive(Serialize)]
struct Vars<'a> {
    next_speaker: &'a str,
    n_turns: usize,
    n_frames: usize,
    n_audio: usize,
    labels: &'a [String],
    stances: &'a [&'a str],
    tones: &'a [&'a str],
    evidence: Option<String>,
    forecast: Option<String>,
    plan: Option<String>,
    reply: Option<String>,
    exemplars: Vec<&'a Exemplar>,
    correction: Option<String>,
}

impl<'a> Pipeline<'a> {
    /// Answers `dialogue` with keyframes already collected by `frames::collect`.
    pub fn respond(&self, dialogue: &Dialogue, keyframes: Vec<Keyframe>, frame_report: FrameReport) -> Result<Trace> {
        self.respond_heard(dialogue, keyframes, frame_report, vec![], AudioReport::default())
    }

    /// Answers `dialogue` with keyframes and audio clips (`hearing::collect`). The clips are
    /// ignored, with a note, when `use_audio` is off or the model does not hear.
    pub fn respond_heard(
        &self,
        dialogue: &Dialogue,
        mut keyframes: Vec<Keyframe>,
        mut frame_report: FrameReport,
        mut clips: Vec<Clip>,
        mut audio_report: AudioReport,
    ) -> Result<Trace> {
        self.cfg.validate()?;
        dialogue.validate()?;
        let started = Instant::now();
        let mut notes = vec![];
        if !dialogue.next_speaker_is_known() {
            notes.push(format!("next speaker {:?} does not appear in the history", dialogue.next_speaker));
        }
        self.hear(&mut clips, &mut audio_report);
        self.fit_media(dialogue, &mut keyframes, &mut frame_report, &mut clips, &mut audio_report)?;
        // What the agents hear, whoever collected the clips.
        audio_report.kept = clips.iter().map(|c| c.source.clone()).collect();
        let shared = SharedContext::build_heard(self.prompts, dialogue, &keyframes, &clips)?;
        let exemplars: Vec<(f64, &Exemplar)> = match (self.memory, self.cfg.baseline) {
            (Some(m), None) => m.search(&context_text(dialogue), self.cfg.top_k, dialogue.id.as_deref()),
            _ => vec![],
        };
        if self.cfg.top_k > 0 && self.memory.is_none() && self.cfg.baseline.is_none() {
            notes.push("no exemplar memory given: SGRG runs without exemplars".into());
        }
        let mut run = Run { p: self, shared: &shared, exemplars: exemplars.iter().map(|e| e.1).collect(), notes };
        let (rounds, selected) = match self.cfg.baseline {
            Some(b) => (vec![run.baseline(b)?], 0),
            None => run.rounds()?,
        };
        let mut totals = Totals::default();
        rounds.iter().flat_map(|r| &r.calls).for_each(|c| totals.add(c));
        totals.ms = started.elapsed().as_secs_f64() * 1e3;
        let chosen = &rounds[selected];
        Ok(Trace {
            dialogue_id: dialogue.id.clone(),
            next_speaker: dialogue.next_speaker.clone(),
            turns: dialogue.turns.len(),
            config: self.cfg.clone(),
            frames: frame_report,
            audio: audio_report,
            notes: run.notes,
            exemplars: exemplars.iter().map(|(s, e)| (e.key.clone(), *s)).collect(),
            selected_round: selected,
            selection_rule: if self.cfg.selects_by_tuple() {
                "argmax over rounds of (c1, c2, c3, c4, -t)".into()
            } else {
                "last round".into()
            },
            reply: chosen.reply.clone(),
            emotion: chosen.forecast.as_ref().map(|f| f.emotion.clone()),
            plan: chosen.plan.clone(),
            reply_logprobs: chosen.reply_logprobs.clone(),
            totals,
            rounds,
        })
    }

    /// The clips the agents hear: none when hearing is off or the model has no ears (noted),
    /// otherwise each cut to the model's audio window.
    fn hear(&self, clips: &mut Vec<Clip>, report: &mut AudioReport) {
        if !self.cfg.use_audio {
            if clips.is_empty() {
                report.notes.push("hearing is off (use_audio false)".into());
            }
            hearing::ignore(clips, report, "hearing is off (use_audio false)");
        } else if !self.model.hears() {
            hearing::ignore(clips, report, "the model does not hear (it has no audio encoder)");
        } else if let Some(w) = self.model.audio_window() {
            hearing::fit_to_window(clips, w, report);
        }
    }

    /// Drops the oldest keyframes and clips until the longest call (GRA, quoting every upstream
    /// output) fits the context window.
    fn fit_media(&self, d: &Dialogue, keyframes: &mut Vec<Keyframe>, report: &mut FrameReport, clips: &mut Vec<Clip>, audio: &mut AudioReport) -> Result<()> {
        let budget = self.cfg.sampling.max_new_tokens;
        let window = self.model.context_window();
        let probe = self.prompts.render("gra", self.vars(&SharedContext::build_heard(self.prompts, d, &[], clips)?, &State::default(), vec![], None, false))?;
        hearing::fit_to_context(keyframes, report, clips, audio, |kf, cl| {
            let shared = SharedContext::build_heard(self.prompts, d, kf, cl)?;
            let n = self.model.count_tokens(&shared.messages(&probe), &shared.media)?;
            // GRA's own output (double budget) plus room for the four upstream outputs it
            // quotes (schema-capped, so together about one budget).
            Ok(n + 3 * budget <= window)
        })
    }

    fn vars<'s>(&'s self, shared: &'s SharedContext, st: &State, exemplars: Vec<&'s Exemplar>, correction: Option<String>, upstream: bool) -> Vars<'s> {
        Vars {
            next_speaker: &shared.next_speaker,
            n_turns: shared.n_turns,
            n_frames: shared.n_frames,
            n_audio: shared.n_audio,
            labels: &self.cfg.labels,
            stances: &psp::STANCES,
            tones: &psp::TONES,
            evidence: st.evidence.as_ref().filter(|_| upstream).map(Evidence::render),
            forecast: st.forecast.as_ref().filter(|_| upstream).map(Forecast::render),
            plan: st.plan.as_ref().filter(|_| upstream).map(Plan::render),
            reply: st.reply.as_ref().map(|r| r.0.clone()),
            exemplars,
            correction,
        }
    }
}

struct Run<'p, 'a> {
    p: &'p Pipeline<'a>,
    shared: &'p SharedContext,
    exemplars: Vec<&'p Exemplar>,
    notes: Vec<String>,
}

impl Run<'_, '_> {
    fn cfg(&self) -> &PipelineConfig {
        self.p.cfg
    }

    fn rounds(&mut self) -> Result<(Vec<RoundRecord>, usize)> {
        let cfg = self.p.cfg;
        let enabled = |s: Stage| cfg.enabled(s);
        let mut rounds: Vec<RoundRecord> = vec![];
        let mut state = State::default();
        let mut start = Stage::ALL.into_iter().find(|&s| enabled(s)).expect("SGRG is always enabled");
        let mut verdict: Option<Verdict> = None;
        for t in 0..=cfg.t_max {
            let mut calls = vec![];
            for stage in Stage::ALL.into_iter().filter(|&s| s >= start && enabled(s)) {
                let correction = verdict.as_ref().map(|v| v.check(stage)).filter(|c| !c.pass).map(|c| c.correction.clone());
                self.run_stage(stage, t, &mut state, correction, &mut calls)?;
            }
            let reason = verdict.as_ref().map(|v| v.check(start).correction.clone());
            let mut rec = RoundRecord {
                round: t,
                start,
                reason,
                calls,
                evidence: state.evidence.clone(),
                forecast: state.forecast.clone(),
                plan: state.plan.clone(),
                reply: state.reply.as_ref().map(|r| r.0.clone()).unwrap_or_default(),
                reply_logprobs: state.reply.as_ref().map(|r| r.1.clone()).unwrap_or_default(),
                verdict: None,
                tuple: [true; 4],
            };
            if !cfg.use_gra {
                rounds.push(rec);
                break;
            }
            let (v, call) = self.audit(t, &state)?;
            rec.calls.push(call);
            rec.tuple = v.as_ref().map(|v| v.flags(enabled)).unwrap_or([false; 4]);
            rec.verdict = v.clone();
            rounds.push(rec);
            let Some(v) = v else {
                self.notes.push(format!("round {t}: GRA gave no usable verdict; refinement stops"));
                break;
            };
            match v.earliest_fault(enabled) {
                Some(s) if t < cfg.t_max => start = s,
                _ => break,
            }
            verdict = Some(v);
        }
        let selected = if cfg.selects_by_tuple() { select(&rounds) } else { rounds.len() - 1 };
        Ok((rounds, selected))
    }

    fn run_stage(&mut self, stage: Stage, round: usize, st: &mut State, correction: Option<String>, calls: &mut Vec<AgentRecord>) -> Result<()> {
        let cascaded = self.cfg().mode == Mode::Cascaded;
        let upstream: Vec<String> = if cascaded {
            let have = [st.evidence.is_some(), st.forecast.is_some(), st.plan.is_some()];
            Stage::ALL.into_iter().zip(have).filter(|(s, h)| *s < stage && *h).map(|(s, _)| s.name().to_string()).collect()
        } else {
            vec![]
        };
        // Each agent sees only the upstream outputs before it (never a stale downstream one).
        let visible = State {
            evidence: st.evidence.clone().filter(|_| stage > Stage::Mpa),
            forecast: st.forecast.clone().filter(|_| stage > Stage::Caef),
            plan: st.plan.clone().filter(|_| stage > Stage::Psp),
            reply: None,
        };
        let exemplars = if stage == Stage::Sgrg { self.exemplars.clone() } else { vec![] };
        let vars = self.p.vars(self.shared, &visible, exemplars.clone(), correction.clone(), cascaded);
        let text = self.p.prompts.render(stage.name(), &vars)?;
        let c = self.p.cfg;
        let schema = match stage {
            Stage::Mpa => mpa::schema(self.shared.n_turns, self.shared.n_frames, self.shared.n_audio, c.max_field_chars),
            Stage::Caef => caef::schema(&c.labels, self.shared.n_frames, self.shared.n_audio, c.max_field_chars),
            Stage::Psp => psp::schema(c.max_field_chars),
            Stage::Sgrg => sgrg::schema(2 * c.max_field_chars),
        };
        let sampling = self.sampling(round, stage as u64);
        let ex_keys: Vec<String> = exemplars.iter().map(|e| e.key.clone()).collect();
        let (mut out, mut rec, mut lps) = self.call(stage.name(), round, &text, schema.clone(), sampling, upstream.clone(), correction.clone(), ex_keys.clone())?;
        match stage {
            Stage::Mpa => st.evidence = parse(&out),
            Stage::Caef => st.forecast = parse(&out),
            Stage::Psp => st.plan = parse(&out),
            Stage::Sgrg => {
                if parse::<ReplyOut>(&out).is_none() {
                    calls.push(rec);
                    let mut retry = self.sampling(round, stage as u64);
                    retry.temperature = 0.0;
                    retry.max_new_tokens *= 2;
                    self.notes.push(format!("round {round}: SGRG output did not parse; retried greedily with {} tokens", retry.max_new_tokens));
                    (out, rec, lps) = self.call(stage.name(), round, &text, schema, retry, upstream, correction, ex_keys)?;
                }
                match parse::<ReplyOut>(&out) {
                    Some(r) => st.reply = Some((r.reply, lps)),
                    None => bail!("SGRG produced no complete reply: its output {} before the JSON closed; raise max_new_tokens: {}", rec.finish, rec.raw),
                }
            }
        }
        let usable = match stage {
            Stage::Mpa => st.evidence.is_some(),
            Stage::Caef => st.forecast.is_some(),
            Stage::Psp => st.plan.is_some(),
            Stage::Sgrg => true, // a reply that does not parse is an error above
        };
        if !usable {
            self.notes.push(format!("round {round}: {} output unusable; later agents run without it", stage.name()));
        }
        calls.push(rec);
        Ok(())
    }

    fn audit(&mut self, round: usize, st: &State) -> Result<(Option<Verdict>, AgentRecord)> {
        let vars = self.p.vars(self.shared, st, vec![], None, true);
        let text = self.p.prompts.render("gra", &vars)?;
        let mut sampling = self.sampling(round, 4);
        // Four verdicts, each with a correction: twice an agent's budget.
        sampling.max_new_tokens *= 2;
        let (out, rec, _) = self.call("gra", round, &text, gra::schema(self.cfg().max_field_chars), sampling, vec!["mpa".into(), "caef".into(), "psp".into(), "sgrg".into()], None, vec![])?;
        Ok((parse(&out), rec))
    }

    fn baseline(&mut self, b: Baseline) -> Result<RoundRecord> {
        let vars = self.p.vars(self.shared, &State::default(), vec![], None, false);
        let (name, schema) = match b {
            Baseline::Plain => ("plain", sgrg::schema(2 * self.cfg().max_field_chars)),
            Baseline::Coe => ("coe", coe_schema(&self.cfg().labels, self.cfg().max_field_chars)),
        };
        let text = self.p.prompts.render(name, &vars)?;
        let (out, rec, lps) = self.call(name, 0, &text, schema, self.sampling(0, 5), vec![], None, vec![])?;
        let Some(v) = out else { bail!("the {name} baseline produced no complete output: it {}: {}", rec.finish, rec.raw) };
        let reply = v["reply"].as_str().unwrap_or_default().to_string();
        let forecast = v["reply_emotion"].as_str().map(|e| Forecast {
            text_emotion: v["emotion"].as_str().unwrap_or_default().into(),
            visual_emotion: "none".into(),
            audio_emotion: None,
            consistency: "no_visual".into(),
            rationale: v["cause"].as_str().unwrap_or_default().into(),
            emotion: e.into(),
        });
        Ok(RoundRecord {
            round: 0,
            start: Stage::Sgrg,
            reason: None,
            calls: vec![rec],
            evidence: None,
            forecast,
            plan: None,
            reply,
            reply_logprobs: lps,
            verdict: None,
            tuple: [true; 4],
        })
    }

    /// Per-call sampling: the seed depends on (seed, round, agent) only, so a run is
    /// reproducible and a re-run agent does not repeat its rejected output by chance.
    fn sampling(&self, round: usize, agent: u64) -> SamplingParams {
        let mut s = self.cfg().sampling.clone();
        s.seed = s.seed.wrapping_mul(1_000_003).wrapping_add(round as u64 * 16 + agent);
        s
    }

    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        agent: &'static str,
        round: usize,
        text: &str,
        schema: Value,
        sampling: SamplingParams,
        upstream: Vec<String>,
        correction: Option<String>,
        exemplars: Vec<String>,
    ) -> Result<(Option<Value>, AgentRecord, Vec<f32>)> {
        // Only outputs carrying a reply need the token-to-text mapping perplexity uses.
        let has_reply = schema["properties"].get("reply").is_some();
        let call = AgentCall { agent, round, messages: self.shared.messages(text), media: self.shared.media.clone(), schema, sampling };
        let r = self.p.model.call(call).map_err(|e| e.context(format!("agent {agent}, round {round}")))?;
        let (output, error) = match (r.finish, serde_json::from_str::<Value>(&r.text)) {
            (FinishReason::Stop, Ok(v)) => (Some(v), None),
            (f, Ok(_)) => (None, Some(format!("output ended by {f:?}"))),
            (f, Err(e)) => (None, Some(format!("not JSON ({e}); ended by {f:?}"))),
        };
        let rec = AgentRecord {
            agent: agent.into(),
            round,
            upstream,
            correction,
            exemplars,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            generated_tokens: r.tokens.len(),
            finish: r.finish,
            ms: r.ms,
            output: output.clone(),
            raw: r.text,
            error,
        };
        let lps = if has_reply { reply_logprobs(&rec.raw, &self.p.model.decoded_offsets(&r.tokens)?, &r.logprobs) } else { vec![] };
        Ok((output, rec, lps))
    }
}

fn parse<T: DeserializeOwned>(v: &Option<Value>) -> Option<T> {
    v.clone().and_then(|v| serde_json::from_value(v).ok())
}

/// Index of the round maximising (c1, c2, c3, c4, −t): lexicographic on the pass flags, the
/// earliest round among equals.
pub fn select(rounds: &[RoundRecord]) -> usize {
    let mut best = 0;
    for (i, r) in rounds.iter().enumerate() {
        if r.tuple > rounds[best].tuple {
            best = i;
        }
    }
    best
}

/// Chain-of-Empathy in one generation (the Empatheia seed's reasoning order).
fn coe_schema(labels: &[String], max_chars: usize) -> Value {
    let text = serde_json::json!({"type": "string", "minLength": 1, "maxLength": max_chars});
    let reply = sgrg::schema(2 * max_chars)["properties"]["reply"].clone();
    serde_json::json!({
        "type": "object",
        "properties": {"event": text, "emotion": {"enum": labels}, "cause": text, "intent": text, "reply_emotion": {"enum": labels}, "reply": reply},
        "required": ["event", "emotion", "cause", "intent", "reply_emotion", "reply"],
        "additionalProperties": false
    })
}
