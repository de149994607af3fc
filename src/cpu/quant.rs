//! Which block formats a packed kernel of this crate runs at the level in use; the others go
//! through candle's own quantized kernels. `merg bench` asks, to name the tensors that fall
//! back.

use candle_core::quantized::GgmlDType;

/// True when a packed kernel runs `dtype`'s blocks at the level in use. Dense types (F32,
/// BF16, F16) are not block types: callers handle them before asking.
pub fn has_kernel(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::Q8_0 | GgmlDType::Q4K) && crate::cpu::q8_0::available()
}
