//! The ops of one Qwen2.5 forward step, one function each, named as the
//! megakernel names its fused ops. Each works on `T` rows (tokens) at once so
//! the same code serves decode (`T = 1`) and prompt prefill.
//!
//! Math is f32 throughout on bf16 weights widened exactly, which is what
//! Hugging Face transformers computes with a bf16 checkpoint loaded as f32.
//!
//! Shapes: H hidden, Q = heads·hd, KV = kv_heads·hd, I intermediate,
//! V vocab, S KV-cache capacity, hd head_dim.

use half::bf16;
use rayon::prelude::*;

use super::matmul::matmul;
use crate::error::ModelError;
use crate::rope::{inv_freq, RopeSpec};
use crate::{Config, Weights};

/// The sizes the forward pass needs, from a validated `Config`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// Hidden size H.
    pub hidden: usize,
    /// MLP width I.
    pub intermediate: usize,
    /// Decoder layers L.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension hd.
    pub head_dim: usize,
    /// Vocabulary size V.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary embedding: base and scaling.
    pub rope: RopeSpec,
}

impl Dims {
    /// Validates the config (see [`Config::validate`]) and reads its sizes.
    pub fn from_config(config: &Config) -> Result<Self, ModelError> {
        config.validate()?;
        Ok(Self {
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            layers: config.num_hidden_layers,
            heads: config.num_attention_heads,
            kv_heads: config.num_kv_heads(),
            head_dim: config.head_dim(),
            vocab: config.vocab_size,
            rms_norm_eps: config.rms_norm_eps as f32,
            rope: config.rope()?,
        })
    }
    /// q_proj width, `heads · hd`.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    /// k_proj / v_proj width, `kv_heads · hd`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// One layer's slices of the stacked weights.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights<'a> {
    /// RMSNorm scale before attention `[H]`.
    pub input_layernorm: &'a [bf16], // [H]
    /// Query projection `[Q, H]`.
    pub q_proj: &'a [bf16], // [Q, H]
    /// Query bias `[Q]`.
    pub q_bias: &'a [bf16], // [Q]
    /// Key projection `[KV, H]`.
    pub k_proj: &'a [bf16], // [KV, H]
    /// Key bias `[KV]`.
    pub k_bias: &'a [bf16], // [KV]
    /// Value projection `[KV, H]`.
    pub v_proj: &'a [bf16], // [KV, H]
    /// Value bias `[KV]`.
    pub v_bias: &'a [bf16], // [KV]
    /// Attention output projection `[H, Q]`.
    pub o_proj: &'a [bf16], // [H, Q]
    /// RMSNorm scale before the MLP `[H]`.
    pub post_attention_layernorm: &'a [bf16], // [H]
    /// MLP gate projection `[I, H]`.
    pub gate_proj: &'a [bf16], // [I, H]
    /// MLP up projection `[I, H]`.
    pub up_proj: &'a [bf16], // [I, H]
    /// MLP down projection `[H, I]`.
    pub down_proj: &'a [bf16], // [H, I]
}

/// Layer `l`'s slices. The lengths must already match `d` (see
/// [`check_weights`]).
pub fn layer_weights<'a>(w: &'a Weights, d: &Dims, l: usize) -> LayerWeights<'a> {
    let (h, q, kv, i) = (d.hidden, d.q_dim(), d.kv_dim(), d.intermediate);
    let at = |v: &'a [bf16], n: usize| &v[l * n..(l + 1) * n];
    LayerWeights {
        input_layernorm: at(&w.input_layernorm, h),
        q_proj: at(&w.q_proj, q * h),
        q_bias: at(&w.q_bias, q),
        k_proj: at(&w.k_proj, kv * h),
        k_bias: at(&w.k_bias, kv),
        v_proj: at(&w.v_proj, kv * h),
        v_bias: at(&w.v_bias, kv),
        o_proj: at(&w.o_proj, h * q),
        post_attention_layernorm: at(&w.post_attention_layernorm, h),
        gate_proj: at(&w.gate_proj, i * h),
        up_proj: at(&w.up_proj, i * h),
        down_proj: at(&w.down_proj, h * i),
    }
}

