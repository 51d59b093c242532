//! Backend-agnostic host code of the megakernel: everything a CUDA backend
//! does around the driver calls, written once so the `cudarc` and `cust`
//! backends cannot drift apart.
//!
//! - [`MemoryPlan`]: every device allocation (weights, KV cache, rope
//!   tables, scratch), sized with checked arithmetic before the first
//!   allocation, so "not enough GPU memory" is reported up front;
//! - [`weight_chunks`]: the weight staging order (plan order, one device
//!   allocation per planned chunk) and the host bytes of each chunk;
//! - [`Buffer`] / [`set_buffer`] / [`base_params`]: filling [`KernelParams`];
//! - [`LaunchInfo::from_occupancy`]: the cooperative grid;
//! - [`status`], [`status_in_mapped_memory`]: word indices of the
//!   [`HostStatus`] block and where it lives (device memory by default,
//!   mapped pinned host memory with `QMK_STATUS_MAPPED=1`);
//! - [`DeviceInfo`]: one CUDA device as a backend sees it;
//! - [`Progress`], [`BenchOptions`], [`BenchReport`], [`median`],
//!   [`percentile`], [`bench_bytes_per_step`]: upload progress and the
//!   decode benchmark's statistics;
//! - [`cuda_error_name`], [`is_sticky`]: driver result codes in words, and
//!   which of them corrupt the context.

// `KernelsError` is the kernels crate's one error type; its size is its call.
#![allow(clippy::result_large_err)]

use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::time::Duration;

use qmk_model::{Config, WeightKind, Weights};

use crate::error::{KernelsError, Result};
use crate::header::KernelBuild;
use crate::params::{HostStatus, KernelParams, PrefillParams, SyncState, THREADS_PER_CTA};

/// How a CUDA backend is set up (the same for every binding).
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// KV cache positions (the context length).
    pub capacity: usize,
    /// Load this cubin (written by `qwen-mk compile`) instead of running
    /// NVRTC.
    pub cubin: Option<PathBuf>,
    /// Budget of every spin-wait inside the kernel.
    pub spin_timeout: Duration,
    /// Host-side deadline of one decode step; past it the host raises the
    /// kernel's abort flag and reports a timeout.
    pub step_deadline: Duration,
    /// Cap on CTAs per SM (default: what the occupancy API allows).
    pub ctas_per_sm: Option<u32>,
    /// Compile the kernel with this split plan instead of the planner's
    /// (tests force a plan made for another offset model to show the
    /// 32-bit trap in a real decode; see crates/backend-cust/tests/scale.rs).
    pub plan: Option<qmk_layout::ModelPlan>,
    /// Prompt positions per launch of the tensor-core prefill kernel
    /// (`qmk_prefill_chunk`, issue 9); clamped to `capacity`. Default
    /// [`DEFAULT_PREFILL_CHUNK`]. `None` keeps `Backend::prefill` on one
    /// decode step per prompt token (and allocates no prefill scratch).
    pub prefill_chunk: Option<u32>,
    /// Prompts shorter than this many tokens are fed one decode step per
    /// token even when the prefill kernel is enabled (for a handful of
    /// tokens a decode step, ~0.7 ms at 0.5B, can beat one chunk launch that
    /// streams every weight with few rows per tile). Default
    /// [`DEFAULT_PREFILL_MIN_TOKENS`]; 1 sends every prompt to the kernel.
    pub prefill_min_tokens: usize,
}

/// Default [`GpuOptions::prefill_chunk`]: positions per prefill launch.
/// Larger chunks stream the weights fewer times and give the attention
/// phase more (query block, head) units to spread over the SMs; the scratch
/// grows linearly (7B at 2,048: 174 MB). Measured on the H200 (NOTES.md,
/// prefill v2): a 2,048-token prompt takes 12.8 ms at chunk 2,048 vs 27.6
/// ms at 512 (0.5B), 133 vs 151 ms (7B).
pub const DEFAULT_PREFILL_CHUNK: u32 = 2048;

/// Default [`GpuOptions::prefill_min_tokens`]: the shortest prompt that goes
/// through the prefill kernel. Measured on the H200 (NOTES.md, prefill v3
/// final pass, `*_threshold` tests): a launch costs ~1.9 ms at 0.5B and
/// ~7.1 ms at 7B for 1-16 tokens, a decode step 0.70 / 3.97 ms per token,
/// so the kernel wins from 3 tokens at 0.5B (1.9 vs 2.1 ms) and from 2 at
/// 7B; 3 serves both.
pub const DEFAULT_PREFILL_MIN_TOKENS: usize = 3;

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            device: 0,
            capacity: 4096,
            cubin: None,
            spin_timeout: Duration::from_secs(2),
            step_deadline: Duration::from_secs(30),
            ctas_per_sm: None,
            plan: None,
            prefill_chunk: Some(DEFAULT_PREFILL_CHUNK),
            prefill_min_tokens: DEFAULT_PREFILL_MIN_TOKENS,
        }
    }
}

/// Grace period after the abort flag before a hung kernel is declared
/// unrecoverable.
pub const ABORT_GRACE: Duration = Duration::from_secs(10);

/// Upload progress (weights can be tens of GB).
pub trait Progress {
    fn begin(&mut self, _what: &str, _total_bytes: u64) {}
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self) {}
}

/// No progress reporting.
impl Progress for () {}

/// One CUDA device as a backend sees it (each backend fills it through its
/// own driver binding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: crate::Arch,
    pub sms: u32,
    pub total_mem: u64,
    /// Filled in by the backend once a context exists (0 before).
    pub free_mem: u64,
    /// Largest dynamic shared memory a CTA may opt into, bytes.
    pub max_smem_optin: u32,
    pub cooperative: bool,
}

/// The environment variable that moves the status block from device memory
/// (the default: the host reads it with a copy after the step and raises
/// `abort` with an async copy on a second stream) to pinned host memory
/// mapped into the device (no copies; needs working zero-copy access).
pub const STATUS_MAPPED_ENV: &str = "QMK_STATUS_MAPPED";

/// `true` when [`STATUS_MAPPED_ENV`] is `1`: the backend allocates the
/// status block in mapped host memory instead of device memory.
pub fn status_in_mapped_memory() -> bool {
    std::env::var(STATUS_MAPPED_ENV).as_deref() == Ok("1")
}

