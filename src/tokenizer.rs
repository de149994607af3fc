//! Tokenization where dialogue text is data: it can never become a control token.
//!
//! HF renders the chat template to one string and tokenizes it, so a user text holding
//! `<|im_end|>` turns into the real control token. We render the template with a sentinel in
//! place of every text part, so we know which bytes are template and which are data. Added
//! (special) tokens are recognised only inside template bytes; everything between two such
//! tokens, template text and data text alike, is tokenized as one segment by a "plain"
//! tokenizer: the same tokenizer.json with its `added_tokens` removed. HF itself splits the
//! string at added tokens and runs normalizer + pre-tokenizer + BPE on each segment on its
//! own, so for data free of special-token strings our ids equal HF's exactly (not merely
//! piecewise-equal); for data that holds them, the text is BPE-split into ordinary pieces,
//! like tiktoken with `disallowed_special=()`.

use crate::chat::{template_and_tokens, ChatTemplate, ContentPart, Message};
use anyhow::{anyhow, bail, Context, Result};
use std::borrow::Cow;
use std::collections::HashSet;
use std::path::Path;
use std::str::FromStr;
use tokenizers::Tokenizer;

mod media;
use media::Expanded;

/// Where a checkpoint's tokenizer.json is: a file, or text rebuilt from a GGUF file.
#[derive(Clone, Debug)]
pub enum TokenizerJson {
    File(std::path::PathBuf),
    Text { origin: String, text: std::sync::Arc<str> },
}

/// Ids of the control tokens a chat needs, in each vocabulary convention merg reads: Qwen's
/// (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<|image_pad|>`, `<|video_pad|>`, the vision
/// markers), Gemma's (`<start_of_turn>`, `<end_of_turn>`, `<eos>`, `<image_soft_token>` between
/// `<start_of_image>` and `<end_of_image>`; no video) or LLaMA's as LLaVA ships it (`</s>` ends
/// turn and text, `<image>`, and no turn start, video or marker tokens: those are `NONE`).
/// Qwen2.5-Omni's vocabulary renames the media tokens (`<|IMAGE|>`, `<|VIDEO|>`, `<|vision_bos|>`,
/// `<|vision_eos|>`) and adds audio (`<|AUDIO|>` between `<|audio_bos|>` and `<|audio_eos|>`);
/// the audio tokens of every other vocabulary are `NONE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Ends the text (`<|endoftext|>`, `</s>`).
    pub endoftext: u32,
    pub im_start: u32,
    /// Ends an assistant turn (`<|im_end|>`, `</s>`).
    pub im_end: u32,
    pub vision_start: u32,
    pub vision_end: u32,
    /// The image placeholder the processor expands (`<|image_pad|>`, `<image>`).
    pub image_pad: u32,
    pub video_pad: u32,
    pub vision_pad: u32,
    /// The audio placeholder (`<|AUDIO|>`) and its markers; `NONE` without audio.
    pub audio_pad: u32,
    pub audio_start: u32,
    pub audio_end: u32,
    pub convention: Convention,
}

/// Which vocabulary convention a tokenizer follows (chosen once, from its token names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Convention {
    Qwen,
    /// Qwen2.5-Omni: Qwen's turns, renamed media tokens, audio.
    QwenOmni,
    Gemma,
    Llama,
}

impl SpecialTokens {
    /// The id of a token the vocabulary does not have: no tokenizer yields it, so comparing a
    /// token with it is always false.
    pub const NONE: u32 = u32::MAX;

