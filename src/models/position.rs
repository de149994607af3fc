//! 3-D position ids for M-RoPE, equal to transformers' `get_rope_index` (Qwen2-VL,
//! Qwen2.5-VL, Qwen3-VL). Text advances all three components together; an image/video
//! placeholder run gets (t, h, w) grid coordinates offset by the text before it; text after a
//! vision block resumes at `max + 1`. The families differ only in a video's time axis;
//! Qwen2.5-Omni's TMRoPE (`tmrope_index`) also interleaves a video with its audio track.

use anyhow::{bail, Result};

use super::{MediaGrid, Positions};

/// How a video's temporal steps become the t component.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum VideoTime {
    /// Qwen2-VL: the step index.
    Index,
    /// Qwen2.5-VL: step × whole seconds per step × tokens per second.
    Scaled { tokens_per_second: f64 },
    /// Qwen3-VL: every step is its own run (its time is text in the prompt), so t is 0.
    PerStep,
}

/// How a family numbers prompt positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionScheme {
    /// 3-D M-RoPE positions (`mrope_index`): the Qwen families.
    MRope,
    /// One running index for every token, media included (LLaMA-style 1-D RoPE: LLaVA-NeXT);
    /// all three components equal and no rope delta.
    Sequential,
    /// Qwen2.5-Omni's time-aligned M-RoPE (`tmrope_index`).
    TmRope(TmRope),
}

/// Positions `0..len` in all three components, and a delta of 0.
pub fn sequential_index(len: usize) -> (Positions, i64) {
    let v: Vec<i64> = (0..len as i64).collect();
    ([v.clone(), v.clone(), v], 0)
}

#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub merge: usize,
    pub image_token: u32,
    pub video_token: u32,
    pub video_time: VideoTime,
}

/// Position ids `[3][L]` and the rope delta (`max position + 1 - L`) that continues decoding.
pub fn mrope_index(ids: &[u32], media: &[MediaGrid], p: &RopeParams) -> Result<(Positions, i64)> {
    // Qwen3-VL: a video of t steps is t one-step items, each its own placeholder run.
    let split: Vec<MediaGrid>;
    let media = match p.video_time {
        VideoTime::PerStep => {
            split = media
                .iter()
                .flat_map(|m| {
                    let n = if m.is_video { m.thw[0] } else { 1 };
                    let thw = if m.is_video { [1, m.thw[1], m.thw[2]] } else { m.thw };
                    std::iter::repeat_n(MediaGrid { thw, ..m.clone() }, n)
                })
                .collect();
            &split[..]
        }
        _ => media,
    };
    let (merge, image_token, video_token) = (p.merge, p.image_token, p.video_token);
    let mut pos: [Vec<i64>; 3] = [Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len())];
    let mut images = media.iter().filter(|m| !m.is_video);
    let mut videos = media.iter().filter(|m| m.is_video);
    let mut next: i64 = 0; // first position of the next text run
    let mut i = 0;
    while i < ids.len() {
        let tok = ids[i];
        if tok != image_token && tok != video_token {
            for p in pos.iter_mut() {
                p.push(next);
            }
            next += 1;
            i += 1;
            continue;
        }
        let is_video = tok == video_token;
        let m = if is_video { videos.next() } else { images.next() };
        let Some(m) = m else {
            bail!("prompt has more {} placeholders than {} given", if is_video { "video" } else { "image" }, if is_video { "videos" } else { "images" });
        };
        let n = check_run(ids, i, tok, m, merge)?;
        let times: Vec<i64> = (0..m.thw[0])
            .map(|t| match p.video_time {
                // Qwen2.5-VL scales the temporal index by real time. transformers casts the
                // seconds per grid to an integer tensor before multiplying (so 0.5 s → 0); we
                // match it exactly. Images have one step: t = 0 either way.
                VideoTime::Scaled { tokens_per_second } if is_video => {
                    ((t as i64 * m.second_per_grid.trunc() as i64) as f64 * tokens_per_second) as i64
                }
                _ => t as i64,
            })
            .collect();
        let run = grid_run(m, merge, next, &times);
        next = append(&mut pos, &run, next);
        i += n;
    }
    if images.next().is_some() || videos.next().is_some() {
        bail!("more images/videos given than placeholders in the prompt");
    }
    let delta = next - ids.len() as i64;
    Ok((pos, delta))
}

