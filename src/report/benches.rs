//! Figures of what the benchmarks measured, drawn from the JSON they print (so a saved run can
//! be drawn again, and the figure shows exactly the printed numbers): `merg bench --plot`
//! (tokens/s per weight format against the roofline), `merg bench-agents --plot` (wall per
//! dialogue and prompt tokens computed, cache on vs off, or a server's), and `merg plot
//! serve-load` for `scripts/bench-serve.sh` (requests/s and latency per client count).

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::plot::{Categorical, Chart, Figure, Style};

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// A measured rate's bound from its printed share of it (`rate` is `pct` % of the bound);
/// NaN, so no mark, without a roofline.
fn bound(rate: f64, pct: &Value) -> f64 {
    100.0 * rate / num(pct)
}

/// `merg bench`'s records, one per weight format: decode (batch 1 and each `--batch`) and
/// prefill tokens/s, each against its roofline bound when one was measured.
pub fn bench(recs: &[Value]) -> Figure {
    let formats: Vec<String> = recs.iter().map(|r| r["weights"].as_str().unwrap_or("?").to_string()).collect();
    let per = |f: &dyn Fn(&Value) -> f64| recs.iter().map(f).collect::<Vec<f64>>();
    let mut decode = vec![("batch 1".to_string(), per(&|r| num(&r["decode_tokens_per_s"])))];
    let batches = recs.first().and_then(|r| r["batched"].as_array()).map(|b| b.len()).unwrap_or(0);
    for i in 0..batches {
        let size = &recs[0]["batched"][i]["batch"];
        decode.push((format!("batch {size} (aggregate)"), per(&|r| num(&r["batched"][i]["tokens_per_s"]))));
    }
    let decode_bound = per(&|r| bound(num(&r["decode_tokens_per_s"]), &r["decode_roofline_pct"]));
    let prefill_bound = per(&|r| bound(num(&r["prefill_tokens_per_s"]), &r["prefill_peak_pct"]));
    let with_bound = |name: &str, v: Vec<f64>| v.iter().any(|x| x.is_finite()).then(|| (name.to_string(), v));
    let panel = |title: &str, series, limit| Categorical {
        title: title.into(),
        x_label: "weights".into(),
        y_label: "tokens/s".into(),
        categories: formats.clone(),
        series,
        limit,
        values: true,
        ..Default::default()
    };
    let decode = panel("decode", decode, with_bound("bandwidth roofline (batch 1)", decode_bound));
    let prefill = panel("prefill", vec![("prefill".into(), per(&|r| num(&r["prefill_tokens_per_s"])))], with_bound("compute peak", prefill_bound));
    let first = recs.first().cloned().unwrap_or(Value::Null);
    let title = format!(
        "merg bench: {} on {}, {}-token prompt, {} decoded{}",
        first["family"].as_str().unwrap_or("?"),
        first["device"].as_str().unwrap_or("?"),
        first["prompt_tokens"],
        first["decode_tokens"],
        if first["dummy"] == true { " (random weights)" } else { "" }
    );
    Figure { title: Some(title), charts: vec![Chart::Categorical(decode), Chart::Categorical(prefill)] }
}

/// Two panels for a five-agent run: wall per dialogue per run, and the prompt tokens computed
/// and taken from the cache.
fn agents_panels(wall_cats: Vec<String>, wall_x: &str, walls: Vec<(String, Vec<f64>)>, token_cats: Vec<String>, computed: Vec<f64>, cached: Vec<f64>) -> Vec<Chart> {
    let wall = Categorical {
        title: "wall per dialogue".into(),
        x_label: wall_x.into(),
        y_label: "seconds".into(),
        categories: wall_cats,
        series: walls,
        values: true,
        ..Default::default()
    };
    let tokens = Categorical {
        title: "prompt tokens".into(),
        x_label: String::new(),
        y_label: "tokens".into(),
        categories: token_cats,
        series: vec![("computed".into(), computed), ("from the cache".into(), cached)],
        style: Style::Stacked,
        values: true,
        ..Default::default()
    };
    vec![Chart::Categorical(wall), Chart::Categorical(tokens)]
}

