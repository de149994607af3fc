//! Agent prompts: the Jinja templates in `prompts/` (compiled in, overridable from a directory)
//! and the shared prefix every agent call starts with.
//!
//! Layout of every call, chosen for the prefix cache: `[system (shared)] [user: dialogue header,
//! turns with their keyframes and audio clips (shared), agent-specific text (last)]`. Everything
//! up to the last keyframe or clip is byte-identical across agents and rounds, so the engine
//! computes it once.
//! Dialogue text and upstream outputs only ever enter as text parts, which the tokenizer treats
//! as data: they cannot produce control tokens.

use std::path::Path;

use anyhow::{Context, Result};
use minijinja::Environment;
use serde::Serialize;

use crate::chat::{ContentPart, Message};
use crate::dialogue::Dialogue;
use crate::vision::Media;

use super::frames::Keyframe;
use super::hearing::Clip;

/// Template names and their built-in sources.
const BUILTIN: [(&str, &str); 9] = [
    ("system", include_str!("../../prompts/system.j2")),
    ("dialogue", include_str!("../../prompts/dialogue.j2")),
    ("mpa", include_str!("../../prompts/mpa.j2")),
    ("caef", include_str!("../../prompts/caef.j2")),
    ("psp", include_str!("../../prompts/psp.j2")),
    ("sgrg", include_str!("../../prompts/sgrg.j2")),
    ("gra", include_str!("../../prompts/gra.j2")),
    ("plain", include_str!("../../prompts/plain.j2")),
    ("coe", include_str!("../../prompts/coe.j2")),
];

pub struct Prompts {
    env: Environment<'static>,
}

impl Prompts {
    /// The templates shipped in `prompts/`.
    pub fn builtin() -> Self {
        Self::with_sources(BUILTIN.iter().map(|(n, s)| (n.to_string(), s.to_string())).collect()).expect("built-in templates compile")
    }

    /// Templates from `dir/<name>.j2` where present, built-in ones otherwise.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let mut sources = vec![];
        for (name, builtin) in BUILTIN {
            let p = dir.join(format!("{name}.j2"));
            let src = if p.exists() {
                crate::input::read_string(&p, &crate::input::TEMPLATE).context("reading a prompt template")?
            } else {
                builtin.to_string()
            };
            sources.push((name.to_string(), src));
        }
        Self::with_sources(sources)
    }

    fn with_sources(sources: Vec<(String, String)>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Output is plain text for a model, not HTML.
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        env.set_fuel(Some(crate::chat::TEMPLATE_FUEL));
        for (name, src) in sources {
            env.add_template_owned(name.clone(), src).with_context(|| format!("prompt template {name}.j2"))?;
        }
        Ok(Prompts { env })
    }

    pub fn render<S: Serialize>(&self, name: &str, ctx: S) -> Result<String> {
        let t = self.env.get_template(name).with_context(|| format!("prompt template {name}"))?;
        let s = t.render(ctx).map_err(|e| match e.kind() {
            minijinja::ErrorKind::OutOfFuel => anyhow::anyhow!(
                "rendering prompt template {name}.j2 stopped after {} steps: the template runs away (a loop that does not end?)",
                crate::chat::TEMPLATE_FUEL
            ),
            _ => anyhow::Error::new(e).context(format!("rendering prompt template {name}.j2")),
        })?;
        Ok(s.trim().to_string())
    }
}

/// The part of every agent call that does not depend on the agent: system text, dialogue,
/// keyframes and audio clips.
#[derive(Clone)]
pub struct SharedContext {
    pub system: String,
    pub parts: Vec<ContentPart>,
    pub media: Vec<Media>,
    pub next_speaker: String,
    pub n_turns: usize,
    pub n_frames: usize,
    pub n_audio: usize,
}

impl SharedContext {
    pub fn build(prompts: &Prompts, dialogue: &Dialogue, frames: &[Keyframe]) -> Result<Self> {
        Self::build_heard(prompts, dialogue, frames, &[])
    }

    /// Each turn's text, then its keyframes, then its audio clip; dialogue-wide keyframes last.
    /// Without clips the prefix is exactly `build`'s.
    pub fn build_heard(prompts: &Prompts, dialogue: &Dialogue, frames: &[Keyframe], clips: &[Clip]) -> Result<Self> {
        let n_turns = dialogue.turns.len();
        let n_audio = clips.len();
        let system = prompts.render("system", minijinja::context! { n_audio })?;
        let header = prompts.render("dialogue", minijinja::context! { n_turns, n_frames => frames.len(), n_audio })?;
        let mut parts = vec![ContentPart::Text(format!("{header}\n"))];
        let mut media = vec![];
        let (mut fi, mut ci) = (0, 0);
        for (ti, turn) in dialogue.turns.iter().enumerate() {
            parts.push(ContentPart::Text(format!("[T{}] {}: {}\n", ti + 1, turn.speaker, turn.text)));
            // Keyframes follow the turn they were taken from; dialogue-wide frames come last.
            while fi < frames.len() && frames[fi].turn == Some(ti) {
                push_frame(&mut parts, &mut media, &frames[fi], fi);
                fi += 1;
            }
            while ci < clips.len() && clips[ci].turn == ti {
                push_clip(&mut parts, &mut media, &clips[ci], ci);
                ci += 1;
            }
        }
        if let Some(c) = clips.get(ci) {
            anyhow::bail!("the audio clip {} belongs to turn {}, which is out of order or beyond the dialogue's {n_turns} turns", c.source, c.turn + 1);
        }
        for (k, f) in frames.iter().enumerate().skip(fi) {
            push_frame(&mut parts, &mut media, f, k);
        }
        Ok(SharedContext {
            system,
            parts,
            media,
            next_speaker: dialogue.next_speaker.clone(),
            n_turns,
            n_frames: frames.len(),
            n_audio,
        })
    }

    /// The full messages of one call: the shared prefix, then the agent's own text.
    pub fn messages(&self, agent_text: &str) -> Vec<Message> {
        let mut user = self.parts.clone();
        user.push(ContentPart::Text(format!("\n{agent_text}")));
        vec![Message::text("system", self.system.clone()), Message::new("user", user)]
    }
}

fn push_frame(parts: &mut Vec<ContentPart>, media: &mut Vec<Media>, f: &Keyframe, index: usize) {
    let from = match f.turn {
        Some(t) => format!("of T{}", t + 1),
        None => "of the video".to_string(),
    };
    parts.push(ContentPart::Text(format!("[F{}] keyframe {from}: ", index + 1)));
    parts.push(ContentPart::Image);
    parts.push(ContentPart::Text("\n".into()));
    media.push(Media::Image(f.image.clone()));
}

fn push_clip(parts: &mut Vec<ContentPart>, media: &mut Vec<Media>, c: &Clip, index: usize) {
    parts.push(ContentPart::Text(format!("[A{}] audio of T{}: ", index + 1, c.turn + 1)));
    parts.push(ContentPart::Audio);
    parts.push(ContentPart::Text("\n".into()));
    media.push(Media::Audio(c.pcm.clone()));
}
