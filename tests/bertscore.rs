//! BERTScore and emotion polarity against goldens from scripts/make_bertscore_goldens.py
//! (bert-score 0.3.13 and transformers on the tiny random checkpoints of
//! scripts/make_encoder_checkpoints.py).

mod common;

use candle_core::Device;
use merg::metrics::bertscore::{default_num_layers, Baseline, BertScorer, Score};
use merg::metrics::polarity::{empathy, EmotionClassifier};
use merg::metrics::encoder::{EncoderCheckpoint, Encoder};
use serde_json::Value;

const TOL: f64 = 1e-4;

fn goldens(name: &str) -> Value {
    let p = common::fixtures().join("goldens/bertscore").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn roberta() -> String {
    common::fixtures().join("tiny-roberta").display().to_string()
}

fn distilbert() -> String {
    common::fixtures().join("tiny-distilbert-emotion").display().to_string()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// Max |ours - golden| over P, R and F; panics above TOL.
fn check(what: &str, ours: &[Score], golden: &Value) -> f64 {
    let (p, r, f) = (floats(&golden["P"]), floats(&golden["R"]), floats(&golden["F"]));
    assert_eq!(ours.len(), p.len(), "{what}: count");
    let mut worst = 0f64;
    for (i, s) in ours.iter().enumerate() {
        for (name, a, b) in [("P", s.precision, p[i]), ("R", s.recall, r[i]), ("F", s.f1, f[i])] {
            let e = (a - b).abs();
            assert!(e <= TOL, "{what}: pair {i} {name}: ours {a} vs bert-score {b}");
            worst = worst.max(e);
        }
    }
    eprintln!("{what}: max abs error {worst:.2e}");
    worst
}

fn max_diff(a: &Value, b: &Value) -> f64 {
    floats(a).iter().zip(floats(b)).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn tokenization_matches_bert_score() {
    let g = goldens("bertscore.json");
    let s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    let ids = g["token_ids"].as_object().unwrap();
    assert!(ids.len() >= 40);
    for (sent, want) in ids {
        let want: Vec<u32> = want.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(s.encode(sent).unwrap(), want, "token ids of {sent:?}");
    }
    // The long sentence is truncated to model_max_length (512), special tokens kept.
    let long = g["cands"][20].as_str().unwrap();
    let ids = s.encode(long).unwrap();
    assert_eq!(ids.len(), 512);
    assert_eq!((ids[0], ids[511]), (0, 2));
}

#[test]
fn hidden_states_match_transformers() {
    let g = goldens("bertscore.json");
    let ck = EncoderCheckpoint::load(&roberta(), &Device::Cpu).unwrap();
    let enc = Encoder::load(&ck.config, Some(2), ck.base_vb().unwrap()).unwrap();
    let s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    let mut worst = 0f32;
    for (sent, want) in g["hidden_states"].as_object().unwrap() {
        let ids = s.encode(sent).unwrap();
        // Batched with a longer sequence, so this one is padded: padding must not matter.
        let other = s.encode(g["cands"][19].as_str().unwrap()).unwrap();
        assert!(other.len() > ids.len());
        let hs = enc.hidden_states(&[&other, &ids], 2).unwrap();
        let ours: Vec<Vec<f32>> = hs.get(1).unwrap().narrow(0, 0, ids.len()).unwrap().to_vec2().unwrap();
        let want = want.as_array().unwrap();
        assert_eq!(ours.len(), want.len());
        for (o, w) in ours.iter().zip(want) {
            for (a, b) in o.iter().zip(w.as_array().unwrap()) {
                worst = worst.max((a - b.as_f64().unwrap() as f32).abs());
            }
        }
    }
    eprintln!("layer-2 hidden states: max abs error {worst:.2e}");
    assert!(worst <= 1e-4, "hidden states differ by {worst}");
    assert!(enc.hidden_states(&[&[0, 2]], 3).is_err(), "only 2 layers loaded");
}

#[test]
fn scores_match_bert_score_at_each_layer() {
    let g = goldens("bertscore.json");
    let (cands, refs) = (strings(&g["cands"]), strings(&g["refs"]));
    assert!(cands.len() >= 20);
    for layer in ["1", "2", "3"] {
        let s = BertScorer::load(&roberta(), Some(layer.parse().unwrap()), &Device::Cpu).unwrap();
        check(&format!("layer {layer}"), &s.score(&cands, &refs).unwrap(), &g["plain"][layer]);
    }
}

#[test]
fn layer_goldens_differ_so_off_by_one_fails() {
    // Parity at layer 2 can only catch an off-by-one layer index if layers 1 and 3 give
    // clearly different scores.
    let g = goldens("bertscore.json");
    for other in ["1", "3"] {
        let d = max_diff(&g["plain"]["2"]["F"], &g["plain"][other]["F"]);
        assert!(d > 1e-2, "layer 2 vs {other}: goldens differ by only {d}");
    }
    let (cands, refs) = (strings(&g["cands"]), strings(&g["refs"]));
    let s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    let ours: Vec<f64> = s.score(&cands, &refs).unwrap().iter().map(|x| x.f1).collect();
    let d3 = ours.iter().zip(floats(&g["plain"]["3"]["F"])).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    assert!(d3 > 1e-2, "layer-2 scores match the layer-3 golden");
}

#[test]
fn rescaled_and_idf_scores_match() {
    let g = goldens("bertscore.json");
    let (cands, refs) = (strings(&g["cands"]), strings(&g["refs"]));
    let baseline = common::fixtures().join("goldens/bertscore").join(g["baseline_file"].as_str().unwrap());
    let mut s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    let idf = s.idf_from_refs(&refs).unwrap();
    check("idf", &s.score_with_idf(&cands, &refs, Some(&idf)).unwrap(), &g["idf"]);
    s.set_baseline_file(&baseline).unwrap();
    check("rescaled", &s.score(&cands, &refs).unwrap(), &g["rescaled"]);
    check("idf rescaled", &s.score_with_idf(&cands, &refs, Some(&idf)).unwrap(), &g["idf_rescaled"]);
    // Rescaling really changes the numbers (the check above could not pass with raw scores).
    assert!(max_diff(&g["rescaled"]["F"], &g["plain"]["2"]["F"]) > 1e-2);
    assert!(max_diff(&g["idf"]["F"], &g["plain"]["2"]["F"]) > 1e-3);
    let b = Baseline::from_file(&baseline, 2).unwrap();
    assert!((b.p - 0.4).abs() < 1e-6 && (b.f - 0.401).abs() < 1e-6);
}

#[test]
fn multi_reference_takes_the_best() {
    let g = goldens("bertscore.json");
    let m = &g["multi"];
    let cands = strings(&m["cands"]);
    let refs: Vec<Vec<String>> = m["refs"].as_array().unwrap().iter().map(strings).collect();
    let s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    check("multi-reference", &s.score_multi(&cands, &refs, None).unwrap(), m);
}

#[test]
fn batching_does_not_change_scores() {
    let g = goldens("bertscore.json");
    let (cands, refs) = (strings(&g["cands"]), strings(&g["refs"]));
    let mut s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    let full = s.score(&cands, &refs).unwrap();
    for bs in [1, 3] {
        s.set_batch_size(bs);
        let got = check(&format!("batch size {bs}"), &s.score(&cands, &refs).unwrap(), &g["plain"]["2"]);
        assert!(got <= TOL);
        let again = s.score(&cands, &refs).unwrap();
        for (a, b) in again.iter().zip(&full) {
            assert!((a.f1 - b.f1).abs() < 1e-5, "batch size {bs}: {} vs {}", a.f1, b.f1);
        }
    }
    // Scoring a pair alone gives the same as scoring it among others.
    let one = s.score(&cands[3..4], &refs[3..4]).unwrap();
    assert!((one[0].f1 - full[3].f1).abs() < 1e-5);
}

#[test]
fn empty_sentences_score_zero_like_bert_score() {
    let g = goldens("bertscore.json");
    let s = BertScorer::load(&roberta(), Some(2), &Device::Cpu).unwrap();
    // Pair 5 has an empty candidate, pair 6 a whitespace-only reference.
    let out = s.score(&strings(&g["cands"])[5..7], &strings(&g["refs"])[5..7]).unwrap();
    for sc in out {
        assert_eq!((sc.precision, sc.recall, sc.f1), (0.0, 0.0, 0.0));
    }
    assert_eq!(s.encode(" \t\n").unwrap(), vec![0, 2]);
}

#[test]
fn bertscore_errors_are_clear() {
    let dev = Device::Cpu;
    let err = |r: anyhow::Result<BertScorer>| format!("{:#}", r.err().expect("should fail"));
    let e = err(BertScorer::load(&roberta(), None, &dev));
    assert!(e.contains("no default layer") && e.contains("num_layers"), "{e}");
    let e = err(BertScorer::load(&roberta(), Some(5), &dev));
    assert!(e.contains("4 layers"), "{e}");
    let e = err(BertScorer::load("/nonexistent/tiny-roberta", Some(1), &dev));
    assert!(e.contains("does not exist"), "{e}");
    let qwen = common::tiny_dir("qwen2_vl").display().to_string();
    let e = err(BertScorer::load(&qwen, Some(1), &dev));
    assert!(e.contains("qwen2_vl") && e.contains("not a supported encoder"), "{e}");

    let s = BertScorer::load(&roberta(), Some(2), &dev).unwrap();
    assert!(s.score(&["a", "b"], &["a"]).is_err());
    assert!(s.score_multi(&["a"], &[Vec::<&str>::new()], None).is_err());
    assert!(s.score::<&str, &str>(&[], &[]).unwrap().is_empty());

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("b.tsv");
    std::fs::write(&bad, "LAYER,P,R,F\n0,0.1,0.2,0.3\n").unwrap();
    let e = format!("{:#}", Baseline::from_file(&bad, 2).unwrap_err());
    assert!(e.contains("no row for layer 2") && e.contains("b.tsv"), "{e}");
    std::fs::write(&bad, "layer;p;r;f\n").unwrap();
    assert!(format!("{:#}", Baseline::from_file(&bad, 0).unwrap_err()).contains("header"));
    std::fs::write(&bad, "LAYER,P,R,F\n0,x,0.2,0.3\n").unwrap();
    assert!(format!("{:#}", Baseline::from_file(&bad, 0).unwrap_err()).contains("not a number"));
    assert!(Baseline::from_file(&dir.path().join("missing.tsv"), 0).is_err());
}

#[test]
fn default_layers_follow_bert_score() {
    assert_eq!(default_num_layers("roberta-large"), Some(17));
    assert_eq!(default_num_layers("/models/roberta-large/"), Some(17));
    assert_eq!(default_num_layers("microsoft/deberta-xlarge-mnli"), Some(40));
    assert_eq!(default_num_layers("distilbert-base-uncased"), Some(5));
    assert_eq!(default_num_layers("bert-base-uncased"), Some(9));
    assert_eq!(default_num_layers("my-own-model"), None);
}

#[test]
fn emotion_logits_match_transformers() {
    let g = goldens("polarity.json");
    let c = EmotionClassifier::load(&distilbert(), &Device::Cpu).unwrap();
    assert_eq!(c.labels(), strings(&g["labels"]).as_slice());
    let texts = strings(&g["texts"]);
    assert!(texts.len() >= 10);
    for (t, n) in texts.iter().zip(g["n_tokens"].as_array().unwrap()) {
        assert_eq!(c.encode(t).unwrap().len() as u64, n.as_u64().unwrap(), "token count of {t:.30}");
    }
    let logits = c.logits(&texts).unwrap();
    let probs = c.probabilities(&texts).unwrap();
    let (mut wl, mut wp) = (0f64, 0f64);
    for i in 0..texts.len() {
        let (gl, gp) = (floats(&g["logits"][i]), floats(&g["probs"][i]));
        for k in 0..gl.len() {
            wl = wl.max((logits[i][k] as f64 - gl[k]).abs());
            wp = wp.max((probs[i][k] - gp[k]).abs());
        }
    }
    eprintln!("emotion logits: max abs error {wl:.2e}; probabilities {wp:.2e}");
    assert!(wl <= TOL && wp <= TOL, "logits {wl}, probabilities {wp}");
}

#[test]
fn emotion_polarity_and_empathy_match() {
    let g = goldens("polarity.json");
    let c = EmotionClassifier::load(&distilbert(), &Device::Cpu).unwrap();
    let mut worst = 0f64;
    let mut seen = Vec::new();
    for d in g["dialogues"].as_array().unwrap() {
        let history = strings(&d["history"]);
        let pol = c.emotion_polarity(d["reply"].as_str().unwrap(), &history).unwrap();
        let want = d["emotion_polarity"].as_f64().unwrap();
        worst = worst.max((pol - want).abs());
        let emp = empathy(pol, d["sentiment_polarity"].as_f64().unwrap());
        worst = worst.max((emp - d["empathy"].as_f64().unwrap()).abs());
        seen.push(want);
    }
    eprintln!("emotion polarity / empathy: max abs error {worst:.2e}");
    assert!(worst <= TOL, "polarity off by {worst}");
    // The goldens span a real range (a constant classifier would make this test meaningless).
    let nonzero: Vec<f64> = seen.iter().copied().filter(|&x| x != 0.0).collect();
    let spread = nonzero.iter().copied().fold(f64::MIN, f64::max) - nonzero.iter().copied().fold(f64::MAX, f64::min);
    assert!(spread > 0.3, "polarity goldens nearly constant ({spread})");
}

#[test]
fn classifier_errors_are_clear() {
    let e = format!("{:#}", EmotionClassifier::load(&roberta(), &Device::Cpu).err().unwrap());
    assert!(e.contains("id2label"), "{e}");
    let e = format!("{:#}", EmotionClassifier::load("/nonexistent/emotion", &Device::Cpu).err().unwrap());
    assert!(e.contains("does not exist"), "{e}");
}
