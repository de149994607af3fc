//! Chat messages and HF-compatible Jinja chat-template rendering.
//!
//! Rendering mirrors `transformers` (`apply_chat_template`): a sandboxed Jinja environment with
//! `trim_blocks` and `lstrip_blocks` on, loop controls, `raise_exception`, and Python string
//! methods (via `minijinja_contrib::pycompat`). Messages are passed in HF's list format:
//! every message's `content` is a list of `{"type": "text", "text": ..}`, `{"type": "image"}`
//! and `{"type": "video"}` parts, exactly what `Qwen2VLProcessor.apply_chat_template` receives
//! from callers that use multimodal messages. (Qwen2-VL's template branches on
//! `message['content'] is string`, but both branches render the same bytes for text, so the
//! list form is never wrong for it, and it is the only form that can carry media.)

use anyhow::{anyhow, bail, Context, Result};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// One part of a message's content. Media payloads (pixels) live elsewhere; only their
/// position matters here, and the order of parts is preserved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContentPart {
    Text(String),
    Image,
    Video,
    /// An audio clip (rendered as `{"type": "audio"}`; Qwen2.5-Omni's template writes
    /// `<|audio_bos|><|AUDIO|><|audio_eos|>`).
    Audio,
}

/// A chat message: a role (`system`, `user`, `assistant`, ...) and ordered content parts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Vec<ContentPart>,
}

impl Message {
    /// A message with a single text part.
    pub fn text(role: impl Into<String>, text: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: vec![ContentPart::Text(text.into())],
        }
    }

    /// A message with arbitrary parts.
    pub fn new(role: impl Into<String>, content: Vec<ContentPart>) -> Self {
        Self {
            role: role.into(),
            content,
        }
    }
}

/// Parses messages in HF's JSON format: `[{"role": .., "content": "text" | [parts]}]`, parts
/// being `{"type": "text", "text": ..}`, `{"type": "image", ..}` (also `image_url`) or
/// `{"type": "video", ..}`; media payload fields are ignored. A string content becomes one
/// text part (Qwen2-VL's template renders both forms identically).
pub fn messages_from_hf_json(v: &serde_json::Value) -> Result<Vec<Message>> {
    let list = v.as_array().context("messages must be a JSON array")?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(|r| r.as_str())
            .with_context(|| format!("messages[{i}] has no string \"role\""))?;
        let content = match m.get("content") {
            Some(serde_json::Value::String(s)) => vec![ContentPart::Text(s.clone())],
            Some(serde_json::Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| {
                    part_from_hf_json(p).with_context(|| format!("messages[{i}].content[{j}]"))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(serde_json::Value::Null) | None => vec![],
            Some(_) => bail!("messages[{i}].content must be a string or a list of parts"),
        };
        out.push(Message {
            role: role.to_string(),
            content,
        });
    }
    Ok(out)
}

fn part_from_hf_json(p: &serde_json::Value) -> Result<ContentPart> {
    let ty = p.get("type").and_then(|t| t.as_str());
    match ty {
        Some("text") => {
            let t = p
                .get("text")
                .and_then(|t| t.as_str())
                .context("text part has no string \"text\"")?;
            Ok(ContentPart::Text(t.to_string()))
        }
        Some("image") | Some("image_url") => Ok(ContentPart::Image),
        Some("video") => Ok(ContentPart::Video),
        Some("audio") | Some("input_audio") | Some("audio_url") => Ok(ContentPart::Audio),
        Some(other) => bail!("unsupported content part type {other:?}"),
        None if p.get("image").is_some() || p.get("image_url").is_some() => Ok(ContentPart::Image),
        None if p.get("video").is_some() => Ok(ContentPart::Video),
        None if p.get("audio").is_some() || p.get("audio_url").is_some() => Ok(ContentPart::Audio),
        None => bail!("content part has no \"type\""),
    }
}

/// The chat template shipped with Qwen2-VL-*-Instruct (`chat_template.json` and
/// `tokenizer_config.json`). Qwen2.5-VL-*-Instruct ships the same template byte for byte.
pub const QWEN2_VL_CHAT_TEMPLATE: &str = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// See [`QWEN2_VL_CHAT_TEMPLATE`]; kept as its own name so callers say which model they mean.
pub const QWEN2_5_VL_CHAT_TEMPLATE: &str = QWEN2_VL_CHAT_TEMPLATE;

/// The chat template shipped with Qwen3-VL-*-Instruct (no default system prompt; tools).
pub const QWEN3_VL_CHAT_TEMPLATE: &str = include_str!("../models/qwen3-vl-chat-template.jinja");

/// The released chat template of a family, for checkpoints made from a config alone (dummy
/// weights): what its Instruct models ship.
pub fn default_chat_template(model_type: &str) -> &'static str {
    match model_type {
        "qwen3_vl" | "qwen3_vl_moe" => QWEN3_VL_CHAT_TEMPLATE,
        "qwen3_5" => QWEN3_5_CHAT_TEMPLATE,
        _ => QWEN2_VL_CHAT_TEMPLATE,
    }
}

