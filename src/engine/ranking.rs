//! The head of each sampled row's order, ranked on the device, so a temperature / top-k /
//! top-p row sends back a few hundred (id, logit) pairs and its normaliser instead of the
//! whole vocabulary. Candle sorts a row on a GPU only up to 1,024 entries (one thread block
//! per row), so a 152k-token row is ranked in rounds: split into rows of 1,024, keep each
//! one's best `m`, and rank the survivors again until one row of at most 1,024 is left. Every
//! round is a handful of launches (pad, sort, gather), about twenty for a Qwen vocabulary.
//! The draw over the head runs there too (`draw`).

use candle_core::{DType, Tensor, D};

/// Widest row one device sort takes.
const SORT_WIDTH: usize = 1024;

/// The best `m` entries of each row of `x` `[r, n]` (f32; masked entries −∞), best first:
/// (values `[r, m]`, column ids `[r, m]` as u32). Ties at the cut may keep either id; the
/// draw orders the head by (value, id) itself.
pub fn top_m(x: &Tensor, m: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let (r, n) = x.dims2()?;
    let ids = Tensor::arange(0u32, n as u32, x.device())?.unsqueeze(0)?.broadcast_as((r, n))?.contiguous()?;
    round(x, &ids, m.min(n))
}

fn round(x: &Tensor, ids: &Tensor, m: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let (r, n) = x.dims2()?;
    if n <= SORT_WIDTH {
        let order = x.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, m)?.contiguous()?;
        return Ok((x.gather(&order, D::Minus1)?, ids.gather(&order, D::Minus1)?));
    }
    // Pad to whole sort rows with −∞ (never kept before a real entry).
    let rows = n.div_ceil(SORT_WIDTH);
    let pad = rows * SORT_WIDTH - n;
    let (x, ids) = match pad {
        0 => (x.clone(), ids.clone()),
        _ => (
            Tensor::cat(&[x, &Tensor::full(f32::NEG_INFINITY, (r, pad), x.device())?.to_dtype(x.dtype())?], 1)?,
            Tensor::cat(&[ids, &Tensor::zeros((r, pad), DType::U32, x.device())?], 1)?,
        ),
    };
    let keep = m.min(SORT_WIDTH);
    let xs = x.reshape((r * rows, SORT_WIDTH))?;
    let order = xs.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, keep)?.contiguous()?;
    let best = xs.gather(&order, D::Minus1)?.reshape((r, rows * keep))?;
    let best_ids = ids.reshape((r * rows, SORT_WIDTH))?.gather(&order, D::Minus1)?.reshape((r, rows * keep))?;
    round(&best, &best_ids, m)
}

/// Σ over each row of exp(x·inv_t − top·inv_t) in f64, as the host sampler sums it (the
/// subtraction in f32, the exponential and the sum in f64): `[r, 1]` f64, kept on the device
/// for the draw. `top` `[r, 1]` is the row's best value, `inv_t` `[r, 1]` its 1/temperature.
pub fn weight_totals(x: &Tensor, top: &Tensor, inv_t: &Tensor) -> candle_core::Result<Tensor> {
    let shifted = x.broadcast_mul(inv_t)?.broadcast_sub(&top.mul(inv_t)?)?;
    shifted.to_dtype(DType::F64)?.exp()?.sum_keepdim(D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Rounds of 1,024 find what one sort of the row finds, past the first round and with a
    /// padded last sort row.
    #[test]
    fn rounds_keep_each_rows_best() -> candle_core::Result<()> {
        let mut rng = StdRng::seed_from_u64(5);
        for (n, m) in [(5, 8), (1024, 16), (3000, 64), (151_936, 256)] {
            let rows: Vec<Vec<f32>> = (0..2).map(|_| (0..n).map(|_| rng.random::<f32>() * 20.0 - 10.0).collect()).collect();
            let x = Tensor::new(rows.clone(), &Device::Cpu)?;
            let (vals, ids) = top_m(&x, m)?;
            for (row, (v, i)) in rows.iter().zip(vals.to_vec2::<f32>()?.iter().zip(ids.to_vec2::<u32>()?)) {
                let mut want: Vec<u32> = (0..n as u32).collect();
                want.sort_by(|a, b| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b)));
                want.truncate(m.min(n));
                assert_eq!(i, want, "n {n}, m {m}");
                assert!(v.iter().zip(&i).all(|(v, i)| *v == row[*i as usize]));
            }
        }
        Ok(())
    }

    #[test]
    fn totals_match_the_host_sum_at_f64_precision() -> candle_core::Result<()> {
        let row: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0).collect();
        let top = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0f32 / 0.7;
        let want: f64 = row.iter().map(|&x| ((x * inv_t - top * inv_t) as f64).exp()).sum();
        let dev = Device::Cpu;
        let got = weight_totals(&Tensor::new(vec![row], &dev)?, &Tensor::new(&[[top]], &dev)?, &Tensor::new(&[[inv_t]], &dev)?)?.to_vec2::<f64>()?[0][0];
        assert!((got - want).abs() <= want * 1e-13, "{got} vs {want}");
        Ok(())
    }
}
