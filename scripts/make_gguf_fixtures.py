#!/usr/bin/env python3
"""GGUF test fixtures made by llama.cpp itself (tests/fixtures/gguf/).

For each tiny hub checkpoint (tests/fixtures/tiny-*), llama.cpp's own converter writes the
text model at F32 and Q8_0 and the vision projector at F32; a wide Qwen2-VL variant (rows of
256 and 512 values, so k-quants apply) is converted and quantized to Q8_0 and Q4_K_M with
llama.cpp's quantizer. For the wide model, llama.cpp (llama-cpp-python) computes the logits of
a fixed prompt and its greedy continuation, and gguf-py dequantizes every tensor; both are
stored as JSON goldens next to the files (tests/gguf.rs compares merg against them).

Environment (goldens only; CI never runs this):
    python -m venv /root/golden-venv && pip install -r scripts/requirements-goldens.txt \
        -r scripts/requirements-gguf.txt
The converter is the one vendored in the llama-cpp-python sdist (the same llama.cpp commit
as the compiled library): pass the unpacked sdist's vendor/llama.cpp as --llama-cpp.
Qwen3.5 needs transformers 5 for its tokenizer: --python5 names that interpreter.
Gemma 3 and LLaVA-NeXT (scripts/gguf_spm_fixtures.py; `--only gemma-llava` makes just those)
also need sentencepiece and protobuf (the converter reads a tokenizer.model).

    python scripts/make_gguf_fixtures.py --llama-cpp /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --python5 /root/golden-venv-5/bin/python

Workarounds for tiny checkpoints (documented in the converter shim below): their BPE is not one
of llama.cpp's hashed pre-tokenizers (we name the real one: qwen2 / qwen35); their vision
towers have fewer blocks than the merger's `mlp.2` index, which llama.cpp's name map ranges
over; and no sentencepiece model exists, so the gpt2 vocabulary path is taken directly.
"""
import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "gguf"

# (fixture dir, tiny checkpoint, llama.cpp pre-tokenizer, needs transformers 5)
FAMILIES = [
    ("qwen2-vl", "tiny-qwen2-vl", "qwen2", False),
    ("qwen2_5-vl", "tiny-qwen2_5-vl", "qwen2", False),
    ("qwen3-vl", "tiny-qwen3-vl", "qwen2", False),
    ("qwen3_5", "tiny-qwen3_5", "qwen35", True),
    # Qwen2.5-Omni's thinker: the text as `qwen2vl`, the vision and audio towers in one `qwen2.5o`
    # projector (conversion/qwenvl.py's Qwen25OmniModel); talker and token2wav are not converted.
    ("qwen2_5-omni", "tiny-qwen2_5-omni", "qwen2", False),
]