/// Word (u32) indices of the [`HostStatus`] fields in the status block
/// (device memory or mapped host memory, see [`status_in_mapped_memory`]).
pub mod status {
    use super::*;
    pub const ABORT: usize = offset_of!(HostStatus, abort) / 4;
    pub const ERROR: usize = offset_of!(HostStatus, error) / 4;
    pub const PHASE: usize = offset_of!(HostStatus, phase) / 4;
    pub const LAYER: usize = offset_of!(HostStatus, layer) / 4;
    pub const CTA: usize = offset_of!(HostStatus, cta) / 4;
    pub const BARRIERS: usize = offset_of!(HostStatus, barriers) / 4;
    pub const ARGMAX: usize = offset_of!(HostStatus, argmax) / 4;
    pub const DONE: usize = offset_of!(HostStatus, done) / 4;
    /// Words in the block.
    pub const WORDS: usize = size_of::<HostStatus>() / 4;
}

/// The cooperative launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchInfo {
    pub grid: u32,
    pub block: u32,
    pub ctas_per_sm: u32,
    /// What the occupancy API allows.
    pub max_ctas_per_sm: u32,
    pub smem_bytes: u32,
    pub registers: u32,
}

impl LaunchInfo {
    /// Grid = CTAs per SM (the occupancy API's answer `occupancy`, capped by
    /// `cap`) x SMs, so every CTA is co-resident. `None` when no CTA fits.
    pub fn from_occupancy(
        occupancy: i32,
        sms: u32,
        cap: Option<u32>,
        smem_bytes: u32,
        registers: u32,
    ) -> Option<LaunchInfo> {
        let occ = u32::try_from(occupancy).ok().filter(|&o| o > 0)?;
        let per_sm = cap.map_or(occ, |c| c.clamp(1, occ));
        Some(LaunchInfo {
            grid: per_sm.checked_mul(sms)?,
            block: THREADS_PER_CTA,
            ctas_per_sm: per_sm,
            max_ctas_per_sm: occ,
            smem_bytes,
            registers,
        })
    }
}

/// A scratch allocation the kernel addresses through [`KernelParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    KCache,
    VCache,
    RopeCos,
    RopeSin,
    X,
    Q,
    Attn,
    MlpH,
    Logits,
    PartialVal,
    PartialIdx,
    ArgmaxOut,
    Sync,
    /// Split-attention scratch ([`attn_part_bytes`]).
    AttnPart,
}

impl Buffer {
    /// The field name in [`KernelParams`] (for error messages).
    pub fn name(self) -> &'static str {
        match self {
            Buffer::KCache => "k_cache",
            Buffer::VCache => "v_cache",
            Buffer::RopeCos => "rope_cos",
            Buffer::RopeSin => "rope_sin",
            Buffer::X => "x",
            Buffer::Q => "q",
            Buffer::Attn => "attn",
            Buffer::MlpH => "mlp_h",
            Buffer::Logits => "logits",
            Buffer::PartialVal => "partial_val",
            Buffer::PartialIdx => "partial_idx",
            Buffer::ArgmaxOut => "argmax_out",
            Buffer::Sync => "sync",
            Buffer::AttnPart => "attn_part",
        }
    }
}

/// Points `buffer`'s field of `params` at device address `addr`.
pub fn set_buffer(params: &mut KernelParams, buffer: Buffer, addr: u64) {
    let field = match buffer {
        Buffer::KCache => &mut params.k_cache,
        Buffer::VCache => &mut params.v_cache,
        Buffer::RopeCos => &mut params.rope_cos,
        Buffer::RopeSin => &mut params.rope_sin,
        Buffer::X => &mut params.x,
        Buffer::Q => &mut params.q,
        Buffer::Attn => &mut params.attn,
        Buffer::MlpH => &mut params.mlp_h,
        Buffer::Logits => &mut params.logits,
        Buffer::PartialVal => &mut params.partial_val,
        Buffer::PartialIdx => &mut params.partial_idx,
        Buffer::ArgmaxOut => &mut params.argmax_out,
        Buffer::Sync => &mut params.sync,
        Buffer::AttnPart => &mut params.attn_part,
    };
    *field = addr;
}

/// A scratch allocation of the prefill kernel ([`PrefillParams`]), sized for
/// a chunk of T positions (tokens: for the whole KV capacity).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillBuffer {
    /// `[C]` u32: the prompt's token ids by position.
    Tokens,
    /// `[T, H]` f32.
    Act,
    /// `[T, max(H, Q)]` bf16.
    Xa,
    /// `[T, Q + 2 KV]` f32.
    Qkv,
    /// `[T, Q]` bf16.
    Qb,
    /// `[T, I]` bf16.
    Hb,
    /// Stream-K scratch of the wgmma GEMM ([`stream_k_bytes`]).
    StreamK,
}

/// Weight rows x tokens of the largest wgmma GEMM tile
/// (`qmk::kWgRows` x `qmk::kWgTokMax`).
pub const STREAM_K_TILE_ELEMS: u64 = 256 * 128;

/// Bytes of the stream-K scratch for a grid of `grid` CTAs: one f32 partial
/// tile per CTA, then a u64 launch nonce and one u64 flag per CTA
/// (kernels/cuda/prefill_wgmma.cuh, `WgStreamK`).
pub fn stream_k_bytes(grid: u32) -> Result<u64> {
    let g = u64::from(grid);
    g.checked_mul(STREAM_K_TILE_ELEMS * 4)
        .and_then(|t| t.checked_add((g + 1) * 8))
        .ok_or_else(|| overflow("the stream-K scratch"))
}

impl PrefillBuffer {
    /// The field name in [`PrefillParams`].
    pub fn name(self) -> &'static str {
        match self {
            PrefillBuffer::Tokens => "prefill tokens",
            PrefillBuffer::Act => "prefill act",
            PrefillBuffer::Xa => "prefill xa",
            PrefillBuffer::Qkv => "prefill qkv",
            PrefillBuffer::Qb => "prefill qb",
            PrefillBuffer::Hb => "prefill hb",
            PrefillBuffer::StreamK => "prefill stream-K scratch",
        }
    }
}

