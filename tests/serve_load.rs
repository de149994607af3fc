//! A bounded load test over loopback: 64 concurrent streaming clients × 4 requests against a
//! server whose queue holds 48. Every request either completes with exactly the greedy output
//! of a sequential run, or is refused with a clear 429; afterwards every KV block is free. It
//! ends by itself (no timing assertions: throughput is measured by scripts/bench-serve.py).

mod common;
#[path = "common/server.rs"]
mod server;

use std::io::{BufRead, BufReader};
use std::sync::Arc;

use common::tiny_dir;

use merg::serve::Limits;
use serde_json::{json, Value};
use server::{chat_body, TestServer};

const PROMPTS: [&str; 4] = ["How was your day?", "I failed my exam.", "We got a puppy!", "My flight was cancelled again."];

enum Outcome {
    Text(usize, String),
    Refused(u16, String),
}

fn streamed(url: &str, prompt: usize) -> Outcome {
    let mut body = chat_body(json!(PROMPTS[prompt]), 8);
    body["stream"] = json!(true);
    match ureq::post(&format!("{url}/v1/chat/completions")).send_string(&body.to_string()) {
        Ok(resp) => {
            let mut text = String::new();
            for line in BufReader::new(resp.into_reader()).lines() {
                let line = line.unwrap();
                let Some(data) = line.strip_prefix("data: ") else { continue };
                if data == "[DONE]" {
                    break;
                }
                let v: Value = serde_json::from_str(data).unwrap();
                assert!(v.get("error").is_none(), "error mid-stream: {v}");
                text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
            }
            Outcome::Text(prompt, text)
        }
        Err(ureq::Error::Status(code, resp)) => Outcome::Refused(code, resp.into_string().unwrap_or_default()),
        Err(e) => panic!("transport error: {e}"),
    }
}

#[test]
fn sixty_four_streaming_clients_get_sequential_outputs_or_a_clear_429() {
    let s = Arc::new(TestServer::start(Limits { max_queue: 48, ..Limits::default() }, None));
    let sequential: Vec<String> = (0..PROMPTS.len())
        .map(|p| match streamed(&s.url, p) {
            Outcome::Text(_, t) => t,
            Outcome::Refused(c, m) => panic!("sequential run refused: {c} {m}"),
        })
        .collect();
    let clients: Vec<_> = (0..64)
        .map(|c| {
            let url = s.url.clone();
            std::thread::spawn(move || (0..4).map(|r| streamed(&url, (c + r) % PROMPTS.len())).collect::<Vec<_>>())
        })
        .collect();
    let (mut done, mut refused) = (0, 0);
    for c in clients {
        for o in c.join().unwrap() {
            match o {
                Outcome::Text(p, t) => {
                    assert_eq!(t, sequential[p], "prompt {p} under load");
                    done += 1;
                }
                Outcome::Refused(code, msg) => {
                    assert_eq!(code, 429, "{msg}");
                    assert!(msg.contains("queue limit is 48"), "{msg}");
                    refused += 1;
                }
            }
        }
    }
    eprintln!("{done} completed, {refused} refused with 429");
    assert_eq!(done + refused, 256);
    assert!(done >= 48, "at least a queue's worth completes");
    s.wait_idle();
    assert_eq!(s.metric("merg_generations_total") as usize, done + PROMPTS.len());
}
