#!/usr/bin/env python3
"""Generate TINY random encoder checkpoints for the BERTScore / emotion-polarity metrics.

Output (deterministic, fixed seeds), both in the Hugging Face hub layout:
    tests/fixtures/tiny-roberta/              RobertaForMaskedLM like `roberta-large` (keys
        "roberta.*" + "lm_head.*"), byte-level BPE tokenizer trained here: vocab.json, merges.txt
        (for the slow RobertaTokenizer that bert-score uses) and tokenizer.json (fast, for Rust).
    tests/fixtures/tiny-distilbert-emotion/   DistilBertForSequenceClassification like
        `bhadresh-savani/distilbert-base-uncased-emotion` (6 labels sadness..surprise), WordPiece
        uncased tokenizer trained here: vocab.txt + tokenizer.json.

Weights are float32 with a larger-than-default init so that token embeddings and the classifier
outputs are clearly distinct (a std-0.02 model maps every token to nearly the same vector).

Usage:  /root/golden-venv/bin/python scripts/make_encoder_checkpoints.py
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"

CORPUS = [
    "I just lost my job and I don't know what to do.",
    "That sounds really hard. I'm so sorry you're going through this.",
    "My sister got married last weekend, it was beautiful!",
    "Congratulations to her! Weddings are such happy occasions.",
    "I'm scared of the exam tomorrow; I haven't studied enough.",
    "You've worked hard all term, you will be fine.",
    "My dog passed away yesterday after fourteen years.",
    "I'm really sorry. Losing a pet is like losing family.",
    "Someone stole my bike right in front of the store!",
    "That's infuriating. Did you report it to the police?",
    "I was surprised when they threw me a party for my birthday.",
    "What a lovely surprise, your friends must care about you a lot.",
    "I love spending rainy afternoons reading with a cup of tea.",
    "The traffic this morning made me so angry, I was late again.",
    "I feel lonely since I moved to a new city.",
    "It takes time to make friends; maybe join a club or a class?",
    "We won the championship game 3-2 in overtime!",
    "I can't believe he said that to me, I'm furious.",
    "She smiled at me and my heart skipped a beat.",
    "The news about the accident terrified everyone.",
    "Thank you so much for listening, it means a lot.",
    "How are you feeling today? Better than yesterday?",
    "Café au lait, naïve résumé — déjà vu at 9:30 a.m.",
    "Numbers like 42, 3.14 and 1,000,000 appear too.",
]

EMOTION_LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]


def perturb_(model: torch.nn.Module, std: float, seed: int) -> None:
    """Re-draw every weight: matrices ~ N(0, std), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "LayerNorm" in name or "layer_norm" in name:
                p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=g)) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def wordpiece_vocab() -> list[str]:
    """A WordPiece vocab built by hand, deterministically (the trainer breaks frequency ties
    differently from run to run): specials, every character seen and its ##-continuation,
    frequent suffixes, then corpus words by count."""
    from collections import Counter

    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    norm, pre = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = Counter(w for line in CORPUS for w, _ in pre.pre_tokenize_str(norm.normalize_str(line)))
    chars = sorted({c for w in words for c in w})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars]
    vocab += ["##s", "##ed", "##ing", "##ly", "##er", "##est", "##ness"]
    vocab += [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])) if len(w) > 1]
    seen, out = set(), []
    for t in vocab:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out[:400]


def center_head_(model, tok) -> None:
    """Random CLS features are nearly the same for every text, so one label would win everywhere
    and every polarity would be ~1. Centre and scale the classifier input over the corpus so
    different texts get clearly different emotion distributions (deterministic, data-derived)."""
    enc = tok(CORPUS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model.distilbert(**enc).last_hidden_state[:, 0]
        h = torch.relu(model.pre_classifier(h))
        mu, sd = h.mean(0), h.std(0) + 1e-3
        w = model.classifier.weight / sd  # per-feature standardisation folded into the weights
        model.classifier.weight.copy_(w)
        model.classifier.bias.copy_(-(w @ mu))
        logits = model.classifier(h)
        model.classifier.weight.mul_(2.0 / logits.std())
        model.classifier.bias.mul_(2.0 / logits.std())


def make_roberta(out: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer, RobertaTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 3, vocab_size=420, min_frequency=2, special_tokens=specials,
                            show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.save_model(tmp)
        vocab, merges = f"{tmp}/vocab.json", f"{tmp}/merges.txt"
        # Both flavours from the same files: the slow one is what bert-score 0.3.13 loads
        # (use_fast=False), the fast one writes the tokenizer.json the Rust side reads.
        slow = RobertaTokenizer(vocab, merges, model_max_length=512)
        fast = RobertaTokenizerFast(vocab, merges, model_max_length=512)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        slow.save_pretrained(out)
        fast.save_pretrained(out)  # overwrites tokenizer_config.json, adds tokenizer.json
    n_vocab = len(slow)
    cfg = RobertaConfig(
        vocab_size=n_vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, hidden_act="gelu", max_position_embeddings=514, type_vocab_size=1,
        layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = RobertaForMaskedLM(cfg).eval()
    perturb_(model, std=0.3, seed=1)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny-roberta: vocab {n_vocab}, {sum(p.numel() for p in model.parameters())} params")


def make_distilbert(out: Path) -> None:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, DistilBertTokenizerFast

    vocab = wordpiece_vocab()
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/vocab.txt").write_text("".join(t + "\n" for t in vocab))
        tok = DistilBertTokenizerFast(f"{tmp}/vocab.txt", do_lower_case=True, model_max_length=512)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        tok.save_pretrained(out)
    cfg = DistilBertConfig(
        vocab_size=len(tok), dim=32, n_layers=2, n_heads=4, hidden_dim=64, activation="gelu",
        max_position_embeddings=512, pad_token_id=0, num_labels=len(EMOTION_LABELS),
        id2label=dict(enumerate(EMOTION_LABELS)), label2id={l: i for i, l in enumerate(EMOTION_LABELS)},
        problem_type="single_label_classification",
    )
    torch.manual_seed(0)
    model = DistilBertForSequenceClassification(cfg).eval()
    perturb_(model, std=0.3, seed=2)
    center_head_(model, tok)
    model.save_pretrained(out, safe_serialization=True)
    print(f"tiny-distilbert-emotion: vocab {len(tok)}, {sum(p.numel() for p in model.parameters())} params")


def main() -> None:
    make_roberta(FIX / "tiny-roberta")
    make_distilbert(FIX / "tiny-distilbert-emotion")


if __name__ == "__main__":
    main()
