"""GGUF fixtures of the SentencePiece families (Gemma 3, LLaVA-NeXT), called by make_gguf_fixtures.py.

Both are converted by the pinned llama.cpp converter the way its documentation converts the real models:
- Gemma 3: `convert_hf_to_gguf.py` writes the `gemma3` text file and, with `--mmproj`, the `clip` projector
  (`gemma3` projector type: SigLIP tower, average pool, soft-embedding norm, input projection).
- LLaVA-NeXT (docs/multimodal/llava.md, "LLaVA 1.6"): the LLaMA decoder is exported as a `LlamaForCausalLM`
  checkpoint and converted by `convert_hf_to_gguf.py` (architecture `llama`); the projector goes through the legacy
  `llava_surgery_v2.py` (tower to llava.clip, projector and image_newline to llava.projector) and
  `convert_image_encoder_to_gguf.py --clip-model-is-vision --llava-projector` with a vision config carrying the
  llava-1.6 fields (image_grid_pinpoints, mm_patch_merge_type spatial_unpad, image_aspect_ratio anyres), as the
  config_vit.json the documentation downloads does.

The converter reads a SentencePiece vocabulary only from tokenizer.model, which the tiny checkpoints lack (their
tokenizer.json is a SentencePiece-style BPE with byte fallback). `spm_model()` writes the tokenizer.model that
tokenizer.json was converted from: the same pieces at the same ids, byte pieces as BYTE, specials as CONTROL, and
BPE scores that order the merged pieces by their merge's rank (a real BPE tokenizer.model scores pieces so; HF's
SpmConverter rebuilds the merges from these scores). Without it the converter would fall back to a GPT-2 vocabulary
(Gemma 3) or to LlamaHfVocab, which scores every piece -1000 (LLaMA), neither what a real model's file holds.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "gguf"


def spm_model(src: Path, dst: Path, add_dummy_prefix: bool):
    """tokenizer.model (SentencePiece BPE) equal to `src`/tokenizer.json's vocabulary and merges."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    t = json.loads((src / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in t["model"]["merges"]]
    special = {a["content"] for a in t["added_tokens"] if a["special"]}
    added = {a["content"] for a in t["added_tokens"]}
    rank = {}
    for r, (a, b) in enumerate(merges):
        rank.setdefault(a + b, r)
    m = pb.ModelProto()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "ids must be contiguous"
    unk = t["model"]["unk_token"]
    for piece, i in by_id:
        p = m.pieces.add()
        p.piece = piece
        if piece == unk:
            p.type, p.score = pb.ModelProto.SentencePiece.UNKNOWN, 0.0
        elif piece in special:
            p.type, p.score = pb.ModelProto.SentencePiece.CONTROL, 0.0
        elif piece in added:
            p.type, p.score = pb.ModelProto.SentencePiece.USER_DEFINED, 0.0
        elif piece.startswith("<0x") and len(piece) == 6:
            p.type, p.score = pb.ModelProto.SentencePiece.BYTE, 0.0
        elif piece in rank:
            p.type, p.score = pb.ModelProto.SentencePiece.NORMAL, -float(rank[piece])
        else:  # single characters (never a merge's result) after every merged piece
            p.type, p.score = pb.ModelProto.SentencePiece.NORMAL, -float(len(merges) + i)
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(by_id)
    ts.byte_fallback = True
    ids = {p: i for p, i in by_id}
    ts.unk_id = ids[unk]
    for name, tok in (("bos", ("<bos>", "<s>")), ("eos", ("<eos>", "</s>")), ("pad", ("<pad>",))):
        setattr(ts, f"{name}_id", next((ids[x] for x in tok if x in ids), -1))
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = add_dummy_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    dst.write_bytes(m.SerializeToString())


