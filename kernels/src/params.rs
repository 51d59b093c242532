//! The kernel parameter blocks, `#[repr(C)]`, twins of `cuda/core/params.cuh`.
//!
//! [`params_check_header`] renders `static_assert`s of the C++ structs' size
//! and of every field's offset, with the numbers taken from these Rust
//! structs (`std::mem::offset_of!`): a field that differs on one side fails
//! the kernel's compilation instead of shifting arguments silently.

use std::mem::{offset_of, size_of};

/// Chunk slots per tensor in [`KernelParams`] (72B's gate/up/down need 10).
pub const MAX_CHUNKS: usize = 16;

/// Threads per CTA of every kernel in the cubin.
pub const THREADS_PER_CTA: u32 = 512;

// Flag bits of [`KernelParams::flags`]: only what the product or its tests
// use. With a bit clear, its hook or oracle leaves the default path's code
// and results alone. Bits in use: 0-6, 8-13 (the skip mask), 18-20; the
// others are free.

/// [`KernelParams::flags`], product: read the input token from
/// `argmax_out` (the previous step's pick) instead of `token`, so greedy
/// steps run back to back with no host round trip.
pub const FLAG_TOKEN_FROM_ARGMAX: u32 = 1;

/// [`KernelParams::flags`], fault tests: the last CTA skips its first grid
/// barrier arrival (a real hang the bounded spin-waits must turn into an
/// error).
pub const FLAG_DEBUG_HANG: u32 = 2;

/// [`KernelParams::flags`], fault tests: the split attention's first item
/// (kv head 0, block 0) never releases its ticket, so every CTA waiting for
/// kv head 0's partials must give up with [`err::COUNTER_TIMEOUT`].
pub const FLAG_DEBUG_NO_TICKET: u32 = 16;

/// [`KernelParams::flags`], profiling: thread 0 of every CTA writes the
/// step's timeline to [`KernelParams::trace`] (its start, each grid
/// barrier's arrival and release, and on CTA 0 the end, in `%globaltimer`
/// nanoseconds). The results are unchanged.
pub const FLAG_TRACE: u32 = 4;

/// [`KernelParams::flags`], fault tests: thread 0 of CTA 0 reads the word
/// just past the logits buffer (caught by compute-sanitizer memcheck with
/// `--padding`), then a weight chunk base + 2^40 bytes (no mapping there:
/// CUDA_ERROR_ILLEGAL_ADDRESS, a sticky error).
pub const FLAG_DEBUG_OOB: u32 = 8;

/// [`KernelParams::flags`], test oracle: the one-CTA-per-head attention at
/// every context length. By default it runs below
/// [`ATTN_SPLIT_MIN_CONTEXT`] cached positions and the split
/// (flash-decoding) attention from there on; the long-context tests compare
/// the two paths on the same cache.
pub const FLAG_ATTN_NO_SPLIT: u32 = 32;

/// [`KernelParams::flags`], test oracle: the split attention at every
/// context length, so short contexts exercise it too.
/// [`FLAG_ATTN_NO_SPLIT`] wins over it.
pub const FLAG_ATTN_FORCE_SPLIT: u32 = 64;

/// [`KernelParams::flags`], test oracle for the prefill kernel on sm_90a:
/// the mma.sync GEMM (`cuda/prefill/gemm.cuh`, the sm_80 / sm_89 path,
/// with its rope phase) instead of the wgmma one: the only way to run that
/// path on a Hopper GPU. No effect on other archs or on the decode kernel.
pub const FLAG_PF_MMA_SYNC: u32 = 1 << 18;

/// [`KernelParams::flags`], test oracle for the wgmma prefill GEMM: every
/// tile data-parallel (no stream-K split of small phases or of a short last
/// wave); the stream-K test compares against it.
pub const FLAG_PF_NO_STREAM_K: u32 = 1 << 19;

