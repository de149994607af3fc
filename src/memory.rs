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

/// What loading a model takes: the weights as held once loaded (on the device that runs them),
/// and the host's peak while loading (with the weights on the CPU, they are part of it; onto a
/// GPU, the host only passes each tensor through).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadCost {
    pub text_bytes: u64,
    pub vision_bytes: u64,
    pub host_peak_bytes: u64,
}

/// Host memory a loaded model's process takes beside its weights and any tensor in flight:
/// code, tokenizer, the files' metadata, thread stacks (measured about 150 MiB for a 152k-token
/// vocabulary).
pub const RUNTIME_BYTES: u64 = 256 << 20;

/// Keeps freed heap memory in one place: glibc's allocator gives each thread that allocates
/// its own arena (up to 8 per core) and each arena keeps the largest working set it has seen,
/// so the buffers of a prefill, allocated on whichever worker ran the op, can be held several
/// times over. `merg bench` on a 3B-width Q8_0 file (256-token prompt, 2 threads, AVX2 VM):
/// 12 MiB less at the resident peak on a quiet machine, 94 MiB less in a run beside other
/// work; decode and prefill speed unchanged (three alternating runs). The share grows with
/// the thread count. Call before any thread starts (it only bounds arenas made later); a
/// program embedding merg decides for itself. Nothing off glibc.
pub fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning; M_ARENA_MAX takes any positive value.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Bytes free on `device`: free GPU memory, or MemAvailable on the host (4 GiB where unknown).
/// Sizes derived from configs, flags and files are checked against it before allocating,
/// because a failed allocation aborts the process instead of returning an error.
pub fn available_memory(device: &candle_core::Device) -> anyhow::Result<u64> {
    if device.is_cuda() {
        #[cfg(feature = "cuda")]
        {
            use anyhow::Context;
            device.synchronize().context("querying free GPU memory")?;
            let (free, _total) = cudarc::driver::result::mem_get_info().context("querying free GPU memory")?;
            return Ok(free as u64 + gpu_pool::slack(device));
        }
    }
    // CPU: MemAvailable from /proc/meminfo; elsewhere assume 4 GiB.
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = info.lines().find(|l| l.starts_with("MemAvailable:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|n| n.parse::<u64>().ok());
    Ok(kb.map(|k| k * 1024).unwrap_or(4 << 30))
}

/// On a GPU, keeps the memory tensors free in the device's allocation pool (called when a
/// device is opened; nothing on the CPU). candle allocates from CUDA's stream-ordered pool,
/// which by default hands freed memory back to the driver at every synchronisation (release
/// threshold 0): each decode step, which reads its sampled token back, then maps its buffers
/// anew. merg keeps it pooled, as PyTorch's caching allocator does, and counts the pooled
/// slack as free (`available_memory`).
pub fn keep_freed_memory(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    gpu_pool::keep_freed(device);
    let _ = device;
}

/// On a GPU, hands the pool's unused memory back to the driver (nothing on the CPU). Called
/// before the one large allocation, the KV pool: the pooled slack counts as free
/// (`available_memory`), but it lies in the pieces earlier tensors freed (dummy weights pass
/// through f32 on the device), which blocks of another size may not fit. On the H200 the
/// automatic KV pool of Qwen3-VL 32B failed to allocate with about 29 GiB of the card unused.
pub fn release_pooled(device: &candle_core::Device) {
    #[cfg(feature = "cuda")]
    gpu_pool::trim(device);
    let _ = device;
}

/// Bytes in use on a GPU (total less free, every process's), for reports; None on the CPU.
pub fn device_used(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
        return Some((total - free) as u64);
    }
    let _ = device;
    None
}

/// The default CUDA memory pool of a device (the one `cuMemAllocAsync` draws from).
#[cfg(feature = "cuda")]
mod gpu_pool {
    use cudarc::driver::sys::{self, CUmemPool_attribute as Attr};

    fn pool(device: &candle_core::Device) -> Option<sys::CUmemoryPool> {
        let stream = device.as_cuda_device().ok()?.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(pool)
    }

    fn attr(pool: sys::CUmemoryPool, a: Attr) -> u64 {
        let mut v: u64 = 0;
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, a, &mut v as *mut u64 as *mut std::ffi::c_void) };
        if r == sys::CUresult::CUDA_SUCCESS { v } else { 0 }
    }

    pub fn keep_freed(device: &candle_core::Device) {
        if let Some(p) = pool(device) {
            let mut keep = u64::MAX;
            unsafe { sys::cuMemPoolSetAttribute(p, Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep as *mut u64 as *mut std::ffi::c_void) };
        }
    }

    /// Releases every pooled byte no tensor holds.
    pub fn trim(device: &candle_core::Device) {
        if let Some(p) = pool(device) {
            let _ = device.synchronize();
            unsafe { sys::cuMemPoolTrimTo(p, 0) };
        }
    }

    /// Pooled bytes no tensor holds: reserved less used.
    pub fn slack(device: &candle_core::Device) -> u64 {
        pool(device).map_or(0, |p| attr(p, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).saturating_sub(attr(p, Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)))
    }
}

