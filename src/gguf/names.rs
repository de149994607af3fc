//! Where a transformers tensor lives in llama.cpp's files, and how to undo what llama.cpp's
//! converters (`convert_hf_to_gguf.py`, `conversion/{qwen*,gemma,llama}.py`, and for LLaVA-NeXT's
//! projector the legacy `convert_image_encoder_to_gguf.py`) did to it. Model code asks for
//! transformers names; this module answers with the GGUF tensor(s) and the inverse transform.
//! tests/fixtures/gguf/MAPPING.md lists the converter's side of every row.

/// Which of the two files holds a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The language model (`general.architecture` qwen2vl, qwen3vl, qwen3vlmoe, qwen35, gemma3, llama).
    Text,
    /// The vision projector (`mmproj-*.gguf`, architecture `clip`); Qwen2.5-Omni's also holds
    /// the audio tower.
    Vision,
}

/// How the stored tensor(s) become the transformers tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    /// Stored as is.
    Same(String),
    /// Concatenated along the first dimension (vision `attn.qkv`, split by the converter).
    Rows(Vec<String>),
    /// The temporal halves of a Conv3d patch embedding, stored as two Conv2d kernels.
    Temporal(String, String),
    /// Fused MoE `gate_up_proj` `[E, hidden, 2·inter]` from `ffn_gate_exps` and `ffn_up_exps`
    /// (each `[E, inter, hidden]`).
    GateUp(String, String),
    /// Fused MoE `down_proj` `[E, inter, hidden]` from `ffn_down_exps` `[E, hidden, inter]`.
    Swap12(String),
    /// A vector stored as a `[C, 1]` column (Qwen2.5-Omni's audio conv biases, which the
    /// converter unsqueezes for ggml's broadcast add).
    Column(String),
}

/// A value transform applied after the layout (the Qwen3.5 and Gemma 3 converters change values).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// The converter stored `w + 1` (zero-centred RMSNorm weights: Qwen3.5's, Gemma 3's).
    MinusOne,
    /// The converter stored `-exp(A_log)`.
    LogNeg,
}

/// Qwen3.5's converter moves value heads from grouped-by-key-head to tiled order when there
/// are more value than key heads; undoing it is a permutation of rows or columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Untile {
    /// Rows (0) or columns (1).
    pub dim: usize,
    /// Leading entries along `dim` that are not value heads (q and k in `in_proj_qkv`).
    pub skip: usize,
    pub key_heads: usize,
    pub per_key: usize,
    /// Entries per value head along `dim`.
    pub head: usize,
}

impl Untile {
    /// For each transformers index along the dimension, the stored index.
    pub fn source_index(&self, len: usize) -> Vec<usize> {
        (0..len)
            .map(|i| {
                if i < self.skip {
                    return i;
                }
                let j = i - self.skip;
                let (g, rest) = (j / (self.per_key * self.head), j % (self.per_key * self.head));
                let (v, d) = (rest / self.head, rest % self.head);
                // transformers: [key head g][value v][d]; stored: [value v][key head g][d].
                self.skip + (v * self.key_heads + g) * self.head + d
            })
            .collect()
    }
}

/// A reordering of a tensor's rows or columns the converter made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permute {
    /// Qwen3.5's value heads (see `Untile`).
    Untile(Untile),
    /// LLaMA's q/k rows: the converter interleaves each head's two rotary halves (`permute` in
    /// `conversion/llama.py`) for llama.cpp's pairwise rope; transformers rotates halves.
    Unrope { head_dim: usize },
}

impl Permute {
    /// Rows (0) or columns (1).
    pub fn dim(&self) -> usize {
        match self {
            Permute::Untile(u) => u.dim,
            Permute::Unrope { .. } => 0,
        }
    }

