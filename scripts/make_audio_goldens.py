#!/usr/bin/env python3
"""Audio fixtures and goldens for src/audio (issue 29 item 2), from PyAV and transformers 4.57.1.

Writes (deterministic: seeded noise, fixed encoder settings, one CPU thread):
    tests/fixtures/media/tone.wav      2 s, 44.1 kHz, stereo, 16-bit PCM: tones + seeded noise
    tests/fixtures/media/tone.mp4      the same signal as an AAC track beside a tiny video stream
    tests/fixtures/goldens/audio/pcm.safetensors       16 kHz mono f32 of both files, decoded by PyAV
    tests/fixtures/goldens/audio/features.safetensors  WhisperFeatureExtractor log-mel features
    tests/fixtures/goldens/audio/index.json            versions, shapes, attention-mask sums, cross-checks

The 16 kHz PCM is what merg's ffmpeg path must give: the file decoded by ffmpeg, every channel
resampled to 16 kHz by swresample (its default filter; PyAV drives the same library), then the
channels averaged (librosa's and qwen-omni-utils' downmix; ffmpeg's own `-ac 1` would weight
stereo by 1/sqrt(2) instead, which shifts every log-mel value by log10(2)/4).

The features are transformers' `WhisperFeatureExtractor` called as Qwen2.5-Omni's processor calls
it (`padding="max_length"`, `return_attention_mask=True`, 16 kHz) on the committed `wav` PCM:
128 mel bins (Qwen2.5-Omni's preprocessor config) and the 80-bin default. Both are 3000 frames;
past the signal every frame is the clamp floor (max - 8), so only the first HEAD frames are stored
and the script asserts the rest equal `floor` exactly. `long128` is a deterministic 31 s chirp
(no random numbers, so Rust rebuilds it): truncated to 30 s, stored as its first and last EDGE frames.

Usage: /root/golden-venv/bin/python scripts/make_audio_goldens.py
"""
from __future__ import annotations

import io
import json
import wave
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from transformers import WhisperFeatureExtractor

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
MEDIA = REPO / "tests" / "fixtures" / "media"
GOLD = REPO / "tests" / "fixtures" / "goldens" / "audio"
RATE_IN = 44100
SECONDS = 2.0
HEAD = 256  # stored frames of the 2 s cases (200 carry signal)
EDGE = 64  # stored frames at each end of the 30 s case
SEED = 29


def tone_signal() -> np.ndarray:
    """(2, n) float64 in [-1, 1]: a tone per channel, a shared chirp, seeded noise, a fade-in."""
    rng = np.random.default_rng(SEED)
    t = np.arange(int(RATE_IN * SECONDS)) / RATE_IN
    chirp = 0.2 * np.sin(2 * np.pi * (200 * t + 900 * t * t))
    left = 0.3 * np.sin(2 * np.pi * 440 * t) + chirp + 0.05 * rng.standard_normal(t.size)
    right = 0.25 * np.sin(2 * np.pi * 1000 * t) + chirp + 0.05 * rng.standard_normal(t.size)
    fade = np.minimum(t / 0.1, 1.0)
    return np.clip(np.stack([left, right]) * fade, -1, 1)


def long_chirp() -> np.ndarray:
    """31 s at 16 kHz: computed in f64 and rounded to f32, as tests/audio_goldens.rs does."""
    t = np.arange(31 * 16000, dtype=np.float64) / 16000
    x = 0.4 * np.sin(2 * np.pi * (150 * t + 40 * t * t)) + 0.1 * np.sin(2 * np.pi * 3000 * t)
    return x.astype(np.float32)