/// Refuses a load whose `cost` does not fit what is free, before anything is allocated: the
/// host's peak against the host's free memory, and on a GPU the weights against the device's.
/// `what` names the files in the message.
pub fn check_load(what: &str, cost: LoadCost, device: &candle_core::Device) -> anyhow::Result<()> {
    let host = available_memory(&candle_core::Device::Cpu)?;
    if cost.host_peak_bytes > host {
        let how = match device.is_cpu() {
            true => format!("{} of weights plus what is in flight", gib(cost.text_bytes + cost.vision_bytes)),
            false => "each tensor passes through it on the way to the GPU".to_string(),
        };
        anyhow::bail!("{what} needs {} of host memory to load ({how}) but {} is available", gib(cost.host_peak_bytes), gib(host));
    }
    if !device.is_cpu() {
        let free = available_memory(device)?;
        let need = cost.text_bytes + cost.vision_bytes;
        if need > free {
            anyhow::bail!("{what} needs {} of GPU memory for its weights but {} is free", gib(need), gib(free));
        }
    }
    Ok(())
}

/// GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Blocks of a sliding-window layer group one sequence holds between steps, at most: the
/// `window − 1` tokens before its next query, block-aligned (a partial block at each end).
/// The engine's pool split and `merg plan` both count it.
pub fn window_blocks(window: usize, block_size: usize) -> usize {
    window.saturating_sub(1).div_ceil(block_size.max(1)) + 2
}

/// Bytes of one K (or V) row of `width` values stored as 8-bit codes: a byte a value and an
/// f16 scale per 32 values (per head where 32 does not divide the row). The engine's pool and
/// `merg plan` both count it.
pub fn q8_row_bytes(width: usize, head_dim: usize) -> u64 {
    (width + 2 * width / q8_group(width, head_dim)) as u64
}

/// Values sharing one scale in an 8-bit K/V row.
pub fn q8_group(width: usize, head_dim: usize) -> usize {
    if width.is_multiple_of(32) { 32 } else { head_dim.max(1) }
}

/// Memory kept back from the K/V cache for activations, workspace and the runtime.
pub const DEFAULT_RESERVE: u64 = 3 << 29;

/// The K/V cache a loaded model gets by default: what is `available` after loading, less
/// `reserve`, less the recurrent states' share for hybrid models (the engine gives states a
/// quarter of the pool's size, so the pool takes four fifths), and never more than
/// `max_tokens` tokens (more could never be used).
pub fn auto_kv_bytes(available: u64, reserve: u64, kv_per_token: u64, max_tokens: u64, hybrid: bool) -> u64 {
    let usable = available.saturating_sub(reserve);
    let share = if hybrid { usable / 5 * 4 } else { usable };
    share.min(kv_per_token.saturating_mul(max_tokens))
}

