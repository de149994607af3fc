//! How the pool stores one layer's K or V rows: in the model's float dtype, or as 8-bit codes
//! with one scale per 32 values (llama.cpp's `q8_0` cache type: about 1.06 bytes a value
//! instead of 2 for bf16). The codes are plain tensors (u8 offset by 128, f16 scales), so
//! every device writes and reads them with its own ops: quantized on the way in, dequantized
//! when a step gathers them. Quantizing is deterministic, so a block served from the prefix
//! cache holds exactly what recomputing it would write.

use std::fmt;
use std::str::FromStr;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};

/// The K/V cache type a user asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// The model's compute dtype (bf16 on a GPU, f32 on a CPU unless told otherwise).
    #[default]
    Auto,
    /// 8-bit codes, one f16 scale per 32 values.
    Q8,
}

impl FromStr for KvDtype {
    type Err = crate::setting::InvalidSetting;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "auto" => Ok(KvDtype::Auto),
            "q8" | "q8_0" => Ok(KvDtype::Q8),
            _ => Err(crate::setting::InvalidSetting::new("kv_dtype", s, "auto or q8")),
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvDtype::Auto => "auto",
            KvDtype::Q8 => "q8",
        })
    }
}

/// What one stored K or V row is, resolved against the model's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStore {
    Float(DType),
    Q8,
}

impl KvStore {
    pub fn resolve(kv: KvDtype, model: DType) -> KvStore {
        match kv {
            KvDtype::Auto => KvStore::Float(model),
            KvDtype::Q8 => KvStore::Q8,
        }
    }

    /// Bytes one stored row of `width` values (a token's K, or its V, in one layer) takes.
    pub fn row_bytes(self, width: usize, head_dim: usize) -> u64 {
        match self {
            KvStore::Float(d) => (width * d.size_in_bytes()) as u64,
            KvStore::Q8 => crate::memory::q8_row_bytes(width, head_dim),
        }
    }
}

/// One layer's K (or V) rows for every slot of its pool group.
pub enum Rows {
    Float(Tensor),
    /// `codes: [slots, width]` u8 (value / scale + 128), `scales: [slots, width / group]` f16.
    Q8 { codes: Tensor, scales: Tensor, group: usize },
}

impl Rows {
    pub fn zeros(slots: usize, width: usize, head_dim: usize, store: KvStore, device: &Device) -> Result<Rows> {
        Ok(match store {
            KvStore::Float(d) => Rows::Float(Tensor::zeros((slots, width), d, device)?),
            KvStore::Q8 => {
                let g = crate::memory::q8_group(width, head_dim);
                let codes = Tensor::full(128u8, (slots, width), device)?;
                Rows::Q8 { codes, scales: Tensor::zeros((slots, width / g), DType::F16, device)?, group: g }
            }
        })
    }

    /// Stores `x: [n, width]` into the slots of `index` (each slot id repeated across the row).
    pub fn set(&self, index: &Tensor, x: &Tensor) -> Result<()> {
        match self {
            Rows::Float(t) => t.scatter_set(index, &x.to_dtype(t.dtype())?.contiguous()?, 0)?,
            Rows::Q8 { codes, scales, group } => {
                let (c, s) = quantize(x, *group)?;
                scatter_q8(codes, scales, index, &c, &s)?;
            }
        }
        Ok(())
    }

    /// Copies the rows of slots `from` into the slots encoded by `to` (`KvPool::write_index`),
    /// as stored.
    pub fn copy(&self, from: &Tensor, to: &Tensor) -> Result<()> {
        match self {
            Rows::Float(t) => t.scatter_set(to, &t.index_select(from, 0)?, 0)?,
            Rows::Q8 { codes, scales, .. } => scatter_q8(codes, scales, to, &codes.index_select(from, 0)?, &scales.index_select(from, 0)?)?,
        }
        Ok(())
    }

    /// The rows of `slots`, `[S, width]` in `dtype`.
    pub fn select(&self, slots: &Tensor, dtype: DType) -> Result<Tensor> {
        Ok(match self {
            Rows::Float(t) => t.index_select(slots, 0)?,
            Rows::Q8 { codes, scales, group } => dequantize(&codes.index_select(slots, 0)?, &scales.index_select(slots, 0)?, *group)?.to_dtype(dtype)?,
        })
    }

    /// The float store itself, for kernels that read slots in place (none for codes).
    pub fn float(&self) -> Option<&Tensor> {
        match self {
            Rows::Float(t) => Some(t),
            Rows::Q8 { .. } => None,
        }
    }
}

