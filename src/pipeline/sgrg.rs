//! A4, strategy-grounded response generator (SGRG): the reply, realising the plan with the
//! evidence, the forecast emotion and the top-k retrieved exemplars. Prompt: prompts/sgrg.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplyOut {
    pub reply: String,
}

/// The reply must contain a letter: an empty or punctuation-only reply is no reply.
pub fn schema(max_chars: usize) -> Value {
    json!({
        "type": "object",
        "properties": {"reply": {"type": "string", "minLength": 1, "maxLength": max_chars, "pattern": "^[^\\n]*[A-Za-z][^\\n]*$"}},
        "required": ["reply"],
        "additionalProperties": false
    })
}
