//! `merg info`: what a checkpoint is (family, sizes, files), without loading its weights.

use anyhow::Result;

use merg::models::registry;

use super::ModelArgs;

pub fn cmd_info(a: ModelArgs) -> Result<()> {
    let files = merg::hub::resolve(&a.model, a.revision.as_deref())?;
    let config = registry::read_config(&files.config)?;
    let spec = registry::spec(&config).map_err(|e| anyhow::anyhow!("{}: {e:#}", files.config.display()))?;
    let shards = merg::weights::index_shards(&files.weights)?;
    println!("model:     {}", files.source);
    println!("dir:       {}", files.dir.display());
    println!("family:    {}", spec.model_type);
    println!(
        "text:      {} layers ({} attention), hidden {}, head_dim {}, {} kv heads, vocab {}, context {}",
        spec.layers.len(),
        spec.num_attention_layers(),
        spec.hidden_size,
        spec.head_dim,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.max_context
    );
    if let Some(v) = &spec.vision {
        println!("vision:    patch {}, merge {}, temporal patch {}", v.patch_size, v.spatial_merge_size, v.temporal_patch_size);
    }
    println!("weights:   {} tensors in {} file(s)", shards.len(), files.weights.len());
    Ok(())
}
