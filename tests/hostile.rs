//! Hostile inputs across the commands, as a user (or an attacker) would try them. Every case
//! runs the real binary under an 8 GiB address-space limit and a deadline, and asserts: the
//! exit status it documents (failure for all but the accepted cases), no panic, no abort or
//! signal, a message naming the input, and that it ended in time.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::tiny_dir;

struct Case {
    name: &'static str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    /// Text the message must contain (the input's name and the problem).
    needles: Vec<String>,
    /// The documented acceptance: the command succeeds.
    succeeds: bool,
    secs: u64,
}

impl Case {
    fn fails(name: &'static str, args: &[&str], needles: &[&str]) -> Case {
        Case {
            name,
            args: args.iter().map(|s| s.to_string()).collect(),
            env: vec![],
            needles: needles.iter().map(|s| s.to_string()).collect(),
            succeeds: false,
            secs: 60,
        }
    }

    fn within(mut self, secs: u64) -> Case {
        self.secs = secs;
        self
    }
}

/// Runs every case; collects all failures into one report.
fn check(cases: Vec<Case>) {
    let mut bad = vec![];
    for c in &cases {
        if let Err(e) = run(c) {
            bad.push(format!("[{}] {e}", c.name));
        }
    }
    assert!(bad.is_empty(), "{} of {} hostile cases failed:\n{}", bad.len(), cases.len(), bad.join("\n"));
}

fn run(c: &Case) -> Result<(), String> {
    // 8 GiB of address space: an unbounded read or allocation fails instead of swapping.
    let mut cmd = Command::new("bash");
    cmd.arg("-c").arg("ulimit -v 8388608; exec \"$0\" \"$@\"").arg(env!("CARGO_BIN_EXE_merg")).args(&c.args);
    for (k, v) in &c.env {
        cmd.env(k, v);
    }
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).stdin(Stdio::null()).spawn().map_err(|e| e.to_string())?;
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if t.elapsed() > Duration::from_secs(c.secs) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {} s (a hang)", c.secs));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = reader.join().unwrap();
    if err.contains("panicked") {
        return Err(format!("panicked: {err}"));
    }
    let Some(code) = status.code() else { return Err(format!("killed by a signal ({status}): {err}")) };
    if c.succeeds != (code == 0) {
        return Err(format!("exit {code}, expected {}: {err}", if c.succeeds { "success" } else { "failure" }));
    }
    if code != 0 && code != 1 {
        return Err(format!("exit {code} (an abort?): {err}"));
    }
    for n in &c.needles {
        if !err.contains(n.as_str()) {
            return Err(format!("message does not contain {n:?}: {err}"));
        }
    }
    Ok(())
}

fn tiny() -> String {
    tiny_dir("qwen2_5_vl").to_string_lossy().into_owned()
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn write(dir: &Path, name: &str, body: impl AsRef<[u8]>) -> String {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    s(&p)
}

fn fifo(dir: &Path, name: &str) -> String {
    let p = dir.join(name);
    assert!(Command::new("mkfifo").arg(&p).status().unwrap().success());
    s(&p)
}

fn png(dir: &Path, name: &str, w: u32, h: u32) -> String {
    let p = dir.join(name);
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 9])).save(&p).unwrap();
    s(&p)
}

/// A copy of the tiny checkpoint with `edit` applied to its directory.
fn checkpoint_with(root: &Path, name: &str, edit: impl FnOnce(&Path)) -> String {
    checkpoint_from("qwen2_5_vl", root, name, edit)
}

