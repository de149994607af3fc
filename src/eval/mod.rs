//! `merg eval`: the pipeline over a dataset split, one JSONL record per item as soon as it is
//! done, resumable, shardable, mergeable; and the exemplar memory the pipeline retrieves from.
//!
//! Reproducibility: each item's sampling seed is derived from (run seed, item key), so an item's
//! result does not depend on which run, shard or worker computed it or in what order. The
//! summary is computed from the records alone, in dataset order.
//!
//! Files in `--out`: `config.json` (what was run: dataset, split, model, pipeline and metric
//! settings, seed; a resume with different settings is refused), `results.jsonl` (append-only;
//! a later line for the same key supersedes an earlier failed one), `summary.json`,
//! `summary.md`.

pub mod record;
pub mod summary;

use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::data::Item;
use crate::metrics::bertscore::BertScorer;
use crate::metrics::polarity::{self, EmotionClassifier};
use crate::metrics::{ppl, sentiment};
use crate::pipeline::frames::{self, FrameOptions, FrameReport};
use crate::pipeline::hearing::{self, AudioReport, Clip};
use crate::pipeline::model::AgentModel;
use crate::pipeline::prompt::Prompts;
use crate::pipeline::retrieval::{context_text, Exemplar, Memory};
use crate::pipeline::{Pipeline, PipelineConfig};
use record::{ItemMetrics, Record, TraceSummary};
use summary::{Summary, SummaryOptions};

/// Everything that determines the results; stored as config.json and checked on resume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    pub dataset: String,
    pub split: String,
    pub data_dir: PathBuf,
    pub video_root: Option<PathBuf>,
    pub model: String,
    pub revision: Option<String>,
    pub pipeline: PipelineConfig,
    pub frames_per_turn: usize,
    pub max_frames: usize,
    #[serde(default = "default_max_audio")]
    pub max_audio: usize,
    pub memory: Option<PathBuf>,
    pub limit: Option<usize>,
    /// (k, n): this run does items with index % n == k − 1.
    pub shard: Option<(usize, usize)>,
    pub bertscore_model: Option<String>,
    pub bertscore_layers: Option<usize>,
    pub bertscore_baseline: Option<PathBuf>,
    pub emotion_model: Option<String>,
    pub summary: SummaryOptions,
    /// Items in the (limited) dataset before sharding.
    pub total_items: usize,
    pub merg_version: String,
}

fn default_max_audio() -> usize {
    crate::pipeline::hearing::DEFAULT_MAX_AUDIO
}

/// Optional learned metrics (they need their own checkpoints).
#[derive(Default)]
pub struct Scorers {
    pub bertscore: Option<BertScorer>,
    pub emotion: Option<EmotionClassifier>,
}

