//! The CPU reference for synthetic models larger than host memory (72B is
//! 145 GB of bf16): each pass regenerates the weights layer by layer
//! ([`SyntheticSource`]: any range of any tensor on demand), so at
//! most one layer's weights, the final norm and the LM head are held at
//! once. Same ops, same order and same rounding as [`Reference`], so its
//! logits equal `Reference`'s on [`crate::synthetic_weights`] bit for bit.
//!
//! A pass over many rows reads (regenerates) the weights once: to check a
//! greedy GPU run, feed the prompt and the GPU's picks as one pass and
//! compare every row's logits and argmax.

use half::bf16;

use super::{
    check_rows, embed, head, layer_forward, Dims, KvCache, LayerWeights, Logits, ReferenceOptions,
    Rope, Row, Scratch,
};
use crate::config::Config;
use crate::error::ModelError;
use crate::inventory::WeightKind;
use crate::synthetic::SyntheticSource;

/// The CPU reference on synthetic weights regenerated per layer (see the
/// module docs). One sequence.
#[derive(Debug, Clone)]
pub struct StreamedReference {
    source: SyntheticSource,
    dims: Dims,
    rope: Rope,           // [S, hd/2] cos and sin
    caches: Vec<KvCache>, // [1], [L, S, KV] for K and V
    norm: Vec<bf16>,      // [H]
    lm_head: Vec<bf16>,   // [V, H] (the embedding when tied)
}

/// One layer's weights, owned.
struct Layer {
    tensors: Vec<Vec<bf16>>, // [12] in `per_layer_kinds` order
}

/// The per-layer tensors, in [`WeightKind::ALL`] order, which is
/// [`LayerWeights`]' field order.
fn per_layer_kinds() -> impl Iterator<Item = WeightKind> {
    WeightKind::ALL.into_iter().filter(|k| k.per_layer())
}

impl StreamedReference {
    /// The reference for `config`'s synthetic weights with `seed` (the
    /// same bits as [`crate::synthetic_weights`]`(config, seed)`).
    /// Generates the final norm and the LM head now; layers are generated
    /// on each pass.
    pub fn new(config: &Config, seed: u64, opts: ReferenceOptions) -> Result<Self, ModelError> {
        let dims = Dims::from_config(config)?;
        if opts.capacity == 0 || opts.sequences != 1 {
            return Err(ModelError::InvalidArgument(format!(
                "capacity ({}) must be at least 1 and sequences ({}) exactly 1",
                opts.capacity, opts.sequences
            )));
        }
        let (h, v) = (dims.hidden, dims.vocab);
        let head_kind = if config.tie_word_embeddings {
            WeightKind::EmbedTokens
        } else {
            WeightKind::LmHead
        };
        let vh = v.checked_mul(h).ok_or_else(|| {
            ModelError::overflow("vocab_size", format!("{v} x hidden_size {h} exceeds usize"))
        })?;
        let source = SyntheticSource::new(config, seed)?;
        Ok(Self {
            norm: generate(&source, WeightKind::Norm, 0, h)?,
            lm_head: generate(&source, head_kind, 0, vh)?,
            source,
            rope: Rope::from_spec(&dims.rope, dims.head_dim, opts.capacity),
            caches: vec![KvCache::new(
                dims.layers,
                opts.capacity,
                dims.kv_dim(),
                opts.kv_bf16,
            )],
            dims,
        })
    }

    /// The model's sizes.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// Weight bytes held at once at most: the largest layer plus the LM
    /// head and the final norm (bf16).
    pub fn peak_weight_bytes(&self) -> u64 {
        let layer: usize = per_layer_kinds().map(|k| self.per_layer_len(k)).sum();
        2 * (layer + self.lm_head.len() + self.norm.len()) as u64
    }

    /// One pass over `tokens` at positions `start..`: K/V stored for every
    /// row, logits `[R, V]` for the rows `which` selects.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        start: usize,
        which: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        let d = self.dims;
        let rows: Vec<Row> = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                seq: 0,
                token,
                pos: start + i,
            })
            .collect();
        check_rows(&rows, &d, &self.caches)?;
        let (h, t) = (d.hidden, rows.len());
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect(); // [T]
        let mut s = Scratch::new(&d, t);
        // Only the rows of the embedding the tokens use.
        let mut rows_of_embed = Vec::with_capacity(t * h); // [T, H]
        for &tok in tokens {
            rows_of_embed.extend(generate(
                &self.source,
                WeightKind::EmbedTokens,
                tok as usize * h,
                h,
            )?);
        }
        let local: Vec<u32> = (0..t as u32).collect(); // [T]
        embed(&rows_of_embed, &local, h, &mut s.x);
        for l in 0..d.layers {
            let layer = self.layer(l)?;
            let lw = layer.weights();
            layer_forward(
                &lw,
                &d,
                l,
                &self.rope,
                &rows,
                &positions,
                &mut self.caches,
                &mut s,
                None,
            );
        }
        let Scratch { x, mut xn, .. } = s;
        Ok(head(&x, &mut xn, &self.norm, &self.lm_head, &d, which))
    }

    /// Elements of one layer's slice of the stacked tensor `kind` (sizes
    /// checked when the source was made).
    fn per_layer_len(&self, kind: WeightKind) -> usize {
        kind.item_elems(self.source.config())
            .map_or(0, |n| n as usize)
    }

    /// Layer `l`'s weights: elements `l·n .. (l+1)·n` of each stacked
    /// tensor.
    fn layer(&self, l: usize) -> Result<Layer, ModelError> {
        Ok(Layer {
            tensors: per_layer_kinds()
                .map(|k| {
                    let n = self.per_layer_len(k);
                    generate(&self.source, k, l * n, n)
                })
                .collect::<Result<_, _>>()?,
        })
    }
}

