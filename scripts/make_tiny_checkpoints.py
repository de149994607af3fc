#!/usr/bin/env python3
"""Generate TINY random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 checkpoints in the exact Hugging
Face hub layout.

Output (deterministic, fixed seeds):
    tests/fixtures/tiny-qwen2-vl/
    tests/fixtures/tiny-qwen2_5-vl/
    tests/fixtures/tiny-qwen3-vl/
    tests/fixtures/tiny-qwen3-vl-moe/
    tests/fixtures/tiny-qwen3_5/          (transformers 5 only: /root/golden-venv-5)

Each directory holds config.json, two safetensors shards + model.safetensors.index.json, tokenizer.json (a
byte-level BPE of our own, trained here with the Qwen2 pipeline), vocab.json, merges.txt, tokenizer_config.json,
chat_template.json (Qwen3.5: chat_template.jinja), preprocessor_config.json, video_preprocessor_config.json,
generation_config.json.

- Qwen2-VL / Qwen2.5-VL: config.json with the text fields at top level + `vision_config`; tensors under the
  hub names model.embed_tokens.weight, model.layers.N..., model.norm.weight, visual..., lm_head.weight.
- Qwen3-VL / Qwen3-VL-MoE: nested `text_config` + `vision_config` (see qwen3_vl_hub.py); tensors exactly as
  transformers 4.57 `save_pretrained` writes them (= the released hub checkpoints): model.language_model...,
  model.visual..., lm_head.weight (absent when tied); MoE experts as fused
  mlp.experts.gate_up_proj [E, hidden, 2*moe_inter] / mlp.experts.down_proj [E, moe_inter, hidden] and the
  router as mlp.gate.weight. The tokenizer adds Qwen3's 12 extra added tokens after the Qwen2-VL specials.
- Qwen3.5: hybrid decoder (3 Gated DeltaNet layers + 1 gated-attention layer, twice), Qwen3-VL tower without DeepStack
  (see qwen3_5_hub.py); tensors as transformers 5 `save_pretrained` writes Qwen3_5ForConditionalGeneration, plus the
  15 `mtp.*` multi-token-prediction tensors the released checkpoints carry (transformers ignores them on load). The
  tokenizer uses the Qwen3.5 pre-tokenizer regex and 33 added tokens; zero-centred RMSNorm weights are drawn around 0.

Weights are float32 and deliberately larger than the default init so that greedy decoding has clear
top-1/top-2 margins (checked by make_goldens.py).

Usage:  /root/golden-venv/bin/python scripts/make_tiny_checkpoints.py [family ...]
        /root/golden-venv-5/bin/python scripts/make_tiny_checkpoints.py qwen3_5
(default: every family of the running transformers major version: the four 4.57 families, or qwen3_5 under 5.x)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qwen3_5_hub as q35  # noqa: E402
import qwen3_vl_hub as q3  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"

# ----------------------------------------------------------------------------------------------
# Chat templates (verbatim from the hub repos' chat_template.json; Qwen2.5-VL-*-Instruct ships the
# same VL template as Qwen2-VL-*-Instruct for its processor).
# ----------------------------------------------------------------------------------------------
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_5_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE

# The Qwen2 pre-tokenizer split regex.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Added tokens in id order, as (content, special flag). Qwen2-VL: the 14 specials; Qwen3-VL: the same 14 followed by
# Qwen3's 12 extra added tokens (qwen3_vl_hub.QWEN3_EXTRA_TOKENS).
QWEN2_ADDED_TOKENS = [(t, True) for t in SPECIAL_TOKENS]
QWEN3_ADDED_TOKENS = QWEN2_ADDED_TOKENS + q3.QWEN3_EXTRA_TOKENS
QWEN3_5_ADDED_TOKENS = QWEN2_ADDED_TOKENS + q35.QWEN3_5_EXTRA_TOKENS  # Qwen3's 26, then 7 audio/TTS specials

BPE_VOCAB = 448  # 256 byte symbols + 192 merges; added tokens follow at 448.. (461 Qwen2-VL, 473 Qwen3-VL, 480 Qwen3.5)
MODEL_VOCAB = 512  # embedding rows (padded beyond the tokenizer, like real Qwen)
assert BPE_VOCAB + len(QWEN3_5_ADDED_TOKENS) <= MODEL_VOCAB

CORPUS = [
    "Hello! How are you doing today?",
    "I'm fine, thank you. And you?",
    "What is in this picture?",
    "The picture shows a red circle on a blue background.",
    "Can you describe the video in a few words?",
    "A small square moves from the left to the right.",
    "You are a helpful assistant.",
    "Please tell me what you see in the image.",
    "There are two images: the first one has stripes, the second one has a gradient.",
    "It's a sunny day, and the children are playing in the park.",
    "Don't worry, we'll figure it out together.",
    "They've been waiting for the train since 9 o'clock.",
    "How many apples are on the table? I count 3 red ones and 12 green ones.",
    "The meeting starts at 10:30 and ends at 11:45.",
    "Could you summarize the story in one sentence?",
    "Once upon a time, a curious cat explored the old library.",
    "What colour is the sky at sunset?",
    "Usually it turns orange, pink and purple.",
    "Write a short poem about the sea.",
    "Waves roll in, waves roll out; the gulls all sing and shout.",
    "Why did you say that?",
    "Because I thought it would help you decide.",
    "Is this a cat or a dog?",
    "It looks like a dog with long brown ears.",
    "Thanks a lot! That's really useful.",
    "You're welcome. Let me know if you need anything else.",
    "Where is the nearest station?\nTurn left, then walk for 200 meters.",
    "The quick brown fox jumps over the lazy dog.",
    "She said: \"I'll be there in 5 minutes.\"",
    "Numbers like 2024, 3.14 and 100% appear in text too.",
    "Describe the scene: a house, a tree, and a river.",
    "Count the objects in the image, please.",
    "I see four circles, two squares and one triangle.",
    "What happens next in the video?",
    "The ball bounces twice and then rolls away.",
    "Can you read the text on the sign?",
    "The sign says: Welcome to the city of light!",
    "Translate 'good morning' into French.",
    "Bonjour! That means good morning.",
    "Let's play a game. I'm thinking of an animal.",
    "Is it big or small? Does it live in the water?",
    "It's small, it has wings, and it sings in the morning.",
    "Okay... is it a bird?",
    "Yes! Well done.",
    "    indented line\twith a tab\n\nand blank lines\n",
]


def tokenizer_json_and_vocab(added_tokens=QWEN2_ADDED_TOKENS, split_regex=QWEN2_SPLIT_REGEX):
    """Train the byte-level BPE (pre-tokenized with `split_regex`), append `added_tokens` and return
    (tokenizer_json_str, vocab dict, merges list)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Repeat the corpus a few times (stable counts, does not change the merge order).
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    n = tok.get_vocab_size()
    assert n == BPE_VOCAB, f"BPE vocab is {n}, expected {BPE_VOCAB} (enlarge the corpus)"
    for i, (t, special) in enumerate(added_tokens):
        add = tok.add_special_tokens if special else tok.add_tokens
        add([AddedToken(t, special=special, normalized=False)])
        assert tok.token_to_id(t) == BPE_VOCAB + i, t

    data = json.loads(tok.to_str())
    # Match the real Qwen2 tokenizer.json model section.
    data["model"]["dropout"] = None
    data["model"]["unk_token"] = None
    data["model"]["continuing_subword_prefix"] = ""
    data["model"]["end_of_word_suffix"] = ""
    data["model"]["fuse_unk"] = False
    data["model"]["byte_fallback"] = False
    data["model"]["ignore_merges"] = False
    vocab = data["model"]["vocab"]
    merges = data["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return json.dumps(data, ensure_ascii=False, indent=2), vocab, merges


def added_token_ids(added_tokens) -> dict:
    return {t: BPE_VOCAB + i for i, (t, _) in enumerate(added_tokens)}


def special_ids():
    """Ids of the 14 Qwen2-VL specials (the same in every family: Qwen3's extra tokens come after them)."""
    return added_token_ids(QWEN2_ADDED_TOKENS)


def added_tokens_decoder(added_tokens) -> dict:
    return {
        str(BPE_VOCAB + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (t, special) in enumerate(added_tokens)
    }


def tokenizer_config(chat_template: str, added_tokens=QWEN2_ADDED_TOKENS, model_max_length: int = 32768) -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(added_tokens),
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    name: str  # model_type
    out_dir: str  # under tests/fixtures
    model_class: str  # transformers class names
    config_class: str
    processor_class: str
    seed_env: str  # weight-init seed, overridable through this environment variable
    seed_default: int
    # hub-data module (nested hub config + transformers-native tensor names + its tokenizer/template):
    # qwen3_vl_hub (Qwen3-VL, Qwen3-VL-MoE) or qwen3_5_hub (Qwen3.5); None for Qwen2(.5)-VL, whose data is in this file
    hub: object = None

    @property
    def path(self) -> Path:
        return FIX / self.out_dir

    @property
    def seed(self) -> int:
        return int(os.environ.get(self.seed_env, self.seed_default))

    @property
    def qwen3(self) -> bool:
        return self.hub is not None

    @property
    def qwen3_5(self) -> bool:
        return self.hub is q35

    @property
    def transformers_major(self) -> int:
        """The transformers major version that builds this family (4.57.1 or 5.23.0; see scripts/README.md)."""
        return getattr(self.hub, "TRANSFORMERS_MAJOR", 4)

    @property
    def added_tokens(self):
        return QWEN3_5_ADDED_TOKENS if self.qwen3_5 else QWEN3_ADDED_TOKENS if self.qwen3 else QWEN2_ADDED_TOKENS

    @property
    def split_regex(self) -> str:
        return q35.QWEN3_5_SPLIT_REGEX if self.qwen3_5 else QWEN2_SPLIT_REGEX

    @property
    def chat_template(self) -> str:
        if self.qwen3_5:
            return q35.QWEN3_5_CHAT_TEMPLATE
        if self.qwen3:
            return q3.QWEN3_VL_CHAT_TEMPLATE
        return QWEN2_VL_CHAT_TEMPLATE if self.name == "qwen2_vl" else QWEN2_5_VL_CHAT_TEMPLATE

    @property
    def chat_template_file(self) -> str:
        return getattr(self.hub, "CHAT_TEMPLATE_FILE", "chat_template.json")

    def transformers_class(self, kind: str):
        import transformers

        return getattr(transformers, {"model": self.model_class, "config": self.config_class,
                                      "processor": self.processor_class}[kind])


FAMILIES = {
    f.name: f
    for f in (
        Family("qwen2_vl", "tiny-qwen2-vl", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
               "Qwen2VLProcessor", "TINY_SEED_QWEN2_VL", 1234),
        Family("qwen2_5_vl", "tiny-qwen2_5-vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
               "Qwen2_5_VLProcessor", "TINY_SEED_QWEN2_5_VL", 3),
        Family("qwen3_vl", "tiny-qwen3-vl", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
               "Qwen3VLProcessor", "TINY_SEED_QWEN3_VL", 22, q3),
        Family("qwen3_vl_moe", "tiny-qwen3-vl-moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig",
               "Qwen3VLProcessor", "TINY_SEED_QWEN3_VL_MOE", 34, q3),
        Family("qwen3_5", "tiny-qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config",
               "Qwen3VLProcessor", "TINY_SEED_QWEN3_5", 14, q35),
    )
}


def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def requested_families(args) -> list:
    """The families named in `args` (default: all those the running transformers builds); refuses the others."""
    major = transformers_major()
    fams = ([a for a in args if not a.startswith("--")]
            or [n for n, f in FAMILIES.items() if f.transformers_major == major])
    unknown = set(fams) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; known: {list(FAMILIES)}")
    wrong = [f for f in fams if FAMILIES[f].transformers_major != major]
    if wrong:
        raise SystemExit(f"{wrong} need transformers {FAMILIES[wrong[0]].transformers_major}.x, this is {major}.x "
                         "(qwen3_5: /root/golden-venv-5, the others: /root/golden-venv; see scripts/README.md)")
    return fams


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------
def text_fields(family: str) -> dict:
    ids = special_ids()
    return {
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "max_window_layers": 2,
        "model_type": family,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 2048,
        "tie_word_embeddings": family == "qwen2_vl",
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": MODEL_VOCAB,
    }


def config_json(family: str, transformers_version: str) -> dict:
    if FAMILIES[family].qwen3:
        return FAMILIES[family].hub.config_json(family, special_ids(), MODEL_VOCAB, transformers_version)
    cfg = {}
    if family == "qwen2_vl":
        cfg["architectures"] = ["Qwen2VLForConditionalGeneration"]
        vision = {
            "depth": 2,
            "embed_dim": 32,
            "mlp_ratio": 2,
            "num_heads": 4,
            "in_chans": 3,
            "hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        }
    else:
        cfg["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
        vision = {
            "depth": 4,
            "hidden_act": "silu",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "in_chans": 3,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        }
    cfg.update(text_fields(family))
    cfg["transformers_version"] = transformers_version
    cfg["vision_config"] = vision
    # hub files list keys roughly alphabetically with vision_config/rope_scaling/vocab_size last
    order = sorted(k for k in cfg if k not in ("vision_config", "rope_scaling", "vocab_size"))
    return {**{k: cfg[k] for k in order}, "vision_config": cfg["vision_config"],
            "rope_scaling": cfg["rope_scaling"], "vocab_size": cfg["vocab_size"]}


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS = 56 * 56  # 3136
MAX_PIXELS = 28 * 28 * 64  # 50176


def preprocessor_config(family: str) -> dict:
    if FAMILIES[family].qwen3:
        return FAMILIES[family].hub.preprocessor_config()
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": CLIP_STD,
        "max_pixels": MAX_PIXELS,
        "merge_size": 2,
        "min_pixels": MIN_PIXELS,
        "patch_size": 14,
        "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": 2,
    }


def video_preprocessor_config(family: str) -> dict:
    if FAMILIES[family].qwen3:
        return FAMILIES[family].hub.video_preprocessor_config()
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": False,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "max_pixels": MAX_PIXELS,
        "merge_size": 2,
        "min_pixels": MIN_PIXELS,
        "patch_size": 14,
        "processor_class": "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
        "temporal_patch_size": 2,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }


# Class names of the PIL ("slow") and torchvision ("fast") Qwen2-VL image processors, by transformers major version.
SLOW_IMAGE_PROCESSOR = {4: "Qwen2VLImageProcessor", 5: "Qwen2VLImageProcessorPil"}
FAST_IMAGE_PROCESSOR = {4: "Qwen2VLImageProcessorFast", 5: "Qwen2VLImageProcessor"}


def slow_image_processor(path: Path):
    """The slow (PIL) Qwen2-VL image processor with the parameters of `path`/preprocessor_config.json.

    transformers 4.57.1's slow Qwen2VLImageProcessor.__init__ replaces a valid `size` by its defaults
    (3136..1003520 pixels) and only honours `min_pixels`/`max_pixels`. The Qwen2(.5)-VL configs carry both; the
    Qwen3-VL hub configs only `size` (which the fast processor does honour), so AutoProcessor(use_fast=False)
    would silently preprocess with the wrong budget. Pass the budget explicitly.
    transformers 5 names the PIL processor Qwen2VLImageProcessorPil (backend="pil") and honours `size`.
    """
    import transformers

    cfg = json.loads((path / "preprocessor_config.json").read_text())
    if transformers_major() >= 5:
        ip = transformers.AutoImageProcessor.from_pretrained(str(path), backend="pil")
        assert type(ip).__name__ == SLOW_IMAGE_PROCESSOR[5], type(ip)
        assert {k: ip.size[k] for k in cfg["size"]} == cfg["size"], (ip.size, cfg["size"])
        return ip
    kw = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
    kw.setdefault("min_pixels", cfg["size"]["shortest_edge"])
    kw.setdefault("max_pixels", cfg["size"]["longest_edge"])
    ip = transformers.Qwen2VLImageProcessor(**kw)
    assert ip.size == cfg["size"], (ip.size, cfg["size"])
    return ip


def generation_config(family: str, transformers_version: str) -> dict:
    ids = special_ids()
    if FAMILIES[family].qwen3:
        return FAMILIES[family].hub.generation_config(ids, transformers_version)
    g = {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "repetition_penalty": 1.0 if family == "qwen2_vl" else 1.05,
        "temperature": 0.01 if family == "qwen2_vl" else 1e-06,
        "top_p": 0.001,
        "top_k": 1,
        "transformers_version": transformers_version,
    }
    return g


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------
WEIGHT_STD = float(os.environ.get("TINY_WEIGHT_STD", 0.3))
PATCH_EMBED_STD = 0.05
BIAS_STD = 0.05
NORM_STD = 0.1
# Gated DeltaNet decay: the state is multiplied by exp(-exp(A_log) * softplus(a + dt_bias)) per token. With the default
# random A_log (A ~ 1) the tiny model forgets within ~3 tokens; A = exp(-2 +- 0.5) keeps tens of tokens of context.
A_LOG_MEAN = -2.0
A_LOG_STD = 0.5


def to_hub_name(name: str) -> str:
    """transformers>=4.52 module names -> hub checkpoint names."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return "visual." + name[len("model.visual."):]
    return name


# Qwen3.5's RMSNorm scales by (1 + weight) (checkpoints store weights around 0); its gated GDN norm and the vision
# LayerNorms scale by the weight itself.
ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm",)


def init_by_rule(model, seed: int, rule):
    """Every parameter drawn from one seeded generator, in name order: `rule(name, leaf)` (leaf: the name without
    its last part) gives the parameter's (mean, std); a mean of 0 is not added, so the draws stay as they were."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            mean, std = rule(name, name.rsplit(".", 1)[0])
            x = torch.randn(p.shape, generator=g) * std
            p.copy_(mean + x if mean else x)


def init_weights(model, seed: int):
    import torch

    zero_centred = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
                    if type(mod).__name__ in ZERO_CENTRED_NORMS}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[0]
            is_norm = any(s in leaf for s in ("norm", "ln_q"))
            if name.endswith(".bias"):
                std = BIAS_STD
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name in zero_centred:
                p.copy_(torch.randn(p.shape, generator=g) * NORM_STD)
            elif name.endswith(".A_log"):
                p.copy_(A_LOG_MEAN + torch.randn(p.shape, generator=g) * A_LOG_STD)
            elif is_norm:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * NORM_STD)
            elif "patch_embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * PATCH_EMBED_STD)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)


