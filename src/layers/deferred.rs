//! A weight of a mapped file (f32, bf16, or blocks that the AVX2 kernels hold in groups of
//! eight rows), used where it lies until its packed copy is made behind the first tokens
//! (`cpu::repack`). Until then each product stages the panels it reaches straight from the
//! file's rows (`cpu::fp32::matmul_rows`, `cpu::bf16::matmul_rows`,
//! `cpu::blocks::PackedBlocks::matmul_staged`), the same bits as the packed kernels give; once
//! the copy exists the file's pages of the weight are released, so the weight is held once
//! either way.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use half::bf16;

use crate::cpu::bf16::PackedBf16;
use crate::cpu::blocks::{Format, PackedBlocks, GROUP_ROWS as GROUP};
use crate::cpu::fp32::PackedF32;
use crate::weights::Mapped;

#[derive(Debug)]
enum Packed {
    F32(PackedF32),
    Bf16(PackedBf16),
    Blocks(PackedBlocks),
}

/// What the file's rows hold.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    F32,
    Bf16,
    Blocks(Format),
}

/// Rows `[n, k]` in one or more mapped parts (a joined q/k/v: its parts' rows in order).
#[derive(Debug)]
pub struct Deferred {
    parts: Vec<Mapped>,
    /// Each part's first row.
    starts: Vec<usize>,
    n: usize,
    k: usize,
    kind: Kind,
    packed: OnceLock<Packed>,
    /// Products staging from the file and the making of the packed copy take turns: a product
    /// reading the file while the copy is made would fault back the pages the copy releases
    /// behind it, and the weight would be resident twice (an f32 tied head: 1.2 GB more).
    gate: Mutex<Gate>,
    turn: Condvar,
}

#[derive(Debug, Default)]
struct Gate {
    staging: usize,
    packing: bool,
}

impl Deferred {
    /// `m` deferred when it is an f32 or bf16 matrix stored in the compute `dtype`, or blocks
    /// held in groups of eight rows, whose packed kernel runs here; queued for repacking.
    pub fn new(m: &Mapped, dtype: DType) -> Option<Arc<Deferred>> {
        let [n, k] = m.dims[..] else { return None };
        let kind = match m.dtype {
            GgmlDType::F32 if dtype == DType::F32 && crate::cpu::fp32::available() && m.values::<f32>().is_some() => Kind::F32,
            GgmlDType::BF16 if dtype == DType::BF16 && crate::cpu::bf16::available() && m.values::<bf16>().is_some() => Kind::Bf16,
            t if crate::cpu::quant::kernel(t) == Some(crate::cpu::quant::Kernel::Blocks) => {
                let f = Format::of(t)?;
                PackedBlocks::whole_blocks(f, m.bytes(), n, k).then_some(Kind::Blocks(f))?
            }
            _ => return None,
        };
        Some(Self::queued(vec![m.clone()], n, k, kind))
    }

