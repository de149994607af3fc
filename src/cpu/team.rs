//! A team of spinning threads for the short parallel products of a decode step.
//!
//! A decode step is about a hundred products of well under a millisecond each, separated by
//! short single-threaded work (norms, rotary, attention). Between two products rayon's idle
//! workers go to sleep on a futex, and waking one costs tens of microseconds on a VM — as
//! much as a fifth of the step (measured on the 2-core box: 96 bf16 layer products with
//! 50 µs of work between them took 5 ms more than the 4.8 ms of work). So the products run
//! on this team instead: `rayon::current_num_threads() − 1` helper threads that, after a
//! job, spin on one atomic word for a while (pausing, then yielding the core to any other
//! runnable thread) before they sleep, and the calling thread, which takes tasks too. One
//! caller owns the team at a time; a second concurrent caller runs on rayon instead.
//!
//! The job word packs the job's epoch, its task count and the next unclaimed task, so one
//! `fetch_add` both claims a task and says which job it belongs to: a helper that wakes late
//! can never run a task of a finished job, and the caller returns only when every claimed
//! task is done (nothing borrowed by the job is used after that).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

const FIELD: u32 = 20;
const MASK: u64 = (1 << FIELD) - 1;
/// Spinning with `pause` this long after a job, then with `sched_yield` until `SLEEP_AFTER`.
const PAUSE_FOR: Duration = Duration::from_micros(100);
const SLEEP_AFTER: Duration = Duration::from_millis(2);

type Body = dyn Fn(usize) + Sync;

struct Team {
    helpers: usize,
    /// epoch << 40 | tasks << 20 | next task to claim.
    word: AtomicU64,
    done: AtomicUsize,
    /// The current job's body; written by the owner only while no task of the previous job
    /// can still be claimed, read by a thread only after it claimed a task of this job.
    body: UnsafeCell<Option<*const Body>>,
    /// A task panicked (on any thread) in the current job.
    panicked: AtomicBool,
    owned: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `body` is only written by the owner (the `owned` flag) between jobs and only read
// under the claim protocol above; every other field is atomic or a lock.
unsafe impl Sync for Team {}
unsafe impl Send for Team {}

fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();
    *TEAM.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        if helpers == 0 {
            return None;
        }
        let team: &'static Team = Box::leak(Box::new(Team {
            helpers,
            word: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            body: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            owned: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for i in 0..helpers {
            let spawned = std::thread::Builder::new().name(format!("merg-team-{i}")).spawn(move || team.help());
            if spawned.is_err() {
                // Without its helpers the team would run every task on the caller.
                return None;
            }
        }
        Some(team)
    })
}

/// Runs `body(0)`, …, `body(tasks − 1)` in parallel and returns when all are done.
pub fn run(tasks: usize, body: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 {
        (0..tasks).for_each(body);
        return;
    }
    match team() {
        // (`next` can pass `tasks` by one claim per thread, so both must fit their field.)
        Some(t) if tasks + t.helpers < MASK as usize && !t.owned.swap(true, Acquire) => {
            let panicked = t.job(tasks, body);
            t.owned.store(false, Release);
            assert!(!panicked, "a parallel task panicked");
        }
        _ => (0..tasks).into_par_iter().for_each(body),
    }
}

/// `body(i, chunk)` for the `i`-th run of `len` items of `out` (the last may be shorter), in
/// parallel.
pub fn chunks_mut<T: Send>(out: &mut [T], len: usize, body: impl Fn(usize, &mut [T]) + Sync) {
    struct Ptr<T>(*mut T);
    impl<T> Ptr<T> {
        fn at(&self, i: usize) -> *mut T {
            self.0.wrapping_add(i)
        }
    }
    // SAFETY: the tasks below touch disjoint runs of `out`, whose items may cross threads.
    unsafe impl<T: Send> Sync for Ptr<T> {}
    let (total, base) = (out.len(), Ptr(out.as_mut_ptr()));
    let len = len.max(1);
    run(total.div_ceil(len), &|i| {
        let start = i * len;
        // SAFETY: run `i` is `out[start..start + n]`, disjoint from every other run, and `out`
        // is borrowed mutably until `run` returns, after every task has finished.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), len.min(total - start)) };
        body(i, chunk);
    });
}

