//! A tensor as it lies in a memory-mapped weights file: its bytes, stored type and shape, with
//! no copy made. The CPU kernels repack a linear weight straight from these bytes, and an
//! embedding table looks its rows up here (dequantizing only the rows a step asks for, as
//! llama.cpp's `get_rows` does; read from the file, not through the mapping), so a weight is
//! held once: in its final home, or in the file.
//!
//! Once a tensor has been copied to its final home, `release` drops the mapping's pages of it
//! from this process (they stay in the page cache), so the file is not counted a second time
//! beside the copy. A later read of those bytes faults them back in from the page cache.

use std::sync::Arc;

use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};

/// A `rows × k` matrix quantized to `format` in bands of rows on all threads (candle's
/// quantizer is serial: minutes for a 7B), each band written straight into its place in the
/// output. `band(r0, n)` gives rows `r0..r0 + n` as an f32 `[n, k]` tensor on the host; bands
/// hold about 8 MiB of f32 each. Blocks never cross rows, so the bytes equal quantizing the
/// whole; `dims` is the result's shape (rows = the product of all but the last).
pub fn quantize_bands(rows: usize, k: usize, format: GgmlDType, dims: Vec<usize>, dev: &Device, band: impl Fn(usize, usize) -> Result<Tensor> + Sync) -> Result<QTensor> {
    use rayon::prelude::*;
    if !k.is_multiple_of(format.block_size()) {
        candle_core::bail!("{format:?} needs rows of a multiple of {} values, not {k}", format.block_size());
    }
    let band_rows = (crate::cpu::pages::BAND_BYTES / 4 / (k * 4).max(1)).max(1);
    let qb = k / format.block_size() * format.type_size();
    let mut out = vec![0u8; rows * qb];
    out.par_chunks_mut(band_rows * qb).enumerate().try_for_each(|(i, dst)| -> Result<()> {
        let t = band(i * band_rows, dst.len() / qb)?;
        dst.copy_from_slice(&QTensor::quantize(&t, format)?.data()?);
        Ok(())
    })?;
    ggml_file::qtensor_from_ggml(format, &out, dims, dev)
}

/// An f32-convertible tensor (any device, any rank ≥ 1) quantized on all host threads.
pub fn quantize_tensor(t: &Tensor, format: GgmlDType, dev: &Device) -> Result<QTensor> {
    let dims = t.dims().to_vec();
    let k = *dims.last().unwrap_or(&1);
    let rows = t.elem_count() / k.max(1);
    let flat = t.to_device(&Device::Cpu)?.reshape((rows, k))?;
    // A band of its own storage: candle's quantizer reads the storage from its start, so a
    // narrowed view (an f32 band of an f32 tensor) would quantize the first rows every time.
    quantize_bands(rows, k, format, dims, dev, |r0, n| {
        let band = flat.narrow(0, r0, n)?;
        match band.dtype() {
            DType::F32 => band.force_contiguous(),
            _ => band.to_dtype(DType::F32),
        }
    })
}

/// A weights file mapped read-only, the file kept open beside its mapping: an embedding
/// lookup reads its rows with `pread` rather than through the mapping, where a fault mapped
/// the page-cache folio around the row (up to 2 MiB) and the lookup then released it again
/// (`madvise`, a TLB shootdown on every thread): ~50 µs of each decode step on the 2-core
/// Zen 5 box, against ~1 µs for the read.
pub struct MappedFile {
    map: memmap2::Mmap,
    file: std::fs::File,
}

impl MappedFile {
    /// Maps the whole of `file`.
    ///
    /// # Safety
    /// The file must not be modified while it is mapped (memmap2's contract).
    pub unsafe fn map(file: std::fs::File) -> std::io::Result<MappedFile> {
        Ok(MappedFile { map: unsafe { memmap2::Mmap::map(&file)? }, file })
    }

    /// `out.len()` bytes from `at`, read from the file (the mapping's bytes where no
    /// positioned read exists or it fails): the mapping is not touched.
    fn read_at(&self, at: usize, out: &mut [u8]) {
        #[cfg(unix)]
        if std::os::unix::fs::FileExt::read_exact_at(&self.file, out, at as u64).is_ok() {
            return;
        }
        out.copy_from_slice(&self.map[at..at + out.len()]);
    }
}

impl std::ops::Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

/// One stored tensor inside a shared read-only mapping.
#[derive(Clone)]
pub struct Mapped {
    map: Arc<MappedFile>,
    start: usize,
    len: usize,
    pub dtype: GgmlDType,
    /// candle's (torch-order) dims, outermost first.
    pub dims: Vec<usize>,
}

