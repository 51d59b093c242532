// core/params.cuh: the C++ twin of qmk_kernels::params (Rust, #[repr(C)]).
//
// The rendered header (qmk_params_check.h, generated from the Rust structs with
// std::mem::offset_of!) static_asserts the size and every field offset of
// these structs, so a field added, removed or reordered on one side only is a
// compile error, never a silent argument shift.
#pragma once

#define QMK_MAX_CHUNKS 16
#define QMK_TP_MAX_RANKS 8

namespace qmk {

// Decode-step parameters, passed by value (read with ld.param).
// Pointers are device addresses. Shapes: L layers, H hidden, Q = heads*D,
// KV = kv_heads*D, I intermediate, V vocab, C = KV capacity (positions).
struct Params {
    // Weight chunk bases: entry c is the device address of chunk c of the
    // tensor (layers [kChunkStart[c], kChunkStart[c+1]) of the split plan).
    u64 embed_tokens[QMK_MAX_CHUNKS];              // [V, H] bf16
    u64 lm_head[QMK_MAX_CHUNKS];                   // [V, H] bf16 (embed_tokens when tied)
    u64 input_layernorm[QMK_MAX_CHUNKS];           // [L, H] bf16
    u64 q_proj[QMK_MAX_CHUNKS];                    // [L, Q, H] bf16
    u64 q_bias[QMK_MAX_CHUNKS];                    // [L, Q] bf16
    u64 k_proj[QMK_MAX_CHUNKS];                    // [L, KV, H] bf16
    u64 k_bias[QMK_MAX_CHUNKS];                    // [L, KV] bf16
    u64 v_proj[QMK_MAX_CHUNKS];                    // [L, KV, H] bf16
    u64 v_bias[QMK_MAX_CHUNKS];                    // [L, KV] bf16
    u64 o_proj[QMK_MAX_CHUNKS];                    // [L, H, Q] bf16
    u64 post_attention_layernorm[QMK_MAX_CHUNKS];  // [L, H] bf16
    u64 gate_proj[QMK_MAX_CHUNKS];                 // [L, I, H] bf16
    u64 up_proj[QMK_MAX_CHUNKS];                   // [L, I, H] bf16
    u64 down_proj[QMK_MAX_CHUNKS];                 // [L, H, I] bf16
    u64 norm[QMK_MAX_CHUNKS];                      // [H] bf16
    u64 k_cache;          // [L, C, KV] bf16; per-layer base computed in 64 bits
    u64 v_cache;          // [L, C, KV] bf16
    u64 rope_cos;         // [C, D/2] f32
    u64 rope_sin;         // [C, D/2] f32
    u64 x;                // [H] f32 residual stream
    u64 q;                // [Q] f32 rotated queries
    u64 attn;             // [Q] f32 attention output
    u64 mlp_h;            // [I] f32 silu(gate) * up
    u64 logits;           // [V] f32
    u64 partial_val;      // [grid] f32 per-CTA max logit
    u64 partial_idx;      // [grid] u32 its index
    u64 argmax_out;       // [1] u32 greedy pick (device memory)
    u64 sync;             // SyncState (device memory)
    u64 status;           // HostStatus (mapped pinned host memory)
    u64 spin_timeout_ns;  // budget of every spin-wait
    u32 token;            // input token (unless kFlagTokenFromArgmax)
    u32 pos;              // position being decoded
    u32 kv_capacity;      // C
    u32 flags;            // kFlag*
    float rms_norm_eps;
    u32 reserved;
    u64 attn_part;        // split attention scratch: tickets [L, KVH] u32 (padded
                          // to 4 words), acc [HEADS, S, D] f32, m/l [HEADS, S, 2]
                          // f32, S = min(grid / KVH, kAttnMaxSplits) (>= 1)
    u64 trace;            // [grid, B + 1, 2] u64 step timeline (kFlagTrace),
                          // B = grid barriers per step: slot 0 = (start, end),
                          // slot k = (arrival, release) of barrier k, in
                          // %globaltimer nanoseconds; then [grid, L, 4] u64
                          // split-attention marks (attn_marks)
    u64 kv_maps;          // [2] CUtensorMap (128 bytes each, K then V) of the
                          // caches as [L * C, KV] bf16 in boxes of kAttnTile
                          // rows x D: the split attention's bulk copies
                          // (sm_90 and later; 0 elsewhere)
    u64 tp_peer[QMK_TP_MAX_RANKS];  // tensor-parallel ranks: every rank's exchange
                          // region (decode/tp.cuh), rank order; 0 past the group
    u32 tp_rank;          // this rank's index (0 on one GPU)
    u32 tp_epoch;         // exchange k of the step publishes tp_epoch + k + 1
    u64 tc_scratch;       // the tensor-core down phase (decode/tc_phase.cuh):
                          // counters [tiles] + [row tiles] u32, partials
                          // [tiles][slots][16][8] f32, block sums
                          // [row tiles][blocks][16][8] f32 (QMK_TC_* offsets)
};

// Most sequence blocks per kv head of the split attention (sizes its
// scratch and the combine's shared memory).
constexpr u32 kAttnMaxSplits = 64u;
// Cached positions (pos + 1) from which the split attention is the default.
constexpr u32 kAttnSplitMinContext = 512u;
// Timeline marks per layer inside the split attention (kFlagTrace): q
// staged, stream done, partial out (ticket released), this CTA's combine
// share done; 0 where the CTA did not get there (no item).
constexpr u32 kAttnMarks = 4u;

// Flag bits of Params::flags. Only what the product or its tests use; each
// test hook or oracle leaves the default path's code and results unchanged
// when its bit is clear. Bits in use: 0-6, 8-13 (the skip mask), 18-20.
//
// Product: read the token from argmax_out (the previous step's pick)
// instead of Params::token: back-to-back greedy decoding with no host
// round trip.
constexpr u32 kFlagTokenFromArgmax = 1u;
// Fault test: the last CTA skips its arrival at the first barrier, a real
// hang that every other spin-wait must turn into an error.
constexpr u32 kFlagDebugHang = 2u;
// Profiling (bench --profile): thread 0 of every CTA writes the step's
// timeline to Params::trace: its start, each barrier's arrival and release,
// (CTA 0) the end, and marks inside the split attention. Results are
// unchanged; a few clock reads per barrier and attention item.
constexpr u32 kFlagTrace = 4u;
// Fault test: thread 0 of CTA 0 reads one word past the logits buffer
// (memcheck with --padding reports it), then far out of bounds (a weight
// chunk + 2^40: CUDA_ERROR_ILLEGAL_ADDRESS, sticky).
constexpr u32 kFlagDebugOob = 8u;
// Fault test: the split attention's first item (kv head 0, block 0) never
// releases its ticket: every CTA waiting for kv head 0 must give up with
// kErrCounterTimeout.
constexpr u32 kFlagDebugNoTicket = 16u;
// Oracle: the one-CTA-per-head attention at every context length. By
// default the split (flash-decoding) attention runs from
// kAttnSplitMinContext cached positions on and this path below it; the
// long-context tests compare the two paths on the same cache.
constexpr u32 kFlagAttnNoSplit = 32u;
// Oracle: the split attention at every context length (kFlagAttnNoSplit
// wins over it), so short contexts test the split path too.
constexpr u32 kFlagAttnForceSplit = 64u;
// Oracle (prefill kernel, sm_90a): the mma.sync GEMM (prefill/gemm.cuh,
// the path of sm_80 / sm_89) instead of the wgmma one, with the rope phase
// it needs; the only way to run that path on a Hopper GPU. No effect on
// other archs or on the decode kernel.
constexpr u32 kFlagPfMmaSync = 1u << 18;
// Oracle (prefill kernel, wgmma GEMM): every tile data-parallel, no
// stream-K split; the stream-K test compares against it.
constexpr u32 kFlagPfNoStreamK = 1u << 19;
// Fault test (tensor-parallel ranks): this rank returns at its first
// exchange without publishing or reporting, as a rank whose process died;
// every peer must end the step with kErrTpTimeout, not hang.
constexpr u32 kFlagDebugTpStop = 1u << 20;
// Profiling (bench --profile): bits kSkipShift + 0..5 skip phases (qkv,
// attention, o_proj, gate_up, down, lm_head) while keeping every barrier;
// time(full) - time(skip X) is what X costs. Results are garbage in these
// runs.
constexpr u32 kSkipShift = 8u;

// Grid-barrier state, device memory; the host zeroes it on reset and after any
// error. Barrier k of a launch waits for arrived >= base + (k+1) * gridDim.x.
struct SyncState {
    u64 arrived;      // arrivals since the last reset
    u64 base;         // value of `arrived` when the next launch starts
    u32 error_claim;  // first error wins it (atomicCAS); nonzero = abort
    u32 reserved[3];
};

// Written by the kernel, read by the host (pinned, mapped into the device's
// address space); `abort` is written by the host.
struct HostStatus {
    u32 abort;     // host -> device: stop at the next spin-wait check
    u32 error;     // kErr*
    u32 phase;     // kPhase* where the error happened
    u32 layer;
    u32 cta;
    u32 barriers;  // grid barriers in the last completed step
    u32 argmax;    // greedy pick of the last completed step
    u32 done;      // steps completed (wrapping)
};

constexpr u32 kErrNone = 0, kErrBarrierTimeout = 1, kErrAborted = 2, kErrBadToken = 3,
              kErrBadPos = 4, kErrCounterTimeout = 5, kErrTpTimeout = 6, kErrTpPeerFailed = 7;
constexpr u32 kPhaseStart = 0, kPhaseQkv = 1, kPhaseAttention = 2, kPhaseOProj = 3,
              kPhaseGateUp = 4, kPhaseDown = 5, kPhaseLmHead = 6, kPhaseArgmax = 7;
// Tensor-parallel ranks: the all-reduces after o_proj and down, the argmax
// across the ranks' vocabulary shards.
constexpr u32 kPhaseTpOProj = 16, kPhaseTpDown = 17, kPhaseTpArgmax = 18;
// Phases of the prefill kernel (qmk_prefill_chunk). kPhasePfRope is the
// mma.sync path's rope phase; on the wgmma path its work is in the q/k/v
// epilogue and only its barrier remains.
constexpr u32 kPhasePfNorm = 8, kPhasePfQkv = 9, kPhasePfRope = 10, kPhasePfAttention = 11,
              kPhasePfOProj = 12, kPhasePfNorm2 = 13, kPhasePfGateUp = 14, kPhasePfDown = 15;

// Prefill parameters (qmk_prefill_chunk), passed by value like Params.
// base: weights, KV cache, rope tables, logits / partials / argmax_out,
// sync, status, spin budget, flags, eps exactly as for a decode step; base.x
// points at the LAST row of `act` (the final norm + LM head read it there);
// base.pos and base.token are unused. T = max_tokens rows of scratch.
struct PrefillParams {
    Params base;
    u64 tokens;      // [n] u32 token ids of this chunk (device memory)
    u64 act;         // [T, H] f32 residual stream of the chunk
    u64 xa;          // [T, max(H, Q)] bf16 normed input / attention output
    u64 qkv;         // [T, Q + 2 KV] f32 projections + bias, before rotary
    u64 qb;          // [T, Q] bf16 rotated queries
    u64 hb;          // [T, I] bf16 silu(gate) * up
    u64 sk;          // stream-K scratch: [G] partial tiles, nonce, [G] flags
    u32 n_tokens;    // n: positions in this chunk (1..=max_tokens)
    u32 start;       // position of tokens[0]
    u32 max_tokens;  // T: rows of every scratch buffer above
    u32 reserved;
};

// Most tokens of a multi-token step (MultiParams::tokens).
constexpr u32 kMultiMaxTokens = 8u;

// Multi-token step parameters (qmk_decode_multi_T, T = n_tokens), passed by
// value like Params: positions start .. start + T - 1 of one sequence.
// base: weights, KV cache, rope tables, sync, status, spin budget, flags
// and eps exactly as for a decode step; the last token's pick also goes to
// base.argmax_out. base's token, pos, activation, logits, partial and
// split-attention buffers are unused: each token has its own below.
struct MultiParams {
    Params base;
    u64 x;            // [T, H] f32 residual streams
    u64 q;            // [T, Q] f32 rotated queries
    u64 attn;         // [T, Q] f32 attention outputs
    u64 mlp_h;        // [T, I] f32 silu(gate) * up
    u64 logits;       // [T, V] f32
    u64 partial_val;  // [T, grid] f32 per-CTA max logit
    u64 partial_idx;  // [T, grid] u32 its index
    u64 attn_part;    // [T, part_words] u32: each token's split-attention
                      // scratch, laid out as Params::attn_part
    u64 part_words;   // u32 words per token in attn_part (a multiple of 4)
    u64 picks;        // [T] u32 greedy picks (device memory)
    u32 tokens[kMultiMaxTokens];  // input tokens; the first T are used
    u32 n_tokens;     // T
    u32 start;        // position of tokens[0]
    u32 reserved[2];
};

// Trap probe: reads element [l, rows-1, cols-1] of a stacked [layers, rows,
// cols] bf16 tensor for every l, through chunk bases exactly as the
// megakernel addresses weights (koff_t arithmetic).
struct ProbeParams {
    u64 chunk_base[QMK_MAX_CHUNKS];
    u64 out;                             // [layers] u32: the bf16 bits read
    u32 chunk_start[QMK_MAX_CHUNKS + 1]; // first layer of each chunk, then layers
    u32 num_chunks;
    u32 layers;
    u32 rows;
    u32 cols;
    u32 stride0;  // elements
    u32 stride1;
    u32 stride2;
};

// Fills the probe tensor: every element of layer l holds bf16(l + 1).
struct ProbeFillParams {
    u64 base;        // [layers, rows, cols] bf16, the whole tensor; 64-bit
                     // addressing (the fill is not under test)
    u64 n_vec16;     // 16-byte vectors in the tensor
    u64 layer_vecs;  // 16-byte vectors per layer
};

// Streaming read (bandwidth floor): xor of every 32-bit word, per CTA.
struct StreamParams {
    u64 src;      // [n_vec16] 16-byte vectors, any contents
    u64 n_vec16;
    u64 out;      // [grid] u32 per-CTA xor
};

}  // namespace qmk
