//! Launch sizing and the memory plan: every device allocation of one
//! engine, sized with checked arithmetic before the first allocation, and
//! the parameter-block fields each allocation's address goes to.

use std::mem::size_of;
use std::time::Duration;

use qmk_kernels::params::{ATTN_MARKS, ATTN_MAX_SPLITS, THREADS_PER_CTA};
use qmk_kernels::{KernelParams, MultiParams, PrefillParams, SyncState, MULTI_MAX_TOKENS};
use qmk_model::Config;

use crate::error::{Error, Result};

/// The cooperative launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchInfo {
    /// CTAs in the grid.
    pub grid: u32,
    /// Threads per CTA.
    pub block: u32,
    /// CTAs per SM the grid uses.
    pub ctas_per_sm: u32,
    /// What the occupancy API allows.
    pub max_ctas_per_sm: u32,
    /// Dynamic shared memory per CTA, bytes.
    pub smem_bytes: u32,
    /// Registers per thread.
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
    /// `[L, C, KV]` bf16 keys.
    KCache,
    /// `[L, C, KV]` bf16 values.
    VCache,
    /// `[C, D/2]` f32 rotary cosines.
    RopeCos,
    /// `[C, D/2]` f32 rotary sines.
    RopeSin,
    /// `[H]` f32 residual stream.
    X,
    /// `[Q]` f32 query.
    Q,
    /// `[Q]` f32 attention output.
    Attn,
    /// `[I]` f32 MLP activation.
    MlpH,
    /// `[V]` f32 logits.
    Logits,
    /// `[G]` f32 per-CTA argmax values.
    PartialVal,
    /// `[G]` u32 per-CTA argmax indices.
    PartialIdx,
    /// The greedy pick (16 bytes).
    ArgmaxOut,
    /// The grid barrier's state (`SyncState`).
    Sync,
    /// Split-attention scratch ([`attn_part_bytes`]).
    AttnPart,
    /// The step timeline of `bench --profile` ([`trace_bytes`]).
    Trace,
    /// `[2]` bulk tensor copy descriptors of the K and V caches
    /// ([`KernelParams::kv_maps`], [`KV_MAPS_BYTES`]).
    KvMaps,
    /// The tensor-core down phase's counters and partial sums
    /// ([`tc_scratch_bytes`]); starts zeroed like every scratch buffer.
    TcScratch,
}

/// Bytes of [`Buffer::KvMaps`]: two 128-byte descriptors.
pub const KV_MAPS_BYTES: u64 = 256;

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
            Buffer::Trace => "trace",
            Buffer::KvMaps => "kv_maps",
            Buffer::TcScratch => "tc_scratch",
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
        Buffer::Trace => &mut params.trace,
        Buffer::KvMaps => &mut params.kv_maps,
        Buffer::TcScratch => &mut params.tc_scratch,
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

/// A buffer of the multi-token step ([`MultiParams`]), sized for
/// [`MULTI_MAX_TOKENS`] tokens T.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultiBuffer {
    /// `[T, H]` f32 residual streams.
    X,
    /// `[T, Q]` f32 queries.
    Q,
    /// `[T, Q]` f32 attention outputs.
    Attn,
    /// `[T, I]` f32 MLP activations.
    MlpH,
    /// `[T, V]` f32 logits.
    Logits,
    /// `[T, G]` f32 per-CTA argmax values.
    PartialVal,
    /// `[T, G]` u32 per-CTA argmax indices.
    PartialIdx,
    /// `[T, W]` u32 split-attention scratch, W = [`multi_part_words`].
    AttnPart,
    /// `[T]` u32 greedy picks.
    Picks,
}

impl MultiBuffer {
    /// The field name in [`MultiParams`].
    pub fn name(self) -> &'static str {
        match self {
            MultiBuffer::X => "multi-token x",
            MultiBuffer::Q => "multi-token q",
            MultiBuffer::Attn => "multi-token attn",
            MultiBuffer::MlpH => "multi-token mlp_h",
            MultiBuffer::Logits => "multi-token logits",
            MultiBuffer::PartialVal => "multi-token partial_val",
            MultiBuffer::PartialIdx => "multi-token partial_idx",
            MultiBuffer::AttnPart => "multi-token attn_part",
            MultiBuffer::Picks => "multi-token picks",
        }
    }
}

