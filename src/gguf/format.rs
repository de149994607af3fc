//! What format a GGUF text model is in, named as llama.cpp names it (`q4_k_m`, `q8_0`, `bf16`,
//! `f32`), from the types its tensors are stored in. llama.cpp's `general.file_type` says how
//! the file was made, but a hand-made or re-quantized file can carry a stale one, so it only
//! names the file when its main type is the one most matrices are really stored in.

use std::collections::BTreeMap;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use serde::Serialize;

use super::file::{GgufFile, TensorInfo};
pub use crate::weights::ledger::type_name;
use crate::weights::TypeCount;

/// llama.cpp's `LlamaFileType` values merg can read (gguf-py `constants.py`), with the type
/// the file's matrices are mostly stored in. The others are IQ/TQ types merg has no reader
/// for, or ids llama.cpp has retired.
const FILE_TYPES: [(u32, &str, GgmlDType); 18] = [
    (0, "f32", GgmlDType::F32),
    (1, "f16", GgmlDType::F16),
    (2, "q4_0", GgmlDType::Q4_0),
    (3, "q4_1", GgmlDType::Q4_1),
    (7, "q8_0", GgmlDType::Q8_0),
    (8, "q5_0", GgmlDType::Q5_0),
    (9, "q5_1", GgmlDType::Q5_1),
    (10, "q2_k", GgmlDType::Q2K),
    (11, "q3_k_s", GgmlDType::Q3K),
    (12, "q3_k_m", GgmlDType::Q3K),
    (13, "q3_k_l", GgmlDType::Q3K),
    (14, "q4_k_s", GgmlDType::Q4K),
    (15, "q4_k_m", GgmlDType::Q4K),
    (16, "q5_k_s", GgmlDType::Q5K),
    (17, "q5_k_m", GgmlDType::Q5K),
    (18, "q6_k", GgmlDType::Q6K),
    (21, "q2_k_s", GgmlDType::Q2K),
    (32, "bf16", GgmlDType::BF16),
];

/// llama.cpp's name for a `general.file_type` value (`MOSTLY_Q4_K_M`), when merg knows it.
pub fn file_type_label(id: u32) -> Option<String> {
    let (_, name, _) = FILE_TYPES.iter().find(|(i, ..)| *i == id)?;
    Some(if id == 0 { "ALL_F32".into() } else { format!("MOSTLY_{}", name.to_ascii_uppercase()) })
}

/// Each type with how many of `matrices` are stored in it, most first (ties by name: the
/// matrices come in the header's hash order, and a run's name must not change with it).
fn tally(matrices: &[GgmlDType]) -> Vec<(GgmlDType, usize)> {
    let mut counts: Vec<(GgmlDType, usize)> = vec![];
    for &t in matrices {
        match counts.iter_mut().find(|(c, _)| *c == t) {
            Some((_, n)) => *n += 1,
            None => counts.push((t, 1)),
        }
    }
    counts.sort_by_key(|c| (std::cmp::Reverse(c.1), type_name(c.0)));
    counts
}

/// The format's name from `general.file_type` (if any) and the stored type of every matrix
/// (tensors of two or more dimensions; norms and biases are f32 in every format): the file
/// type's name when its main type is the most common, else the one type, else the mix
/// spelled out (`mix(12 q4_k, 3 q6_k)`).
pub fn format_name(file_type: Option<u32>, matrices: &[GgmlDType]) -> String {
    let counts = tally(matrices);
    let Some(&(main, _)) = counts.first() else { return "empty".into() };
    let labelled = FILE_TYPES.iter().find(|(id, _, t)| Some(*id) == file_type && *t == main);
    match (labelled, counts.len()) {
        (Some((_, name, _)), _) => name.to_string(),
        (None, 1) => type_name(main).to_string(),
        (None, _) => format!("mix({})", counts.iter().map(|(t, n)| format!("{n} {}", type_name(*t))).collect::<Vec<_>>().join(", ")),
    }
}

/// A GGUF text model's format: its name, llama.cpp's label and its tensors by type.
#[derive(Clone, Debug, Serialize)]
pub struct Format {
    pub name: String,
    /// `general.file_type` as llama.cpp names it (or its number when merg does not know it).
    pub file_type: Option<String>,
    /// The text model's tensors (those merg loads) by stored type.
    pub tensor_types: BTreeMap<String, TypeCount>,
    /// The type most matrices are stored in.
    #[serde(skip)]
    pub main: Option<GgmlDType>,
}

