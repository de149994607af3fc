//! The GGUF container as llama.cpp writes it (v2 and v3): a header of typed metadata and tensor
//! descriptions, then aligned tensor data. Parsed from bytes (a memory map) with every length
//! and offset checked against what is left, so a truncated or hostile file fails with its name
//! and the offending key or tensor instead of allocating or panicking. Tensor data stays in the
//! map until a tensor is asked for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::weights::mapped::MappedFile;
use crate::weights::Mapped;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

const MAGIC: u32 = 0x4655_4747; // "GGUF", little-endian
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are not GGUF as anyone writes it.
const MAX_DEPTH: usize = 2;

/// One tensor's description: candle's (torch-style) dims, outermost first.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: GgmlDType,
    pub dims: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

/// A parsed header.
#[derive(Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Tensor names in file order.
    pub order: Vec<String>,
}

/// llama.cpp's name for a ggml type id (`ggml.h`), for errors about types candle lacks.
pub fn ggml_type_name(id: u32) -> String {
    let name = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("unknown type {id}"),
    };
    name.to_string()
}

/// The ggml types merg reads (candle has kernels or dequantisation for each).
fn dtype_of(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        30 => GgmlDType::BF16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        _ => return None,
    })
}

const SUPPORTED: &str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// A little-endian reader over the header bytes that never reads past the end.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.bytes.len() - self.pos) as u64;
        if n > left {
            bail!("truncated: {what} needs {n} bytes at offset {}, only {left} remain", self.pos);
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into()?))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into()?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into()?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let raw = self.take(len, what)?;
        // llama.cpp writes UTF-8; some converters leave NULs at the end.
        let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
        String::from_utf8(raw.to_vec()).with_context(|| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.u8(what)?),
            1 => Value::I8(self.u8(what)? as i8),
            2 => Value::U16(self.u16(what)?),
            3 => Value::I16(self.u16(what)? as i16),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(self.u32(what)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(what)?)),
            7 => match self.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!("{what}: boolean byte {b} is neither 0 nor 1"),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    bail!("{what}: arrays nested deeper than {MAX_DEPTH}");
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Refuse a length the remaining bytes cannot hold before allocating for it.
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    t => bail!("{what}: unknown array element type {t}"),
                };
                if n.saturating_mul(min) > self.left() {
                    bail!("truncated: {what} declares {n} elements, more than the {} bytes left hold", self.left());
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(self.u64(what)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(what)?)),
            t => bail!("{what}: unknown value type {t}"),
        })
    }
}

impl Header {
    /// Parses the header of a whole GGUF file's bytes and checks every tensor's type, shape and
    /// data range. Errors name the key or tensor; callers add the file name.
    pub fn parse(bytes: &[u8]) -> Result<Header> {
        let mut c = Cursor { bytes, pos: 0 };
        let magic = c.u32("the magic number")?;
        if magic != MAGIC {
            bail!("not a GGUF file (magic {magic:#010x}, expected \"GGUF\")");
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (merg reads versions 2 and 3)");
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        // Each entry takes at least 13 (metadata) or 24 (tensor) bytes.
        if n_kv.saturating_mul(13).saturating_add(n_tensors.saturating_mul(24)) > c.left() {
            bail!("truncated: the header declares {n_tensors} tensors and {n_kv} metadata entries, more than the file holds");
        }
        let mut metadata = HashMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let ty = c.u32(&format!("metadata {key}"))?;
            let v = c.value(ty, &format!("metadata {key}"), 0)?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.to_u32() {
                Ok(a) if a > 0 && a.is_power_of_two() => a as u64,
                _ => bail!("metadata general.alignment {v:?} is not a power of two"),
            },
        };
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let what = format!("tensor {name}");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                bail!("{what} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})");
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64(&what)?);
            }
            let ty = c.u32(&what)?;
            let offset = c.u64(&what)?;
            raw.push((name, ne, ty, offset));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = HashMap::new();
        let mut order = vec![];
        for (name, ne, ty, offset) in raw {
            let info = tensor_info(&name, &ne, ty, offset, data_start, alignment, bytes.len() as u64)?;
            if tensors.insert(name.clone(), info).is_some() {
                bail!("tensor {name} appears twice");
            }
            order.push(name);
        }
        Ok(Header { version, metadata, tensors, order })
    }
}

fn tensor_info(name: &str, ne: &[u64], ty: u32, offset: u64, data_start: u64, alignment: u64, file_len: u64) -> Result<TensorInfo> {
    let Some(dtype) = dtype_of(ty) else {
        bail!("tensor {name} is stored as {}, a type merg cannot read (it reads {SUPPORTED})", ggml_type_name(ty));
    };
    let elems = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n > 0 && n < (1 << 48));
    let Some(elems) = elems else { bail!("tensor {name} has an impossible shape {ne:?}") };
    let block = dtype.block_size() as u64;
    if !ne[0].is_multiple_of(block) {
        bail!("tensor {name}: rows of {} values are not whole {} blocks of {block}", ne[0], ggml_type_name(ty));
    }
    let len = elems / block * dtype.type_size() as u64;
    if !offset.is_multiple_of(alignment) {
        bail!("tensor {name}: data offset {offset} is not aligned to {alignment}");
    }
    let start = data_start.checked_add(offset).filter(|s| s.checked_add(len).is_some_and(|e| e <= file_len));
    let Some(start) = start else {
        let at = data_start.saturating_add(offset);
        bail!("truncated: tensor {name} needs {len} bytes at offset {at}, so the file should be at least {} bytes, but it has {file_len} (an interrupted download?)", at.saturating_add(len));
    };
    // GGUF lists the fastest-varying dimension first; candle (and torch) list it last.
    let dims = ne.iter().rev().map(|&d| d as usize).collect();
    Ok(TensorInfo { dtype, dims, start: start as usize, len: len as usize })
}