    /// The convention `id` resolves, or the tokens neither convention found.
    fn lookup(id: impl Fn(&str) -> Option<u32>) -> std::result::Result<Self, String> {
        let none = Self::NONE;
        // Omni first: it has `<|im_end|>` too, but none of Qwen's media token names.
        if id("<|AUDIO|>").is_some() && id("<|IMAGE|>").is_some() {
            let need = |name: &str| id(name).ok_or_else(|| format!("the Qwen2.5-Omni special token {name}"));
            return Ok(SpecialTokens {
                endoftext: need("<|endoftext|>")?,
                im_start: need("<|im_start|>")?,
                im_end: need("<|im_end|>")?,
                vision_start: need("<|vision_bos|>")?,
                vision_end: need("<|vision_eos|>")?,
                image_pad: need("<|IMAGE|>")?,
                video_pad: need("<|VIDEO|>")?,
                vision_pad: id("<|vision_pad|>").unwrap_or(none),
                audio_pad: need("<|AUDIO|>")?,
                audio_start: need("<|audio_bos|>")?,
                audio_end: need("<|audio_eos|>")?,
                convention: Convention::QwenOmni,
            });
        }
        if id("<|im_end|>").is_some() || id("<|image_pad|>").is_some() {
            let need = |name: &str| id(name).ok_or_else(|| format!("the Qwen2-VL special token {name}"));
            return Ok(SpecialTokens {
                endoftext: need("<|endoftext|>")?,
                im_start: need("<|im_start|>")?,
                im_end: need("<|im_end|>")?,
                vision_start: need("<|vision_start|>")?,
                vision_end: need("<|vision_end|>")?,
                image_pad: need("<|image_pad|>")?,
                video_pad: need("<|video_pad|>")?,
                vision_pad: need("<|vision_pad|>")?,
                audio_pad: none,
                audio_start: none,
                audio_end: none,
                convention: Convention::Qwen,
            });
        }
        // Gemma 3: turns are `<start_of_turn>`/`<end_of_turn>`, and an image is the soft token
        // between its begin/end markers (the template emits only the begin marker).
        if let (Some(start), Some(end), Some(eos), Some(boi), Some(eoi), Some(image_pad)) =
            (id("<start_of_turn>"), id("<end_of_turn>"), id("<eos>"), id("<start_of_image>"), id("<end_of_image>"), id("<image_soft_token>"))
        {
            let (audio_pad, audio_start, audio_end) = (none, none, none);
            let convention = Convention::Gemma;
            return Ok(SpecialTokens { endoftext: eos, im_start: start, im_end: end, vision_start: boi, vision_end: eoi, image_pad, video_pad: none, vision_pad: none, audio_pad, audio_start, audio_end, convention });
        }
        match (id("</s>"), id("<image>")) {
            (Some(eos), Some(image_pad)) => {
                let (audio_pad, audio_start, audio_end) = (none, none, none);
                let convention = Convention::Llama;
                Ok(SpecialTokens { endoftext: eos, im_start: none, im_end: eos, vision_start: none, vision_end: none, image_pad, video_pad: none, vision_pad: none, audio_pad, audio_start, audio_end, convention })
            }
            _ => Err("the media tokens of a known convention (Qwen's <|image_pad|> and <|im_end|>, Qwen2.5-Omni's <|IMAGE|> and <|AUDIO|>, Gemma's <start_of_image> and <image_soft_token>, or LLaVA's <image> and </s>)".into()),
        }
    }

    fn is_media(&self, id: u32) -> bool {
        id == self.image_pad || id == self.video_pad || id == self.audio_pad
    }
}

/// A tokenizer plus (optionally) the checkpoint's chat template.
pub struct ChatTokenizer {
    full: Tokenizer,
    plain: Tokenizer,
    /// A SentencePiece-style tokenizer (Metaspace, prepend scheme "first") marks a word start
    /// only at the very start of the input: HF tokenizes the text after an added token without
    /// it. This is `plain` without the mark, for those segments; `None` where they are alike.
    plain_inner: Option<Tokenizer>,
    /// What the post-processor puts around a prompt (LLaMA's `<s>`), as the HF processor
    /// tokenizes with special tokens added (unless the rendered prompt already starts with it).
    affixes: (Vec<u32>, Vec<u32>),
    /// Gemma 3's template emits only an image's begin marker (`<start_of_image>`): the text the
    /// processor puts in its place (`full_image_sequence`: blank lines around the marker, the
    /// image pad and the end marker). `None` in every other convention.
    image_sequence: Option<String>,
    /// (content, id) of every added token, longest first so matching prefers the longest.
    added: Vec<(String, u32)>,
    added_ids: HashSet<u32>,
    special: SpecialTokens,
    template: Option<ChatTemplate>,
    /// The special-token strings the template may name, kept for a replaced template.
    template_tokens: Vec<(String, String)>,
    /// Bytes of the longest vocabulary entry (as stored: ≥ the bytes it stands for), so a
    /// text of n bytes is at least n / max_token_bytes tokens.
    max_token_bytes: usize,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("has_chat_template", &self.template.is_some())
            .finish()
    }
}