/// Stores codes `c` and scales `s` into the slots of `index` (a row index as wide as the codes;
/// the scales take its first columns).
fn scatter_q8(codes: &Tensor, scales: &Tensor, index: &Tensor, c: &Tensor, s: &Tensor) -> Result<()> {
    codes.scatter_set(index, c, 0)?;
    scales.scatter_set(&index.narrow(1, 0, s.dim(1)?)?.contiguous()?, s, 0)?;
    Ok(())
}

/// `x: [n, width]` → (codes `[n, width]` u8, scales `[n, width / group]` f16): each group's
/// largest magnitude maps to ±127.
pub fn quantize(x: &Tensor, group: usize) -> Result<(Tensor, Tensor)> {
    let (n, w) = x.dims2()?;
    let x = x.to_dtype(DType::F32)?.reshape((n, w / group, group))?;
    // The scale as it is stored (f16), so codes are computed against the scale read back.
    let scales = (x.abs()?.max_keepdim(D::Minus1)? / 127.0)?.to_dtype(DType::F16)?;
    let s = scales.to_dtype(DType::F32)?;
    // An all-zero group has scale 0: any divisor gives code 128, which reads back as 0.
    let q = x.broadcast_div(&s.clamp(f32::MIN_POSITIVE, f32::MAX)?)?.round()?.clamp(-127f32, 127f32)?;
    let codes = (q + 128.0)?.to_dtype(DType::U8)?.reshape((n, w))?;
    Ok((codes, scales.reshape((n, w / group))?))
}

/// Codes and scales back to f32 rows `[n, width]`.
pub fn dequantize(codes: &Tensor, scales: &Tensor, group: usize) -> Result<Tensor> {
    let (n, w) = codes.dims2()?;
    let q = (codes.to_dtype(DType::F32)? - 128.0)?.reshape((n, w / group, group))?;
    Ok(q.broadcast_mul(&scales.to_dtype(DType::F32)?.unsqueeze(2)?)?.reshape((n, w))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Every value comes back within half a step of its group's scale (plus the f16 rounding
    /// of the scale), zeros stay zero, and rows written to slots read back from them.
    #[test]
    fn q8_rows_round_trip_within_half_a_step() -> Result<()> {
        let dev = Device::Cpu;
        let mut rng = StdRng::seed_from_u64(3);
        let (n, w) = (6, 64);
        let mut data: Vec<f32> = (0..n * w).map(|_| rng.random::<f32>() * 8.0 - 4.0).collect();
        data[5 * w..].iter_mut().for_each(|x| *x = 0.0);
        data[7] = 40.0; // an outlier widens only its own group's step
        let x = Tensor::from_vec(data.clone(), (n, w), &dev)?;
        let rows = Rows::zeros(10, w, 16, KvStore::Q8, &dev)?;
        let slots = [7u32, 2, 9, 0, 4, 5];
        let index = Tensor::new(&slots, &dev)?.unsqueeze(1)?.broadcast_as((n, w))?.contiguous()?;
        rows.set(&index, &x)?;
        let back: Vec<Vec<f32>> = rows.select(&Tensor::new(&slots, &dev)?, DType::F32)?.to_vec2()?;
        for (r, row) in back.iter().enumerate() {
            for (g, chunk) in row.chunks(32).enumerate() {
                let want = &data[r * w + g * 32..r * w + (g + 1) * 32];
                let amax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = amax / 127.0;
                for (a, b) in chunk.iter().zip(want) {
                    assert!((a - b).abs() <= step * 0.5 + amax * 1e-3 + 1e-7, "row {r} group {g}: {a} vs {b} (step {step})");
                }
            }
        }
        assert!(back[5].iter().all(|v| *v == 0.0), "a zero row stays zero");
        assert_eq!(KvStore::Q8.row_bytes(64, 16), 64 + 4);
        assert_eq!(KvStore::Float(DType::BF16).row_bytes(64, 16), 128);
        // A row 32 does not divide is scaled per head.
        assert_eq!(KvStore::Q8.row_bytes(48, 16), 48 + 6);
        Ok(())
    }

    #[test]
    fn kv_dtype_reads_and_names_itself() {
        assert_eq!("q8".parse::<KvDtype>().unwrap(), KvDtype::Q8);
        assert_eq!("auto".parse::<KvDtype>().unwrap(), KvDtype::Auto);
        let e = "fp4".parse::<KvDtype>().unwrap_err();
        assert_eq!(e.name, "kv_dtype");
        assert_eq!(KvDtype::Q8.to_string().parse::<KvDtype>().unwrap(), KvDtype::Q8);
    }
}