/// `body(a, b)` over `0..units` in runs of at most `grain` units, on every thread of the team:
/// each thread walks its own contiguous share from the front and, once it is through, takes
/// runs off the back of the share with the most left. A decode step's product split in fixed
/// halves waited for the slower thread: on a 2-core Zen 5 VM the helper's half took ~9 % longer
/// on average than the caller's (same bytes), and the caller spun through the difference
/// (up to ~1 ms of a ~7 ms step while the host gave ~70 GB/s). Shares stay sequential streams
/// for the prefetchers except at their tails.
pub fn split(units: usize, grain: usize, body: &(dyn Fn(usize, usize) + Sync)) {
    let grain = grain.max(1);
    let chunks = units.div_ceil(grain);
    let threads = rayon::current_num_threads().clamp(1, chunks.max(1));
    if threads == 1 {
        if units > 0 {
            body(0, units);
        }
        return;
    }
    let shares: Vec<Share> = (0..threads).map(|t| Share::new(t * chunks / threads, (t + 1) * chunks / threads)).collect();
    let chunk = |c: usize| body(c * grain, ((c + 1) * grain).min(units));
    run(threads, &|t| {
        while let Some(c) = shares[t].front() {
            chunk(c);
        }
        // The fullest other share, until none has a run left.
        while let Some((v, _)) = (0..threads).filter(|&v| v != t).map(|v| (v, shares[v].left())).filter(|&(_, left)| left > 0).max_by_key(|&(_, left)| left) {
            if let Some(c) = shares[v].back() {
                chunk(c);
            }
        }
    });
}

/// A thread's share of `split`'s runs: `front << 32 | back`, the runs `front..back` not yet
/// taken (the owner takes the front, others the back), on a cache line of its own.
#[repr(align(64))]
struct Share(AtomicU64);

impl Share {
    fn new(front: usize, back: usize) -> Share {
        Share(AtomicU64::new((front as u64) << 32 | back as u64))
    }

    fn left(&self) -> usize {
        let w = self.0.load(Relaxed);
        ((w & 0xffff_ffff) as usize).saturating_sub((w >> 32) as usize)
    }

    /// Takes the first run left.
    fn front(&self) -> Option<usize> {
        self.take(|f, b| (f < b).then(|| (f, (f + 1) << 32 | b)))
    }

    /// Takes the last run left.
    fn back(&self) -> Option<usize> {
        self.take(|f, b| (f < b).then(|| (b - 1, f << 32 | (b - 1))))
    }

    fn take(&self, next: impl Fn(u64, u64) -> Option<(u64, u64)>) -> Option<usize> {
        let mut w = self.0.load(Relaxed);
        loop {
            let (run, to) = next(w >> 32, w & 0xffff_ffff)?;
            match self.0.compare_exchange_weak(w, to, Acquire, Relaxed) {
                Ok(_) => return Some(run as usize),
                Err(now) => w = now,
            }
        }
    }
}

