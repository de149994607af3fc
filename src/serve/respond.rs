//! `POST /v1/merg/respond`: the dialogue JSON of `merg respond`, with keyframes inline as
//! base64 images and each turn's audio as a base64 WAV/MP3/FLAC instead of file paths, through
//! the five-agent pipeline; answers the reply and the trace. Concurrent dialogues batch in the engine like any other requests. The server
//! reads no files for a client: paths and videos are refused. `pipeline` overrides fields of
//! the server's pipeline defaults; `frames` the keyframe policy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::{parse_json, RequestBody};
use super::{media, merge_json, ApiError, AppState, Flavor, Limits};
use crate::data::labels::LabelSet;
use crate::dialogue::{Dialogue, Turn};
use crate::engine::EngineError;
use crate::pipeline::frames::{cap, evenly, FrameOptions, FrameReport, Keyframe};
use crate::pipeline::hearing::{AudioReport, Clip};
use crate::pipeline::model::EngineModel;
use crate::pipeline::{Pipeline, PipelineConfig};

const F: Flavor = Flavor::OpenAi;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RespondReq {
    #[serde(default)]
    pub model: Option<String>,
    pub dialogue: InlineDialogue,
    /// Fields of the pipeline configuration to override (`t_max`, `use_gra`, `sampling`, ...).
    #[serde(default)]
    pub pipeline: Option<Value>,
    #[serde(default)]
    pub frames: Option<FramesReq>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InlineDialogue {
    #[serde(default)]
    pub id: Option<String>,
    pub turns: Vec<InlineTurn>,
    pub next_speaker: String,
    /// Keyframes of the whole dialogue (base64 images, time order).
    #[serde(default)]
    pub frames: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InlineTurn {
    pub speaker: String,
    #[serde(alias = "utterance", alias = "Utterance")]
    pub text: String,
    /// Keyframes of this turn (base64 images, time order).
    #[serde(default)]
    pub frames: Vec<String>,
    /// This turn's audio (base64 WAV, MP3 or FLAC; a `data:` URL prefix is allowed).
    #[serde(default)]
    pub audio: Option<String>,
    #[serde(default)]
    pub emotion: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FramesReq {
    pub frames_per_turn: Option<usize>,
    pub max_frames: Option<usize>,
    pub max_audio: Option<usize>,
    pub skip_bad_media: Option<bool>,
}

/// Sets its flag when dropped: the handler's future was dropped, so the client went away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

pub async fn respond(State(state): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Json<Value>, ApiError> {
    let mut req: RespondReq = parse_json(F, &body)?;
    if let Some(m) = &req.model {
        state.check_model(F, m)?;
    }
    let (cfg, opts) = settings(&mut req, &state.cfg.pipeline, &state.cfg.frames)?;
    let slot = state.acquire(F)?;
    let gone = Arc::new(AtomicBool::new(false));
    let _guard = CancelOnDrop(gone.clone());
    let st = state.clone();
    let run = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let (dialogue, keyframes, report, heard) = checked_dialogue(req.dialogue, &opts, cfg.use_audio, &st.cfg.limits)?;
        let st2 = st.clone();
        let model = EngineModel::with_cancel(st.handle.clone(), Arc::new(move || gone.load(Ordering::SeqCst) || st2.cancelled()));
        let pipeline = Pipeline { model: &model, prompts: &st.cfg.prompts, memory: st.cfg.memory.as_ref(), cfg: &cfg };
        let trace = pipeline.respond_heard(&dialogue, keyframes, report, heard.clips, heard.report).map_err(pipeline_error)?;
        let t = &trace.totals;
        st.metrics.record(t.calls, t.prompt_tokens, t.cached_tokens, t.generated_tokens);
        Ok::<_, ApiError>(json!({"reply": trace.reply, "emotion": trace.emotion, "trace": trace}))
    });
    let out = run.await.map_err(|e| ApiError::new(F, 500, format!("the pipeline run failed: {e}")))??;
    Ok(Json(out))
}

/// A `/v1/merg/respond` request, checked: what the pipeline gets.
pub struct Checked {
    pub dialogue: Dialogue,
    pub keyframes: Vec<Keyframe>,
    pub report: FrameReport,
    pub audio: Heard,
    pub cfg: PipelineConfig,
}

/// The turns' audio clips decoded from a request, and the report of what was kept.
#[derive(Default)]
pub struct Heard {
    pub clips: Vec<Clip>,
    pub report: AudioReport,
}

/// Body bytes to the pipeline's input without a model or a server, over the server's
/// `defaults` and `frames` policy: everything the handler checks but the model name. Any
/// error is a 4xx (tests/fuzz's `serve_request` holds it to that).
pub fn parse_request(body: &[u8], defaults: &PipelineConfig, frames: &FrameOptions, limits: &Limits) -> Result<Checked, ApiError> {
    let mut req: RespondReq = parse_json(F, body)?;
    let (cfg, opts) = settings(&mut req, defaults, frames)?;
    let (dialogue, keyframes, report, audio) = checked_dialogue(req.dialogue, &opts, cfg.use_audio, limits)?;
    Ok(Checked { dialogue, keyframes, report, audio, cfg })
}

/// The pipeline configuration and frame policy: the server's, with the request's overrides
/// (`pipeline` and `frames` are taken out of `req`).
fn settings(req: &mut RespondReq, defaults: &PipelineConfig, frames: &FrameOptions) -> Result<(PipelineConfig, FrameOptions), ApiError> {
    let cfg = pipeline_config(defaults, req.pipeline.take().as_ref())?;
    let f = req.frames.take().unwrap_or_default();
    let opts = FrameOptions {
        frames_per_turn: f.frames_per_turn.unwrap_or(frames.frames_per_turn),
        max_frames: f.max_frames.unwrap_or(frames.max_frames),
        max_audio: f.max_audio.unwrap_or(frames.max_audio),
        skip_bad_media: f.skip_bad_media.unwrap_or(frames.skip_bad_media),
    };
    Ok((cfg, opts))
}

/// The dialogue with its keyframes and (when `hear`) its turns' audio decoded, validated.
fn checked_dialogue(mut d: InlineDialogue, opts: &FrameOptions, hear: bool, limits: &Limits) -> Result<(Dialogue, Vec<Keyframe>, FrameReport, Heard), ApiError> {
    let heard = if hear { inline_audio(&d.turns, opts, limits)? } else { Heard::default() };
    d.turns.iter_mut().for_each(|t| t.audio = None);
    let (dialogue, keyframes, report) = inline_dialogue(d, opts, limits)?;
    dialogue.validate().map_err(|e| ApiError::bad(F, format!("dialogue: {e:#}")))?;
    Ok((dialogue, keyframes, report, heard))
}

/// The audio of the `max_audio` most recent turns that have any, decoded (older ones are not),
/// at most the server's `max_audio` limit; an undecodable clip is a 400 naming its field, or
/// with `skip_bad_media` a note.
fn inline_audio(turns: &[InlineTurn], opts: &FrameOptions, limits: &Limits) -> Result<Heard, ApiError> {
    let with_audio: Vec<(usize, &str)> = turns.iter().enumerate().filter_map(|(ti, t)| t.audio.as_deref().map(|a| (ti, a))).collect();
    let keep_from = with_audio.len().saturating_sub(opts.max_audio);
    media::check_audio_count(with_audio.len() - keep_from, limits).map_err(|e| ApiError::bad(F, format!("{e} (frames.max_audio keeps fewer)")))?;
    let mut heard = Heard::default();
    let field = |ti: usize| format!("dialogue.turns[{ti}].audio");
    if keep_from > 0 {
        heard.report.notes.push(format!("{} audio clips given, max_audio {}: the {keep_from} oldest were not decoded", with_audio.len(), opts.max_audio));
        heard.report.dropped = with_audio[..keep_from].iter().map(|&(ti, _)| field(ti)).collect();
    }
    for &(ti, b64) in &with_audio[keep_from..] {
        match decode_audio(b64, &field(ti)) {
            Ok(pcm) => heard.clips.push(Clip { turn: ti, source: field(ti), pcm }),
            Err(e) if opts.skip_bad_media => heard.report.notes.push(format!("skipped unreadable audio: {e}")),
            Err(e) => return Err(ApiError::bad(F, format!("{e} (frames.skip_bad_media continues without it)"))),
        }
    }
    heard.report.kept = heard.clips.iter().map(|c| c.source.clone()).collect();
    Ok(heard)
}

/// Base64 (optionally a `data:` URL) to 16 kHz mono, every audio cap applied; errors name `field`.
fn decode_audio(b64: &str, field: &str) -> Result<crate::audio::Pcm, String> {
    use base64::Engine as _;
    let data = match b64.split_once(";base64,") {
        Some((head, rest)) if head.starts_with("data:") => rest,
        _ => b64,
    };
    let bytes = base64::engine::general_purpose::STANDARD.decode(data.trim()).map_err(|e| format!("{field}: not base64: {e}"))?;
    crate::audio::load_audio_bytes(&bytes, field).map_err(|e| e.to_string())
}

/// The server's defaults with the request's overrides; unknown settings are refused (a typo
/// must not silently run the default). `labels` may be a set name or a list.
fn pipeline_config(base: &PipelineConfig, over: Option<&Value>) -> Result<PipelineConfig, ApiError> {
    let Some(over) = over else { return Ok(base.clone()) };
    let Value::Object(fields) = over else { return Err(ApiError::bad(F, "pipeline must be an object of settings")) };
    let mut merged = serde_json::to_value(base).map_err(|e| ApiError::new(F, 500, e.to_string()))?;
    let known: Vec<String> = merged.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let mut over = over.clone();
    for k in fields.keys() {
        if !known.contains(k) {
            return Err(ApiError::bad(F, format!("pipeline: unknown setting {k:?}; known: {}", known.join(", "))));
        }
    }
    if let Some(Value::String(spec)) = fields.get("labels") {
        let set = LabelSet::from_spec(spec).map_err(|e| ApiError::bad(F, format!("pipeline.labels: {e:#}")))?;
        over["labels"] = json!(set.labels);
    }
    merge_json(&mut merged, &over);
    let cfg: PipelineConfig = serde_path_to_error::deserialize(merged).map_err(|e| ApiError::bad(F, format!("pipeline.{}: {}", e.path(), e.inner())))?;
    cfg.validate().map_err(|e| ApiError::bad(F, format!("pipeline: {e:#}")))?;
    Ok(cfg)
}

/// The dialogue with its keyframes: per-turn frames thinned to `frames_per_turn`, all capped
/// to the `max_frames` most recent, and only those decoded.
fn inline_dialogue(d: InlineDialogue, opts: &FrameOptions, limits: &Limits) -> Result<(Dialogue, Vec<Keyframe>, FrameReport), ApiError> {
    let mut picked: Vec<(Option<usize>, String, &str)> = vec![];
    for (ti, t) in d.turns.iter().enumerate() {
        let idx: Vec<usize> = (0..t.frames.len()).collect();
        for &fi in evenly(&idx, opts.frames_per_turn) {
            picked.push((Some(ti), format!("dialogue.turns[{ti}].frames[{fi}]"), &t.frames[fi]));
        }
    }
    for (fi, b64) in d.frames.iter().enumerate() {
        picked.push((None, format!("dialogue.frames[{fi}]"), b64));
    }
    let mut report = FrameReport::default();
    cap(&mut picked, |p| p.1.clone(), opts, &mut report);
    media::check_count(picked.len(), limits).map_err(|e| ApiError::bad(F, e))?;
    let mut keyframes = vec![];
    for (turn, source, b64) in picked {
        match media::from_base64(b64, &source, limits) {
            Ok(image) => keyframes.push(Keyframe { turn, source, image }),
            Err(e) if opts.skip_bad_media => {
                report.notes.push(format!("skipped unreadable media {e}"));
                report.kept.retain(|k| *k != source);
            }
            Err(e) => return Err(ApiError::bad(F, format!("{e} (frames.skip_bad_media continues without it)"))),
        }
    }
    let turns = d.turns.into_iter().map(|t| Turn { emotion: t.emotion, ..Turn::new(t.speaker, t.text) }).collect();
    let dialogue = Dialogue { id: d.id, turns, next_speaker: d.next_speaker, video: None, frames: vec![] };
    Ok((dialogue, keyframes, report))
}

/// A failed run: the engine's own status when it refused a call, 503 when cancelled.
fn pipeline_error(e: anyhow::Error) -> ApiError {
    if let Some(ee) = e.chain().find_map(|c| c.downcast_ref::<EngineError>()) {
        return ApiError::new(F, ee.status(), format!("{e:#}"));
    }
    let msg = format!("{e:#}");
    if msg.contains("cancelled") {
        return ApiError::new(F, 503, msg);
    }
    ApiError::new(F, 500, msg)
}