/// Piece of a rendered prompt: template bytes, the k-th text part of the conversation, or
/// that part as the template wrote it (verbatim or trimmed) once fitted.
enum Piece<'a> {
    Template(Cow<'a, str>),
    Data(usize),
    Text(&'a str),
}

/// How one image/video placeholder of the rendered template becomes tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum Placeholder {
    /// `n` copies of the pad token (Qwen2-VL, Qwen2.5-VL, Qwen3-VL images).
    Run(usize),
    /// A Qwen3-VL video: for each temporal step, its time as text (`<1.2 seconds>`), then
    /// vision-start, `per_step` pads, vision-end, in place of the template's
    /// `<|vision_start|><|video_pad|><|vision_end|>` (transformers 4.57's Qwen3VLProcessor), or
    /// of the pad alone, inside the template's markers, with `keep_outer` (transformers 5).
    Steps { per_step: usize, seconds: Vec<f64>, keep_outer: bool },
    /// A Gemma 3 image with pan-and-scan crops: the whole image then each crop, `per_image`
    /// pads each, in the processor's words ("Here is the original image … and here are some
    /// crops to help you see better …").
    Crops { per_image: usize, crops: usize },
    /// An audio clip: `n` copies of the audio pad (Qwen2.5-Omni's `<|AUDIO|>`).
    Audio(usize),
}

