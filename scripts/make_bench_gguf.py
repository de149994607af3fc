#!/usr/bin/env python3
"""Random-weight F32 GGUF files of a Qwen2.5-VL config, for speed comparisons with llama.cpp.

    python scripts/make_bench_gguf.py --config models/dummy-qwen2.5-vl-3b-text-8l.json --out DIR

writes DIR/<stem>-f32.gguf (the text model, llama.cpp arch `qwen2vl`) and
DIR/mmproj-<stem>-f32.gguf (the `qwen2.5vl_merger` projector), where <stem> is the config's
file name without `dummy-` and `.json`. Other formats come from llama.cpp's own
`llama-quantize` on the F32 file (scripts/bench-vs-llamacpp.sh does that).

Why not llama.cpp's converter: it needs torch and an HF checkpoint of the full size. This
writes, with gguf-py alone (pins: scripts/requirements-gguf.txt, plus numpy), the same
metadata keys in the same order, the same tensor names, shapes and order, and the same
tokenizer metadata as convert_hf_to_gguf.py of llama-cpp-python 0.3.36 writes at
`--outtype f32` for a single-shard Qwen2.5-VL checkpoint; the committed converter-made
fixtures tests/fixtures/gguf/qwen2_5-vl/ (dump them with gguf.GGUFReader) show that layout.

Vocabulary: all `vocab_size` rows (151,936) so the output head has its real cost. Tokens come
from the real Qwen2 tokenizer.json when $MERG_DATA_DIR (default ../shared/data) has one, else
from the tiny fixture tokenizer; its special tokens sit at the config's ids (151643...) and every
id left over is `[PAD<id>]` of type UNUSED, exactly as the converter pads Qwen's vocabulary.

Weights: N(0, std) per tensor from numpy's PCG64 seeded with (seed, crc32(name)), so a file is
the same on every run and machine; RMSNorm weights are 1 and biases 0, as at initialisation,
so activations stay in a realistic range (std 0.02 is Qwen's initializer_range).
"""
import argparse
import json
import os
import zlib
from pathlib import Path

import numpy as np
import gguf

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "tiny-qwen2_5-vl"
# The tiny checkpoint's generation_config.json, which the converter records (fixture keys).
SAMPLING = dict(top_k=1, top_p=0.001, temp=1e-6, penalty_repeat=1.05)
# OpenAI CLIP mean/std: the Qwen2-VL image processor's (clip.vision.image_mean/std).
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def text_tensors(c):
    """HF name -> (GGUF name, shape as torch stores it) for the language model."""
    h, ff, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    t = {"model.embed_tokens.weight": ("token_embd.weight", (c["vocab_size"], h)),
         "model.norm.weight": ("output_norm.weight", (h,))}
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = ("output.weight", (c["vocab_size"], h))
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        t |= {p + "input_layernorm.weight": (b + "attn_norm.weight", (h,)),
              p + "mlp.down_proj.weight": (b + "ffn_down.weight", (h, ff)),
              p + "mlp.gate_proj.weight": (b + "ffn_gate.weight", (ff, h)),
              p + "mlp.up_proj.weight": (b + "ffn_up.weight", (ff, h)),
              p + "post_attention_layernorm.weight": (b + "ffn_norm.weight", (h,)),
              p + "self_attn.k_proj.bias": (b + "attn_k.bias", (kv,)),
              p + "self_attn.k_proj.weight": (b + "attn_k.weight", (kv, h)),
              p + "self_attn.o_proj.weight": (b + "attn_output.weight", (h, h)),
              p + "self_attn.q_proj.bias": (b + "attn_q.bias", (h,)),
              p + "self_attn.q_proj.weight": (b + "attn_q.weight", (h, h)),
              p + "self_attn.v_proj.bias": (b + "attn_v.bias", (kv,)),
              p + "self_attn.v_proj.weight": (b + "attn_v.weight", (kv, h))}
    # The converter walks the safetensors keys, which are sorted (blk.10 before blk.2).
    return [t[k] for k in sorted(t)]


def vision_tensors(c):
    """The projector's tensors, after the converter's qkv split and Conv3d split."""
    v = c["vision_config"]
    w, ff, out, ps = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v["patch_size"]
    m = w * v["spatial_merge_size"] ** 2
    t = {"visual.merger.ln_q.weight": ("v.post_ln.weight", (w,)),
         "visual.merger.mlp.0.bias": ("mm.0.bias", (m,)),
         "visual.merger.mlp.0.weight": ("mm.0.weight", (m, m)),
         "visual.merger.mlp.2.bias": ("mm.2.bias", (out,)),
         "visual.merger.mlp.2.weight": ("mm.2.weight", (out, m)),
         # Conv3d [w, 3, 2, p, p] becomes one Conv2d per temporal slice.
         "visual.patch_embed.proj.weight": [("v.patch_embd.weight", (w, 3, ps, ps)), ("v.patch_embd.weight.1", (w, 3, ps, ps))]}
    for i in range(v["depth"]):
        p, b = f"visual.blocks.{i}.", f"v.blk.{i}."
        t |= {p + "attn.proj.bias": (b + "attn_out.bias", (w,)),
              p + "attn.proj.weight": (b + "attn_out.weight", (w, w)),
              p + "attn.qkv.bias": [(b + f"attn_{x}.bias", (w,)) for x in "qkv"],
              p + "attn.qkv.weight": [(b + f"attn_{x}.weight", (w, w)) for x in "qkv"],
              p + "mlp.down_proj.bias": (b + "ffn_down.bias", (w,)),
              p + "mlp.down_proj.weight": (b + "ffn_down.weight", (w, ff)),
              p + "mlp.gate_proj.bias": (b + "ffn_gate.bias", (ff,)),
              p + "mlp.gate_proj.weight": (b + "ffn_gate.weight", (ff, w)),
              p + "mlp.up_proj.bias": (b + "ffn_up.bias", (ff,)),
              p + "mlp.up_proj.weight": (b + "ffn_up.weight", (ff, w)),
              p + "norm1.weight": (b + "ln1.weight", (w,)),
              p + "norm2.weight": (b + "ln2.weight", (w,))}
    out_list = []
    for k in sorted(t):
        out_list += t[k] if isinstance(t[k], list) else [t[k]]
    return out_list