    /// The parts' rows one after another (q/k/v, gate/up), when all store one type and width
    /// (blocks: every part but the last whole groups of eight rows).
    pub fn join(parts: &[&Deferred]) -> Option<Arc<Deferred>> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.kind != first.kind || p.k != first.k) {
            return None;
        }
        if matches!(first.kind, Kind::Blocks(_)) && parts[..parts.len() - 1].iter().any(|p| !p.n.is_multiple_of(GROUP)) {
            return None;
        }
        let maps = parts.iter().flat_map(|p| p.parts.iter().cloned()).collect();
        Some(Self::queued(maps, parts.iter().map(|p| p.n).sum(), first.k, first.kind))
    }

    fn queued(parts: Vec<Mapped>, n: usize, k: usize, kind: Kind) -> Arc<Deferred> {
        let starts = parts.iter().scan(0, |at, p| Some(std::mem::replace(at, *at + p.rows()))).collect();
        let d = Arc::new(Deferred { parts, starts, n, k, kind, packed: OnceLock::new(), gate: Mutex::default(), turn: Condvar::new() });
        let weak: std::sync::Weak<dyn crate::cpu::repack::Repack> = Arc::downgrade(&d) as _;
        crate::cpu::repack::later(weak, d.parts.iter().map(|p| p.bytes().len()).sum());
        d
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// Whether the weight (and so the activations it takes) is bf16.
    pub fn is_bf16(&self) -> bool {
        self.kind == Kind::Bf16
    }

    /// Whether the weight is blocks.
    pub fn is_quantized(&self) -> bool {
        matches!(self.kind, Kind::Blocks(_))
    }

    /// Row `r` as stored (the type was checked when the part was taken).
    fn row<T: candle_core::WithDType>(&self, r: usize) -> &[T] {
        let j = self.starts.partition_point(|&s| s <= r) - 1;
        let values = self.parts[j].values::<T>().expect("a deferred part holds aligned values of its type");
        &values[(r - self.starts[j]) * self.k..][..self.k]
    }

    /// Group `g` (rows `8g..`, within one part) of a blocks weight, packed into `out`.
    fn group(&self, f: Format, g: usize, out: &mut [u8]) {
        let j = self.starts.partition_point(|&s| s <= g * GROUP) - 1;
        PackedBlocks::pack_group(f, self.parts[j].bytes(), self.k, (g * GROUP - self.starts[j]) / GROUP, out)
    }

    /// `out[m, n] = x[m, k] · wᵀ` for an f32 or blocks weight (f32 activations).
    pub fn matmul_f32(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let staged = |o: &mut [f32]| match self.kind {
            Kind::Blocks(f) => PackedBlocks::matmul_staged(f, self.n, self.k, |g, b| self.group(f, g, b), x, m, o),
            _ => crate::cpu::fp32::matmul_rows(self.n, self.k, |r| self.row(r), x, m, o),
        };
        let packed = |p: &Packed, o: &mut [f32]| match p {
            Packed::F32(p) => p.matmul(x, m, o),
            Packed::Blocks(p) => p.matmul(x, m, o),
            Packed::Bf16(_) => unreachable!("a bf16 weight takes bf16 activations"),
        };
        self.product(out, packed, staged);
    }

    /// `out[m, n] = x[m, k] · wᵀ` in f32 for a bf16 weight.
    pub fn matmul_bf16(&self, x: &[bf16], m: usize, out: &mut [f32]) {
        let staged = |o: &mut [f32]| crate::cpu::bf16::matmul_rows(self.n, self.k, |r| self.row(r), x, m, o);
        self.product(out, |p, o| if let Packed::Bf16(p) = p { p.matmul(x, m, o) }, staged);
    }

    /// `packed` of the copy once it exists (waiting for it while it is being made), else
    /// `staged` from the file.
    fn product(&self, out: &mut [f32], packed: impl FnOnce(&Packed, &mut [f32]), staged: impl FnOnce(&mut [f32])) {
        crate::cpu::repack::start();
        if let Some(p) = self.packed.get() {
            return packed(p, out);
        }
        let mut g = self.gate();
        while g.packing {
            g = self.turn.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(p) = self.packed.get() {
            drop(g);
            return packed(p, out);
        }
        g.staging += 1;
        drop(g);
        // Counted out however the product ends, so the packer never waits forever.
        struct Staging<'a>(&'a Deferred);
        impl Drop for Staging<'_> {
            fn drop(&mut self) {
                let mut g = self.0.gate();
                g.staging -= 1;
                if g.staging == 0 {
                    self.0.turn.notify_all();
                }
            }
        }
        let _staging = Staging(self);
        staged(out);
    }

    /// Drops the file's pages of the weight from the resident set (a read faults them back).
    fn release(&self) {
        for p in &self.parts {
            crate::cpu::pages::release(p.bytes());
        }
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl crate::cpu::repack::Repack for Deferred {
    fn repack(&self) {
        let mut g = self.gate();
        while g.staging > 0 || g.packing {
            g = self.turn.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if self.packed.get().is_some() {
            return;
        }
        g.packing = true;
        drop(g);
        // Products waiting for the copy go on (from the file, if it was not made) however
        // this ends, a panic included.
        struct Done<'a>(&'a Deferred);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.gate().packing = false;
                self.0.turn.notify_all();
            }
        }
        let _done = Done(self);
        let pack = || match self.kind {
            Kind::Bf16 => Packed::Bf16(PackedBf16::pack_rows(self.n, self.k, |r| self.row(r))),
            Kind::F32 => Packed::F32(PackedF32::pack_rows(self.n, self.k, |r| self.row(r))),
            Kind::Blocks(f) => Packed::Blocks(PackedBlocks::pack_groups(f, self.n, self.k, |g, b| self.group(f, g, b))),
        };
        let packed = match &self.parts[..] {
            // One part: its pages released band by band behind the copy.
            [one] => crate::cpu::pages::releasing(one.bytes(), pack),
            _ => pack(),
        };
        let _ = self.packed.set(packed);
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{Fused, Linear};
    use candle_core::{Device, Module, Tensor};

    /// `[n, k]` tensors written one after another to a file (as blocks of `q`, when given) and
    /// mapped back, as a GGUF's are.
    fn mapped(ts: &[Tensor], q: Option<GgmlDType>) -> candle_core::Result<Vec<Mapped>> {
        let mut f = tempfile::tempfile()?;
        let mut at = vec![];
        let mut bytes = vec![];
        for t in ts {
            at.push(bytes.len());
            let raw: Vec<u8> = match (t.dtype(), q) {
                (_, Some(q)) => candle_core::quantized::QTensor::quantize(t, q)?.data()?.to_vec(),
                (DType::BF16, _) => t.flatten_all()?.to_vec1::<bf16>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
                _ => t.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
            };
            bytes.extend(raw);
            bytes.resize(bytes.len().next_multiple_of(32), 0);
        }
        std::io::Write::write_all(&mut f, &bytes)?;
        // SAFETY: a private temporary file nobody else writes.
        let map = Arc::new(unsafe { crate::weights::mapped::MappedFile::map(f)? });
        Ok(ts.iter().zip(at).map(|(t, a)| {
            let (dt, len) = match (t.dtype(), q) {
                (_, Some(q)) => (q, t.elem_count() / q.block_size() * q.type_size()),
                (DType::BF16, _) => (GgmlDType::BF16, t.elem_count() * 2),
                _ => (GgmlDType::F32, t.elem_count() * 4),
            };
            Mapped::new(map.clone(), a, len, dt, t.dims().to_vec())
        }).collect())
    }

    /// Mapped f32, bf16, Q8_0, Q4_K and Q6_K layers (q/k/v-like parts joined, with biases) give
    /// candle's product within rounding (blocks: against their dequantized values), and the
    /// same bits before and after their packed copy is made. Blocks are deferred where the
    /// AVX2 groups hold them (at AVX-512 with VNNI they are packed at load).
    #[test]
    fn a_mapped_layer_gives_the_same_bits_before_and_after_repacking() -> candle_core::Result<()> {
        if !crate::cpu::fp32::available() || !crate::cpu::bf16::available() {
            return Ok(());
        }
        for (dtype, q) in [(DType::F32, None), (DType::BF16, None), (DType::F32, Some(GgmlDType::Q8_0)), (DType::F32, Some(GgmlDType::Q4K)), (DType::F32, Some(GgmlDType::Q6K))] {
            let k = match q {
                None => 72,
                Some(GgmlDType::Q8_0) => 64,
                Some(_) => 512,
            };
            // Blocks in whole 16-row panels: the VNNI panels join only such parts.
            let ns = if q.is_some() { [48, 16, 16] } else { [40, 8, 8] };
            let ws: Vec<Tensor> = ns.iter().enumerate().map(|(i, &n)| crate::testing::randn(70 + i as u64, (n, k), 0.3)?.to_dtype(dtype)).collect::<candle_core::Result<_>>()?;
            let bs: Vec<Tensor> = ns.iter().enumerate().map(|(i, &n)| crate::testing::randn(80 + i as u64, n, 0.3)?.to_dtype(dtype)).collect::<candle_core::Result<_>>()?;
            let maps = mapped(&ws, q)?;
            let parts: Vec<Linear> = maps.iter().zip(&bs).map(|(m, b)| Linear::from_mapped(m, dtype, &Device::Cpu, Some(b.clone())).expect("a packed layer")).collect();
            for p in &parts {
                let deferred = q.is_none_or(|q| crate::cpu::quant::kernel(q) == Some(crate::cpu::quant::Kernel::Blocks));
                assert_eq!(format!("{p:?}").contains("Deferred"), deferred, "{dtype:?} ({q:?}): deferred iff the AVX2 groups or a float kernel hold it");
            }
            let fused = Fused::new(parts.clone())?;
            assert_eq!(fused.products(), 1, "the mapped parts join");
            for rows in [1, 3, 20] {
                let x = crate::testing::randn(90 + rows as u64, (rows, k), 1.)?.to_dtype(dtype)?;
                let before: Vec<Vec<f32>> = fused.forward(&x)?.iter().map(|y| y.to_dtype(DType::F32)?.flatten_all()?.to_vec1()).collect::<candle_core::Result<_>>()?;
                crate::cpu::repack::wait();
                let after: Vec<Vec<f32>> = fused.forward(&x)?.iter().map(|y| y.to_dtype(DType::F32)?.flatten_all()?.to_vec1()).collect::<candle_core::Result<_>>()?;
                assert_eq!(before, after, "{dtype:?} ({q:?}), {rows} rows: staged vs packed");
                for ((p, w), b) in parts.iter().zip(&ws).zip(&bs) {
                    // Blocks against their own values (the error left is the activations').
                    let w = match q {
                        Some(q) => candle_core::quantized::QTensor::quantize(w, q)?.dequantize(&Device::Cpu)?,
                        None => w.to_dtype(DType::F32)?,
                    };
                    let want = candle_nn::Linear::new(w, Some(b.to_dtype(DType::F32)?)).forward(&x.to_dtype(DType::F32)?)?;
                    let got = p.forward(&x)?.to_dtype(DType::F32)?;
                    let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    let tol = if dtype == DType::BF16 || q.is_some() { 2e-2 } else { 1e-5 } * want.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(err <= tol, "{dtype:?} ({q:?}), {rows} rows: off by {err}, bound {tol}");
                }
            }
        }
        Ok(())
    }
}
