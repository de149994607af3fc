#!/usr/bin/env python3
"""Goldens for src/metrics (distinct-n, classification, VADER) from reference implementations.

Writes tests/fixtures/goldens/metrics/{vader,distinct,classification}.json from made-up
sentences, and vader_meld.json / distinct_meld.json holding only MELD row ids and numbers
(the MELD text itself is not copied: tests read it from $MERG_DATA_DIR/meld when present).

    python3 -m venv /work/venv-data && /work/venv-data/bin/pip install vaderSentiment==3.3.2 scikit-learn==1.9.1
    /work/venv-data/bin/python scripts/make_metric_goldens.py

Deterministic: fixed seeds, sorted keys.
"""
import csv
import json
import os
import random
import re
import sys
from pathlib import Path

import sklearn
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support
from vaderSentiment import vaderSentiment as vs
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/goldens/metrics"
DATA = Path(os.environ.get("MERG_DATA_DIR", ROOT / "../shared/data"))
VADER_VERSION = "3.3.2"


def normalize_apostrophes(text):
    return text.replace("\u2019", "'").replace("\u2018", "'")


# ---- distinct-n: the reference definition (Li et al. 2016), written out plainly ----
def tokenize(text):
    return re.findall(r"[\w']+|[^\w\s]", normalize_apostrophes(text.lower()))


def ngrams(tokens, n):
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def corpus_ratio(token_lists, n):
    grams = [g for t in token_lists for g in ngrams(t, n)]
    return len(set(grams)) / len(grams) if grams else None


def distinct(replies, mode, size=None):
    toks = [tokenize(r) for r in replies]
    if mode == "corpus":
        groups = [toks]
    elif mode == "per_response":
        groups = [[t] for t in toks]
    else:
        groups = [toks[i : i + size] for i in range(0, len(toks), size)]
        if len(groups) > 1 and len(groups[-1]) < size:
            groups.pop()
    out = {}
    for n in (1, 2):
        rs = [corpus_ratio(g, n) for g in groups]
        rs = [r for r in rs if r is not None] if mode == "per_response" else [r or 0.0 for r in rs]
        out[f"distinct_{n}"] = sum(rs) / len(rs) if rs else 0.0
    return out


SENTENCES = [
    "VADER is smart, handsome, and funny.",
    "VADER is smart, handsome, and funny!",
    "VADER is very smart, handsome, and funny.",
    "VADER is VERY SMART, handsome, and FUNNY.",
    "VADER is VERY SMART, handsome, and FUNNY!!!",
    "VADER is VERY SMART, uber handsome, and FRIGGIN FUNNY!!!",
    "VADER is not smart, handsome, nor funny.",
    "The book was good.",
    "At least it isn't a horrible book.",
    "At least it isn’t a horrible book.",
    "The book was only kind of good.",
    "The plot was good, but the characters are uncompelling and the dialog is not great.",
    "Today SUX!",
    "Today only kinda sux! But I'll get by, lol",
    "Make sure you :) or :D today!",
    "Catch utf-8 emoji such as 💘 and 💋 and 😁",
    "Not bad at all",
    "I don't love you.",
    "I don’t love you.",
    "I don‘t love you.",
    "You’re not my friend, you’re my BEST friend!",
    "I can’t believe you did that...",
    "Oh my God, I’m so happy for you!",
    "What the hell is wrong with you?!",
    "I never said I hated it, but I didn’t like it either.",
    "That’s the worst idea ever.",
    "That was kind of great, but also really sad.",
    "Great. Just great.",
    "No.",
    "Yes!",
    "Hey.",
    "",
    "   ",
    "Ugh :( I'm so tired",
    "This is sort of okay I guess",
    "He is NOT happy about it.",
    "Without a doubt, it's the best thing that happened.",
    "kiss of death for the whole plan",
    "the shit hit the fan",
    "It was the bomb!",
    "I least expected that to work.",
    "Nothing is wrong, everything is fine.",
    "Don’t you dare cry, it’s gonna be okay.",
    "Wow… that’s — honestly — amazing.",
    "“I love it,” she said.",
    "Seriously??? You forgot AGAIN?",
    "lol that's hilarious",
    "I’m fine. Really. I’m FINE.",
    "Joey, you’re the sweetest guy, but no.",
    "I am not unhappy.",
    "never so good",
    "this isn't bad, but it's not good either",
    "Well, thank you very much!",
    "Sorry, sorry, I am so sorry.",
]


def vader_goldens(an):
    rows = []
    for s in SENTENCES:
        rows.append({
            "text": s,
            "compound_raw": an.polarity_scores(s)["compound"],
            "compound": an.polarity_scores(normalize_apostrophes(s))["compound"],
        })
    return rows