/// "K/N" with 1 ≤ K ≤ N.
pub fn parse_shard(s: &str) -> Result<(usize, usize), crate::setting::InvalidSetting> {
    let bad = || crate::setting::InvalidSetting::new("shard", s, "K/N with 1 ≤ K ≤ N, e.g. 2/8");
    let (k, n) = s.split_once('/').ok_or_else(bad)?;
    let (k, n): (usize, usize) = (k.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
    if n == 0 || k == 0 || k > n {
        return Err(bad());
    }
    Ok((k, n))
}

/// The items this run does: (index in the limited dataset, item).
pub fn select(items: Vec<Item>, limit: Option<usize>, shard: Option<(usize, usize)>) -> Vec<(usize, Item)> {
    let n = limit.unwrap_or(items.len()).min(items.len());
    items
        .into_iter()
        .take(n)
        .enumerate()
        .filter(|(i, _)| shard.is_none_or(|(k, n)| i % n == k - 1))
        .collect()
}

/// The dialogue an item key belongs to (`meld/test/dia3_utt4` → `meld/test/dia3`,
/// `iemocap/Ses05F_impro01_F003` → `iemocap/Ses05F_impro01`).
pub fn dialogue_of(key: &str) -> &str {
    key.rsplit_once('_').map(|(d, _)| d).unwrap_or(key)
}

/// Per-item seed: FNV-1a of the key mixed with the run seed (stable across builds).
pub fn item_seed(seed: u64, key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in key.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Exemplars from a held-out split: context = the last turns before each item, response =
/// the item's reference reply.
pub fn build_memory(items: &[Item]) -> Memory {
    Memory::new(
        items
            .iter()
            .map(|it| Exemplar {
                key: it.key.clone(),
                dialogue: dialogue_of(&it.key).to_string(),
                context: context_text(&it.dialogue),
                response: it.reference.clone(),
                emotion: Some(it.gold_emotion.clone()),
            })
            .collect(),
    )
}

/// Refuses a memory that contains any evaluated item or any of their dialogues.
pub fn check_memory_is_held_out(memory: &Memory, items: &[(usize, Item)]) -> Result<()> {
    let keys: HashSet<&str> = items.iter().map(|(_, it)| it.key.as_str()).collect();
    let dialogues: HashSet<&str> = items.iter().map(|(_, it)| dialogue_of(&it.key)).collect();
    if let Some(e) = memory.entries.iter().find(|e| keys.contains(e.key.as_str()) || dialogues.contains(e.dialogue.as_str())) {
        bail!(
            "the exemplar memory contains {} (dialogue {}), which is being evaluated: build it from a held-out split (MELD dev, IEMOCAP Session 2)",
            e.key,
            e.dialogue
        );
    }
    Ok(())
}

pub struct Evaluator<'a> {
    pub spec: &'a RunSpec,
    pub model: &'a dyn AgentModel,
    pub prompts: &'a Prompts,
    pub memory: Option<&'a Memory>,
    pub scorers: &'a Scorers,
}

impl Evaluator<'_> {
    /// Runs every item not yet done in `out`, appending records; returns the summary of all.
    /// Progress goes to the installed `progress` reporter, failed items as notes beside it.
    pub fn run(&self, items: &[(usize, Item)], out: &Path, concurrency: usize) -> Result<Summary> {
        prepare_out(out, self.spec)?;
        let path = out.join("results.jsonl");
        let done: HashSet<String> = read_records(&path)?.into_iter().filter(|r| r.error.is_none()).map(|r| r.key).collect();
        let todo: Vec<&(usize, Item)> = items.iter().filter(|(_, it)| !done.contains(&it.key)).collect();
        let bar = crate::progress::resumed("evaluating", Some(items.len() as u64), "items", (items.len() - todo.len()) as u64);
        let file = Mutex::new(OpenOptions::new().append(true).create(true).open(&path).with_context(|| format!("opening {}", path.display()))?);
        let next = AtomicUsize::new(0);
        let fatal: Mutex<Option<anyhow::Error>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..concurrency.max(1) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= todo.len() || fatal.lock().map(|f| f.is_some()).unwrap_or(true) {
                        return;
                    }
                    let (index, item) = todo[i];
                    let rec = self.item(*index, item);
                    let line = match serde_json::to_string(&rec) {
                        Ok(l) => l + "\n",
                        Err(e) => {
                            *fatal.lock().expect("lock") = Some(e.into());
                            return;
                        }
                    };
                    // One write per line: a kill leaves at most one partial last line, which the
                    // next run drops.
                    let res = file.lock().map_err(|_| anyhow::anyhow!("writer poisoned")).and_then(|mut f| {
                        f.write_all(line.as_bytes())?;
                        f.flush()?;
                        Ok(())
                    });
                    if let Err(e) = res {
                        *fatal.lock().expect("lock") = Some(e.context(format!("appending to {}", path.display())));
                        return;
                    }
                    bar.advance(1);
                    if let Some(e) = &rec.error {
                        bar.note(&format!("{}: failed: {e}", rec.key));
                    }
                });
            }
        });
        drop(bar);
        if let Some(e) = fatal.into_inner().expect("lock") {
            return Err(e);
        }
        write_summary(out, self.spec)
    }

    fn item(&self, index: usize, item: &Item) -> Record {
        let history: Vec<String> = item.dialogue.turns.iter().map(|t| t.text.clone()).collect();
        let mut rec = Record {
            key: item.key.clone(),
            index,
            gold: item.gold_emotion.clone(),
            forecast: None,
            reply: String::new(),
            reference: item.reference.clone(),
            history,
            speakers: item.dialogue.turns.iter().map(|t| t.speaker.clone()).collect(),
            error: None,
            trace: TraceSummary::default(),
            metrics: ItemMetrics::default(),
        };
        if let Err(e) = self.fill(item, &mut rec) {
            rec.error = Some(format!("{e:#}"));
        }
        rec
    }

    fn fill(&self, item: &Item, rec: &mut Record) -> Result<()> {
        let mut d = item.dialogue.clone();
        d.id = Some(dialogue_of(&item.key).to_string());
        let mut cfg = self.spec.pipeline.clone();
        cfg.sampling.seed = item_seed(cfg.sampling.seed, &item.key);
        // Dataset clips are often defective (MELD has missing and corrupt ones): such an item
        // runs text-only for that clip, and the trace notes say so.
        let opts = FrameOptions { frames_per_turn: self.spec.frames_per_turn, max_frames: self.spec.max_frames, max_audio: self.spec.max_audio, skip_bad_media: true };
        let mut report = FrameReport::default();
        let mut kf = frames::collect(&d, &opts, &mut report)?;
        if kf.is_empty() {
            // IEMOCAP: one recording of the whole dialog, cut before the answered turn.
            if let Some(r) = &item.recording {
                kf = frames::from_recording(&r.path, &r.turn_spans, r.target_span.0, &opts, &mut report)?;
            }
        }
        let (clips, audio) = self.hear(item, &d, &opts, cfg.use_audio)?;
        let p = Pipeline { model: self.model, prompts: self.prompts, memory: self.memory, cfg: &cfg };
        let t = p.respond_heard(&d, kf, report, clips, audio)?;
        rec.reply = t.reply.clone();
        rec.forecast = t.emotion.clone();
        rec.trace = TraceSummary::of(&t);
        let m = &mut rec.metrics;
        m.ppl = ppl::item_ppl(&t.reply_logprobs).ok();
        m.reply_logprobs = t.reply_logprobs;
        m.sentiment_polarity = sentiment::polarity(&rec.reply, &rec.history);
        if let Some(c) = &self.scorers.emotion {
            let e = c.emotion_polarity(&rec.reply, &rec.history)?;
            m.emotion_polarity = Some(e);
            m.empathy = Some(polarity::empathy(e, m.sentiment_polarity));
        }
        if let Some(b) = &self.scorers.bertscore {
            let s = b.score(&[rec.reply.as_str()], &[rec.reference.as_str()])?;
            m.bertscore = s.first().map(|s| [s.precision, s.recall, s.f1]);
        }
        Ok(())
    }
}