/// The chat template shipped with Qwen3.5 (thinking blocks; merg renders it with
/// `enable_thinking` false).
pub const QWEN3_5_CHAT_TEMPLATE: &str = include_str!("../models/qwen3.5-chat-template.jinja");

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// Where the template came from, for errors.
    origin: String,
    /// Special-token strings the template may name (`bos_token`, `eos_token`), as transformers
    /// passes the tokenizer's special tokens.
    tokens: Vec<(String, String)>,
}

const TEMPLATE_NAME: &str = "chat_template";

/// Template steps allowed per render. A Qwen chat template spends a few dozen per message, so
/// this allows conversations of many thousands of turns, while a template looping 10^10 times
/// stops within a second or two.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template; syntax errors are reported with their line.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        // transformers compiles with trim_blocks=True, lstrip_blocks=True; whitespace
        // handling is what makes byte-identical rendering possible.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", py_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("chat template does not compile: {}", describe(&e)))?;
        Ok(Self {
            env,
            source: source.to_string(),
            origin: "the chat template".into(),
            tokens: vec![],
        })
    }

    /// Names where the template came from in render errors ("the chat template of <dir>").
    pub fn with_origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = origin.into();
        self
    }

    /// Sets the special-token strings the template may use (`bos_token` → `<bos>`).
    pub fn with_tokens(mut self, tokens: Vec<(String, String)>) -> Self {
        self.tokens = tokens;
        self
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` like `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let msgs: Vec<serde_json::Value> = messages.iter().map(|m| hf_message(m, None)).collect();
        self.render_values(msgs, add_generation_prompt)
    }

    /// Renders with every text part replaced by `sentinel(k)` (k counts text parts over the
    /// whole conversation). Used by the tokenizer to learn where data text lands.
    pub(crate) fn render_with_text(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        sentinel: &dyn Fn(usize) -> String,
    ) -> Result<String> {
        let mut k = 0usize;
        let mut msgs = Vec::with_capacity(messages.len());
        for m in messages {
            msgs.push(hf_message(m, Some((&mut k, sentinel))));
        }
        self.render_values(msgs, add_generation_prompt)
    }

    fn render_values(
        &self,
        msgs: Vec<serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .context("chat template missing")?;
        // Qwen3.5's template opens a <think> block unless told otherwise: merg's agents answer
        // in constrained JSON, so the reasoning block is switched off (templates that do not
        // know the variable ignore it).
        let mut ctx: std::collections::BTreeMap<String, Value> = self.tokens.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
        ctx.insert("messages".into(), Value::from_serialize(&msgs));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("enable_thinking".into(), Value::from(false));
        let ctx = Value::from(ctx);
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => anyhow!("rendering {} stopped after {TEMPLATE_FUEL} steps: the template runs away (a loop that does not end?)", self.origin),
            _ => anyhow!("rendering {} failed: {}", self.origin, describe(&e)),
        })
    }
}

/// One message in HF's dict format; optionally substituting sentinels for text.
fn hf_message(
    m: &Message,
    mut sub: Option<(&mut usize, &dyn Fn(usize) -> String)>,
) -> serde_json::Value {
    let parts: Vec<serde_json::Value> = m
        .content
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => {
                let text = match sub.as_mut() {
                    Some((k, f)) => {
                        let s = f(**k);
                        **k += 1;
                        s
                    }
                    None => t.clone(),
                };
                serde_json::json!({"type": "text", "text": text})
            }
            ContentPart::Image => serde_json::json!({"type": "image"}),
            ContentPart::Video => serde_json::json!({"type": "video"}),
            ContentPart::Audio => serde_json::json!({"type": "audio"}),
        })
        .collect();
    serde_json::json!({"role": m.role, "content": parts})
}

fn raise_exception(msg: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        format!("template raised: {msg}"),
    ))
}

