//! A `merg serve` server in-process on a loopback port with the tiny checkpoint, and a small
//! blocking HTTP client for the tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use candle_core::{DType, Device};
use merg::engine::{Engine, EngineConfig, EngineThread, KvMemory};
use merg::pipeline::prompt::Prompts;
use merg::pipeline::retrieval::Memory;
use merg::pipeline::PipelineConfig;
use merg::serve::{AppState, Limits, ModelInfo, ServeConfig};
use merg::Checkpoint;
use serde_json::Value;

pub const MODEL: &str = "tiny";

pub struct TestServer {
    pub url: String,
    pub state: Arc<AppState>,
    key: Option<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<std::thread::JoinHandle<()>>,
    _engine: EngineThread,
}

impl TestServer {
    pub fn start(limits: Limits, api_key: Option<&str>) -> Self {
        Self::start_family("qwen2_5_vl", limits, api_key)
    }

    /// A server on another tiny checkpoint (e.g. `qwen2_5_omni`, which hears).
    pub fn start_family(family: &str, limits: Limits, api_key: Option<&str>) -> Self {
        let dir = super::tiny_dir(family);
        let files = merg::hub::resolve(dir.to_str().unwrap(), None).unwrap();
        let ckpt = Checkpoint::load(files, &Device::Cpu, Some(DType::F32)).unwrap();
        let engine = EngineThread::spawn(Engine::new(ckpt, EngineConfig { kv_memory: KvMemory::Blocks(512), ..Default::default() }).unwrap());
        let mut pipeline = PipelineConfig { max_field_chars: 16, ..Default::default() };
        pipeline.sampling.max_new_tokens = 240;
        let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
        let cfg = ServeConfig {
            model_name: MODEL.into(),
            api_key: api_key.map(String::from),
            limits,
            shutdown_grace: Duration::from_secs(2),
            pipeline,
            frames: Default::default(),
            prompts: Prompts::builtin(),
            memory: Some(Memory::from_jsonl(&examples.join("memory.jsonl")).unwrap()),
            info: ModelInfo { family: family.into(), dtype: "f32".into(), ..Default::default() },
        };
        let state = AppState::new(engine.handle.clone(), cfg);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let st = state.clone();
        let join = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                merg::serve::serve(listener, st, async {
                    let _ = stopped.await;
                })
                .await;
            });
        });
        let addr = addr_rx.recv().unwrap();
        TestServer { url: format!("http://{addr}"), state, key: api_key.map(String::from), stop: Some(stop), join: Some(join), _engine: engine }
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(path, Some(body.to_string().into_bytes()), None)
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        self.send(path, None, None)
    }

    /// Any request; the body parsed as JSON (Null if it is not JSON).
    pub fn send(&self, path: &str, body: Option<Vec<u8>>, key: Option<&str>) -> (u16, Value) {
        let (status, text) = self.send_text(path, body, key);
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub fn send_text(&self, path: &str, body: Option<Vec<u8>>, key: Option<&str>) -> (u16, String) {
        let url = format!("{}{path}", self.url);
        let mut req = if body.is_some() { ureq::post(&url) } else { ureq::get(&url) };
        req = req.set("content-type", "application/json");
        if let Some(k) = key {
            req = req.set("authorization", &format!("Bearer {k}"));
        }
        let res = match body {
            Some(b) => req.send_bytes(&b),
            None => req.call(),
        };
        let resp = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{path}: {e}"),
        };
        let status = resp.status();
        let mut text = String::new();
        resp.into_reader().read_to_string(&mut text).unwrap();
        (status, text)
    }

    /// The lines of a streamed response (SSE `data:` payloads or NDJSON objects).
    pub fn stream_lines(&self, path: &str, body: &Value) -> Vec<String> {
        let resp = ureq::post(&format!("{}{path}", self.url)).send_string(&body.to_string()).unwrap();
        BufReader::new(resp.into_reader()).lines().map(Result::unwrap).filter(|l| !l.trim().is_empty()).collect()
    }

    /// A value of the Prometheus text at /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.send_text("/metrics", None, self.key.as_deref());
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }

    /// Waits until no request is in flight and every KV block is free again.
    pub fn wait_idle(&self) {
        for _ in 0..400 {
            if self.metric("merg_engine_running") == 0.0 && self.metric("merg_kv_blocks_used") == 0.0 && self.metric("merg_requests_in_flight") == 0.0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the server did not become idle: running {}, blocks used {}", self.metric("merg_engine_running"), self.metric("merg_kv_blocks_used"));
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// A PNG as base64.
pub fn png_b64(w: u32, h: u32) -> String {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, 90]));
    let mut buf = std::io::Cursor::new(vec![]);
    img.write_to(&mut buf, image::ImageFormat::Png).unwrap();
    base64::engine::general_purpose::STANDARD.encode(buf.into_inner())
}

/// An OpenAI chat body with one user message.
pub fn chat_body(content: Value, max_tokens: usize) -> Value {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
}
