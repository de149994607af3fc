//! Which kernel runs a block-quantized weight on this CPU at the level in use: the one place
//! that decides, for the linear layer that repacks and for `merg bench`, which names the
//! tensors left to candle's kernels.

use candle_core::quantized::GgmlDType;

/// The packed kernels that can hold a weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 VNNI panels (`q8_0`, `q4_k` for Q4_K and Q5_K, `q6_k`).
    Vnni,
    /// AVX2 row-major blocks (`blocks`), at AVX2 and above.
    Blocks,
}

/// The packed kernel for `dtype`, or `None` where candle's own kernels run it.
pub fn kernel(dtype: GgmlDType) -> Option<Kernel> {
    if matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K) && super::q8_0::available() {
        return Some(Kernel::Vnni);
    }
    (super::blocks::Format::of(dtype).is_some() && super::blocks::available()).then_some(Kernel::Blocks)
}

/// Whether a packed kernel runs `dtype` at the level in use.
pub fn has_kernel(dtype: GgmlDType) -> bool {
    kernel(dtype).is_some()
}
