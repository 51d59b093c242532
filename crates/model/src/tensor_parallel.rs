//! Tensor parallelism for Qwen2.5: which weight each rank of a
//! tensor-parallel group holds, each rank's split plan, and a CPU reference
//! that runs the ranks one after another with a simulated all-reduce (the
//! oracle a multi-GPU engine is checked against).
//!
//! The split is the usual one for a transformer (Megatron-LM's):
//!
//! | tensor | rule | what a rank computes |
//! |---|---|---|
//! | q/k/v projections and biases | rows, by whole KV groups | its KV heads and their query heads |
//! | o_proj | input columns, by the same groups | a partial `[H]`, summed over ranks |
//! | gate/up | rows, 8 at a time | its slice of the MLP's intermediate vector |
//! | down | input columns, the same slices | a partial `[H]`, summed over ranks |
//! | LM head | vocabulary rows | its slice of the logits; the argmax folds across ranks |
//! | embedding, norms | replicated | |
//!
//! Two all-reduces per layer (after o_proj and after down) and the argmax
//! fold per step are all the communication. A rank holds whole KV groups, so
//! attention needs none: the number of KV heads must divide by the ranks.
//! The intermediate slices are multiples of 8 elements so that every rank's
//! rows stay whole 16-byte vectors for the kernel.

use std::ops::Range;

use half::bf16;
use qmk_layout::{plan_tensor_parallel, ShardRule, TpPlan, KERNEL_OFFSET_MODEL};

use crate::error::ModelError;
use crate::inventory::{stacked_specs, WeightKind};
use crate::reference::{
    argmax, attention, embed, kv_append, layer_weights, matmul, mlp, qkv_proj, rms_norm, rotary,
    Dims, KvCache, LayerWeights, Rope,
};
use crate::{Config, Weights};

/// Intermediate (MLP) slices are multiples of this many elements.
pub const INTER_UNIT: u64 = 8;

/// How `kind` is divided among ranks (see the module table).
pub fn shard_rule(kind: WeightKind, config: &Config) -> ShardRule {
    let d = config.head_dim() as u64;
    let group = (config.num_attention_heads / config.num_kv_heads().max(1)) as u64;
    match kind {
        WeightKind::QProj | WeightKind::QBias => ShardRule::split(1, group * d),
        WeightKind::KProj | WeightKind::KBias | WeightKind::VProj | WeightKind::VBias => {
            ShardRule::split(1, d)
        }
        WeightKind::OProj => ShardRule::split(2, group * d),
        WeightKind::GateProj | WeightKind::UpProj => ShardRule::split(1, INTER_UNIT),
        WeightKind::DownProj => ShardRule::split(2, INTER_UNIT),
        WeightKind::LmHead => ShardRule::split(0, 1),
        WeightKind::EmbedTokens
        | WeightKind::InputLayernorm
        | WeightKind::PostAttentionLayernorm
        | WeightKind::Norm => ShardRule::Replicated,
    }
}

/// Refuses a group size the model cannot be split into, naming the field.
pub fn check_ranks(config: &Config, ranks: usize) -> Result<(), ModelError> {
    config.validate()?;
    let bad = |field: &'static str, reason: String| {
        Err(ModelError::TensorParallel {
            ranks,
            field,
            reason,
        })
    };
    if ranks == 0 {
        return bad("ranks", "must be at least 1".into());
    }
    let kvh = config.num_kv_heads();
    if kvh % ranks != 0 {
        return bad(
            "num_key_value_heads",
            format!("= {kvh} does not divide among the ranks (each rank holds whole KV heads)"),
        );
    }
    let inter = config.intermediate_size as u64;
    if inter % (INTER_UNIT * ranks as u64) != 0 {
        return bad(
            "intermediate_size",
            format!("= {inter} is not a multiple of {INTER_UNIT} x {ranks}"),
        );
    }
    if config.vocab_size % ranks != 0 {
        return bad(
            "vocab_size",
            format!("= {} does not divide among the ranks", config.vocab_size),
        );
    }
    Ok(())
}