impl ChatTokenizer {
    /// Loads `dir/tokenizer.json` and the chat template found beside it
    /// (see [`crate::chat::find_chat_template`]: `chat_template.jinja`, `chat_template.json`, then
    /// `tokenizer_config.json`). A missing template is not an error until `encode_chat`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tok = dir.join("tokenizer.json");
        if !tok.is_file() {
            bail!(
                "tokenizer directory {} has no tokenizer.json",
                dir.display()
            );
        }
        // One read of tokenizer_config.json gives both the template's last fallback and the
        // special-token strings the template may name.
        let (template, tokens) = template_and_tokens(dir)
            .with_context(|| format!("looking for a chat template in {}", dir.display()))?;
        let mut t = Self::from_json_file(&tok, template)?;
        t.set_template_tokens(tokens);
        Ok(t)
    }

    /// Gives the chat template the special-token strings it may name (`bos_token`: Gemma's
    /// template writes `<bos>` itself), as transformers does from the tokenizer config.
    pub fn set_template_tokens(&mut self, tokens: Vec<(String, String)>) {
        if let Some(t) = self.template.take() {
            self.template = Some(t.with_tokens(tokens.clone()));
        }
        self.template_tokens = tokens;
    }

    /// Loads a tokenizer.json and compiles `chat_template` when given.
    pub fn from_files(tokenizer_json: &Path, chat_template: Option<String>) -> Result<Self> {
        let mut tok = Self::from_json_file(tokenizer_json, chat_template)?;
        if let Some(dir) = tokenizer_json.parent() {
            tok.set_template_tokens(crate::chat::template_tokens(dir)?);
        }
        Ok(tok)
    }

    fn from_json_file(tokenizer_json: &Path, chat_template: Option<String>) -> Result<Self> {
        let text = crate::input::read_string(tokenizer_json, &crate::input::TOKENIZER)?;
        Self::from_json(&text, &tokenizer_json.display().to_string(), chat_template)
    }

    /// A tokenizer.json's text; `origin` names it in errors (a path, or the GGUF file it was
    /// rebuilt from).
    pub fn from_json(text: &str, origin: &str, chat_template: Option<String>) -> Result<Self> {
        let mut full = Tokenizer::from_str(text).map_err(|e| anyhow!("{origin} is not a usable tokenizer: {e}"))?;
        // The plain tokenizer shares the model and pipeline but knows no added tokens, so data
        // text is only ever BPE-split. (Cloning the parts is much faster than re-parsing.)
        let mut plain = Tokenizer::new(full.get_model().clone());
        plain
            .with_normalizer(full.get_normalizer().cloned())
            .with_pre_tokenizer(full.get_pre_tokenizer().cloned())
            .with_post_processor(full.get_post_processor().cloned())
            .with_decoder(full.get_decoder().cloned());
        // Silent truncation or padding would corrupt prompts; we never want either.
        for t in [&mut full, &mut plain] {
            t.with_truncation(None)
                .map_err(|e| anyhow!("{origin}: disabling truncation: {e}"))?;
            t.with_padding(None);
        }

        let mut added: Vec<(String, u32)> = full
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        added.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let added_ids = added.iter().map(|(_, id)| *id).collect();

        let special = SpecialTokens::lookup(|name| full.token_to_id(name))
            .map_err(|missing| anyhow!("{origin}: {missing} is not in the vocabulary"))?;
        let plain_inner = without_first_mark(&plain);
        let image_sequence = media::image_sequence(&full, &special);
        let affixes = affixes(&full).map_err(|e| anyhow!("{origin}: {e}"))?;
        let template = match chat_template {
            Some(src) => Some(
                ChatTemplate::new(&src)
                    .with_context(|| format!("chat template for {origin}"))?
                    .with_origin(format!("the chat template of {origin}")),
            ),
            None => None,
        };
        let max_token_bytes = plain.get_vocab(false).keys().map(String::len).max().unwrap_or(1).max(1);
        Ok(Self {
            full,
            plain,
            plain_inner,
            affixes,
            image_sequence,
            added,
            added_ids,
            special,
            template,
            template_tokens: vec![],
            max_token_bytes,
        })
    }

    /// A lower bound on the tokens `text_bytes` of data text become, known without tokenizing
    /// (so an oversized prompt is refused at once, not after seconds and gigabytes of BPE).
    pub fn min_tokens(&self, text_bytes: usize) -> usize {
        text_bytes / self.max_token_bytes
    }

    /// Replaces (or sets) the chat template.
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        self.template = Some(ChatTemplate::new(source)?.with_tokens(self.template_tokens.clone()));
        Ok(())
    }

    /// The chat template, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Tokenizes data text. Never yields added/special tokens: `"<|im_end|>"` in the text
    /// becomes ordinary byte-level pieces.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        // The check guards against vocabularies whose BPE could still reach an added token's id.
        self.checked(&self.plain, text)
    }

    /// Tokenizes `text` as HF would, recognising special tokens in it. Only for template
    /// text and tests; never pass user data here.
    pub fn encode_trusted(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .full
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing trusted text failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The prompt text exactly as transformers' `apply_chat_template(tokenize=False)` renders it.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.template()?.render(messages, add_generation_prompt)
    }

    /// Token ids for a conversation, with media placeholders expanded.
    ///
    /// Every `<|image_pad|>` and `<|video_pad|>` the template emits is one media item; the
    /// k-th such placeholder in the rendered prompt (images and videos in one sequence, in
    /// order of appearance, which for Qwen templates is the order of `Image`/`Video` parts
    /// across all messages) becomes `media_tokens[k]` copies of itself, as Qwen2VLProcessor
    /// does with `grid_thw.prod() / merge_size²`. The number of placeholders must equal
    /// `media_tokens.len()` and each count must be positive.
    pub fn encode_chat(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        media_tokens: &[usize],
    ) -> Result<Vec<u32>> {
        let runs: Vec<Placeholder> = media_tokens.iter().map(|&n| Placeholder::Run(n)).collect();
        self.encode_chat_with(messages, add_generation_prompt, &runs)
    }

    /// `encode_chat` with each placeholder's own expansion (Qwen3-VL videos split into steps).
    pub fn encode_chat_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        media: &[Placeholder],
    ) -> Result<Vec<u32>> {
        let template = self.template()?;
        let texts: Vec<&str> = messages
            .iter()
            .flat_map(|m| m.content.iter())
            .filter_map(|p| match p {
                ContentPart::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let mark = sentinel_char(template.source(), &texts);
        let rendered = template.render_with_text(messages, add_generation_prompt, &|k| {
            format!("{mark}{k}{mark}")
        })?;
        let pieces = split_sentinels(&rendered, mark, texts.len())?;

        // The sentinel render is only trustworthy if the template copies text verbatim, or
        // trims it (Gemma's `| trim`): each text part is fitted against a render with the real
        // text, and anything else (slicing, escaping) is refused.
        let real = template.render(messages, add_generation_prompt)?;
        let pieces = fit_texts(pieces, &texts, &real)?;
        let Expanded { pieces, counts: media_tokens, found: [img, vid, aud], fault } = self.expand_media(pieces, media);
        if img + vid + aud != media.len() {
            let n = img + vid + aud;
            bail!("the prompt has {n} media placeholders ({img} image, {vid} video, {aud} audio) but {} media items were given", media.len());
        }
        let empty = |p: &Placeholder| match p {
            Placeholder::Run(n) | Placeholder::Audio(n) => *n == 0,
            Placeholder::Steps { per_step, seconds, .. } => *per_step == 0 || seconds.is_empty(),
            Placeholder::Crops { per_image, .. } => *per_image == 0,
        };
        if let Some(k) = media.iter().position(empty) {
            bail!("media item {k} has no tokens; every image, video and audio clip needs at least one");
        }
        if let Some(e) = fault {
            return Err(e);
        }

        // HF's processors tokenize without special tokens when the rendered prompt already
        // starts with the tokenizer's own opening (Gemma's template writes `<bos>` itself).
        let opening = self.affixes.0.iter().map(|&id| self.content_of(id)).collect::<Result<String>>().unwrap_or_default();
        let mut ids = match !opening.is_empty() && real.starts_with(&opening) {
            true => vec![],
            false => self.affixes.0.clone(),
        };
        ids.reserve(real.len() / 3 + media_tokens.iter().sum::<usize>());
        let mut buf = String::new(); // plain text since the last template special token
        let mut at_start = true; // nothing of the prompt tokenized yet
        let mut media = media_tokens.iter();
        for p in &pieces {
            let s = match p {
                Piece::Text(t) => {
                    buf.push_str(t);
                    continue;
                }
                Piece::Data(_) => bail!("a text part was left unfitted"),
                Piece::Template(s) => s.as_ref(),
            };
            let mut rest = s;
            while let Some((at, content, id)) = self.find_added(rest) {
                buf.push_str(&rest[..at]);
                ids.extend(self.encode_segment(&buf, at_start)?);
                buf.clear();
                at_start = false;
                let n = if self.special.is_media(id) {
                    *media
                        .next()
                        .context("media placeholder count changed while encoding")?
                } else {
                    1
                };
                ids.extend(std::iter::repeat_n(id, n));
                rest = &rest[at + content.len()..];
            }
            buf.push_str(rest);
        }
        ids.extend(self.encode_segment(&buf, at_start)?);
        ids.extend_from_slice(&self.affixes.1);
        Ok(ids)
    }

    /// Data and template text between two added tokens; `first`: it opens the prompt (the only
    /// place a "first"-scheme Metaspace marks a word start).
    fn encode_segment(&self, text: &str, first: bool) -> Result<Vec<u32>> {
        match (&self.plain_inner, first) {
            (Some(inner), false) => self.checked(inner, text),
            _ => self.encode_text(text),
        }
    }

    fn checked(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
        let enc = tok.encode(text, false).map_err(|e| anyhow!("tokenizing {} bytes of text failed: {e}", text.len()))?;
        let ids = enc.get_ids().to_vec();
        if let Some(bad) = ids.iter().find(|i| self.added_ids.contains(i)) {
            bail!("text tokenized to the added token id {bad}; refusing to let data produce a control token");
        }
        Ok(ids)
    }

    /// Decodes ids; `skip_special` drops special tokens like HF's `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.full
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("decoding {} token ids failed: {e}", ids.len()))
    }

    /// Ids of the control tokens.
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// Tokens that end a generated turn: `<|im_end|>` and `<|endoftext|>` (LLaMA: `</s>`).
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut v = vec![self.special.im_end, self.special.endoftext];
        v.dedup();
        v
    }

    /// Size of the tokenizer's vocabulary including added tokens (151,657 for the real Qwen2-VL
    /// one). The model's embedding table is usually larger (padded, e.g. 151,936).
    pub fn vocab_size(&self) -> usize {
        self.full.get_vocab_size(true)
    }

    /// The underlying HF tokenizer (specials recognised); for inspection only.
    pub fn inner(&self) -> &Tokenizer {
        &self.full
    }

    fn template(&self) -> Result<&ChatTemplate> {
        self.template.as_ref().context(
            "this tokenizer has no chat template (none in chat_template.jinja, chat_template.json \
             or tokenizer_config.json); set one with set_chat_template",
        )
    }

    /// Leftmost added-token occurrence in `s`, longest on ties: (byte offset, content, id).
    fn find_added<'s>(&'s self, s: &str) -> Option<(usize, &'s str, u32)> {
        let mut best: Option<(usize, &str, u32)> = None;
        for (content, id) in &self.added {
            if let Some(at) = s.find(content.as_str()) {
                // `added` is sorted longest first, so a strict `<` keeps the longest on ties.
                if best.is_none_or(|(b, _, _)| at < b) {
                    best = Some((at, content.as_str(), *id));
                }
            }
        }
        best
    }

    /// Content string of an added token.
    fn content_of(&self, id: u32) -> Result<&str> {
        self.added.iter().find(|(_, i)| *i == id).map(|(c, _)| c.as_str()).with_context(|| format!("token id {id} is not an added token"))
    }
}

