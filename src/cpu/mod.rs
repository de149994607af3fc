//! CPU kernels with run-time dispatch: AVX-512 where the machine has it, AVX2 + FMA otherwise,
//! portable Rust as the last resort. `MERG_CPU_KERNELS=avx2|portable` forces a lower level (to
//! test the fallbacks, or to compare); the level in use is logged once.

pub mod arena;
pub mod attention;
pub mod bf16;
pub mod blocks;
pub mod elementwise;
pub mod fp32;
pub mod matvec;
pub mod pages;
pub mod panels;
pub mod q4_k;
pub mod q6_k;
pub mod q8_0;
pub mod quant;
pub mod reduce;
pub mod repack;
pub mod roofline;
pub mod team;

use std::sync::OnceLock;

/// Runs `f` on a worker of the rayon pool when called from outside it (and on the CPU). The
/// products of a step run on `team`, but candle's own parallel ops (norms, softmax, casts)
/// called from outside the pool are each injected into it and wait for a worker to wake; from
/// a worker they run in place. A thread that runs many steps should `adopt_thread` once
/// instead: handing each step to a worker costs more than the ops it saves.
pub fn on_pool<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

/// Makes the calling thread worker 0 of a rayon pool of its own (rayon's default thread
/// count, the caller one of them), once; nothing when it already is a worker. Call it on a
/// thread that will run a model step after step (the CLI's main thread, an engine's). Its
/// steps then run in place, where `on_pool` handed each one to a pool worker and slept until
/// it was done: the worker that finished a step spun on `sched_yield` and the pool's other
/// worker, woken by the hand-off, did too, so on two cores three threads took turns with the
/// team's helper. On a 2-core Zen 5 VM at the AVX2 level, decode of the 0.5B shape's Q4_K_M
/// file went from 102-116 to 112-132 tokens/s as the host's bandwidth moved (`sched_switch`es
/// from ~40 to ~7 a token).
/// The pool is never dropped (rayon leaks a pool that adopted its caller anyway).
pub fn adopt_thread() {
    if rayon::current_thread_index().is_some() {
        return;
    }
    let built = rayon::ThreadPoolBuilder::new().use_current_thread().thread_name(|i| format!("merg-pool-{i}")).build();
    // A pool that cannot be built leaves the thread as it was: `on_pool` still works.
    if let Ok(pool) = built {
        std::mem::forget(pool);
    }
}

/// Names the thread count in `RAYON_NUM_THREADS` when the environment does not: the count
/// rayon's pool takes anyway (the machine's available parallelism), so nothing changes size.
/// candle's CPU matmul asks for its thread count on every product, and without the variable
/// it counts the physical cores from `/proc/cpuinfo` each time: about 130 µs a product on a
/// 2-core VM, where prefill attention runs two products per layer and query block (a
/// 256-token prefill of the 0.5B shape: 832/873/806 → 929/883/847 tok/s in three alternating
/// pairs of runs without and with the variable). Its products then also use the pool's threads
/// rather than one per physical core. Call before any thread starts (the environment is
/// process-wide); a program embedding merg decides for itself.
pub fn name_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// The instruction-set level the kernels run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Portable,
    Avx2,
    Avx512,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// The best level this machine supports.
    pub fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                return Level::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Portable
    }

    /// The levels this machine can run, lowest first (tests compare each with the reference).
    pub fn available() -> Vec<Level> {
        [Level::Portable, Level::Avx2, Level::Avx512].into_iter().filter(|l| *l <= Level::detected()).collect()
    }
}

/// The level in use: the detected one, lowered by `MERG_CPU_KERNELS`.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = Level::detected();
        let (level, warning) = choose_level(std::env::var("MERG_CPU_KERNELS").ok().as_deref(), best);
        if let Some(w) = warning {
            tracing::warn!("{w}");
        }
        tracing::info!("cpu kernels: {} (detected {})", level.name(), best.name());
        level
    })
}