def read_meld(path):
    with open(path, encoding="utf-8", newline="") as f:
        return [r for r in csv.DictReader(f)]


def classification_goldens():
    rng = random.Random(5)
    labels = ["neutral", "joy", "surprise", "anger", "sadness", "disgust", "fear"]
    cases = []
    for name, n, invalid_rate, gold_labels in [
        ("meld7", 300, 0.05, labels),
        # fear never appears in gold nor pred: its row/column is empty (zero_division = 0).
        ("absent_class", 80, 0.0, labels[:6]),
        ("tiny", 5, 0.2, labels[:3]),
    ]:
        gold = [rng.choice(gold_labels) for _ in range(n)]
        pred = []
        for g in gold:
            u = rng.random()
            if u < invalid_rate:
                pred.append("none")
            elif u < 0.55:
                pred.append(g)
            else:
                pred.append(rng.choice(gold_labels))
        p, r, f, s = precision_recall_fscore_support(gold, pred, labels=labels, zero_division=0)
        mp, mr, mf, _ = precision_recall_fscore_support(gold, pred, labels=labels, average="macro", zero_division=0)
        cases.append({
            "name": name,
            "labels": labels,
            "gold": gold,
            "pred": pred,
            "accuracy": accuracy_score(gold, pred),
            "precision": list(map(float, p)),
            "recall": list(map(float, r)),
            "f1": list(map(float, f)),
            "support": list(map(int, s)),
            "macro_precision": float(mp),
            "macro_recall": float(mr),
            "macro_f1": float(f1_score(gold, pred, labels=labels, average="macro", zero_division=0)),
            "weighted_f1": float(f1_score(gold, pred, labels=labels, average="weighted", zero_division=0)),
            "confusion": confusion_matrix(gold, pred, labels=labels).tolist(),
        })
        assert abs(cases[-1]["macro_f1"] - mf) < 1e-12
    return cases


def dump(name, obj):
    path = OUT / name
    text = json.dumps(obj, indent=1, ensure_ascii=False, sort_keys=True)
    if "rows" in obj:  # one compact row per line keeps the big table small and diffable
        rows = ",\n".join("  " + json.dumps(r) for r in obj["rows"])
        text = json.dumps({**obj, "rows": "@ROWS@"}, indent=1, ensure_ascii=False, sort_keys=True)
        text = text.replace('"@ROWS@"', "[\n" + rows + "\n ]")
    path.write_text(text + "\n", encoding="utf-8")
    print("wrote", path.relative_to(ROOT))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    an = SentimentIntensityAnalyzer()
    versions = {"vaderSentiment": VADER_VERSION, "scikit-learn": sklearn.__version__, "python": sys.version.split()[0]}
    dump("vader.json", {"versions": versions, "sentences": vader_goldens(an)})

    made_up = [s for s in SENTENCES if s.strip()] + ["", "ok ok ok", "I'm fine, I'm fine."]
    modes = [("corpus", None), ("per_response", None), ("chunked", 10), ("chunked", 7), ("chunked", 1000)]
    dump("distinct.json", {
        "versions": versions,
        "replies": made_up,
        "tokens": [tokenize(s) for s in made_up],
        "scores": [{"mode": m, "size": k, **distinct(made_up, m, k)} for m, k in modes],
    })
    dump("classification.json", {"versions": versions, "cases": classification_goldens()})

    meld = DATA / "meld" / "test_sent_emo.csv"
    if not meld.exists():
        print(f"{meld} absent: MELD goldens not regenerated")
        return
    rows = read_meld(meld)
    dump("vader_meld.json", {
        "versions": versions,
        "file": "meld/test_sent_emo.csv",
        "fields": ["Dialogue_ID", "Utterance_ID", "compound_raw", "compound"],
        "rows": [
            [int(r["Dialogue_ID"]), int(r["Utterance_ID"]),
             an.polarity_scores(r["Utterance"])["compound"],
             an.polarity_scores(normalize_apostrophes(r["Utterance"]))["compound"]]
            for r in rows
        ],
    })
    utts = [r["Utterance"] for r in rows]  # file order
    dump("distinct_meld.json", {
        "versions": versions,
        "file": "meld/test_sent_emo.csv",
        "replies": "every Utterance in file order",
        "scores": [{"mode": m, "size": k, **distinct(utts, m, k)} for m, k in [("corpus", None), ("per_response", None), ("chunked", 100)]],
    })


if __name__ == "__main__":
    main()
