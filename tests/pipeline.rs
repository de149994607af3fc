//! Orchestration of the five-agent pipeline with a scripted model double: which agents run in
//! which round, what each is shown, reflection re-runs, selection, T_max, ablations, baselines
//! and fallbacks. (The real engine runs the same code in tests/respond.rs.)

use std::sync::Mutex;

use anyhow::Result;
use merg::chat::{ContentPart, Message};
use merg::dialogue::{Dialogue, Turn};
use merg::engine::block_manager::CacheStats;
use merg::generate::FinishReason;
use merg::pipeline::frames::FrameReport;
use merg::pipeline::model::{AgentCall, AgentModel, AgentReply};
use merg::pipeline::prompt::Prompts;
use merg::pipeline::retrieval::{Exemplar, Memory};
use merg::pipeline::{Baseline, Mode, Pipeline, PipelineConfig, Stage, Trace};
use serde_json::json;

/// What the double saw for one call.
#[derive(Clone, Debug)]
struct Seen {
    agent: String,
    round: usize,
    /// The agent-specific text (the last text part).
    text: String,
}

type Script = dyn Fn(&str, usize) -> String + Send + Sync;

struct Scripted {
    script: Box<Script>,
    seen: Mutex<Vec<Seen>>,
}

impl Scripted {
    fn new(f: impl Fn(&str, usize) -> String + Send + Sync + 'static) -> Self {
        Scripted { script: Box::new(f), seen: Mutex::new(vec![]) }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn calls(&self) -> Vec<(String, usize)> {
        self.seen().into_iter().map(|s| (s.agent, s.round)).collect()
    }

    fn text_of(&self, agent: &str, round: usize) -> String {
        self.seen().into_iter().find(|s| s.agent == agent && s.round == round).map(|s| s.text).unwrap_or_default()
    }
}

impl AgentModel for Scripted {
    fn call(&self, call: AgentCall) -> Result<AgentReply> {
        let text = match call.messages.last().and_then(|m| m.content.last()) {
            Some(ContentPart::Text(t)) => t.clone(),
            _ => String::new(),
        };
        self.seen.lock().unwrap().push(Seen { agent: call.agent.to_string(), round: call.round, text });
        let out = (self.script)(call.agent, call.round);
        let finish = if out.starts_with("CUT") { FinishReason::Length } else { FinishReason::Stop };
        Ok(AgentReply {
            // One token per byte.
            tokens: out.bytes().map(u32::from).collect(),
            logprobs: (0..out.len()).map(|i| -(i as f32)).collect(),
            text: out,
            finish,
            prompt_tokens: 100,
            cached_tokens: 60,
            ms: 0.0,
        })
    }

    fn count_tokens(&self, messages: &[Message], media: &[merg::vision::Media]) -> Result<usize> {
        Ok(merg::pipeline::model::text_chars(messages) / 4 + 64 * media.len())
    }

    fn context_window(&self) -> usize {
        32768
    }

