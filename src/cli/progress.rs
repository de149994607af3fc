//! Terminal progress bars for the library's long tasks (`merg::progress`): loading and
//! quantizing weights, hashing a model blob, evaluating a split. Installed only when stderr is
//! a terminal and `--quiet` was not given, so logs and pipes get no bar characters.

use std::io::IsTerminal;
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};

use merg::progress::{Reporter, Shown};

struct Bars;

struct Bar(ProgressBar);

/// Shows every later task as a bar on stderr, if stderr is a terminal and `quiet` is off.
pub fn install(quiet: bool) {
    if !quiet && std::io::stderr().is_terminal() {
        merg::progress::set_reporter(Arc::new(Bars));
    }
}

impl Reporter for Bars {
    fn begin(&self, what: &str, total: Option<u64>, unit: &'static str, start: u64) -> Box<dyn Shown> {
        let (bar, template) = match (total, unit) {
            (Some(n), "bytes") => (ProgressBar::new(n), "{msg}\n{bar:40} {bytes}/{total_bytes}  {bytes_per_sec}, ETA {eta}"),
            (Some(n), _) => (ProgressBar::new(n), "{msg}\n{bar:40} {pos}/{len} UNIT  {elapsed} elapsed, ETA {eta}"),
            (None, _) => (ProgressBar::new_spinner(), "{spinner} {msg}: {pos} UNIT  {elapsed}"),
        };
        let style = ProgressStyle::with_template(&template.replace("UNIT", unit)).unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_message(what.to_string());
        bar.set_position(start);
        // A resumed task's rate counts from here, not from the work done before.
        bar.reset_eta();
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Box::new(Bar(bar))
    }
}

impl Shown for Bar {
    fn update(&self, done: u64) {
        self.0.set_position(done);
    }

    fn note(&self, line: &str) {
        self.0.println(line);
    }

    fn end(&self) {
        self.0.finish_and_clear();
    }
}