/// Checks every weight vector's length against `d` (weights built in memory
/// bypass the loader's shape checks; slicing would otherwise panic).
pub fn check_weights(w: &Weights, d: &Dims) -> Result<(), ModelError> {
    let (h, q, kv, i, v, l) = (
        d.hidden,
        d.q_dim(),
        d.kv_dim(),
        d.intermediate,
        d.vocab,
        d.layers,
    );
    let mut checks: Vec<(&'static str, usize, usize)> = vec![
        ("embed_tokens", w.embed_tokens.len(), v * h),
        ("input_layernorm", w.input_layernorm.len(), l * h),
        ("q_proj", w.q_proj.len(), l * q * h),
        ("q_bias", w.q_bias.len(), l * q),
        ("k_proj", w.k_proj.len(), l * kv * h),
        ("k_bias", w.k_bias.len(), l * kv),
        ("v_proj", w.v_proj.len(), l * kv * h),
        ("v_bias", w.v_bias.len(), l * kv),
        ("o_proj", w.o_proj.len(), l * h * q),
        (
            "post_attention_layernorm",
            w.post_attention_layernorm.len(),
            l * h,
        ),
        ("gate_proj", w.gate_proj.len(), l * i * h),
        ("up_proj", w.up_proj.len(), l * i * h),
        ("down_proj", w.down_proj.len(), l * h * i),
        ("norm", w.norm.len(), h),
    ];
    if let Some(lm) = &w.lm_head {
        checks.push(("lm_head", lm.len(), v * h));
    }
    for (tensor, found, expected) in checks {
        if found != expected {
            return Err(ModelError::WeightLength {
                tensor,
                expected,
                found,
            });
        }
    }
    Ok(())
}

/// Rotary embedding tables, computed as transformers computes them in f32:
/// angle = `pos · inv_freq[i]` ([`crate::rope::inv_freq`]), and cos and sin
/// multiplied by the scaling's attention factor (1 without scaling).
#[derive(Debug, Clone)]
pub struct Rope {
    /// Head dimension hd the tables are for.
    pub head_dim: usize,
    /// Cosines `[S, hd/2]`, by position then frequency.
    pub cos: Vec<f32>, // [S, hd/2]
    /// Sines `[S, hd/2]`, by position then frequency.
    pub sin: Vec<f32>, // [S, hd/2]
}

impl Rope {
    /// Plain (unscaled) tables for `positions` positions of a
    /// `head_dim`-wide head, rotary base `theta`.
    pub fn new(head_dim: usize, theta: f64, positions: usize) -> Self {
        let spec = RopeSpec {
            theta,
            scaling: crate::rope::RopeScaling::None,
        };
        Self::from_spec(&spec, head_dim, positions)
    }

    /// Tables for `positions` positions of a `head_dim`-wide head with the
    /// rotary embedding `spec` (base and scaling).
    pub fn from_spec(spec: &RopeSpec, head_dim: usize, positions: usize) -> Self {
        let half = head_dim / 2;
        let inv_freq = inv_freq(spec, head_dim); // [hd/2]
                                                 // transformers multiplies the f32 cos and sin by the factor.
        let factor = spec.attention_factor() as f32;
        let mut cos = vec![0f32; positions * half];
        let mut sin = vec![0f32; positions * half];
        for p in 0..positions {
            for (i, f) in inv_freq.iter().enumerate() {
                let angle = p as f32 * f;
                cos[p * half + i] = angle.cos() * factor;
                sin[p * half + i] = angle.sin() * factor;
            }
        }
        Self { head_dim, cos, sin }
    }
    /// Number of positions tabulated.
    pub fn positions(&self) -> usize {
        self.cos.len() / (self.head_dim / 2).max(1)
    }
}

/// An f32 KV cache for one sequence. K and V are stored after rotary, per
/// layer and position: `[L, S, KV]`.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Keys after rotary `[L, S, KV]`.
    pub k: Vec<f32>, // [L, S, KV]
    /// Values `[L, S, KV]`.
    pub v: Vec<f32>, // [L, S, KV]
    /// Positions per layer (S).
    pub capacity: usize,
    /// Width of one position's K or V (KV).
    pub kv_dim: usize,
    /// Round K/V to bf16 when stored, as the megakernel's bf16 cache does.
    pub round_to_bf16: bool,
}

impl KvCache {
    /// A zeroed cache of `layers` x `capacity` positions of `kv_dim` values
    /// for K and for V.
    pub fn new(layers: usize, capacity: usize, kv_dim: usize, round_to_bf16: bool) -> Self {
        Self {
            k: vec![0f32; layers * capacity * kv_dim],
            v: vec![0f32; layers * capacity * kv_dim],
            capacity,
            kv_dim,
            round_to_bf16,
        }
    }
    /// Layer `l`'s keys `[S, KV]`.
    pub fn k_layer(&self, l: usize) -> &[f32] {
        let n = self.capacity * self.kv_dim;
        &self.k[l * n..(l + 1) * n]
    }
    /// Layer `l`'s values `[S, KV]`.
    pub fn v_layer(&self, l: usize) -> &[f32] {
        let n = self.capacity * self.kv_dim;
        &self.v[l * n..(l + 1) * n]
    }
}