/// [`KernelParams::flags`], test hook of a tensor-parallel rank: the rank
/// returns at its first exchange without publishing or reporting anything,
/// as a rank whose process died would; every other rank must then end the
/// step with [`err::TP_TIMEOUT`] instead of hanging.
pub const FLAG_DEBUG_TP_STOP: u32 = 1 << 20;

/// Most ranks of a tensor-parallel group ([`KernelParams::tp_peer`]).
pub const TP_MAX_RANKS: usize = 8;

/// Cached positions (`pos + 1`) from which the split attention is the
/// default (`qmk::kAttnSplitMinContext`).
pub const ATTN_SPLIT_MIN_CONTEXT: u32 = 512;

/// [`KernelParams::flags`], profiling (`bench --profile`): `(mask <<
/// SKIP_SHIFT)` skips phases (bit 0 qkv, 1 attention, 2 o_proj, 3 gate/up,
/// 4 down, 5 lm_head) and keeps every barrier; time(full) - time(skip X) is
/// what X costs. The results of such a step are meaningless.
pub const SKIP_SHIFT: u32 = 8;

/// Megakernel parameters (`qmk::Params`). Device addresses are `u64`.
/// L layers, H hidden, Q = heads * D, KV = kv_heads * D, I intermediate,
/// V vocab, C KV capacity.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct KernelParams {
    /// Chunk bases of the token embeddings, bf16 `[V, H]` (device addresses).
    pub embed_tokens: [u64; MAX_CHUNKS],
    /// Chunk bases of the LM head, bf16 `[V, H]` (device addresses); `embed_tokens`'
    /// bases when tied.
    pub lm_head: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked pre-attention RMSNorm weights, bf16 `[L, H]` (device addresses).
    pub input_layernorm: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked q_proj weights, bf16 `[L, Q, H]` (device addresses).
    pub q_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked q_proj biases, bf16 `[L, Q]` (device addresses).
    pub q_bias: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked k_proj weights, bf16 `[L, KV, H]` (device addresses).
    pub k_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked k_proj biases, bf16 `[L, KV]` (device addresses).
    pub k_bias: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked v_proj weights, bf16 `[L, KV, H]` (device addresses).
    pub v_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked v_proj biases, bf16 `[L, KV]` (device addresses).
    pub v_bias: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked o_proj weights, bf16 `[L, H, Q]` (device addresses).
    pub o_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked pre-MLP RMSNorm weights, bf16 `[L, H]` (device addresses).
    pub post_attention_layernorm: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked gate_proj weights, bf16 `[L, I, H]` (device addresses).
    pub gate_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked up_proj weights, bf16 `[L, I, H]` (device addresses).
    pub up_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the stacked down_proj weights, bf16 `[L, H, I]` (device addresses).
    pub down_proj: [u64; MAX_CHUNKS],
    /// Chunk bases of the final RMSNorm weight, bf16 `[H]` (device addresses).
    pub norm: [u64; MAX_CHUNKS],
    /// Key cache, bf16 `[L, C, KV]` (device address).
    pub k_cache: u64,
    /// Value cache, bf16 `[L, C, KV]` (device address).
    pub v_cache: u64,
    /// Rotary cosine table, f32 `[C, D/2]` (device address).
    pub rope_cos: u64,
    /// Rotary sine table, f32 `[C, D/2]` (device address).
    pub rope_sin: u64,
    /// Residual stream, f32 `[H]` (device address).
    pub x: u64,
    /// Rotated queries, f32 `[Q]` (device address).
    pub q: u64,
    /// Attention output, f32 `[Q]` (device address).
    pub attn: u64,
    /// MLP hidden activation `silu(gate) * up`, f32 `[I]` (device address).
    pub mlp_h: u64,
    /// Output logits, f32 `[V]` (device address).
    pub logits: u64,
    /// Per-CTA max logit of the argmax, f32 `[grid]` (device address).
    pub partial_val: u64,
    /// Vocabulary index of each per-CTA max logit, u32 `[grid]` (device address).
    pub partial_idx: u64,
    /// Greedy pick of the step, u32 `[1]` (device address).
    pub argmax_out: u64,
    /// Grid-barrier state, a [`SyncState`] (device address).
    pub sync: u64,
    /// Kernel-to-host status, a [`HostStatus`] in mapped pinned host memory (device address).
    pub status: u64,
    /// Time budget of every spin-wait, nanoseconds; past it the kernel reports
    /// [`err::BARRIER_TIMEOUT`].
    pub spin_timeout_ns: u64,
    /// Input token id (unless [`FLAG_TOKEN_FROM_ARGMAX`] is set).
    pub token: u32,
    /// Position being decoded.
    pub pos: u32,
    /// KV cache capacity C, positions.
    pub kv_capacity: u32,
    /// Flag bits: `FLAG_*` and the skip mask at [`SKIP_SHIFT`].
    pub flags: u32,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Padding; zero.
    pub reserved: u32,
    /// Split-attention scratch (sized by `qmk_gpu::plan::attn_part_bytes`).
    pub attn_part: u64,
    /// Step timeline written under [`FLAG_TRACE`], u64 `[grid, B + 1, 2]`
    /// with B grid barriers per step: slot 0 holds (start, end; end on CTA
    /// 0 only), slot k (arrival, release) of barrier k; then u64 `[grid, L,`
    /// [`ATTN_MARKS`]`]`, the split attention's marks (device address).
    pub trace: u64,
    /// Bulk tensor copy descriptors (`CUtensorMap`, 128 bytes each) of the
    /// K and V caches as 2-D tensors `[L * C, KV]` bf16 in boxes of
    /// [`crate::ATTN_TILE`] rows x D, K's first (device address, 64-byte
    /// aligned); the split attention's K/V stream on sm_90 and later. 0 on
    /// earlier archs.
    pub kv_maps: u64,
    /// Tensor-parallel ranks only: every rank's exchange region (device
    /// addresses, mapped for this rank; rank order, 0 past the group), laid
    /// out as [`crate::TpRegion`] says. Unused by one-GPU builds.
    pub tp_peer: [u64; TP_MAX_RANKS],
    /// This rank's index in its tensor-parallel group (0 on one GPU).
    pub tp_rank: u32,
    /// Epoch before this step's first exchange: exchange k of the step
    /// (0 ..= 2L) publishes `tp_epoch + k + 1` (wrapping).
    pub tp_epoch: u32,
    /// The tensor-core phases' scratch (device address; sized and laid out
    /// by [`qmk_layout::TcScratch`]): tile and block counters, then the
    /// tiles' partial sums and the block sums. Unused where the build keeps
    /// its weight phases on CUDA cores.
    pub tc_scratch: u64,
}