/// `tojson` like transformers' (json.dumps with ensure_ascii=False, Python's separators,
/// optional indent) rather than minijinja's HTML-safe variant, which escapes `<`, `>`, `'`.
fn py_tojson(
    value: Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, JinjaError> {
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(i) => Some(i),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let v: serde_json::Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&v, indent, 0, &mut out);
    Ok(out)
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let nl = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    // Python: separators (', ', ': ') without indent, (',', ': ') with indent.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                nl(out, depth + 1);
                write_py_json(x, indent, depth + 1, out);
            }
            nl(out, depth);
            out.push(']');
        }
        J::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                nl(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(x, indent, depth + 1, out);
            }
            nl(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// minijinja errors carry the useful part (line, detail) in their Display chain.
fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    if let Some(line) = e.line() {
        s.push_str(&format!(" (template line {line})"));
    }
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

/// Reads a chat template from a checkpoint directory, in transformers' order of precedence:
/// `chat_template.jinja`, then `chat_template.json` (`{"chat_template": ..}`), then the
/// `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates
/// from which `default` is taken). Returns `Ok(None)` when none is present.
pub fn find_chat_template(dir: &std::path::Path) -> Result<Option<String>> {
    match own_template_file(dir)? {
        Some(t) => Ok(Some(t)),
        // tokenizer_config.json is read only when no file of the template's own names has one.
        None => template_field(tokenizer_config(dir)?.as_ref()),
    }
}

/// The special-token strings of `tokenizer_config.json` in `dir` a template may name
/// (`bos_token`, `eos_token`, `pad_token`, `unk_token`; a string or `{"content": ..}`); none
/// when the file is absent.
pub fn template_tokens(dir: &std::path::Path) -> Result<Vec<(String, String)>> {
    Ok(tokens_of(tokenizer_config(dir)?.as_ref()))
}

/// [`find_chat_template`] and [`template_tokens`] together, `tokenizer_config.json` read once
/// for both (a tokenizer loading from its directory needs the two).
pub fn template_and_tokens(dir: &std::path::Path) -> Result<(Option<String>, Vec<(String, String)>)> {
    let own = own_template_file(dir)?;
    let config = tokenizer_config(dir)?;
    let template = match own {
        Some(t) => Some(t),
        None => template_field(config.as_ref())?,
    };
    Ok((template, tokens_of(config.as_ref())))
}

/// The chat template of `chat_template.jinja`, else of `chat_template.json`, in `dir`.
fn own_template_file(dir: &std::path::Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return Ok(Some(crate::input::read_string(&jinja, &crate::input::TEMPLATE)?));
    }
    let json = dir.join("chat_template.json");
    if !json.is_file() {
        return Ok(None);
    }
    chat_template_from_json_file(&json)
}

/// A JSON config file: its path (for messages) and its parsed text.
type JsonFile = (std::path::PathBuf, serde_json::Value);

/// `dir/tokenizer_config.json` parsed, with its path for messages; `None` when absent.
fn tokenizer_config(dir: &std::path::Path) -> Result<Option<JsonFile>> {
    let path = dir.join("tokenizer_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let v = read_json(&path)?;
    Ok(Some((path, v)))
}

fn tokens_of(config: Option<&JsonFile>) -> Vec<(String, String)> {
    let Some((_, v)) = config else { return vec![] };
    let content = |t: &serde_json::Value| t.as_str().or_else(|| t.get("content").and_then(|c| c.as_str())).map(str::to_string);
    ["bos_token", "eos_token", "pad_token", "unk_token"]
        .into_iter()
        .filter_map(|k| v.get(k).and_then(content).map(|c| (k.to_string(), c)))
        .collect()
}

fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = crate::input::read_string(path, &crate::input::CONFIG)?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// The `chat_template` field of a JSON config file (string or list of `{name, template}`).
pub fn chat_template_from_json_file(path: &std::path::Path) -> Result<Option<String>> {
    let v = read_json(path)?;
    template_field(Some(&(path.to_path_buf(), v)))
}

/// The `chat_template` field of a parsed JSON config (`None`: no file, no template).
fn template_field(config: Option<&JsonFile>) -> Result<Option<String>> {
    let Some((path, v)) = config else { return Ok(None) };
    match v.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let pick = list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first());
            match pick
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
            {
                Some(s) => Ok(Some(s.to_string())),
                None => bail!(
                    "{}: chat_template list has no usable template entry",
                    path.display()
                ),
            }
        }
        Some(_) => bail!(
            "{}: chat_template must be a string or a list of named templates",
            path.display()
        ),
    }
}
