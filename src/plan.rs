//! Memory planning from a config alone: what the weights, the vision tower, each token's K/V
//! and each sequence's recurrent state take, and how many dialogues of a given context fit
//! in a memory budget. `merg plan` prints it; the engine's own sizes use the same formulas
//! (`kv_pool::bytes_per_block`, `models::cost::state_bytes_per_seq`, `memory::auto_kv_bytes`).

use serde::Serialize;

use crate::models::cost::state_bytes_per_seq;
use crate::memory::{LoadCost, RUNTIME_BYTES};
use crate::models::{ModelSpec, ParamCounts};
use crate::weights::Quant;

/// How the weights are held.
#[derive(Clone, Copy, Debug)]
pub struct Precision {
    /// Bytes per dense weight (bf16: 2).
    pub dense_bytes: f64,
    /// Linear layers quantized (in situ, as `--quant` does).
    pub quant: Option<Quant>,
    /// The vision tower quantized too (`--quant-vision`).
    pub quant_vision: bool,
    /// K/V stored as 8-bit codes (`--kv-dtype q8`) instead of `dense_bytes` a value.
    pub kv_q8: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub params: ParamCounts,
    pub text_weight_bytes: u64,
    pub vision_weight_bytes: u64,
    /// K and V of one token over every global attention layer (in the dense dtype).
    pub kv_bytes_per_token: u64,
    /// K and V the sliding-window layers keep per sequence, whatever its length: the window's
    /// blocks (`memory::window_blocks`, blocks of 16 tokens as the engine's default); 0
    /// without such layers.
    pub window_bytes_per_sequence: u64,
    /// … and once for all sequences: one step's new tokens (2048, the engine's default).
    pub window_step_bytes: u64,
    /// Conv windows and delta-rule states of one sequence (f32; 0 without recurrent layers).
    pub state_bytes_per_sequence: u64,
    /// Activations, workspace and runtime, kept back from the budget.
    pub reserve_bytes: u64,
    pub budget_bytes: u64,
    /// Bytes left for K/V and states after weights and reserve (negative: weights alone do not fit).
    pub free_bytes: i64,
    /// The host's memory at the load's peak (`memory::LoadCost`).
    pub host_load_peak_bytes: u64,
    /// The host's memory when the weights go to a GPU (`None`: one memory, the budget).
    pub host_budget_bytes: Option<u64>,
    /// Whether the load's peak fits the host (or the one memory).
    pub host_fits: bool,
    pub context: usize,
    /// Dialogues of `context` tokens that fit at once.
    pub dialogues_that_fit: u64,
    /// Longest context each of `dialogues` dialogues can have.
    pub dialogues: u64,
    pub context_that_fits: u64,
    /// Whether `dialogues` × `context` fits.
    pub fits: bool,
}

pub fn weight_bytes(p: &ParamCounts, spec: &ModelSpec, prec: Precision) -> (u64, u64) {
    let dense = |n: u64| (n as f64 * prec.dense_bytes) as u64;
    let text = match prec.quant {
        None => dense(p.text_linear + p.text_other),
        Some(q) => {
            let bits = q.bits_per_weight();
            // A tied head gets its own quantized copy; the embedding lookup stays dense.
            let head = if p.tied_head { (spec.vocab_size * spec.hidden_size) as u64 } else { 0 };
            ((p.text_linear + head) as f64 * bits / 8.0) as u64 + dense(p.text_other)
        }
    };
    // The media towers (vision, and audio for Qwen2.5-Omni) stay dense unless asked for.
    let towers = p.vision + p.audio;
    let vision = match (prec.quant, prec.quant_vision) {
        (Some(q), true) => (towers as f64 * q.bits_per_weight() / 8.0) as u64,
        _ => dense(towers),
    };
    (text, vision)
}

/// Where the memory is: one memory holding weights, K/V and the load (CPU), or a device of
/// `device` bytes fed from a host of `host` bytes (GPU).
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub device: u64,
    pub host: Option<u64>,
    /// Kept back on the device for activations, workspace and the runtime.
    pub reserve: u64,
}