/// Points `buffer`'s field of `params` at device address `addr`.
pub fn set_prefill_buffer(params: &mut PrefillParams, buffer: PrefillBuffer, addr: u64) {
    let field = match buffer {
        PrefillBuffer::Tokens => &mut params.tokens,
        PrefillBuffer::Act => &mut params.act,
        PrefillBuffer::Xa => &mut params.xa,
        PrefillBuffer::Qkv => &mut params.qkv,
        PrefillBuffer::Qb => &mut params.qb,
        PrefillBuffer::Hb => &mut params.hb,
        PrefillBuffer::StreamK => &mut params.sk,
    };
    *field = addr;
}

/// The prefill parameter block of one launch: positions `start..start +
/// len` of the prompt, `base` the engine's decode block (weights, caches,
/// ...), `scratch` a block whose prefill buffers are set
/// ([`set_prefill_buffer`]) and whose `max_tokens` is the chunk size.
/// `base.x` is pointed at the last row of `act` (the LM head reads it).
pub fn prefill_launch_params(
    config: &Config,
    base: &KernelParams,
    scratch: &PrefillParams,
    start: u32,
    len: u32,
    flags: u32,
) -> PrefillParams {
    let mut p = *scratch;
    p.base = *base;
    p.base.flags = flags;
    p.base.token = 0;
    p.base.pos = start;
    p.base.x = scratch.act + u64::from(len.saturating_sub(1)) * config.hidden_size as u64 * 4;
    p.tokens = scratch.tokens + u64::from(start) * 4;
    p.n_tokens = len;
    p.start = start;
    p
}

/// The chunks of a prompt at positions `start..start + n`: `(start, len)`
/// with `len <= chunk`, in order.
pub fn prefill_chunks(start: usize, n: usize, chunk: u32) -> Vec<(u32, u32)> {
    let chunk = chunk.max(1) as usize;
    (0..n)
        .step_by(chunk)
        .map(|i| ((start + i) as u32, chunk.min(n - i) as u32))
        .collect()
}

/// The chunk a backend uses: never more positions than the KV cache holds
/// (a larger chunk could never be filled, and its scratch would be waste).
pub fn clamp_prefill_chunk(chunk: Option<u32>, capacity: u32) -> Option<u32> {
    chunk.map(|c| c.min(capacity))
}

/// Checks a prefill chunk size against the KV capacity: `1..=capacity`.
pub fn check_prefill_chunk(chunk: u32, capacity: u32) -> Result<()> {
    if chunk == 0 || chunk > capacity {
        return Err(KernelsError::Config {
            field: "prefill_chunk",
            reason: format!("{chunk} is outside 1..={capacity} (the KV capacity)"),
        });
    }
    Ok(())
}

/// A parameter block with every address zero and the scalars set: the
/// backend then fills weight chunks ([`WeightChunk::set`]), buffers
/// ([`set_buffer`]) and `status`.
pub fn base_params(config: &Config, capacity: u32, spin_timeout: Duration) -> KernelParams {
    let mut p: KernelParams = bytemuck::Zeroable::zeroed();
    p.spin_timeout_ns = duration_ns(spin_timeout);
    p.kv_capacity = capacity;
    p.rms_norm_eps = config.rms_norm_eps as f32;
    p
}

/// A duration in nanoseconds, saturating (the kernel's spin budget).
pub fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn overflow(what: &str) -> KernelsError {
    KernelsError::Config {
        field: "kv_capacity",
        reason: format!("the size of {what} overflows 64 bits"),
    }
}

fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| overflow(what))
}

/// Sequence blocks per kv head the split attention may use with a grid of
/// `grid` CTAs: one item per CTA, at least 1, at most
/// [`crate::params::ATTN_MAX_SPLITS`] (the kernel's `attn_split_max`).
pub fn attn_max_splits(config: &Config, grid: u32) -> u32 {
    let kvh = (config.num_kv_heads() as u32).max(1);
    (grid / kvh).clamp(1, crate::params::ATTN_MAX_SPLITS)
}

/// Bytes of the split-attention scratch (`KernelParams::attn_part`):
/// tickets `[L, KVH]` u32 padded to 4 words, then `[HEADS, S, D]` f32
/// (block accumulators, 16-byte aligned) and `[HEADS, S, 2]` f32 (block
/// max, block sum), S = [`attn_max_splits`].
pub fn attn_part_bytes(config: &Config, grid: u32) -> Result<u64> {
    let what = "the split-attention scratch";
    let s = u64::from(attn_max_splits(config, grid));
    let tickets = mul(
        config.num_hidden_layers as u64,
        config.num_kv_heads() as u64,
        what,
    )?
    .div_ceil(4)
    .checked_mul(4)
    .ok_or_else(|| overflow(what))?;
    let per_block = (config.head_dim() as u64)
        .checked_add(2)
        .ok_or_else(|| overflow(what))?;
    let floats = mul(
        mul(config.num_attention_heads as u64, s, what)?,
        per_block,
        what,
    )?;
    mul(
        tickets.checked_add(floats).ok_or_else(|| overflow(what))?,
        4,
        what,
    )
}

/// Every device allocation of one engine, in bytes, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Every weight chunk together.
    pub weight_bytes: u64,
    /// Weight bytes one decode step reads.
    pub weight_bytes_per_step: u64,
    /// One of the K and V caches `[L, C, KV]` bf16.
    pub kv_cache_bytes: u64,
    /// One layer of one cache (must fit the kernel's 32-bit in-layer offsets).
    pub kv_layer_bytes: u64,
    /// One of the rope cos/sin tables `[C, D/2]` f32.
    pub rope_table_bytes: u64,
    /// Scratch buffers and their sizes, in allocation order (after the
    /// weights). The rope tables are uploaded; the rest start zeroed.
    pub buffers: Vec<(Buffer, u64)>,
    /// The prefill kernel's scratch for a chunk of `prefill_chunk`
    /// positions, allocated after `buffers` (empty when prefill is off).
    pub prefill: Vec<(PrefillBuffer, u64)>,
    /// Everything together: what must be free on the device.
    pub total_bytes: u64,
}

/// Largest layer of one KV cache the kernel's 32-bit in-layer offsets
/// address, in bytes.
pub const MAX_KV_LAYER_BYTES: u64 = 1 << 32;