impl Format {
    /// The format of text model `file` (multi-token-prediction tensors, which merg skips, left
    /// out).
    pub fn of(file: &GgufFile) -> Format {
        let tensors: Vec<&TensorInfo> = file.header.tensors.iter().filter(|(name, _)| !super::is_mtp(file, name)).map(|(_, t)| t).collect();
        let matrices: Vec<GgmlDType> = tensors.iter().filter(|t| t.dims.len() >= 2).map(|t| t.dtype).collect();
        let file_type = file.meta("general.file_type").and_then(|v| v.to_u32().ok());
        let mut tensor_types = BTreeMap::<String, TypeCount>::new();
        for t in &tensors {
            tensor_types.entry(type_name(t.dtype).into()).or_default().add(t.len as u64);
        }
        Format {
            name: format_name(file_type, &matrices),
            file_type: file_type.map(|id| file_type_label(id).unwrap_or_else(|| id.to_string())),
            tensor_types,
            main: tally(&matrices).first().map(|(t, _)| *t),
        }
    }

    /// The compute dtype when none is asked for: bf16 for a bf16 file (f32 would double the
    /// memory and the bytes each decode step reads, for no precision the file has), else the
    /// device's default. F16 files stay at f32: bf16 would drop mantissa bits they hold.
    pub fn default_dtype(&self, device: &Device) -> DType {
        match self.main {
            Some(GgmlDType::BF16) => DType::BF16,
            _ => crate::weights::default_dtype(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlDType::*;

    fn of(spec: &[(GgmlDType, usize)]) -> Vec<GgmlDType> {
        spec.iter().flat_map(|&(t, n)| std::iter::repeat_n(t, n)).collect()
    }

    #[test]
    fn names_follow_the_tensor_types() {
        // llama.cpp's Q4_K_M: mostly Q4_K, some Q6_K, narrow rows in Q5_0 / Q8_0.
        let q4_k_m = of(&[(Q4K, 12), (Q6K, 3), (Q5_0, 1), (Q8_0, 1)]);
        assert_eq!(format_name(Some(15), &q4_k_m), "q4_k_m");
        assert_eq!(format_name(Some(14), &of(&[(Q4K, 10), (Q5K, 2)])), "q4_k_s");
        // No file type: the mix, spelled out, most common first.
        assert_eq!(format_name(None, &q4_k_m), "mix(12 q4_k, 3 q6_k, 1 q5_0, 1 q8_0)");
        // A file type that disagrees with the tensors is not believed.
        assert_eq!(format_name(Some(7), &q4_k_m), "mix(12 q4_k, 3 q6_k, 1 q5_0, 1 q8_0)");
        // Ties are named in one order whatever order the tensors come in (the 0.5B file's
        // name swapped its q4_k and q6_k between runs).
        let tied = of(&[(Q5_0, 132), (Q6K, 12), (Q8_0, 13), (Q4K, 12)]);
        let reversed: Vec<GgmlDType> = tied.iter().rev().copied().collect();
        for m in [&tied, &reversed] {
            assert_eq!(format_name(None, m), "mix(132 q5_0, 13 q8_0, 12 q4_k, 12 q6_k)");
        }
        assert_eq!(format_name(Some(0), &of(&[(Q8_0, 15)])), "q8_0");
        // One type, with or without the label.
        assert_eq!(format_name(Some(7), &of(&[(Q8_0, 15)])), "q8_0");
        assert_eq!(format_name(None, &of(&[(Q8_0, 15)])), "q8_0");
        assert_eq!(format_name(Some(32), &of(&[(BF16, 15)])), "bf16");
        assert_eq!(format_name(Some(0), &of(&[(F32, 15)])), "f32");
        assert_eq!(format_name(Some(1024), &of(&[(F16, 3)])), "f16");
        assert_eq!(format_name(None, &[]), "empty");
    }

    #[test]
    fn file_type_labels_are_llama_cpp_names() {
        let labels: Vec<_> = [0, 1, 2, 3, 7, 8, 9, 14, 15, 16, 17, 18, 32].iter().map(|&i| file_type_label(i).unwrap()).collect();
        let want = [
            "ALL_F32", "MOSTLY_F16", "MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q8_0", "MOSTLY_Q5_0", "MOSTLY_Q5_1", "MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M",
            "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M", "MOSTLY_Q6_K", "MOSTLY_BF16",
        ];
        assert_eq!(labels, want);
        // Retired (Q4_2) and IQ types are not claimed.
        assert_eq!(file_type_label(5), None);
        assert_eq!(file_type_label(19), None);
    }

    #[test]
    fn bf16_files_default_to_bf16() {
        let format = |main| Format { name: String::new(), file_type: None, tensor_types: BTreeMap::new(), main };
        assert_eq!(format(Some(BF16)).default_dtype(&Device::Cpu), DType::BF16);
        for main in [Some(F32), Some(F16), Some(Q4K), None] {
            assert_eq!(format(main).default_dtype(&Device::Cpu), DType::F32, "{main:?}");
        }
    }
}