/// Resolves every text part to what the template wrote: the text itself or, for templates
/// that `trim` it, the trimmed text, by matching the pieces against the real render in order.
/// Where both fit, the one after which the next template bytes also match is taken; the
/// whole rebuild must then equal the render, or the template is refused.
fn fit_texts<'a>(pieces: Vec<Piece<'a>>, texts: &[&'a str], real: &str) -> Result<Vec<Piece<'a>>> {
    let refuse = || anyhow!("the chat template transforms message text instead of copying it; cannot tell data from template, refusing to tokenize (template must insert each text part verbatim or trimmed)");
    let mut at = 0;
    let mut out = Vec::with_capacity(pieces.len());
    let mut it = pieces.into_iter().peekable();
    while let Some(p) = it.next() {
        let rest = &real[at..];
        let chosen = match &p {
            Piece::Data(k) => {
                let next = match it.peek() {
                    Some(Piece::Template(t)) => t.as_ref(),
                    _ => "",
                };
                let fits = |c: &str| rest.starts_with(c) && rest[c.len()..].starts_with(next);
                let (full, trimmed) = (texts[*k], texts[*k].trim());
                Some(match (fits(full), fits(trimmed), rest.starts_with(full)) {
                    (true, _, _) | (false, false, true) => full,
                    _ => trimmed,
                })
            }
            _ => None,
        };
        let written = match (&p, chosen) {
            (_, Some(t)) => t,
            (Piece::Text(t), None) => *t,
            (Piece::Template(t), None) => t.as_ref(),
            (Piece::Data(_), None) => "",
        };
        if !rest.starts_with(written) {
            return Err(refuse());
        }
        at += written.len();
        out.push(match chosen {
            Some(t) => Piece::Text(t),
            None => p,
        });
    }
    if at != real.len() {
        return Err(refuse());
    }
    Ok(out)
}

/// `plain` with a "first"-scheme Metaspace pre-tokenizer set to mark no word start, or `None`
/// when the tokenizer has no such pre-tokenizer (byte-level BPE, or a normalizer that marks
/// every segment as HF does too).
fn without_first_mark(plain: &Tokenizer) -> Option<Tokenizer> {
    use tokenizers::pre_tokenizers::metaspace::PrependScheme;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    let Some(PreTokenizerWrapper::Metaspace(m)) = plain.get_pre_tokenizer() else { return None };
    if m.get_prepend_scheme() != PrependScheme::First {
        return None;
    }
    let mut m = m.clone();
    m.set_prepend_scheme(PrependScheme::Never);
    let mut inner = plain.clone();
    inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(m)));
    Some(inner)
}

