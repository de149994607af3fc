//! The library's modules import only downward: each top-level module of src/ may use only the
//! modules listed before it in `ORDER` (docs/ARCHITECTURE.md draws the same list as layers).
//! So kernels (`cpu`) know nothing of models, `layers` nothing of `models`, and there is no
//! import cycle. Test code (`#[cfg(test)]` modules) may import anything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom first. A module may import those before it, never those after.
const ORDER: &[&str] = &[
    "setting", "progress", "input", "memory", "cpu", // plumbing and kernels
    "chat", "dialogue", "hub", "tokenizer", "audio", "vision", "weights", // formats and sources
    "layers",    // shared blocks
    "models",    // families behind `Model`
    "metrics",   // scoring models (BERTScore, emotion) on the shared blocks
    "data",      // datasets
    "gguf",      // llama.cpp files into configs and weight sources
    "processor", // prompts and media into model inputs
    "plan",      // memory planning
    "generate",  // sampling and a single-sequence loop
    "checkpoint", "engine", "pipeline", "bench", "serve", "eval", "report",
];

/// Modules outside the order: the crate root re-exports, and the test-only helpers.
const FREE: &[&str] = &["lib", "testing"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's text without its `#[cfg(test)]` modules (each cut at its matching brace; an
/// unbalanced one, from a brace in a string, is cut to the end of the file).
fn non_test_code(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        let Some(open) = after.find('{') else { return out };
        let mut depth = 0usize;
        let close = after[open..].char_indices().find_map(|(j, c)| {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(open + j + 1)
        });
        match close {
            Some(end) => {
                // Keep the line numbers of what follows.
                out.extend(std::iter::repeat_n('\n', after[..end].matches('\n').count()));
                rest = &after[end..];
            }
            None => return out,
        }
    }
    out.push_str(rest);
    out
}

/// Top-level modules named as `crate::NAME` in non-comment code, with their line numbers.
fn imports(code: &str) -> Vec<(usize, String)> {
    let mut out = vec![];
    for (n, line) in code.lines().enumerate() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                out.push((n + 1, name));
            }
        }
    }
    out
}

fn rank(module: &str) -> Option<usize> {
    ORDER.iter().position(|m| *m == module)
}

#[test]
fn modules_import_only_downward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    let mut offences = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        if top == "main" || top == "cli" || FREE.contains(&top.as_str()) {
            continue;
        }
        let own = rank(&top).unwrap_or_else(|| panic!("src/{} is in no layer: add `{top}` to ORDER", rel.display()));
        let text = std::fs::read_to_string(&f).unwrap();
        for (line, name) in imports(&non_test_code(&text)) {
            if name == top || FREE.contains(&name.as_str()) {
                continue;
            }
            let theirs = rank(&name).unwrap_or_else(|| panic!("src/{}:{line}: crate::{name} is in no layer", rel.display()));
            if theirs > own {
                offences.insert(format!("src/{}:{line}", rel.display()), format!("{top} imports {name}, a higher layer"));
            }
        }
    }
    assert!(offences.is_empty(), "imports against the layering:\n{offences:#?}");
}

#[test]
fn the_check_sees_an_upward_import() {
    let code = "use crate::engine::Engine;\n// crate::serve in a comment\nfn f() { crate::models::load(); }\n#[cfg(test)]\nmod tests {\n fn g() { crate::report::x(); }\n}\nuse crate::pipeline;\n";
    let found = imports(&non_test_code(code));
    assert_eq!(found, vec![(1, "engine".to_string()), (3, "models".to_string()), (8, "pipeline".to_string())]);
    assert!(rank("engine") > rank("models") && rank("models") > rank("layers") && rank("layers") > rank("cpu"));
}