/// Points `buffer`'s field of `params` at device address `addr`.
pub fn set_multi_buffer(params: &mut MultiParams, buffer: MultiBuffer, addr: u64) {
    let field = match buffer {
        MultiBuffer::X => &mut params.x,
        MultiBuffer::Q => &mut params.q,
        MultiBuffer::Attn => &mut params.attn,
        MultiBuffer::MlpH => &mut params.mlp_h,
        MultiBuffer::Logits => &mut params.logits,
        MultiBuffer::PartialVal => &mut params.partial_val,
        MultiBuffer::PartialIdx => &mut params.partial_idx,
        MultiBuffer::AttnPart => &mut params.attn_part,
        MultiBuffer::Picks => &mut params.picks,
    };
    *field = addr;
}

/// u32 words of one token's split-attention scratch in the multi-token step
/// ([`MultiParams::part_words`]): [`attn_part_bytes`] rounded up to 16
/// bytes, so every token's partials stay 16-byte aligned.
pub fn multi_part_words(config: &Config, grid: u32) -> Result<u64> {
    Ok(attn_part_bytes(config, grid)?.div_ceil(16) * 4)
}

/// The multi-token step's buffers for a grid of `grid` CTAs, T =
/// [`MULTI_MAX_TOKENS`] rows each.
pub fn multi_buffers(config: &Config, grid: u32) -> Result<Vec<(MultiBuffer, u64)>> {
    let t = u64::from(MULTI_MAX_TOKENS);
    let rows = |n: u64| {
        mul(
            mul(t, n, "a multi-token buffer")?,
            4,
            "a multi-token buffer",
        )
    };
    Ok(vec![
        (MultiBuffer::X, rows(config.hidden_size as u64)?),
        (MultiBuffer::Q, rows(config.q_dim() as u64)?),
        (MultiBuffer::Attn, rows(config.q_dim() as u64)?),
        (MultiBuffer::MlpH, rows(config.intermediate_size as u64)?),
        (MultiBuffer::Logits, rows(config.vocab_size as u64)?),
        (MultiBuffer::PartialVal, rows(u64::from(grid))?),
        (MultiBuffer::PartialIdx, rows(u64::from(grid))?),
        (
            MultiBuffer::AttnPart,
            rows(multi_part_words(config, grid)?)?,
        ),
        (MultiBuffer::Picks, rows(1)?),
    ])
}

/// Bytes of the stream-K scratch for a grid of `grid` CTAs: one f32 partial
/// tile per CTA, then a u64 launch nonce and one u64 flag per CTA
/// (the kernel's `WgStreamK`).
pub fn stream_k_bytes(grid: u32) -> Result<u64> {
    let g = u64::from(grid);
    g.checked_mul(qmk_kernels::STREAM_K_TILE_ELEMS * 4)
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

/// A parameter block with every address zero and the scalars set: the
/// backend then fills weight chunks ([`crate::staging::PlannedChunk::set`]), buffers
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

fn overflow(what: &str) -> Error {
    Error::Overflow(what.to_string())
}

fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| overflow(what))
}

/// Checks a prefill chunk size against the KV capacity: `1..=capacity`.
pub fn check_prefill_chunk(chunk: u32, capacity: u32) -> Result<()> {
    if chunk == 0 || chunk > capacity {
        return Err(Error::Option {
            field: "prefill_chunk",
            reason: format!("{chunk} is outside 1..={capacity} (the KV capacity)"),
        });
    }
    Ok(())
}