def build_model(family: str, cfg: dict):
    import torch

    fam = FAMILIES[family]
    config = fam.transformers_class("config")(**cfg)
    torch.manual_seed(0)
    model = fam.transformers_class("model")(config).to(torch.float32).eval()
    init_weights(model, fam.seed)
    if cfg["tie_word_embeddings"]:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return model


def mtp_module(model, seed: int):
    """The multi-token-prediction block the released Qwen3.5 checkpoints carry next to the model (15 tensors for one
    MTP layer): mtp.fc [hidden, 2*hidden] over cat(pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(hidden state)),
    one full-attention decoder layer mtp.layers.0.* (gated q_proj, q/k norms, dense MLP) and the final mtp.norm, all
    norms zero-centred. transformers has no module for it and drops `^mtp.*` on load
    (_keys_to_ignore_on_load_unexpected); built here from transformers' own layer classes so names and shapes
    follow the decoder's, random like the rest."""
    import importlib

    from torch import nn

    modeling = importlib.import_module(type(model).__module__)
    tc = model.config.text_config
    assert tc.mtp_num_hidden_layers == 1, tc.mtp_num_hidden_layers
    h, eps = tc.hidden_size, tc.rms_norm_eps
    mtp = nn.Module()
    mtp.fc = nn.Linear(2 * h, h, bias=False)
    mtp.layers = nn.ModuleList([modeling.Qwen3_5DecoderLayer(tc, tc.layer_types.index("full_attention"))])
    mtp.norm = modeling.Qwen3_5RMSNorm(h, eps=eps)
    mtp.pre_fc_norm_embedding = modeling.Qwen3_5RMSNorm(h, eps=eps)
    mtp.pre_fc_norm_hidden = modeling.Qwen3_5RMSNorm(h, eps=eps)
    init_weights(mtp, seed)
    return mtp