/// `x[t] = embed_tokens[tokens[t]]`, widened to f32.
///
/// * `embed_tokens` `[V, H]`, `x` `[T, H]`. Ids must be `< V` (checked by the
///   caller, which can name the error).
pub fn embed(embed_tokens: &[bf16], tokens: &[u32], hidden: usize, x: &mut [f32]) {
    for (xt, &tok) in x.chunks_exact_mut(hidden).zip(tokens) {
        let row = &embed_tokens[tok as usize * hidden..(tok as usize + 1) * hidden];
        for (o, w) in xt.iter_mut().zip(row) {
            *o = w.to_f32();
        }
    }
}

/// RMSNorm per row: `out = x / sqrt(mean(x²) + eps) · weight`.
///
/// * `x` `[T, H]`, `weight` `[H]`, `out` `[T, H]`
pub fn rms_norm(x: &[f32], weight: &[bf16], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (xt, ot) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        // f64 sum: the oracle should not lose bits to a long f32 running sum.
        let ss: f64 = xt.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let inv = 1.0 / ((ss / h as f64) as f32 + eps).sqrt();
        for ((o, &v), w) in ot.iter_mut().zip(xt).zip(weight) {
            *o = v * inv * w.to_f32();
        }
    }
}

/// Adds a bias to every row: `x[t] += bias`. `x` `[T, N]`, `bias` `[N]`.
fn add_bias(x: &mut [f32], bias: &[bf16]) {
    for xt in x.chunks_exact_mut(bias.len()) {
        for (o, b) in xt.iter_mut().zip(bias) {
            *o += b.to_f32();
        }
    }
}

/// The three input projections, with their biases.
///
/// * `x` `[T, H]` (normed), `q` `[T, Q]`, `k` `[T, KV]`, `v` `[T, KV]`
pub fn qkv_proj(
    x: &[f32],
    lw: &LayerWeights<'_>,
    hidden: usize,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) {
    matmul(x, lw.q_proj, hidden, q);
    add_bias(q, lw.q_bias);
    matmul(x, lw.k_proj, hidden, k);
    add_bias(k, lw.k_bias);
    matmul(x, lw.v_proj, hidden, v);
    add_bias(v, lw.v_bias);
}

/// Rotary embedding, rotate-half (neox) form, in place: each head's pair
/// `(x[i], x[i + hd/2])` is rotated by angle `pos · inv_freq[i]`:
/// `x[i]' = x[i]·cos − x[i+hd/2]·sin`, `x[i+hd/2]' = x[i+hd/2]·cos + x[i]·sin`.
///
/// * `x` `[T, n_heads, hd]`, `positions` `[T]` (each `< rope.positions()`)
pub fn rotary(x: &mut [f32], positions: &[usize], rope: &Rope) {
    let hd = rope.head_dim;
    let half = hd / 2;
    let per_row = x.len() / positions.len().max(1);
    for (xt, &pos) in x.chunks_exact_mut(per_row).zip(positions) {
        let cos = &rope.cos[pos * half..(pos + 1) * half]; // [hd/2]
        let sin = &rope.sin[pos * half..(pos + 1) * half]; // [hd/2]
        for head in xt.chunks_exact_mut(hd) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// Stores one position's K and V for layer `l` (rounded to bf16 if the cache
/// says so).
///
/// * `k`, `v` `[KV]`; `pos < cache.capacity` (checked by the caller)
pub fn kv_append(cache: &mut KvCache, l: usize, pos: usize, k: &[f32], v: &[f32]) {
    let kv = cache.kv_dim;
    let at = (l * cache.capacity + pos) * kv;
    let round = cache.round_to_bf16;
    let store = |dst: &mut [f32], src: &[f32]| {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = if round { bf16::from_f32(s).to_f32() } else { s };
        }
    };
    store(&mut cache.k[at..at + kv], k);
    store(&mut cache.v[at..at + kv], v);
}

/// Grouped-query attention for one token at position `pos`, over the cached
/// positions `0..=pos` (which must already hold this token's K/V). Query head
/// `h` reads KV head `h / (heads / kv_heads)`; scores are scaled by
/// `1/sqrt(hd)`, softmaxed in f32 with the max subtracted.
///
/// * `q` `[Q]` (after rotary), `k_cache`, `v_cache` `[S, KV]` (one layer),
///   `out` `[Q]`
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    pos: usize,
    d: &Dims,
    out: &mut [f32],
) {
    let hd = d.head_dim;
    for (h, (qh, oh)) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).enumerate() {
        attention_head(qh, k_cache, v_cache, h / d.group(), pos, d, oh);
    }
}