/// Every stacked tensor of `config` divided among `ranks` ranks, each rank's
/// shards planned for the kernel's 32-bit offsets.
pub fn tp_plan(config: &Config, ranks: usize) -> Result<TpPlan, ModelError> {
    check_ranks(config, ranks)?;
    let specs = stacked_specs(config)?;
    let rules: Vec<_> = specs
        .into_iter()
        .map(|spec| {
            let kind = WeightKind::ALL
                .into_iter()
                .find(|k| k.name() == spec.name)
                .expect("stacked_specs names only weight kinds");
            let rule = shard_rule(kind, config);
            (spec, rule)
        })
        .collect();
    plan_tensor_parallel(&rules, ranks as u64, &KERNEL_OFFSET_MODEL).map_err(|source| {
        ModelError::Layout {
            tensor: format!("(tensor-parallel plan, {ranks} ranks)"),
            source: Box::new(source),
        }
    })
}

/// The vocabulary rows rank `rank` of `ranks` computes logits for (the LM
/// head's shard, or of the tied embedding table, which every rank holds).
pub fn vocab_range(config: &Config, ranks: usize, rank: usize) -> Range<usize> {
    let per = config.vocab_size / ranks.max(1);
    rank * per..(rank + 1) * per
}

/// The model one rank of `ranks` computes: its query and KV heads, its
/// intermediate slice and its vocabulary rows (`vocab_size` is the LM
/// head's rows per rank; the embedding table stays whole on every rank).
/// `head_dim` is explicit, since hidden / heads no longer gives it. Call
/// [`check_ranks`] first: the divisions assume it passed.
pub fn rank_config(config: &Config, ranks: usize) -> Config {
    let ranks = ranks.max(1);
    let mut c = config.clone();
    c.num_attention_heads = config.num_attention_heads / ranks;
    c.num_key_value_heads = Some(config.num_kv_heads() / ranks);
    c.head_dim = Some(config.head_dim());
    c.intermediate_size = config.intermediate_size / ranks;
    c.vocab_size = config.vocab_size / ranks;
    c
}

/// Indices `range` of axis `axis` of a row-major tensor `data` of `shape`,
/// as its own row-major tensor.
fn take(data: &[bf16], shape: &[usize], axis: usize, range: Range<usize>) -> Vec<bf16> {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let extent = shape[axis];
    let mut out = Vec::with_capacity(outer * range.len() * inner);
    for o in 0..outer {
        let base = o * extent * inner;
        out.extend_from_slice(&data[base + range.start * inner..base + range.end * inner]);
    }
    out
}

/// One rank's weights: a smaller model of its own (its heads, KV heads,
/// intermediate slice and vocabulary rows), so the reference's ops and
/// [`layer_weights`] run on it unchanged. The norms are copied (they are
/// replicated); the embedding stays with the whole model (only the input
/// token's row is read, before the ranks split).
struct RankWeights {
    dims: Dims,
    vocab: Range<usize>,
    weights: Weights, // embed_tokens empty; lm_head [V/N, H]
}