/// The `n` tokens of `m`'s placeholder run starting at token `i` (an error when the prompt's run
/// is shorter than the grid).
fn check_run(ids: &[u32], i: usize, tok: u32, m: &MediaGrid, merge: usize) -> Result<usize> {
    let n = m.thw[0] * (m.thw[1] / merge) * (m.thw[2] / merge);
    if i + n > ids.len() || ids[i..i + n].iter().any(|&x| x != tok) {
        bail!("placeholder run at token {i} is shorter than the {n} tokens its grid {:?} needs", m.thw);
    }
    Ok(n)
}

/// (t, h, w) of each merged token of one media item, offset by `start`: temporal step `s` at
/// `times[s]`, rows and columns of the merged grid.
fn grid_run(m: &MediaGrid, merge: usize, start: i64, times: &[i64]) -> Positions {
    let (gh, gw) = (m.thw[1] / merge, m.thw[2] / merge);
    let mut run: Positions = Default::default();
    for &tv in times {
        for h in 0..gh {
            for w in 0..gw {
                for (c, v) in [tv, h as i64, w as i64].into_iter().enumerate() {
                    run[c].push(v + start);
                }
            }
        }
    }
    run
}

/// Appends `run` to `pos`; returns the first position after it (its max + 1, or `next` when empty).
fn append(pos: &mut Positions, run: &Positions, next: i64) -> i64 {
    let max = run.iter().flatten().copied().max().unwrap_or(next - 1);
    for c in 0..3 {
        pos[c].extend_from_slice(&run[c]);
    }
    max + 1
}

/// Qwen2.5-Omni's TMRoPE: positions that follow time, at `per_second` ids per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmRope {
    pub audio_token: u32,
    pub audio_start: u32,
    pub audio_end: u32,
    pub vision_start: u32,
    pub vision_end: u32,
    /// `position_id_per_seconds` (25: one audio token is 40 ms).
    pub per_second: i64,
    /// Position ids per interleaving chunk of audio-in-video (`position_id_per_seconds ×
    /// seconds_per_chunk`).
    pub per_chunk: i64,
}

/// Position ids `[3][L]` and the rope delta of a Qwen2.5-Omni prompt, equal to transformers'
/// `Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index`. Text and audio advance
/// all three components by one per token (an audio token is 40 ms, 25 ids per second); an
/// image is its (0, h, w) grid; a video step `s` is at `s × seconds per grid × per_second`
/// (f32, truncated, as transformers). A video with its audio track
/// (`<|vision_bos|><|audio_bos|>` … `<|audio_eos|><|vision_eos|>`) shares one start: both
/// markers take it, video and audio count time from the position after it, and the prompt
/// holds them in chunks of `per_chunk` ids (the video's chunk, then the audio's).
pub fn tmrope_index(ids: &[u32], media: &[MediaGrid], p: &RopeParams, tm: &TmRope) -> Result<(Positions, i64)> {
    let mut pos: Positions = Default::default();
    let mut images = media.iter().filter(|m| !m.is_video);
    let mut videos = media.iter().filter(|m| m.is_video);
    let (mut next, mut i) = (0i64, 0usize);
    while i < ids.len() {
        let tok = ids[i];
        if tok == tm.vision_start && ids.get(i + 1) == Some(&tm.audio_start) && ids.get(i + 2) == Some(&p.video_token) {
            let Some(m) = videos.next() else { bail!("prompt has more video placeholders than videos given") };
            let (run, used) = audio_in_video(&ids[i..], m, p, tm, next).map_err(|e| e.context(format!("video with its audio at token {i}")))?;
            append(&mut pos, &run, next);
            // Text goes on after the end markers (the block's last ids).
            (next, i) = (run[0][run[0].len() - 1] + 1, i + used);
            continue;
        }
        if tok != p.image_token && tok != p.video_token {
            for c in pos.iter_mut() {
                c.push(next);
            }
            (next, i) = (next + 1, i + 1);
            continue;
        }
        let is_video = tok == p.video_token;
        let Some(m) = (if is_video { videos.next() } else { images.next() }) else {
            bail!("prompt has more {} placeholders than {} given", if is_video { "video" } else { "image" }, if is_video { "videos" } else { "images" });
        };
        let n = check_run(ids, i, tok, m, p.merge)?;
        let times = if is_video { video_times(m, tm) } else { (0..m.thw[0] as i64).map(|t| t * tm.per_second).collect() };
        next = append(&mut pos, &grid_run(m, p.merge, next, &times), next);
        i += n;
    }
    if images.next().is_some() || videos.next().is_some() {
        bail!("more images/videos given than placeholders in the prompt");
    }
    // The delta continues after the largest id, which a late video step can hold.
    let max = pos.iter().flatten().copied().max().unwrap_or(-1);
    Ok((pos, max + 1 - ids.len() as i64))
}

