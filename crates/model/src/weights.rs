//! All weights of a model, staged to bf16 and stacked along the layer axis
//! (the form the megakernel reads and the CPU reference computes on).
//!
//! The field names mirror the checkpoint names; shapes are row-major,
//! `[out, in]` for projections as in PyTorch's `nn.Linear`.

use half::bf16;

use crate::error::{to_usize, ModelError};
use crate::inventory::WeightKind;
use crate::Config;

/// Every weight of a Qwen2.5 model, stacked per layer.
///
/// L = layers, H = hidden, Q = heads*head_dim, KV = kv_heads*head_dim,
/// I = intermediate, V = vocab.
#[derive(Debug, Clone)]
pub struct Weights {
    /// The model these weights belong to.
    pub config: Config,
    /// Token embeddings `[V, H]`.
    pub embed_tokens: Vec<bf16>, // [V, H]
    /// Output projection `[V, H]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Vec<bf16>>, // [V, H]; None when tied to embed_tokens
    /// RMSNorm scale before attention `[L, H]`.
    pub input_layernorm: Vec<bf16>, // [L, H]
    /// Query projection `[L, Q, H]`.
    pub q_proj: Vec<bf16>, // [L, Q, H]
    /// Query bias `[L, Q]`.
    pub q_bias: Vec<bf16>, // [L, Q]
    /// Key projection `[L, KV, H]`.
    pub k_proj: Vec<bf16>, // [L, KV, H]
    /// Key bias `[L, KV]`.
    pub k_bias: Vec<bf16>, // [L, KV]
    /// Value projection `[L, KV, H]`.
    pub v_proj: Vec<bf16>, // [L, KV, H]
    /// Value bias `[L, KV]`.
    pub v_bias: Vec<bf16>, // [L, KV]
    /// Attention output projection `[L, H, Q]`.
    pub o_proj: Vec<bf16>, // [L, H, Q]
    /// RMSNorm scale before the MLP `[L, H]`.
    pub post_attention_layernorm: Vec<bf16>, // [L, H]
    /// MLP gate projection `[L, I, H]`.
    pub gate_proj: Vec<bf16>, // [L, I, H]
    /// MLP up projection `[L, I, H]`.
    pub up_proj: Vec<bf16>, // [L, I, H]
    /// MLP down projection `[L, H, I]`.
    pub down_proj: Vec<bf16>, // [L, H, I]
    /// Final RMSNorm scale `[H]`.
    pub norm: Vec<bf16>, // [H]
}

impl Weights {
    /// The LM head matrix `[V, H]`: `lm_head` or, when tied, `embed_tokens`.
    pub fn lm_head(&self) -> &[bf16] {
        self.lm_head.as_deref().unwrap_or(&self.embed_tokens)
    }

    /// All-zero weights of the right sizes for `config` (`lm_head` only when
    /// untied). Pages come zeroed from the allocator and are not touched, so
    /// this is cheap even at 72B sizes until the buffers are written.
    pub fn zeroed(config: &Config) -> Result<Weights, ModelError> {
        config.validate()?;
        let buf = |kind: WeightKind| -> Result<Vec<bf16>, ModelError> {
            zeroed_bf16(
                kind.name(),
                to_usize(kind.name(), kind.stacked_elems(config)?)?,
            )
        };
        Ok(Weights {
            config: config.clone(),
            embed_tokens: buf(WeightKind::EmbedTokens)?,
            lm_head: if WeightKind::LmHead.present(config) {
                Some(buf(WeightKind::LmHead)?)
            } else {
                None
            },
            input_layernorm: buf(WeightKind::InputLayernorm)?,
            q_proj: buf(WeightKind::QProj)?,
            q_bias: buf(WeightKind::QBias)?,
            k_proj: buf(WeightKind::KProj)?,
            k_bias: buf(WeightKind::KBias)?,
            v_proj: buf(WeightKind::VProj)?,
            v_bias: buf(WeightKind::VBias)?,
            o_proj: buf(WeightKind::OProj)?,
            post_attention_layernorm: buf(WeightKind::PostAttentionLayernorm)?,
            gate_proj: buf(WeightKind::GateProj)?,
            up_proj: buf(WeightKind::UpProj)?,
            down_proj: buf(WeightKind::DownProj)?,
            norm: buf(WeightKind::Norm)?,
        })
    }