/// Most sequence blocks per kv head of the split attention (`qmk::kAttnMaxSplits`).
pub const ATTN_MAX_SPLITS: u32 = 64;
/// Timeline marks per layer inside the split attention (`qmk::kAttnMarks`):
/// q staged, stream done, partial out, the CTA's combine share done.
pub const ATTN_MARKS: u32 = 4;

/// Prefill parameters (`qmk::PrefillParams`, entry `qmk_prefill_chunk`):
/// one launch processes positions `start..start + n_tokens` of a prompt.
/// `base` is a decode parameter block (weights, caches, rope, logits,
/// partials, argmax, sync, status, spin budget, flags, eps) with `base.x`
/// pointed at the LAST row of `act`. T = `max_tokens` scratch rows.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PrefillParams {
    /// Decode parameter block shared with the step (`pos` and `token` unused).
    pub base: KernelParams,
    /// Token ids of this chunk, u32 `[n]` (device address).
    pub tokens: u64,
    /// Residual stream of the chunk, f32 `[T, H]` (device address).
    pub act: u64,
    /// Normed input / attention output, bf16 `[T, max(H, Q)]` (device address).
    pub xa: u64,
    /// q/k/v projections plus bias before rotary, f32 `[T, Q + 2 KV]` (device address).
    pub qkv: u64,
    /// Rotated queries, bf16 `[T, Q]` (device address).
    pub qb: u64,
    /// MLP hidden activation `silu(gate) * up`, bf16 `[T, I]` (device address).
    pub hb: u64,
    /// Stream-K scratch of the wgmma GEMM: `[G]` partial tiles, then the
    /// launch nonce and `[G]` flags (sized by `qmk_gpu::plan::stream_k_bytes`).
    pub sk: u64,
    /// Positions in this chunk, n (`1..=max_tokens`).
    pub n_tokens: u32,
    /// Position of `tokens[0]`.
    pub start: u32,
    /// Rows T of every scratch buffer above.
    pub max_tokens: u32,
    /// Padding; zero.
    pub reserved: u32,
}