impl Evaluator<'_> {
    /// The item's audio: each turn's clip (MELD: the utterance's mp4 under the video root), or
    /// IEMOCAP's recording cut per history turn. Not decoded at all when hearing is off or the
    /// model does not hear (the pipeline then notes it).
    fn hear(&self, item: &Item, d: &crate::dialogue::Dialogue, opts: &FrameOptions, on: bool) -> Result<(Vec<Clip>, AudioReport)> {
        let mut report = AudioReport::default();
        if !on {
            return Ok((vec![], report));
        }
        if !self.model.hears() {
            report.notes.push("the model does not hear (it has no audio encoder): the turns' audio was not read".into());
            return Ok((vec![], report));
        }
        let mut clips = hearing::collect(d, opts, &mut report)?;
        if clips.is_empty() {
            if let Some(r) = &item.recording {
                clips = hearing::from_recording(&r.path, &r.turn_spans, r.target_span.0, opts, &mut report)?;
            }
        }
        Ok((clips, report))
    }
}

/// Creates `out` with config.json, or checks that an existing one describes the same run.
fn prepare_out(out: &Path, spec: &RunSpec) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cfg = out.join("config.json");
    if cfg.exists() {
        let mut old: serde_json::Value = serde_json::from_str(&crate::input::read_string(&cfg, &crate::input::CONFIG)?).with_context(|| format!("reading {}", cfg.display()))?;
        with_added_defaults(&mut old);
        let new = serde_json::to_value(spec)?;
        if old != new {
            let diff: Vec<String> = new
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| old.get(k.as_str()) != Some(v))
                .map(|(k, _)| k.clone())
                .collect();
            bail!("{} holds a run with different settings ({}); use another output folder to start a new run", out.display(), diff.join(", "));
        }
    } else {
        std::fs::write(&cfg, serde_json::to_string_pretty(spec)?).with_context(|| format!("writing {}", cfg.display()))?;
    }
    Ok(())
}

/// Settings added after a run was started are what it ran with: hearing on and the default clip
/// cap (a model that does not hear ignores both), so such a run still resumes.
fn with_added_defaults(old: &mut serde_json::Value) {
    let Some(o) = old.as_object_mut() else { return };
    o.entry("max_audio").or_insert(serde_json::json!(default_max_audio()));
    if let Some(p) = o.get_mut("pipeline").and_then(|p| p.as_object_mut()) {
        p.entry("use_audio").or_insert(serde_json::json!(true));
    }
}