/// What loading takes when only the config is known: weights as `weight_bytes` says, the host
/// passing one tensor at a time, the largest being the vocabulary × hidden table: in-situ
/// quantization makes its blocks from the file a band of rows at a time (the blocks gathered,
/// then copied into the quantized tensor), else it is in flight in the checkpoint's 2-byte
/// dtype and the compute dtype.
pub fn config_load_cost(p: &ParamCounts, spec: &ModelSpec, prec: Precision, gpu: bool) -> LoadCost {
    let (text, vision) = weight_bytes(p, spec, prec);
    let largest = (spec.vocab_size * spec.hidden_size) as f64;
    let in_flight = match prec.quant {
        Some(q) => largest * q.bits_per_weight() / 8.0 * 2.0 + crate::cpu::pages::BAND_BYTES as f64,
        None => largest * (2.0 + prec.dense_bytes),
    } as u64;
    let resident = if gpu { 0 } else { text + vision };
    LoadCost { text_bytes: text, vision_bytes: vision, host_peak_bytes: resident + in_flight + RUNTIME_BYTES }
}

pub fn plan(p: &ParamCounts, spec: &ModelSpec, prec: Precision, budget: Budget, context: usize, dialogues: u64) -> Plan {
    plan_with_load(p, spec, prec, config_load_cost(p, spec, prec, budget.host.is_some()), budget, context, dialogues)
}

/// As `plan`, for weights whose load is known (GGUF files: `gguf::load_cost`).
pub fn plan_with_load(p: &ParamCounts, spec: &ModelSpec, prec: Precision, load: LoadCost, budget: Budget, context: usize, dialogues: u64) -> Plan {
    let (text, vision, reserve) = (load.text_bytes, load.vision_bytes, budget.reserve);
    let width = spec.num_kv_heads * spec.head_dim;
    let row = 2 * match prec.kv_q8 {
        true => crate::memory::q8_row_bytes(width, spec.head_dim),
        false => width as u64 * prec.dense_bytes as u64,
    };
    let kv = spec.num_global_layers() as u64 * row;
    // Sliding layers: a window's blocks per sequence and one step's tokens, as the engine's
    // pool split counts them (no more than the context itself needs).
    let (window, step) = match spec.sliding_window() {
        Some(w) => {
            let tokens = |n: usize| (n.min(context.max(1)).div_ceil(PLAN_BLOCK) * PLAN_BLOCK) as u64 * spec.num_sliding_layers() as u64 * row;
            (tokens(crate::memory::window_blocks(w.min(context.max(1)), PLAN_BLOCK) * PLAN_BLOCK), tokens(PLAN_STEP))
        }
        None => (0, 0),
    };
    let state = state_bytes_per_seq(spec);
    let free = budget.device as i64 - (text + vision + reserve) as i64;
    let per_dialogue = kv * context as u64 + window + state;
    let (fit_n, fit_ctx) = match free {
        f if f <= step as i64 => (0, 0),
        f => {
            let f = f as u64 - step;
            let n = f / per_dialogue.max(1);
            let ctx = (f / dialogues.max(1)).saturating_sub(state + window) / kv.max(1);
            (n, ctx)
        }
    };
    // One memory: the load's peak must fit it too (it is over before K/V is allocated).
    let host_fits = load.host_peak_bytes <= budget.host.unwrap_or(budget.device);
    Plan {
        params: *p,
        text_weight_bytes: text,
        vision_weight_bytes: vision,
        kv_bytes_per_token: kv,
        window_bytes_per_sequence: window,
        window_step_bytes: step,
        state_bytes_per_sequence: state,
        reserve_bytes: reserve,
        budget_bytes: budget.device,
        free_bytes: free,
        host_load_peak_bytes: load.host_peak_bytes,
        host_budget_bytes: budget.host,
        host_fits,
        context,
        dialogues_that_fit: fit_n,
        dialogues,
        context_that_fits: fit_ctx.min(spec.max_context as u64),
        fits: fit_n >= dialogues && context <= spec.max_context && host_fits,
    }
}

pub use crate::memory::{auto_kv_bytes, DEFAULT_RESERVE};