/// `merg bench-agents`' report: here (cache on vs off, each repeated pair), or a server's run.
pub fn bench_agents(r: &Value) -> Result<Figure> {
    let dialogues = match r["dialogues"].as_u64() {
        Some(d) if d > 0 => d as f64,
        _ => bail!("not a bench-agents report: no `dialogues`"),
    };
    let (title, charts) = match r.get("with_cache") {
        Some(on) => {
            let pairs = r["pair_walls_s"].as_array().cloned().unwrap_or_default();
            let (cats, walls) = match pairs.is_empty() {
                true => (vec!["1".to_string()], vec![("cache on".to_string(), vec![num(&on["wall_s"]) / dialogues])]),
                false => (
                    (1..=pairs.len()).map(|i| i.to_string()).collect(),
                    vec![
                        ("cache on".to_string(), pairs.iter().map(|p| num(&p[0]) / dialogues).collect()),
                        ("cache off".to_string(), pairs.iter().map(|p| num(&p[1]) / dialogues).collect()),
                    ],
                ),
            };
            let runs: Vec<&Value> = std::iter::once(on).chain(r["without_cache"].as_object().map(|_| &r["without_cache"])).collect();
            let token_cats = ["cache on", "cache off"][..runs.len()].iter().map(|s| s.to_string()).collect();
            let count = |k: &str| runs.iter().map(|run| num(&run["stats"]["prefix"][k])).collect();
            let ratio = r["wall_ratio"].as_f64().map(|x| format!("; wall on/off {x:.2} (median)")).unwrap_or_default();
            let title = format!("merg bench-agents: {dialogues} dialogues × 8 agent calls, keyframes {}, new tokens {}{ratio}", r["keyframes"], r["new_tokens"]);
            (title, agents_panels(cats, "run (cache on and off alternated)", walls, token_cats, count("computed_tokens"), count("cached_tokens")))
        }
        None => {
            let name = format!("{} order, {} slot(s)", r["order"].as_str().unwrap_or("?"), r["slots"]);
            let walls = vec![("server".to_string(), vec![num(&r["wall_s"]) / dialogues])];
            let title = format!("bench-agents --server: {dialogues} dialogues, {} requests", r["requests"]);
            (title, agents_panels(vec![name.clone()], "", walls, vec![name], vec![num(&r["computed_tokens"])], vec![num(&r["cached_tokens"])]))
        }
    };
    Ok(Figure { title: Some(title), charts })
}

/// `scripts/bench_serve.py`'s rows (`clients`, `rps`, `p50`, `p99`, `ttft_p50`, seconds):
/// requests/s and latency per number of concurrent clients.
pub fn serve_load(rows: &Value) -> Result<Figure> {
    let rows = rows.as_array().context("serve-load: expected the JSON array of rows bench_serve.py prints")?;
    if rows.iter().any(|r| r["clients"].as_u64().is_none()) {
        bail!("serve-load: every row needs `clients`");
    }
    let clients: Vec<String> = rows.iter().map(|r| r["clients"].to_string()).collect();
    let col = |k: &str, scale: f64| rows.iter().map(|r| num(&r[k]) * scale).collect::<Vec<f64>>();
    // Values printed on the one throughput line; the latency lines' would overlap at the start.
    let panel = |title: &str, y: &str, series, values| Categorical {
        title: title.into(),
        x_label: "concurrent streaming clients".into(),
        y_label: y.into(),
        categories: clients.clone(),
        series,
        style: Style::Lines,
        values,
        ..Default::default()
    };
    let rps = panel("throughput", "requests/s", vec![("requests/s".into(), col("rps", 1.0))], true);
    let latency = panel(
        "latency",
        "ms",
        vec![("p50".into(), col("p50", 1e3)), ("p99".into(), col("p99", 1e3)), ("time to first token, p50".into(), col("ttft_p50", 1e3))],
        false,
    );
    let title = "merg serve under load: streaming chat requests over loopback".to_string();
    Ok(Figure { title: Some(title), charts: vec![Chart::Categorical(rps), Chart::Categorical(latency)] })
}