/// Sequence blocks per kv head the split attention may use with a grid of
/// `grid` CTAs: one item per CTA, at least 1, at most
/// [`ATTN_MAX_SPLITS`] (the kernel's `attn_split_max`).
pub fn attn_max_splits(config: &Config, grid: u32) -> u32 {
    let kvh = (config.num_kv_heads() as u32).max(1);
    (grid / kvh).clamp(1, ATTN_MAX_SPLITS)
}

/// Grid barriers per decode step: five per layer and one after the LM head
/// (the kernel asserts the same count).
pub fn barriers_per_step(config: &Config) -> u64 {
    config.num_hidden_layers as u64 * 5 + 1
}

/// Bytes of the step timeline (`KernelParams::trace`): u64 `[grid, B + 1,
/// 2]`, B = [`barriers_per_step`], then the split attention's marks, u64
/// `[grid, L, ATTN_MARKS]`.
pub fn trace_bytes(config: &Config, grid: u32) -> Result<u64> {
    let what = "the step timeline";
    let slots = barriers_per_step(config)
        .checked_add(1)
        .ok_or_else(|| overflow(what))?;
    let barriers = mul(mul(u64::from(grid), slots, what)?, 16, what)?;
    let marks = mul(
        mul(u64::from(grid), config.num_hidden_layers as u64, what)?,
        u64::from(ATTN_MARKS) * 8,
        what,
    )?;
    barriers.checked_add(marks).ok_or_else(|| overflow(what))
}

/// Bytes of [`Buffer::TcScratch`]: the scratch the tensor-core MLP phases
/// of `config` share ([`qmk_kernels::tc_plans`]), or 16 bytes where
/// there is none. Sized from the config alone, so a build whose arch keeps
/// the MLP on CUDA cores still has a valid (unused) address to pass.
pub fn tc_scratch_bytes(config: &Config) -> u64 {
    qmk_kernels::tc_plans(config).map_or(16, |t| t.scratch.bytes)
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
    /// The multi-token step's buffers ([`multi_buffers`]), allocated last.
    pub multi: Vec<(MultiBuffer, u64)>,
    /// Everything together: what must be free on the device.
    pub total_bytes: u64,
}

/// Largest layer of one KV cache the kernel's 32-bit in-layer offsets
/// address, in bytes.
pub const MAX_KV_LAYER_BYTES: u64 = 1 << 32;

impl MemoryPlan {
    /// Sizes every allocation for `config` with a `capacity`-position KV
    /// cache, a grid of `grid` CTAs and the prefill kernel's scratch for
    /// chunks of `prefill_chunk` positions (`None`: no prefill kernel), and
    /// refuses what the kernel cannot address: a KV layer past
    /// [`MAX_KV_LAYER_BYTES`], a chunk outside `1..=capacity`. The backend
    /// allocates exactly this plan; the CLI checks it against the device
    /// before loading anything.
    pub fn new(
        config: &Config,
        capacity: u32,
        grid: u32,
        prefill_chunk: Option<u32>,
    ) -> Result<MemoryPlan> {
        let plan = MemoryPlan::sizes(config, capacity, grid, prefill_chunk)?;
        let kv_layer = plan.kv_layer_bytes;
        if kv_layer > MAX_KV_LAYER_BYTES {
            return Err(Error::Option {
                field: "capacity",
                reason: format!(
                    "one layer of the KV cache ({kv_layer} bytes for {capacity} positions) exceeds \
                     the kernel's 32-bit in-layer offsets"
                ),
            });
        }
        Ok(plan)
    }

    /// The sizes alone (every one checked for overflow), without the limit
    /// [`MemoryPlan::new`] puts on `kv_layer_bytes`: what `qwen-mk plan`
    /// reports for any context.
    pub fn sizes(
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
            (Buffer::Trace, trace_bytes(config, grid)?),
            (Buffer::KvMaps, KV_MAPS_BYTES),
            (Buffer::TcScratch, tc_scratch_bytes(config)),
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
        let multi = multi_buffers(config, grid)?;
        let total = buffers
            .iter()
            .map(|&(_, b)| b)
            .chain(prefill.iter().map(|&(_, b)| b))
            .chain(multi.iter().map(|&(_, b)| b))
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
            multi,
            total_bytes: total,
        })
    }
}

