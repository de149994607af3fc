"""Gemma 3 (model_type `gemma3`): the tiny checkpoint and its goldens, kept apart from the Qwen families' scripts.

make_tiny_checkpoints.py and make_goldens.py hand the `gemma3` family to `make_checkpoint()` / `make_goldens()` here.

Checkpoint (tests/fixtures/tiny-gemma3/), in the layout the released google/gemma-3-*-it repos use:
- tensors under the released names: language_model.model.*, vision_tower.vision_model.*, multi_modal_projector.*
  (transformers 4.57 maps them to model.language_model.* etc. on load); the head is tied, so lm_head is not stored;
- a SigLIP tower (image 48 px, patch 8: 6x6 patches), pooled 2x2 to mm_tokens_per_image = 9 tokens per image;
- a 6-layer text decoder, sliding_window 8 with sliding_window_pattern 3 (layers S S F S S F), linear rope scaling on
  the global layers (as the 4B/12B/27B configs), query_pre_attn_scalar != head_dim;
- a tiny SentencePiece-style BPE (byte fallback, spaces as U+2581, no pre-tokenizer) whose specials follow the real
  vocabulary's order: <pad> <eos> <bos> <unk> <mask> [multimodal] first, <start_of_turn> <end_of_turn> after them,
  <start_of_image> <end_of_image> at the end of the base vocabulary and <image_soft_token> after it;
- the Gemma 3 chat template (verbatim from the -it repos), preprocessor_config.json (Gemma3ImageProcessor, bilinear,
  mean = std = 0.5) and processor_config.json (image_seq_length).

Goldens (tests/fixtures/goldens/gemma3/): text, image, two_images, long (prompt far longer than the window, an image in
the middle), each the prompt ids, positions, f32 logits of the no-cache forward (eager attention), 32 greedy ids and the
processor's pixel values; plus files_to_tokens.{json,safetensors}: the processor's ids and pixels for a system prompt,
trimmed whitespace, two turns and images of other sizes (no Rust test reads them yet).
"""
from __future__ import annotations

import copy
import os
import json
from pathlib import Path

import make_goldens as mg

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "tiny-gemma3"
GOLD = REPO / "tests" / "fixtures" / "goldens" / "gemma3"
MEDIA = REPO / "tests" / "fixtures" / "media"
SEED = int(os.environ.get("TINY_SEED_GEMMA3", 8))
NEW_TOKENS = 32
MIN_MARGIN = 1e-3

# Verbatim google/gemma-3-*-it chat template.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

LEADING = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
BASE_VOCAB = 520  # leading specials, byte tokens, BPE pieces, then <start_of_image> <end_of_image>
IMAGE_TOKEN = BASE_VOCAB  # <image_soft_token>, after the base vocabulary like the real 262144
MODEL_VOCAB = 528  # embedding rows (padded beyond the tokenizer, as the real 262208)
BOI, EOI = BASE_VOCAB - 2, BASE_VOCAB - 1
MM_TOKENS = 9
WINDOW = 8