    /// For each transformers index along `dim`, the stored index.
    pub fn source_index(&self, len: usize) -> Vec<usize> {
        match self {
            Permute::Untile(u) => u.source_index(len),
            Permute::Unrope { head_dim } => {
                let d = (*head_dim).max(2);
                let half = d / 2;
                // transformers: [head][half][i]; stored: [head][i][half].
                (0..len).map(|r| (r / d) * d + 2 * (r % d % half) + r % d / half).collect()
            }
        }
    }
}

/// A located tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    pub part: Part,
    pub layout: Layout,
    pub value: Option<Value>,
    pub permute: Option<Permute>,
    /// Conv1d kernels stored without their middle dimension (`[C, K]` for `[C, 1, K]`).
    pub unsqueeze1: bool,
}

/// Head shapes for undoing reorderings: Qwen3.5's linear-attention heads, LLaMA's head width.
#[derive(Clone, Copy, Debug, Default)]
pub struct Heads {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// The attention head width (LLaMA's q/k rows are permuted per head).
    pub head_dim: usize,
}

/// The text architecture, as `general.architecture` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Qwen2Vl,
    Qwen3Vl,
    Qwen3VlMoe,
    Qwen35,
    /// Gemma 3's text model.
    Gemma3,
    /// LLaMA (LLaVA-NeXT's text model).
    Llama,
}

impl Arch {
    pub fn parse(s: &str) -> Option<Arch> {
        Some(match s {
            "qwen2vl" => Arch::Qwen2Vl,
            "qwen3vl" => Arch::Qwen3Vl,
            "qwen3vlmoe" => Arch::Qwen3VlMoe,
            "qwen35" => Arch::Qwen35,
            "gemma3" => Arch::Gemma3,
            "llama" => Arch::Llama,
            _ => return None,
        })
    }

    pub const NAMES: &'static str = "qwen2vl, qwen3vl, qwen3vlmoe, qwen35, gemma3, llama";

    /// Whether the converter stored every RMSNorm weight of the text model as `w + 1`.
    fn norms_plus_one(self) -> bool {
        matches!(self, Arch::Qwen35 | Arch::Gemma3)
    }
}

fn same(part: Part, name: String) -> Located {
    Located { part, layout: Layout::Same(name), value: None, permute: None, unsqueeze1: false }
}

/// Strips the transformers prefixes (hub layout `model.` / `visual.`, newer layout
/// `model.language_model.` / `model.visual.`, the released Gemma 3 / LLaVA-NeXT layout
/// `language_model.model.` / `language_model.lm_head`; LLaVA-NeXT's and Gemma 3's `model.vision_tower.`,
/// `model.multi_modal_projector.`, `model.image_newline`) to a canonical `model.…` / `visual.…`
/// / `vision_tower.…` / `multi_modal_projector.…` / `image_newline`.
fn canonical(name: &str) -> String {
    // Qwen2.5-Omni's released layout nests the thinker (`thinker.model.`, `thinker.visual.`,
    // `thinker.audio_tower.`); the converter strips it as well.
    let name = name.strip_prefix("thinker.").unwrap_or(name);
    if let Some(rest) = name.strip_prefix("model.language_model.").or_else(|| name.strip_prefix("language_model.model.")) {
        format!("model.{rest}")
    } else if name == "language_model.lm_head.weight" {
        "lm_head.weight".into()
    } else if let Some(rest) = name.strip_prefix("model.visual.") {
        format!("visual.{rest}")
    } else if let Some(rest) = name.strip_prefix("model.").filter(|r| r.starts_with("vision_tower.") || r.starts_with("multi_modal_projector.") || *r == "image_newline") {
        rest.to_string()
    } else {
        name.to_string()
    }
}

