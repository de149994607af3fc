//! Any audio ffmpeg decodes (MP3, FLAC, AAC in an mp4 clip, …), through the libraries merg
//! already links for video: the best audio stream is decoded, and swresample (its default
//! filter, as `ffmpeg -ar 16000` uses) converts every channel to 16 kHz planar float; the
//! channels are then averaged.

use std::path::Path;

use video_rs::ffmpeg;
use ffmpeg::format::Sample;
use ffmpeg::software::resampling;
use ffmpeg::util::frame::Audio as Frame;
use ffmpeg::ChannelLayout;

use super::{AudioError, TARGET_RATE};

fn init() -> Result<(), String> {
    static INIT: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    INIT.get_or_init(|| ffmpeg::init().map_err(|e| e.to_string())).clone()
}

/// The best audio stream of `path` as 16 kHz mono.
pub(crate) fn decode(path: &Path, max_seconds: f64) -> Result<Vec<f32>, AudioError> {
    let bad = |e: ffmpeg::Error| AudioError::undecodable(path, e);
    init().map_err(|e| AudioError::undecodable(path, e))?;
    let mut input = ffmpeg::format::input(&path).map_err(bad)?;
    let stream = input.streams().best(ffmpeg::media::Type::Audio).ok_or_else(|| AudioError::NoAudioStream { path: path.to_path_buf() })?;
    let index = stream.index();
    // The header's duration: the stream's, else the container's (AV_TIME_BASE units).
    let seconds = if stream.duration() > 0 {
        stream.duration() as f64 * f64::from(stream.time_base())
    } else {
        input.duration().max(0) as f64 / ffmpeg::ffi::AV_TIME_BASE as f64
    };
    super::check_duration(path, seconds, max_seconds)?;
    let mut decoder = ffmpeg::codec::context::Context::from_parameters(stream.parameters()).and_then(|c| c.decoder().audio()).map_err(bad)?;
    if decoder.rate() == 0 {
        return Err(AudioError::ZeroRate { path: path.to_path_buf() });
    }
    let mut out = Output { planes: vec![], resampler: None, limit: (max_seconds * TARGET_RATE as f64).ceil() as usize };
    let mut packet = ffmpeg::Packet::empty();
    loop {
        match packet.read(&mut input) {
            Ok(()) if packet.stream() == index => {
                decoder.send_packet(&packet).map_err(bad)?;
                out.drain(&mut decoder, path)?;
            }
            Ok(()) => {}
            Err(ffmpeg::Error::Eof) => break,
            Err(e) => return Err(bad(e)),
        }
    }
    decoder.send_eof().map_err(bad)?;
    out.drain(&mut decoder, path)?;
    out.finish(path)
}

/// Resampled channels so far, and the resampler once the first frame has fixed the input format.
struct Output {
    planes: Vec<Vec<f32>>,
    resampler: Option<resampling::Context>,
    /// Samples per channel allowed (the duration cap: a header can understate the length).
    limit: usize,
}

impl Output {
    fn drain(&mut self, decoder: &mut ffmpeg::decoder::Audio, path: &Path) -> Result<(), AudioError> {
        let mut frame = Frame::empty();
        while decoder.receive_frame(&mut frame).is_ok() {
            if self.resampler.is_none() {
                let layout = layout_of(&frame);
                let r = resampling::Context::get(frame.format(), layout, frame.rate(), Sample::F32(ffmpeg::format::sample::Type::Planar), layout, TARGET_RATE)
                    .map_err(|e| AudioError::undecodable(path, e))?;
                self.planes = vec![vec![]; layout.channels() as usize];
                self.resampler = Some(r);
            }
            // A frame's layout must be the resampler's: ffmpeg-next does not reconfigure it.
            frame.set_channel_layout(self.resampler.as_ref().expect("set above").input().channel_layout);
            let cap = frame.samples() * TARGET_RATE as usize / frame.rate().max(1) as usize + 256;
            let mut res = self.new_frame(cap);
            self.resampler.as_mut().expect("set above").run(&frame, &mut res).map_err(|e| AudioError::undecodable(path, e))?;
            self.take(&res, path)?;
        }
        Ok(())
    }

    fn new_frame(&self, samples: usize) -> Frame {
        let layout = self.resampler.as_ref().map(|r| r.output().channel_layout).unwrap_or(ChannelLayout::MONO);
        let mut f = Frame::new(Sample::F32(ffmpeg::format::sample::Type::Planar), samples, layout);
        f.set_rate(TARGET_RATE);
        f
    }

    fn take(&mut self, res: &Frame, path: &Path) -> Result<(), AudioError> {
        for (c, plane) in self.planes.iter_mut().enumerate() {
            plane.extend_from_slice(&res.plane::<f32>(c)[..res.samples()]);
        }
        let got = self.planes.first().map_or(0, Vec::len);
        if got > self.limit {
            return Err(super::too_long(path, got as f64 / TARGET_RATE as f64));
        }
        Ok(())
    }

    /// What the resampler still holds (its filter's tail), then the channel mean.
    fn finish(mut self, path: &Path) -> Result<Vec<f32>, AudioError> {
        while self.resampler.is_some() {
            let mut res = self.new_frame(4096);
            self.resampler.as_mut().expect("checked").flush(&mut res).map_err(|e| AudioError::undecodable(path, e))?;
            if res.samples() == 0 {
                break;
            }
            self.take(&res, path)?;
        }
        let n = self.planes.first().map_or(0, Vec::len);
        if n == 0 {
            return Err(AudioError::Empty { path: path.to_path_buf() });
        }
        let c = self.planes.len() as f64;
        Ok((0..n).map(|i| (self.planes.iter().map(|p| p[i] as f64).sum::<f64>() / c) as f32).collect())
    }
}

/// The frame's channel layout, or the default one for its channel count when the file states
/// none (a WAV without a channel mask).
fn layout_of(frame: &Frame) -> ChannelLayout {
    let l = frame.channel_layout();
    if l.is_empty() || l.channels() != frame.channels() as i32 {
        ChannelLayout::default(frame.channels() as i32)
    } else {
        l
    }
}

/// Mono samples at `rate` resampled to 16 kHz by swresample.
pub(crate) fn resample(samples: &[f32], rate: u32, path: &Path) -> Result<Vec<f32>, AudioError> {
    let bad = |e: ffmpeg::Error| AudioError::undecodable(path, e);
    init().map_err(|e| AudioError::undecodable(path, e))?;
    let packed = Sample::F32(ffmpeg::format::sample::Type::Packed);
    let planar = Sample::F32(ffmpeg::format::sample::Type::Planar);
    let r = resampling::Context::get(packed, ChannelLayout::MONO, rate, planar, ChannelLayout::MONO, TARGET_RATE).map_err(bad)?;
    let mut out = Output { planes: vec![vec![]], resampler: Some(r), limit: usize::MAX };
    for chunk in samples.chunks(4096) {
        let mut f = Frame::new(packed, chunk.len(), ChannelLayout::MONO);
        f.set_rate(rate);
        f.plane_mut::<f32>(0).copy_from_slice(chunk);
        let mut res = out.new_frame(chunk.len() * TARGET_RATE as usize / rate as usize + 256);
        out.resampler.as_mut().expect("set").run(&f, &mut res).map_err(bad)?;
        out.take(&res, path)?;
    }
    out.finish(path)
}
