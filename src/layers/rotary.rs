//! Rotary position embeddings on token-major tensors (`[T, heads, head_dim]`), NeoX
//! "rotate_half" convention. One table builder serves every variant:
//! - 1-D RoPE (all three position components equal, or a text-only model);
//! - sectioned M-RoPE (Qwen2-VL, Qwen2.5-VL): frequency blocks `[t…t h…h w…w]`;
//! - interleaved M-RoPE (Qwen3-VL, Qwen3.5): `[t h w t h w … t t]`, the h/w slots limited to
//!   three times their section;
//! - partial rotary (Qwen3.5): only the first `rotary_dim` channels of a head rotate.

use candle_core::{DType, Device, Result, Tensor};

/// Which position component (0 = t, 1 = h, 2 = w) drives each rotary frequency.
#[derive(Clone, Debug, PartialEq)]
pub enum RotaryLayout {
    OneD,
    Sectioned([usize; 3]),
    Interleaved([usize; 3]),
}

impl RotaryLayout {
    /// Component of each of the `half` frequencies.
    pub fn components(&self, half: usize) -> Vec<usize> {
        match self {
            RotaryLayout::OneD => vec![0; half],
            RotaryLayout::Sectioned(s) => {
                let mut c: Vec<usize> = s.iter().enumerate().flat_map(|(i, &n)| std::iter::repeat_n(i, n)).collect();
                c.resize(half, 0);
                c
            }
            // transformers' apply_interleaved_mrope: start from t everywhere, then overwrite
            // frequencies 1, 4, 7, … (< 3·s_h) with h and 2, 5, 8, … (< 3·s_w) with w.
            RotaryLayout::Interleaved(s) => (0..half)
                .map(|f| match f % 3 {
                    1 if f < 3 * s[1] => 1,
                    2 if f < 3 * s[2] => 2,
                    _ => 0,
                })
                .collect(),
        }
    }
}

/// Inverse frequencies plus the component map; builds per-step cos/sin tables.
#[derive(Clone, Debug)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    component: Vec<usize>,
    /// Channels of a head that rotate (head_dim, or less for partial rotary).
    rotary_dim: usize,
}

impl Rotary {
    pub fn new(rotary_dim: usize, theta: f64, layout: &RotaryLayout) -> Self {
        let half = rotary_dim / 2;
        let inv_freq = (0..half).map(|i| (1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64)) as f32).collect();
        Rotary { inv_freq, component: layout.components(half), rotary_dim }
    }

    /// Linear rope scaling (transformers' `rope_type: linear`): positions divided by `factor`,
    /// i.e. every inverse frequency.
    pub fn linear_scaled(self, factor: f64) -> Self {
        let inv_freq = self.inv_freq.iter().map(|&f| (f as f64 / factor) as f32).collect();
        Rotary { inv_freq, ..self }
    }

    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// `positions[c][i]` = component `c` of token `i` → `(cos, sin)`, each `[T, rotary_dim/2]` f32.
    pub fn tables(&self, positions: &[Vec<i64>; 3], dev: &Device) -> Result<(Tensor, Tensor)> {
        let t = positions[0].len();
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for i in 0..t {
            for (f, &inv) in self.inv_freq.iter().enumerate() {
                // f32 product then f32 cos/sin, as transformers computes them.
                let angle = positions[self.component[f]][i] as f32 * inv;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok((Tensor::from_vec(cos, (t, half), dev)?, Tensor::from_vec(sin, (t, half), dev)?))
    }

    /// Rotates the first `rotary_dim` channels of `x: [T, heads, head_dim]`; the rest pass.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if let Some(y) = self.host(x, cos, sin)? {
            return Ok(y);
        }
        let d = x.dim(2)?;
        if self.rotary_dim == d {
            return apply_rope(x, cos, sin);
        }
        let rot = apply_rope(&x.narrow(2, 0, self.rotary_dim)?, cos, sin)?;
        Tensor::cat(&[&rot, &x.narrow(2, self.rotary_dim, d - self.rotary_dim)?], 2)
    }

    /// `apply` in one pass over host memory for a contiguous f32 or bf16 `x` on the CPU (the
    /// same values: f32 arithmetic as candle's `rope_thd`, bf16 widened and rounded once); a
    /// decode step spent more in the tensor ops around candle's kernel (the lift to a batch of
    /// one, the copy, the squeeze) than in the rotation. `None`: not such a tensor.
    fn host(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
        let (t, heads, d) = x.dims3()?;
        let half = self.rotary_dim / 2;
        let ok_tables = cos.dims() == [t, half] && sin.dims() == [t, half] && cos.dtype() == DType::F32 && sin.dtype() == DType::F32;
        if !crate::cpu::host_paths(x.device()) || !x.is_contiguous() || !ok_tables || !matches!(x.dtype(), DType::F32 | DType::BF16) || self.rotary_dim > d {
            return Ok(None);
        }
        crate::cpu::note_kernel_run();
        let mut out = vec![0f32; t * heads * d];
        super::with_host_slice(cos, |c: &[f32]| {
            super::with_host_slice(sin, |s: &[f32]| super::with_host_slice(x, |xs: &[f32]| crate::cpu::elementwise::rope(xs, c, s, heads, d, self.rotary_dim, &mut out)))
        })???;
        let y = Tensor::from_vec(out, (t, heads, d), x.device())?;
        match x.dtype() {
            DType::F32 => Ok(Some(y)),
            dt => Ok(Some(y.to_dtype(dt)?)),
        }
    }
}

