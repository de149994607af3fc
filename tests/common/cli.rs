//! Runs the `merg` binary as a user would: its stdout and stderr kept, and a server (any run
//! that prints `listening on http://ADDR`) asked one GET once it listens, then stopped.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Run {
    /// Exit status 0 (a server: its probe answered 200).
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    /// A server's answer to the probe, head and body.
    pub probed: Option<String>,
}

/// `merg args` with `HF_HUB_OFFLINE=1`; a server gets `GET /v1/models`.
pub fn run(args: &[String]) -> Run {
    run_with(args, &[], "/v1/models")
}

/// `merg args` with extra environment variables; a server gets `GET probe`.
pub fn run_with(args: &[String], env: &[(&str, &std::ffi::OsStr)], probe: &str) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_merg"));
    cmd.args(args).env("HF_HUB_OFFLINE", "1").stdout(Stdio::piped()).stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<(bool, String)>();
    for (is_err, mut pipe) in [(false, Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>), (true, Box::new(child.stderr.take().unwrap()))] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 || tx.send((is_err, String::from_utf8_lossy(&buf[..n]).into_owned())).is_err() {
                    break;
                }
            }
        });
    }
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let drain = |stdout: &mut String, stderr: &mut String| {
        while let Ok((is_err, chunk)) = rx.try_recv() {
            if is_err { stderr.push_str(&chunk) } else { stdout.push_str(&chunk) }
        }
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        drain(&mut stdout, &mut stderr);
        if let Some(addr) = stderr.split("listening on http://").nth(1).and_then(|r| r.split_whitespace().next()) {
            let answer = http_get(addr, probe);
            child.kill().unwrap();
            child.wait().unwrap();
            let ok = answer.starts_with("HTTP/1.1 200");
            return Run { ok, stdout, stderr, probed: Some(answer) };
        }
        if let Some(status) = child.try_wait().unwrap() {
            std::thread::sleep(Duration::from_millis(100));
            drain(&mut stdout, &mut stderr);
            return Run { ok: status.success(), stdout, stderr, probed: None };
        }
        assert!(Instant::now() < deadline, "merg {args:?} ran past 300 s:\n{stderr}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn http_get(addr: &str, path: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}