/// Most tokens of one multi-token step (`qmk::kMultiMaxTokens`).
pub const MULTI_MAX_TOKENS: u32 = 8;

/// Multi-token step parameters (`qmk::MultiParams`, entries
/// `qmk_decode_multi_T`): one launch processes positions `start..start + T`
/// of one sequence, T = `n_tokens`. `base` is a decode parameter block
/// (weights, caches, rope, sync, status, spin budget, flags, eps; the last
/// pick also goes to `base.argmax_out`); each token has its own activation,
/// logits, partial and split-attention buffers here.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MultiParams {
    /// Decode parameter block shared with the step (`pos`, `token` and the
    /// per-step buffers unused).
    pub base: KernelParams,
    /// Residual streams, f32 `[T, H]` (device address).
    pub x: u64,
    /// Rotated queries, f32 `[T, Q]` (device address).
    pub q: u64,
    /// Attention outputs, f32 `[T, Q]` (device address).
    pub attn: u64,
    /// MLP hidden activations, f32 `[T, I]` (device address).
    pub mlp_h: u64,
    /// Logits, f32 `[T, V]` (device address).
    pub logits: u64,
    /// Per-CTA max logit, f32 `[T, grid]` (device address).
    pub partial_val: u64,
    /// Its index, u32 `[T, grid]` (device address).
    pub partial_idx: u64,
    /// Split-attention scratch, u32 `[T, part_words]`, each token's laid
    /// out as [`KernelParams::attn_part`] (device address).
    pub attn_part: u64,
    /// u32 words per token in `attn_part` (a multiple of 4).
    pub part_words: u64,
    /// Greedy picks, u32 `[T]` (device address).
    pub picks: u64,
    /// Input tokens; the first T are used.
    pub tokens: [u32; MULTI_MAX_TOKENS as usize],
    /// T, 2 ..= the arch's [`crate::KernelBuild::multi_max_tokens`]; the
    /// entry launched must be `qmk_decode_multi_T`.
    pub n_tokens: u32,
    /// Position of `tokens[0]`.
    pub start: u32,
    /// Padding; zero.
    pub reserved: [u32; 2],
}

/// Grid-barrier state in device memory (`qmk::SyncState`); zeroed on reset.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SyncState {
    /// Barrier arrivals since the last reset.
    pub arrived: u64,
    /// Value of `arrived` when the next launch starts.
    pub base: u64,
    /// Error code of the first error, claimed by compare-and-swap; nonzero aborts.
    pub error_claim: u32,
    /// Padding; zero.
    pub reserved: [u32; 3],
}

/// Kernel-to-host status block in mapped pinned memory (`qmk::HostStatus`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct HostStatus {
    /// Written by the host: nonzero stops the kernel at its next spin-wait check.
    pub abort: u32,
    /// Error code of the first error ([`err`]).
    pub error: u32,
    /// Phase where the error happened ([`phase_name`]).
    pub phase: u32,
    /// Layer where the error happened.
    pub layer: u32,
    /// CTA that recorded the error.
    pub cta: u32,
    /// Grid barriers in the last completed step.
    pub barriers: u32,
    /// Greedy pick of the last completed step.
    pub argmax: u32,
    /// Steps completed (wrapping).
    pub done: u32,
}