/// The engine's default block size and step tokens, which the sliding layers' share follows.
const PLAN_BLOCK: usize = 16;
const PLAN_STEP: usize = 2048;

pub use crate::memory::gib;

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "weights:            {} (text {}, vision tower {})", gib(self.text_weight_bytes + self.vision_weight_bytes), gib(self.text_weight_bytes), gib(self.vision_weight_bytes))?;
        writeln!(f, "KV per token:       {} KiB", self.kv_bytes_per_token as f64 / 1024.0)?;
        if self.window_bytes_per_sequence > 0 {
            let mib = |b: u64| b as f64 / 1048576.0;
            writeln!(f, "sliding-window K/V: {:.1} MiB per sequence (its window, whatever its length) + {:.1} MiB for one step", mib(self.window_bytes_per_sequence), mib(self.window_step_bytes))?;
        }
        writeln!(f, "state per sequence: {} MiB (recurrent layers, f32)", self.state_bytes_per_sequence as f64 / 1048576.0)?;
        writeln!(f, "reserve:            {} (activations, workspace)", gib(self.reserve_bytes))?;
        writeln!(f, "budget:             {}; {} left for K/V and states", gib(self.budget_bytes), gib(self.free_bytes.max(0) as u64))?;
        let host = match self.host_budget_bytes {
            Some(h) => format!("of the host's {}", gib(h)),
            None => format!("of the {} budget, before K/V is allocated", gib(self.budget_bytes)),
        };
        writeln!(f, "loading peak:       {} {host}{}", gib(self.host_load_peak_bytes), if self.host_fits { "" } else { ": DOES NOT FIT" })?;
        writeln!(f, "fits:               {} dialogues of {} tokens at once; {} dialogues get up to {} tokens each", self.dialogues_that_fit, self.context, self.dialogues, self.context_that_fits)?;
        let why = match (self.fits, self.host_fits) {
            (true, _) => String::new(),
            (false, false) => format!(" (the {} cannot load it)", if self.host_budget_bytes.is_some() { "host" } else { "memory" }),
            (false, true) => format!(" (the {} is too small for them)", if self.host_budget_bytes.is_some() { "device" } else { "memory" }),
        };
        write!(f, "verdict:            {} dialogues × {} tokens {}{why}", self.dialogues, self.context, if self.fits { "FIT" } else { "DO NOT FIT" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::LayerKind;

    /// Gemma 3 12B's text shape (48 layers, every sixth global, window 1024, 8 kv heads of
    /// 256): K/V per token counts the 8 global layers, the 40 sliding ones a window's blocks
    /// per dialogue, and more dialogues of 4k fit than if every layer kept every token.
    #[test]
    fn sliding_layers_count_their_window_per_dialogue() {
        let c = crate::models::gemma3::Config::from_value(&serde_json::json!({
            "model_type": "gemma3",
            "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14}
        }))
        .unwrap();
        use crate::models::FamilyConfig;
        let (spec, p) = (c.spec(), c.param_counts());
        let prec = Precision { dense_bytes: 2.0, quant: Some(Quant::Q4K), quant_vision: false, kv_q8: false };
        let budget = Budget { device: 24 << 30, host: None, reserve: DEFAULT_RESERVE };
        let plan = plan(&p, &spec, prec, budget, 4096, 8);
        let row = 2 * 8 * 256 * 2;
        assert_eq!(plan.kv_bytes_per_token, 8 * row);
        assert_eq!(plan.window_bytes_per_sequence, 40 * row * (64 + 2) * 16);
        assert_eq!(plan.window_step_bytes, 40 * row * 2048);
        assert!(plan.fits, "{plan}");
        let global = ModelSpec { layers: vec![LayerKind::Attention; 48], ..spec.clone() };
        let all = super::plan(&p, &global, prec, budget, 4096, 8);
        assert_eq!((all.kv_bytes_per_token, all.window_bytes_per_sequence), (48 * row, 0));
        assert!(plan.dialogues_that_fit > 2 * all.dialogues_that_fit, "{} vs {}", plan.dialogues_that_fit, all.dialogues_that_fit);
    }
}