def hub_state_dict(model, family: str, tied: bool) -> dict:
    # Qwen2(.5)-VL hub checkpoints predate transformers' model.language_model / model.visual nesting;
    # Qwen3-VL ones were released with it, so their names are the module names as they are.
    rename = (lambda k: k) if FAMILIES[family].qwen3 else to_hub_name
    sd = {}
    for k, v in model.state_dict().items():
        hk = rename(k)
        if tied and hk == "lm_head.weight":
            continue  # tied checkpoints (e.g. Qwen2-VL-2B, Qwen3-VL-2B/4B) do not store lm_head
        sd[hk] = v.detach().to("cpu").contiguous().clone()
    if FAMILIES[family].qwen3_5:
        for k, v in mtp_module(model, FAMILIES[family].seed + 1).state_dict().items():
            sd["mtp." + k] = v.detach().contiguous().clone()
    return sd


def write_shards(out: Path, sd: dict, shard_name: str = "model-{:05d}-of-{:05d}.safetensors"):
    from safetensors.torch import save_file

    names = sorted(sd)
    total = sum(sd[n].numel() * sd[n].element_size() for n in names)
    shard1, acc = [], 0
    for n in names:
        if acc >= total / 2:
            break
        shard1.append(n)
        acc += sd[n].numel() * sd[n].element_size()
    shard2 = [n for n in names if n not in set(shard1)]
    files = [shard_name.format(1, 2), shard_name.format(2, 2)]
    weight_map = {}
    for fname, part in zip(files, (shard1, shard2)):
        save_file({n: sd[n] for n in part}, str(out / fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_json(path: Path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make(family: str):
    import transformers

    fam = FAMILIES[family]
    tv = transformers.__version__
    out = fam.path
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()

    tok_json, vocab, merges = tokenizer_json_and_vocab(fam.added_tokens, fam.split_regex)
    (out / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")
    write_json(out / "vocab.json", vocab)
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    if fam.qwen3_5:
        tok_cfg = q35.tokenizer_config(added_tokens_decoder(fam.added_tokens))
    elif fam.qwen3:
        tok_cfg = tokenizer_config(fam.chat_template, fam.added_tokens, q3.MODEL_MAX_LENGTH)
    else:
        tok_cfg = tokenizer_config(fam.chat_template)
    write_json(out / "tokenizer_config.json", tok_cfg)
    if fam.chat_template_file.endswith(".jinja"):
        (out / fam.chat_template_file).write_text(fam.chat_template, encoding="utf-8")  # verbatim, as the hub file
    else:
        write_json(out / fam.chat_template_file, {"chat_template": fam.chat_template})
    write_json(out / "preprocessor_config.json", preprocessor_config(family))
    write_json(out / "video_preprocessor_config.json", video_preprocessor_config(family))
    write_json(out / "generation_config.json", generation_config(family, tv))

    cfg = config_json(family, tv)
    write_json(out / "config.json", cfg)

    model = build_model(family, cfg)
    sd = hub_state_dict(model, family, cfg["tie_word_embeddings"])
    write_shards(out, sd, *([fam.hub.SHARD_NAME] if hasattr(fam.hub, "SHARD_NAME") else []))
    print(f"{family}: {len(sd)} tensors, {sum(v.numel() for v in sd.values())} params -> {out}")
    verify(out, family, model, cfg, sd)


def verify(out: Path, family: str, ref_model, cfg: dict, sd: dict):
    """Reload with transformers from the hub-layout files and check exact weight equality."""
    import tempfile

    import torch
    import transformers

    fam = FAMILIES[family]
    m = fam.transformers_class("model").from_pretrained(str(out), dtype=torch.float32).eval()
    c = m.config
    want_text = cfg["text_config"] if fam.qwen3 else cfg
    assert c.text_config.hidden_size == 64, c
    assert c.text_config.num_hidden_layers == want_text["num_hidden_layers"], c
    assert c.text_config.vocab_size == MODEL_VOCAB
    if cfg["tie_word_embeddings"]:
        assert m.lm_head.weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
    ref = ref_model.state_dict()
    got = m.state_dict()
    assert set(ref) == set(got), set(ref) ^ set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    if fam.qwen3:
        # our shards carry exactly the tensor names (and shapes) transformers itself writes
        with tempfile.TemporaryDirectory() as td:
            ref_model.save_pretrained(td, safe_serialization=True)
            from safetensors import safe_open

            saved = {}
            for f in Path(td).glob("*.safetensors"):
                with safe_open(str(f), "pt") as h:
                    saved.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        # (+ Qwen3.5's mtp.* block, which transformers has no module for and skips on load)
        own = {k: tuple(v.shape) for k, v in sd.items() if not k.startswith("mtp.")}
        assert saved == own, set(saved) ^ set(own)
        mtp = sorted(k for k in sd if k.startswith("mtp."))
        assert len(mtp) == (15 if fam.qwen3_5 else 0), mtp
    major = fam.transformers_major
    if major >= 5:  # transformers 5 has one (tokenizers-backed) tokenizer; the PIL image processor is backend="pil"
        proc = transformers.AutoProcessor.from_pretrained(str(out))
        check_tokenizer_json(out, proc.tokenizer, fam)
    else:
        proc = transformers.AutoProcessor.from_pretrained(str(out), use_fast=False)
    assert type(proc).__name__ == fam.processor_class, type(proc)
    ids = proc.tokenizer("Hello! <|im_start|>user\nHi<|im_end|>")["input_ids"]
    assert special_ids()["<|im_start|>"] in ids and special_ids()["<|im_end|>"] in ids, ids
    all_ids = added_token_ids(fam.added_tokens)
    for t, _special in fam.added_tokens:
        assert proc.tokenizer.convert_tokens_to_ids(t) == all_ids[t], t
        assert proc.tokenizer(t, add_special_tokens=False)["input_ids"] == [all_ids[t]], t
    pc, vc = preprocessor_config(family), video_preprocessor_config(family)
    auto_ip = (FAST_IMAGE_PROCESSOR if major >= 5 else SLOW_IMAGE_PROCESSOR)[major]  # 4.57: use_fast=False above
    assert type(proc.image_processor).__name__ == auto_ip, type(proc.image_processor)
    ip = slow_image_processor(out)
    for k in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        assert _plain(getattr(ip, k)) == pc[k] == _plain(getattr(proc.image_processor, k)), k
    fast = (transformers.AutoImageProcessor.from_pretrained(str(out), backend="torchvision") if major >= 5
            else transformers.AutoImageProcessor.from_pretrained(str(out), use_fast=True))
    assert type(fast).__name__ == FAST_IMAGE_PROCESSOR[major], type(fast)
    assert {k: fast.size[k] for k in pc["size"]} == pc["size"], fast.size
    vp = proc.video_processor
    assert {k: vp.size[k] for k in vc["size"]} == vc["size"], vp.size
    print(f"{family}: reload OK ({type(proc).__name__}, {type(proc.tokenizer).__name__}, "
          f"{type(ip).__name__}, {type(vp).__name__})")


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


# Strings the tokenizer checks encode: the BPE corpus, typographic / combining-mark / CJK / emoji text, whitespace
# runs, and added-token strings glued to text.
TOKENIZER_PROBES = CORPUS + [
    "I don’t know… it’s “fine” 😀👍🏽 — café, naïve, 東京, e\u0301 (decomposed)!",
    "क्ष हिन्दी a\u0327\u0301 Z\u0351 \u0301leading ٱلْعَرَبِيَّة",
    "  leading spaces\n\n\ttab 12345 3.14159 and trailing   ",
    "x<|im_start|>user\nHi<|im_end|><think>\n\n</think>\n\n<|vision_start|><|image_pad|><|vision_end|><tts_pad>y",
]


def check_tokenizer_json(out: Path, tok, fam):
    """transformers 5 rebuilds the Qwen3.5 tokenizer (Qwen3_5Tokenizer) from tokenizer.json's vocab/merges with its
    own normalizer / pre-tokenizer / decoder: check that it matches tokenizer.json as the `tokenizers` library (and so
    the Rust engine) reads it, and that the file carries the family's split regex (combining marks stay in words)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TOKENIZER_PROBES:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == raw.decode(ids, skip_special_tokens=False), text
    assert raw.pre_tokenizer.pre_tokenize_str("क्ष") == [("à¤ķà¥įà¤·", (0, 3))], "not the Qwen3.5 split regex"
    assert json.loads(raw.to_str())["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == fam.split_regex


def main():
    if sys.argv[1:] == ["gemma3"]:  # Gemma 3: its own module (scripts/tiny_gemma3.py)
        return __import__("tiny_gemma3").make_checkpoint()
    if sys.argv[1:] == ["llava_next"]:  # LLaVA-NeXT lives in its own file
        return __import__("tiny_llava_next").make_checkpoint()
    if sys.argv[1:] == ["qwen2_5_omni"]:  # Qwen2.5-Omni's thinker: scripts/tiny_qwen2_5_omni.py
        return __import__("tiny_qwen2_5_omni").make_checkpoint()
    for f in requested_families(sys.argv[1:]):
        make(f)


if __name__ == "__main__":
    main()
