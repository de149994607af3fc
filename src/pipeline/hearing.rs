//! Audio for the agents (issue 29 item 4), the `frames` of the voice: one clip per history turn,
//! taken from the turn's `"audio"` file, else from the audio track of its `"video"` clip, or cut
//! from one recording of the whole conversation (IEMOCAP). Policies (all reported in the trace's
//! `audio` report):
//! - a turn's clip without an audio stream is no audio for that turn (a note, not an error);
//! - at most `max_audio` clips, keeping the most recent turns (older sources are not decoded);
//! - a clip longer than the model's audio window is cut to the turn's span (`fit_to_window`;
//!   a per-turn file is the whole turn, so its first window is kept, which is what the feature
//!   extractor would truncate it to anyway: the cut is made visible instead of silent);
//! - clips that do not fit the context window are dropped oldest first, with the keyframes
//!   (`fit_to_context`);
//! - unreadable audio is an error naming the file, or with `skip_bad_media` a note and that
//!   turn without audio.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::frames::{self, FrameOptions, FrameReport, Keyframe};
use crate::audio::{self, AudioError, Pcm};
use crate::dialogue::Dialogue;

/// Default of `max_audio`. Four clips keep the answered turn and the three before it, where the
/// speaker's current state is heard; a 30 s window is 750 audio tokens, so four long clips cost
/// about what the default eight keyframes do, and MELD's few-second utterances far less.
pub const DEFAULT_MAX_AUDIO: usize = 4;

