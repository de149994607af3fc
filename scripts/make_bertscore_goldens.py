#!/usr/bin/env python3
"""Goldens for the BERTScore and emotion-polarity metrics (tests/bertscore.rs).

Reads the tiny checkpoints from scripts/make_encoder_checkpoints.py and writes
tests/fixtures/goldens/bertscore/:
    bertscore.json          P/R/F1 from bert_score.score (bert-score 0.3.13) on the tiny RoBERTa at
                            layers 1, 2, 3 (the off-by-one check), rescaled with a made-up baseline,
                            with idf, and with multiple references; the bert-score token ids of
                            every sentence; layer-2 hidden states of two sentences.
    baseline-tiny-roberta.tsv   made-up baseline in bert-score's rescale_baseline format.
    polarity.json           logits/softmax of the tiny DistilBERT emotion classifier (transformers,
                            checked against the text-classification pipeline) and emotion
                            polarity / empathy numbers from a plain NumPy version of the formula.

Usage:  /root/golden-venv/bin/python scripts/make_bertscore_goldens.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
OUT = FIX / "goldens" / "bertscore"
ROBERTA = FIX / "tiny-roberta"
DISTIL = FIX / "tiny-distilbert-emotion"

LONG = " ".join(["I keep thinking about everything that happened, and it hurts."] * 60)

PAIRS = [  # (candidate, reference)
    ("I'm so sorry to hear that.", "That sounds really hard, I'm sorry."),
    ("Congratulations on your new job!", "Congrats, that's wonderful news about the job!"),
    ("What happened?", "Can you tell me more about what happened?"),
    ("That must have been terrifying.", "You must have been so scared."),
    ("Ok.", "Okay!"),
    ("", "I understand how you feel."),
    ("I understand how you feel.", "   "),
    ("Café au lait, naïve résumé — déjà vu.", "Coffee with milk, a naive resume, deja vu."),
    ("你好，世界！", "Hello, world!"),
    ("I ❤️ this so much 😊😊", "I love this a lot :)"),
    ("Numbers: 42, 3.14 and 1,000,000.", "numbers 42 3.14 1000000"),
    ("  leading and trailing spaces  ", "leading and trailing spaces"),
    ("Tabs\tand\nnewlines\r\nmixed in.", "Tabs and newlines mixed in."),
    ("Why?!?!", "why"),
    ("It takes time to make friends; maybe join a club?", "Maybe you could join a club to meet people."),
    ("My dog passed away yesterday.", "My dog passed away yesterday."),
    ("I'm furious, he lied to me again!!!", "It's understandable to be angry when someone lies to you."),
    ("Don't worry, you'll do great tomorrow.", "Good luck on your exam, I believe in you."),
    ("a", "b"),
    ("The quick brown fox jumps over the lazy dog, doesn't it?",
     "A fast, brown fox leaped over a sleepy dog."),
    (LONG, "I keep thinking about it and it hurts."),
    ("What a lovely surprise, your friends must care about you a lot.",
     "It's great that your friends threw you a party!"),
]

MULTI = [  # (candidate, [references])
    ("I'm so sorry to hear that.", ["That is sad.", "I'm sorry to hear that."]),
    ("Congrats!", ["Congratulations!", "Well done, that's great.", "Nice."]),
    ("", ["Anything.", "Something else"]),
]

LAYERS = (1, 2, 3)
MAIN_LAYER = 2

EMOTION_TEXTS = [
    "I just lost my job and I don't know what to do.",
    "My sister got married last weekend, it was beautiful!",
    "I love spending rainy afternoons reading with a cup of tea.",
    "Someone stole my bike right in front of the store!",
    "The news about the accident terrified everyone.",
    "I was surprised when they threw me a party.",
    "",
    "ok",
    "WHY WOULD YOU DO THAT?!",
    "Café au lait, naïve résumé — déjà vu.",
    "你好，世界！ 😊",
    LONG,  # > 512 tokens: truncated like the pipeline with truncation=True
]

DIALOGUES = [  # (reply, history)
    ("I'm so sorry, that sounds really hard.", ["I just lost my job and I don't know what to do."]),
    ("Congratulations to her!", ["My sister got married last weekend, it was beautiful!",
                                 "The whole family was there."]),
    ("Did you report it to the police?", ["Someone stole my bike!", "I'm so angry.", "It was new."]),
    ("Hello there.", []),
    ("", ["I feel lonely since I moved to a new city."]),
    ("What a lovely surprise.", ["I was surprised when they threw me a party.", ""]),
]


def write_baseline(path: Path) -> None:
    # Made-up numbers in bert-score's format (header LAYER,P,R,F; row i = layer i).
    rows = ["LAYER,P,R,F"]
    for layer in range(5):
        rows.append(f"{layer},{0.30 + 0.05 * layer:.8f},{0.31 + 0.045 * layer:.8f},{0.305 + 0.048 * layer:.8f}")
    path.write_text("\n".join(rows) + "\n")


def bertscore_goldens() -> dict:
    from bert_score import score
    from bert_score.utils import get_tokenizer, sent_encode
    from transformers import AutoModel

    cands = [c for c, _ in PAIRS]
    refs = [r for _, r in PAIRS]
    model = str(ROBERTA)

    def run(layer, **kw):
        p, r, f = score(cands, refs, model_type=model, num_layers=layer, device="cpu", nthreads=0, **kw)
        return {"P": p.tolist(), "R": r.tolist(), "F": f.tolist()}

    out = {"model": "tiny-roberta", "main_layer": MAIN_LAYER, "cands": cands, "refs": refs, "plain": {}}
    for layer in LAYERS:
        out["plain"][str(layer)] = run(layer)
        # bert-score pads in the greedy match with 0-similarity entries, so a token whose best
        # cosine is negative would make results batch-dependent there; assert it does not happen
        # on these inputs (our implementation is padding-invariant by construction).
        one = run(layer, batch_size=1)
        for k in "PRF":
            err = np.max(np.abs(np.array(one[k]) - np.array(out["plain"][str(layer)][k])))
            assert err < 1e-6, f"layer {layer} {k}: batch-size dependence {err}"
    for a in LAYERS:
        for b in LAYERS:
            if a < b:
                d = np.max(np.abs(np.array(out["plain"][str(a)]["F"]) - np.array(out["plain"][str(b)]["F"])))
                assert d > 1e-2, f"layers {a} and {b} give nearly equal F ({d}); off-by-one check too weak"

    baseline = OUT / "baseline-tiny-roberta.tsv"
    write_baseline(baseline)
    out["baseline_file"] = baseline.name
    out["rescaled"] = run(MAIN_LAYER, lang="en", rescale_with_baseline=True, baseline_path=str(baseline))
    out["idf"] = run(MAIN_LAYER, idf=True)
    out["idf_rescaled"] = run(MAIN_LAYER, idf=True, lang="en", rescale_with_baseline=True,
                              baseline_path=str(baseline))

    mc = [c for c, _ in MULTI]
    mr = [r for _, r in MULTI]
    p, r, f = score(mc, mr, model_type=model, num_layers=MAIN_LAYER, device="cpu", nthreads=0)
    out["multi"] = {"cands": mc, "refs": mr, "P": p.tolist(), "R": r.tolist(), "F": f.tolist()}

    tok = get_tokenizer(model, use_fast=False)
    sents = sorted(set(cands + refs + mc + [x for g in mr for x in g]))
    out["token_ids"] = {s: sent_encode(tok, s) for s in sents}

    enc = AutoModel.from_pretrained(model).eval()
    hidden = {}
    for s in (cands[0], refs[7]):
        ids = torch.tensor([sent_encode(tok, s)])
        with torch.no_grad():
            hs = enc(ids, output_hidden_states=True).hidden_states
        hidden[s] = hs[MAIN_LAYER][0].tolist()
    out["hidden_states"] = hidden
    return out


def polarity_goldens() -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(DISTIL)
    model = AutoModelForSequenceClassification.from_pretrained(DISTIL).eval()
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]

    def classify(texts):
        # One text at a time, unpadded, as the pipeline runs them.
        rows = []
        for t in texts:
            enc = tok([t], truncation=True, max_length=512, return_tensors="pt")
            with torch.no_grad():
                rows.append(model(**enc).logits[0].numpy().astype(np.float64))
        return np.stack(rows)

    logits = classify(EMOTION_TEXTS)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)

    # The reference notebook uses the text-classification pipeline; it must agree with the above.
    pipe = pipeline("text-classification", model=str(DISTIL), tokenizer=str(DISTIL), top_k=None, device="cpu")
    for text, row in zip(EMOTION_TEXTS, probs):
        res = pipe([text], truncation=True, max_length=512)[0]
        got = {d["label"]: d["score"] for d in res}
        err = max(abs(got[l] - row[i]) for i, l in enumerate(labels))
        assert err < 1e-5, f"pipeline differs by {err} on {text[:30]!r}"

    def dist(text):
        lg = classify([text])[0]
        e = np.exp(lg - lg.max())
        return e / e.sum()

    def polarity(reply, history):
        if not history:
            return 0.0
        a = dist(reply)
        b = np.mean([dist(h) for h in history], axis=0)
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    dialogues = []
    for i, (reply, history) in enumerate(DIALOGUES):
        pol = polarity(reply, history)
        sentiment = -0.5 + 0.3 * i  # stand-in for VADER; empathy is their plain mean
        dialogues.append({"reply": reply, "history": history, "emotion_polarity": pol,
                          "sentiment_polarity": sentiment, "empathy": (pol + sentiment) / 2})
    n_tokens = [len(tok(t, truncation=True, max_length=512)["input_ids"]) for t in EMOTION_TEXTS]
    return {"model": "tiny-distilbert-emotion", "labels": labels, "texts": EMOTION_TEXTS,
            "n_tokens": n_tokens, "logits": logits.tolist(), "probs": probs.tolist(),
            "dialogues": dialogues}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    bs = bertscore_goldens()
    (OUT / "bertscore.json").write_text(json.dumps(bs, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    pol = polarity_goldens()
    (OUT / "polarity.json").write_text(json.dumps(pol, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    f = bs["plain"][str(MAIN_LAYER)]["F"]
    print(f"bertscore: {len(PAIRS)} pairs, layer-{MAIN_LAYER} F1 range [{min(f):.4f}, {max(f):.4f}]")
    print(f"polarity: {len(EMOTION_TEXTS)} texts, polarities "
          f"{[round(d['emotion_polarity'], 4) for d in pol['dialogues']]}")


if __name__ == "__main__":
    main()
