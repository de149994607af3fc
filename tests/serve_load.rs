//! Load and hostile clients over loopback.
//! - 64 concurrent streaming clients × 4 requests against a server whose queue holds 48: every
//!   request either completes with exactly the greedy output of a sequential run, or is refused
//!   with a clear 429; afterwards every KV block is free (no timing assertions: throughput is
//!   measured by scripts/bench-serve.py).
//! - Slow, silent and half-closed connections, oversized headers, and more connections than
//!   the cap: each is cut off by the limit meant for it, and a normal client is still served.
//!   Timeouts are configured short (1-2 s) and every time bound is several times what the
//!   limit needs, so a loaded 2-core box does not flake.

mod common;
#[path = "common/server.rs"]
mod server;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

fn addr(s: &TestServer) -> String {
    s.url.strip_prefix("http://").unwrap().to_string()
}

/// A connection that sent `prefix` and then stays silent.
fn sent(addr: &str, prefix: &[u8]) -> TcpStream {
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.write_all(prefix).unwrap();
    sock
}

/// Writes one byte every 100 ms to each socket until `stop` is set or the write fails (the
/// server closed it): clients that send, but too slowly.
fn drip(socks: Vec<TcpStream>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut live = socks;
        while !stop.load(Ordering::SeqCst) && !live.is_empty() {
            live.retain_mut(|s| s.write_all(b"a").is_ok());
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Reads until the server closes the connection (end of stream or a reset), for at most
/// `limit`: what it sent and when it closed, counted from `since`.
fn until_closed(sock: &mut TcpStream, since: Instant, limit: Duration) -> (String, Duration) {
    sock.set_read_timeout(Some(limit)).unwrap();
    let (mut got, mut buf) = (vec![], [0u8; 4096]);
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => panic!("still open after {limit:?}"),
            Err(_) => break, // reset: closed too
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), since.elapsed())
}

const HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: merg\r\nContent-Type: application/json\r\n";

/// Headers for a 1000-byte body, and the first bytes of it.
fn partial_body() -> Vec<u8> {
    [HEAD, b"Content-Length: 1000\r\n\r\n{\"model\": "].concat()
}

