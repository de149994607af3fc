//! This process's resident memory as Linux counts it: anonymous pages (heap, copies, packed
//! weights) apart from file-backed ones (mapped weight files). A weight held twice shows up as
//! both at once; held once, as one or the other. `PeakSampler` reads `/proc/self/status` on a
//! thread every few milliseconds, because the kernel keeps a peak only of the sum (`VmHWM`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Resident bytes, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Resident {
    pub anon_bytes: u64,
    pub file_bytes: u64,
}

impl Resident {
    pub fn total(&self) -> u64 {
        self.anon_bytes + self.file_bytes
    }
}

/// Now, from `/proc/self/status` (`None` off Linux). Shared memory counts as file-backed.
pub fn resident() -> Option<Resident> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<u64> { s.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024) };
    Some(Resident { anon_bytes: kib("RssAnon:")?, file_bytes: kib("RssFile:")? + kib("RssShmem:").unwrap_or(0) })
}

/// Allocator tuning while a model loads, restored to run-time tuning when dropped.
///
/// glibc raises its mmap threshold after each large free (up to 32 MiB), so the tensors a load
/// frees (parts joined into one q/k/v or gate/up weight, a copy on the way to a packed layout)
/// stay resident as holes in the heap: measured 137 MiB kept per layer of a 3B-width Q8_0
/// file whose layers hold 78 MiB. While loading, every block of 4 MiB or more is mapped on its
/// own and so returned when freed. After loading the threshold goes to glibc's ceiling instead
/// (and the heap is trimmed only past 128 MiB free): a step's activations of a few MiB are then
/// reused from the heap, where with the 4 MiB threshold each would be mapped and faulted in
/// afresh (prefill measured 28 % slower that way). Only glibc is tuned; other allocators and
/// systems are left alone.
pub struct Loading(());

impl Loading {
    pub fn begin() -> Self {
        mallopt_pair(4 << 20, 8 << 20);
        Loading(())
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        mallopt_pair(32 << 20, 128 << 20);
    }
}

fn mallopt_pair(mmap_threshold: i32, trim_threshold: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning thresholds.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, mmap_threshold);
        libc::mallopt(libc::M_TRIM_THRESHOLD, trim_threshold);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (mmap_threshold, trim_threshold);
}

/// Peaks seen so far: of each kind, and of their sum (the two need not peak together).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Peak {
    pub anon_bytes: u64,
    pub file_bytes: u64,
    pub total_bytes: u64,
}

#[derive(Default)]
struct Peaks {
    anon: AtomicU64,
    file: AtomicU64,
    total: AtomicU64,
    stop: AtomicBool,
}

impl Peaks {
    fn sample(&self) {
        if let Some(r) = resident() {
            self.anon.fetch_max(r.anon_bytes, Ordering::Relaxed);
            self.file.fetch_max(r.file_bytes, Ordering::Relaxed);
            self.total.fetch_max(r.total(), Ordering::Relaxed);
        }
    }
}

/// Samples `resident()` until dropped.
pub struct PeakSampler {
    peaks: Arc<Peaks>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakSampler {
    /// Starts sampling every `every` (10 ms catches a tensor's transient copy at load speed).
    pub fn start(every: Duration) -> Self {
        let peaks = Arc::new(Peaks::default());
        peaks.sample();
        let p = peaks.clone();
        let thread = std::thread::Builder::new()
            .name("merg-memory".into())
            .spawn(move || {
                while !p.stop.load(Ordering::Relaxed) {
                    p.sample();
                    std::thread::sleep(every);
                }
            })
            .ok();
        PeakSampler { peaks, thread }
    }

    /// The peaks so far (sampling once more now).
    pub fn peak(&self) -> Peak {
        self.peaks.sample();
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Peak { anon_bytes: l(&self.peaks.anon), file_bytes: l(&self.peaks.file), total_bytes: l(&self.peaks.total) }
    }
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.peaks.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn sees_an_allocation_as_anonymous() {
        let s = PeakSampler::start(Duration::from_millis(1));
        let before = s.peak();
        let v = std::hint::black_box(vec![1u8; 64 << 20]);
        std::thread::sleep(Duration::from_millis(20));
        let after = s.peak();
        drop(v);
        assert!(after.anon_bytes >= before.anon_bytes + (60 << 20), "{before:?} → {after:?}");
        assert!(after.total_bytes >= after.anon_bytes);
    }
}