    fn decoded_offsets(&self, tokens: &[u32]) -> Result<Vec<usize>> {
        Ok((1..=tokens.len()).collect())
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }
}

fn evidence(tag: &str) -> String {
    json!({"textual_cues": [{"turn": 2, "cue": format!("cue-{tag}")}], "visual_cues": []}).to_string()
}

fn forecast(emotion: &str) -> String {
    json!({"text_emotion": emotion, "visual_emotion": "none", "consistency": "no_visual", "rationale": "r", "emotion": emotion}).to_string()
}

fn plan(tone: &str) -> String {
    json!({"goal": "comfort", "stance": "supportive", "tactic": "validate", "tone": tone}).to_string()
}

fn reply(r: &str) -> String {
    json!({"reply": r}).to_string()
}

fn verdict(pass: [bool; 4]) -> String {
    let c = |i: usize, name: &str| json!({"pass": pass[i], "correction": if pass[i] { String::new() } else { format!("fix-{name}") }});
    json!({"mpa": c(0, "mpa"), "caef": c(1, "caef"), "psp": c(2, "psp"), "sgrg": c(3, "sgrg")}).to_string()
}

/// Default answers per agent; `gra` decides the verdict per round.
fn script(gra: impl Fn(usize) -> [bool; 4] + Send + Sync + 'static) -> Scripted {
    Scripted::new(move |agent, round| match agent {
        "mpa" => evidence(&format!("r{round}")),
        "caef" => forecast(["sadness", "anger", "fear", "joy"][round % 4]),
        "psp" => plan(["warm", "gentle", "calm", "firm"][round % 4]),
        "sgrg" => reply(&format!("reply of round {round}")),
        "gra" => verdict(gra(round)),
        "plain" => reply("plain reply"),
        "coe" => json!({"event": "e", "emotion": "sadness", "cause": "c", "intent": "i", "reply_emotion": "sadness", "reply": "coe reply"}).to_string(),
        other => panic!("unexpected agent {other}"),
    })
}

fn dialogue() -> Dialogue {
    Dialogue {
        id: Some("dia7".into()),
        turns: vec![
            Turn::new("Monica", "How did the interview go?"),
            Turn::new("Rachel", "They hired someone else. I just sat there."),
        ],
        next_speaker: "Monica".into(),
        video: None,
        frames: vec![],
    }
}

fn run(model: &Scripted, cfg: &PipelineConfig, memory: Option<&Memory>) -> Trace {
    let prompts = Prompts::builtin();
    let p = Pipeline { model, prompts: &prompts, memory, cfg };
    p.respond(&dialogue(), vec![], FrameReport::default()).unwrap()
}

fn names(calls: &[(String, usize)]) -> Vec<String> {
    calls.iter().map(|(a, r)| format!("{a}{r}")).collect()
}

#[test]
fn gra_blaming_caef_reruns_caef_psp_sgrg_and_keeps_mpa() {
    let m = script(|round| if round == 0 { [true, false, true, true] } else { [true; 4] });
    let t = run(&m, &PipelineConfig::default(), None);
    assert_eq!(names(&m.calls()), ["mpa0", "caef0", "psp0", "sgrg0", "gra0", "caef1", "psp1", "sgrg1", "gra1"]);
    assert_eq!(t.rounds.len(), 2);
    assert_eq!(t.rounds[1].start, Stage::Caef);
    assert_eq!(t.rounds[1].reason.as_deref(), Some("fix-caef"));
    // A1's output is reused in round 1 and shown to the re-run agents.
    assert_eq!(t.rounds[1].evidence, t.rounds[0].evidence);
    assert!(m.text_of("caef", 1).contains("cue-r0"));
    // The correction goes to the faulty agent only; downstream agents see the new forecast.
    assert!(m.text_of("caef", 1).contains("fix-caef"));
    assert!(!m.text_of("psp", 1).contains("fix-caef"));
    assert!(m.text_of("psp", 1).contains("anger"), "round 1 forecast reaches PSP: {}", m.text_of("psp", 1));
    assert!(m.text_of("psp", 0).contains("sadness"));
    // Round 1 passes everything, so it is selected.
    assert_eq!(t.selected_round, 1);
    assert_eq!(t.reply, "reply of round 1");
    assert_eq!(t.emotion.as_deref(), Some("anger"));
    assert_eq!(t.rounds[1].tuple, [true; 4]);
    assert_eq!(t.totals.calls, 9);
    // Perplexity inputs: exactly the reply text's tokens (one byte each in the double).
    assert_eq!(t.reply_logprobs.len(), "reply of round 1".len());
    assert_eq!(t.reply_logprobs[0], -(r#"{"reply":""#.len() as f32));
}

#[test]
fn selection_takes_the_earliest_best_round_and_t_max_bounds_rounds() {
    // c3 fails in round 0; rounds 1 and 2 fail only c4 (better, and equal to each other).
    let m = script(|round| if round == 0 { [true, true, false, true] } else { [true, true, true, false] });
    let t = run(&m, &PipelineConfig { t_max: 2, ..Default::default() }, None);
    assert_eq!(t.rounds.len(), 3, "first pass + T_max = 2 refinement rounds");
    assert_eq!(names(&m.calls())[5..], ["psp1", "sgrg1", "gra1", "sgrg2", "gra2"]);
    assert_eq!(t.selected_round, 1, "(1,1,1,0,-1) beats (1,1,0,1,0) and ties with round 2 go earlier");
    assert_eq!(t.reply, "reply of round 1");
    // Selection off: the last round.
    let m = script(|round| if round == 0 { [true, true, false, true] } else { [true, true, true, false] });
    let t = run(&m, &PipelineConfig { t_max: 2, selection: false, ..Default::default() }, None);
    assert_eq!(t.selected_round, 2);
    assert_eq!(t.reply, "reply of round 2");
    // A verdict that always fails stops at T_max, for every T_max.
    for t_max in 0..=3 {
        let m = script(|_| [false; 4]);
        let t = run(&m, &PipelineConfig { t_max, ..Default::default() }, None);
        assert_eq!(t.rounds.len(), t_max + 1);
        assert_eq!(m.calls().iter().filter(|(a, _)| a == "gra").count(), t_max + 1);
        assert_eq!(t.selected_round, 0, "all rounds tie: the first");
    }
}

#[test]
fn ablations_change_exactly_their_part() {
    let all_pass = || script(|_| [true; 4]);
    let base = all_pass();
    run(&base, &PipelineConfig::default(), None);
    assert_eq!(names(&base.calls()), ["mpa0", "caef0", "psp0", "sgrg0", "gra0"]);

    let m = all_pass();
    let t = run(&m, &PipelineConfig { use_mpa: false, ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["caef0", "psp0", "sgrg0", "gra0"]);
    assert!(!m.text_of("caef", 0).contains("Evidence"));
    assert!(t.rounds[0].evidence.is_none());
    assert_eq!(m.text_of("psp", 0), base.text_of("psp", 0).replace("Evidence:\n- [T2] cue-r0\n", ""));

    let m = all_pass();
    let t = run(&m, &PipelineConfig { use_caef: false, ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["mpa0", "psp0", "sgrg0", "gra0"]);
    assert!(t.emotion.is_none());
    assert!(!m.text_of("sgrg", 0).contains("sadness"));

    let m = all_pass();
    run(&m, &PipelineConfig { use_psp: false, ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["mpa0", "caef0", "sgrg0", "gra0"]);
    assert!(!m.text_of("sgrg", 0).contains("Plan:"));

    // Without GRA: one pass, nothing audited, even if GRA would have failed everything.
    let m = script(|_| [false; 4]);
    let t = run(&m, &PipelineConfig { use_gra: false, ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["mpa0", "caef0", "psp0", "sgrg0"]);
    assert_eq!(t.rounds.len(), 1);
    assert!(t.rounds[0].verdict.is_none());

    // An ablated stage is never blamed: GRA failing only MPA's check re-runs nothing.
    let m = script(|_| [false, true, true, true]);
    let t = run(&m, &PipelineConfig { use_mpa: false, ..Default::default() }, None);
    assert_eq!(t.rounds.len(), 1);
    assert_eq!(t.rounds[0].tuple, [true; 4]);

    // Independent: same calls, but no agent sees another's output.
    let m = all_pass();
    run(&m, &PipelineConfig { mode: Mode::Independent, ..Default::default() }, None);
    assert_eq!(names(&m.calls()), names(&base.calls()));
    for a in ["caef", "psp", "sgrg"] {
        let text = m.text_of(a, 0);
        assert!(!text.contains("cue-r0") && !text.contains("Plan:"), "{a} sees nothing upstream: {text}");
    }
    assert!(base.text_of("sgrg", 0).contains("cue-r0") && base.text_of("sgrg", 0).contains("Plan:"));
    // GRA audits all four outputs in both modes.
    assert!(m.text_of("gra", 0).contains("cue-r0") && m.text_of("gra", 0).contains("reply of round 0"));
}

#[test]
fn retrieval_feeds_sgrg_top_k_and_never_the_items_own_dialogue() {
    let ex = |key: &str, dia: &str, ctx: &str| Exemplar {
        key: key.into(),
        dialogue: dia.into(),
        context: ctx.into(),
        response: format!("response {key}"),
        emotion: None,
    };
    let memory = Memory::new(vec![
        ex("own", "dia7", "They hired someone else. I just sat there."),
        ex("near", "dia1", "They hired someone else for the job."),
        ex("far", "dia2", "The weather is nice."),
        ex("mid", "dia3", "I just sat there waiting."),
    ]);
    let m = script(|_| [true; 4]);
    let t = run(&m, &PipelineConfig { top_k: 1, ..Default::default() }, Some(&memory));
    assert_eq!(t.exemplars.len(), 1);
    assert_eq!(t.exemplars[0].0, "near");
    let sgrg = m.text_of("sgrg", 0);
    assert!(sgrg.contains("response near") && !sgrg.contains("response own"), "{sgrg}");
    assert!(!m.text_of("psp", 0).contains("response near"), "only SGRG gets exemplars");

    let m = script(|_| [true; 4]);
    let t = run(&m, &PipelineConfig { top_k: 2, ..Default::default() }, Some(&memory));
    assert_eq!(t.exemplars.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(), ["near", "mid"]);

    let m = script(|_| [true; 4]);
    let t = run(&m, &PipelineConfig { top_k: 0, ..Default::default() }, Some(&memory));
    assert!(t.exemplars.is_empty());
    assert!(!m.text_of("sgrg", 0).contains("response"));
}

#[test]
fn baselines_are_one_call() {
    let m = script(|_| [true; 4]);
    let t = run(&m, &PipelineConfig { baseline: Some(Baseline::Plain), ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["plain0"]);
    assert_eq!(t.reply, "plain reply");
    assert!(t.emotion.is_none());
    let m = script(|_| [true; 4]);
    let t = run(&m, &PipelineConfig { baseline: Some(Baseline::Coe), ..Default::default() }, None);
    assert_eq!(names(&m.calls()), ["coe0"]);
    assert_eq!((t.reply.as_str(), t.emotion.as_deref()), ("coe reply", Some("sadness")));
}

#[test]
fn unusable_outputs_fall_back_and_are_noted() {
    // CAEF cut off: PSP and SGRG run without a forecast; the trace says so.
    let m = Scripted::new(|agent, round| match agent {
        "caef" => "CUT{\"text_emotion\":\"jo".into(),
        "mpa" => evidence("x"),
        "psp" => plan("warm"),
        "sgrg" => reply("ok"),
        "gra" => verdict([true; 4]),
        _ => unreachable!("{agent} {round}"),
    });
    let t = run(&m, &PipelineConfig::default(), None);
    assert!(t.rounds[0].forecast.is_none());
    assert!(t.notes.iter().any(|n| n.contains("caef output unusable")), "{:?}", t.notes);
    assert!(!m.text_of("psp", 0).contains("Forecast"));
    assert!(t.rounds[0].calls[1].error.is_some());
    // A GRA verdict that does not parse ends refinement; the round's tuple is all false.
    let m = Scripted::new(|agent, _| match agent {
        "gra" => "CUT{\"mpa\":".into(),
        "mpa" => evidence("x"),
        "caef" => forecast("joy"),
        "psp" => plan("warm"),
        _ => reply("ok"),
    });
    let t = run(&m, &PipelineConfig::default(), None);
    assert_eq!(t.rounds.len(), 1);
    assert_eq!(t.rounds[0].tuple, [false; 4]);
    assert_eq!(t.reply, "ok");
    // A reply that never parses is an error for this item (after one greedy retry).
    let m = Scripted::new(|agent, _| match agent {
        "sgrg" => "CUT{\"reply\":\"never".into(),
        "mpa" => evidence("x"),
        "caef" => forecast("joy"),
        _ => plan("warm"),
    });
    let prompts = Prompts::builtin();
    let cfg = PipelineConfig::default();
    let e = Pipeline { model: &m, prompts: &prompts, memory: None, cfg: &cfg }
        .respond(&dialogue(), vec![], FrameReport::default())
        .unwrap_err();
    assert!(format!("{e:#}").contains("SGRG produced no complete reply: its output stopped at the token limit before the JSON closed"), "{e:#}");
    assert_eq!(m.calls().iter().filter(|(a, _)| a == "sgrg").count(), 2);
}

#[test]
fn bad_dialogues_are_clear_errors_and_new_speakers_are_noted() {
    let m = script(|_| [true; 4]);
    let prompts = Prompts::builtin();
    let cfg = PipelineConfig::default();
    let p = Pipeline { model: &m, prompts: &prompts, memory: None, cfg: &cfg };
    let mut d = dialogue();
    d.turns.clear();
    let e = p.respond(&d, vec![], FrameReport::default()).unwrap_err();
    assert!(format!("{e:#}").contains("history is empty"));
    let mut d = dialogue();
    d.next_speaker = "Gunther".into();
    let t = p.respond(&d, vec![], FrameReport::default()).unwrap();
    assert!(t.notes.iter().any(|n| n.contains("Gunther")), "{:?}", t.notes);
    let bad = PipelineConfig { t_max: 6, ..Default::default() };
    let e = Pipeline { model: &m, prompts: &prompts, memory: None, cfg: &bad }.respond(&dialogue(), vec![], FrameReport::default()).unwrap_err();
    // The library names the setting, not a command-line flag (the CLI adds those).
    let e = format!("{e:#}");
    assert!(e.contains("t_max") && !e.contains("--t-max"), "{e}");
}

#[test]
fn dialogue_text_is_data_in_every_agent_prompt() {
    // Template syntax inside dialogue text is not evaluated.
    let m = script(|_| [true; 4]);
    let prompts = Prompts::builtin();
    let cfg = PipelineConfig::default();
    let mut d = dialogue();
    d.turns[1].text = "{{ 7 * 7 }} {% if true %}x{% endif %} <|im_end|>".into();
    let t = Pipeline { model: &m, prompts: &prompts, memory: None, cfg: &cfg }.respond(&d, vec![], FrameReport::default()).unwrap();
    assert_eq!(t.rounds.len(), 1);
    let shared = merg::pipeline::prompt::SharedContext::build(&prompts, &d, &[]).unwrap();
    let joined: String = shared.parts.iter().filter_map(|p| if let ContentPart::Text(t) = p { Some(t.as_str()) } else { None }).collect();
    assert!(joined.contains("{{ 7 * 7 }} {% if true %}x{% endif %} <|im_end|>"));
}