def write_wav(path: Path, sig: np.ndarray) -> None:
    pcm = np.round(sig.T * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(RATE_IN)
        w.writeframes(pcm.tobytes())
    path.write_bytes(buf.getvalue())


def write_mp4(path: Path, sig: np.ndarray) -> None:
    """AAC 128 kb/s beside 2 s of 32x32 mpeg4 video at 10 fps (a clip, as MELD's are)."""
    out = av.open(str(path), "w", format="mp4", options={"fflags": "+bitexact"})
    out.metadata.clear()
    vs = out.add_stream("mpeg4", rate=10)
    vs.width, vs.height, vs.pix_fmt = 32, 32, "yuv420p"
    vs.options = {"flags": "+bitexact"}
    aus = out.add_stream("aac", rate=RATE_IN, layout="stereo")
    aus.bit_rate = 128000
    aus.options = {"flags": "+bitexact"}
    for i in range(int(SECONDS * 10)):
        img = np.full((32, 32, 3), (i * 12) % 256, np.uint8)
        for p in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            out.mux(p)
    for p in vs.encode():
        out.mux(p)
    planar = sig.astype(np.float32)
    for start in range(0, planar.shape[1], 1024):
        fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(planar[:, start:start + 1024]), format="fltp", layout="stereo")
        fr.sample_rate = RATE_IN
        fr.pts = start
        fr.time_base = Fraction(1, RATE_IN)
        for p in aus.encode(fr):
            out.mux(p)
    for p in aus.encode():
        out.mux(p)
    out.close()


def decode_16k(path: Path) -> np.ndarray:
    """Every channel to 16 kHz planar float by swresample, then the channel mean."""
    with av.open(str(path)) as c:
        stream = c.streams.audio[0]
        res = av.AudioResampler(format="fltp", layout=stream.layout, rate=16000)
        chunks = []
        for frame in c.decode(stream):
            chunks += [f.to_ndarray() for f in res.resample(frame)]
        chunks += [f.to_ndarray() for f in res.resample(None)]
    planar = np.concatenate(chunks, axis=1)
    return planar.mean(axis=0, dtype=np.float64).astype(np.float32)


def features(pcm: np.ndarray, mels: int) -> tuple[np.ndarray, np.ndarray]:
    fe = WhisperFeatureExtractor(feature_size=mels)
    out = fe(pcm, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="np")
    # The numpy path (used when torch is absent) as a cross-check of the torch one.
    np_feats = fe._np_extract_fbank_features(np.pad(pcm, (0, fe.n_samples - min(pcm.size, fe.n_samples)))[None, : fe.n_samples], "cpu")
    diff = float(np.abs(np_feats[0] - out["input_features"][0]).max())
    assert diff < 1e-4, f"torch and numpy paths differ by {diff}"
    return out["input_features"][0].astype(np.float32), out["attention_mask"][0], diff


def main() -> None:
    MEDIA.mkdir(parents=True, exist_ok=True)
    GOLD.mkdir(parents=True, exist_ok=True)
    sig = tone_signal()
    write_wav(MEDIA / "tone.wav", sig)
    write_mp4(MEDIA / "tone.mp4", sig)
    wav16 = decode_16k(MEDIA / "tone.wav")
    mp416 = decode_16k(MEDIA / "tone.mp4")
    save_file({"wav": wav16, "mp4": mp416}, str(GOLD / "pcm.safetensors"))

    tensors, index = {}, {"transformers": transformers.__version__, "torch": torch.__version__, "av": av.__version__,
                          "ffmpeg": {k: list(v) for k, v in av.library_versions.items()}, "seed": SEED, "cases": {}}
    for name, pcm, mels in [("wav128", wav16, 128), ("wav80", wav16, 80), ("long128", long_chirp(), 128)]:
        feats, mask, np_diff = features(pcm, mels)
        case = {"mels": mels, "frames": int(feats.shape[1]), "samples": int(pcm.size), "mask_sum": int(mask.sum()),
                "mask_len": int(mask.size), "numpy_vs_torch_max_abs": np_diff}
        if name == "long128":
            tensors[f"{name}.head"] = np.ascontiguousarray(feats[:, :EDGE])
            tensors[f"{name}.tail"] = np.ascontiguousarray(feats[:, -EDGE:])
            case["edge"] = EDGE
        else:
            floor = feats[:, HEAD:]
            assert (floor == floor.flat[0]).all(), f"{name}: frames past {HEAD} are not all the floor"
            tensors[f"{name}.head"] = np.ascontiguousarray(feats[:, :HEAD])
            case["head"], case["floor"] = HEAD, float(floor.flat[0])
        index["cases"][name] = case
    save_file(tensors, str(GOLD / "features.safetensors"))
    index["pcm"] = {"wav": int(wav16.size), "mp4": int(mp416.size)}
    (GOLD / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(json.dumps(index, indent=1))


if __name__ == "__main__":
    main()