/// Where transformers tensor `name` is, for a text file of `arch` (and Qwen3.5's heads).
pub fn locate(name: &str, arch: Arch, heads: Heads, has_output: bool) -> Option<Located> {
    let name = canonical(name);
    if let Some(rest) = name.strip_prefix("visual.") {
        return locate_vision(rest);
    }
    if let Some(rest) = name.strip_prefix("audio_tower.") {
        return locate_audio(rest);
    }
    if let Some(rest) = name.strip_prefix("vision_tower.vision_model.") {
        return locate_tower(rest);
    }
    if name.starts_with("multi_modal_projector.") || name == "image_newline" {
        return locate_projector(&name);
    }
    let mut loc = match name.as_str() {
        "model.embed_tokens.weight" => same(Part::Text, "token_embd.weight".into()),
        "lm_head.weight" if has_output => same(Part::Text, "output.weight".into()),
        "model.norm.weight" => same(Part::Text, "output_norm.weight".into()),
        _ => {
            let rest = name.strip_prefix("model.layers.")?;
            let (layer, leaf) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            return locate_layer(layer, leaf, arch, heads);
        }
    };
    if arch.norms_plus_one() && name == "model.norm.weight" {
        loc.value = Some(Value::MinusOne);
    }
    Some(loc)
}

fn locate_layer(i: usize, leaf: &str, arch: Arch, h: Heads) -> Option<Located> {
    let blk = |s: &str| format!("blk.{i}.{s}");
    let (stem, suffix) = leaf.rsplit_once('.')?;
    let qwen35 = arch == Arch::Qwen35;
    let renamed = match stem {
        "input_layernorm" => "attn_norm",
        // Qwen3.5's and Gemma 3's archs list ATTN_POST_NORM, the others FFN_NORM, for the same
        // tensor (Gemma 3 normalizes the attention's output with it).
        "post_attention_layernorm" if qwen35 || arch == Arch::Gemma3 => "post_attention_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "mlp.gate" => "ffn_gate_inp",
        "mlp.experts" if leaf == "mlp.experts.gate_up_proj" => {
            let l = Layout::GateUp(blk("ffn_gate_exps.weight"), blk("ffn_up_exps.weight"));
            return Some(Located { part: Part::Text, layout: l, value: None, permute: None, unsqueeze1: false });
        }
        "mlp.experts" if leaf == "mlp.experts.down_proj" => {
            let l = Layout::Swap12(blk("ffn_down_exps.weight"));
            return Some(Located { part: Part::Text, layout: l, value: None, permute: None, unsqueeze1: false });
        }
        _ if qwen35 => return locate_linear_attn(i, stem, suffix, h),
        _ => return None,
    };
    let mut loc = same(Part::Text, blk(&format!("{renamed}.{suffix}")));
    if arch.norms_plus_one() && stem.ends_with("norm") {
        loc.value = Some(Value::MinusOne);
    }
    if arch == Arch::Llama && matches!(stem, "self_attn.q_proj" | "self_attn.k_proj") {
        loc.permute = Some(Permute::Unrope { head_dim: h.head_dim });
    }
    Some(loc)
}

/// Qwen3.5's Gated DeltaNet tensors (`linear_attn.*`).
fn locate_linear_attn(i: usize, stem: &str, suffix: &str, h: Heads) -> Option<Located> {
    let blk = |s: &str| format!("blk.{i}.{s}");
    let per_key = h.value_heads.checked_div(h.key_heads).unwrap_or(1);
    let untile = |dim, skip, head| (per_key > 1).then_some(Permute::Untile(Untile { dim, skip, key_heads: h.key_heads, per_key, head }));
    let (stored, permute, value, unsqueeze1) = match (stem, suffix) {
        ("linear_attn.in_proj_qkv", _) => ("attn_qkv.weight".to_string(), untile(0, 2 * h.key_heads * h.key_dim, h.value_dim), None, false),
        ("linear_attn.in_proj_z", _) => ("attn_gate.weight".into(), untile(0, 0, h.value_dim), None, false),
        ("linear_attn.in_proj_b", _) => ("ssm_beta.weight".into(), untile(0, 0, 1), None, false),
        ("linear_attn.in_proj_a", _) => ("ssm_alpha.weight".into(), untile(0, 0, 1), None, false),
        ("linear_attn", "A_log") => ("ssm_a".into(), untile(0, 0, 1), Some(Value::LogNeg), false),
        ("linear_attn", "dt_bias") => ("ssm_dt.bias".into(), untile(0, 0, 1), None, false),
        ("linear_attn.conv1d", _) => ("ssm_conv1d.weight".into(), untile(0, 2 * h.key_heads * h.key_dim, h.value_dim), None, true),
        ("linear_attn.norm", _) => ("ssm_norm.weight".into(), None, None, false),
        ("linear_attn.out_proj", _) => ("ssm_out.weight".into(), untile(1, 0, h.value_dim), None, false),
        _ => return None,
    };
    Some(Located { part: Part::Text, layout: Layout::Same(blk(&stored)), value, permute, unsqueeze1 })
}