/// Trap-probe parameters (`qmk::ProbeParams`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ProbeParams {
    /// Chunk bases of the probed bf16 `[layers, rows, cols]` tensor (device addresses).
    pub chunk_base: [u64; MAX_CHUNKS],
    /// The bf16 bits read per layer, u32 `[layers]` (device address).
    pub out: u64,
    /// First layer of each chunk, then `layers`.
    pub chunk_start: [u32; MAX_CHUNKS + 1],
    /// Chunks in use in `chunk_base`.
    pub num_chunks: u32,
    /// Layers of the tensor.
    pub layers: u32,
    /// Rows per layer.
    pub rows: u32,
    /// Columns per row.
    pub cols: u32,
    /// Layer stride, elements.
    pub stride0: u32,
    /// Row stride, elements.
    pub stride1: u32,
    /// Column stride, elements.
    pub stride2: u32,
}

/// Probe-tensor fill parameters (`qmk::ProbeFillParams`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ProbeFillParams {
    /// The whole probe tensor, bf16 `[layers, rows, cols]` (device address).
    pub base: u64,
    /// 16-byte vectors in the tensor.
    pub n_vec16: u64,
    /// 16-byte vectors per layer.
    pub layer_vecs: u64,
}

/// Streaming-read parameters (`qmk::StreamParams`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StreamParams {
    /// Buffer read, 16-byte vectors `[n_vec16]` of any contents (device address).
    pub src: u64,
    /// 16-byte vectors in `src`.
    pub n_vec16: u64,
    /// Per-CTA xor of every 32-bit word read, u32 `[grid]` (device address).
    pub out: u64,
}

/// Kernel error codes (`qmk::kErr*`).
pub mod err {
    /// No error.
    pub const NONE: u32 = 0;
    /// A grid barrier or other spin-wait ran past its time budget.
    pub const BARRIER_TIMEOUT: u32 = 1;
    /// The host set [`HostStatus::abort`](super::HostStatus::abort).
    pub const ABORTED: u32 = 2;
    /// The input token is outside the vocabulary.
    pub const BAD_TOKEN: u32 = 3;
    /// The position is past the KV cache capacity.
    pub const BAD_POS: u32 = 4;
    /// A wait on a counter (the split attention's tickets) ran past its
    /// time budget.
    pub const COUNTER_TIMEOUT: u32 = 5;
    /// A tensor-parallel exchange waited past its time budget for a peer
    /// rank that neither published nor reported a failure.
    pub const TP_TIMEOUT: u32 = 6;
    /// A peer rank of the tensor-parallel group reported a failure.
    pub const TP_PEER_FAILED: u32 = 7;

    /// A short description of an error code.
    pub fn name(code: u32) -> &'static str {
        match code {
            NONE => "none",
            BARRIER_TIMEOUT => "grid barrier timed out",
            ABORTED => "aborted by the host",
            BAD_TOKEN => "token out of the vocabulary",
            BAD_POS => "position past the KV capacity",
            COUNTER_TIMEOUT => "counter wait timed out",
            TP_TIMEOUT => "a peer rank stopped publishing (tensor-parallel exchange timed out)",
            TP_PEER_FAILED => "a peer rank failed",
            _ => "unknown error code",
        }
    }
}

/// Phase names (`qmk::kPhase*`), for error messages.
pub fn phase_name(phase: u32) -> &'static str {
    match phase {
        0 => "start",
        1 => "qkv_proj",
        2 => "attention",
        3 => "o_proj",
        4 => "mlp gate/up",
        5 => "mlp down",
        6 => "lm_head",
        7 => "argmax",
        8 => "prefill rms_norm",
        9 => "prefill qkv_proj",
        10 => "prefill rotary + KV write",
        11 => "prefill attention",
        12 => "prefill o_proj",
        13 => "prefill post_attention_layernorm",
        14 => "prefill mlp gate/up",
        15 => "prefill mlp down",
        16 => "all-reduce of o_proj",
        17 => "all-reduce of mlp down",
        18 => "argmax across ranks",
        _ => "unknown phase",
    }
}