impl std::fmt::Debug for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapped({:?} {:?}, {} bytes at {})", self.dtype, self.dims, self.len, self.start)
    }
}

/// The dense dtype of a float storage type.
pub fn float_dtype(t: GgmlDType) -> Option<DType> {
    match t {
        GgmlDType::F32 => Some(DType::F32),
        GgmlDType::F16 => Some(DType::F16),
        GgmlDType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

impl Mapped {
    /// `len` bytes at `start` of `map` (the caller checked the range against the file).
    pub fn new(map: Arc<MappedFile>, start: usize, len: usize, dtype: GgmlDType, dims: Vec<usize>) -> Self {
        assert!(start + len <= map.len(), "tensor range past the mapping");
        Mapped { map, start, len, dtype, dims }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// The bytes as `T` values, when they are aligned for `T` (GGUF aligns tensor data to 32).
    pub fn values<T: candle_core::WithDType>(&self) -> Option<&[T]> {
        if float_dtype(self.dtype) != Some(T::DTYPE) {
            return None;
        }
        // SAFETY: f32, f16 and bf16 are plain data of any bit pattern; align_to only hands out
        // the aligned middle, and an unaligned head or tail is refused below.
        let (head, body, tail) = unsafe { self.bytes().align_to::<T>() };
        (head.is_empty() && tail.is_empty()).then_some(body)
    }

    /// Whether the values are a float type rather than quantized blocks.
    pub fn is_float(&self) -> bool {
        float_dtype(self.dtype).is_some()
    }

    pub fn rows(&self) -> usize {
        self.dims.first().copied().unwrap_or(0)
    }

    fn row_bytes(&self) -> usize {
        self.len / self.rows().max(1)
    }

    /// A copy as candle's quantized tensor (float types included).
    pub fn qtensor(&self, dev: &Device) -> Result<QTensor> {
        ggml_file::qtensor_from_ggml(self.dtype, self.bytes(), self.dims.clone(), dev)
    }

    /// A dense copy on the host, in the stored float type (blocks: dequantized to f32).
    pub fn tensor(&self) -> Result<Tensor> {
        match float_dtype(self.dtype) {
            Some(dt) => Tensor::from_raw_buffer(self.bytes(), dt, &self.dims, &Device::Cpu),
            None => self.qtensor(&Device::Cpu)?.dequantize(&Device::Cpu),
        }
    }

    /// Rows `ids` of a 2-D table as `[ids.len(), width]` in `dtype` on `dev`; only their bytes
    /// are read.
    pub fn lookup(&self, ids: &[u32], dtype: DType, dev: &Device) -> Result<Tensor> {
        let (rows, rb) = (self.rows(), self.row_bytes());
        let width = self.dims.get(1).copied().unwrap_or(0);
        let mut bytes = vec![0u8; ids.len() * rb];
        for (j, &id) in ids.iter().enumerate() {
            let i = id as usize;
            if i >= rows {
                candle_core::bail!("token id {id} is outside the embedding table's {rows} rows");
            }
            self.map.read_at(self.start + i * rb, &mut bytes[j * rb..(j + 1) * rb]);
        }
        let picked = match float_dtype(self.dtype) {
            Some(dt) => Tensor::from_raw_buffer(&bytes, dt, &[ids.len(), width], &Device::Cpu)?,
            None => ggml_file::qtensor_from_ggml(self.dtype, &bytes, vec![ids.len(), width], &Device::Cpu)?.dequantize(&Device::Cpu)?,
        };
        picked.to_dtype(dtype)?.to_device(dev)
    }

    /// A 2-D float tensor quantized to `format` one band of rows at a time, each band's pages
    /// released behind it: an f32 copy of one band at a time rather than of the whole tensor
    /// (5 GB for a 248k × 5120 head). Blocks never cross rows, so the bytes are those of
    /// quantizing the whole.
    pub fn quantize(&self, format: GgmlDType, dev: &Device) -> Result<QTensor> {
        let (Some(dt), &[rows, k]) = (float_dtype(self.dtype), &self.dims[..]) else {
            candle_core::bail!("only a 2-D float tensor is quantized from the file, not {:?} {:?}", self.dtype, self.dims);
        };
        let rb = self.row_bytes();
        quantize_bands(rows, k, format, self.dims.clone(), dev, |r0, n| {
            let bytes = &self.bytes()[r0 * rb..(r0 + n) * rb];
            let t = Tensor::from_raw_buffer(bytes, dt, &[n, k], &Device::Cpu)?.to_dtype(DType::F32)?;
            crate::cpu::pages::release(bytes);
            Ok(t)
        })
    }

    /// The start of the whole mapping this tensor lies in (which file it is).
    pub fn file_start(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Drops this process's pages of the whole mapping this tensor lies in
    /// (`WeightSource::release_mappings`).
    pub fn release_file(&self) {
        crate::cpu::pages::release(&self.map[..]);
    }

    /// Drops this process's pages of the tensor's bytes (whole pages only, so neighbours keep
    /// theirs). Call once the bytes have been copied to where they will be read from.
    pub fn release(&self) {
        crate::cpu::pages::release(self.bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn map_of(bytes: &[u8]) -> Arc<MappedFile> {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        // SAFETY: a private temporary file nobody else writes.
        Arc::new(unsafe { MappedFile::map(f) }.unwrap())
    }

    #[test]
    fn looks_up_rows_of_float_and_block_tables() -> Result<()> {
        // 4 rows of 32 values; row r holds r + i/64.
        let vals: Vec<f32> = (0..4 * 32).map(|i| (i / 32) as f32 + (i % 32) as f32 / 64.0).collect();
        let t = Tensor::from_vec(vals.clone(), (4, 32), &Device::Cpu)?;
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Mapped::new(map_of(&bytes), 0, bytes.len(), GgmlDType::F32, vec![4, 32]);
        let got = m.lookup(&[3, 0, 3], DType::F32, &Device::Cpu)?;
        let want = t.index_select(&Tensor::new(&[3u32, 0, 3], &Device::Cpu)?, 0)?;
        assert_eq!(got.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        assert_eq!(m.values::<f32>().map(|v| v.len()), Some(128));
        assert!(m.values::<half::bf16>().is_none());

        // The same table in Q8_0 blocks: rows dequantize as the whole tensor does.
        let q = QTensor::quantize(&t, GgmlDType::Q8_0)?;
        let qb = q.data()?.to_vec();
        let m = Mapped::new(map_of(&qb), 0, qb.len(), GgmlDType::Q8_0, vec![4, 32]);
        let whole = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
        let got = m.lookup(&[2, 1], DType::F32, &Device::Cpu)?.to_vec2::<f32>()?;
        assert_eq!(got, vec![whole[2].clone(), whole[1].clone()]);
        assert!(m.lookup(&[4], DType::F32, &Device::Cpu).unwrap_err().to_string().contains("outside the embedding table's 4 rows"));
        // Released pages read back the same.
        m.release();
        assert_eq!(m.tensor()?.to_vec2::<f32>()?, whole);
        Ok(())
    }

    /// Quantizing band by band gives the bytes of quantizing the whole tensor (seeded; more
    /// rows than one band, and a last partial band).
    #[test]
    fn banded_quantization_equals_the_whole() -> Result<()> {
        let (rows, k) = (33_000, 256);
        let t = crate::testing::randn(7, (rows, k), 1.0)?;
        let bytes: Vec<u8> = t.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = Mapped::new(map_of(&bytes), 0, bytes.len(), GgmlDType::F32, vec![rows, k]);
        for format in [GgmlDType::Q8_0, GgmlDType::Q4K] {
            let banded = m.quantize(format, &Device::Cpu)?;
            let whole = QTensor::quantize(&t, format)?;
            assert_eq!(banded.shape().dims(), &[rows, k]);
            assert!(banded.data()? == whole.data()?, "{format:?}");
        }
        Ok(())
    }

    /// A tensor quantized on all threads (3-D, bf16 and f32, several bands) equals candle's serial
    /// quantizer's bytes; a row length off the block size is an error, not a panic.
    #[test]
    fn parallel_tensor_quantization_equals_candles() -> Result<()> {
        let f32s = crate::testing::randn(11, (3, 9_000, 256), 1.0)?;
        for t in [f32s.to_dtype(DType::BF16)?, f32s] {
            for format in [GgmlDType::Q8_0, GgmlDType::Q6K] {
                let got = quantize_tensor(&t, format, &Device::Cpu)?;
                let want = QTensor::quantize(&t.to_dtype(DType::F32)?, format)?;
                assert_eq!(got.shape().dims(), &[3, 9_000, 256]);
                assert!(got.data()? == want.data()?, "{format:?} from {:?}", t.dtype());
            }
        }
        let odd = crate::testing::randn(1, (4, 100), 1.0)?;
        assert!(quantize_tensor(&odd, GgmlDType::Q4K, &Device::Cpu).unwrap_err().to_string().contains("multiple of 256"));
        Ok(())
    }
}
