//! Repacking behind the first tokens. A weight read from a mapped file can be used where it
//! lies (its panels staged as a product reaches them, `panels::Staged`) while its packed copy
//! is made here, on one thread, newest first. So a model answers its first token without
//! first writing gigabytes of fresh memory (on a VM the
//! first touch of a page dominates: an f32 3B-width file took 4.8× llama.cpp's time to its
//! first token when every weight was copied before it), and decode reaches the packed
//! kernels' speed a few seconds later. A weight's numbers are the same bits either way.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, Weak};

/// A weight whose packed copy can be made later.
pub trait Repack: Send + Sync {
    /// Makes the packed copy if there is none yet (idempotent; concurrent calls wait for one).
    fn repack(&self);
}

#[derive(Default)]
struct Queue {
    /// Each weight with its size in the file.
    waiting: VecDeque<(usize, Weak<dyn Repack>)>,
    /// Weights being repacked now (by the thread or by `wait`'s callers).
    busy: usize,
}

fn queue() -> &'static (Mutex<Queue>, Condvar) {
    static Q: OnceLock<(Mutex<Queue>, Condvar)> = OnceLock::new();
    Q.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Queue> {
    // A panic while repacking leaves the queue itself consistent.
    queue().0.lock().unwrap_or_else(|e| e.into_inner())
}

/// Queues `w`, `bytes` in the file (a weight dropped before its turn is skipped). Nothing runs
/// until `start`.
pub fn later(w: Weak<dyn Repack>, bytes: usize) {
    lock().waiting.push_back((bytes, w));
    queue().1.notify_all();
}

/// Starts the repacking thread (once per process; later calls do nothing). Called when a model
/// has loaded, so weights joined while loading (q/k/v) are repacked joined, not part by part.
pub fn start() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    if STARTED.swap(true, Ordering::Relaxed) {
        return;
    }
    // Its own one-thread pool: a repack's parallel copy runs there, on one core, not on the
    // rayon workers that a step's other work uses. Normal priority: at nice 10 a busy decode
    // would starve it while products stage their panels (at about half the packed decode
    // speed on the 2-core VM), and it brought the first token no measurably sooner there.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).thread_name(|_| "merg-repack".into()).build();
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    // Without a thread, products keep staging their panels until `wait` repacks them.
    if let Ok(pool) = pool {
        POOL.get_or_init(|| pool).spawn(|| {
            while let Some(w) = next(true) {
                run(&*w);
            }
        });
    }
}

/// The next live weight to repack, marked busy; `None` when the queue is empty and `block` is
/// false. With `block` it waits for one (the thread lives as long as the process).
fn next(block: bool) -> Option<std::sync::Arc<dyn Repack>> {
    let mut q = lock();
    loop {
        // Newest first: a forward pass walks the weights in the order they were built (and
        // queued), and a product that reaches a weight while it is being packed waits for it,
        // so a packer walking the same way paced the first token (2.1 s against 1.0 s on the
        // 3B-width F32 file); walking back, the two meet once. The largest weight (a head of
        // the whole vocabulary, built last) goes last: the first forward pass reaches it at
        // its end and would otherwise wait for its whole packing (the 27B-width file's 1 GB
        // Q6_K head: first token 1.64 s against llama.cpp's 1.47 s).
        q.waiting.retain(|(_, w)| w.strong_count() > 0);
        let largest = q.waiting.iter().enumerate().map(|(i, (bytes, _))| (*bytes, i)).max().map(|(_, i)| i);
        let pick = match (q.waiting.len(), largest) {
            (0, _) => None,
            (n, Some(l)) if n > 1 && l == n - 1 => Some(n - 2),
            (n, _) => Some(n - 1),
        };
        if let Some(i) = pick {
            // (A weight dropped since the count above is skipped.)
            if let Some(w) = q.waiting.remove(i).and_then(|(_, w)| w.upgrade()) {
                q.busy += 1;
                return Some(w);
            }
            continue;
        }
        if !block {
            return None;
        }
        q = queue().1.wait(q).unwrap_or_else(|e| e.into_inner());
    }
}

/// `w.repack()`, then the weight no longer counts as busy, even if repacking panicked (that
/// weight keeps running from the file; the thread goes on with the next).
fn run(w: &dyn Repack) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.repack()));
    lock().busy -= 1;
    queue().1.notify_all();
}

/// Repacks every queued weight now, on this thread and its rayon pool (all cores), and waits
/// for any the thread is doing: afterwards every weight runs packed. For measurements of the
/// steady state (`merg bench`) and tests.
pub fn wait() {
    while let Some(w) = next(false) {
        run(&*w);
    }
    let mut q = lock();
    while q.busy > 0 {
        q = queue().1.wait(q).unwrap_or_else(|e| e.into_inner());
    }
}