/// The ids the post-processor adds before and after a text (LLaMA's `<s>`; none for Qwen).
fn affixes(full: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>)> {
    let with = full.encode("a", true).map_err(|e| anyhow!("post-processing a probe text failed: {e}"))?;
    let bare = full.encode("a", false).map_err(|e| anyhow!("tokenizing a probe text failed: {e}"))?;
    let (with, bare) = (with.get_ids(), bare.get_ids());
    let at = (0..=with.len().saturating_sub(bare.len()))
        .find(|&i| with[i..].starts_with(bare))
        .context("the post-processor changes the text's own tokens")?;
    Ok((with[..at].to_vec(), with[at + bare.len()..].to_vec()))
}

/// A private-use character found in neither the template nor any text, so that every
/// occurrence in the rendered prompt is ours.
fn sentinel_char(template: &str, texts: &[&str]) -> char {
    // Plane-15 private use: U+F0000..=U+FFFFD. Texts are finite, so one is always free.
    (0xF0000u32..=0xFFFFD)
        .filter_map(char::from_u32)
        .find(|c| !template.contains(*c) && texts.iter().all(|t| !t.contains(*c)))
        .unwrap_or('\u{FFFFD}')
}

/// Splits `mark k mark` sentinels out of a rendered prompt.
fn split_sentinels(rendered: &str, mark: char, n_texts: usize) -> Result<Vec<Piece<'_>>> {
    let mut pieces = Vec::new();
    let mut rest = rendered;
    while let Some(start) = rest.find(mark) {
        let after = &rest[start + mark.len_utf8()..];
        let end = after
            .find(mark)
            .context("chat template cut a text sentinel in half")?;
        let k: usize = after[..end]
            .parse()
            .context("chat template altered a text sentinel")?;
        if k >= n_texts {
            bail!("chat template produced an unknown text sentinel {k}");
        }
        if start > 0 {
            pieces.push(Piece::Template(Cow::Borrowed(&rest[..start])));
        }
        pieces.push(Piece::Data(k));
        rest = &after[end + mark.len_utf8()..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Template(Cow::Borrowed(rest)));
    }
    Ok(pieces)
}