/// Records of a results file, the last one per key. A partial last line (a killed run) is
/// cut off the file; any other bad line is an error naming it.
pub fn read_records(path: &Path) -> Result<Vec<Record>> {
    if !path.exists() {
        return Ok(vec![]);
    }
    let bytes = crate::input::read(path, &crate::input::RECORDS)?;
    let complete = bytes.iter().rposition(|&b| b == b'\n').map(|i| i + 1).unwrap_or(0);
    if complete < bytes.len() {
        // Only a trailing fragment without its newline can come from a kill mid-write.
        let f = OpenOptions::new().write(true).open(path)?;
        f.set_len(complete as u64).with_context(|| format!("truncating the partial last line of {}", path.display()))?;
    }
    let mut by_key: HashMap<String, Record> = HashMap::new();
    let mut order = vec![];
    for (n, line) in bytes[..complete].lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Record = serde_json::from_str(&line).with_context(|| format!("{} line {}: not a result record", path.display(), n + 1))?;
        if !by_key.contains_key(&r.key) {
            order.push(r.key.clone());
        }
        let keep_old = by_key.get(&r.key).is_some_and(|old| old.error.is_none() && r.error.is_some());
        if !keep_old {
            by_key.insert(r.key.clone(), r);
        }
    }
    Ok(order.into_iter().filter_map(|k| by_key.remove(&k)).collect())
}

/// Recomputes summary.json / summary.md from config.json and results.jsonl.
pub fn write_summary(out: &Path, spec: &RunSpec) -> Result<Summary> {
    let records = read_records(&out.join("results.jsonl"))?;
    let s = Summary::compute(&records, &spec.pipeline.labels, &spec.summary)?;
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&s)?)?;
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
    std::fs::write(out.join("summary.md"), s.to_markdown(&name))?;
    Ok(s)
}

pub fn read_spec(dir: &Path) -> Result<RunSpec> {
    let p = dir.join("config.json");
    let text = crate::input::read_string(&p, &crate::input::CONFIG).with_context(|| format!("is {} a merg eval run?", dir.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
}

/// Combines shard runs into `out`: same settings apart from the shard, no conflicting records.
pub fn merge(dirs: &[PathBuf], out: &Path) -> Result<Summary> {
    let Some(first) = dirs.first() else { bail!("merging needs at least one run folder") };
    let mut spec = read_spec(first)?;
    spec.shard = None;
    let mut all: HashMap<String, (Record, &Path)> = HashMap::new();
    for d in dirs {
        let mut s = read_spec(d)?;
        s.shard = None;
        if s != spec {
            bail!("{} and {} were run with different settings; only shards of one run can be merged", first.display(), d.display());
        }
        for r in read_records(&d.join("results.jsonl"))? {
            match all.get(&r.key) {
                Some((old, from)) if old.error.is_none() && r.error.is_none() && *old != r => {
                    bail!("item {} has different results in {} and {}", r.key, from.display(), d.display())
                }
                Some((old, _)) if old.error.is_none() => {}
                _ => {
                    all.insert(r.key.clone(), (r, d.as_path()));
                }
            }
        }
    }
    if out.join("results.jsonl").exists() {
        bail!("{} already holds results; merge into a new folder", out.display());
    }
    prepare_out(out, &spec)?;
    let mut records: Vec<Record> = all.into_values().map(|(r, _)| r).collect();
    records.sort_by_key(|r| r.index);
    let mut f = std::io::BufWriter::new(std::fs::File::create(out.join("results.jsonl"))?);
    for r in &records {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.flush()?;
    drop(f);
    write_summary(out, &spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_partition_the_limited_items() {
        let item = |i: usize| Item {
            key: format!("meld/test/dia{i}_utt1"),
            dialogue: crate::dialogue::Dialogue {
                id: None,
                turns: vec![crate::dialogue::Turn::new("A", "hi")],
                next_speaker: "B".into(),
                video: None,
                frames: vec![],
            },
            gold_emotion: "joy".into(),
            reference: "ok".into(),
            target_video: None,
            recording: None,
        };
        let items: Vec<Item> = (0..12).map(item).collect();
        let mut seen: Vec<usize> = vec![];
        for k in 1..=3 {
            let part = select(items.clone(), Some(10), Some((k, 3)));
            assert!(part.iter().all(|(i, it)| i % 3 == k - 1 && it.key == items[*i].key));
            seen.extend(part.into_iter().map(|(i, _)| i));
        }
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>(), "shards cover the limited items exactly once");
        assert_eq!(parse_shard("2/8").unwrap(), (2, 8));
        for bad in ["0/2", "3/2", "x", "1/0"] {
            assert!(parse_shard(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dialogue_keys_and_seeds() {
        assert_eq!(dialogue_of("meld/test/dia3_utt4"), "meld/test/dia3");
        assert_eq!(dialogue_of("iemocap/Ses05F_impro01_F003"), "iemocap/Ses05F_impro01");
        assert_ne!(item_seed(0, "a"), item_seed(0, "b"));
        assert_ne!(item_seed(0, "a"), item_seed(1, "a"));
        assert_eq!(item_seed(7, "meld/test/dia3_utt4"), item_seed(7, "meld/test/dia3_utt4"));
    }
}
