//! config.json through the model registry (spec without weights) and preprocessor configs:
//! an error naming the field, never a panic or an absurd allocation.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if let Ok(spec) = merg::models::registry::spec(&v) {
        assert!(spec.hidden_size > 0 && spec.vocab_size > 0 && !spec.layers.is_empty());
    }
    if let Ok(cfg) = serde_json::from_value::<merg::vision::PreprocessorConfig>(v) {
        let _ = cfg.validate();
    }
});