/// [`attention`] for one query head reading KV head `kvh`.
///
/// * `q` `[hd]`, `k_cache`, `v_cache` `[S, KV]`, `out` `[hd]`
pub fn attention_head(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    kvh: usize,
    pos: usize,
    d: &Dims,
    out: &mut [f32],
) {
    let (hd, kv) = (d.head_dim, d.kv_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    // Position p's slice of KV head kvh, [hd].
    let at = |p: usize| p * kv + kvh * hd..p * kv + (kvh + 1) * hd;
    let mut scores: Vec<f32> = (0..=pos) // [pos + 1]
        .map(|p| {
            q.iter()
                .zip(&k_cache[at(p)])
                .map(|(a, b)| a * b)
                .sum::<f32>()
                * scale
        })
        .collect();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut denom = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        denom += *s;
    }
    out.fill(0.0);
    for (p, s) in scores.iter().enumerate() {
        let w = s / denom;
        for (o, v) in out.iter_mut().zip(&v_cache[at(p)]) {
            *o += w * v;
        }
    }
}

/// Output projection plus residual: `x += attn · o_projᵀ`.
///
/// * `attn` `[T, Q]`, `o_proj` `[H, Q]`, `x` `[T, H]` (the residual stream)
pub fn o_proj(attn: &[f32], o_proj: &[bf16], q_dim: usize, x: &mut [f32]) {
    let mut y = vec![0f32; x.len()]; // [T, H]
    matmul(attn, o_proj, q_dim, &mut y);
    for (a, b) in x.iter_mut().zip(&y) {
        *a += b;
    }
}

/// `silu(z) = z · sigmoid(z)`.
#[inline]
pub fn silu(z: f32) -> f32 {
    z / (1.0 + (-z).exp())
}

/// SwiGLU MLP plus residual: `act = silu(x·gateᵀ) ⊙ (x·upᵀ)`,
/// `residual += act · downᵀ`. Returns `act` `[T, I]` for tracing.
///
/// * `x` `[T, H]` (normed), `residual` `[T, H]`
pub fn mlp(x: &[f32], lw: &LayerWeights<'_>, d: &Dims, residual: &mut [f32]) -> Vec<f32> {
    let t = x.len() / d.hidden;
    let mut gate = vec![0f32; t * d.intermediate]; // [T, I]
    let mut up = vec![0f32; t * d.intermediate]; // [T, I]
    matmul(x, lw.gate_proj, d.hidden, &mut gate);
    matmul(x, lw.up_proj, d.hidden, &mut up);
    for (g, u) in gate.iter_mut().zip(&up) {
        *g = silu(*g) * u;
    }
    let act = gate; // [T, I]
    let mut y = vec![0f32; t * d.hidden]; // [T, H]
    matmul(&act, lw.down_proj, d.intermediate, &mut y);
    for (a, b) in residual.iter_mut().zip(&y) {
        *a += b;
    }
    act
}

/// The last RMSNorm, with the model's `norm` weight `[H]`.
///
/// * `x` `[T, H]`, `out` `[T, H]`
pub fn final_norm(x: &[f32], norm: &[bf16], eps: f32, out: &mut [f32]) {
    rms_norm(x, norm, eps, out)
}

/// Logits: `logits = x · lm_headᵀ` (`lm_head` is `embed_tokens` when tied).
///
/// * `x` `[T, H]`, `lm_head` `[V, H]`, `logits` `[T, V]`
pub fn lm_head(x: &[f32], lm_head: &[bf16], hidden: usize, logits: &mut [f32]) {
    matmul(x, lm_head, hidden, logits)
}

/// Greedy pick: index of the largest logit, lowest index on ties (NaN never
/// wins). `logits` `[V]`.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// Attention for `T` rows in parallel over (row, head); row `t` reads its
/// own sequence's cache.
///
/// * `q` `[T, Q]`, `out` `[T, Q]`
pub(crate) fn attention_rows(
    q: &[f32],
    caches: &[&KvCache],
    positions: &[usize],
    l: usize,
    d: &Dims,
    out: &mut [f32],
) {
    let hd = d.head_dim;
    out.par_chunks_mut(hd)
        .zip(q.par_chunks(hd))
        .enumerate()
        .for_each(|(i, (oh, qh))| {
            let (t, h) = (i / d.heads, i % d.heads);
            let c = caches[t];
            let (k, v) = (c.k_layer(l), c.v_layer(l));
            attention_head(qh, k, v, h / d.group(), positions[t], d, oh);
        });
}