def copy_checkpoint(src: Path, dst: Path, add_dummy_prefix: bool):
    shutil.copytree(src, dst, dirs_exist_ok=True)
    spm_model(src, dst / "tokenizer.model", add_dummy_prefix)


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def llava_text_checkpoint(src: Path, dst: Path):
    """The LLaMA decoder of tiny-llava-next as a LlamaForCausalLM checkpoint (the documented export; transformers
    4.57's `language_model` is the bare LlamaModel, so the head is carried over with it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlavaNextForConditionalGeneration

    full = LlavaNextForConditionalGeneration.from_pretrained(src, torch_dtype=torch.float32).eval()
    cfg = LlamaConfig(**full.config.text_config.to_dict())
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.tie_word_embeddings = False
    llm = LlamaForCausalLM(cfg).eval()
    llm.model.load_state_dict(full.model.language_model.state_dict())
    llm.lm_head.load_state_dict(full.lm_head.state_dict())
    dst.mkdir(parents=True, exist_ok=True)
    llm.save_pretrained(dst, safe_serialization=True)
    # The checkpoint's tokenizer files beside it, its chat template (chat_template.json, which the converter's
    # SpecialVocab reads) included, so the text file carries the vicuna template as the Qwen fixtures carry theirs.
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.json"):
        shutil.copy(src / f, dst / f)
    spm_model(src, dst / "tokenizer.model", True)


def llava_projector(python: str, llama_cpp: Path, src: Path, work: Path, out: Path):
    """llava_surgery_v2.py + convert_image_encoder_to_gguf.py, as docs/multimodal/llava.md runs them for 1.6."""
    legacy = llama_cpp / "tools" / "mtmd" / "legacy-models"
    model = work / "model"
    shutil.copytree(src, model, dirs_exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    run([python, legacy / "llava_surgery_v2.py", "-C", "-m", model], env=env)
    vit = work / "vit"
    vit.mkdir(exist_ok=True)
    shutil.copy(model / "llava.clip", vit / "pytorch_model.bin")
    shutil.copy(model / "llava.projector", vit / "llava.projector")
    cfg = json.loads((src / "config.json").read_text())
    from transformers import CLIPVisionConfig
    v = CLIPVisionConfig(**cfg["vision_config"]).to_dict()
    # The llava-1.6 fields of the documented config_vit.json, with this checkpoint's values.
    v.update(architectures=["CLIPVisionModel"], image_grid_pinpoints=cfg["image_grid_pinpoints"],
             mm_patch_merge_type="spatial_unpad", image_aspect_ratio="anyres",
             image_crop_resolution=v["image_size"], image_split_resolution=v["image_size"],
             mm_projector_type="mlp2x_gelu")
    (vit / "config.json").write_text(json.dumps(v, indent=2))
    pre = json.loads((src / "preprocessor_config.json").read_text())
    run([python, legacy / "convert_image_encoder_to_gguf.py", "-m", vit, "--llava-projector", vit / "llava.projector",
         "--output-dir", vit, "--clip-model-is-vision", "--use-f32",
         "--image-mean", *pre["image_mean"], "--image-std", *pre["image_std"]], env=env)
    shutil.move(vit / "mmproj-model-f32.gguf", out)


CONVERT_SHIM = r'''
import sys, runpy
root = sys.argv.pop(1)
sys.path.insert(0, root)
sys.path.insert(1, root + "/gguf-py")
sys.argv[0] = "convert_hf_to_gguf.py"
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
'''


def convert(python, llama_cpp, src, out, outtype, mmproj=False):
    """convert_hf_to_gguf.py as it is (no shim beyond putting the vendored gguf-py first on the path)."""
    shim = out.parent / ".convert_spm_shim.py"
    shim.write_text(CONVERT_SHIM)
    cmd = [python, shim, llama_cpp, src, "--outtype", outtype, "--outfile", out] + (["--mmproj"] if mmproj else [])
    run(cmd)
    shim.unlink()


def quantize_q4_0(f32: Path, out: Path):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"


def golden_prompt(family: str) -> list[int]:
    from safetensors.numpy import load_file
    return [int(x) for x in load_file(str(FIX / "goldens" / family / "text.safetensors"))["input_ids"][0]]


def make(python: str, llama_cpp: Path, llama_goldens, gguf_py_hashes):
    """Writes gguf/gemma3 and gguf/llava-next: F32 text, Q4_0 text (llama.cpp's quantizer), F32 projector, the
    checkpoint's preprocessor config, and llama.cpp's logits and greedy tokens on each text golden's prompt."""
    work = OUT / ".spm-work"
    shutil.rmtree(work, ignore_errors=True)
    # Gemma 3: one checkpoint gives both files.
    dst = OUT / "gemma3"
    dst.mkdir(exist_ok=True)
    hf = work / "gemma3-hf"
    copy_checkpoint(FIX / "tiny-gemma3", hf, add_dummy_prefix=False)
    convert(python, llama_cpp, hf, dst / "tiny-gemma3-f32.gguf", "f32")
    convert(python, llama_cpp, hf, dst / "mmproj-tiny-gemma3-f32.gguf", "f32", mmproj=True)
    shutil.copy(FIX / "tiny-gemma3" / "preprocessor_config.json", dst)
    print("wrote gemma3")
    # LLaVA-NeXT: the decoder exported as LLaMA, the projector by the legacy llava tools.
    dst = OUT / "llava-next"
    dst.mkdir(exist_ok=True)
    llm = work / "llava-llm"
    llava_text_checkpoint(FIX / "tiny-llava-next", llm)
    convert(python, llama_cpp, llm, dst / "tiny-llava-next-f32.gguf", "f32")
    llava_projector(python, llama_cpp, FIX / "tiny-llava-next", work / "llava-proj", dst / "mmproj-tiny-llava-next-f32.gguf")
    shutil.copy(FIX / "tiny-llava-next" / "preprocessor_config.json", dst)
    print("wrote llava-next")
    shutil.rmtree(work)
    if llama_goldens is None:
        return
    for d, family in (("gemma3", "gemma3"), ("llava-next", "llava_next")):
        f32 = OUT / d / f"tiny-{d}-f32.gguf"
        q4 = OUT / d / f"tiny-{d}-q4_0.gguf"
        quantize_q4_0(f32, q4)
        prompt = golden_prompt(family)
        for f in (f32, q4):
            g = {"llama_cpp": llama_goldens(f, prompt), "gguf_py": gguf_py_hashes(f)}
            f.with_suffix(".json").write_text(json.dumps(g))
        print("wrote", d, "llama.cpp goldens")


if __name__ == "__main__":
    # Conversion only (no llama.cpp library needed): python scripts/gguf_spm_fixtures.py LLAMA_CPP_DIR
    make(sys.executable, Path(sys.argv[1]), None, None)