def ids():
    d = {t: i for i, t in enumerate(LEADING)}
    d.update({"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE_TOKEN})
    return d


def tokenizer_json() -> str:
    """A SentencePiece-like BPE in tokenizers' format: ' ' -> U+2581, byte fallback, no pre-tokenizer at encode time
    (merges are learnt on whitespace/newline-split pieces so none joins a newline to a word)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, \
        trainers

    import make_tiny_checkpoints as mtc

    n_pieces = BASE_VOCAB - 2 - len(LEADING) - len(BYTES)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\u2581?[^\u2581\n]+|\n+|\u2581+"), behavior="isolated")
    alphabet = sorted({c for s in mtc.CORPUS for c in s.replace(" ", "\u2581")})
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, min_frequency=1, show_progress=False, special_tokens=[],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tok.train_from_iterator(mtc.CORPUS * 3, trainer=trainer)
    data = json.loads(tok.to_str())
    learnt = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert len(learnt) <= n_pieces, len(learnt)
    vocab = {t: i for i, t in enumerate(LEADING + BYTES)}
    for t, _ in learnt:
        vocab.setdefault(t, len(vocab))
    while len(vocab) < BASE_VOCAB - 2:
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    vocab["<start_of_image>"], vocab["<end_of_image>"] = BOI, EOI
    vocab["<image_soft_token>"] = IMAGE_TOKEN
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    out = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    out.normalizer = normalizers.Replace(" ", "\u2581")
    out.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    out.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    special = {"<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
               "<end_of_image>", "<image_soft_token>"}
    added = sorted(special | {"[multimodal]"}, key=lambda t: vocab[t])
    out.add_special_tokens([AddedToken(t, special=t in special, normalized=False) for t in added])
    for t in added:
        assert out.token_to_id(t) == vocab[t], t
    return out.to_str(pretty=True)


def tokenizer_config() -> dict:
    v = ids()
    dec = {str(v[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                       "special": t != "[multimodal]"} for t in sorted(v, key=v.get)}
    return {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": dec,
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eoi_token": "<end_of_image>", "eos_token": "<eos>",
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "image_token": "<image_soft_token>", "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>", "padding_side": "left", "processor_class": "Gemma3Processor",
        "sp_model_kwargs": None, "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>", "use_default_system_prompt": False,
    }


def config_json(tv: str) -> dict:
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": BOI, "eoi_token_index": EOI, "eos_token_id": [1, 7], "image_token_index": IMAGE_TOKEN,
        "initializer_range": 0.02, "mm_tokens_per_image": MM_TOKENS, "model_type": "gemma3",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 4096, "model_type": "gemma3_text",
            "num_attention_heads": 4, "num_hidden_layers": 6, "num_key_value_heads": 2, "query_pre_attn_scalar": 24,
            "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1000000.0, "sliding_window": WINDOW, "sliding_window_pattern": 3, "vocab_size": MODEL_VOCAB,
        },
        "torch_dtype": "float32", "transformers_version": tv,
        "vision_config": {
            "hidden_size": 32, "image_size": 48, "intermediate_size": 64, "model_type": "siglip_vision_model",
            "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 8, "vision_use_head": False,
        },
    }


def preprocessor_config() -> dict:
    return {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": MM_TOKENS,
        "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": 48, "width": 48},
    }


def to_hub_name(k: str) -> str:
    """transformers 4.57 module names -> the names in the released Gemma 3 checkpoints."""
    for new, old in (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if k.startswith(new):
            return old + k[len(new):]
    return k


def init_rule(name, leaf):
    """(mean, std) of each weight: larger than the default init (clear greedy margins); Gemma's RMSNorms scale by
    1 + w, so their weights are drawn around 0, SigLIP's LayerNorms around 1."""
    if name.endswith(".bias"):
        return 0.0, 0.05
    if "vision_tower" in name and "layer_norm" in leaf or "post_layernorm" in leaf:
        return 1.0, 0.1
    if "norm" in leaf:
        return 0.0, 0.1
    if "patch_embedding" in name or "position_embedding" in name:
        return 0.0, 0.05
    if "embed_tokens" in name:
        return 0.0, 0.1
    return 0.0, 0.25


def make_checkpoint():
    import torch
    import transformers

    import make_tiny_checkpoints as mtc

    OUT.mkdir(parents=True, exist_ok=True)
    for f in OUT.iterdir():
        f.unlink()
    tv = transformers.__version__
    (OUT / "tokenizer.json").write_text(tokenizer_json() + "\n", encoding="utf-8")
    mtc.write_json(OUT / "tokenizer_config.json", tokenizer_config())
    mtc.write_json(OUT / "special_tokens_map.json", {
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "eoi_token": "<end_of_image>", "eos_token": "<eos>",
        "image_token": "<image_soft_token>", "pad_token": "<pad>", "unk_token": "<unk>"})
    mtc.write_json(OUT / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    mtc.write_json(OUT / "preprocessor_config.json", preprocessor_config())
    mtc.write_json(OUT / "processor_config.json", {"image_seq_length": MM_TOKENS, "processor_class": "Gemma3Processor"})
    mtc.write_json(OUT / "generation_config.json", {"bos_token_id": 2, "cache_implementation": "hybrid",
                                                    "do_sample": True, "eos_token_id": [1, 7], "pad_token_id": 0,
                                                    "top_k": 64, "top_p": 0.95, "transformers_version": tv})
    cfg = config_json(tv)
    mtc.write_json(OUT / "config.json", cfg)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(**cfg)).to(torch.float32).eval()
    mtc.init_by_rule(model, SEED, init_rule)
    model.tie_weights()
    sd = {to_hub_name(k): v.detach().contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    mtc.write_shards(OUT, sd)
    print(f"gemma3: {len(sd)} tensors, {sum(v.numel() for v in sd.values())} params -> {OUT}")
    m = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(OUT), dtype=torch.float32).eval()
    ref, got = model.state_dict(), m.state_dict()
    assert set(ref) == set(got), set(ref) ^ set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert m.config.text_config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    proc = load_processor()
    auto = transformers.AutoProcessor.from_pretrained(str(OUT))
    assert type(auto).__name__ == "Gemma3Processor" and auto.image_seq_length == MM_TOKENS, type(auto)
    for t, i in ids().items():
        assert proc.tokenizer.convert_tokens_to_ids(t) == i, t
    print("gemma3: reload OK")


# ----------------------------------------------------------------------------------------------
# Goldens
# ----------------------------------------------------------------------------------------------
LONG_TEXT = ("Once upon a time, a curious cat explored the old library. The quick brown fox jumps over the lazy dog. "
             "Could you summarize the story in one sentence?")
CASES = {
    # The Qwen families' conversations (make_goldens.CASES), then a prompt far past the window.
    "text": mg.CASES["text"],
    "image": mg.CASES["image"],
    "two_images": [{"role": "user", "content": [{"type": "image", "image": "img_a.png"},
                                                {"type": "image", "image": "img_b.png"},
                                                {"type": "text", "text": "What is the difference between these two images?"}]}],
    "long": [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": [{"type": "text", "text": LONG_TEXT}, {"type": "image", "image": "img_b.png"},
                                     {"type": "text", "text": "Describe the scene: a house, a tree, and a river. " + LONG_TEXT}]},
    ],
}
# System prompt folded into the first turn, whitespace the template trims, two turns, images of other sizes. (Text
# spelling control tokens is left out: transformers' processor turns it into control tokens, and counts a literal
# <start_of_image> as an image; the Rust processor must keep such text plain, a check of its own, not against this.)
HOSTILE = [
    {"role": "system", "content": [{"type": "text", "text": "Be kind.\n"}]},
    {"role": "user", "content": [{"type": "text", "text": "  Hi there, look: "},
                                 {"type": "image", "image": "img_small.png"},
                                 {"type": "text", "text": " what is it?\n"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A checkerboard."}]},
    {"role": "user", "content": [{"type": "image", "image": "img_tall.png"}, {"type": "text", "text": "And this?"}]},
]


def load_image(name):
    from PIL import Image

    return Image.open(MEDIA / name).convert("RGB")


def with_images(messages):
    """The messages with each image name replaced by the decoded image (the processor loads them itself)."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m["content"]:
            if c["type"] == "image":
                c["image"] = load_image(c["image"])
    return out


def run_case(case, proc, model):
    import torch
    import transformers
    from safetensors.torch import save_file

    messages = CASES[case]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc.apply_chat_template(with_images(messages), tokenize=True, return_dict=True, add_generation_prompt=True,
                                      return_tensors="pt")
    L = inputs["input_ids"].shape[1]
    assert (inputs["input_ids"][0] == 2).sum() == 1, "one <bos>"
    assert L > 2 * WINDOW, L
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    greedy, margins = mg.greedy_with_margins(model, inputs, NEW_TOKENS, 0)
    assert not {BOI, EOI, IMAGE_TOKEN} & set(greedy.tolist()), greedy.tolist()
    assert int(logits[0, -1].argmax()) == int(greedy[0])
    tensors = {
        "input_ids": inputs["input_ids"].to(torch.int64).contiguous(),
        "position_ids": torch.arange(L, dtype=torch.int64)[None].contiguous(),
        "token_type_ids": inputs["token_type_ids"].to(torch.int64).contiguous(),
        "logits": logits.contiguous(),
        "greedy_ids": greedy.to(torch.int64).contiguous(),
    }
    if "pixel_values" in inputs:
        tensors["pixel_values"] = inputs["pixel_values"].to(torch.float32).contiguous()
    GOLD.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(GOLD / f"{case}.safetensors"), metadata={"format": "pt"})
    meta = {"messages": messages, "prompt_text": prompt, "num_new_tokens": NEW_TOKENS,
            "greedy_ids": greedy.tolist(), "margins": margins, "min_margin": min(margins),
            "sliding_window": WINDOW, "transformers": transformers.__version__, "torch": torch.__version__}
    (GOLD / f"{case}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  gemma3/{case}: L={L} min_margin={min(margins):.4g} greedy[:8]={greedy.tolist()[:8]}")
    return min(margins)


def bidirectional_effect(model, proc):
    """The image case's logits without the image tokens' bidirectional mask (token_type_ids dropped) must differ, so
    the Rust side's mask is really exercised."""
    import torch

    inputs = proc.apply_chat_template(with_images(CASES["image"]), tokenize=True, return_dict=True, add_generation_prompt=True,
                                      return_tensors="pt")
    with torch.no_grad():
        a = model(**inputs, use_cache=False).logits
        b = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}, use_cache=False).logits
    d = float((a - b).abs().max() / a.abs().max())
    assert d > 1e-3, d
    return d


def files_to_tokens(proc):
    """The processor's tokens for hostile messages (control-token spellings in text, whitespace the template trims):
    ids, pixel values and the rendered text, for the Rust processor to reproduce from the checkpoint's files."""
    import torch
    from safetensors.torch import save_file

    out = proc.apply_chat_template(with_images(HOSTILE), tokenize=True, return_dict=True, add_generation_prompt=True,
                                   return_tensors="pt")
    ids_ = out["input_ids"][0].tolist()
    assert ids_.count(2) == 1 and ids_.count(BOI) == 2 and ids_.count(IMAGE_TOKEN) == 2 * MM_TOKENS, ids_
    save_file({"input_ids": out["input_ids"].to(torch.int64).contiguous(),
               "pixel_values": out["pixel_values"].to(torch.float32).contiguous()},
              str(GOLD / "files_to_tokens.safetensors"), metadata={"format": "pt"})
    meta = {"messages": HOSTILE, "prompt_text": proc.apply_chat_template(HOSTILE, tokenize=False,
                                                                           add_generation_prompt=True)}
    (GOLD / "files_to_tokens.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Pan-and-scan as a preprocessor config asking for it would set it up (small crops for the 48-px tiny tower).
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}
PAN_AND_SCAN_CASE = [
    {"role": "user", "content": [{"type": "image", "image": "img_b.png"}, {"type": "text", "text": "And now?"},
                                 {"type": "image", "image": "img_tall.png"}, {"type": "image", "image": "img_small.png"},
                                 {"type": "text", "text": "What is in these pictures?"}]},
]


def pan_and_scan(proc, model):
    """Pan-and-scan crops: transformers 4.57's Gemma3Processor applies them only when called with the image kwargs
    (its own defaults override the image processor's config), so they are passed explicitly; the Rust side reads them
    from goldens/gemma3/pan_and_scan_preprocessor_config.json, the checkpoint's config with the four fields set.
    Saves ids, pixel values (original then crops, per image), num_crops, f32 logits and 32 greedy ids."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((OUT / "preprocessor_config.json").read_text())
    cfg.update(PAN_AND_SCAN)
    (GOLD / "pan_and_scan_preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    messages = PAN_AND_SCAN_CASE
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [load_image(c["image"]) for m in messages for c in m["content"] if c["type"] == "image"]
    # The template writes <bos>: tokenized without special tokens, as apply_chat_template does.
    inputs = proc(text=prompt, images=images, return_tensors="pt", add_special_tokens=False,
                  images_kwargs=dict(PAN_AND_SCAN))
    assert inputs["input_ids"][0].tolist().count(2) == 1, "one <bos>"
    crops = [int(n) for n in proc.image_processor(images=images, return_tensors="pt", **PAN_AND_SCAN)["num_crops"]]
    assert crops == [2, 4, 0], crops
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits.float()
    L = inputs["input_ids"].shape[1]
    greedy, margins = mg.greedy_with_margins(model, inputs, NEW_TOKENS, 0)
    save_file({"input_ids": inputs["input_ids"].to(torch.int64).contiguous(),
               "token_type_ids": inputs["token_type_ids"].to(torch.int64).contiguous(),
               "pixel_values": inputs["pixel_values"].to(torch.float32).contiguous(),
               "logits": logits.contiguous(), "greedy_ids": greedy.to(torch.int64).contiguous()},
              str(GOLD / "pan_and_scan.safetensors"), metadata={"format": "pt"})
    meta = {"messages": messages, "prompt_text": prompt, "num_crops": crops, "preprocessor": PAN_AND_SCAN,
            "greedy_ids": greedy.tolist(), "min_margin": min(margins)}
    (GOLD / "pan_and_scan.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"  gemma3/pan_and_scan: L={L} crops={crops} min_margin={min(margins):.4g}")
    return min(margins)


def load_processor():
    """The tokenizer from tokenizer.json (the file the Rust side reads) and the slow (PIL) image processor, the
    reference the Rust preprocessing matches; AutoProcessor(use_fast=False) would want sentencepiece's slow tokenizer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(OUT))
    assert tok.is_fast, type(tok)
    ip = transformers.Gemma3ImageProcessor.from_pretrained(str(OUT))
    proc = transformers.Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                                        image_seq_length=MM_TOKENS)
    assert type(proc.image_processor).__name__ == "Gemma3ImageProcessor", type(proc.image_processor)
    return proc


def make_goldens():
    import torch
    import transformers

    proc = load_processor()
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(OUT), dtype=torch.float32, attn_implementation="eager").eval()
    margins = {case: run_case(case, proc, model) for case in CASES}
    effect = bidirectional_effect(model, proc)
    files_to_tokens(proc)
    margins["pan_and_scan"] = pan_and_scan(proc, model)
    print(f"gemma3 min margins {margins}; bidirectional image mask moves the logits by {effect:.3g}")
    bad = {k: v for k, v in margins.items() if v < MIN_MARGIN}
    if bad:
        raise SystemExit(f"margin below {MIN_MARGIN}: {bad}")