SHIM = r'''
import sys, runpy
root = sys.argv.pop(1)
pre = sys.argv.pop(1)
sys.path.insert(0, root)
sys.path.insert(1, root + "/gguf-py")
import gguf
import conversion.base as base
# Tiny BPEs hash to no known pre-tokenizer; name the real model's.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
_orig = gguf.get_tensor_name_map
def _map(arch, n_blocks):
    # Tiny towers have fewer blocks than the merger's mm.2 index; widen the name range.
    return _orig(arch, max(n_blocks, 4) if arch == gguf.MODEL_ARCH.MMPROJ else n_blocks)
gguf.get_tensor_name_map = _map
base.gguf.get_tensor_name_map = _map
import conversion.qwenvl as qv
qv.Qwen2VLModel.set_vocab = lambda self: self._set_vocab_gpt2()
def _no_sp(self, *a, **k):
    raise FileNotFoundError("tiny checkpoints have no sentencepiece model")
base.TextModel._set_vocab_sentencepiece = _no_sp
sys.argv[0] = "convert_hf_to_gguf.py"
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def convert(python, llama_cpp, pre, src, out, outtype, mmproj=False):
    shim = OUT / ".convert_shim.py"
    shim.write_text(SHIM)
    cmd = [python, str(shim), str(llama_cpp), pre, str(src), "--outtype", outtype, "--outfile", str(out)]
    if mmproj:
        cmd.append("--mmproj")
    subprocess.run(cmd, check=True, capture_output=True)
    shim.unlink()


def save_variant(src, dst, make, seed, std):
    """A variant of tiny checkpoint `src` in `dst`: its tokenizer and processor files, and the
    weights of the model `make()` builds, drawn from N(0, std) after seeding with `seed`."""
    import torch
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    torch.manual_seed(seed)
    model = make().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(dst, safe_serialization=True)
    return model


def wide_checkpoint(dst):
    """tiny-qwen2-vl with 256-wide text rows (k-quant blocks are 256 values)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    src = FIX / "tiny-qwen2-vl"
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    cfg["vision_config"]["hidden_size"] = 256
    # head_dim 64: M-RoPE sections must cover its 32 frequency pairs.
    cfg["rope_scaling"]["mrope_section"] = [8, 12, 12]
    save_variant(src, dst, lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(**cfg)), seed=11, std=0.05)


def moe_checkpoint(dst):
    """tiny-qwen3-vl-moe with every layer sparse: llama.cpp's qwen3vlmoe has no dense FFN
    layers, and the tiny checkpoint keeps layer 3 dense. Returns transformers' logits for the
    qwen3_vl_moe text golden's prompt (last 16 positions)."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from safetensors.numpy import load_file
    src = FIX / "tiny-qwen3-vl-moe"
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["mlp_only_layers"] = []
    model = save_variant(src, dst, lambda: Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**cfg)), seed=7, std=0.1)
    ids = load_file(str(FIX / "goldens" / "qwen3_vl_moe" / "text.safetensors"))["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits[0, -16:].float().numpy()
    return {"prompt": [int(x) for x in ids[0]], "logits_last": logits.tolist()}


def llama_goldens(path, prompt, n_new=16, keep=16):
    """llama.cpp's logits for the last `keep` prompt positions and its greedy continuation."""
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False, seed=0)
    llm.reset()
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float32)
    tokens, seq = [], list(prompt)
    last = logits[-1]
    for _ in range(n_new):
        t = int(np.argmax(last))
        tokens.append(t)
        llm.eval([t])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return {"version": llama_cpp.__version__, "prompt": prompt, "logits_last": logits[-keep:].tolist(), "greedy": tokens}


def gguf_py_hashes(path):
    """sha256 of every tensor dequantized by PyPI gguf-py, f32 little-endian, row-major in the
    torch-style shape (gguf-py's `data` shape, outermost first; candle's order too)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        v = dequantize(t.data, t.tensor_type).astype("<f4")
        shape = [int(d) for d in reversed(t.shape.tolist())]
        v = np.ascontiguousarray(v.reshape(shape))
        out[t.name] = {"type": t.tensor_type.name, "shape": shape, "sha256": hashlib.sha256(v.tobytes()).hexdigest()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, type=Path, help="vendor/llama.cpp of the llama-cpp-python sdist")
    ap.add_argument("--python5", default=sys.executable, help="an interpreter with transformers 5 (Qwen3.5)")
    ap.add_argument("--only", choices=["all", "gemma-llava", "omni"], default="all",
                    help="gemma-llava: only the SentencePiece families (scripts/gguf_spm_fixtures.py); omni: only Qwen2.5-Omni")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    import gguf_spm_fixtures
    if a.only == "gemma-llava":
        gguf_spm_fixtures.make(sys.executable, a.llama_cpp, llama_goldens, gguf_py_hashes)
        return
    for d, ckpt, pre, needs5 in FAMILIES:
        if a.only == "omni" and d != "qwen2_5-omni":
            continue
        py = a.python5 if needs5 else sys.executable
        dst = OUT / d
        dst.mkdir(exist_ok=True)
        src = FIX / ckpt
        convert(py, a.llama_cpp, pre, src, dst / f"tiny-{d}-f32.gguf", "f32")
        convert(py, a.llama_cpp, pre, src, dst / f"tiny-{d}-q8_0.gguf", "q8_0")
        convert(py, a.llama_cpp, pre, src, dst / f"mmproj-tiny-{d}-f32.gguf", "f32", mmproj=True)
        for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
            if (src / f).is_file():  # tiny-qwen2_5-omni has one processor config for both
                shutil.copy(src / f, dst / f)
        print("wrote", d)
    if a.only == "omni":
        return

    moe_src = OUT / ".moe-hf"
    golden = moe_checkpoint(moe_src)
    dst = OUT / "qwen3-vl-moe"
    dst.mkdir(exist_ok=True)
    convert(sys.executable, a.llama_cpp, "qwen2", moe_src, dst / "moe-f32.gguf", "f32")
    convert(sys.executable, a.llama_cpp, "qwen2", moe_src, dst / "mmproj-moe-f32.gguf", "f32", mmproj=True)
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(moe_src / f, dst / f)
    (dst / "moe-f32.json").write_text(json.dumps({"transformers": golden}))
    shutil.rmtree(moe_src)
    print("wrote qwen3-vl-moe")

    import llama_cpp
    wide_src = OUT / ".wide-hf"
    wide_checkpoint(wide_src)
    dst = OUT / "qwen2-vl-wide"
    dst.mkdir(exist_ok=True)
    f32 = dst / "wide-f32.gguf.tmp"
    convert(sys.executable, a.llama_cpp, "qwen2", wide_src, f32, "f32")
    convert(sys.executable, a.llama_cpp, "qwen2", wide_src, dst / "wide-q8_0.gguf", "q8_0")
    convert(sys.executable, a.llama_cpp, "qwen2", wide_src, dst / "mmproj-wide-f32.gguf", "f32", mmproj=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(dst / "wide-q4_k_m.gguf").encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"
    # The hub safetensors of the wide model stay out of the repo: F32 GGUF is committed instead.
    shutil.move(f32, dst / "wide-f32.gguf")
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        shutil.copy(FIX / "tiny-qwen2-vl" / f, dst / f)
    from safetensors.numpy import load_file
    prompt = [int(x) for x in load_file(str(FIX / "goldens" / "qwen2_vl" / "text.safetensors"))["input_ids"][0]]
    for name in ("wide-f32", "wide-q8_0", "wide-q4_k_m"):
        g = {"llama_cpp": llama_goldens(dst / f"{name}.gguf", prompt), "gguf_py": gguf_py_hashes(dst / f"{name}.gguf")}
        (dst / f"{name}.json").write_text(json.dumps(g))
        print("wrote", name)
    shutil.rmtree(wide_src)
    gguf_spm_fixtures.make(sys.executable, a.llama_cpp, llama_goldens, gguf_py_hashes)


if __name__ == "__main__":
    main()