/// Temporal ids of a video's steps: `(s · seconds per grid · per_second)` in f32, truncated.
fn video_times(m: &MediaGrid, tm: &TmRope) -> Vec<i64> {
    (0..m.thw[0]).map(|s| (s as f32 * m.second_per_grid as f32 * tm.per_second as f32) as i64).collect()
}

/// `[start, end)` runs of `values` (ascending, counted from 0) by chunks of `per_chunk`, as
/// transformers' `get_chunked_index`: a run ends where a value reaches the next multiple.
fn chunks(values: &[i64], per_chunk: i64) -> Vec<(usize, usize)> {
    let (mut out, mut start, mut chunk) = (vec![], 0usize, 1i64);
    for (i, &v) in values.iter().enumerate() {
        if v >= chunk * per_chunk {
            out.push((start, i));
            (start, chunk) = (i, chunk + 1);
        }
    }
    out.push((start, values.len()));
    out
}

/// The tokens of a video (grid `m`) and its audio track (`n_audio` tokens) between their
/// markers, as transformers' processor lays them out: each time chunk's video tokens, then its
/// audio tokens.
pub fn interleaved_tokens(m: &MediaGrid, merge: usize, n_audio: usize, video_token: u32, tm: &TmRope) -> Vec<u32> {
    let per_step = (m.thw[1] / merge) * (m.thw[2] / merge);
    let video: Vec<i64> = video_times(m, tm).into_iter().flat_map(|t| std::iter::repeat_n(t, per_step)).collect();
    let audio: Vec<i64> = (0..n_audio as i64).collect();
    let (vc, ac) = (chunks(&video, tm.per_chunk), chunks(&audio, tm.per_chunk));
    let mut out = Vec::with_capacity(video.len() + n_audio);
    for j in 0..vc.len().max(ac.len()) {
        if let Some(&(a, b)) = vc.get(j) {
            out.extend(std::iter::repeat_n(video_token, b - a));
        }
        if let Some(&(a, b)) = ac.get(j) {
            out.extend(std::iter::repeat_n(tm.audio_token, b - a));
        }
    }
    out
}