/// A memory-mapped GGUF file with its parsed header.
pub struct GgufFile {
    pub path: PathBuf,
    pub header: Header,
    map: std::sync::Arc<MappedFile>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        crate::input::regular_file(path, &crate::input::WEIGHTS)?;
        let file = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: a read-only map of a file we never write; the same as the safetensors maps.
        let map = unsafe { MappedFile::map(file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let header = Header::parse(&map).with_context(|| format!("{} is not a usable GGUF file", path.display()))?;
        Ok(GgufFile { path: path.to_path_buf(), header, map: std::sync::Arc::new(map) })
    }

    pub fn name(&self) -> String {
        self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| self.path.display().to_string())
    }

    pub fn info(&self, tensor: &str) -> Option<&TensorInfo> {
        self.header.tensors.get(tensor)
    }

    /// Drops this process's pages of the whole file (`WeightSource::release_mappings`).
    pub fn release_all(&self) {
        crate::cpu::pages::release(&self.map[..]);
    }

    /// A tensor where it lies in the mapping.
    pub fn mapped(&self, tensor: &str) -> Option<Mapped> {
        let info = self.info(tensor)?;
        Some(Mapped::new(self.map.clone(), info.start, info.len, info.dtype, info.dims.clone()))
    }

    fn need(&self, tensor: &str) -> candle_core::Result<Mapped> {
        self.mapped(tensor).ok_or_else(|| candle_core::Error::Msg(format!("{}: no tensor {tensor}", self.name())))
    }

    /// A tensor as candle's quantized tensor (float types included), copied out of the map;
    /// the map's pages of it are released (the copy is what gets read from now on).
    pub fn qtensor(&self, tensor: &str, dev: &Device) -> candle_core::Result<QTensor> {
        let m = self.need(tensor)?;
        let q = m.qtensor(dev)?;
        m.release();
        Ok(q)
    }

    /// A tensor as a dense host tensor in its stored float type (blocks: dequantized to f32),
    /// with one copy out of the map, whose pages are then released.
    pub fn dense(&self, tensor: &str) -> candle_core::Result<candle_core::Tensor> {
        let m = self.need(tensor)?;
        let t = m.tensor()?;
        m.release();
        Ok(t)
    }

    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.header.metadata.get(key)
    }

    /// `general.architecture` (`qwen2vl`, `clip`, …).
    pub fn architecture(&self) -> Result<String> {
        let v = self.meta("general.architecture").with_context(|| format!("{}: no general.architecture in its metadata", self.name()))?;
        Ok(v.to_string().map_err(|_| anyhow::anyhow!("{}: general.architecture is not a string", self.name()))?.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A one-tensor file written by hand: header fields land where GGUF puts them.
    fn tiny(ty: u32, ne: &[u64], data: &[u8]) -> Vec<u8> {
        let mut b = vec![];
        b.extend(MAGIC.to_le_bytes());
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        string(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        string(&mut b, "qwen2vl");
        string(&mut b, "w");
        b.extend((ne.len() as u32).to_le_bytes());
        for d in ne {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(data);
        b
    }

    #[test]
    fn reads_a_tensor_with_torch_order_dims() -> Result<()> {
        let vals: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let h = Header::parse(&tiny(0, &[3, 2], &data))?;
        let t = &h.tensors["w"];
        assert_eq!(t.dims, vec![2, 3]);
        assert_eq!(t.len, 24);
        assert_eq!(h.metadata["general.architecture"].to_string()?, "qwen2vl");
        Ok(())
    }

    /// The fuzz corpus's complete seed parses (so the fuzzer starts from a valid file).
    #[test]
    fn fuzz_seed_is_a_valid_file() -> Result<()> {
        let seed = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz/corpus/gguf_header/q8_0.gguf");
        let h = Header::parse(&std::fs::read(seed)?)?;
        let t = &h.tensors["w"];
        assert_eq!((t.dims.clone(), t.dtype, t.len), (vec![2, 32], GgmlDType::Q8_0, 68));
        Ok(())
    }

    #[test]
    fn names_what_is_wrong() {
        let data = vec![0u8; 24];
        let err = |b: &[u8]| format!("{:#}", Header::parse(b).unwrap_err());
        // An IQ type is named, with the tensor.
        assert!(err(&tiny(16, &[256], &data)).contains("tensor w is stored as IQ2_XXS"));
        // Data past the end of the file.
        let e = err(&tiny(0, &[3, 4], &data));
        assert!(e.contains("truncated") && e.contains("tensor w"), "{e}");
        // Cut in the header.
        let whole = tiny(0, &[3, 2], &data);
        for cut in [3, 20, 40, 70] {
            assert!(err(&whole[..cut]).contains("truncated"), "cut at {cut}: {}", err(&whole[..cut]));
        }
        assert!(err(b"GGML\x03\0\0\0").contains("not a GGUF file"));
        // Rows not whole blocks.
        assert!(err(&tiny(8, &[33], &data)).contains("not whole Q8_0 blocks"));
    }
}
