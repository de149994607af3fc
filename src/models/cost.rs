//! What one token costs a model, from its config alone: the bytes a decode token reads and
//! the FLOPs a prefill token takes. `merg bench` sets them against the machine's roofline
//! (`cpu::roofline`), which knows nothing of models.

use serde::Serialize;

use super::{LayerKind, ModelSpec};

/// What one token costs a model: weight bytes read per decode token and FLOPs per prefill
/// token, from its parameter counts and spec.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TokenCost {
    /// Linear weights one decode token reads (MoE: its top-k experts; a tied head counted).
    pub weight_bytes: f64,
    /// K and V bytes read per decode token per position of context (global attention layers).
    pub kv_bytes_per_position: f64,
    /// The same for the sliding-window layers, which read at most `window` positions.
    pub sliding_kv_bytes_per_position: f64,
    /// Their window (0 without sliding layers).
    pub window: f64,
    /// Matmul FLOPs of one token (2 per weight) …
    pub flops: f64,
    /// … plus attention FLOPs per position of context (global attention layers) …
    pub attn_flops_per_position: f64,
    /// … and per position inside the window (sliding-window layers).
    pub sliding_attn_flops_per_position: f64,
    /// The vocabulary head's share of `flops`: a prefill computes logits for its last token
    /// only.
    pub head_flops: f64,
}

impl TokenCost {
    /// `bytes_per_weight`: 4 (f32), 2 (bf16) or a block format's bits ÷ 8; `kv_bytes`: bytes
    /// per cached value.
    pub fn of(p: &super::ParamCounts, spec: &ModelSpec, bytes_per_weight: f64, kv_bytes: f64) -> TokenCost {
        let mut linear = p.text_linear as f64;
        // MoE: only the routed experts' share of the linear weights is read per token.
        let active_linear = p.text_active.saturating_sub(p.text_other) as f64;
        if active_linear > 0.0 && active_linear < linear {
            linear = active_linear;
        }
        if p.tied_head {
            linear += (spec.vocab_size * spec.hidden_size) as f64;
        }
        let (global, sliding) = (spec.num_global_layers() as f64, spec.num_sliding_layers() as f64);
        let kv_row = 2.0 * (spec.num_kv_heads * spec.head_dim) as f64 * kv_bytes;
        // Query heads are not in the spec; hidden ÷ head_dim is exact for Qwen2 shapes and
        // close for the others (attention is a small share of a short context's FLOPs).
        let q_heads = (spec.hidden_size / spec.head_dim.max(1)).max(1) as f64;
        TokenCost {
            weight_bytes: linear * bytes_per_weight,
            kv_bytes_per_position: global * kv_row,
            sliding_kv_bytes_per_position: sliding * kv_row,
            window: spec.sliding_window().unwrap_or(0) as f64,
            flops: 2.0 * linear,
            // Scores and the weighted sum: 2 × 2 FLOPs per head dimension per position.
            attn_flops_per_position: 4.0 * global * q_heads * spec.head_dim as f64,
            sliding_attn_flops_per_position: 4.0 * sliding * q_heads * spec.head_dim as f64,
            // Both a tied and an untied head are in `linear` by now.
            head_flops: 2.0 * (spec.vocab_size * spec.hidden_size) as f64,
        }
    }

    /// Bytes one decode step reads at `context` positions.
    pub fn decode_bytes(&self, context: f64) -> f64 {
        self.weight_bytes + self.kv_bytes_per_position * context + self.sliding_kv_bytes_per_position * context.min(self.window)
    }

    /// FLOPs of a causal prefill of `tokens` tokens, logits for the last one only (as
    /// `merg bench`, the engine and llama-bench compute them).
    pub fn prefill_flops(&self, tokens: f64) -> f64 {
        let head = self.head_flops.min(self.flops);
        // Token t attends to t positions, at most `window` of them in a sliding layer.
        let w = self.window.min(tokens);
        let windowed = w * tokens - w * w / 2.0;
        (self.flops - head) * tokens + head + self.attn_flops_per_position * tokens * tokens / 2.0 + self.sliding_attn_flops_per_position * windowed
    }
}

/// Bytes one sequence's recurrent states take (f32): what the engine's state slots and the
/// planner both count.
pub fn state_bytes_per_seq(spec: &ModelSpec) -> u64 {
    spec.layers
        .iter()
        .map(|k| match k {
            LayerKind::Recurrent { conv_shape, state_shape } => (conv_shape.iter().product::<usize>() + state_shape.iter().product::<usize>()) as u64 * 4,
            LayerKind::Attention | LayerKind::SlidingAttention { .. } => 0,
        })
        .sum()
}

#[cfg(test)]
mod cost_tests {
    use super::TokenCost;

    /// A prefill computes the head for its last token only; one token costs a decode step.
    #[test]
    fn prefill_counts_the_head_once() {
        let c = TokenCost { weight_bytes: 0.0, kv_bytes_per_position: 0.0, sliding_kv_bytes_per_position: 0.0, window: 0.0, flops: 10.0, attn_flops_per_position: 0.0, sliding_attn_flops_per_position: 0.0, head_flops: 4.0 };
        assert_eq!(c.prefill_flops(1.0), 10.0);
        assert_eq!(c.prefill_flops(5.0), 6.0 * 5.0 + 4.0);
        // A decode step reads the sliding layers' K/V of the window only.
        let d = TokenCost { weight_bytes: 100.0, kv_bytes_per_position: 2.0, sliding_kv_bytes_per_position: 10.0, window: 8.0, ..c };
        assert_eq!(d.decode_bytes(4.0), 100.0 + 8.0 + 40.0);
        assert_eq!(d.decode_bytes(20.0), 100.0 + 40.0 + 80.0);
        // Attention: t²/2 positions in a global layer, w·t − w²/2 in a sliding one.
        let e = TokenCost { attn_flops_per_position: 1.0, sliding_attn_flops_per_position: 2.0, ..d };
        assert_eq!(e.prefill_flops(20.0) - c.prefill_flops(20.0), 200.0 + 2.0 * (8.0 * 20.0 - 32.0));
        assert_eq!(e.prefill_flops(4.0) - c.prefill_flops(4.0), 8.0 + 2.0 * 8.0);
    }
}
