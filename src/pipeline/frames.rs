//! Keyframes for the agents: sampled from each turn's clip or frame list, or from one video of
//! the whole dialogue, then capped. Policies (all reported in the trace):
//! - at most `frames_per_turn` evenly spaced frames per turn clip / frame list;
//! - at most `max_frames` overall, keeping the most recent (the turn being answered matters most);
//! - frames that do not fit the context window are dropped oldest first (`fit_to_context`);
//! - unreadable media are an error, or with `skip_bad_media` a note and text only for that source.

use std::path::Path;

use anyhow::{bail, Context, Result};
use image::RgbImage;
use serde::{Deserialize, Serialize};

use crate::dialogue::Dialogue;

#[derive(Clone, Debug)]
pub struct FrameOptions {
    pub frames_per_turn: usize,
    pub max_frames: usize,
    /// Audio clips shown at most, one per turn, the most recent kept (`hearing`).
    pub max_audio: usize,
    /// Applies to audio too.
    pub skip_bad_media: bool,
}

impl Default for FrameOptions {
    fn default() -> Self {
        FrameOptions { frames_per_turn: 1, max_frames: 8, max_audio: super::hearing::DEFAULT_MAX_AUDIO, skip_bad_media: false }
    }
}

#[derive(Clone, Debug)]
pub struct Keyframe {
    /// Index of the turn the frame belongs to; `None` for a whole-dialogue video or frame list.
    pub turn: Option<usize>,
    /// File (and frame index for videos), for the trace.
    pub source: String,
    pub image: RgbImage,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FrameReport {
    pub kept: Vec<String>,
    pub dropped: Vec<String>,
    pub notes: Vec<String>,
}

/// One file that yields keyframes: an image, or a video sampled for up to `n` frames.
struct Source<'a> {
    turn: Option<usize>,
    path: &'a Path,
    video: Option<usize>,
}

/// Collects keyframes in dialogue order (per-turn first, then whole-dialogue media). Only the
/// media that can still be among the `max_frames` most recent are read: sources are loaded
/// newest first until enough frames are in hand, so a dialogue with thousands of per-turn
/// frames costs what the kept ones cost.
pub fn collect(d: &Dialogue, opts: &FrameOptions, report: &mut FrameReport) -> Result<Vec<Keyframe>> {
    let mut sources = vec![];
    for (ti, turn) in d.turns.iter().enumerate() {
        let turn_no = Some(ti);
        if !turn.frames.is_empty() {
            sources.extend(evenly(&turn.frames, opts.frames_per_turn).into_iter().map(|p| Source { turn: turn_no, path: p, video: None }));
        } else if let Some(v) = &turn.video {
            sources.push(Source { turn: turn_no, path: v, video: Some(opts.frames_per_turn) });
        }
    }
    sources.extend(d.frames.iter().map(|p| Source { turn: None, path: p, video: None }));
    if let Some(v) = &d.video {
        sources.push(Source { turn: None, path: v, video: Some(opts.max_frames.max(1)) });
    }
    let mut newest_first: Vec<Vec<Keyframe>> = vec![];
    let mut have = 0;
    let mut unread = 0;
    for (i, s) in sources.iter().enumerate().rev() {
        if have >= opts.max_frames {
            unread = i + 1;
            break;
        }
        let frames = match s.video {
            None => load_or_skip(opts, report, s.path, s.turn, image_frame)?,
            Some(n) => load_or_skip(opts, report, s.path, s.turn, |p| video_frames(p, n))?,
        };
        have += frames.len();
        newest_first.push(keyframes(s.turn, frames).collect());
    }
    let mut out: Vec<Keyframe> = newest_first.into_iter().rev().flatten().collect();
    cap(&mut out, |f| f.source.clone(), opts, report);
    if unread > 0 {
        report.notes.push(format!("{unread} older media files were not read: max_frames {} was reached by newer ones", opts.max_frames));
        let mut dropped: Vec<String> = sources[..unread].iter().map(|s| s.path.display().to_string()).collect();
        dropped.append(&mut report.dropped);
        report.dropped = dropped;
    }
    Ok(out)
}

/// Keyframes from one recording of the whole conversation (IEMOCAP): `frames_per_turn` evenly
/// spaced inside each history turn's time span, never at or after `until` (the start of the
/// turn being answered: the model must not see it).
pub fn from_recording(path: &Path, spans: &[(f64, f64)], until: f64, opts: &FrameOptions, report: &mut FrameReport) -> Result<Vec<Keyframe>> {
    let n = opts.frames_per_turn;
    let mut times: Vec<(f64, usize)> = vec![];
    for (ti, &(s, e)) in spans.iter().enumerate() {
        let e = e.min(until);
        for k in 0..n {
            let t = s + (e - s) * (k as f64 + 0.5) / n as f64;
            if t >= s && t < until {
                times.push((t, ti));
            }
        }
    }
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    let ts: Vec<f64> = times.iter().map(|t| t.0).collect();
    // Times past the end of the recording are dropped at the end, so the rest stay aligned.
    let loaded = load_or_skip(opts, report, path, None, |p| recording_frames(p, &ts))?;
    let mut out: Vec<Keyframe> = loaded
        .into_iter()
        .zip(&times)
        .map(|((t, image), (_, ti))| Keyframe { turn: Some(*ti), source: format!("{}@{t:.2}s", path.display()), image })
        .collect();
    cap(&mut out, |f| f.source.clone(), opts, report);
    Ok(out)
}

