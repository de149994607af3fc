//! Token embeddings. A table the weight source holds in a mapped file stays there in its
//! stored type (blocks, bf16): a step dequantizes only the rows it looks up, as llama.cpp's
//! `get_rows` does, so a 248k-row vocabulary costs no dense copy. Other sources (random
//! weights, checkpoints whose table is transformed on load) give a dense table, which a tied
//! head may share.

use candle_core::{DType, Device, Module, Result, Shape, Tensor};

use crate::weights::{Mapped, Weights};

pub enum Embedding {
    Dense(candle_nn::Embedding),
    Mapped { table: Mapped, dtype: DType, device: Device },
}

impl Embedding {
    /// `embed_tokens`-style table `weight` `[vocab, hidden]` under `w`.
    pub fn new(vocab: usize, hidden: usize, w: &Weights) -> Result<Self> {
        match w.rows("weight", &Shape::from((vocab, hidden)))? {
            Some(table) => Ok(Embedding::Mapped { table, dtype: w.dtype(), device: w.device().clone() }),
            None => Ok(Embedding::Dense(candle_nn::embedding(vocab, hidden, w.vb().clone())?)),
        }
    }

    /// The dense table, when there is one.
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            Embedding::Dense(e) => Some(e.embeddings()),
            Embedding::Mapped { .. } => None,
        }
    }

    /// The dense table moved onto huge pages (a tied head streams it every token).
    pub fn rehomed(self) -> Result<Self> {
        match self {
            Embedding::Dense(e) => {
                let h = e.hidden_size();
                Ok(Embedding::Dense(candle_nn::Embedding::new(crate::cpu::pages::rehome(e.embeddings().clone())?, h)))
            }
            m => Ok(m),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Embedding::Dense(e) => e.embeddings().dtype(),
            Embedding::Mapped { dtype, .. } => *dtype,
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Embedding::Dense(e) => e.embeddings().device(),
            Embedding::Mapped { device, .. } => device,
        }
    }

    /// Rows `ids`: `[ids.len(), hidden]`.
    pub fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Embedding::Dense(e) => e.forward(&Tensor::new(ids, e.embeddings().device())?),
            Embedding::Mapped { table, dtype, device } => table.lookup(ids, *dtype, device),
        }
    }
}