impl MemoryPlan {
    /// Sizes every allocation for `config` with a `capacity`-position KV
    /// cache and a grid of `grid` CTAs, and refuses a KV layer past
    /// [`MAX_KV_LAYER_BYTES`].
    pub fn new(config: &Config, capacity: u32, grid: u32) -> Result<MemoryPlan> {
        let plan = MemoryPlan::sizes(config, capacity, grid)?;
        let kv_layer = plan.kv_layer_bytes;
        if kv_layer > MAX_KV_LAYER_BYTES {
            return Err(KernelsError::Config {
                field: "kv_capacity",
                reason: format!(
                    "one layer of the KV cache ({kv_layer} bytes for {capacity} positions) exceeds \
                     the kernel's 32-bit in-layer offsets"
                ),
            });
        }
        Ok(plan)
    }

    /// The sizes alone (every one checked for overflow), without the limit
    /// [`MemoryPlan::new`] puts on `kv_layer_bytes`: for a backend that
    /// reports that limit in its own words.
    pub fn sizes(config: &Config, capacity: u32, grid: u32) -> Result<MemoryPlan> {
        MemoryPlan::sizes_with_prefill(config, capacity, grid, None)
    }

    /// [`MemoryPlan::new`] plus the prefill kernel's scratch for chunks of
    /// `prefill_chunk` positions.
    pub fn new_with_prefill(
        config: &Config,
        capacity: u32,
        grid: u32,
        prefill_chunk: Option<u32>,
    ) -> Result<MemoryPlan> {
        let base = MemoryPlan::new(config, capacity, grid)?;
        if prefill_chunk.is_none() {
            return Ok(base);
        }
        MemoryPlan::sizes_with_prefill(config, capacity, grid, prefill_chunk)
    }

    /// [`MemoryPlan::sizes`] plus the prefill kernel's scratch for chunks
    /// of `prefill_chunk` positions (`None`: none).
    pub fn sizes_with_prefill(
        config: &Config,
        capacity: u32,
        grid: u32,
        prefill_chunk: Option<u32>,
    ) -> Result<MemoryPlan> {
        let wb = qmk_model::weight_bytes(config)?;
        let cap = u64::from(capacity);
        let kv_dim = config.kv_dim() as u64;
        let layers = config.num_hidden_layers as u64;
        let kv_layer = mul(mul(cap, kv_dim, "a KV-cache layer")?, 2, "a KV-cache layer")?;
        let kv = mul(kv_layer, layers, "the KV cache")?;
        let half = config.head_dim() as u64 / 2;
        let rope = mul(mul(cap, half, "the rope table")?, 4, "the rope table")?;
        let f32s = |n: usize| mul(n as u64, 4, "a scratch buffer");
        let buffers = vec![
            (Buffer::KCache, kv),
            (Buffer::VCache, kv),
            (Buffer::RopeCos, rope),
            (Buffer::RopeSin, rope),
            (Buffer::X, f32s(config.hidden_size)?),
            (Buffer::Q, f32s(config.q_dim())?),
            (Buffer::Attn, f32s(config.q_dim())?),
            (Buffer::MlpH, f32s(config.intermediate_size)?),
            (Buffer::Logits, f32s(config.vocab_size)?),
            (Buffer::PartialVal, f32s(grid as usize)?),
            (Buffer::PartialIdx, f32s(grid as usize)?),
            (Buffer::ArgmaxOut, 16),
            (Buffer::Sync, size_of::<SyncState>() as u64),
            (Buffer::AttnPart, attn_part_bytes(config, grid)?),
        ];
        let mut prefill = Vec::new();
        if let Some(t) = prefill_chunk {
            check_prefill_chunk(t, capacity)?;
            let t = u64::from(t);
            let rows = |cols: usize, elem: u64| {
                mul(
                    mul(t, cols as u64, "a prefill buffer")?,
                    elem,
                    "a prefill buffer",
                )
            };
            let xa_cols = config.hidden_size.max(config.q_dim());
            let qkv_cols = config.q_dim() + 2 * config.kv_dim();
            prefill = vec![
                (PrefillBuffer::Tokens, mul(cap, 4, "the prefill tokens")?),
                (PrefillBuffer::Act, rows(config.hidden_size, 4)?),
                (PrefillBuffer::Xa, rows(xa_cols, 2)?),
                (PrefillBuffer::Qkv, rows(qkv_cols, 4)?),
                (PrefillBuffer::Qb, rows(config.q_dim(), 2)?),
                (PrefillBuffer::Hb, rows(config.intermediate_size, 2)?),
                (PrefillBuffer::StreamK, stream_k_bytes(grid)?),
            ];
        }
        let total = buffers
            .iter()
            .map(|&(_, b)| b)
            .chain(prefill.iter().map(|&(_, b)| b))
            .try_fold(wb.total.0, |a, b| a.checked_add(b))
            .ok_or_else(|| overflow("the device memory plan"))?;
        Ok(MemoryPlan {
            weight_bytes: wb.total.0,
            weight_bytes_per_step: wb.per_decode_step.0,
            kv_cache_bytes: kv,
            kv_layer_bytes: kv_layer,
            rope_table_bytes: rope,
            buffers,
            prefill,
            total_bytes: total,
        })
    }
}

/// One planned chunk of one weight tensor: its bytes on the host and the
/// [`KernelParams`] slot its device address goes to.
#[derive(Debug, Clone, Copy)]
pub struct WeightChunk<'w> {
    /// Plan name (`gate_proj`, ...).
    pub tensor: &'w str,
    /// Chunk index inside the tensor.
    pub chunk: usize,
    /// The chunk's bf16 elements as bytes (one device allocation each).
    pub host: &'w [u8],
}

impl WeightChunk<'_> {
    /// Writes `addr` into this chunk's slot of `params`.
    pub fn set(&self, params: &mut KernelParams, addr: u64) {
        if let Some(slots) = params.chunks_mut(self.tensor) {
            slots[self.chunk] = addr;
        }
    }
}

