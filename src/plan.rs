//! Memory planning from a config alone: what the weights, the vision tower, each token's K/V
//! and each sequence's recurrent state take, and how many dialogues of a given context fit
//! in a memory budget. `merg plan` prints it; the engine's own sizes use the same formulas
//! (`kv_pool::bytes_per_block`, `engine::state_bytes_per_seq`).

use serde::Serialize;

use crate::engine::engine::state_bytes_per_seq;
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
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub params: ParamCounts,
    pub text_weight_bytes: u64,
    pub vision_weight_bytes: u64,
    /// K and V of one token over every attention layer (in the dense dtype).
    pub kv_bytes_per_token: u64,
    /// Conv windows and delta-rule states of one sequence (f32; 0 without recurrent layers).
    pub state_bytes_per_sequence: u64,
    /// Activations, workspace and runtime, kept back from the budget.
    pub reserve_bytes: u64,
    pub budget_bytes: u64,
    /// Bytes left for K/V and states after weights and reserve (negative: weights alone do not fit).
    pub free_bytes: i64,
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
    let vision = match (prec.quant, prec.quant_vision) {
        (Some(q), true) => (p.vision as f64 * q.bits_per_weight() / 8.0) as u64,
        _ => dense(p.vision),
    };
    (text, vision)
}

pub fn plan(p: &ParamCounts, spec: &ModelSpec, prec: Precision, budget: u64, reserve: u64, context: usize, dialogues: u64) -> Plan {
    plan_with_weights(p, spec, prec, weight_bytes(p, spec, prec), budget, reserve, context, dialogues)
}

/// As `plan`, for weights whose loaded sizes are known (GGUF files: `gguf::loaded_bytes`).
#[allow(clippy::too_many_arguments)]
pub fn plan_with_weights(p: &ParamCounts, spec: &ModelSpec, prec: Precision, (text, vision): (u64, u64), budget: u64, reserve: u64, context: usize, dialogues: u64) -> Plan {
    let kv = 2 * (spec.num_attention_layers() * spec.num_kv_heads * spec.head_dim) as u64 * prec.dense_bytes as u64;
    let state = state_bytes_per_seq(spec);
    let free = budget as i64 - (text + vision + reserve) as i64;
    let per_dialogue = kv * context as u64 + state;
    let (fit_n, fit_ctx) = match free {
        f if f <= 0 => (0, 0),
        f => {
            let f = f as u64;
            let n = f / per_dialogue.max(1);
            let ctx = (f / dialogues.max(1)).saturating_sub(state) / kv.max(1);
            (n, ctx)
        }
    };
    Plan {
        params: *p,
        text_weight_bytes: text,
        vision_weight_bytes: vision,
        kv_bytes_per_token: kv,
        state_bytes_per_sequence: state,
        reserve_bytes: reserve,
        budget_bytes: budget,
        free_bytes: free,
        context,
        dialogues_that_fit: fit_n,
        dialogues,
        context_that_fits: fit_ctx.min(spec.max_context as u64),
        fits: fit_n >= dialogues && context <= spec.max_context,
    }
}

/// Memory kept back from the K/V cache for activations, workspace and the runtime.
pub const DEFAULT_RESERVE: u64 = 3 << 29;

/// The K/V cache a loaded model gets by default: what is `available` after loading, less
/// `reserve`, less the recurrent states' share for hybrid models (the engine gives states a
/// quarter of the pool's size, so the pool takes four fifths), and never more than
/// `max_tokens` tokens (more could never be used).
pub fn auto_kv_bytes(available: u64, reserve: u64, kv_per_token: u64, max_tokens: u64, hybrid: bool) -> u64 {
    let usable = available.saturating_sub(reserve);
    let share = if hybrid { usable / 5 * 4 } else { usable };
    share.min(kv_per_token.saturating_mul(max_tokens))
}

/// GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "weights:            {} (text {}, vision tower {})", gib(self.text_weight_bytes + self.vision_weight_bytes), gib(self.text_weight_bytes), gib(self.vision_weight_bytes))?;
        writeln!(f, "KV per token:       {} KiB", self.kv_bytes_per_token as f64 / 1024.0)?;
        writeln!(f, "state per sequence: {} MiB (recurrent layers, f32)", self.state_bytes_per_sequence as f64 / 1048576.0)?;
        writeln!(f, "reserve:            {} (activations, workspace)", gib(self.reserve_bytes))?;
        writeln!(f, "budget:             {}; {} left for K/V and states", gib(self.budget_bytes), gib(self.free_bytes.max(0) as u64))?;
        writeln!(f, "fits:               {} dialogues of {} tokens at once; {} dialogues get up to {} tokens each", self.dialogues_that_fit, self.context, self.dialogues, self.context_that_fits)?;
        write!(f, "verdict:            {} dialogues × {} tokens {}", self.dialogues, self.context, if self.fits { "FIT" } else { "DO NOT FIT" })
    }
}
