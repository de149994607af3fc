//! The host sampler ranks only the head of the vocabulary it walks; it must pick exactly what
//! sorting the whole row picks. The reference below is the sampler as it was (full sort, then
//! top-k, top-p and one draw), run on the same seeded stream of draws.

use merg::generate::{Sampler, SamplingParams};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The full-sort sampler: order by value desc then id asc, top-k, normalise, top-p, draw.
fn reference(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> u32 {
    let inv_t = 1.0 / p.temperature as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if p.top_k > 0 {
        idx.truncate(p.top_k);
    }
    let max = logits[idx[0] as usize] * inv_t;
    let mut probs: Vec<f64> = idx.iter().map(|&i| ((logits[i as usize] * inv_t - max) as f64).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= total);
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (n, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= p.top_p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (n, q) in probs.iter().enumerate() {
        r -= q;
        if r <= 0.0 {
            return idx[n];
        }
    }
    *idx.last().unwrap()
}

/// Logits like a model's: a long tail, a few likely tokens, and ties (quantized values).
fn row(vocab: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..vocab)
        .map(|_| {
            let x = rng.random::<f32>() * 8.0 - 4.0 + if rng.random::<f32>() < 0.01 { 9.0 } else { 0.0 };
            (x * 16.0).round() / 16.0
        })
        .collect()
}

#[test]
fn ranking_the_head_picks_what_a_full_sort_picks() {
    let mut gen = StdRng::seed_from_u64(2024);
    let mut picks = std::collections::HashSet::new();
    let mut deepest = 0;
    for case in 0..240u64 {
        let vocab = [7, 64, 65, 300, 5000, 20_000][case as usize % 6];
        let p = SamplingParams {
            temperature: [0.3, 0.7, 1.0, 2.5][case as usize % 4],
            top_p: [1.0, 0.9, 0.5, 0.999][(case / 4) as usize % 4],
            top_k: [0, 0, 1, 40, 100_000][(case / 16) as usize % 5],
            seed: case,
            ..Default::default()
        };
        let logits = row(vocab, &mut gen);
        let mut sampler = Sampler::new(p.clone());
        let mut rng = StdRng::seed_from_u64(case);
        // Several draws from one seed: the streams must stay in step.
        for draw in 0..3 {
            let (got, _) = sampler.sample_row(&logits, None).unwrap();
            let want = reference(&logits, &p, &mut rng);
            assert_eq!(got, want, "case {case} draw {draw}: vocab {vocab}, {p:?}");
            picks.insert((vocab, got));
            // Its place in the order: how many tokens come before it.
            let g = logits[got as usize];
            deepest = deepest.max(logits.iter().enumerate().filter(|&(i, &x)| x > g || (x == g && (i as u32) < got)).count());
        }
    }
    // The cases reach many tokens, and past the first heads ranked (64, then 256).
    assert!(picks.len() > 200 && deepest > 256, "{} picks, deepest rank {deepest}", picks.len());
}