#[cfg(feature = "video")]
fn recording_frames(path: &Path, times: &[f64]) -> Result<Vec<(f64, RgbImage)>> {
    crate::vision::load_frames_at(path, times)
}

#[cfg(not(feature = "video"))]
fn recording_frames(path: &Path, _times: &[f64]) -> Result<Vec<(f64, RgbImage)>> {
    bail!("{}: this merg was built without the `video` feature", path.display())
}

/// Keeps the `max_frames` most recent keyframes.
/// Keeps the `max_frames` most recent items (keyframes, or sources not decoded yet).
pub(crate) fn cap<T>(out: &mut Vec<T>, source: impl Fn(&T) -> String, opts: &FrameOptions, report: &mut FrameReport) {
    if out.len() > opts.max_frames {
        let n = out.len() - opts.max_frames;
        let dropped: Vec<T> = out.drain(..n).collect();
        report.notes.push(format!("{} keyframes found, max_frames {}: dropped the {n} oldest", n + opts.max_frames, opts.max_frames));
        report.dropped.extend(dropped.iter().map(&source));
    }
    report.kept = out.iter().map(source).collect();
}

/// Drops the oldest frames until `fits` accepts the rest (the text alone must fit).
pub fn fit_to_context(
    frames: &mut Vec<Keyframe>,
    report: &mut FrameReport,
    mut fits: impl FnMut(&[Keyframe]) -> Result<bool>,
) -> Result<()> {
    let before = frames.len();
    while !fits(frames)? {
        if frames.is_empty() {
            bail!("the dialogue text alone does not fit the context window with the agents' token budget; shorten the history or lower max_new_tokens");
        }
        let f = frames.remove(0);
        report.dropped.push(f.source);
    }
    if frames.len() < before {
        report.notes.push(format!(
            "{} of {before} keyframes did not fit the context window: dropped oldest first",
            before - frames.len()
        ));
        report.kept = frames.iter().map(|f| f.source.clone()).collect();
    }
    Ok(())
}

/// `load(path)`, or with `skip_bad_media` nothing plus a note when it fails.
fn load_or_skip<T>(opts: &FrameOptions, report: &mut FrameReport, path: &Path, whose: Option<usize>, load: impl FnOnce(&Path) -> Result<Vec<T>>) -> Result<Vec<T>> {
    match load(path) {
        Ok(v) => Ok(v),
        Err(e) if opts.skip_bad_media => {
            report.notes.push(format!("skipped unreadable media {}: {e:#}", path.display()));
            Ok(vec![])
        }
        Err(e) => Err(e.context(format!(
            "media of {} (skip_bad_media continues without it)",
            whose.map(|t| format!("turn {}", t + 1)).unwrap_or_else(|| "the dialogue".into())
        ))),
    }
}

fn image_frame(p: &Path) -> Result<Vec<(String, RgbImage)>> {
    let img = crate::vision::load_image(p)?;
    // Qwen's processors refuse aspect ratios over 200; say so here, where the file is known,
    // rather than later as "media item k" of some agent call.
    crate::vision::smart_resize(img.height() as usize, img.width() as usize, 28, 56 * 56, 28 * 28 * 1280)
        .with_context(|| format!("image {} cannot be shown to the model", p.display()))?;
    Ok(vec![(p.display().to_string(), img)])
}

fn keyframes(turn: Option<usize>, frames: Vec<(String, RgbImage)>) -> impl Iterator<Item = Keyframe> {
    frames.into_iter().map(move |(source, image)| Keyframe { turn, source, image })
}

/// `n` evenly spaced items, always including the last (closest to the reply).
pub(crate) fn evenly<T>(items: &[T], n: usize) -> Vec<&T> {
    if n == 0 || items.is_empty() {
        return vec![];
    }
    if items.len() <= n {
        return items.iter().collect();
    }
    let step = items.len() as f64 / n as f64;
    (0..n).map(|i| &items[items.len() - 1 - ((n - 1 - i) as f64 * step) as usize]).collect()
}

#[cfg(feature = "video")]
fn video_frames(path: &Path, n: usize) -> Result<Vec<(String, RgbImage)>> {
    if n == 0 {
        return Ok(vec![]);
    }
    // A very high rate asks for as many frames as allowed: `n`, evenly spaced (factor 1).
    let v = crate::vision::load_video_frames_with_factor(path, 1e6, n, 1)?;
    Ok(v.indices.iter().zip(v.frames).map(|(i, f)| (format!("{}#{i}", path.display()), f)).collect())
}

#[cfg(not(feature = "video"))]
fn video_frames(path: &Path, _n: usize) -> Result<Vec<(String, RgbImage)>> {
    bail!("{}: this merg was built without the `video` feature; pass keyframes as images", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evenly_keeps_the_last_and_spreads() {
        let v: Vec<usize> = (0..10).collect();
        assert_eq!(evenly(&v, 1), vec![&9]);
        assert_eq!(evenly(&v, 2), vec![&4, &9]);
        assert_eq!(evenly(&v, 20).len(), 10);
        assert!(evenly(&v, 0).is_empty());
    }
}