/// Allocator tuning while a model loads, restored to run-time tuning when dropped.
///
/// glibc raises its mmap threshold after each large free (up to 32 MiB), so the tensors a load
/// frees (parts joined into one q/k/v or gate/up weight, a copy on the way to a packed layout)
/// stay resident as holes in the heap: measured 137 MiB kept per layer of a 3B-width Q8_0
/// file whose layers hold 78 MiB. While loading, every block of 256 KiB or more is mapped on
/// its own and so returned when freed (heap holes of freed megabyte-sized parts were not reused
/// well either: 7.3 MiB kept per layer holding 3.9 on a file of 1 MiB tensors). After loading
/// the threshold goes to glibc's ceiling instead (and the heap is trimmed only past 128 MiB free): a step's activations of a few MiB are then
/// reused from the heap, where with the 4 MiB threshold each would be mapped and faulted in
/// afresh (prefill measured 28 % slower that way). glibc maps every block over its ceiling
/// (32 MiB) whatever the threshold says, and a 1024-token prefill's MLP activations (45 MiB at
/// an 11008-wide MLP) or four keyframes' vision-tower activations are such blocks: mapped,
/// faulted in and unmapped again on every step. So after loading nothing is mapped by malloc at
/// all (`M_MMAP_MAX` 0): those blocks come from the heap too and are reused, and the trim
/// threshold still gives a free top of heap back. Only glibc is tuned; other allocators and
/// systems are left alone.
pub struct Loading(());

impl Loading {
    pub fn begin() -> Self {
        mallopt_pair(256 << 10, 1 << 20);
        mallopt(libc_m_mmap_max(), GLIBC_MMAP_MAX_DEFAULT);
        trim();
        Loading(())
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        mallopt_pair(32 << 20, 128 << 20);
        mallopt(libc_m_mmap_max(), 0);
        trim();
    }
}

/// glibc's default cap on blocks served by mmap (`DEFAULT_MMAP_MAX`).
const GLIBC_MMAP_MAX_DEFAULT: i32 = 65536;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn libc_m_mmap_max() -> i32 {
    libc::M_MMAP_MAX
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn libc_m_mmap_max() -> i32 {
    0
}

fn mallopt(param: i32, value: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tuning parameters.
    unsafe {
        libc::mallopt(param, value);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (param, value);
}

/// Gives the heap's free pages back to the system, wherever they lie (`malloc_trim`): parsing
/// a GGUF header and rebuilding its tokenizer frees some 80 MiB of small allocations
/// (measured with a 152k-token vocabulary) that would otherwise stay resident beside the
/// weights.
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn mallopt_pair(mmap_threshold: i32, trim_threshold: i32) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        mallopt(libc::M_MMAP_THRESHOLD, mmap_threshold);
        mallopt(libc::M_TRIM_THRESHOLD, trim_threshold);
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

    /// A load larger than the free memory is refused by name, with both sizes.
    #[test]
    fn a_load_that_does_not_fit_is_refused() {
        let cost = LoadCost { text_bytes: 1 << 50, vision_bytes: 0, host_peak_bytes: (1 << 50) + (1 << 30) };
        let e = check_load("big.gguf", cost, &candle_core::Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("big.gguf needs 1048577.00 GiB of host memory") && e.contains("is available"), "{e}");
        assert!(check_load("small.gguf", LoadCost { text_bytes: 1 << 20, vision_bytes: 0, host_peak_bytes: 2 << 20 }, &candle_core::Device::Cpu).is_ok());
    }

    /// Resident memory is the whole process's, and the other tests of this binary allocate and
    /// free beside this one (a peak another test left above the baseline once hid most of the
    /// 64 MiB), so the check runs again in a child process of this binary running it alone.
    #[test]
    fn sees_an_allocation_as_anonymous() {
        const CHILD: &str = "MERG_MEMORY_TEST_CHILD";
        if std::env::var_os(CHILD).is_none() {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args(["--exact", "memory::tests::sees_an_allocation_as_anonymous", "--test-threads", "1", "--nocapture"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success() && text.contains("1 passed"), "{text}");
            return;
        }
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