/// The vision tower (`visual.` stripped), as the mmproj converters write it.
fn locate_vision(rest: &str) -> Option<Located> {
    let v = |s: String| Some(same(Part::Vision, s));
    match rest {
        "patch_embed.proj.weight" => {
            let l = Layout::Temporal("v.patch_embd.weight".into(), "v.patch_embd.weight.1".into());
            return Some(Located { part: Part::Vision, layout: l, value: None, permute: None, unsqueeze1: false });
        }
        "patch_embed.proj.bias" => return v("v.patch_embd.bias".into()),
        "pos_embed.weight" => return v("v.position_embd.weight".into()),
        _ => {}
    }
    if let Some(m) = rest.strip_prefix("merger.") {
        let (stem, suffix) = m.rsplit_once('.')?;
        let s = match stem {
            "ln_q" | "norm" => "v.post_ln",
            "mlp.0" | "linear_fc1" => "mm.0",
            "mlp.2" | "linear_fc2" => "mm.2",
            _ => return None,
        };
        return v(format!("{s}.{suffix}"));
    }
    if let Some(d) = rest.strip_prefix("deepstack_merger_list.") {
        // The converter names DeepStack mergers by the tower layer they read; the caller maps
        // the merger's list index to that layer (see `GgufWeights`).
        let (idx, tail) = d.split_once('.')?;
        let (stem, suffix) = tail.rsplit_once('.')?;
        let s = match stem {
            "norm" => "norm",
            "linear_fc1" => "fc1",
            "linear_fc2" => "fc2",
            _ => return None,
        };
        return v(format!("v.deepstack.@{idx}.{s}.{suffix}"));
    }
    let b = rest.strip_prefix("blocks.")?;
    let (i, leaf) = b.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let (stem, suffix) = leaf.rsplit_once('.')?;
    let blk = |s: &str| format!("v.blk.{i}.{s}.{suffix}");
    let s = match stem {
        "norm1" => "ln1",
        "norm2" => "ln2",
        "attn.proj" => "attn_out",
        "mlp.fc1" | "mlp.up_proj" | "mlp.linear_fc1" => "ffn_up",
        "mlp.fc2" | "mlp.down_proj" | "mlp.linear_fc2" => "ffn_down",
        "mlp.gate_proj" => "ffn_gate",
        // Qwen2.5-Omni's tower keeps q, k and v apart (the converter maps them one to one).
        "attn.q" => "attn_q",
        "attn.k" => "attn_k",
        "attn.v" => "attn_v",
        // Qwen2/2.5-VL's converter splits qkv; Qwen3-VL's keeps it (`attn_qkv`). The source
        // tries the fused name first.
        "attn.qkv" => {
            let l = Layout::Rows(vec![blk("attn_qkv"), blk("attn_q"), blk("attn_k"), blk("attn_v")]);
            return Some(Located { part: Part::Vision, layout: l, value: None, permute: None, unsqueeze1: false });
        }
        _ => return None,
    };
    v(blk(s))
}