/// Whether the CPU is Intel's (CPUID's vendor string): a kernel whose best instruction differs
/// by vendor at the same level chooses by this, so its bits never depend on a timing. Read
/// once: products ask on every call, and CPUID in a VM traps to the hypervisor.
pub(crate) fn intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // Leaf 0 (the vendor string) exists on every x86-64 CPU.
            let id = std::arch::x86_64::__cpuid(0);
            [id.ebx, id.edx, id.ecx] == [u32::from_le_bytes(*b"Genu"), u32::from_le_bytes(*b"ineI"), u32::from_le_bytes(*b"ntel")]
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

static FORCE_GENERIC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `MERG_CPU_KERNELS=generic`: run on the CPU the path a GPU runs, so it is proven without one.
/// Layers with a host fast path (the Gated DeltaNet rule) take their tensor form instead.
pub fn generic() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    FORCE_GENERIC.load(std::sync::atomic::Ordering::Relaxed) || *ENV.get_or_init(|| std::env::var("MERG_CPU_KERNELS").as_deref() == Ok("generic"))
}

/// Sets `generic()` for this process (tests that prove the device path in their own binary).
#[doc(hidden)]
pub fn force_generic() {
    FORCE_GENERIC.store(true, std::sync::atomic::Ordering::Relaxed);
}