macro_rules! check_struct {
    ($out:ident, $cpp:literal, $id:literal, $ty:ty, [$($field:ident $([$idx:literal])?),* $(,)?]) => {{
        $out.push_str(&format!(
            "static_assert(sizeof({}) == {}, \"{}: size differs from the Rust struct\");\n",
            $cpp, size_of::<$ty>(), $cpp
        ));
        $(
            let access = concat!(stringify!($field) $(, "[", stringify!($idx), "]")?);
            $out.push_str(&format!(
                "__device__ constexpr unsigned long long qmk_off_{id}_{f}() {{ {cpp} p{{}}; qmk_set_marker(p.{access}); \
                 return qmk_find_marker(__builtin_bit_cast(qmk_bytes<sizeof({cpp})>, p)); }}\n\
                 static_assert(qmk_off_{id}_{f}() == {off}, \"{cpp}::{f}: offset differs from the Rust struct\");\n",
                id = $id, f = stringify!($field), cpp = $cpp, access = access,
                off = offset_of!($ty, $field),
            ));
        )*
    }};
}

/// `qmk_params_check.h`: size and offset asserts for every struct above.
///
/// NVRTC has no `offsetof`; an offset is found at compile time by setting
/// the field's first byte to a marker in a value-initialised struct and
/// searching the marker in its `__builtin_bit_cast` byte image.
pub fn params_check_header() -> String {
    let mut out = String::from(
        "// Generated by qmk-kernels from the Rust #[repr(C)] structs; do not edit.\n#pragma once\n\
         template <unsigned long long N> struct qmk_bytes { unsigned char b[N]; };\n\
         template <unsigned long long N>\n\
         __device__ constexpr unsigned long long qmk_find_marker(const qmk_bytes<N> x) {\n\
         \x20 for (unsigned long long i = 0; i < N; ++i) if (x.b[i] == 0xABu) return i;\n\
         \x20 return ~0ull;\n\
         }\n\
         __device__ constexpr void qmk_set_marker(unsigned int& v) { v = 0xABu; }\n\
         __device__ constexpr void qmk_set_marker(unsigned long long& v) { v = 0xABull; }\n\
         __device__ constexpr void qmk_set_marker(float& v) { v = __builtin_bit_cast(float, 0xABu); }\n",
    );
    out.push_str(&format!(
        "static_assert(QMK_MAX_CHUNKS == {MAX_CHUNKS}, \"QMK_MAX_CHUNKS differs from Rust MAX_CHUNKS\");\n"
    ));
    out.push_str(&format!(
        "static_assert(qmk::kFlagTokenFromArgmax == {FLAG_TOKEN_FROM_ARGMAX}u && qmk::kFlagDebugHang == {FLAG_DEBUG_HANG}u && qmk::kFlagTrace == {FLAG_TRACE}u && qmk::kFlagDebugOob == {FLAG_DEBUG_OOB}u && qmk::kFlagDebugNoTicket == {FLAG_DEBUG_NO_TICKET}u && qmk::kFlagAttnNoSplit == {FLAG_ATTN_NO_SPLIT}u && qmk::kFlagAttnForceSplit == {FLAG_ATTN_FORCE_SPLIT}u && qmk::kFlagPfMmaSync == {FLAG_PF_MMA_SYNC}u && qmk::kFlagPfNoStreamK == {FLAG_PF_NO_STREAM_K}u && qmk::kFlagDebugTpStop == {FLAG_DEBUG_TP_STOP}u && qmk::kSkipShift == {SKIP_SHIFT}u, \"flags differ\");\n\
         static_assert(qmk::kAttnMaxSplits == {ATTN_MAX_SPLITS}u && qmk::kAttnSplitMinContext == {ATTN_SPLIT_MIN_CONTEXT}u && qmk::kAttnMarks == {ATTN_MARKS}u, \"split attention constants differ\");\n"
    ));
    out.push_str(&format!(
        "static_assert(qmk::kErrBarrierTimeout == {}u && qmk::kErrAborted == {}u && qmk::kErrBadToken == {}u && qmk::kErrBadPos == {}u && qmk::kErrCounterTimeout == {}u && qmk::kErrTpTimeout == {}u && qmk::kErrTpPeerFailed == {}u && QMK_TP_MAX_RANKS == {TP_MAX_RANKS}, \"error codes differ\");\n",
        err::BARRIER_TIMEOUT, err::ABORTED, err::BAD_TOKEN, err::BAD_POS, err::COUNTER_TIMEOUT, err::TP_TIMEOUT, err::TP_PEER_FAILED
    ));
    check_struct!(
        out,
        "qmk::Params",
        "Params",
        KernelParams,
        [
            embed_tokens[0],
            lm_head[0],
            input_layernorm[0],
            q_proj[0],
            q_bias[0],
            k_proj[0],
            k_bias[0],
            v_proj[0],
            v_bias[0],
            o_proj[0],
            post_attention_layernorm[0],
            gate_proj[0],
            up_proj[0],
            down_proj[0],
            norm[0],
            k_cache,
            v_cache,
            rope_cos,
            rope_sin,
            x,
            q,
            attn,
            mlp_h,
            logits,
            partial_val,
            partial_idx,
            argmax_out,
            sync,
            status,
            spin_timeout_ns,
            token,
            pos,
            kv_capacity,
            flags,
            rms_norm_eps,
            reserved,
            attn_part,
            trace,
            kv_maps,
            tp_peer[0],
            tp_rank,
            tp_epoch,
            tc_scratch,
        ]
    );
    // `base` is at offset 0; its size is asserted through `tokens`' offset.
    check_struct!(
        out,
        "qmk::PrefillParams",
        "PrefillParams",
        PrefillParams,
        [tokens, act, xa, qkv, qb, hb, sk, n_tokens, start, max_tokens, reserved]
    );
    out.push_str(&format!(
        "static_assert(qmk::kMultiMaxTokens == {MULTI_MAX_TOKENS}u, \"multi-token maximum differs\");\n"
    ));
    check_struct!(
        out,
        "qmk::MultiParams",
        "MultiParams",
        MultiParams,
        [
            x,
            q,
            attn,
            mlp_h,
            logits,
            partial_val,
            partial_idx,
            attn_part,
            part_words,
            picks,
            tokens[0],
            n_tokens,
            start,
            reserved[0]
        ]
    );
    out.push_str(
        "static_assert(qmk::kPhasePfNorm == 8u && qmk::kPhasePfDown == 15u, \"prefill phases differ\");\n",
    );
    check_struct!(
        out,
        "qmk::SyncState",
        "SyncState",
        SyncState,
        [arrived, base, error_claim, reserved[0]]
    );
    check_struct!(
        out,
        "qmk::HostStatus",
        "HostStatus",
        HostStatus,
        [abort, error, phase, layer, cta, barriers, argmax, done,]
    );
    check_struct!(
        out,
        "qmk::ProbeParams",
        "ProbeParams",
        ProbeParams,
        [
            chunk_base[0],
            out,
            chunk_start[0],
            num_chunks,
            layers,
            rows,
            cols,
            stride0,
            stride1,
            stride2,
        ]
    );
    check_struct!(
        out,
        "qmk::ProbeFillParams",
        "ProbeFillParams",
        ProbeFillParams,
        [base, n_vec16, layer_vecs]
    );
    check_struct!(
        out,
        "qmk::StreamParams",
        "StreamParams",
        StreamParams,
        [src, n_vec16, out]
    );
    out
}