/// One turn's audio as the agents hear it.
#[derive(Clone, Debug)]
pub struct Clip {
    /// Index of the history turn it belongs to.
    pub turn: usize,
    /// File (and span for a recording), for the trace.
    pub source: String,
    pub pcm: Pcm,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AudioReport {
    pub kept: Vec<String>,
    pub dropped: Vec<String>,
    /// Clips cut to the turn's span, and how.
    pub cut: Vec<String>,
    pub notes: Vec<String>,
}

/// Where one turn's audio comes from.
enum Source<'a> {
    File(&'a Path),
    Clip(&'a Path),
}

impl Source<'_> {
    fn path(&self) -> &Path {
        match self {
            Source::File(p) | Source::Clip(p) => p,
        }
    }
}

/// One clip per turn that has audio, in dialogue order, at most `opts.max_audio` (the most
/// recent). Sources are decoded newest first until enough clips are in hand.
pub fn collect(d: &Dialogue, opts: &FrameOptions, report: &mut AudioReport) -> Result<Vec<Clip>> {
    let sources: Vec<(usize, Source)> = d
        .turns
        .iter()
        .enumerate()
        .filter_map(|(ti, t)| match (&t.audio, &t.video) {
            (Some(a), _) => Some((ti, Source::File(a))),
            (None, Some(v)) => Some((ti, Source::Clip(v))),
            (None, None) => None,
        })
        .collect();
    if let Some(v) = &d.video {
        report.notes.push(format!("the audio of the dialogue video {} is not used: it has no per-turn spans", v.display()));
    }
    let mut newest_first = vec![];
    let mut unread = 0;
    for (i, (ti, s)) in sources.iter().enumerate().rev() {
        if newest_first.len() >= opts.max_audio {
            unread = i + 1;
            break;
        }
        if let Some(pcm) = load_turn(s, *ti, opts, report)? {
            newest_first.push(Clip { turn: *ti, source: s.path().display().to_string(), pcm });
        }
    }
    if unread > 0 {
        report.notes.push(format!("{unread} older audio sources were not read: max_audio {} was reached by newer turns", opts.max_audio));
        report.dropped.extend(sources[..unread].iter().map(|(_, s)| s.path().display().to_string()));
    }
    let clips: Vec<Clip> = newest_first.into_iter().rev().collect();
    report.kept = clips.iter().map(|c| c.source.clone()).collect();
    Ok(clips)
}

/// A turn's audio; `None` when its clip has no audio stream (noted) or, with `skip_bad_media`,
/// when it does not decode (noted).
fn load_turn(s: &Source, turn: usize, opts: &FrameOptions, report: &mut AudioReport) -> Result<Option<Pcm>> {
    let loaded = match s {
        Source::File(p) => audio::load_audio(p),
        Source::Clip(p) => audio::load_clip_audio(p),
    };
    match loaded {
        Ok(pcm) => Ok(Some(pcm)),
        Err(AudioError::NoAudioStream { path }) if matches!(s, Source::Clip(_)) => {
            report.notes.push(format!("T{}: the clip {} has no audio stream: no audio for that turn", turn + 1, path.display()));
            Ok(None)
        }
        Err(e) => skip_or_fail(e.into(), &format!("turn {}", turn + 1), opts, report).map(|()| None),
    }
}

fn skip_or_fail(e: anyhow::Error, whose: &str, opts: &FrameOptions, report: &mut AudioReport) -> Result<()> {
    if opts.skip_bad_media {
        report.notes.push(format!("skipped unreadable audio: {e:#}"));
        return Ok(());
    }
    Err(e.context(format!("audio of {whose} (skip_bad_media continues without it)")))
}

/// Clips cut from one recording of the whole conversation (IEMOCAP): each history turn's
/// `[start, end)` span, never at or after `until` (the start of the turn being answered: the
/// model must not hear it), capped to the `max_audio` most recent.
pub fn from_recording(path: &Path, spans: &[(f64, f64)], until: f64, opts: &FrameOptions, report: &mut AudioReport) -> Result<Vec<Clip>> {
    let pcm = match audio::load_clip_audio(path) {
        Ok(p) => p,
        Err(AudioError::NoAudioStream { path }) => {
            report.notes.push(format!("the recording {} has no audio stream: no audio for this dialogue", path.display()));
            return Ok(vec![]);
        }
        Err(e) => return skip_or_fail(e.into(), "the dialogue's recording", opts, report).map(|()| vec![]),
    };
    let mut clips = vec![];
    for (ti, &(s, e)) in spans.iter().enumerate() {
        let e = e.min(until);
        if !(e > s && s >= 0.0) {
            continue;
        }
        // Window 0: always cut, even a recording shorter than the model's window holds the
        // answered turn.
        let c = audio::cut_to_span(&pcm.samples, (s, e), 0.0).with_context(|| format!("turn {} of {}", ti + 1, path.display()))?;
        if c.samples.is_empty() {
            report.notes.push(format!("T{}: its span {s:.2}..{e:.2} s lies past the end of {}", ti + 1, path.display()));
            continue;
        }
        let source = format!("{}@{:.2}-{:.2}s", path.display(), c.start, c.end);
        report.cut.push(format!("{source}: T{}'s span of the recording", ti + 1));
        clips.push(Clip { turn: ti, source, pcm: Pcm { samples: c.samples, source: pcm.source.clone() } });
    }
    cap(&mut clips, opts.max_audio, report);
    Ok(clips)
}

/// Keeps the `max` most recent clips.
pub fn cap(clips: &mut Vec<Clip>, max: usize, report: &mut AudioReport) {
    if clips.len() > max {
        let n = clips.len() - max;
        report.notes.push(format!("{} audio clips found, max_audio {max}: dropped the {n} oldest", clips.len()));
        report.dropped.extend(clips.drain(..n).map(|c| c.source));
    }
    report.kept = clips.iter().map(|c| c.source.clone()).collect();
}

/// Cuts every clip longer than `window` seconds (the model's audio window) to its turn's span:
/// the turn is the whole clip, so the first `window` seconds are kept.
pub fn fit_to_window(clips: &mut [Clip], window: f64, report: &mut AudioReport) {
    if window.is_nan() || window <= 0.0 {
        return;
    }
    for c in clips {
        let secs = c.pcm.seconds();
        if secs <= window {
            continue;
        }
        let cut = audio::cut_to_span(&c.pcm.samples, (0.0, window), window).expect("a positive window is a valid span");
        report.cut.push(format!("{}: {secs:.1} s, longer than the model's {window} s audio window: cut to {:.1}..{:.1} s", c.source, cut.start, cut.end));
        c.pcm.samples = cut.samples;
    }
}

/// Drops the oldest media until `fits` accepts the rest (the text alone must fit). Oldest is by
/// turn: a turn's clip and keyframes go before a later turn's; within a turn the clip goes first
/// (it usually costs more tokens); dialogue-wide keyframes count as the earliest turn's. Without
/// clips this is `frames::fit_to_context`.
pub fn fit_to_context(
    frames: &mut Vec<Keyframe>,
    frame_report: &mut FrameReport,
    clips: &mut Vec<Clip>,
    report: &mut AudioReport,
    mut fits: impl FnMut(&[Keyframe], &[Clip]) -> Result<bool>,
) -> Result<()> {
    if clips.is_empty() {
        return frames::fit_to_context(frames, frame_report, |kf| fits(kf, &[]));
    }
    let (n_frames, n_clips) = (frames.len(), clips.len());
    while !fits(frames, clips)? {
        let clip_turn = clips.first().map(|c| c.turn);
        let frame_turn = frames.first().map(|f| f.turn.unwrap_or(0));
        match (clip_turn, frame_turn) {
            (Some(c), Some(f)) if f < c => frame_report.dropped.push(frames.remove(0).source),
            (Some(_), _) => report.dropped.push(clips.remove(0).source),
            (None, Some(_)) => frame_report.dropped.push(frames.remove(0).source),
            (None, None) => anyhow::bail!("the dialogue text alone does not fit the context window with the agents' token budget; shorten the history or lower max_new_tokens"),
        }
    }
    if frames.len() < n_frames {
        frame_report.notes.push(format!("{} of {n_frames} keyframes did not fit the context window: dropped oldest first", n_frames - frames.len()));
        frame_report.kept = frames.iter().map(|f| f.source.clone()).collect();
    }
    if clips.len() < n_clips {
        report.notes.push(format!("{} of {n_clips} audio clips did not fit the context window: dropped oldest first", n_clips - clips.len()));
        report.kept = clips.iter().map(|c| c.source.clone()).collect();
    }
    Ok(())
}

/// Drops every clip with `why` noted (hearing off, or a model that does not hear).
pub fn ignore(clips: &mut Vec<Clip>, report: &mut AudioReport, why: &str) {
    if clips.is_empty() {
        return;
    }
    report.notes.push(format!("{why}: ignored {} audio clips; the agents get text and keyframes only", clips.len()));
    report.dropped.extend(clips.drain(..).map(|c| c.source));
    report.kept.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clip(turn: usize, secs: f64) -> Clip {
        let n = (secs * audio::TARGET_RATE as f64) as usize;
        Clip { turn, source: format!("c{turn}.wav"), pcm: Pcm { samples: (0..n).map(|i| i as f32).collect(), source: "c.wav".into() } }
    }

    #[test]
    fn long_clips_are_cut_to_the_window_and_reported() {
        let mut clips = vec![clip(0, 2.0), clip(1, 31.5)];
        let mut r = AudioReport::default();
        fit_to_window(&mut clips, 30.0, &mut r);
        assert_eq!(clips[0].pcm.samples.len(), 32000);
        assert_eq!(clips[1].pcm.samples.len(), 30 * 16000);
        assert_eq!(clips[1].pcm.samples[..3], [0.0, 1.0, 2.0], "the turn's start is kept");
        assert_eq!(r.cut.len(), 1);
        assert!(r.cut[0].starts_with("c1.wav: 31.5 s"), "{:?}", r.cut);
    }

    #[test]
    fn cap_keeps_the_most_recent() {
        let mut clips: Vec<Clip> = (0..6).map(|t| clip(t, 0.1)).collect();
        let mut r = AudioReport::default();
        cap(&mut clips, 4, &mut r);
        assert_eq!(clips.iter().map(|c| c.turn).collect::<Vec<_>>(), [2, 3, 4, 5]);
        assert_eq!(r.dropped, ["c0.wav", "c1.wav"]);
        assert_eq!(r.kept.len(), 4);
    }

    #[test]
    fn fitting_drops_the_oldest_turns_media_first() {
        let img = image::RgbImage::new(2, 2);
        let kf = |t: usize| Keyframe { turn: Some(t), source: format!("f{t}"), image: img.clone() };
        let mut frames = vec![kf(0), kf(2)];
        let mut clips = vec![clip(1, 0.1), clip(2, 0.1)];
        let (mut fr, mut ar) = (FrameReport::default(), AudioReport::default());
        // Fits once at most two media items are left.
        fit_to_context(&mut frames, &mut fr, &mut clips, &mut ar, |f, c| Ok(f.len() + c.len() <= 2)).unwrap();
        assert_eq!(fr.dropped, ["f0"]);
        assert_eq!(ar.dropped, ["c1.wav"]);
        assert_eq!((frames.len(), clips.len()), (1, 1));
        assert!(ar.notes[0].starts_with("1 of 2 audio clips did not fit"), "{:?}", ar.notes);
        let e = fit_to_context(&mut frames, &mut fr, &mut clips, &mut ar, |_, _| Ok(false)).unwrap_err();
        assert!(e.to_string().contains("text alone does not fit"), "{e}");
    }
}