impl RankWeights {
    fn new(w: &Weights, d: &Dims, ranks: usize, rank: usize) -> RankWeights {
        let (l, h, i) = (d.layers, d.hidden, d.intermediate);
        let (q, kv) = (d.q_dim(), d.kv_dim());
        let (qn, kvn, inn) = (q / ranks, kv / ranks, i / ranks);
        let r = |n: usize| rank * n..(rank + 1) * n;
        let vocab = vocab_range(&w.config, ranks, rank);
        let mut config = rank_config(&w.config, ranks);
        // The rank holds its own LM-head rows, even of a tied table.
        config.tie_word_embeddings = false;
        let dims = Dims {
            heads: d.heads / ranks,
            kv_heads: d.kv_heads / ranks,
            intermediate: inn,
            vocab: vocab.len(),
            ..*d
        };
        let weights = Weights {
            config,
            embed_tokens: Vec::new(),
            lm_head: Some(take(w.lm_head(), &[d.vocab, h], 0, vocab.clone())),
            input_layernorm: w.input_layernorm.clone(),
            q_proj: take(&w.q_proj, &[l, q, h], 1, r(qn)),
            q_bias: take(&w.q_bias, &[l, q], 1, r(qn)),
            k_proj: take(&w.k_proj, &[l, kv, h], 1, r(kvn)),
            k_bias: take(&w.k_bias, &[l, kv], 1, r(kvn)),
            v_proj: take(&w.v_proj, &[l, kv, h], 1, r(kvn)),
            v_bias: take(&w.v_bias, &[l, kv], 1, r(kvn)),
            o_proj: take(&w.o_proj, &[l, h, q], 2, r(qn)),
            post_attention_layernorm: w.post_attention_layernorm.clone(),
            gate_proj: take(&w.gate_proj, &[l, i, h], 1, r(inn)),
            up_proj: take(&w.up_proj, &[l, i, h], 1, r(inn)),
            down_proj: take(&w.down_proj, &[l, h, i], 2, r(inn)),
            norm: w.norm.clone(),
        };
        RankWeights {
            dims,
            vocab,
            weights,
        }
    }

    /// Layer `l`'s slices of this rank's shards.
    fn layer(&self, l: usize) -> LayerWeights<'_> {
        layer_weights(&self.weights, &self.dims, l)
    }
}

/// The CPU reference split over `ranks` simulated ranks: each rank computes
/// with its own shards and KV cache; the partial outputs of o_proj and down
/// are summed in rank order (the all-reduce), the logits of the vocabulary
/// shards are concatenated (the greedy pick folds across ranks). One
/// sequence, one token per step; positions in order from 0, as
/// [`crate::reference::Reference::step`] takes them.
pub struct ShardedReference {
    weights: std::sync::Arc<Weights>,
    dims: Dims,
    rope: Rope,
    ranks: Vec<RankWeights>,
    caches: Vec<KvCache>, // [N], each [L, C, KV/N]
    capacity: usize,
}