/// The weight staging order: every chunk of every tensor the kernel
/// addresses, in plan order, each checked against the tensor's layout.
/// After uploading them, call [`tie_embeddings`].
pub fn weight_chunks<'w>(
    build: &'w KernelBuild,
    weights: &'w Weights,
) -> Result<Vec<WeightChunk<'w>>> {
    let bad = |tensor: &str, reason: String| KernelsError::Plan {
        tensor: tensor.to_string(),
        reason,
    };
    if weights.config != build.config {
        return Err(bad(
            "(all)",
            "the weights were made for another config than the kernel build".into(),
        ));
    }
    let mut probe: KernelParams = bytemuck::Zeroable::zeroed();
    let mut out = Vec::new();
    for t in &build.plan.tensors {
        let name = t.spec.name.as_str();
        let kind = WeightKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                bad(
                    name,
                    "the plan names a tensor the model does not have".into(),
                )
            })?;
        let host = weights
            .get(kind)
            .ok_or_else(|| bad(name, "missing from the weights".into()))?;
        let elems = t.spec.layout.size()?;
        if host.len() as u64 != elems {
            return Err(bad(
                name,
                format!(
                    "{} elements, the layout {} needs {elems}",
                    host.len(),
                    t.spec.layout
                ),
            ));
        }
        if probe.chunks_mut(name).is_none() {
            continue; // a tensor the kernel does not address
        }
        let bytes: &[u8] = bytemuck::cast_slice(host);
        for (c, chunk) in t.chunks.iter().enumerate() {
            let off = t.chunk_byte_offset(c)?.0;
            let end = off
                .checked_add(chunk.byte_span.0)
                .filter(|&e| e <= bytes.len() as u64)
                .ok_or_else(|| bad(name, format!("chunk {c} runs past the tensor")))?;
            out.push(WeightChunk {
                tensor: name,
                chunk: c,
                host: &bytes[off as usize..end as usize],
            });
        }
    }
    Ok(out)
}

/// A tied model's LM head is its embedding table.
pub fn tie_embeddings(config: &Config, params: &mut KernelParams) {
    if config.tie_word_embeddings {
        params.lm_head = params.embed_tokens;
    }
}

/// Bytes per host-to-device copy: large enough for full PCIe speed, small
/// enough for a smooth progress bar.
pub const UPLOAD_PIECE_BYTES: usize = 128 << 20;

/// What a backend's `bench` runs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is reported).
    pub steps: usize,
    /// Token of position 0; later tokens are the kernel's own greedy picks
    /// (read on the device, no host round trip).
    pub first_token: u32,
    /// Size of the streaming-read buffer for the floor.
    pub stream_bytes: u64,
    pub stream_reps: usize,
    /// KV length the timed steps run at (`bench --context N`): the first
    /// timed step decodes position `max(context, warmup)`, after warm-up
    /// steps at the positions just before it. Positions below the first
    /// warm-up step hold synthetic KV values ([`KV_FILL_BF16`]). 0: start
    /// at position 0 (the short-context bench).
    pub context: usize,
    /// Extra [`KernelParams::flags`] bits for every step (oracle runs, e.g.
    /// [`crate::params::FLAG_ATTN_NO_SPLIT`]).
    pub flags: u32,
}

/// `bench --profile`: (name, extra flags) of every variant, timed in the
/// same process at the same positions. Phase skips keep every barrier;
/// cost of a phase = full - skip. The attention rows: the unsplit path at
/// every length, and the split forced at any length (it is the default from
/// `ATTN_SPLIT_MIN_CONTEXT` on).
pub const PROFILE_VARIANTS: &[(&str, u32)] = {
    use crate::params::{FLAG_ATTN_FORCE_SPLIT as FS, FLAG_ATTN_NO_SPLIT as NS, SKIP_SHIFT as K};
    &[
        ("full", 0),
        ("barriers only", 63 << K),
        ("skip qkv_proj", 1 << K),
        ("skip attention", 2 << K),
        ("skip o_proj", 4 << K),
        ("skip mlp gate/up", 8 << K),
        ("skip mlp down", 16 << K),
        ("skip lm_head", 32 << K),
        ("full, attention no split", NS),
        ("skip attention, no split", NS | 2 << K),
        ("full, split forced", FS),
    ]
};

/// bf16 bits of the synthetic KV value a long-context bench fills the
/// cache with (0.0078125 = 2^-7: small, finite, so scores stay finite and
/// the softmax is well defined; never zeros to time).
pub const KV_FILL_BF16: u16 = 0x3C00;

/// The positions of a bench run: `(first, total)`: `total` steps decode
/// positions `first..first + total`, the last `opts.steps` of them timed.
pub fn bench_positions(opts: &BenchOptions) -> (usize, usize) {
    let total = opts.warmup + opts.steps;
    (opts.context.saturating_sub(opts.warmup), total)
}

/// KV-cache capacity a bench run needs ([`bench_positions`] + 1 spare).
pub fn bench_capacity(opts: &BenchOptions) -> Option<usize> {
    let (first, total) = bench_positions(opts);
    first.checked_add(total)?.checked_add(1)
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            warmup: 16,
            steps: 128,
            first_token: 9707,
            stream_bytes: 4 << 30,
            stream_reps: 10,
            context: 0,
            flags: 0,
        }
    }
}

/// Decode benchmark results, with the floor measured in the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    pub device: String,
    pub tok_per_s: f64,
    /// Median over the timed steps, device events.
    pub us_per_step: f64,
    pub us_p10: f64,
    pub us_p90: f64,
    /// Mean bytes one timed step must move.
    pub bytes_per_step: u64,
    /// bytes_per_step / us_per_step.
    pub gbps: f64,
    /// Streaming-read bandwidth, same cubin, same run.
    pub floor_gbps: f64,
    /// floor time / measured time, in percent.
    pub pct_of_floor: f64,
    /// Floor tok/s: floor_gbps / bytes_per_step.
    pub floor_tok_per_s: f64,
    pub barriers_per_step: u32,
    pub grid: u32,
    pub ctas_per_sm: u32,
    pub registers: u32,
    pub warmup: usize,
    pub steps: usize,
    /// `bench --context N` when given, else the last position decoded + 1.
    pub context: usize,
    /// First timed position.
    pub first_timed_pos: usize,
    /// Mean KV-cache bytes one timed step reads and writes (included in
    /// `bytes_per_step`).
    pub kv_bytes: u64,
}

/// Median (upper median for even lengths); sorts `v`. NaN for empty input.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Nearest-rank percentile `p` in 0..=1 of a sorted slice. NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize]
}

/// Mean bytes one timed step moves: the step's weights plus the KV cache
/// read (positions 0..=pos) and written (pos), averaged over positions
/// `warmup..warmup + steps`.
pub fn bench_bytes_per_step(
    config: &Config,
    weight_bytes_per_step: u64,
    warmup: usize,
    steps: usize,
) -> u64 {
    weight_bytes_per_step + bench_kv_bytes(config, warmup, steps)
}