impl Layer {
    fn weights(&self) -> LayerWeights<'_> {
        let t = &self.tensors;
        LayerWeights {
            input_layernorm: &t[0],
            q_proj: &t[1],
            q_bias: &t[2],
            k_proj: &t[3],
            k_bias: &t[4],
            v_proj: &t[5],
            v_bias: &t[6],
            o_proj: &t[7],
            post_attention_layernorm: &t[8],
            gate_proj: &t[9],
            up_proj: &t[10],
            down_proj: &t[11],
        }
    }
}

/// Elements `first .. first + n` of the synthetic tensor `kind`.
fn generate(
    source: &SyntheticSource,
    kind: WeightKind,
    first: usize,
    n: usize,
) -> Result<Vec<bf16>, ModelError> {
    let mut out = vec![bf16::ZERO; n];
    source.fill(kind, first as u64, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::reference::Reference;
    use crate::synthetic_weights;

    fn small(tied: bool) -> Config {
        let mut c = crate::synthetic::tests::tiny();
        c.tie_word_embeddings = tied;
        c
    }

    /// Bit for bit the resident reference on the same synthetic weights,
    /// tied and untied, in one pass and in a prefill + step.
    #[test]
    fn equals_the_resident_reference_bit_for_bit() {
        for tied in [true, false] {
            let c = small(tied);
            let opts = ReferenceOptions::new(16).kv_bf16(true);
            let mut resident = Reference::new(Arc::new(synthetic_weights(&c, 5)), opts).unwrap();
            let mut streamed = StreamedReference::new(&c, 5, opts).unwrap();
            let tokens = [3u32, 299, 0, 150, 7];
            let a = resident.prefill(&tokens[..4]).unwrap();
            let b = streamed.forward(&tokens[..4], 0, Logits::Last).unwrap();
            assert_eq!(a, b, "tied {tied}: prefill");
            let a = resident.step(tokens[4], 4).unwrap();
            let b = streamed.forward(&tokens[4..], 4, Logits::Last).unwrap();
            assert_eq!(a, b, "tied {tied}: step");
            // Every row of a fresh pass.
            let mut fresh = StreamedReference::new(&c, 5, opts).unwrap();
            let all = fresh.forward(&tokens, 0, Logits::All).unwrap();
            assert_eq!(all.len(), 5 * 300);
            assert_eq!(&all[4 * 300..], &a[..], "tied {tied}: last row of one pass");
        }
    }

    /// What it holds is one layer plus the LM head: for a deep model, far
    /// less than the whole model.
    #[test]
    fn holds_one_layer_at_a_time() {
        let mut c = small(false);
        c.num_hidden_layers = 40;
        let r = StreamedReference::new(&c, 1, ReferenceOptions::new(4)).unwrap();
        let whole = crate::weight_bytes(&c).unwrap().total.0;
        let peak = r.peak_weight_bytes();
        let layer = 2 * (2 * 64 + 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 96 * 64) as u64;
        assert_eq!(peak, layer + 2 * (300 * 64 + 64));
        assert!(peak * 10 < whole, "peak {peak} of {whole}");
    }

    #[test]
    fn bad_rows_are_named_errors() {
        let c = small(true);
        let mut r = StreamedReference::new(&c, 1, ReferenceOptions::new(4)).unwrap();
        assert!(matches!(
            r.forward(&[], 0, Logits::Last),
            Err(ModelError::EmptyPrompt)
        ));
        assert!(matches!(
            r.forward(&[300], 0, Logits::Last),
            Err(ModelError::TokenOutOfVocab { .. })
        ));
        assert!(matches!(
            r.forward(&[1, 2], 3, Logits::Last),
            Err(ModelError::PositionOutOfRange { pos: 4, .. })
        ));
        assert!(StreamedReference::new(&c, 1, ReferenceOptions::new(4).sequences(2)).is_err());
    }
}
