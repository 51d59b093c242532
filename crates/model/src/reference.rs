//! The CPU reference forward pass: the oracle every GPU test compares with,
//! and the backend where there is no GPU.
//!
//! One decode step, exactly as Hugging Face's Qwen2 computes it in f32:
//!
//! ```text
//! x = embed(token)                                   [H]
//! for each layer l:
//!     xn      = rms_norm(x, input_layernorm[l])
//!     q, k, v = qkv_proj(xn)                         (with biases)
//!     q, k    = rotary(q, k, pos)                    (rotate-half)
//!     kv_append(cache[l], pos, k, v)
//!     a       = attention(q, cache[l], 0..=pos)      (GQA)
//!     x      += o_proj(a)
//!     xn      = rms_norm(x, post_attention_layernorm[l])
//!     x      += mlp(xn)                              (down(silu(gate) * up))
//! logits = lm_head(final_norm(x))                    [V]
//! next   = argmax(logits)
//! ```
//!
//! The op functions are public ([`embed`], [`rms_norm`], [`qkv_proj`],
//! [`rotary`], [`kv_append`], [`attention`], [`o_proj`], [`mlp`],
//! [`final_norm`], [`lm_head`], [`argmax`]) and share the kernel's names, and
//! [`Reference::step_traced`] records every op's output, so a GPU test can
//! compare op by op. Matmuls run in parallel over output rows (rayon).
//!
//! Several sequences can share one `Reference` (one KV cache each), and a
//! forward call takes any set of (sequence, token, position) rows, so a
//! prompt prefill is one batched pass and several sequences' decode steps
//! can share one pass over the weights.

mod matmul;
mod ops;
mod streamed;
#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use matmul::matmul;
pub use ops::{
    argmax, attention, attention_head, check_weights, embed, final_norm, kv_append, layer_weights,
    lm_head, mlp, o_proj, qkv_proj, rms_norm, rotary, silu, Dims, KvCache, LayerWeights, Rope,
};

pub use streamed::StreamedReference;

use crate::error::ModelError;
use crate::Weights;

/// How a [`Reference`] is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReferenceOptions {
    /// KV cache positions per sequence (the largest position is one less).
    pub capacity: usize,
    /// Round K/V to bf16 when stored, like the megakernel's bf16 cache.
    pub kv_bf16: bool,
    /// Independent sequences (one KV cache each).
    pub sequences: usize,
}

impl ReferenceOptions {
    /// One sequence, f32 KV cache of `capacity` positions.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            kv_bf16: false,
            sequences: 1,
        }
    }
    /// Rounds K/V to bf16 when stored, as the megakernel's cache does.
    pub fn kv_bf16(mut self, yes: bool) -> Self {
        self.kv_bf16 = yes;
        self
    }
    /// `n` independent sequences, each with its own KV cache.
    pub fn sequences(mut self, n: usize) -> Self {
        self.sequences = n;
        self
    }
}

/// One token of a forward pass: which sequence's cache, which token, where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// Index of the sequence (KV cache).
    pub seq: usize,
    /// Token id.
    pub token: u32,
    /// Position in the sequence.
    pub pos: usize,
}

/// Which rows of a forward pass get logits (the LM head is the largest
/// matmul; a prefill only needs the last row's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// No logits (a prefill chunk before the last).
    None,
    /// The last row's only.
    Last,
    /// Every row's.
    All,
}

/// Every op's output for the `T` rows of one forward pass.
#[derive(Debug, Clone, Default)]
pub struct StepTrace {
    /// Embedded tokens `[T, H]`.
    pub embed: Vec<f32>, // [T, H]
    /// Each layer's outputs `[L]`.
    pub layers: Vec<LayerTrace>, // [L]
    /// Final RMSNorm output `[T, H]`.
    pub final_norm: Vec<f32>, // [T, H]
    /// Logits `[R, V]` of the rows asked for.
    pub logits: Vec<f32>, // [R, V], the rows asked for
}

