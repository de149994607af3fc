//! CPU kernels with run-time dispatch: AVX-512 where the machine has it, AVX2 + FMA otherwise,
//! portable Rust as the last resort. `MERG_CPU_KERNELS=avx2|portable` forces a lower level (to
//! test the fallbacks, or to compare); the level in use is logged once.

pub mod attention;
pub mod bf16;
pub mod elementwise;
pub mod matvec;
pub mod pages;
pub mod panels;
pub mod q4_k;
pub mod q8_0;
pub mod roofline;
pub mod team;

use std::sync::OnceLock;

/// Runs `f` on a worker of the rayon pool when called from outside it (and on the CPU). A
/// decode step is a few hundred short parallel products: from outside the pool each one would
/// wake a worker and then the caller again; from a worker it is a join with the other
/// workers, which are still spinning from the last one.
pub fn on_pool<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| f())
    } else {
        f()
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
        let forced = match std::env::var("MERG_CPU_KERNELS").ok().as_deref() {
            Some("portable") => Some(Level::Portable),
            Some("avx2") => Some(Level::Avx2),
            Some("avx512") => Some(Level::Avx512),
            Some(other) => {
                tracing::warn!("MERG_CPU_KERNELS={other:?} is not one of avx512, avx2, portable; using {}", best.name());
                None
            }
            None => None,
        };
        let level = forced.map(|f| f.min(best)).unwrap_or(best);
        tracing::info!("cpu kernels: {} (detected {})", level.name(), best.name());
        level
    })
}