/// Full-width rotary on `x: [T, heads, d]` with half-width tables `cos, sin: [T, d/2]`,
/// computed in f32 like transformers, then cast back.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?.unsqueeze(0)?.contiguous()?;
    let out = candle_nn::rotary_emb::rope_thd(&x32, cos, sin)?;
    out.squeeze(0)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sectioned_and_interleaved_component_maps() {
        assert_eq!(RotaryLayout::Sectioned([2, 3, 3]).components(8), vec![0, 0, 1, 1, 1, 2, 2, 2]);
        // Qwen3-VL's [24, 20, 20] over 64 frequencies: h at 1,4,…,58; w at 2,5,…,59; t elsewhere.
        let c = RotaryLayout::Interleaved([24, 20, 20]).components(64);
        assert_eq!(&c[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!((c[58], c[59], c[60], c[61], c[62], c[63]), (1, 2, 0, 0, 0, 0));
        assert_eq!(c.iter().filter(|&&x| x == 1).count(), 20);
        assert_eq!(c.iter().filter(|&&x| x == 2).count(), 20);
        assert_eq!(RotaryLayout::OneD.components(3), vec![0, 0, 0]);
    }

    /// Reference rotate_half on plain vectors.
    fn rotate_ref(x: &[f32], cos: &[f32], sin: &[f32]) -> Vec<f32> {
        let h = cos.len();
        (0..2 * h)
            .map(|j| if j < h { x[j] * cos[j] - x[j + h] * sin[j] } else { x[j] * cos[j - h] + x[j - h] * sin[j - h] })
            .collect()
    }

    #[test]
    fn partial_rotary_rotates_only_the_leading_channels() -> Result<()> {
        let dev = Device::Cpu;
        let (t, heads, d, rd) = (3, 2, 8, 4);
        let rope = Rotary::new(rd, 10_000.0, &RotaryLayout::OneD);
        let pos = [vec![0, 5, 9], vec![0, 5, 9], vec![0, 5, 9]];
        let (cos, sin) = rope.tables(&pos, &dev)?;
        let x = crate::testing::randn(101, (t, heads, d), 1.)?;
        let y = rope.apply(&x, &cos, &sin)?;
        let (xv, yv): (Vec<Vec<Vec<f32>>>, Vec<Vec<Vec<f32>>>) = (x.to_vec3()?, y.to_vec3()?);
        let (cv, sv): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (cos.to_vec2()?, sin.to_vec2()?);
        for i in 0..t {
            for h in 0..heads {
                let want = rotate_ref(&xv[i][h][..rd], &cv[i], &sv[i]);
                for j in 0..rd {
                    assert!((yv[i][h][j] - want[j]).abs() < 1e-5);
                }
                assert_eq!(&yv[i][h][rd..], &xv[i][h][rd..]);
            }
        }
        Ok(())
    }

    /// The host pass gives candle's `rope_thd` values bit for bit, full and partial rotary,
    /// f32 and bf16, one token and several; a strided input takes candle's path.
    #[test]
    fn the_host_pass_is_candles_rotation_bit_for_bit() -> Result<()> {
        let dev = Device::Cpu;
        if !crate::cpu::host_paths(&dev) {
            return Ok(());
        }
        for (t, rd) in [(1, 64), (5, 64), (3, 32)] {
            let rope = Rotary::new(rd, 1e6, &RotaryLayout::OneD);
            let pos: Vec<i64> = (0..t as i64).map(|i| 37 * i + 11).collect();
            let (cos, sin) = rope.tables(&[pos.clone(), pos.clone(), pos], &dev)?;
            for dt in [DType::F32, DType::BF16] {
                let x = crate::testing::randn(102 + t as u64, (t, 3, 64), 2.)?.to_dtype(dt)?;
                let want = match rd {
                    64 => apply_rope(&x, &cos, &sin)?,
                    _ => Tensor::cat(&[&apply_rope(&x.narrow(2, 0, rd)?, &cos, &sin)?, &x.narrow(2, rd, 64 - rd)?], 2)?,
                };
                let got = rope.host(&x, &cos, &sin)?.expect("a contiguous CPU tensor takes the host pass");
                let bits = |y: &Tensor| -> Result<Vec<u32>> { Ok(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect()) };
                assert_eq!(bits(&got)?, bits(&want)?, "{t} tokens, rotary {rd}, {dt:?}");
                assert_eq!(got.dtype(), dt);
            }
            let strided = crate::testing::randn(104, (3, t, 64), 1.)?.transpose(0, 1)?;
            assert_eq!(rope.host(&strided, &cos, &sin)?.is_none(), t > 1, "{t} tokens: strided unless one token");
        }
        Ok(())
    }

    #[test]
    fn equal_components_reduce_to_one_d() -> Result<()> {
        let dev = Device::Cpu;
        let pos = [vec![3, 7], vec![3, 7], vec![3, 7]];
        let one = Rotary::new(16, 1e6, &RotaryLayout::OneD).tables(&pos, &dev)?;
        for layout in [RotaryLayout::Sectioned([2, 3, 3]), RotaryLayout::Interleaved([2, 3, 3])] {
            let m = Rotary::new(16, 1e6, &layout).tables(&pos, &dev)?;
            let d = (&m.0 - &one.0)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0);
        }
        Ok(())
    }
}