/// Qwen2.5-Omni's Whisper-style audio tower (`audio_tower.` stripped), as the converter's
/// `Qwen25AudioModel` writes it into the projector: convolutions `a.conv1d.{1,2}` (weights in
/// f16 at every output type, biases as `[C, 1]` columns), layers `a.blk.*` under the ViT
/// names, `a.post_ln`, and the projection as `mm.a.fc`. The sinusoidal table it adds
/// (`a.position_embd.weight`) is computed by the model, and the unused `audio_bos_eos_token`
/// is not written.
fn locate_audio(rest: &str) -> Option<Located> {
    let (stem, suffix) = rest.rsplit_once('.')?;
    let stored = match stem {
        "conv1" | "conv2" => {
            let s = format!("a.conv1d.{}.{suffix}", &stem[4..]);
            let layout = if suffix == "bias" { Layout::Column(s) } else { Layout::Same(s) };
            return Some(Located { part: Part::Vision, layout, value: None, permute: None, unsqueeze1: false });
        }
        "ln_post" => format!("a.post_ln.{suffix}"),
        "proj" => format!("mm.a.fc.{suffix}"),
        _ => {
            let (i, leaf) = stem.strip_prefix("layers.")?.split_once('.')?;
            let i: usize = i.parse().ok()?;
            let s = match leaf {
                "self_attn_layer_norm" => "ln1",
                "final_layer_norm" => "ln2",
                "fc1" => "ffn_up",
                "fc2" => "ffn_down",
                _ => attention_leaf(leaf)?,
            };
            format!("a.blk.{i}.{s}.{suffix}")
        }
    };
    Some(same(Part::Vision, stored))
}

/// The attention projections' names in llama.cpp's towers (Whisper's and CLIP's alike).
fn attention_leaf(leaf: &str) -> Option<&'static str> {
    Some(match leaf {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.out_proj" => "attn_out",
        _ => return None,
    })
}

/// A CLIP or SigLIP tower (`vision_tower.vision_model.` stripped: LLaVA-NeXT, Gemma 3). The
/// legacy LLaVA converter names `mlp.fc1` `ffn_down` and `mlp.fc2` `ffn_up`; the source swaps
/// them back for such files (see `GgufWeights`), as llama.cpp's clip loader does.
fn locate_tower(rest: &str) -> Option<Located> {
    let v = |s: String| Some(same(Part::Vision, s));
    match rest {
        "embeddings.class_embedding" => return v("v.class_embd".into()),
        "embeddings.position_embedding.weight" => return v("v.position_embd.weight".into()),
        _ => {}
    }
    let (stem, suffix) = rest.rsplit_once('.')?;
    let top = match stem {
        "embeddings.patch_embedding" => Some("v.patch_embd"),
        "pre_layrnorm" => Some("v.pre_ln"),
        "post_layernorm" => Some("v.post_ln"),
        _ => None,
    };
    if let Some(t) = top {
        return v(format!("{t}.{suffix}"));
    }
    let (i, leaf) = stem.strip_prefix("encoder.layers.")?.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let s = match leaf {
        "layer_norm1" => "ln1",
        "layer_norm2" => "ln2",
        "mlp.fc1" => "ffn_up",
        "mlp.fc2" => "ffn_down",
        _ => attention_leaf(leaf)?,
    };
    v(format!("v.blk.{i}.{s}.{suffix}"))
}