/// A copy of the tiny checkpoint of `family` with `edit` applied to its directory.
fn checkpoint_from(family: &str, root: &Path, name: &str, edit: impl FnOnce(&Path)) -> String {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(tiny_dir(family)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    edit(&dir);
    s(&dir)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Overwrites tensor `name` of a safetensors file with NaN bytes (0xFF.. is NaN in f32/f16/bf16).
fn poison(file: &Path, name: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = &header[name]["data_offsets"];
    let (a, b) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
    bytes[8 + n + a..8 + n + b].fill(0xFF);
    std::fs::write(file, bytes).unwrap();
}

/// CRC-32 (IEEE), as PNG chunks carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

fn respond(model: &str, dialogue: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["respond", "--model", model, "--dialogue", dialogue, "--kv-memory", "blocks:256", "--t-max", "0", "--max-new-tokens", "240", "--max-field-chars", "16"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn dialogue_json(turns: &str) -> String {
    format!(r#"{{"turns": {turns}, "next_speaker": "B"}}"#)
}

#[test]
fn hostile_dialogues_and_media() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let model = tiny();
    let ok_img = png(d, "ok.png", 32, 24);
    let tall = png(d, "thin.png", 300, 1);
    let pipe = fifo(d, "pipe");
    let trace = s(&d.join("t.json"));
    let dlg = |name: &str, turns: &str| write(d, name, dialogue_json(turns));
    let good = dlg("good.json", r#"[{"speaker": "A", "text": "I lost my keys."}]"#);
    let mut big_turns = String::from("[");
    for i in 0..2000 {
        big_turns.push_str(&format!(r#"{{"speaker": "{}", "text": "turn {i}", "frames": ["{ok_img}"]}},"#, if i % 2 == 0 { "A" } else { "B" }));
    }
    big_turns.push_str(r#"{"speaker": "A", "text": "end"}]"#);
    let many = dlg("many.json", &big_turns);
    let huge_text = dlg("huge.json", &format!(r#"[{{"speaker": "A", "text": "{}"}}]"#, "a".repeat(10 << 20)));
    let big_file = write(d, "big.json", format!("{}{}", " ".repeat(2 << 20), dialogue_json(r#"[{"speaker": "A", "text": "hi"}]"#)));
    let r = |dialogue: &str, extra: &[&str]| {
        let mut a = respond(&model, dialogue, extra);
        a.extend(["--trace".into(), trace.clone()]);
        a
    };
    let case = |name, args: Vec<String>, needles: &[&str]| Case { args, ..Case::fails(name, &[], needles) };
    check(vec![
        case("dialogue is /dev/zero", r("/dev/zero", &[]), &["dialogue /dev/zero is not a regular file"]),
        case("dialogue is a FIFO", r(&pipe, &[]), &["FIFO", "pipe"]),
        case("dialogue is a directory", r(&s(d), &[]), &["a directory"]),
        case("dialogue is missing", r(&s(&d.join("nope.json")), &[]), &["nope.json"]),
        Case { env: vec![("MERG_MAX_DIALOGUE_MIB", "1".into())], ..case("dialogue over its cap", r(&big_file, &[]), &["big.json", "the limit is 1 MiB", "MERG_MAX_DIALOGUE_MIB"]) },
        case("dialogue not UTF-8", r(&write(d, "latin1.json", b"{\"turns\": [\xff]}"), &[]), &["latin1.json", "not UTF-8"]),
        case("dialogue not JSON", r(&write(d, "broken.json", "{turns:"), &[]), &["broken.json", "not valid JSON"]),
        case("turn text of the wrong type", r(&dlg("type.json", r#"[{"speaker": "A", "text": 5}]"#), &[]), &["type.json", "turns[0].text", "expected a string"]),
        case("top level a number", r(&write(d, "num.json", "42"), &[]), &["num.json", "neither an object nor a list"]),
        case("no turns", r(&dlg("none.json", "[]"), &[]), &["none.json", "empty"]),
        case("empty speaker", r(&dlg("spk.json", r#"[{"speaker": " ", "text": "x"}]"#), &[]), &["spk.json", "empty speaker"]),
        case("10 MB utterance", r(&huge_text, &[]), &["huge.json", "context window"]).within(20),
        case("2000 turns with per-turn frames", r(&many, &[]), &["many.json", "context"]).within(120),
        case("frame is a FIFO", r(&dlg("ff.json", &format!(r#"[{{"speaker": "A", "text": "x", "frames": ["{pipe}"]}}]"#)), &[]), &["FIFO"]),
        case("frame is /dev/zero", r(&dlg("fz.json", r#"[{"speaker": "A", "text": "x", "frames": ["/dev/zero"]}]"#), &[]), &["/dev/zero", "not a regular file"]),
        case("frame is missing", r(&dlg("fm.json", r#"[{"speaker": "A", "text": "x", "frames": ["gone.png"]}]"#), &[]), &["gone.png"]),
        case("frame is not an image", r(&dlg("ft.json", &format!(r#"[{{"speaker": "A", "text": "x", "frames": ["{}"]}}]"#, write(d, "notes.png", "hello"))), &[]), &["notes.png"]),
        case("frame 300x1", r(&dlg("thin.json", &format!(r#"[{{"speaker": "A", "text": "x", "frames": ["{tall}"]}}]"#)), &[]), &["thin.png", "aspect ratio"]),
        case("video is a FIFO", r(&good, &["--video", &pipe]), &["FIFO"]),
        case("video is /dev/zero", r(&good, &["--video", "/dev/zero"]), &["/dev/zero", "not a regular file"]),
        case("memory is /dev/zero", r(&good, &["--memory", "/dev/zero"]), &["exemplar memory /dev/zero is not a regular file"]),
        case("memory line is not JSON", r(&good, &["--memory", &write(d, "mem.jsonl", "{}\nnot json\n")]), &["mem.jsonl line 1"]),
        case("memory is empty", r(&good, &["--memory", &write(d, "empty.jsonl", "\n\n")]), &["empty.jsonl", "empty"]),
        Case { succeeds: true, ..case("a good dialogue is answered", r(&good, &[]), &[]) },
    ]);
}

#[test]
fn hostile_checkpoints_templates_and_flags() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let model = tiny();
    let good = write(d, "good.json", dialogue_json(r#"[{"speaker": "A", "text": "I lost my keys."}]"#));
    let cfg = |name: &'static str, f: fn(&mut serde_json::Value)| checkpoint_with(d, name, |dir| edit_json(&dir.join("config.json"), f));
    let zero_hidden = cfg("zero_hidden", |v| v["hidden_size"] = 0.into());
    let neg_depth = cfg("neg_depth", |v| v["vision_config"]["depth"] = (-1).into());
    let unknown_type = cfg("unknown_type", |v| v["model_type"] = "llama4".into());
    let big_pixels = checkpoint_with(d, "big_pixels", |dir| edit_json(&dir.join("preprocessor_config.json"), |v| v["max_pixels"] = 1_000_000_000_000_000u64.into()));
    let float_pixels = checkpoint_with(d, "float_pixels", |dir| edit_json(&dir.join("preprocessor_config.json"), |v| v["max_pixels"] = 1e15.into()));
    let runaway_chat = checkpoint_with(d, "runaway_chat", |dir| {
        std::fs::write(dir.join("chat_template.json"), r#"{"chat_template": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"}"#).unwrap()
    });
    let bad_tok = checkpoint_with(d, "bad_tok", |dir| std::fs::write(dir.join("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap());
    let truncated = checkpoint_with(d, "truncated", |dir| {
        let f = dir.join("model-00002-of-00002.safetensors");
        let b = std::fs::read(&f).unwrap();
        std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    });
    let nan = checkpoint_with(d, "nan_weights", |dir| poison(&dir.join("model-00002-of-00002.safetensors"), "model.norm.weight"));
    let bad_json = checkpoint_with(d, "bad_json", |dir| std::fs::write(dir.join("config.json"), "{").unwrap());
    let prompts = d.join("prompts");
    std::fs::create_dir_all(&prompts).unwrap();
    std::fs::write(prompts.join("mpa.j2"), "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}").unwrap();
    let syntax = d.join("prompts_syntax");
    std::fs::create_dir_all(&syntax).unwrap();
    std::fs::write(syntax.join("caef.j2"), "{% if %}").unwrap();
    let gen_kv = |m: &str, kv: &str, extra: &[&str]| {
        let mut v: Vec<String> = ["generate", "--model", m, "--prompt", "How are you?", "--max-new-tokens", "4", "--kv-memory", kv].iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let gen = |m: &str, extra: &[&str]| gen_kv(m, "blocks:64", extra);
    let pipe = fifo(d, "pipe");
    let huge_png = {
        // A PNG header claiming 100000×100000 pixels, with no data behind it.
        let mut chunk = b"IHDR".to_vec();
        chunk.extend(100000u32.to_be_bytes());
        chunk.extend(100000u32.to_be_bytes());
        chunk.extend([8, 2, 0, 0, 0]);
        let mut b = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0d".to_vec();
        b.extend(&chunk);
        b.extend(crc32(&chunk).to_be_bytes());
        // An empty IDAT so the header parses; the pixel data never comes.
        b.extend(0u32.to_be_bytes());
        b.extend(b"IDAT");
        b.extend(crc32(b"IDAT").to_be_bytes());
        write(d, "huge.png", b)
    };
    let thin = png(d, "thin.png", 300, 1);
    let absurd = d.join("absurd.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dummy-small-qwen2.5-vl.json")).unwrap()).unwrap();
    cfg["vocab_size"] = 100_000_000.into();
    cfg["intermediate_size"] = 1_000_000_000.into();
    std::fs::write(&absurd, cfg.to_string()).unwrap();
    let case = |name, args: Vec<String>, needles: &[&str]| Case { args, ..Case::fails(name, &[], needles) };
    let mut cases = vec![
        case("model dir missing", gen(&s(&d.join("no_model")), &[]), &["no_model"]),
        case("config not JSON", gen(&bad_json, &[]), &["bad_json", "config.json"]),
        case("hidden_size 0", gen(&zero_hidden, &[]), &["zero_hidden", "hidden_size must be at least 1"]),
        case("negative depth", gen(&neg_depth, &[]), &["neg_depth", "\"depth\" must be a non-negative integer, got -1"]),
        case("unknown model_type", gen(&unknown_type, &[]), &["llama4"]),
        case("absurd max_pixels", gen(&big_pixels, &[]), &["big_pixels", "max_pixels is 1000000000000000"]),
        case("fractional max_pixels", gen(&float_pixels, &[]), &["float_pixels", "max_pixels"]),
        case("runaway chat template", gen(&runaway_chat, &[]), &["runaway_chat", "runs away"]).within(60),
        case("tokenizer garbage", gen(&bad_tok, &[]), &["bad_tok", "tokenizer"]),
        case("truncated weights", gen(&truncated, &[]), &["model-00002-of-00002.safetensors", "truncated or corrupt"]),
        case("NaN weights", gen(&nan, &[]), &["nan_weights", "non-finite"]),
        case("KV memory 1e30", gen_kv(&model, "1e30", &[]), &["KV pool", "available"]),
        case("KV memory blocks:10^15", gen_kv(&model, "blocks:1000000000000000", &[]), &["KV pool", "available"]),
        case("dummy weights of an absurd config", vec!["bench".into(), "--config".into(), s(&absurd), "--prompt-tokens".into(), "8".into(), "--decode-tokens".into(), "2".into()], &["too large for this machine"]),
        case("KV memory nonsense", gen_kv(&model, "lots", &[]), &["--kv-memory", "lots"]),
        case("image is /dev/zero", gen(&model, &["--image", "/dev/zero"]), &["image /dev/zero is not a regular file"]),
        case("image is a FIFO", gen(&model, &["--image", &pipe]), &["FIFO"]),
        case("image claims 10^10 pixels", gen(&model, &["--image", &huge_png]), &["huge.png", "pixels; the limit"]),
        case("image 300x1", gen(&model, &["--image", &thin]), &["thin.png", "aspect ratio"]),
        case("video is a FIFO", gen(&model, &["--video", &pipe]), &["FIFO"]),
        case("runaway prompt template", respond(&model, &good, &["--prompts", &s(&prompts)]), &["mpa.j2", "runs away"]).within(60),
        case("prompt template syntax", respond(&model, &good, &["--prompts", &s(&syntax)]), &["caef.j2"]),
    ];
    if cfg!(feature = "serve") {
        cases.extend([
            case("serve on 0.0.0.0 without a key", vec!["serve".into(), "--model".into(), model.clone(), "--host".into(), "0.0.0.0".into()], &["API key", "--api-key-file"]),
            case("serve key file is /dev/zero", vec!["serve".into(), "--model".into(), model.clone(), "--api-key-file".into(), "/dev/zero".into()], &["--api-key-file", "not a regular file"]),
        ]);
    }
    check(cases);
}

/// Qwen3-VL checkpoints that disagree with their config: each error names the field or the
/// tensor, exit ≠ 0, no panic.
#[test]
fn hostile_qwen3_vl_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let cfg = |family: &str, name: &'static str, f: fn(&mut serde_json::Value)| checkpoint_from(family, d, name, |dir| edit_json(&dir.join("config.json"), f));
    let beyond = cfg("qwen3_vl", "deepstack_beyond", |v| v["vision_config"]["deepstack_visual_indexes"] = serde_json::json!([0, 1, 9]));
    let missing = cfg("qwen3_vl", "merger_missing", |v| v["vision_config"]["deepstack_visual_indexes"] = serde_json::json!([0, 1, 2, 3]));
    let extra = cfg("qwen3_vl", "merger_extra", |v| v["vision_config"]["deepstack_visual_indexes"] = serde_json::json!([0, 1]));
    let experts = cfg("qwen3_vl_moe", "expert_count", |v| v["text_config"]["num_experts"] = 6.into());
    let top_k = cfg("qwen3_vl_moe", "top_k", |v| v["text_config"]["num_experts_per_tok"] = 9.into());
    let gen = |m: &str| -> Vec<String> { ["generate", "--model", m, "--prompt", "Hi", "--max-new-tokens", "2"].iter().map(|s| s.to_string()).collect() };
    let case = |name, args: Vec<String>, needles: &[&str]| Case { args, ..Case::fails(name, &[], needles) };
    check(vec![
        case("DeepStack index beyond the tower", gen(&beyond), &["deepstack_beyond", "deepstack_visual_indexes has 9", "depth 4"]),
        case("missing DeepStack merger", gen(&missing), &["merger_missing", "deepstack_merger_list.3"]),
        case("more mergers than indexes", gen(&extra), &["merger_extra", "more DeepStack mergers"]),
        case("expert count disagrees with the tensors", gen(&experts), &["expert_count", "mlp.gate", "[6, 64]"]),
        case("top-k above the expert count", gen(&top_k), &["top_k", "num_experts_per_tok 9"]),
    ]);
}

/// Replaces `from` by `to` (same length) in a safetensors header: the tensor is then missing
/// under its own name while the file stays valid.
fn rename_tensor(file: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    assert!(header.contains(&format!("\"{from}\"")), "{from} not in {}", file.display());
    let header = header.replace(&format!("\"{from}\""), &format!("\"{to}\""));
    bytes[8..8 + n].copy_from_slice(header.as_bytes());
    std::fs::write(file, bytes).unwrap();
}

/// Qwen3.5 checkpoints and settings that cannot work: each error names the field, tensor or
/// setting, exit ≠ 0, no panic.
#[test]
fn hostile_qwen3_5_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let cfg = |name: &'static str, f: fn(&mut serde_json::Value)| checkpoint_from("qwen3_5", d, name, |dir| edit_json(&dir.join("config.json"), f));
    let short = cfg("short_types", |v| v["text_config"]["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]));
    let unknown = cfg("unknown_type", |v| v["text_config"]["layer_types"][1] = "mamba".into());
    let missing = checkpoint_from("qwen3_5", d, "missing_state", |dir| {
        let shard = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).find(|p| {
            p.extension().is_some_and(|x| x == "safetensors") && String::from_utf8_lossy(&std::fs::read(p).unwrap()).contains("layers.0.linear_attn.A_log")
        });
        rename_tensor(&shard.unwrap(), "model.language_model.layers.0.linear_attn.A_log", "model.language_model.layers.0.linear_attn.A_loq");
    });
    let model = s(&tiny_dir("qwen3_5"));
    let gen = |m: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["generate", "--model", m, "--prompt", "Hi", "--max-new-tokens", "2"].iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let case = |name, args: Vec<String>, needles: &[&str]| Case { args, ..Case::fails(name, &[], needles) };
    check(vec![
        case("layer_types shorter than the layers", gen(&short, &[]), &["short_types", "layer_types has 2 entries for 8 layers"]),
        case("unknown layer type", gen(&unknown, &[]), &["unknown_type", "\"mamba\""]),
        case("a Gated DeltaNet tensor missing", gen(&missing, &[]), &["missing_state", "layers.0.linear_attn.A_log"]),
        case("state budget below one sequence", gen(&model, &["--state-memory", "1KiB"]), &["state memory", "1024 bytes", "recurrent state"]),
        case("state budget nonsense", gen(&model, &["--state-memory", "plenty"]), &["--state-memory", "plenty"]),
    ]);
}

#[test]
fn hostile_datasets_and_reports() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    let meld = d.join("meld");
    std::fs::create_dir_all(&meld).unwrap();
    let header = "Sr No.,Utterance,Speaker,Emotion,Sentiment,Dialogue_ID,Utterance_ID,Season,Episode,StartTime,EndTime\n";
    std::fs::write(meld.join("test_sent_emo.csv"), format!("{header}1,hi,A,joy,positive,0,0,1,1,0,1\n2,\"unclosed,B\n")).unwrap();
    let bad_ids = d.join("meld_ids");
    std::fs::create_dir_all(&bad_ids).unwrap();
    std::fs::write(bad_ids.join("test_sent_emo.csv"), format!("{header}1,hi,A,joy,positive,x,0,1,1,0,1\n")).unwrap();
    let key = write(d, "key.csv", "code,run\nc1,runA\n");
    let sheet = write(d, "sheet.csv", "code,empathy,relevance,fluency\nc1,5,4\nc1,1,2,3,4,5\n");
    let bad_score = write(d, "scores.csv", "code,empathy,relevance,fluency\nc1,9,4,4\n");
    let eval = |data: &Path| -> Vec<String> {
        ["eval", "--dataset", "meld", "--split", "test", "--data-dir", &s(data), "--model", &tiny(), "--out", &s(&d.join("out"))].iter().map(|s| s.to_string()).collect()
    };
    let case = |name, args: Vec<String>, needles: &[&str]| Case { args, ..Case::fails(name, &[], needles) };
    check(vec![
        case("MELD row with an unclosed quote", eval(&meld), &["test_sent_emo.csv"]),
        case("MELD id not a number", eval(&bad_ids), &["test_sent_emo.csv", "Dialogue_ID"]),
        case("MELD dir missing", eval(&d.join("absent")), &["absent"]),
        case("ragged human sheet", vec!["report".into(), "--aggregate-human".into(), sheet.clone(), "--key".into(), key.clone()], &["sheet.csv"]),
        case("score out of range", vec!["report".into(), "--aggregate-human".into(), bad_score, "--key".into(), key.clone()], &["scores.csv", "1 to 5"]),
        case("human key is /dev/zero", vec!["report".into(), "--aggregate-human".into(), sheet, "--key".into(), "/dev/zero".into()], &["/dev/zero", "not a regular file"]),
        case("report of a missing run", vec!["report".into(), s(&d.join("no_run"))], &["no_run"]),
        case("plot of /dev/zero", vec!["plot".into(), "serve-load".into(), "/dev/zero".into(), "--out".into(), s(&d.join("f.svg"))], &["/dev/zero", "not a regular file"]),
        case("plot of a file that is not JSON", vec!["plot".into(), "serve-load".into(), key.clone(), "--out".into(), s(&d.join("f.svg"))], &["key.csv", "not JSON"]),
    ]);
}

