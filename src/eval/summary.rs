//! Corpus numbers from a set of records, shaped like the MERG paper's Table 1 (PPL, Dist-1,
//! Dist-2, Acc, P, R, F1) plus polarity. Computed from the records alone, in dataset order, so
//! an interrupted-and-resumed run, a sharded-and-merged run and an uninterrupted run give the
//! same summary.

use anyhow::Result;
use serde::{Deserialize, Serialize};

use super::record::Record;
use crate::metrics::classification::{self, ClassificationReport};
use crate::metrics::distinct::{self, DistinctMode, DistinctScores};
use crate::metrics::ppl::{self, PplSummary};

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub items: usize,
    /// Items the pipeline failed on (no reply; left out of every metric below).
    pub failed: usize,
    /// Items whose forecast is missing (CAEF ablated or unusable): counted as wrong in `acc`.
    pub no_forecast: usize,
    pub ppl: Option<PplSummary>,
    pub distinct: DistinctScores,
    /// None when no item has a forecast (e.g. --no-caef or the plain baseline).
    pub emotion: Option<ClassificationReport>,
    /// Mean BERTScore (P, R, F1); None when BERTScore was off.
    pub bertscore: Option<[f64; 3]>,
    pub polarity_emotion: Option<f64>,
    pub polarity_sentiment: f64,
    pub empathy: Option<f64>,
    /// Histogram of the selected round (index = round).
    pub selected_rounds: Vec<usize>,
    pub mean_rounds: f64,
    /// How the run went, not what it produced: depends on cache warmth, so it differs between
    /// an interrupted-and-resumed run and an uninterrupted one.
    pub engine: EngineSummary,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineSummary {
    pub agent_calls: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Share of prompt tokens served from the prefix cache.
    pub cache_hit_fraction: f64,
    pub generated_tokens: usize,
    /// Sum of per-item wall times (ms).
    pub item_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SummaryOptions {
    /// Distinct-n over chunks of this many replies (None: corpus-level over all replies).
    pub distinct_chunk: Option<usize>,
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

impl Summary {
    /// `records` in any order; `labels` is the label set forecasts are scored over.
    pub fn compute(records: &[Record], labels: &[String], opts: &SummaryOptions) -> Result<Summary> {
        let mut rs: Vec<&Record> = records.iter().collect();
        rs.sort_by_key(|r| r.index);
        let ok: Vec<&Record> = rs.iter().copied().filter(|r| r.error.is_none()).collect();
        let lps: Vec<&[f32]> = ok.iter().map(|r| r.metrics.reply_logprobs.as_slice()).collect();
        let ppl = if lps.iter().any(|l| !l.is_empty()) { Some(ppl::summarize(&lps)?) } else { None };
        let replies: Vec<&str> = ok.iter().map(|r| r.reply.as_str()).collect();
        let mode = match opts.distinct_chunk {
            Some(size) => DistinctMode::Chunked { size },
            None => DistinctMode::Corpus,
        };
        let distinct = distinct::distinct(&replies, mode)?;
        let no_forecast = ok.iter().filter(|r| r.forecast.is_none()).count();
        let emotion = if no_forecast < ok.len() {
            let gold: Vec<&str> = ok.iter().map(|r| r.gold.as_str()).collect();
            // A missing forecast can match no label: it counts as wrong.
            let pred: Vec<&str> = ok.iter().map(|r| r.forecast.as_deref().unwrap_or("<none>")).collect();
            Some(classification::evaluate(&gold, &pred, labels)?)
        } else {
            None
        };
        let bs: Vec<[f64; 3]> = ok.iter().filter_map(|r| r.metrics.bertscore).collect();
        let bertscore = (!bs.is_empty()).then(|| {
            let n = bs.len() as f64;
            [0, 1, 2].map(|k| bs.iter().map(|s| s[k]).sum::<f64>() / n)
        });
        let max_round = ok.iter().map(|r| r.trace.selected_round).max().unwrap_or(0);
        let mut selected_rounds = vec![0; max_round + 1];
        ok.iter().for_each(|r| selected_rounds[r.trace.selected_round] += 1);
        let prompt: usize = ok.iter().map(|r| r.trace.prompt_tokens).sum();
        let cached: usize = ok.iter().map(|r| r.trace.cached_tokens).sum();
        let engine = EngineSummary {
            agent_calls: ok.iter().map(|r| r.trace.calls).sum(),
            prompt_tokens: prompt,
            cached_tokens: cached,
            cache_hit_fraction: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            generated_tokens: ok.iter().map(|r| r.trace.generated_tokens).sum(),
            item_ms: ok.iter().map(|r| r.trace.ms).sum(),
        };
        Ok(Summary {
            items: rs.len(),
            failed: rs.len() - ok.len(),
            no_forecast,
            ppl,
            distinct,
            emotion,
            bertscore,
            polarity_emotion: mean(ok.iter().filter_map(|r| r.metrics.emotion_polarity)),
            polarity_sentiment: mean(ok.iter().map(|r| r.metrics.sentiment_polarity)).unwrap_or(0.0),
            empathy: mean(ok.iter().filter_map(|r| r.metrics.empathy)),
            selected_rounds,
            mean_rounds: mean(ok.iter().map(|r| r.trace.rounds as f64)).unwrap_or(0.0),
            engine,
        })
    }

    /// The Table-1 row and the polarity row, as markdown cells (no header).
    pub fn table_cells(&self) -> Vec<String> {
        let f = |x: Option<f64>, scale: f64| x.map(|v| format!("{:.2}", v * scale)).unwrap_or_else(|| "–".into());
        vec![
            f(self.ppl.as_ref().map(|p| p.corpus_ppl), 1.0),
            f(Some(self.distinct.distinct_1), 100.0),
            f(Some(self.distinct.distinct_2), 100.0),
            f(self.emotion.as_ref().map(|e| e.accuracy), 100.0),
            f(self.bertscore.map(|b| b[0]), 100.0),
            f(self.bertscore.map(|b| b[1]), 100.0),
            f(self.bertscore.map(|b| b[2]), 100.0),
            f(self.polarity_emotion, 1.0),
            f(Some(self.polarity_sentiment), 1.0),
            f(self.empathy, 1.0),
        ]
    }

    pub const HEADER: [&'static str; 10] =
        ["PPL", "Dist-1", "Dist-2", "Acc", "P", "R", "F1", "Pol-emotion", "Pol-sentiment", "Empathy"];

    pub fn to_markdown(&self, name: &str) -> String {
        let mut s = table_header();
        s.push_str(&format!("| {name} | {} |\n", self.table_cells().join(" | ")));
        s.push_str(&format!(
            "\n{} items, {} failed, {} without a forecast. PPL: corpus-level exp(−Σ log p / Σ tokens) over reply tokens. Distinct-n: {}. Acc, P/R/F1 (BERTScore) and Dist-n in %.\n",
            self.items,
            self.failed,
            self.no_forecast,
            match self.distinct.mode {
                DistinctMode::Chunked { size } => format!("corpus-level within chunks of {size} replies, averaged"),
                DistinctMode::Corpus => "corpus-level over all replies".into(),
                DistinctMode::PerResponse => "mean per reply".into(),
            }
        ));
        s
    }
}

pub fn table_header() -> String {
    format!(
        "| run | {} |\n|---|{}\n",
        Summary::HEADER.join(" | "),
        Summary::HEADER.iter().map(|_| "---|").collect::<String>()
    )
}