static KERNEL_RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts one run of a CPU kernel or host fast path (a packed product, `matvec`, the decode
/// attention, an elementwise pass, the host delta rule), so a test can show that
/// `MERG_CPU_KERNELS=generic` runs none of them.
pub fn note_kernel_run() {
    KERNEL_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// CPU kernel and host fast-path runs in this process so far.
pub fn kernel_runs() -> u64 {
    KERNEL_RUNS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether a layer on `device` may take its host fast path: on the CPU, unless `generic()`.
pub fn host_paths(device: &candle_core::Device) -> bool {
    device.is_cpu() && !generic()
}

/// The level for a `MERG_CPU_KERNELS` value on a machine that detected `best`, and a warning
/// when the value cannot be honoured. A level above `best` is lowered to it: its instructions
/// would fault on this machine.
pub fn choose_level(forced: Option<&str>, best: Level) -> (Level, Option<String>) {
    let forced = match forced {
        None => return (best, None),
        // The device path on the CPU: layers with a host fast path take their tensor form
        // (`generic()`); the kernels that remain run at the portable level.
        Some("portable") | Some("generic") => Level::Portable,
        Some("avx2") => Level::Avx2,
        Some("avx512") => Level::Avx512,
        Some(other) => return (best, Some(format!("MERG_CPU_KERNELS={other:?} is not one of avx512, avx2, portable, generic; using {}", best.name()))),
    };
    if forced > best {
        let w = format!("MERG_CPU_KERNELS={} asks for more than this machine has; using {}", forced.name(), best.name());
        return (best, Some(w));
    }
    (forced, None)
}

#[cfg(test)]
mod level_tests {
    use super::*;

    #[test]
    fn a_forced_level_is_capped_at_the_detected_one() {
        use Level::*;
        assert_eq!(choose_level(None, Avx2), (Avx2, None));
        assert_eq!(choose_level(Some("portable"), Avx2), (Portable, None));
        assert_eq!(choose_level(Some("avx2"), Avx512), (Avx2, None));
        assert_eq!(choose_level(Some("avx512"), Avx512), (Avx512, None));
        let (l, w) = choose_level(Some("avx512"), Avx2);
        assert_eq!(l, Avx2);
        assert!(w.unwrap().contains("using avx2"));
        let (l, w) = choose_level(Some("avx2"), Portable);
        assert_eq!(l, Portable);
        assert!(w.unwrap().contains("avx2 asks for more") );
        let (l, w) = choose_level(Some("sse9"), Avx2);
        assert_eq!(l, Avx2);
        assert!(w.unwrap().contains("\"sse9\" is not one of"));
    }
}

#[cfg(test)]
mod pool_tests {
    use rayon::prelude::*;

    /// An adopted thread is worker 0 of its own pool: `on_pool` runs on it rather than handing
    /// the step to another thread, its parallel ops still run (and may split), and adopting
    /// again changes nothing.
    #[test]
    fn an_adopted_thread_runs_its_steps_in_place() {
        std::thread::spawn(|| {
            let me = std::thread::current().id();
            assert_eq!(rayon::current_thread_index(), None);
            assert_ne!(super::on_pool(&candle_core::Device::Cpu, || std::thread::current().id()), me, "a plain thread hands the step to the pool");
            super::adopt_thread();
            assert_eq!(rayon::current_thread_index(), Some(0));
            super::adopt_thread();
            assert_eq!(rayon::current_thread_index(), Some(0));
            assert_eq!(super::on_pool(&candle_core::Device::Cpu, || std::thread::current().id()), me);
            assert_eq!((0..10_000u64).into_par_iter().sum::<u64>(), 49_995_000);
        })
        .join()
        .expect("the adopted thread's checks");
    }
}

/// What the packed kernels' tests share.
#[cfg(test)]
pub(crate) mod testing {
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Module, Result};

    /// A random `[m, k]` input, an `[n, k]` weight quantized to `dtype` (its blocks' bytes) and
    /// candle's own product of the two (which quantizes the input as ggml does).
    pub fn quantized_case(dtype: GgmlDType, m: usize, k: usize, n: usize) -> Result<(Vec<f32>, Vec<u8>, Vec<Vec<f32>>)> {
        let seed = (m * 1_000_003 + k * 1009 + n) as u64;
        let x = crate::testing::randn(seed, (m, k), 1.)?;
        let q = QTensor::quantize(&crate::testing::randn(seed + 1, (n, k), 1.)?, dtype)?;
        let blocks = q.data()?.to_vec();
        let want = QMatMul::from_qtensor(q)?.forward(&x)?.to_vec2::<f32>()?;
        Ok((x.flatten_all()?.to_vec1()?, blocks, want))
    }

    /// A packed quantized format against candle's own product, for each `(m, k, n)`: `pack`
    /// the blocks, check the bytes it holds (`bytes(n, k)`), and `matmul` within 1e-4.
    pub fn packed_matches_candle<P>(dtype: GgmlDType, shapes: &[(usize, usize, usize)], pack: impl Fn(&[u8], usize, usize) -> Option<P>, held: impl Fn(&P) -> usize, bytes: impl Fn(usize, usize) -> usize, matmul: impl Fn(&P, &[f32], usize, &mut [f32])) -> Result<()> {
        for &(m, k, n) in shapes {
            let (x, blocks, want) = quantized_case(dtype, m, k, n)?;
            let packed = pack(&blocks, n, k).expect("whole blocks");
            assert_eq!(held(&packed), bytes(n, k), "{dtype:?} [{n}, {k}]: bytes held");
            let mut got = vec![0f32; m * n];
            matmul(&packed, &x, m, &mut got);
            assert_close(&want, &got, 1e-4, &format!("{dtype:?} {m}x{k}x{n}"));
        }
        Ok(())
    }

    /// `got` (`[m, n]` row-major) equals `want` within `rel` of its largest magnitude.
    pub fn assert_close(want: &[Vec<f32>], got: &[f32], rel: f32, what: &str) {
        let scale = want.iter().flatten().fold(1f32, |a, &b| a.max(b.abs()));
        let n = want.first().map_or(0, Vec::len);
        for (r, row) in want.iter().enumerate() {
            for (j, w) in row.iter().enumerate() {
                assert!((w - got[r * n + j]).abs() <= rel * scale, "{what} [{r},{j}]: {w} vs {}", got[r * n + j]);
            }
        }
    }
}