/// One layer's op outputs, `T` rows each.
#[derive(Debug, Clone, Default)]
pub struct LayerTrace {
    /// `rms_norm(x, input_layernorm)` `[T, H]`.
    pub attn_norm: Vec<f32>, // [T, H]   rms_norm(x, input_layernorm)
    /// `q_proj` + bias, before rotary `[T, Q]`.
    pub q: Vec<f32>, // [T, Q]   q_proj + bias, before rotary
    /// `k_proj` + bias, before rotary `[T, KV]`.
    pub k: Vec<f32>, // [T, KV]  k_proj + bias, before rotary
    /// `v_proj` + bias `[T, KV]`.
    pub v: Vec<f32>, // [T, KV]  v_proj + bias
    /// Queries after rotary `[T, Q]`.
    pub q_rot: Vec<f32>, // [T, Q]   after rotary
    /// Keys after rotary, before any bf16 rounding in the cache `[T, KV]`.
    pub k_rot: Vec<f32>, // [T, KV]  after rotary (before any bf16 rounding in the cache)
    /// Attention output, before `o_proj` `[T, Q]`.
    pub attn: Vec<f32>, // [T, Q]   attention output, before o_proj
    /// `x + o_proj(attn)` `[T, H]`.
    pub h_attn: Vec<f32>, // [T, H]   x + o_proj(attn)
    /// `rms_norm(h_attn, post_attention_layernorm)` `[T, H]`.
    pub mlp_norm: Vec<f32>, // [T, H]   rms_norm(h_attn, post_attention_layernorm)
    /// `silu(gate) * up` `[T, I]`.
    pub act: Vec<f32>, // [T, I]   silu(gate) * up
    /// Layer output, `h_attn + down(act)` `[T, H]`.
    pub h_out: Vec<f32>, // [T, H]   layer output, h_attn + down(act)
}

/// The CPU reference model: shared weights, rotary tables and one KV cache
/// per sequence.
#[derive(Debug, Clone)]
pub struct Reference {
    weights: Arc<Weights>,
    dims: Dims,
    rope: Rope,           // [S, hd/2] cos and sin
    caches: Vec<KvCache>, // [sequences], each [L, S, KV] for K and V
}

impl Reference {
    /// Checks the config and every weight length, and allocates the caches.
    pub fn new(weights: Arc<Weights>, opts: ReferenceOptions) -> Result<Self, ModelError> {
        let dims = Dims::from_config(&weights.config)?;
        check_weights(&weights, &dims)?;
        if opts.capacity == 0 || opts.sequences == 0 {
            return Err(ModelError::InvalidArgument(format!(
                "capacity ({}) and sequences ({}) must be at least 1",
                opts.capacity, opts.sequences
            )));
        }
        let rope = Rope::from_spec(&dims.rope, dims.head_dim, opts.capacity);
        let caches = (0..opts.sequences)
            .map(|_| KvCache::new(dims.layers, opts.capacity, dims.kv_dim(), opts.kv_bf16))
            .collect();
        Ok(Self {
            weights,
            dims,
            rope,
            caches,
        })
    }

    /// The model's sizes.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }
    /// The weights it computes with.
    pub fn weights(&self) -> &Arc<Weights> {
        &self.weights
    }
    /// The rotary tables, one row per cache position.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }
    /// KV cache positions per sequence.
    pub fn capacity(&self) -> usize {
        self.caches[0].capacity
    }
    /// Number of sequences (KV caches).
    pub fn sequences(&self) -> usize {
        self.caches.len()
    }
    /// Sequence `seq`'s KV cache (panics if out of range).
    pub fn cache(&self, seq: usize) -> &KvCache {
        &self.caches[seq]
    }
    /// Sequence `seq`'s KV cache, writable: a test fills it with another
    /// backend's cache to compare the steps that follow on the same
    /// context (panics if out of range).
    pub fn cache_mut(&mut self, seq: usize) -> &mut KvCache {
        &mut self.caches[seq]
    }

    /// One decode step of sequence 0: feeds `token` at `pos` (positions
    /// `0..pos` must already be in the cache) and returns the logits `[V]`.
    pub fn step(&mut self, token: u32, pos: usize) -> Result<Vec<f32>, ModelError> {
        self.forward(&[Row { seq: 0, token, pos }], Logits::All, None)
    }

    /// [`Reference::step`], recording every op's output.
    pub fn step_traced(&mut self, token: u32, pos: usize) -> Result<StepTrace, ModelError> {
        let mut trace = StepTrace::default();
        self.forward(&[Row { seq: 0, token, pos }], Logits::All, Some(&mut trace))?;
        Ok(trace)
    }