/// Device memory the backend leaves free beside its memory plan when it
/// picks the context itself ([`crate::Options::fit_capacity`]): the loaded
/// module, the driver's own per-context needs, and the slack between the
/// plan sized for one CTA per SM and the grid the occupancy API gives.
pub const FIT_RESERVE_BYTES: u64 = 512 << 20;

/// The largest KV capacity in `1..=limit` whose memory plan (a grid of
/// `grid` CTAs, the prefill scratch for `prefill_chunk` clamped to the
/// capacity) fits in `available` bytes and that the kernel can address;
/// `None` when not even one position fits. The plan grows with the
/// capacity, so a binary search finds it in about 32 plans.
pub fn largest_context(
    config: &Config,
    available: u64,
    grid: u32,
    prefill_chunk: Option<u32>,
    limit: u32,
) -> Option<u32> {
    let fits = |c: u32| {
        MemoryPlan::new(config, c, grid, clamp_prefill_chunk(prefill_chunk, c))
            .is_ok_and(|p| p.total_bytes <= available)
    };
    if limit == 0 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1u32, limit); // fits(lo); the answer is in lo..=hi
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let plan = MemoryPlan::new(&config, 4096, 132, None).unwrap();
        // [24, 4096, 128] bf16 per cache.
        assert_eq!(plan.kv_cache_bytes, 24 * 4096 * 128 * 2);
        assert_eq!(plan.rope_table_bytes, 4096 * 32 * 4);
        assert!(plan.total_bytes > plan.weight_bytes + 2 * plan.kv_cache_bytes);
        // A KV layer past 4 GiB is refused, naming the capacity.
        let big = Config::preset("72b").unwrap();
        let e = MemoryPlan::new(&big, u32::MAX, 132, None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Option {
                    field: "capacity",
                    ..
                }
            ),
            "{e}"
        );
        // `sizes` leaves that limit to the caller.
        let sized = MemoryPlan::sizes(&big, u32::MAX, 132, None).unwrap();
        assert!(sized.kv_layer_bytes > MAX_KV_LAYER_BYTES);
        assert_eq!(MemoryPlan::sizes(&config, 4096, 132, None).unwrap(), plan);
    }

    #[test]
    fn largest_context_is_the_last_capacity_that_fits() {
        let c = Config::preset("72b").unwrap();
        let plan = |cap| MemoryPlan::new(&c, cap, 132, clamp_prefill_chunk(Some(2048), cap));
        let h200 = 150_109_880_320u64;
        let best = largest_context(&c, h200, 132, Some(2048), 32768).unwrap();
        assert!(plan(best).unwrap().total_bytes <= h200);
        assert!(plan(best + 1).unwrap().total_bytes > h200);
        // 72B on an H200: weights 145.41 GB leave room for about 14k
        // positions at 327,680 bytes each (K and V, 80 layers x 1,024 x 2 B).
        assert!((13_000..15_000).contains(&best), "{best}");
        // The model's limit caps it; nothing fits below the weights.
        let small = Config::preset("0.5b").unwrap();
        assert_eq!(
            largest_context(&small, h200, 132, Some(2048), 32768),
            Some(32768)
        );
        let w = qmk_model::weight_bytes(&c).unwrap().total.0;
        assert_eq!(largest_context(&c, w, 132, Some(2048), 32768), None);
        assert_eq!(largest_context(&small, h200, 132, None, 0), None);
        // The kernel's 32-bit KV layer offsets bound it too: 0.5B's KV layer
        // is 256 bytes per position, so 2^24 positions at most.
        let huge = largest_context(&small, u64::MAX, 132, None, u32::MAX).unwrap();
        assert_eq!(huge, 1 << 24);
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
        let plan = MemoryPlan::new(&c7, 4096, 132, None).unwrap();
        assert!(plan
            .buffers
            .contains(&(Buffer::AttnPart, (112 + 28 * 33 * 130) * 4)));
        let mut p: KernelParams = bytemuck::Zeroable::zeroed();
        set_buffer(&mut p, Buffer::AttnPart, 0xabc0);
        assert_eq!(p.attn_part, 0xabc0);
        assert_eq!(Buffer::AttnPart.name(), "attn_part");
    }

    #[test]
    fn trace_timeline() {
        // 7B: 28 layers, 141 barriers; 132 CTAs x 142 slots x 2 u64, then
        // 132 CTAs x 28 layers x 4 attention marks.
        let c7 = Config::preset("7b").unwrap();
        assert_eq!(barriers_per_step(&c7), 141);
        let want = 132 * 142 * 16 + 132 * 28 * 4 * 8;
        assert_eq!(trace_bytes(&c7, 132).unwrap(), want);
        let plan = MemoryPlan::new(&c7, 4096, 132, None).unwrap();
        assert!(plan.buffers.contains(&(Buffer::Trace, want)));
        let mut p: KernelParams = bytemuck::Zeroable::zeroed();
        set_buffer(&mut p, Buffer::Trace, 0x7700);
        assert_eq!(p.trace, 0x7700);
        assert_eq!(Buffer::Trace.name(), "trace");
    }

    #[test]
    fn prefill_scratch_and_chunks() {
        let config = Config::preset("7b").unwrap();
        let off = MemoryPlan::new(&config, 4096, 132, None).unwrap();
        assert!(off.prefill.is_empty());
        let on = MemoryPlan::new(&config, 4096, 132, Some(512)).unwrap();
        let size = |b| on.prefill.iter().find(|&&(x, _)| x == b).unwrap().1;
        assert_eq!(size(PrefillBuffer::Tokens), 4096 * 4);
        assert_eq!(size(PrefillBuffer::Act), 512 * 3584 * 4);
        assert_eq!(size(PrefillBuffer::Qkv), 512 * (3584 + 2 * 512) * 4);
        assert_eq!(size(PrefillBuffer::Hb), 512 * 18944 * 2);
        // 132 partial tiles of 256 x 128 f32, then nonce + 132 flags.
        assert_eq!(size(PrefillBuffer::StreamK), 132 * 131_072 + 133 * 8);
        let extra: u64 = on.prefill.iter().map(|&(_, b)| b).sum();
        assert_eq!(on.total_bytes, off.total_bytes + extra);
        let e = MemoryPlan::new(&config, 16, 132, Some(17)).unwrap_err();
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

    #[test]
    fn tc_scratch_is_the_mlp_plans_or_16_bytes() {
        let c7 = Config::preset("7b").unwrap();
        let tc = qmk_kernels::tc_plans(&c7).expect("7B runs the MLP on tensor cores");
        let want = tc.scratch.bytes;
        // Room for either phase's counters and sums.
        let alone = |p| qmk_layout::TcScratch::for_plans(&[p]).bytes;
        assert!(
            want >= alone(&tc.down) && want >= alone(&tc.gate_up),
            "{want}"
        );
        assert!(want > 16, "{want}");
        assert_eq!(tc_scratch_bytes(&c7), want);
        let c05 = Config::preset("0.5b").unwrap();
        assert!(qmk_kernels::tc_plans(&c05).is_none());
        assert_eq!(tc_scratch_bytes(&c05), 16);
        for (c, bytes) in [(&c7, want), (&c05, 16)] {
            let plan = MemoryPlan::new(c, 4096, 132, Some(512)).unwrap();
            let tc: Vec<_> = plan
                .buffers
                .iter()
                .filter(|&&(b, _)| b == Buffer::TcScratch)
                .collect();
            assert_eq!(tc, [&(Buffer::TcScratch, bytes)]);
        }
        let mut p: KernelParams = bytemuck::Zeroable::zeroed();
        set_buffer(&mut p, Buffer::TcScratch, 0x5c00);
        assert_eq!(p.tc_scratch, 0x5c00);
        assert_eq!(Buffer::TcScratch.name(), "tc_scratch");
    }
}