/// Mean KV-cache bytes one step at positions `first..first + steps` reads
/// (K and V rows 0..=pos, every layer, bf16) and writes (row pos); the
/// integer mean (floor) of the exact sum, computed in u128.
pub fn bench_kv_bytes(config: &Config, first: usize, steps: usize) -> u64 {
    let kv_row = 2 * config.kv_dim() as u128 * config.num_hidden_layers as u128 * 2; // K and V, bf16
    let (a, n) = (first as u128, steps as u128);
    // sum over p in a..a+n of (p + 2) = n (a + 2) + n (n - 1) / 2
    let rows = n * (a + 2) + n * n.saturating_sub(1) / 2;
    u64::try_from(kv_row * rows / n.max(1)).unwrap_or(u64::MAX)
}

impl BenchReport {
    /// Assembles the report from per-step device times (microseconds).
    #[allow(clippy::too_many_arguments)]
    pub fn from_times(
        device: String,
        config: &Config,
        weight_bytes_per_step: u64,
        opts: &BenchOptions,
        mut us: Vec<f64>,
        floor_gbps: f64,
        barriers_per_step: u32,
        launch: &LaunchInfo,
    ) -> BenchReport {
        let us_med = median(&mut us);
        let (first, total) = bench_positions(opts);
        let first_timed = first + opts.warmup;
        let kv_bytes = bench_kv_bytes(config, first_timed, opts.steps);
        let bytes_per_step = weight_bytes_per_step.saturating_add(kv_bytes);
        let gbps = bytes_per_step as f64 / (us_med * 1e-6) / 1e9;
        BenchReport {
            device,
            tok_per_s: 1e6 / us_med,
            us_per_step: us_med,
            us_p10: percentile(&us, 0.1),
            us_p90: percentile(&us, 0.9),
            bytes_per_step,
            gbps,
            floor_gbps,
            pct_of_floor: 100.0 * gbps / floor_gbps,
            floor_tok_per_s: floor_gbps * 1e9 / bytes_per_step as f64,
            barriers_per_step,
            grid: launch.grid,
            ctas_per_sm: launch.ctas_per_sm,
            registers: launch.registers,
            warmup: opts.warmup,
            steps: opts.steps,
            context: if opts.context > 0 {
                opts.context
            } else {
                first + total
            },
            first_timed_pos: first_timed,
            kv_bytes,
        }
    }
}

/// Matrix FLOPs of a prefill of positions `start..start + n`: every layer's
/// projections for every position (2 x params x n), causal attention
/// (Q K^T and P V over positions 0..=p for each p: 4 x Q x (p + 1) per
/// layer) and the LM head for the last position only.
pub fn prefill_flops(config: &Config, start: usize, n: usize) -> f64 {
    let (h, i, q, kv) = (
        config.hidden_size as f64,
        config.intermediate_size as f64,
        config.q_dim() as f64,
        config.kv_dim() as f64,
    );
    let l = config.num_hidden_layers as f64;
    let per_token = 2.0 * l * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    let (s, n_f) = (start as f64, n as f64);
    // sum over p in start..start+n of (p + 1)
    let ctx = n_f * s + n_f * (n_f + 1.0) / 2.0;
    per_token * n_f + 4.0 * l * q * ctx + 2.0 * config.vocab_size as f64 * h
}

/// Time to first token of the prefill kernel (`qwen-mk bench --prefill N`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillReport {
    pub device: String,
    /// Prompt length.
    pub tokens: usize,
    /// Positions per launch.
    pub chunk: u32,
    pub launches: usize,
    /// Median over `reps` prefills of the whole prompt (device events
    /// around the launches: prompt ids already on the device).
    pub ms_median: f64,
    pub ms_p10: f64,
    pub ms_p90: f64,
    pub reps: usize,
    /// [`prefill_flops`] / time.
    pub tflops: f64,
    pub grid: u32,
    pub registers: u32,
    pub smem_bytes: u32,
    /// Grid barriers per launch, as the kernel counted them.
    pub barriers_per_launch: u32,
}

/// What a cubin is, for an error when the driver refuses it: the SM
/// architecture recorded in its ELF header (`e_flags`: the low byte for
/// CUDA ELF ABI version 7, bits 8..16 from version 8 on) and the file it came
/// from, if any.
pub fn describe_cubin(bytes: &[u8], file: Option<&std::path::Path>) -> String {
    // ELF64: EI_ABIVERSION at byte 8, e_flags at byte 48.
    let arch = match (bytes.get(..4), bytes.get(8), bytes.get(48..52)) {
        (Some(b"\x7fELF"), Some(&abi), Some(f)) => {
            let flags = u32::from_le_bytes([f[0], f[1], f[2], f[3]]);
            let sm = if abi >= 8 {
                (flags >> 8) & 0xff
            } else {
                flags & 0xff
            };
            if (30..=200).contains(&sm) {
                format!("sm_{sm}")
            } else {
                format!("an unknown arch (ELF ABI {abi}, e_flags {flags:#x})")
            }
        }
        _ => "an unknown arch (not an ELF cubin)".to_string(),
    };
    match file {
        Some(p) => format!("{arch} (cubin file {})", p.display()),
        None => arch,
    }
}

/// CUDA driver errors after which the context cannot be used again.
pub fn is_sticky(code: u32) -> bool {
    matches!(
        code,
        214 | 700 | 702 | 714 | 715 | 716 | 717 | 718 | 719 | 999
    )
}