impl ShardedReference {
    /// `weights` split over `ranks` ranks, each with a KV cache of
    /// `capacity` positions.
    pub fn new(
        weights: std::sync::Arc<Weights>,
        ranks: usize,
        capacity: usize,
    ) -> Result<Self, ModelError> {
        check_ranks(&weights.config, ranks)?;
        let d = Dims::from_config(&weights.config)?;
        crate::reference::check_weights(&weights, &d)?;
        let rope = Rope::from_spec(&d.rope, d.head_dim, capacity);
        let shards: Vec<RankWeights> = (0..ranks)
            .map(|r| RankWeights::new(&weights, &d, ranks, r))
            .collect();
        let caches = shards
            .iter()
            .map(|s| KvCache::new(d.layers, capacity, s.dims.kv_dim(), false))
            .collect();
        Ok(ShardedReference {
            weights,
            dims: d,
            rope,
            ranks: shards,
            caches,
            capacity,
        })
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// One decode step: logits `[V]` of `token` at `pos`.
    pub fn step(&mut self, token: u32, pos: usize) -> Result<Vec<f32>, ModelError> {
        let d = self.dims;
        if token as usize >= d.vocab {
            return Err(ModelError::TokenOutOfVocab {
                token,
                vocab_size: d.vocab,
            });
        }
        if pos >= self.capacity {
            return Err(ModelError::PositionOutOfRange {
                pos,
                capacity: self.capacity,
            });
        }
        let w = &*self.weights;
        let h = d.hidden;
        let mut x = vec![0f32; h]; // [H] residual stream
        let mut xn = vec![0f32; h]; // [H] normed
        embed(&w.embed_tokens, &[token], h, &mut x);
        for l in 0..d.layers {
            rms_norm(
                &x,
                &w.input_layernorm[l * h..(l + 1) * h],
                d.rms_norm_eps,
                &mut xn,
            );
            let mut sum = vec![0f32; h]; // [H] all-reduce of o_proj partials
            for (rank, cache) in self.ranks.iter().zip(self.caches.iter_mut()) {
                let rd = &rank.dims;
                let lw = rank.layer(l);
                let mut q = vec![0f32; rd.q_dim()]; // [Q/N]
                let mut k = vec![0f32; rd.kv_dim()]; // [KV/N]
                let mut v = vec![0f32; rd.kv_dim()]; // [KV/N]
                qkv_proj(&xn, &lw, h, &mut q, &mut k, &mut v);
                rotary(&mut q, &[pos], &self.rope);
                rotary(&mut k, &[pos], &self.rope);
                kv_append(cache, l, pos, &k, &v);
                let mut att = vec![0f32; rd.q_dim()]; // [Q/N]
                attention(&q, cache.k_layer(l), cache.v_layer(l), pos, rd, &mut att);
                let mut part = vec![0f32; h]; // [H]
                matmul(&att, lw.o_proj, rd.q_dim(), &mut part);
                sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            }
            x.iter_mut().zip(&sum).for_each(|(a, b)| *a += b);
            rms_norm(
                &x,
                &w.post_attention_layernorm[l * h..(l + 1) * h],
                d.rms_norm_eps,
                &mut xn,
            );
            let mut sum = vec![0f32; h]; // [H] all-reduce of down partials
            for rank in &self.ranks {
                let mut part = vec![0f32; h]; // [H]
                mlp(&xn, &rank.layer(l), &rank.dims, &mut part);
                sum.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
            }
            x.iter_mut().zip(&sum).for_each(|(a, b)| *a += b);
        }
        rms_norm(&x, &w.norm, d.rms_norm_eps, &mut xn);
        let mut logits = vec![0f32; d.vocab]; // [V], each rank's rows in place
        for rank in &self.ranks {
            matmul(
                &xn,
                rank.weights.lm_head(),
                h,
                &mut logits[rank.vocab.clone()],
            );
        }
        Ok(logits)
    }

    /// Greedy decoding: the prompt's steps, then `n` picks (each fed back).
    pub fn generate_greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>, ModelError> {
        let Some((&last, rest)) = prompt.split_last() else {
            return Err(ModelError::EmptyPrompt);
        };
        for (pos, &t) in rest.iter().enumerate() {
            self.step(t, pos)?;
        }
        let mut pos = rest.len();
        let mut tok = argmax(&self.step(last, pos)?);
        let mut out = vec![tok];
        while out.len() < n {
            pos += 1;
            tok = argmax(&self.step(tok, pos)?);
            out.push(tok);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::reference::{Reference, ReferenceOptions};
    use crate::synthetic_weights;

    /// A small GQA model: 8 query heads over 4 KV heads, so 1, 2 and 4 ranks
    /// all divide it.
    fn small() -> Config {
        let mut c = Config::preset("0.5b").unwrap();
        c.hidden_size = 64;
        c.intermediate_size = 160;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 8;
        c.num_key_value_heads = Some(4);
        c.head_dim = Some(16);
        c.vocab_size = 512;
        c
    }

    #[test]
    fn sharded_reference_equals_the_whole_one() {
        for tied in [true, false] {
            let mut c = small();
            c.tie_word_embeddings = tied;
            let w = Arc::new(synthetic_weights(&c, 7));
            let prompt = [3u32, 200, 17, 44, 9];
            let mut whole = Reference::new(w.clone(), ReferenceOptions::new(64)).unwrap();
            let want = whole.generate_greedy(&prompt, 24).unwrap();
            for ranks in [1usize, 2, 4] {
                let mut tp = ShardedReference::new(w.clone(), ranks, 64).unwrap();
                assert_eq!(tp.ranks(), ranks);
                assert_eq!(
                    tp.generate_greedy(&prompt, 24).unwrap(),
                    want,
                    "tied {tied}, {ranks} ranks"
                );
                // Logits of a fresh run, step by step, within f32 rounding
                // of the sums' new order.
                let mut a = Reference::new(w.clone(), ReferenceOptions::new(64)).unwrap();
                let mut b = ShardedReference::new(w.clone(), ranks, 64).unwrap();
                for (pos, &t) in prompt.iter().chain(&want).enumerate() {
                    let (la, lb) = (a.step(t, pos).unwrap(), b.step(t, pos).unwrap());
                    let scale = la.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let err = la
                        .iter()
                        .zip(&lb)
                        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        err <= 1e-4 * scale.max(1.0),
                        "{ranks} ranks, pos {pos}: |diff| {err} vs scale {scale}"
                    );
                    if ranks == 1 {
                        assert_eq!(la, lb, "one rank computes exactly the whole model");
                    }
                }
            }
        }
    }

    #[test]
    fn group_sizes_the_model_cannot_take_are_refused_by_field() {
        let c = small();
        for (ranks, field) in [
            (0usize, "ranks"),
            (3, "num_key_value_heads"),
            (8, "num_key_value_heads"),
        ] {
            let e = tp_plan(&c, ranks).unwrap_err().to_string();
            assert!(e.contains(field), "{ranks}: {e}");
        }
        let mut c = small();
        c.intermediate_size = 168; // 21 units of 8: not among 2 ranks
        let e = check_ranks(&c, 2).unwrap_err().to_string();
        assert!(e.contains("intermediate_size"), "{e}");
        let mut c = small();
        c.vocab_size = 513;
        let e = check_ranks(&c, 2).unwrap_err().to_string();
        assert!(e.contains("vocab_size"), "{e}");
    }

    #[test]
    fn the_plan_shards_every_tensor_and_keeps_bytes() {
        for (preset, ranks) in [("72b", 8usize), ("72b", 2), ("32b", 4), ("0.5b", 2)] {
            let c = Config::preset(preset).unwrap();
            let tp = tp_plan(&c, ranks).unwrap();
            assert_eq!(tp.rank_plans.len(), ranks);
            let whole = crate::weight_bytes(&c).unwrap().total.0;
            let replicated: u64 = tp
                .tensors
                .iter()
                .filter(|t| t.rule == ShardRule::Replicated)
                .map(|t| t.spec.byte_span().unwrap().0)
                .sum();
            let per_rank: Vec<u64> = (0..ranks).map(|r| tp.rank_bytes(r).unwrap()).collect();
            // Equal ranks; the split bytes once over the group, the
            // replicated ones on every rank.
            assert!(per_rank.iter().all(|&b| b == per_rank[0]), "{preset}");
            assert_eq!(
                per_rank.iter().sum::<u64>(),
                whole + (ranks as u64 - 1) * replicated,
                "{preset} tp {ranks}"
            );
            for t in &tp.tensors {
                if let ShardRule::Split { axis, .. } = t.rule {
                    // Contiguous, in rank order, covering the axis.
                    let extent = t.spec.layout.shape()[axis];
                    let mut next = 0;
                    for s in &t.shards {
                        assert_eq!(s.range.start, next, "{preset} {}", t.spec.name);
                        next = s.range.end;
                    }
                    assert_eq!(next, extent, "{preset} {}", t.spec.name);
                }
            }
        }
        // 72B at 8 ranks: a down_proj shard [80, 8192, 3696] is 4.85 GB,
        // still over the 32-bit offsets: 2 chunks per rank.
        let tp = tp_plan(&Config::preset("72b").unwrap(), 8).unwrap();
        let down = tp.rank_plans[5].tensor("down_proj").unwrap();
        assert_eq!(down.spec.layout.shape(), &[80, 8192, 3696]);
        assert_eq!(down.chunks.len(), 2);
    }
}
