//! The five-agent workload sent to an OpenAI-compatible server (`llama-server`, the engine of
//! the paper's Ollama setup), as its users run it: the same prompts, keyframes, token budgets,
//! greedy decoding and fixed output length as `run_agents`, in one of two call orders and with
//! one or several requests in flight. Each later agent's prompt carries the server's own
//! upstream outputs, as in the pipeline. Prompt tokens computed and taken from the server's
//! cache come from llama-server's per-response `timings` (`prompt_n`, `cache_n`).

use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use base64::Engine as _;
use serde::Serialize;

use crate::chat::ContentPart;
use crate::engine::ChatRequest;

/// Which calls may run together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Every dialogue's call of one agent, then the next agent (how `merg eval` batches).
    Stage,
    /// Each dialogue's calls back to back; several dialogues at once with several slots.
    Dialogue,
}

#[derive(Clone, Debug, Serialize)]
pub struct ServerRun {
    pub order: Order,
    /// Requests in flight at once (the server's slots).
    pub slots: usize,
    pub dialogues: usize,
    pub requests: usize,
    pub wall_s: f64,
    /// Prompt tokens the server computed, and those it took from its cache.
    pub computed_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub dialogues_per_minute: f64,
}

/// One call's counts from the server's answer.
struct Counts {
    computed: u64,
    cached: u64,
    generated: u64,
}

/// Runs the workload against `url` (e.g. `http://127.0.0.1:8080`).
pub fn run_on_server(url: &str, order: Order, slots: usize, dialogues: usize, new_tokens: usize, keyframes: &[image::RgbImage]) -> Result<ServerRun> {
    let images = keyframes.iter().map(png_data_url).collect::<Result<Vec<_>>>()?;
    let outputs: Vec<Mutex<Vec<(usize, String)>>> = (0..dialogues).map(|_| Mutex::new(vec![])).collect();
    let totals = Mutex::new(Counts { computed: 0, cached: 0, generated: 0 });
    let schedule = super::schedule();
    let call = |d: usize, agent: usize| -> Result<()> {
        let upstream = outputs[d].lock().expect("outputs").clone();
        let req = super::request(d, agent, &upstream, keyframes, new_tokens);
        let (text, c) = post(url, &req, &images, new_tokens).with_context(|| format!("dialogue {d}, agent {}", super::AGENTS[agent].0))?;
        super::record(&mut outputs[d].lock().expect("outputs"), agent, text);
        let mut t = totals.lock().expect("totals");
        (t.computed, t.cached, t.generated) = (t.computed + c.computed, t.cached + c.cached, t.generated + c.generated);
        Ok(())
    };
    let t0 = Instant::now();
    match order {
        Order::Stage => {
            for &agent in &schedule {
                in_parallel(slots, dialogues, |d| call(d, agent))?;
            }
        }
        Order::Dialogue => in_parallel(slots, dialogues, |d| schedule.iter().try_for_each(|&agent| call(d, agent)))?,
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let t = totals.into_inner().expect("totals");
    Ok(ServerRun {
        order,
        slots,
        dialogues,
        requests: dialogues * schedule.len(),
        wall_s,
        computed_tokens: t.computed,
        cached_tokens: t.cached,
        generated_tokens: t.generated,
        dialogues_per_minute: dialogues as f64 * 60.0 / wall_s,
    })
}

/// `f(0..n)` on `slots` threads, each taking the next index; the first error wins.
fn in_parallel(slots: usize, n: usize, f: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..slots.clamp(1, n.max(1)))
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return Ok(());
                    }
                    f(i)?;
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?)
    })
}

fn png_data_url(img: &image::RgbImage) -> Result<String> {
    let mut png = std::io::Cursor::new(vec![]);
    img.write_to(&mut png, image::ImageFormat::Png)?;
    Ok(format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png.into_inner())))
}

/// The request in OpenAI chat form: images as data URLs in their places, greedy, exactly
/// `new_tokens` generated (`ignore_eos`), the server's prompt cache on.
fn body(req: &ChatRequest, images: &[String], new_tokens: usize) -> serde_json::Value {
    let mut next_image = images.iter();
    let messages: Vec<serde_json::Value> = req
        .messages
        .iter()
        .map(|m| {
            let parts: Vec<serde_json::Value> = m
                .content
                .iter()
                .map(|p| match p {
                    ContentPart::Text(t) => serde_json::json!({"type": "text", "text": t}),
                    _ => serde_json::json!({"type": "image_url", "image_url": {"url": next_image.next().cloned().unwrap_or_default()}}),
                })
                .collect();
            serde_json::json!({"role": m.role, "content": parts})
        })
        .collect();
    serde_json::json!({
        "model": "merg-bench", "messages": messages, "max_tokens": new_tokens, "temperature": 0.0,
        "ignore_eos": true, "cache_prompt": true,
    })
}

fn post(url: &str, req: &ChatRequest, images: &[String], new_tokens: usize) -> Result<(String, Counts)> {
    let resp: serde_json::Value = ureq::post(&format!("{}/v1/chat/completions", url.trim_end_matches('/')))
        .send_json(body(req, images, new_tokens))
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?
        .into_json()?;
    let text = resp["choices"][0]["message"]["content"].as_str().context("no choices[0].message.content in the answer")?.to_string();
    let t = &resp["timings"];
    if t.is_null() {
        anyhow::bail!("{url} gives no `timings` (is it llama-server?)");
    }
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    Ok((text, Counts { computed: n("prompt_n"), cached: n("cache_n"), generated: n("predicted_n") }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request body: images in their places as PNG data URLs, greedy, fixed length.
    #[test]
    fn body_is_openai_chat_with_images_in_place() {
        let frames = vec![image::RgbImage::new(4, 4); 2];
        let images: Vec<String> = frames.iter().map(|f| png_data_url(f).unwrap()).collect();
        let req = crate::bench::request(1, 2, &[(0, "evidence".into())], &frames, 7);
        let b = body(&req, &images, 7);
        assert_eq!(b["messages"][0]["role"], "system");
        let user = b["messages"][1]["content"].as_array().unwrap();
        assert_eq!(user.len(), 3);
        assert!(user[0]["image_url"]["url"].as_str().unwrap().starts_with("data:image/png;base64,iVBOR"));
        assert!(user[2]["text"].as_str().unwrap().contains("MPA output: evidence"));
        assert_eq!((b["max_tokens"].as_u64(), b["ignore_eos"].as_bool(), b["temperature"].as_f64()), (Some(7), Some(true), Some(0.0)));
    }
}
