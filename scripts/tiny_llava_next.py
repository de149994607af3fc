#!/usr/bin/env python3
"""LLaVA-NeXT (model_type `llava_next`): a tiny random checkpoint in the hub layout of
llava-hf/llava-v1.6-vicuna-7b-hf, and its goldens from transformers 4.57.1.

    /root/golden-venv/bin/python scripts/make_tiny_checkpoints.py llava_next   -> tests/fixtures/tiny-llava-next/
    /root/golden-venv/bin/python scripts/make_goldens.py llava_next            -> tests/fixtures/goldens/llava_next/

Checkpoint: config.json as the hub writes it (`text_config` llama, `vision_config` clip_vision_model,
`image_grid_pinpoints`, `vision_feature_layer` -2, `vision_feature_select_strategy` "default", `image_token_index`);
tensors under the hub's names (`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`, `image_newline`), which transformers maps onto its own module names on load;
preprocessor_config.json for LlavaNextImageProcessor, processor_config.json, a LLaMA-style tokenizer.json of our own
(SentencePiece-like BPE: Metaspace, byte fallback, `<s>` added by the post-processor) with `<image>` and `<pad>` after
the BPE vocabulary, and the vicuna chat template of transformers' LLaVA-NeXT conversion script.

Tiny dims: CLIP image_size 56, patch 14 (4x4 patches a tile), 3 layers (the features come from layer -2, so the last
layer is never run); the grid pinpoints are the real ones scaled by 56/336. Goldens: text, one image (img_a 100x70:
a 2x2 grid), two images of different aspect ratios (img_b 260x190: 2x2; img_tall 40x300: 3x1) — each with the HF
processor's ids and pixel values, the packed image features, logits, and 32 greedy tokens.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import make_goldens as mg
import make_tiny_checkpoints as mtc

NAME = "llava_next"
OUT = mtc.FIX / "tiny-llava-next"
GOLD = mtc.FIX / "goldens" / NAME
SEED = int(os.environ.get("TINY_SEED_LLAVA_NEXT", 7))

BPE_VOCAB = 400  # <unk> <s> </s>, 256 byte tokens <0x00>..<0xFF>, then learned pieces
IMAGE_TOKEN, PAD_TOKEN = "<image>", "<pad>"
IMAGE_ID, PAD_ID = BPE_VOCAB, BPE_VOCAB + 1
MODEL_VOCAB = 416  # padded past the tokenizer, as the hub's 32064 past 32002
TILE, PATCH = 56, 14
PINPOINTS = [[p * TILE // 336 for p in hw] for hw in [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]]

# transformers' convert_llava_next_weights_to_hf.py (the vicuna variant's template, as the llava-hf repos ship it)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'][0]['text'] }}"
    "{% else %}"
    "{{ message['role'].upper() + ': '}}"
    "{% endif %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}"
    "{% endfor %}"
    "{# Render all text next #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}"
    "{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ 'ASSISTANT:' }}"
    "{% endif %}"
)

CASES = {
    # The Qwen families' text and one-image conversations (make_goldens.CASES), then two images of other aspects.
    "text": mg.CASES["text"],
    "image": mg.CASES["image"],
    "two_images": [
        {"role": "user", "content": [{"type": "image", "image": "img_b.png"},
                                     {"type": "image", "image": "img_tall.png"},
                                     {"type": "text", "text": "What is the difference between these two images?"}]},
    ],
}


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------
def tokenizer_json() -> str:
    """A LLaMA-layout tokenizer.json: BPE over Metaspace pieces with byte fallback, ids 0-2 <unk> <s> </s>, 3-258
    the byte tokens, learned pieces after, `<image>` and `<pad>` as added tokens at 400/401."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB - 256, min_frequency=1, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    t.train_from_iterator(mtc.CORPUS * 3, trainer=trainer)
    trained = json.loads(t.to_str())["model"]
    learned = [tok for tok, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if tok not in ("<unk>", "<s>", "</s>")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({tok: 259 + i for i, tok in enumerate(learned)})
    assert len(vocab) == BPE_VOCAB, len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False),
                            AddedToken(PAD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(IMAGE_TOKEN) == IMAGE_ID and tok.token_to_id(PAD_TOKEN) == PAD_ID
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=2)