impl Team {
    /// Posts the job, takes part, waits for every task; whether one panicked.
    fn job(&self, tasks: usize, body: &(dyn Fn(usize) + Sync)) -> bool {
        // SAFETY: only the lifetime is erased; the pointer is used only by tasks of this job,
        // and this function returns after all of them.
        let ptr: *const Body = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Body>(body) };
        // SAFETY: every task of the previous job is done and its count was reached, so no
        // thread can claim one and read `body` (claims now see `next ≥ tasks`).
        unsafe { *self.body.get() = Some(ptr) };
        self.done.store(0, Relaxed);
        self.panicked.store(false, Relaxed);
        let epoch = (self.word.load(Relaxed) >> (2 * FIELD)) + 1;
        self.word.store(epoch << (2 * FIELD) | (tasks as u64) << FIELD, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
        self.claim_all();
        let mut spins = 0u32;
        while self.done.load(Acquire) < tasks {
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        self.panicked.load(Relaxed)
    }

    /// Claims and runs tasks of the current job (and of any posted meanwhile) until none is
    /// left; returns the epoch the last claim saw. (Epochs wrap at 2^24: only inequality
    /// matters.)
    fn claim_all(&self) -> u64 {
        loop {
            let w = self.word.fetch_add(1, AcqRel);
            let (e, tasks, i) = (w >> (2 * FIELD), (w >> FIELD) & MASK, w & MASK);
            if i >= tasks {
                return e;
            }
            // SAFETY: task `i` of the current job is claimed, so the job is not finished and
            // its body (written before the word that was claimed from) is alive.
            let body = unsafe { (*self.body.get()).expect("a job's body is set before it is posted") };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*body)(i as usize) })).is_err() {
                self.panicked.store(true, Relaxed);
            }
            self.done.fetch_add(1, Release);
        }
    }

    /// A helper's life: wait for a new epoch, take tasks, repeat.
    fn help(&self) {
        let mut seen = 0u64;
        loop {
            let since = Instant::now();
            let mut spins = 0u32;
            loop {
                if self.word.load(Acquire) >> (2 * FIELD) != seen {
                    break;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(64) {
                    std::hint::spin_loop();
                    continue;
                }
                let idle = since.elapsed();
                if idle < PAUSE_FOR {
                    continue;
                }
                if idle < SLEEP_AFTER {
                    std::thread::yield_now();
                    continue;
                }
                self.sleep(seen);
            }
            seen = self.claim_all();
        }
    }

    fn sleep(&self, seen: u64) {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, SeqCst);
        // Checked after counting ourselves in: a job posted before this load is seen here, one
        // posted after it sees `sleepers > 0` and notifies under the lock.
        while self.word.load(SeqCst) >> (2 * FIELD) == seen {
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        self.sleepers.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_and_chunks_cover_the_output() {
        for tasks in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            run(tasks, &|i| {
                hits[i].fetch_add(1, Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{tasks} tasks");
        }
        let mut out = vec![0usize; 103];
        chunks_mut(&mut out, 10, |i, c| c.iter_mut().enumerate().for_each(|(j, v)| *v = i * 10 + j));
        assert_eq!(out, (0..103).collect::<Vec<_>>());
    }

    #[test]
    fn concurrent_callers_and_sleeping_helpers_all_finish() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        if round % 50 == 49 {
                            // Long enough for the helpers to go to sleep.
                            std::thread::sleep(SLEEP_AFTER * 2);
                        }
                        let sum = AtomicUsize::new(0);
                        run(64, &|i| {
                            sum.fetch_add(i + t, Relaxed);
                        });
                        assert_eq!(sum.load(Relaxed), 64 * 63 / 2 + 64 * t);
                    }
                });
            }
        });
    }

    /// `split` covers every unit once, in runs of at most `grain` that never cross a run
    /// boundary, for unit counts on and off the grain and fewer runs than threads.
    #[test]
    fn split_covers_every_unit_once() {
        for (units, grain) in [(0, 4), (1, 4), (3, 4), (9496, 298), (56, 4), (57, 4), (1000, 1), (7, 100)] {
            let hits: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            split(units, grain, &|a, b| {
                assert!(a < b && b <= units && b - a <= grain.max(1) && (a % grain.max(1) == 0 || grain >= units), "{units}/{grain}: run {a}..{b}");
                (a..b).for_each(|i| {
                    hits[i].fetch_add(1, Relaxed);
                });
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{units} units, grain {grain}");
        }
    }

    /// A share's front and back never hand out one run twice, however the two ends race.
    #[test]
    fn a_shares_two_ends_never_take_one_run_twice() {
        let share = Share::new(3, 20_003);
        let taken: Vec<AtomicUsize> = (0..20_003).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            s.spawn(|| {
                while let Some(c) = share.front() {
                    taken[c].fetch_add(1, Relaxed);
                }
            });
            while let Some(c) = share.back() {
                taken[c].fetch_add(1, Relaxed);
            }
        });
        assert_eq!(share.left(), 0);
        assert!(taken[..3].iter().all(|t| t.load(Relaxed) == 0) && taken[3..].iter().all(|t| t.load(Relaxed) == 1));
    }

    #[test]
    fn a_panicking_task_is_reported_and_the_team_survives() {
        let r = std::panic::catch_unwind(|| run(8, &|i| assert!(i != 5, "task five")));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        run(8, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 8);
    }
}