    /// The stacked tensor of `kind`; `None` only for `LmHead` when tied.
    pub fn get(&self, kind: WeightKind) -> Option<&[bf16]> {
        Some(match kind {
            WeightKind::EmbedTokens => &self.embed_tokens,
            WeightKind::LmHead => return self.lm_head.as_deref(),
            WeightKind::InputLayernorm => &self.input_layernorm,
            WeightKind::QProj => &self.q_proj,
            WeightKind::QBias => &self.q_bias,
            WeightKind::KProj => &self.k_proj,
            WeightKind::KBias => &self.k_bias,
            WeightKind::VProj => &self.v_proj,
            WeightKind::VBias => &self.v_bias,
            WeightKind::OProj => &self.o_proj,
            WeightKind::PostAttentionLayernorm => &self.post_attention_layernorm,
            WeightKind::GateProj => &self.gate_proj,
            WeightKind::UpProj => &self.up_proj,
            WeightKind::DownProj => &self.down_proj,
            WeightKind::Norm => &self.norm,
        })
    }

    /// Mutable view of the stacked tensor of `kind`; `None` only for
    /// `LmHead` when tied.
    pub fn get_mut(&mut self, kind: WeightKind) -> Option<&mut [bf16]> {
        Some(match kind {
            WeightKind::EmbedTokens => &mut self.embed_tokens,
            WeightKind::LmHead => return self.lm_head.as_deref_mut(),
            WeightKind::InputLayernorm => &mut self.input_layernorm,
            WeightKind::QProj => &mut self.q_proj,
            WeightKind::QBias => &mut self.q_bias,
            WeightKind::KProj => &mut self.k_proj,
            WeightKind::KBias => &mut self.k_bias,
            WeightKind::VProj => &mut self.v_proj,
            WeightKind::VBias => &mut self.v_bias,
            WeightKind::OProj => &mut self.o_proj,
            WeightKind::PostAttentionLayernorm => &mut self.post_attention_layernorm,
            WeightKind::GateProj => &mut self.gate_proj,
            WeightKind::UpProj => &mut self.up_proj,
            WeightKind::DownProj => &mut self.down_proj,
            WeightKind::Norm => &mut self.norm,
        })
    }

    /// Every present stacked tensor, mutably, in [`WeightKind::ALL`] order
    /// (disjoint borrows, so callers can fill them in parallel).
    pub fn tensors_mut(&mut self) -> Vec<(WeightKind, &mut [bf16])> {
        let mut out: Vec<(WeightKind, &mut [bf16])> = vec![
            (WeightKind::EmbedTokens, &mut self.embed_tokens),
            (WeightKind::InputLayernorm, &mut self.input_layernorm),
            (WeightKind::QProj, &mut self.q_proj),
            (WeightKind::QBias, &mut self.q_bias),
            (WeightKind::KProj, &mut self.k_proj),
            (WeightKind::KBias, &mut self.k_bias),
            (WeightKind::VProj, &mut self.v_proj),
            (WeightKind::VBias, &mut self.v_bias),
            (WeightKind::OProj, &mut self.o_proj),
            (
                WeightKind::PostAttentionLayernorm,
                &mut self.post_attention_layernorm,
            ),
            (WeightKind::GateProj, &mut self.gate_proj),
            (WeightKind::UpProj, &mut self.up_proj),
            (WeightKind::DownProj, &mut self.down_proj),
            (WeightKind::Norm, &mut self.norm),
        ];
        if let Some(lm) = self.lm_head.as_deref_mut() {
            out.push((WeightKind::LmHead, lm));
        }
        out
    }

    /// One layer's slice of a per-layer tensor (the whole tensor for the
    /// others); `None` for an absent `lm_head` or a layer out of range.
    pub fn layer(&self, kind: WeightKind, layer: usize) -> Option<&[bf16]> {
        let all = self.get(kind)?;
        let items = kind.items(&self.config);
        // Sizes were checked when the buffers were made, so this divides exactly.
        let per = all.len().checked_div(items)?;
        let start = layer.checked_mul(per)?;
        all.get(start..start.checked_add(per)?)
    }