def added_tokens_decoder() -> dict:
    tokens = [(0, "<unk>"), (1, "<s>"), (2, "</s>"), (IMAGE_ID, IMAGE_TOKEN), (PAD_ID, PAD_TOKEN)]
    return {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True} for i, c in tokens}


def tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder(),
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": 4096,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "processor_class": "LlavaNextProcessor",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }


def preprocessor_config() -> dict:
    return {
        "aspect_ratio_setting": "anyres",
        "crop_size": {"height": TILE, "width": TILE},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_grid_pinpoints": PINPOINTS,
        "image_mean": mtc.CLIP_MEAN,
        "image_processor_type": "LlavaNextImageProcessor",
        "image_std": mtc.CLIP_STD,
        "processor_class": "LlavaNextProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": TILE},
    }


def processor_config() -> dict:
    return {"image_token": IMAGE_TOKEN, "num_additional_image_tokens": 1, "patch_size": PATCH,
            "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}


def config_json(tv: str) -> dict:
    return {
        "architectures": ["LlavaNextForConditionalGeneration"],
        "ignore_index": -100,
        "image_grid_pinpoints": PINPOINTS,
        "image_token_index": IMAGE_ID,
        "model_type": NAME,
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "pad_token_id": 0,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
            "vocab_size": MODEL_VOCAB,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": tv,
        "use_image_newline_parameter": True,
        "vision_config": {
            "hidden_size": 32,
            "image_size": TILE,
            "intermediate_size": 64,
            "model_type": "clip_vision_model",
            "num_attention_heads": 4,
            "num_hidden_layers": 3,
            "patch_size": PATCH,
            "projection_dim": 32,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": MODEL_VOCAB,
    }


def generation_config(tv: str) -> dict:
    return {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "transformers_version": tv}


def hub_name(name: str) -> str:
    """transformers 4.57 module names -> the names of the llava-hf checkpoints (written before the 4.52 nesting)."""
    for new, old in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                     ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("model.image_newline", "image_newline")):
        if name.startswith(new):
            return old + name[len(new):]
    raise ValueError(name)


def make_checkpoint():
    import torch
    import transformers

    tv = transformers.__version__
    OUT.mkdir(parents=True, exist_ok=True)
    for f in OUT.iterdir():
        f.unlink()
    (OUT / "tokenizer.json").write_text(tokenizer_json() + "\n", encoding="utf-8")
    mtc.write_json(OUT / "tokenizer_config.json", tokenizer_config())
    mtc.write_json(OUT / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": PAD_TOKEN,
                                                     "unk_token": "<unk>", "image_token": IMAGE_TOKEN})
    mtc.write_json(OUT / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    mtc.write_json(OUT / "preprocessor_config.json", preprocessor_config())
    mtc.write_json(OUT / "processor_config.json", processor_config())
    mtc.write_json(OUT / "generation_config.json", generation_config(tv))
    cfg = config_json(tv)
    mtc.write_json(OUT / "config.json", cfg)

    config = transformers.LlavaNextConfig(**copy.deepcopy(cfg))
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).to(torch.float32).eval()
    mtc.init_weights(model, SEED)
    sd = {hub_name(k): v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    mtc.write_shards(OUT, sd)
    print(f"{NAME}: {len(sd)} tensors, {sum(v.numel() for v in sd.values())} params -> {OUT}")
    verify(model)


def verify(ref):
    """Reload from the hub-layout files: same weights; the processor's tokenizer equals tokenizer.json as the
    `tokenizers` library reads it (so the Rust engine's), and `<image>` is one token."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    m = transformers.LlavaNextForConditionalGeneration.from_pretrained(str(OUT), dtype=torch.float32).eval()
    ref_sd, got = ref.state_dict(), m.state_dict()
    assert set(ref_sd) == set(got), set(ref_sd) ^ set(got)
    for k in ref_sd:
        assert torch.equal(ref_sd[k], got[k]), k
    proc = transformers.AutoProcessor.from_pretrained(str(OUT))
    assert type(proc).__name__ == "LlavaNextProcessor", type(proc)
    assert type(proc.image_processor).__name__ == "LlavaNextImageProcessor", type(proc.image_processor)
    assert proc.tokenizer.is_fast and proc.image_token_id == IMAGE_ID
    raw = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    for text in mtc.CORPUS + ["USER: <image>\nWhat is this? ASSISTANT:", "  two spaces\n\nand é 東京 😀"]:
        ids = raw.encode(text).ids
        assert proc.tokenizer(text)["input_ids"] == ids, text
        assert ids[0] == 1, ids
    print(f"{NAME}: reload OK ({type(proc.tokenizer).__name__})")


# ----------------------------------------------------------------------------------------------
# Goldens
# ----------------------------------------------------------------------------------------------
def load_processor():
    import transformers

    proc = transformers.AutoProcessor.from_pretrained(str(OUT))
    assert type(proc.image_processor).__name__ == "LlavaNextImageProcessor"  # the slow (PIL) one
    return proc


def run_case(case, proc, model, load_image):
    import torch
    import transformers
    from safetensors.torch import save_file

    messages = CASES[case]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [load_image(c["image"]) for m in messages for c in m["content"] if c["type"] == "image"]
    inputs = proc(text=[prompt], images=images or None, return_tensors="pt")
    ids = inputs["input_ids"]
    L = ids.shape[1]
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    logits = out.logits.float()
    assert logits.shape == (1, L, MODEL_VOCAB), logits.shape

    greedy, margins = mg.greedy_with_margins(model, inputs, mtc_new_tokens(), 0)
    assert IMAGE_ID not in greedy.tolist(), f"greedy path holds the image token: {greedy.tolist()}"
    # the full no-cache forward over prompt + continuation picks the same tokens
    ext = dict(inputs)
    ext["input_ids"] = torch.cat([ids, greedy[None, :-1]], 1)
    ext["attention_mask"] = torch.ones_like(ext["input_ids"])
    with torch.no_grad():
        re_ids = model(**ext, use_cache=False).logits[0, L - 1:].argmax(-1)
    assert torch.equal(re_ids, greedy), (re_ids, greedy)

    tensors = {"input_ids": ids.to(torch.int64).contiguous(),
               "position_ids": torch.arange(L, dtype=torch.int64)[None].contiguous(),
               "logits": logits.contiguous(), "greedy_ids": greedy.to(torch.int64).contiguous()}
    meta_images = []
    if images:
        sizes = inputs["image_sizes"]
        with torch.no_grad():
            feats = model.model.get_image_features(inputs["pixel_values"], sizes)
        tensors["pixel_values"] = inputs["pixel_values"].to(torch.float32).contiguous()
        tensors["image_sizes"] = sizes.to(torch.int64).contiguous()
        tensors["image_features"] = torch.cat(list(feats), 0).float().contiguous()
        counts = [int((ids[0] == IMAGE_ID).sum())]
        assert sum(f.shape[0] for f in feats) == counts[0], ([f.shape for f in feats], counts)
        from transformers.image_processing_utils import select_best_resolution
        for img, f in zip(images, feats):
            hw = [img.height, img.width]
            meta_images.append({"size_hw": hw, "best_resolution": list(select_best_resolution(hw, PINPOINTS)),
                                "tokens": f.shape[0]})
    GOLD.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(GOLD / f"{case}.safetensors"), metadata={"format": "pt"})
    meta = {"messages": messages, "media_dir": "tests/fixtures/media", "prompt_text": prompt, "images": meta_images,
            "num_new_tokens": mtc_new_tokens(), "greedy_ids": greedy.tolist(), "margins": margins,
            "min_margin": min(margins), "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "transformers": transformers.__version__, "torch": torch.__version__,
            "greedy_note": "pure argmax over all vocab rows for every step; EOS does not stop generation"}
    (GOLD / f"{case}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  {NAME}/{case}: L={L} min_margin={min(margins):.4g} images={meta_images} greedy[:8]={greedy.tolist()[:8]}")
    return min(margins)


def mtc_new_tokens() -> int:
    return 32


def make_goldens(load_image, min_margin: float):
    import torch
    import transformers

    proc = load_processor()
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        str(OUT), dtype=torch.float32, attn_implementation="eager").eval()
    worst = {case: run_case(case, proc, model, load_image) for case in CASES}
    bad = {k: v for k, v in worst.items() if v < min_margin}
    if bad:
        raise SystemExit(f"margin below {min_margin}: {bad}")