/// LLaVA-NeXT's MLP projector and row marker, Gemma 3's soft-embedding norm (stored `w + 1`)
/// and input projection.
fn locate_projector(name: &str) -> Option<Located> {
    let stored = match name {
        "image_newline" => "model.image_newline".to_string(),
        "multi_modal_projector.mm_input_projection_weight" => "mm.input_projection.weight".into(),
        "multi_modal_projector.mm_soft_emb_norm.weight" => {
            return Some(Located { value: Some(Value::MinusOne), ..same(Part::Vision, "mm.soft_emb_norm.weight".into()) });
        }
        _ => {
            let (stem, suffix) = name.strip_prefix("multi_modal_projector.")?.rsplit_once('.')?;
            match stem {
                "linear_1" => format!("mm.0.{suffix}"),
                "linear_2" => format!("mm.2.{suffix}"),
                _ => return None,
            }
        }
    };
    Some(same(Part::Vision, stored))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_names_follow_the_converter() {
        let h = Heads::default();
        let l = |n| locate(n, Arch::Qwen2Vl, h, false).map(|l| l.layout);
        assert_eq!(l("model.layers.3.self_attn.q_proj.bias"), Some(Layout::Same("blk.3.attn_q.bias".into())));
        assert_eq!(l("model.language_model.layers.0.post_attention_layernorm.weight"), Some(Layout::Same("blk.0.ffn_norm.weight".into())));
        assert_eq!(l("lm_head.weight"), None, "tied: the model falls back to the embedding");
        assert_eq!(l("visual.merger.mlp.2.bias"), Some(Layout::Same("mm.2.bias".into())));
        assert_eq!(l("model.visual.blocks.1.mlp.linear_fc2.weight"), Some(Layout::Same("v.blk.1.ffn_down.weight".into())));
        let n = locate("model.layers.0.input_layernorm.weight", Arch::Qwen35, h, true).unwrap();
        assert_eq!(n.value, Some(Value::MinusOne));
        let n = locate("model.layers.0.linear_attn.norm.weight", Arch::Qwen35, h, true).unwrap();
        assert_eq!((n.layout, n.value), (Layout::Same("blk.0.ssm_norm.weight".into()), None));
    }

    /// Qwen2.5-Omni's thinker (`thinker.` stripped): the audio tower in the projector under the
    /// converter's `a.*` / `mm.a.fc` names, its conv biases as columns, the vision tower's
    /// separate q/k/v.
    #[test]
    fn omni_names_follow_the_converter() {
        let l = |n| locate(n, Arch::Qwen2Vl, Heads::default(), true).map(|l| (l.part, l.layout));
        let vision = |s: &str| Some((Part::Vision, Layout::Same(s.into())));
        assert_eq!(l("thinker.audio_tower.conv2.weight"), vision("a.conv1d.2.weight"));
        assert_eq!(l("thinker.audio_tower.conv1.bias"), Some((Part::Vision, Layout::Column("a.conv1d.1.bias".into()))));
        assert_eq!(l("audio_tower.layers.1.self_attn_layer_norm.bias"), vision("a.blk.1.ln1.bias"));
        assert_eq!(l("audio_tower.layers.0.final_layer_norm.weight"), vision("a.blk.0.ln2.weight"));
        assert_eq!(l("audio_tower.layers.0.self_attn.out_proj.weight"), vision("a.blk.0.attn_out.weight"));
        assert_eq!(l("audio_tower.layers.0.fc1.weight"), vision("a.blk.0.ffn_up.weight"));
        assert_eq!(l("audio_tower.layers.0.fc2.bias"), vision("a.blk.0.ffn_down.bias"));
        assert_eq!(l("audio_tower.ln_post.weight"), vision("a.post_ln.weight"));
        assert_eq!(l("thinker.audio_tower.proj.bias"), vision("mm.a.fc.bias"));
        assert_eq!(l("thinker.visual.blocks.2.attn.k.bias"), vision("v.blk.2.attn_k.bias"));
        assert_eq!(l("thinker.model.layers.0.mlp.up_proj.weight"), Some((Part::Text, Layout::Same("blk.0.ffn_up.weight".into()))));
        assert_eq!(l("thinker.lm_head.weight"), Some((Part::Text, Layout::Same("output.weight".into()))));
        assert_eq!(l("audio_tower.audio_bos_eos_token.weight"), None);
        assert_eq!(l("talker.model.layers.0.mlp.up_proj.weight"), None);
    }

    /// Gemma 3's and LLaVA-NeXT's names in every transformers layout, Gemma's `w + 1` norms.
    #[test]
    fn gemma3_and_llava_names_follow_the_converters() {
        let h = Heads { head_dim: 4, ..Heads::default() };
        let l = |n, arch| locate(n, arch, h, true).map(|l| (l.layout, l.value));
        let same = |s: &str, v| Some((Layout::Same(s.into()), v));
        let minus = Some(Value::MinusOne);
        assert_eq!(l("language_model.model.layers.2.pre_feedforward_layernorm.weight", Arch::Gemma3), same("blk.2.ffn_norm.weight", minus));
        assert_eq!(l("model.language_model.layers.0.post_attention_layernorm.weight", Arch::Gemma3), same("blk.0.post_attention_norm.weight", minus));
        assert_eq!(l("model.layers.1.self_attn.k_norm.weight", Arch::Gemma3), same("blk.1.attn_k_norm.weight", minus));
        assert_eq!(l("model.layers.1.post_attention_layernorm.weight", Arch::Llama), same("blk.1.ffn_norm.weight", None));
        assert_eq!(l("language_model.lm_head.weight", Arch::Llama), same("output.weight", None));
        assert_eq!(l("model.multi_modal_projector.mm_soft_emb_norm.weight", Arch::Gemma3), same("mm.soft_emb_norm.weight", minus));
        assert_eq!(l("vision_tower.vision_model.encoder.layers.1.mlp.fc1.bias", Arch::Gemma3), same("v.blk.1.ffn_up.bias", None));
        assert_eq!(l("model.vision_tower.vision_model.pre_layrnorm.weight", Arch::Llama), same("v.pre_ln.weight", None));
        assert_eq!(l("model.image_newline", Arch::Llama), same("model.image_newline", None));
        assert_eq!(l("multi_modal_projector.linear_2.weight", Arch::Llama), same("mm.2.weight", None));
        let q = locate("model.layers.0.self_attn.q_proj.weight", Arch::Llama, h, true).unwrap();
        assert_eq!(q.permute, Some(Permute::Unrope { head_dim: 4 }));
        assert_eq!(locate("model.layers.0.self_attn.q_proj.weight", Arch::Gemma3, h, true).unwrap().permute, None);
    }

    /// The inverse of `conversion/llama.py`'s `permute`: two heads of width 4, each head's
    /// halves [a0 a1 | b0 b1] stored interleaved [a0 b0 a1 b1].
    #[test]
    fn unrope_inverts_the_llama_permute() {
        let stored = ["a0", "b0", "a1", "b1", "c0", "d0", "c1", "d1"];
        let back: Vec<_> = Permute::Unrope { head_dim: 4 }.source_index(8).into_iter().map(|i| stored[i]).collect();
        assert_eq!(back, ["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1"]);
    }

    /// The inverse of the converter's `_reorder_v_heads`: 2 key heads, 3 values each.
    #[test]
    fn untile_inverts_the_reorder() {
        let u = Untile { dim: 0, skip: 2, key_heads: 2, per_key: 3, head: 1 };
        // Converter: grouped [g0v0 g0v1 g0v2 g1v0 g1v1 g1v2] → tiled [g0v0 g1v0 g0v1 g1v1 g0v2 g1v2].
        let grouped = ["g0v0", "g0v1", "g0v2", "g1v0", "g1v1", "g1v2"];
        let tiled = ["q", "k", "g0v0", "g1v0", "g0v1", "g1v1", "g0v2", "g1v2"];
        let idx = u.source_index(8);
        let back: Vec<_> = idx.iter().map(|&i| tiled[i]).collect();
        assert_eq!(&back[2..], &grouped);
        assert_eq!(&back[..2], &["q", "k"]);
    }
}