    /// Checks every buffer's length against `config` (for weights built by
    /// hand rather than by `zeroed`, `load_weights` or `synthetic_weights`).
    pub fn check_sizes(&self) -> Result<(), ModelError> {
        for kind in WeightKind::ALL {
            let want = if kind.present(&self.config) {
                Some(to_usize(kind.name(), kind.stacked_elems(&self.config)?)?)
            } else {
                None
            };
            let have = self.get(kind).map(<[bf16]>::len);
            if have != want && !(kind == WeightKind::LmHead && want.is_none()) {
                return Err(ModelError::ShapeMismatch {
                    path: "(in memory)".into(),
                    tensor: kind.name().to_string(),
                    expected: kind.stacked_shape(&self.config)?,
                    found: have.map(|n| vec![n as u64]).unwrap_or_default(),
                });
            }
        }
        Ok(())
    }
}

/// A zeroed `Vec<bf16>` of `n` elements without writing it: the
/// allocator's zeroed path hands out fresh (lazily zeroed) pages for large
/// sizes, which matters when `n` is 32 billion; `vec![bf16::ZERO; n]` would
/// write every element. A failed allocation is an error naming `what`
/// rather than an abort.
pub(crate) fn zeroed_bf16(what: &str, n: usize) -> Result<Vec<bf16>, ModelError> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<bf16>(n)
        .map_err(|_| ModelError::overflow(what, format!("{n} bf16 elements exceed isize")))?;
    // SAFETY: `layout` has non-zero size (n > 0 and bf16 is 2 bytes).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<bf16>();
    if ptr.is_null() {
        return Err(ModelError::OutOfMemory {
            what: what.to_string(),
            bytes: layout.size() as u64,
        });
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of
    // `[bf16; n]`, which is what a `Vec<bf16>` of capacity `n` frees with;
    // all-zero bytes are a valid bf16 (+0.0), so all `n` elements are
    // initialised; length and capacity are both `n`.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_sizes_and_accessors() {
        let mut c = Config::preset("0.5b").unwrap();
        c.num_hidden_layers = 2;
        c.vocab_size = 1000;
        let mut w = Weights::zeroed(&c).unwrap();
        w.check_sizes().unwrap();
        assert!(w.lm_head.is_none());
        assert_eq!(w.lm_head().len(), 1000 * 896);
        assert_eq!(w.layer(WeightKind::KBias, 1).unwrap().len(), 128);
        assert!(w.layer(WeightKind::KBias, 2).is_none());
        assert_eq!(w.tensors_mut().len(), 14);
        w.get_mut(WeightKind::KBias).unwrap()[128] = bf16::ONE;
        assert_eq!(w.layer(WeightKind::KBias, 1).unwrap()[0], bf16::ONE);
        w.k_bias.pop();
        assert!(matches!(
            w.check_sizes(),
            Err(ModelError::ShapeMismatch { .. })
        ));

        c.tie_word_embeddings = false;
        let mut w = Weights::zeroed(&c).unwrap();
        assert_eq!(w.tensors_mut().len(), 15);
        assert_eq!(w.get(WeightKind::LmHead).unwrap().len(), 1000 * 896);
        assert!(w.embed_tokens.iter().all(|x| x.to_bits() == 0));
    }

    #[test]
    fn impossible_allocations_are_errors() {
        assert!(matches!(
            zeroed_bf16("huge", usize::MAX / 2),
            Err(ModelError::Overflow { .. })
        ));
        // 64 TiB: refused by the allocator (or, where memory is fully
        // overcommitted, granted untouched); never an abort.
        match zeroed_bf16("64 TiB", 1 << 45) {
            Err(e) => assert!(matches!(e, ModelError::OutOfMemory { .. }), "{e}"),
            Ok(v) => assert_eq!(v.len(), 1 << 45),
        }
        assert!(zeroed_bf16("empty", 0).unwrap().is_empty());
    }
}
