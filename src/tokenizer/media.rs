//! Media placeholders in a rendered chat template: which added token stands for which kind of
//! media in each vocabulary convention, and the one walk over the template pieces that writes
//! every media item out (Gemma's image sequence, Qwen3-VL's video time steps) before tokenizing.

use super::{ChatTokenizer, Convention, Piece, Placeholder, SpecialTokens};
use anyhow::{bail, Result};
use std::borrow::Cow;
use tokenizers::Tokenizer;

impl ChatTokenizer {
    /// The media kind the template's added token `id` stands for, by the vocabulary's
    /// convention: the pads (Qwen's, Omni's, LLaVA's `<image>`), or for Gemma the image's begin
    /// marker (its template writes only that, and the processor's image sequence replaces it).
    fn placeholder_kind(&self, id: u32) -> Option<MediaKind> {
        let s = &self.special;
        let image = match s.convention {
            Convention::Gemma => s.vision_start,
            Convention::Qwen | Convention::QwenOmni | Convention::Llama => s.image_pad,
        };
        [(image, MediaKind::Image), (s.video_pad, MediaKind::Video), (s.audio_pad, MediaKind::Audio)]
            .into_iter()
            .find_map(|(t, kind)| (t == id).then_some(kind))
    }

    /// One walk over the template pieces (template bytes only: a placeholder typed in dialogue
    /// text stays text): the k-th placeholder the template wrote stands for media item k and
    /// is written out as that item needs (Gemma's image sequence, Qwen3-VL's video time steps;
    /// a pad run stays one pad, repeated when tokenized). Placeholders beyond the items are
    /// only counted, and the first item its placeholder cannot take is kept as the fault, so
    /// the caller refuses a wrong count before a wrong kind.
    pub(super) fn expand_media<'a>(&self, pieces: Vec<Piece<'a>>, media: &[Placeholder]) -> Expanded<'a> {
        let mut ex = Expanded { pieces: Vec::with_capacity(pieces.len()), counts: Vec::with_capacity(media.len()), found: [0; 3], fault: None };
        let mut items = media.iter();
        for p in pieces {
            let Piece::Template(s) = p else {
                ex.pieces.push(p);
                continue;
            };
            let mut w = Writing { text: String::with_capacity(s.len()), rest: s.as_ref(), changed: false };
            while let Some((at, content, id)) = self.find_added(w.rest) {
                w.text.push_str(&w.rest[..at]);
                w.rest = &w.rest[at + content.len()..];
                let Some(kind) = self.placeholder_kind(id) else {
                    w.text.push_str(content);
                    continue;
                };
                ex.found[kind as usize] += 1;
                match items.next().filter(|_| ex.fault.is_none()) {
                    Some(item) => {
                        if let Err(e) = self.write_placeholder(kind, content, item, &mut w, &mut ex.counts) {
                            ex.fault = Some(e);
                        }
                    }
                    None => w.text.push_str(content),
                }
            }
            w.text.push_str(w.rest);
            ex.pieces.push(Piece::Template(if w.changed { Cow::Owned(w.text) } else { s }));
        }
        ex
    }

    /// Writes media item `item` where the template wrote placeholder `content` of `kind`, and
    /// records the pad count of every pad run it leaves, in order.
    fn write_placeholder(&self, kind: MediaKind, content: &str, item: &Placeholder, w: &mut Writing, counts: &mut Vec<usize>) -> Result<()> {
        if let Some(sequence) = &self.image_sequence {
            // Gemma: the image's begin marker is the only placeholder its template writes.
            match item {
                Placeholder::Run(n) => {
                    w.text.push_str(sequence);
                    counts.push(*n);
                }
                Placeholder::Crops { per_image, crops } => {
                    w.text.push_str(&format!("Here is the original image {sequence} and here are some crops to help you see better "));
                    w.text.push_str(&vec![sequence.as_str(); *crops].join(" "));
                    counts.extend(std::iter::repeat_n(*per_image, 1 + crops));
                }
                Placeholder::Steps { .. } => bail!("an image placeholder cannot take a video's time steps"),
                Placeholder::Audio(_) => bail!("this vocabulary has no audio placeholder"),
            }
            w.changed = true;
            return Ok(());
        }
        if matches!(item, Placeholder::Audio(_)) != (kind == MediaKind::Audio) {
            bail!("the prompt's media placeholders and the media items are of different kinds (an audio clip where an image or video is, or the reverse)");
        }
        match item {
            Placeholder::Run(n) | Placeholder::Audio(n) => {
                counts.push(*n);
                w.text.push_str(content);
            }
            Placeholder::Crops { .. } => bail!("image crops need a vocabulary with an image marker (Gemma's)"),
            Placeholder::Steps { per_step, seconds, keep_outer } => {
                if kind != MediaKind::Video {
                    bail!("an image placeholder cannot take a video's time steps");
                }
                // Only Qwen vocabularies have a video pad, and they have the markers.
                let (vs, ve) = (self.content_of(self.special.vision_start)?, self.content_of(self.special.vision_end)?);
                // The template's own start/end around the pad are replaced, not doubled.
                if !keep_outer && w.text.ends_with(vs) && w.rest.starts_with(ve) {
                    w.text.truncate(w.text.len() - vs.len());
                    w.rest = &w.rest[ve.len()..];
                }
                for t in seconds {
                    w.text.push_str(&format!("<{t:.1} seconds>{vs}{content}{ve}"));
                    counts.push(*per_step);
                }
                w.changed = true;
            }
        }
        Ok(())
    }
}

/// The kind of media a placeholder stands for (its index into `Expanded::found`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MediaKind {
    Image = 0,
    Video = 1,
    Audio = 2,
}

/// The template pieces with their media placeholders written out (`ChatTokenizer::expand_media`).
pub(super) struct Expanded<'a> {
    pub(super) pieces: Vec<Piece<'a>>,
    /// The pad count of every pad run left in `pieces`, in order.
    pub(super) counts: Vec<usize>,
    /// Placeholders the template wrote: images, videos, audio clips.
    pub(super) found: [usize; 3],
    /// The first media item its placeholder could not take.
    pub(super) fault: Option<anyhow::Error>,
}

/// One template piece being rewritten: the text so far, what is left of the piece, and
/// whether the text differs from the piece.
struct Writing<'a> {
    text: String,
    rest: &'a str,
    changed: bool,
}

/// Gemma 3's image sequence (`Gemma3Processor.full_image_sequence`, its pad repeated later),
/// for vocabularies of that convention.
pub(super) fn image_sequence(full: &Tokenizer, special: &SpecialTokens) -> Option<String> {
    if special.convention != Convention::Gemma {
        return None;
    }
    let name = |id: u32| full.id_to_token(id);
    let (boi, eoi, pad) = (name(special.vision_start)?, name(special.vision_end)?, name(special.image_pad)?);
    Some(format!("\n\n{boi}{pad}{eoi}\n\n"))
}