    /// Processes a prompt for sequence 0 at positions `0..len` in one
    /// batched pass; returns the last position's logits `[V]`.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.prefill_seq(0, tokens, 0)
    }

    /// Processes `tokens` for sequence `seq` at positions `start..start+len`;
    /// returns the last position's logits `[V]`.
    pub fn prefill_seq(
        &mut self,
        seq: usize,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>, ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyPrompt);
        }
        let rows: Vec<Row> = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                seq,
                token,
                pos: start + i,
            })
            .collect();
        self.forward(&rows, Logits::Last, None)
    }

    /// One decode step for each of sequences `0..B`: `tokens[b]` at
    /// `positions[b]` in sequence `b`, sharing one pass over the weights.
    /// Returns logits `[B, V]`.
    pub fn step_batch(
        &mut self,
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        if tokens.len() != positions.len() {
            return Err(ModelError::InvalidArgument(format!(
                "step_batch: {} tokens but {} positions",
                tokens.len(),
                positions.len()
            )));
        }
        let rows: Vec<Row> = tokens
            .iter()
            .zip(positions)
            .enumerate()
            .map(|(seq, (&token, &pos))| Row { seq, token, pos })
            .collect();
        self.forward(&rows, Logits::All, None)
    }

    /// Greedy decoding on sequence 0: prefill `prompt`, then `n` new tokens.
    /// Does not stop at end-of-text (callers that want to stop can; the
    /// goldens continue past it).
    pub fn generate_greedy(&mut self, prompt: &[u32], n: usize) -> Result<Vec<u32>, ModelError> {
        if prompt.is_empty() {
            return Err(ModelError::EmptyPrompt);
        }
        if prompt.len().saturating_add(n) > self.capacity() {
            return Err(ModelError::KvCapacity {
                prompt: prompt.len(),
                new_tokens: n,
                capacity: self.capacity(),
            });
        }
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Ok(out);
        }
        let mut next = argmax(&self.prefill(prompt)?);
        out.push(next);
        for pos in prompt.len()..prompt.len() + n - 1 {
            next = argmax(&self.step(next, pos)?);
            out.push(next);
        }
        Ok(out)
    }

    /// The general forward pass over any rows (see the module docs). Each
    /// row's K/V is stored before any attention runs, so a row at position
    /// `p` sees every row of the same sequence at positions `<= p`, from
    /// this pass or earlier ones. Returns logits `[R, V]` for the rows
    /// `which` selects; fills `trace` if given.
    pub fn forward(
        &mut self,
        rows: &[Row],
        which: Logits,
        mut trace: Option<&mut StepTrace>,
    ) -> Result<Vec<f32>, ModelError> {
        check_rows(rows, &self.dims, &self.caches)?;
        let d = self.dims;
        let (h, t) = (d.hidden, rows.len());
        let w = &*self.weights;
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect(); // [T]
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect(); // [T]

        let mut s = Scratch::new(&d, t);
        embed(&w.embed_tokens, &tokens, h, &mut s.x);
        if let Some(tr) = trace.as_deref_mut() {
            *tr = StepTrace {
                embed: s.x.clone(),
                ..StepTrace::default()
            };
        }
        for l in 0..d.layers {
            let lw = layer_weights(w, &d, l);
            let mut lt = trace.as_ref().map(|_| LayerTrace::default());
            layer_forward(
                &lw,
                &d,
                l,
                &self.rope,
                rows,
                &positions,
                &mut self.caches,
                &mut s,
                lt.as_mut(),
            );
            if let (Some(tr), Some(lt)) = (trace.as_deref_mut(), lt) {
                tr.layers.push(lt);
            }
        }
        let Scratch { x, mut xn, .. } = s;

        let logits = head(&x, &mut xn, &w.norm, w.lm_head(), &d, which);
        if let Some(tr) = trace {
            tr.final_norm = xn;
            tr.logits = logits.clone();
        }
        Ok(logits)
    }
}

/// Every row of a pass names an existing sequence, a token of the
/// vocabulary and a position inside its cache; the pass is not empty.
fn check_rows(rows: &[Row], d: &Dims, caches: &[KvCache]) -> Result<(), ModelError> {
    if rows.is_empty() {
        return Err(ModelError::EmptyPrompt);
    }
    for r in rows {
        let Some(cache) = caches.get(r.seq) else {
            return Err(ModelError::InvalidArgument(format!(
                "sequence {} does not exist ({} sequences)",
                r.seq,
                caches.len()
            )));
        };
        if r.token as usize >= d.vocab {
            return Err(ModelError::TokenOutOfVocab {
                token: r.token,
                vocab_size: d.vocab,
            });
        }
        if r.pos >= cache.capacity {
            return Err(ModelError::PositionOutOfRange {
                pos: r.pos,
                capacity: cache.capacity,
            });
        }
    }
    Ok(())
}