/// The `CUresult` enumerator name and the driver's description of `code`,
/// for error messages that must not depend on a working driver (a stub
/// libcuda cannot describe its own errors).
pub fn cuda_error_name(code: u32) -> (&'static str, &'static str) {
    match code {
        0 => ("CUDA_SUCCESS", "no error"),
        1 => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        4 => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
        34 => ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
        46 => (
            "CUDA_ERROR_DEVICE_UNAVAILABLE",
            "CUDA-capable device(s) is/are busy or unavailable",
        ),
        100 => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        200 => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        201 => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        209 => (
            "CUDA_ERROR_NO_BINARY_FOR_GPU",
            "no kernel image is available for execution on the device",
        ),
        214 => (
            "CUDA_ERROR_ECC_UNCORRECTABLE",
            "uncorrectable ECC error encountered",
        ),
        218 => ("CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
        222 => (
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            "the provided PTX was compiled with an unsupported toolchain",
        ),
        300 => (
            "CUDA_ERROR_INVALID_SOURCE",
            "device kernel image is invalid",
        ),
        400 => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        500 => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        600 => ("CUDA_ERROR_NOT_READY", "device not ready"),
        700 => (
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "an illegal memory access was encountered",
        ),
        701 => (
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            "too many resources requested for launch",
        ),
        702 => (
            "CUDA_ERROR_LAUNCH_TIMEOUT",
            "the launch timed out and was terminated",
        ),
        714 => ("CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"),
        715 => (
            "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            "an illegal instruction was encountered",
        ),
        716 => ("CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
        717 => (
            "CUDA_ERROR_INVALID_ADDRESS_SPACE",
            "operation not supported on global/shared address space",
        ),
        718 => ("CUDA_ERROR_INVALID_PC", "invalid program counter"),
        719 => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
        720 => (
            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
            "too many blocks in cooperative launch",
        ),
        800 => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
        801 => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        999 => ("CUDA_ERROR_UNKNOWN", "unknown error"),
        _ => ("CUDA_ERROR_(unlisted)", "see cuda.h for this result code"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_match_the_struct() {
        assert_eq!(
            (status::ABORT, status::ERROR, status::ARGMAX, status::DONE),
            (0, 1, 6, 7)
        );
        assert_eq!(status::WORDS, 8);
        assert_eq!(STATUS_MAPPED_ENV, "QMK_STATUS_MAPPED");
    }

    #[test]
    fn grid_is_occupancy_times_sms() {
        let l = LaunchInfo::from_occupancy(2, 132, None, 1024, 64).unwrap();
        assert_eq!((l.grid, l.ctas_per_sm, l.max_ctas_per_sm), (264, 2, 2));
        let l = LaunchInfo::from_occupancy(2, 132, Some(5), 1024, 64).unwrap();
        assert_eq!(l.grid, 264);
        let l = LaunchInfo::from_occupancy(3, 132, Some(1), 1024, 64).unwrap();
        assert_eq!(l.grid, 132);
        assert!(LaunchInfo::from_occupancy(0, 132, None, 1024, 64).is_none());
    }

    #[test]
    fn memory_plan_sizes() {
        let config = Config::preset("0.5b").unwrap();
        let plan = MemoryPlan::new(&config, 4096, 132).unwrap();
        // [24, 4096, 128] bf16 per cache.
        assert_eq!(plan.kv_cache_bytes, 24 * 4096 * 128 * 2);
        assert_eq!(plan.rope_table_bytes, 4096 * 32 * 4);
        assert!(plan.total_bytes > plan.weight_bytes + 2 * plan.kv_cache_bytes);
        // A KV layer past 4 GiB is refused, naming the capacity.
        let big = Config::preset("72b").unwrap();
        let e = MemoryPlan::new(&big, u32::MAX, 132).unwrap_err();
        assert!(e.to_string().contains("kv_capacity"), "{e}");
        // `sizes` leaves that limit to the caller.
        let sized = MemoryPlan::sizes(&big, u32::MAX, 132).unwrap();
        assert!(sized.kv_layer_bytes > MAX_KV_LAYER_BYTES);
        assert_eq!(MemoryPlan::sizes(&config, 4096, 132).unwrap(), plan);
    }

    #[test]
    fn attn_split_scratch() {
        let c05 = Config::preset("0.5b").unwrap();
        let c7 = Config::preset("7b").unwrap();
        let c14 = Config::preset("14b").unwrap();
        // One item per CTA, capped at ATTN_MAX_SPLITS, at least 1.
        assert_eq!(attn_max_splits(&c05, 132), 64); // 132 / 2 = 66 -> 64
        assert_eq!(attn_max_splits(&c7, 132), 33); // 132 / 4
        assert_eq!(attn_max_splits(&c14, 132), 16); // 132 / 8
        assert_eq!(attn_max_splits(&c14, 4), 1);
        // 7B: tickets 28 x 4 = 112 words; 28 heads x 33 blocks x (128 + 2) f32.
        assert_eq!(
            attn_part_bytes(&c7, 132).unwrap(),
            (112 + 28 * 33 * 130) * 4
        );
        // 0.5B: 24 x 2 = 48 words; 14 x 64 x 66.
        assert_eq!(attn_part_bytes(&c05, 132).unwrap(), (48 + 14 * 64 * 66) * 4);
        let plan = MemoryPlan::new(&c7, 4096, 132).unwrap();
        assert!(plan
            .buffers
            .contains(&(Buffer::AttnPart, (112 + 28 * 33 * 130) * 4)));
        let mut p: KernelParams = bytemuck::Zeroable::zeroed();
        set_buffer(&mut p, Buffer::AttnPart, 0xabc0);
        assert_eq!(p.attn_part, 0xabc0);
        assert_eq!(Buffer::AttnPart.name(), "attn_part");
    }

    #[test]
    fn bench_kv_bytes_and_positions() {
        let c7 = Config::preset("7b").unwrap();
        // K and V rows of every layer: 2 x 512 x 28 x 2 B = 57,344 B.
        let row = 2 * 512 * 28 * 2u64;
        // One step at position p reads p + 1 rows and writes one.
        assert_eq!(bench_kv_bytes(&c7, 0, 1), 2 * row);
        assert_eq!(bench_kv_bytes(&c7, 10, 1), 12 * row);
        // Mean over positions 8191..8191+200: rows p + 2.
        let brute: u64 = (8191..8191 + 200u64).map(|p| (p + 2) * row).sum::<u64>() / 200;
        assert_eq!(bench_kv_bytes(&c7, 8191, 200), brute);
        // 32k: about 1.9 GB per step.
        let kv32 = bench_kv_bytes(&c7, 32_768, 200);
        assert!(kv32 > 1_870_000_000 && kv32 < 1_890_000_000, "{kv32}");
        // The old helper is weights + the same KV mean.
        assert_eq!(
            bench_bytes_per_step(&c7, 1000, 16, 128),
            1000 + bench_kv_bytes(&c7, 16, 128)
        );
        // Positions: the timed steps start at max(context, warmup).
        let o = BenchOptions {
            warmup: 16,
            steps: 200,
            context: 8192,
            ..BenchOptions::default()
        };
        assert_eq!(bench_positions(&o), (8176, 216));
        assert_eq!(bench_capacity(&o), Some(8192 + 200 + 1));
        let short = BenchOptions {
            warmup: 16,
            steps: 200,
            ..BenchOptions::default()
        };
        assert_eq!(bench_positions(&short), (0, 216));
        assert_eq!(bench_capacity(&short), Some(217));
    }

    #[test]
    fn prefill_flop_model() {
        let c = Config::preset("7b").unwrap();
        // ~2 x 7.07e9 non-embedding params... per token, plus attention.
        let one = prefill_flops(&c, 0, 1);
        assert!((13.0e9..15.0e9).contains(&one), "{one}");
        let a = prefill_flops(&c, 0, 512);
        let b = prefill_flops(&c, 0, 256) + prefill_flops(&c, 256, 256);
        let lm = 2.0 * c.vocab_size as f64 * c.hidden_size as f64;
        assert!((a - (b - lm)).abs() < 1.0, "{a} vs {b}");
    }

    #[test]
    fn prefill_scratch_and_chunks() {
        let config = Config::preset("7b").unwrap();
        let off = MemoryPlan::new(&config, 4096, 132).unwrap();
        assert!(off.prefill.is_empty());
        let on = MemoryPlan::new_with_prefill(&config, 4096, 132, Some(512)).unwrap();
        let size = |b| on.prefill.iter().find(|&&(x, _)| x == b).unwrap().1;
        assert_eq!(size(PrefillBuffer::Tokens), 4096 * 4);
        assert_eq!(size(PrefillBuffer::Act), 512 * 3584 * 4);
        assert_eq!(size(PrefillBuffer::Qkv), 512 * (3584 + 2 * 512) * 4);
        assert_eq!(size(PrefillBuffer::Hb), 512 * 18944 * 2);
        // 132 partial tiles of 256 x 128 f32, then nonce + 132 flags.
        assert_eq!(size(PrefillBuffer::StreamK), 132 * 131_072 + 133 * 8);
        let extra: u64 = on.prefill.iter().map(|&(_, b)| b).sum();
        assert_eq!(on.total_bytes, off.total_bytes + extra);
        let e = MemoryPlan::new_with_prefill(&config, 16, 132, Some(17)).unwrap_err();
        assert!(e.to_string().contains("prefill_chunk"), "{e}");
        assert_eq!(clamp_prefill_chunk(Some(256), 34), Some(34));
        assert_eq!(clamp_prefill_chunk(Some(16), 34), Some(16));
        assert_eq!(clamp_prefill_chunk(None, 34), None);
        assert_eq!(prefill_chunks(5, 7, 3), vec![(5, 3), (8, 3), (11, 1)]);
        assert_eq!(prefill_chunks(0, 1, 512), vec![(0, 1)]);

        let mut scratch: PrefillParams = bytemuck::Zeroable::zeroed();
        for (i, &(b, _)) in on.prefill.iter().enumerate() {
            set_prefill_buffer(&mut scratch, b, 0x10_0000 * (i as u64 + 1));
        }
        scratch.max_tokens = 512;
        let mut base = base_params(&config, 4096, Duration::from_secs(1));
        base.x = 0xdead;
        let p = prefill_launch_params(&config, &base, &scratch, 512, 100, 4);
        assert_eq!(p.tokens, scratch.tokens + 512 * 4);
        assert_eq!(p.base.x, scratch.act + 99 * 3584 * 4);
        assert_eq!(
            (p.n_tokens, p.start, p.max_tokens, p.base.flags),
            (100, 512, 512, 4)
        );
        assert_eq!(p.base.kv_capacity, 4096);
    }

    fn tiny(tied: bool) -> Config {
        let mut c = Config::preset(if tied { "0.5b" } else { "7b" }).unwrap();
        c.hidden_size = 128;
        c.intermediate_size = 256;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(32);
        c.vocab_size = 512;
        c
    }

    #[test]
    fn weight_chunks_cover_every_kernel_tensor_once() {
        for tied in [true, false] {
            let config = tiny(tied);
            let build = KernelBuild::new(&config).unwrap();
            let w = qmk_model::synthetic_weights(&config, 7);
            let chunks = weight_chunks(&build, &w).unwrap();
            let total: u64 = chunks.iter().map(|c| c.host.len() as u64).sum();
            assert_eq!(total, qmk_model::weight_bytes(&config).unwrap().total.0);
            let mut p = base_params(&config, 16, Duration::from_secs(1));
            for (i, c) in chunks.iter().enumerate() {
                c.set(&mut p, 0x1000 * (i as u64 + 1));
            }
            tie_embeddings(&config, &mut p);
            for name in crate::params::KERNEL_TENSORS {
                let slot = p.chunks_mut(name).unwrap()[0];
                assert_ne!(slot, 0, "tied={tied}: {name} has no chunk 0");
            }
            assert_eq!(p.lm_head == p.embed_tokens, tied);
            // The first chunk of embed_tokens is the table's first bytes.
            let e: &[u8] = bytemuck::cast_slice(&w.embed_tokens);
            assert_eq!(chunks[0].tensor, "embed_tokens");
            assert_eq!(chunks[0].host, e);
        }
    }

    #[test]
    fn statistics() {
        let mut v = vec![3.0, 1.0, 2.0, 10.0];
        assert_eq!(median(&mut v), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 10.0);
        assert!(median(&mut []).is_nan());
        assert_eq!(cuda_error_name(700).0, "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(is_sticky(700) && !is_sticky(2));
    }

    #[test]
    fn describe_cubin_reads_the_elf_arch() {
        // ELF64 headers as NVRTC 12.9 writes them (ABI 7: e_flags 0x500550
        // for sm_80), and the ABI 8 layout (SM in bits 8..16).
        let header = |abi: u8, flags: u32| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(b"\x7fELF");
            h[8] = abi;
            h[48..52].copy_from_slice(&flags.to_le_bytes());
            h
        };
        assert_eq!(describe_cubin(&header(7, 0x500550), None), "sm_80");
        assert_eq!(describe_cubin(&header(7, 0x5a055a), None), "sm_90");
        assert_eq!(describe_cubin(&header(8, 0x5a00), None), "sm_90");
        let f = std::path::Path::new("/tmp/x.cubin");
        assert_eq!(
            describe_cubin(&header(7, 0x500550), Some(f)),
            "sm_80 (cubin file /tmp/x.cubin)"
        );
        assert!(describe_cubin(b"PTX", Some(f)).contains("not an ELF cubin"));
        assert!(describe_cubin(&header(7, 0), None).contains("unknown arch"));
    }
}
