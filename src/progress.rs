//! Progress of long work (loading and quantizing weights, hashing a model blob) for whoever
//! shows it. The library only counts: a front end installs a `Reporter` once (the command line
//! draws terminal bars with it), and without one every task is free and silent. This keeps
//! terminal code out of the loaders and lets another program show progress its own way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// Shows tasks; called from any thread.
pub trait Reporter: Send + Sync {
    /// A task named `what` of `total` `unit`s (None: unknown total) begins, `start` of them
    /// already done (a resumed run: the rate counts from here).
    fn begin(&self, what: &str, total: Option<u64>, unit: &'static str, start: u64) -> Box<dyn Shown>;
}

/// One task as the reporter shows it.
pub trait Shown: Send + Sync {
    /// `done` units are complete.
    fn update(&self, done: u64);
    /// A line to show beside the task (a failed item), without breaking its display.
    fn note(&self, line: &str);
    /// The task is over (complete or abandoned).
    fn end(&self);
}

static REPORTER: RwLock<Option<Arc<dyn Reporter>>> = RwLock::new(None);

/// Installs the reporter every later task goes to (replacing any before it).
pub fn set_reporter(r: Arc<dyn Reporter>) {
    if let Ok(mut g) = REPORTER.write() {
        *g = Some(r);
    }
}

/// Whether tasks are shown (a reporter is installed).
pub fn reporting() -> bool {
    REPORTER.read().map(|g| g.is_some()).unwrap_or(false)
}

/// A running task; it ends when dropped, so an error on the way ends it too.
pub struct Task {
    shown: Option<Box<dyn Shown>>,
    done: AtomicU64,
}

/// Starts a task with the installed reporter (a silent one without).
pub fn task(what: &str, total: Option<u64>, unit: &'static str) -> Arc<Task> {
    resumed(what, total, unit, 0)
}

/// A task `start` units into its work.
pub fn resumed(what: &str, total: Option<u64>, unit: &'static str, start: u64) -> Arc<Task> {
    let shown = REPORTER.read().ok().and_then(|g| g.as_ref().map(|r| r.begin(what, total, unit, start)));
    Arc::new(Task { shown, done: AtomicU64::new(start) })
}

impl Task {
    /// `n` more units are done.
    pub fn advance(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(s) = &self.shown {
            s.update(done);
        }
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// A line beside the task, shown only where the task is.
    pub fn note(&self, line: &str) {
        if let Some(s) = &self.shown {
            s.note(line);
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        if let Some(s) = &self.shown {
            s.end();
        }
    }
}

/// A reporter that writes down what it is shown, for tests of the loaders' counting.
#[doc(hidden)]
#[derive(Default)]
pub struct Recorder {
    /// Every task, in start order.
    pub tasks: std::sync::Mutex<Vec<Recorded>>,
}

#[doc(hidden)]
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub what: String,
    pub total: Option<u64>,
    pub unit: &'static str,
    pub done: u64,
    pub notes: Vec<String>,
    pub ended: bool,
}

struct RecordedTask(Arc<Recorder>, usize);

impl Reporter for Arc<Recorder> {
    fn begin(&self, what: &str, total: Option<u64>, unit: &'static str, start: u64) -> Box<dyn Shown> {
        let mut t = self.tasks.lock().unwrap();
        t.push(Recorded { what: what.into(), total, unit, done: start, notes: vec![], ended: false });
        Box::new(RecordedTask(self.clone(), t.len() - 1))
    }
}

impl Shown for RecordedTask {
    fn update(&self, done: u64) {
        self.0.tasks.lock().unwrap()[self.1].done = done;
    }

    fn note(&self, line: &str) {
        self.0.tasks.lock().unwrap()[self.1].notes.push(line.into());
    }

    fn end(&self) {
        self.0.tasks.lock().unwrap()[self.1].ended = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_counts_and_ends_when_dropped() {
        let rec = Arc::new(Recorder::default());
        set_reporter(Arc::new(rec.clone()));
        {
            let t = resumed("hashing", Some(10), "bytes", 1);
            t.advance(3);
            t.note("half way");
            t.advance(6);
            assert_eq!(t.done(), 10);
            assert!(!rec.tasks.lock().unwrap().iter().any(|r| r.what == "hashing" && r.ended));
        }
        let got = rec.tasks.lock().unwrap().iter().find(|r| r.what == "hashing").cloned().unwrap();
        assert_eq!(got, Recorded { what: "hashing".into(), total: Some(10), unit: "bytes", done: 10, notes: vec!["half way".into()], ended: true });
    }
}