impl KernelParams {
    /// The chunk-base array of a planned tensor, by its plan name.
    pub fn chunks_mut(&mut self, tensor: &str) -> Option<&mut [u64; MAX_CHUNKS]> {
        Some(match tensor {
            "embed_tokens" => &mut self.embed_tokens,
            "lm_head" => &mut self.lm_head,
            "input_layernorm" => &mut self.input_layernorm,
            "q_proj" => &mut self.q_proj,
            "q_bias" => &mut self.q_bias,
            "k_proj" => &mut self.k_proj,
            "k_bias" => &mut self.k_bias,
            "v_proj" => &mut self.v_proj,
            "v_bias" => &mut self.v_bias,
            "o_proj" => &mut self.o_proj,
            "post_attention_layernorm" => &mut self.post_attention_layernorm,
            "gate_proj" => &mut self.gate_proj,
            "up_proj" => &mut self.up_proj,
            "down_proj" => &mut self.down_proj,
            "norm" => &mut self.norm,
            _ => return None,
        })
    }
}

/// Tensors the kernel addresses through [`KernelParams`] chunk arrays, by
/// plan name. `lm_head` is absent from tied models' plans.
pub const KERNEL_TENSORS: [&str; 15] = [
    "embed_tokens",
    "lm_head",
    "input_layernorm",
    "q_proj",
    "q_bias",
    "k_proj",
    "k_bias",
    "v_proj",
    "v_bias",
    "o_proj",
    "post_attention_layernorm",
    "gate_proj",
    "up_proj",
    "down_proj",
    "norm",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_what_the_cuda_twin_expects() {
        assert_eq!(
            size_of::<KernelParams>(),
            15 * MAX_CHUNKS * 8 + 18 * 8 + 6 * 4 + TP_MAX_RANKS * 8 + 2 * 4 + 8
        );
        assert_eq!(size_of::<SyncState>(), 32);
        assert_eq!(size_of::<HostStatus>(), 32);
        // Kernel parameters must stay under the 4 KiB launch limit.
        assert!(size_of::<KernelParams>() <= 4096);
        assert_eq!(
            size_of::<PrefillParams>(),
            size_of::<KernelParams>() + 7 * 8 + 4 * 4
        );
        assert!(size_of::<PrefillParams>() <= 4096);
        assert_eq!(offset_of!(PrefillParams, base), 0);
        assert_eq!(
            size_of::<MultiParams>(),
            size_of::<KernelParams>() + 10 * 8 + (MULTI_MAX_TOKENS as usize + 4) * 4
        );
        assert!(size_of::<MultiParams>() <= 4096);
        assert_eq!(offset_of!(MultiParams, base), 0);
    }

    #[test]
    fn flags_are_distinct_bits_outside_the_skip_mask() {
        let flags = [
            FLAG_TOKEN_FROM_ARGMAX,
            FLAG_DEBUG_HANG,
            FLAG_TRACE,
            FLAG_DEBUG_OOB,
            FLAG_DEBUG_NO_TICKET,
            FLAG_ATTN_NO_SPLIT,
            FLAG_ATTN_FORCE_SPLIT,
            FLAG_PF_MMA_SYNC,
            FLAG_PF_NO_STREAM_K,
            FLAG_DEBUG_TP_STOP,
        ];
        let mut seen = 63u32 << SKIP_SHIFT;
        for f in flags {
            assert!(f.is_power_of_two(), "{f:#x}");
            assert_eq!(seen & f, 0, "{f:#x} overlaps another flag or the skip mask");
            seen |= f;
        }
    }

    #[test]
    fn check_header_names_every_field() {
        let h = params_check_header();
        assert!(h.contains("qmk::Params::rms_norm_eps: offset differs"));
        assert!(h.contains("sizeof(qmk::ProbeParams) == "));
        assert!(h.contains("qmk::PrefillParams::max_tokens: offset differs"));
        assert_eq!(phase_name(11), "prefill attention");
    }
}