#[test]
fn two_hundred_slow_or_half_open_connections_do_not_stop_a_normal_client() {
    // Long timeouts: every hostile connection stays open while the normal client is served.
    let long = Duration::from_secs(120);
    let s = TestServer::start(Limits { header_read_timeout: long, body_read_timeout: long, ..Limits::default() }, None);
    let a = addr(&s);
    let (mut held, mut dripping) = (vec![], vec![]);
    for i in 0..200 {
        let sock = match i % 4 {
            0 => TcpStream::connect(&a).unwrap(),   // connected, silent
            1 => sent(&a, &HEAD[..40]),             // half a header line, then a byte at a time
            2 => sent(&a, &partial_body()),         // headers, then the body a byte at a time
            _ => {
                let sock = sent(&a, HEAD); // half-closed: headers unfinished, no more coming
                sock.shutdown(Shutdown::Write).unwrap();
                sock
            }
        };
        if i % 4 == 1 || i % 4 == 2 {
            dripping.push(sock.try_clone().unwrap());
        }
        held.push(sock);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let dripper = drip(dripping, stop.clone());
    let t = Instant::now();
    let (st, v) = s.post("/v1/chat/completions", &chat_body(json!("Still there?"), 4));
    assert_eq!(st, 200, "{v}");
    assert_eq!(s.get("/health").0, 200);
    let took = t.elapsed();
    eprintln!("normal client served in {took:?} beside 200 hostile connections");
    assert!(took < Duration::from_secs(20), "a normal client waited {took:?}");
    stop.store(true, Ordering::SeqCst);
    dripper.join().unwrap();
    drop(held);
    s.wait_idle();
}

#[test]
fn slow_clients_are_cut_off_by_the_configured_timeouts_and_big_headers_get_431() {
    let limits = Limits {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        max_header_bytes: 16 << 10,
        ..Limits::default()
    };
    let s = TestServer::start(limits, None);
    let a = addr(&s);
    let (at_least, at_most) = (Duration::from_millis(900), Duration::from_secs(15));
    let cut = |what: &str, mut sock: TcpStream, t: Instant| {
        let (got, after) = until_closed(&mut sock, t, at_most);
        assert!(after >= at_least, "{what}: closed after {after:?}, before its timeout");
        eprintln!("{what}: closed after {after:?}");
        got
    };

    // Headers: silent, or sent a byte every 100 ms; hyper closes without a response.
    let t = Instant::now();
    assert_eq!(cut("silent", TcpStream::connect(&a).unwrap(), t), "");
    let (stop, t) = (Arc::new(AtomicBool::new(false)), Instant::now());
    let sock = sent(&a, b"GET /health HTTP/1.1\r\nX-Slow: ");
    let dripper = drip(vec![sock.try_clone().unwrap()], stop.clone());
    assert_eq!(cut("slow headers", sock, t), "");
    stop.store(true, Ordering::SeqCst);
    dripper.join().unwrap();

    // A body that stops arriving: 408 naming the limit, then the connection closes.
    let t = Instant::now();
    let got = cut("stalled body", sent(&a, &partial_body()), t);
    assert!(got.starts_with("HTTP/1.1 408") && got.contains("body_read_timeout of 1 s"), "{got}");
    // One that arrives a byte every 100 ms: cut off too (the 408 may be lost to the reset that
    // bytes still arriving after the close cause).
    let (stop, t) = (Arc::new(AtomicBool::new(false)), Instant::now());
    let sock = sent(&a, &partial_body());
    let dripper = drip(vec![sock.try_clone().unwrap()], stop.clone());
    let got = cut("slow body", sock, t);
    assert!(got.is_empty() || got.starts_with("HTTP/1.1 408"), "{got}");
    stop.store(true, Ordering::SeqCst);
    dripper.join().unwrap();

    // Headers of exactly max_header_bytes, unfinished: 431, and all of it was read (no reset).
    let mut big = b"GET /health HTTP/1.1\r\nX-Big: ".to_vec();
    big.resize(16 << 10, b'a');
    let (got, _) = until_closed(&mut sent(&a, &big), Instant::now(), at_most);
    assert!(got.starts_with("HTTP/1.1 431"), "{got}");
    let (st, _) = ureq::get(&format!("{}/health", s.url)).set("x-big", &"a".repeat(12 << 10)).call().map(|r| (r.status(), ())).unwrap();
    assert_eq!(st, 200, "12 KiB of headers is under the limit");

    // A streamed response outlasting both timeouts is not cut: only reading the request is timed.
    let mut body = chat_body(json!("Talk."), 120);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let resp = ureq::post(&format!("{}/v1/chat/completions", s.url)).send_string(&body.to_string()).unwrap();
    let t = Instant::now();
    let mut lines = vec![];
    for line in BufReader::new(resp.into_reader()).lines() {
        lines.push(line.unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(t.elapsed() > Duration::from_millis(1500), "the stream took {:?}", t.elapsed());
    assert_eq!(lines.iter().rev().find(|l| !l.is_empty()).map(String::as_str), Some("data: [DONE]"));
    assert!(lines.iter().any(|l| l.contains("\"finish_reason\":\"length\"")));
    s.wait_idle();
}

#[test]
fn clients_beyond_the_connection_cap_wait_for_a_free_one_and_are_served() {
    let limits = Limits { max_connections: 8, header_read_timeout: Duration::from_secs(2), ..Limits::default() };
    let s = TestServer::start(limits, None);
    let a = addr(&s);
    // Eight silent connections fill the cap until the header timeout cuts them.
    let t = Instant::now();
    let held: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&a).unwrap()).collect();
    // Forty more queue behind them and give up; the server must get past them.
    for _ in 0..40 {
        drop(sent(&a, b"GET /health HTTP/1.1\r\n"));
    }
    let url = s.url.clone();
    let normal = std::thread::spawn(move || ureq::get(&format!("{url}/health")).call().map(|r| r.status()).map_err(|e| e.to_string()));
    let st = normal.join().unwrap();
    let took = t.elapsed();
    eprintln!("a client over the cap was served after {took:?}");
    assert_eq!(st, Ok(200));
    assert!(took >= Duration::from_secs(1), "served after {took:?}: the cap of 8 did not hold it back");
    assert!(took < Duration::from_secs(30), "served after {took:?}");
    for mut sock in held {
        assert_eq!(until_closed(&mut sock, t, Duration::from_secs(15)).0, "");
    }
    let (st, v) = s.post("/v1/chat/completions", &chat_body(json!("And now?"), 4));
    assert_eq!(st, 200, "{v}");
    s.wait_idle();
}