/// The final norm of the residual stream `x` `[T, H]` (into `xn`), then the
/// LM head over the rows `which` selects: logits `[R, V]`.
fn head(
    x: &[f32],
    xn: &mut [f32],
    norm: &[half::bf16],
    lm_head_w: &[half::bf16],
    d: &Dims,
    which: Logits,
) -> Vec<f32> {
    let h = d.hidden;
    final_norm(x, norm, d.rms_norm_eps, xn);
    let t = xn.len() / h;
    let selected: &[f32] = match which {
        Logits::None => &[],
        Logits::Last => &xn[(t - 1) * h..],
        Logits::All => xn,
    }; // [R, H]
    let mut logits = vec![0f32; selected.len() / h * d.vocab]; // [R, V]
    lm_head(selected, lm_head_w, h, &mut logits);
    logits
}

/// The activations of one forward pass over `T` rows.
struct Scratch {
    x: Vec<f32>,   // [T, H] residual stream
    xn: Vec<f32>,  // [T, H] normed
    q: Vec<f32>,   // [T, Q]
    k: Vec<f32>,   // [T, KV]
    v: Vec<f32>,   // [T, KV]
    att: Vec<f32>, // [T, Q]
}

impl Scratch {
    fn new(d: &Dims, t: usize) -> Self {
        Self {
            x: vec![0f32; t * d.hidden],
            xn: vec![0f32; t * d.hidden],
            q: vec![0f32; t * d.q_dim()],
            k: vec![0f32; t * d.kv_dim()],
            v: vec![0f32; t * d.kv_dim()],
            att: vec![0f32; t * d.q_dim()],
        }
    }
}

/// One decoder layer over the rows of a pass: attention (K/V of every row
/// stored before any row attends) then the MLP, both added to the residual
/// stream `s.x`; records the layer's outputs in `lt` if given.
#[allow(clippy::too_many_arguments)]
fn layer_forward(
    lw: &LayerWeights<'_>,
    d: &Dims,
    l: usize,
    rope: &Rope,
    rows: &[Row],
    positions: &[usize], // [T]
    caches: &mut [KvCache],
    s: &mut Scratch,
    mut lt: Option<&mut LayerTrace>,
) {
    let (h, qd, kvd) = (d.hidden, d.q_dim(), d.kv_dim());
    rms_norm(&s.x, lw.input_layernorm, d.rms_norm_eps, &mut s.xn);
    qkv_proj(&s.xn, lw, h, &mut s.q, &mut s.k, &mut s.v);
    if let Some(lt) = lt.as_deref_mut() {
        lt.attn_norm = s.xn.clone();
        lt.q = s.q.clone();
        lt.k = s.k.clone();
        lt.v = s.v.clone();
    }
    rotary(&mut s.q, positions, rope);
    rotary(&mut s.k, positions, rope);
    for (i, r) in rows.iter().enumerate() {
        let (ki, vi) = (&s.k[i * kvd..(i + 1) * kvd], &s.v[i * kvd..(i + 1) * kvd]);
        kv_append(&mut caches[r.seq], l, r.pos, ki, vi);
    }
    let row_caches: Vec<&KvCache> = rows.iter().map(|r| &caches[r.seq]).collect();
    ops::attention_rows(&s.q, &row_caches, positions, l, d, &mut s.att);
    o_proj(&s.att, lw.o_proj, qd, &mut s.x);
    if let Some(lt) = lt.as_deref_mut() {
        lt.q_rot = s.q.clone();
        lt.k_rot = s.k.clone();
        lt.attn = s.att.clone();
        lt.h_attn = s.x.clone();
    }

    rms_norm(&s.x, lw.post_attention_layernorm, d.rms_norm_eps, &mut s.xn);
    let act = mlp(&s.xn, lw, d, &mut s.x);
    if let Some(lt) = lt {
        lt.mlp_norm = s.xn.clone();
        lt.act = act;
        lt.h_out = s.x.clone();
    }
}

/// `log_softmax` of one row of logits, in f64 (for comparing logprobs).
///
/// * `logits` `[V]` -> `[V]`
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// The `k` largest entries as `(index, value)`, largest first, lower index
/// first on ties. `values` `[V]`.
pub fn top_k(values: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        if best.len() == k && best.last().is_some_and(|&(_, b)| v <= b) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= v);
        best.insert(at, (i as u32, v));
        best.truncate(k);
    }
    best
}
