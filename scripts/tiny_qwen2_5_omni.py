"""Qwen2.5-Omni (model_type `qwen2_5_omni`): the tiny checkpoint and its goldens, kept apart from the Qwen-VL scripts.

make_tiny_checkpoints.py and make_goldens.py hand the `qwen2_5_omni` family to `make_checkpoint()` / `make_goldens()`
here (run under /root/golden-venv, transformers 4.57.1).

Checkpoint (tests/fixtures/tiny-qwen2_5-omni/), in the layout of the released Qwen/Qwen2.5-Omni-3B / -7B repos:
- config.json with `model_type` qwen2_5_omni, `enable_audio_output`, and `thinker_config` holding `audio_config`,
  `vision_config`, `text_config` and the token ids (`*_token_index`, audio/vision start and end,
  position_id_per_seconds 25, seconds_per_chunk 2); `talker_config` and `token2wav_config` tiny but never built;
- tensors `thinker.model.*`, `thinker.lm_head.weight`, `thinker.visual.*`, `thinker.audio_tower.*` from a random
  Qwen2_5OmniThinkerForConditionalGeneration, plus a few tiny `talker.*` / `token2wav.*` tensors (random, named as
  the released ones) so that a loader's skipping of them is exercised, and a one-entry spk_dict.pt (transformers'
  Qwen2_5OmniForConditionalGeneration.from_pretrained requires the file);
- the audio tower keeps the released n_window = 100 (chunks of 200 mel frames) so that a 5.3 s clip has three
  chunks, the last one partial;
- the tiny byte-level BPE of make_tiny_checkpoints.py with the Omni specials (Qwen2-VL's 14 with the audio/vision
  renames: <|AUDIO|> <|audio_bos|> <|audio_eos|> <|vision_bos|> <|vision_eos|> <|IMAGE|> <|VIDEO|>), the Omni chat
  template, preprocessor_config.json (WhisperFeatureExtractor, 128 mels, + the Qwen2-VL image processor fields).

Goldens (tests/fixtures/goldens/qwen2_5_omni/): text, audio, image_audio, video_audio (use_audio_in_video) and video
(the same frames without their track). Each holds
the prompt ids, positions and rope delta from transformers' get_rope_index (TMRoPE), the f32 logits of the no-cache
forward (eager attention), 32 greedy ids, and the processor's inputs: input_features cut to the longest clip's valid
frames (the rest is padding to 30 s that the model drops by feature_attention_mask), feature_attention_mask,
pixel_values(_videos), grids, video_second_per_grid; and audio_features (the audio tower's output) on its own.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import make_goldens as mg

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "tiny-qwen2_5-omni"
GOLD = REPO / "tests" / "fixtures" / "goldens" / "qwen2_5_omni"
MEDIA = REPO / "tests" / "fixtures" / "media"
SEED = int(os.environ.get("TINY_SEED_QWEN2_5_OMNI", 25))
NEW_TOKENS = 32
SAMPLE_RATE = 16000

# Qwen2-VL's 14 specials in id order with Qwen2.5-Omni's renames (the released vocabulary keeps the ids).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>",
]

# The Qwen2.5-Omni chat template (the released chat_template.json's, audio items as <|audio_bos|><|AUDIO|><|audio_eos|>).
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: "
    "{% endif %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TALKER_TENSORS = {  # a few released talker / token2wav names, tiny shapes: present so that a loader must skip them
    "talker.model.embed_tokens.weight": (16, 8),
    "talker.codec_head.weight": (16, 8),
    "talker.thinker_to_talker_proj.weight": (8, 64),
    "token2wav.code2wav_dit_model.input_embed.proj.weight": (8, 8),
    "token2wav.code2wav_bigvgan_model.conv_pre.weight": (8, 8, 3),
}


def ids() -> dict:
    import make_tiny_checkpoints as mtc

    return {t: mtc.BPE_VOCAB + i for i, t in enumerate(SPECIAL_TOKENS)}


def thinker_config() -> dict:
    import make_tiny_checkpoints as mtc

    v = ids()
    return {
        "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
        "audio_config": {
            "activation_function": "gelu", "d_model": 32, "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
            "encoder_layers": 2, "max_source_positions": 1500, "model_type": "qwen2_5_omni_audio_encoder",
            "n_window": 100, "num_mel_bins": 128, "output_dim": 64, "scale_embedding": False,
        },
        "text_config": {
            "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 4096,
            "model_type": "qwen2_5_omni_text", "num_attention_heads": 4, "num_hidden_layers": 3,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
            "sliding_window": 4096, "tie_word_embeddings": False, "use_sliding_window": False,
            "vocab_size": mtc.MODEL_VOCAB,
        },
        "vision_config": {
            "depth": 4, "embed_dim": 32, "fullatt_block_indexes": [1, 3], "hidden_act": "silu", "hidden_size": 32,
            "in_channels": 3, "in_chans": 3, "intermediate_size": 64, "model_type": "qwen2_5_omni_vision_encoder",
            "num_heads": 4, "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
            "temporal_patch_size": 2, "tokens_per_second": 25, "window_size": 56,
        },
        "audio_end_token_id": v["<|audio_eos|>"], "audio_start_token_id": v["<|audio_bos|>"],
        "audio_token_index": v["<|AUDIO|>"], "bos_token_id": v["<|im_start|>"], "eos_token_id": v["<|im_end|>"],
        "ignore_index": -100, "image_token_index": v["<|IMAGE|>"], "init_std": 0.02,
        "model_type": "qwen2_5_omni_thinker", "pad_token_id": v["<|endoftext|>"], "position_id_per_seconds": 25,
        "seconds_per_chunk": 2, "torch_dtype": "float32", "user_token_id": 0, "video_token_index": v["<|VIDEO|>"],
        "vision_end_token_id": v["<|vision_eos|>"], "vision_start_token_id": v["<|vision_bos|>"],
        "vision_token_id": v["<|vision_pad|>"],
    }


def config_json(tv: str) -> dict:
    return {
        "architectures": ["Qwen2_5OmniModel"], "enable_audio_output": True, "enable_talker": True,
        "model_type": "qwen2_5_omni",
        "talker_config": {"hidden_size": 8, "embedding_size": 64, "intermediate_size": 16, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 16,
                          "model_type": "qwen2_5_omni_talker"},
        "thinker_config": thinker_config(),
        "token2wav_config": {"model_type": "qwen2_5_omni_token2wav"},
        "torch_dtype": "float32", "transformers_version": tv,
    }


def preprocessor_config() -> dict:
    """WhisperFeatureExtractor (Qwen2.5-Omni's: 128 mels, 30 s chunks) with the Qwen2-VL image fields beside it, as
    the released preprocessor_config.json; pixel budget as the tiny Qwen2.5-VL's."""
    return {
        "chunk_length": 30, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
        "hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": SAMPLE_RATE,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 50176, "merge_size": 2, "min_pixels": 3136,
        "patch_size": 14, "processor_class": "Qwen2_5OmniProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2,
    }


def tokenizer_config() -> dict:
    import make_tiny_checkpoints as mtc

    added = [(t, True) for t in SPECIAL_TOKENS]
    cfg = mtc.tokenizer_config(CHAT_TEMPLATE, added)
    cfg["additional_special_tokens"] = SPECIAL_TOKENS[1:]
    cfg["processor_class"] = "Qwen2_5OmniProcessor"
    cfg["extra_special_tokens"] = {
        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>", "audio_token": "<|AUDIO|>",
        "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
    }
    return cfg


def init_rule(name, leaf):
    """(mean, std) of each weight: larger than the default init (clear greedy margins); LayerNorm / RMSNorm weights
    around 1."""
    if "norm" in leaf or "ln_" in leaf:
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.05
    if "embed_tokens" in name or "audio_bos_eos_token" in name:
        return 0.0, 0.5
    if "conv" in name:
        return 0.0, 0.1
    return 0.0, 0.2


def thinker_class():
    import transformers

    return transformers.Qwen2_5OmniThinkerForConditionalGeneration


def make_checkpoint():
    import torch
    import transformers

    import make_tiny_checkpoints as mtc

    OUT.mkdir(parents=True, exist_ok=True)
    for f in OUT.iterdir():
        f.unlink()
    tv = transformers.__version__
    tok_json, vocab, merges = mtc.tokenizer_json_and_vocab([(t, True) for t in SPECIAL_TOKENS])
    (OUT / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")
    mtc.write_json(OUT / "vocab.json", vocab)
    (OUT / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    mtc.write_json(OUT / "tokenizer_config.json", tokenizer_config())
    mtc.write_json(OUT / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    mtc.write_json(OUT / "preprocessor_config.json", preprocessor_config())
    v = ids()
    mtc.write_json(OUT / "generation_config.json", {"bos_token_id": v["<|im_start|>"], "eos_token_id": v["<|im_end|>"],
                                                    "pad_token_id": v["<|endoftext|>"], "transformers_version": tv})
    cfg = config_json(tv)
    mtc.write_json(OUT / "config.json", cfg)
    torch.manual_seed(0)
    tcfg = transformers.Qwen2_5OmniThinkerConfig(**cfg["thinker_config"])
    model = thinker_class()(tcfg).to(torch.float32).eval()
    mtc.init_by_rule(model, SEED, init_rule)
    sd = {"thinker." + k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(SEED + 1)
    for k, shape in TALKER_TENSORS.items():
        sd[k] = torch.randn(shape, generator=g)
    mtc.write_shards(OUT, sd)
    # The released repos carry the talker's speaker table; transformers' full model will not load without one.
    torch.save({"Chelsie": {"bos_token": 0}}, OUT / "spk_dict.pt")
    print(f"qwen2_5_omni: {len(sd)} tensors, {sum(v.numel() for v in sd.values())} params -> {OUT}")
    # The released layout loads into transformers' full model (talker off), whose thinker is ours.
    full = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(str(OUT), dtype=torch.float32,
                                                                           enable_audio_output=False).eval()
    ref, got = model.state_dict(), full.thinker.state_dict()
    assert set(ref) == set(got), set(ref) ^ set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    proc = load_processor()
    for t, i in v.items():
        assert proc.tokenizer.convert_tokens_to_ids(t) == i, t
    print("qwen2_5_omni: reload OK")


# ----------------------------------------------------------------------------------------------
# Goldens
# ----------------------------------------------------------------------------------------------
SYSTEM = {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]}
CASES = {
    "text": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Hello! How are you doing today?"}]}],
    "audio": [SYSTEM, {"role": "user", "content": [{"type": "audio", "audio": "clip_a"},
                                                   {"type": "text", "text": "Why did you say that?"}]}],
    "image_audio": [SYSTEM, {"role": "user", "content": [{"type": "image", "image": "img_a.png"},
                                                         {"type": "audio", "audio": "clip_b"},
                                                         {"type": "text", "text": "What is in this picture?"}]}],
    "video_audio": [SYSTEM, {"role": "user", "content": [{"type": "video", "video": "vid"},
                                                         {"type": "text", "text": "What happens next in the video?"}]}],
    # The same video without its track: TMRoPE's plain video time (steps at seconds x 25).
    "video": [SYSTEM, {"role": "user", "content": [{"type": "video", "video": "vid", "with_audio": False},
                                                   {"type": "text", "text": "Can you describe the video in a few words?"}]}],
}
# Seconds of each synthetic clip: 5.3 s = 530 mel frames = chunks of 200, 200, 130; 1.7 s = one partial chunk;
# 4.5 s beside a 4 s video = three audio time chunks against two video ones.
CLIPS = {"clip_a": 5.3, "clip_b": 1.7, "vid": 4.5}
VIDEO_FRAMES = ["vid_0.png", "vid_1.png", "vid_2.png", "vid_3.png"]
VIDEO_FPS = 2.0


def clip(name):
    """A seeded waveform: a gliding tone with a second harmonic, an amplitude swell and a little noise."""
    import numpy as np

    rng = np.random.default_rng(SEED + sum(map(ord, name)))
    t = np.arange(int(CLIPS[name] * SAMPLE_RATE)) / SAMPLE_RATE
    f = 220 + 180 * t / t[-1] + rng.uniform(0, 100)
    phase = 2 * np.pi * np.cumsum(f) / SAMPLE_RATE
    x = 0.5 * np.sin(phase) + 0.2 * np.sin(2 * phase) * (0.5 + 0.5 * np.sin(2 * np.pi * 0.7 * t))
    return (x + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def write_clip_wavs():
    """Each synthetic clip as a 32-bit float WAV in tests/fixtures/media (omni_<name>.wav): the very samples the
    goldens were made from, so merg's file-to-logits path is checked against them without rounding."""
    import struct

    for name in CLIPS:
        x = clip(name)
        data = x.astype("<f4").tobytes()
        fmt = struct.pack("<HHIIHH", 3, 1, SAMPLE_RATE, SAMPLE_RATE * 4, 4, 32)  # IEEE float, mono
        body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
        (MEDIA / f"omni_{name}.wav").write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def video_frames():
    """Eight frames (the four committed ones forth and back) at 2 fps: a 4 s clip, four temporal grid steps."""
    import numpy as np
    from PIL import Image

    frames = [np.asarray(Image.open(MEDIA / n).convert("RGB")) for n in VIDEO_FRAMES]
    return np.stack(frames + frames[::-1])


def processor_inputs(proc, messages):
    from PIL import Image

    images, audios, videos = [], [], []
    for m in messages:
        for c in m["content"]:
            if c["type"] == "image":
                images.append(Image.open(MEDIA / c["image"]).convert("RGB"))
            elif c["type"] == "audio":
                audios.append(clip(c["audio"]))
            elif c["type"] == "video":
                videos.append(video_frames())
                if c.get("with_audio", True):
                    audios.append(clip(c["video"]))
    in_video = bool(videos) and bool(audios)
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=text, images=images or None, audio=audios or None, videos=videos or None, return_tensors="pt",
                  videos_kwargs={"size": {"shortest_edge": 3136, "longest_edge": 50176}, "fps": VIDEO_FPS,
                                 "do_sample_frames": False, "use_audio_in_video": in_video})
    return text, inputs, in_video


def rope(model, inputs, in_video):
    import torch

    fam = inputs.get("feature_attention_mask")
    return model.get_rope_index(inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                                torch.ones_like(inputs["input_ids"]), in_video,
                                None if fam is None else fam.sum(-1), inputs.get("video_second_per_grid"))


def run_case(case, proc, model):
    import torch
    import transformers
    from safetensors.torch import save_file

    messages = CASES[case]
    text, inputs, in_video = processor_inputs(proc, messages)
    L = inputs["input_ids"].shape[1]
    if "video_second_per_grid" in inputs:
        v = inputs["video_second_per_grid"]  # a list from the processor, a tensor once return_tensors applies
        inputs["video_second_per_grid"] = (v if torch.is_tensor(v) else torch.tensor(v)).to(torch.float32)
    kw = dict(inputs)
    kw["use_audio_in_video"] = in_video
    with torch.no_grad():
        logits = model(**kw, use_cache=False).logits.float()
    pos, delta = rope(model, inputs, in_video)
    model.rope_deltas = None  # no rope delta left over from the forward above
    greedy, margins = mg.greedy_with_margins(model, kw, NEW_TOKENS, ids()["<|endoftext|>"])
    assert int(logits[0, -1].argmax()) == int(greedy[0])
    tensors = mg.golden_tensors(inputs, pos[:, 0, :], delta, logits, greedy)
    if "video_second_per_grid" in inputs:
        tensors["video_second_per_grid"] = inputs["video_second_per_grid"].to(torch.float32).contiguous()
    if "input_features" in inputs:
        mask = inputs["feature_attention_mask"]
        n = int(mask.sum(-1).max())
        assert bool((mask[:, :n].sum(-1) == mask.sum(-1)).all())  # valid frames come first
        tensors["input_features"] = inputs["input_features"][:, :, :n].to(torch.float32).contiguous()
        tensors["feature_attention_mask"] = mask.to(torch.int64).contiguous()
        with torch.no_grad():
            tensors["audio_features"] = model.get_audio_features(
                inputs["input_features"], feature_attention_mask=mask).float().contiguous()
    GOLD.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(GOLD / f"{case}.safetensors"), metadata={"format": "pt"})
    meta = {"messages": messages, "prompt_text": text, "use_audio_in_video": in_video,
            "clip_seconds": {c.get("audio", c.get("video")): CLIPS[c.get("audio", c.get("video"))]
                             for m in messages for c in m["content"]
                             if c["type"] == "audio" or c["type"] == "video" and c.get("with_audio", True)},
            "num_new_tokens": NEW_TOKENS, "greedy_ids": greedy.tolist(), "margins": margins,
            "min_margin": min(margins), "transformers": transformers.__version__, "torch": torch.__version__}
    (GOLD / f"{case}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  qwen2_5_omni/{case}: L={L} min_margin={min(margins):.4g} greedy[:8]={greedy.tolist()[:8]}")
    return min(margins)


def load_processor():
    """Tokenizer from tokenizer.json (the file the Rust side reads), WhisperFeatureExtractor, the slow Qwen2-VL image
    processor and the Qwen2-VL video processor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(OUT))
    assert tok.is_fast, type(tok)
    fe = transformers.WhisperFeatureExtractor.from_pretrained(str(OUT))
    ip = transformers.Qwen2VLImageProcessor.from_pretrained(str(OUT))
    vp = transformers.Qwen2VLVideoProcessor(**{k: v for k, v in preprocessor_config().items()
                                              if k in ("image_mean", "image_std", "min_pixels", "max_pixels",
                                                       "merge_size", "patch_size", "temporal_patch_size")})
    return transformers.Qwen2_5OmniProcessor(image_processor=ip, video_processor=vp, feature_extractor=fe,
                                             tokenizer=tok, chat_template=CHAT_TEMPLATE)


def make_goldens(min_margin=1e-3):
    import torch
    import transformers

    write_clip_wavs()
    proc = load_processor()
    full = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(
        str(OUT), dtype=torch.float32, enable_audio_output=False, attn_implementation="eager").eval()
    model = full.thinker
    margins = {case: run_case(case, proc, model) for case in CASES}
    print(f"qwen2_5_omni min margins {margins}")
    bad = {k: v for k, v in margins.items() if v < min_margin}
    if bad:
        raise SystemExit(f"margin below {min_margin}: {bad}")