def vocab(c, tokenizer):
    """(tokens, types, merges): the tokenizer's ordinary tokens at their ids, its added
    (special) tokens moved to start at the config's bos id, [PAD<id>] everywhere else."""
    tj = json.loads(Path(tokenizer).read_text())
    n = c["vocab_size"]
    tokens, types = [f"[PAD{i}]" for i in range(n)], [gguf.TokenType.UNUSED] * n
    for s, i in tj["model"]["vocab"].items():
        tokens[i], types[i] = s, gguf.TokenType.NORMAL
    added = sorted(tj["added_tokens"], key=lambda a: a["id"])
    shift = c["bos_token_id"] - added[0]["id"]  # 0 for the real tokenizer
    for a in added:
        tokens[a["id"] + shift] = a["content"]
        types[a["id"] + shift] = gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return tokens, types, merges


def write(path, arch, tensors, meta, seed, std):
    """Streams the tensors (the 3B-width F32 file is ~3.7 GB) after the metadata `meta` adds."""
    w = gguf.GGUFWriter(path, arch)
    meta(w)
    for name, shape in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in tensors:
        if name.endswith(("norm.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            x = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            x = np.zeros(shape, np.float32)
        else:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        w.write_tensor_data(x)
    w.close()


def general(w, kind, name, n_params):
    w.add_type(kind)
    for k, v in SAMPLING.items():
        getattr(w, f"add_sampling_{k}")(v)
    w.add_name(name)
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a Qwen2.5-VL config.json (models/dummy-*.json)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--tokenizer", help="tokenizer.json (default: the real Qwen2 one if present, else the tiny fixture's)")
    a = ap.parse_args()
    c = json.loads(Path(a.config).read_text())
    if c.get("model_type") != "qwen2_5_vl":
        raise SystemExit(f"{a.config}: model_type {c.get('model_type')!r}; this writes Qwen2.5-VL (qwen2_5_vl) files only")
    real = Path(os.environ.get("MERG_DATA_DIR", ROOT.parent / "shared" / "data")) / "qwen2-tokenizer" / "tokenizer.json"
    tok = a.tokenizer or (real if real.is_file() else TINY / "tokenizer.json")
    stem = Path(a.config).stem.removeprefix("dummy-")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tt, vt = text_tensors(c), vision_tensors(c)
    count = lambda ts: sum(int(np.prod(s)) for _, s in ts)
    v, mrope = c["vision_config"], c["rope_scaling"]["mrope_section"]
    fa = v["fullatt_block_indexes"]
    assert all(b - a_ == fa[0] + 1 for a_, b in zip(fa, fa[1:])), "llama.cpp needs evenly spaced full-attention blocks"

    def text_meta(w):
        general(w, "model", stem, count(tt))
        w.add_block_count(c["num_hidden_layers"])
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(c["hidden_size"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_rope_dimension_sections(list(mrope) + [0] * (4 - len(mrope)))
        w.add_rope_freq_base(c["rope_theta"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tokens, types, merges = vocab(c, tok)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(c["eos_token_id"])
        w.add_pad_token_id(c["bos_token_id"])  # Qwen pads with <|endoftext|>
        w.add_bos_token_id(c["bos_token_id"])
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        w.add_chat_template(json.loads((TINY / "chat_template.json").read_text())["chat_template"])

    def vision_meta(w):
        general(w, "mmproj", stem, count(vt))
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_clip_has_vision_encoder(True)
        w.add_vision_projection_dim(c["hidden_size"])
        w.add_vision_image_size(v.get("image_size", 560))  # the converter's default
        w.add_vision_patch_size(v["patch_size"])
        w.add_vision_embedding_length(v["hidden_size"])
        w.add_vision_feed_forward_length(v["intermediate_size"])
        w.add_vision_block_count(v["depth"])
        w.add_vision_head_count(v["num_heads"])
        w.add_vision_image_mean(MEAN)
        w.add_vision_image_std(STD)
        w.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
        w.add_vision_use_silu(True)
        w.add_vision_n_wa_pattern(fa[0] + 1)
        w.add_vision_attention_layernorm_eps(c["rms_norm_eps"])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    write(out / f"{stem}-f32.gguf", "qwen2vl", tt, text_meta, a.seed, a.std)
    write(out / f"mmproj-{stem}-f32.gguf", "clip", vt, vision_meta, a.seed, a.std)
    print(f"wrote {out}/{stem}-f32.gguf ({count(tt):,} params, tokenizer {tok}) and mmproj-{stem}-f32.gguf ({count(vt):,} params)")


if __name__ == "__main__":
    main()