/// Positions of one audio-in-video block at the start of `ids` (its two start markers, the
/// interleaved video and audio tokens, its two end markers, both at the block's last id) and
/// the tokens it spans. Every token of the block must be where `interleaved_tokens` puts it.
fn audio_in_video(ids: &[u32], m: &MediaGrid, p: &RopeParams, tm: &TmRope, start: i64) -> Result<(Positions, usize)> {
    let body = &ids[2..];
    let n_video = m.thw[0] * (m.thw[1] / p.merge) * (m.thw[2] / p.merge);
    let len = body.iter().position(|&t| t != p.video_token && t != tm.audio_token).unwrap_or(body.len());
    let n_audio = body[..len].iter().filter(|&&t| t == tm.audio_token).count();
    if len - n_audio != n_video {
        bail!("{} video tokens but its grid {:?} needs {n_video}", len - n_audio, m.thw);
    }
    if body.get(len) != Some(&tm.audio_end) || body.get(len + 1) != Some(&tm.vision_end) {
        bail!("the block does not end with the audio-end and vision-end markers");
    }
    if body[..len] != interleaved_tokens(m, p.merge, n_audio, p.video_token, tm)[..] {
        bail!("video and audio tokens are not interleaved in {}-id time chunks as the processor writes them", tm.per_chunk);
    }
    let st = start + 1;
    let video = grid_run(m, p.merge, st, &video_times(m, tm));
    let audio: Vec<i64> = (0..n_audio as i64).map(|k| k + st).collect();
    let rel = |v: &[i64]| v.iter().map(|x| x - st).collect::<Vec<_>>();
    let (vc, ac) = (chunks(&rel(&video[0]), tm.per_chunk), chunks(&rel(&audio), tm.per_chunk));
    let mut run: Positions = [vec![start, start], vec![start, start], vec![start, start]];
    // transformers puts the end markers after the last chunk's max, which need not be the
    // block's (a video step late in the last chunk can pass the audio's end).
    let mut last = start;
    for j in 0..vc.len().max(ac.len()) {
        if let Some(&(a, b)) = vc.get(j) {
            (0..3).for_each(|c| run[c].extend_from_slice(&video[c][a..b]));
            last = (0..3).flat_map(|c| video[c][a..b].iter().copied()).max().unwrap_or(last);
        }
        if let Some(&(a, b)) = ac.get(j) {
            (0..3).for_each(|c| run[c].extend_from_slice(&audio[a..b]));
            last = audio[a..b].iter().copied().max().unwrap_or(last);
        }
    }
    let end = last + 1;
    (0..3).for_each(|c| run[c].extend_from_slice(&[end, end]));
    Ok((run, len + 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_at_each_multiple() {
        assert_eq!(chunks(&[0, 0, 25, 25, 50, 50, 75], 50), vec![(0, 4), (4, 7)]);
        let audio: Vec<i64> = (0..112).collect();
        assert_eq!(chunks(&audio, 50), vec![(0, 50), (50, 100), (100, 112)]);
    }

    /// A video whose last step (t = 75) passes its audio's end (60 tokens): transformers puts
    /// the end markers and the text after the last chunk (the audio's, max 61), while the rope
    /// delta follows the largest id (77). Values from transformers 4.57.1's get_rope_index.
    #[test]
    fn audio_in_video_follows_transformers_past_the_audio_end() {
        let (v, au, vs, as_, ae, ve) = (461, 451, 457, 452, 453, 458);
        let mut ids = vec![5, vs, as_, v, v];
        ids.extend([au; 50]);
        ids.extend([v, v]);
        ids.extend([au; 10]);
        ids.extend([ae, ve, 7]);
        let p = RopeParams { merge: 2, image_token: 460, video_token: v, video_time: VideoTime::Index };
        let tm = TmRope { audio_token: au, audio_start: as_, audio_end: ae, vision_start: vs, vision_end: ve, per_second: 25, per_chunk: 50 };
        let video = MediaGrid { thw: [4, 2, 2], is_video: true, second_per_grid: 1.0, frames: 0, size: [0, 0], audio_frames: 0 };
        let (pos, delta) = tmrope_index(&ids, &[video], &p, &tm).unwrap();
        let mut t = vec![0, 1, 1, 2, 27];
        t.extend(2..52);
        t.extend([52, 77]);
        t.extend(52..62);
        t.extend([62, 62, 63]);
        assert_eq!(pos[0], t);
        assert_eq!(&pos[1][..8], &[0, 1, 1, 2, 2, 2, 3, 4]);
        assert_eq!(delta, 8);
    }
}
