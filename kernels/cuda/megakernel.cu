// megakernel.cu: the one translation unit NVRTC compiles per (model config,
// split plan, arch). Its cubin holds every kernel the engine launches:
//   qmk_decode_step    one decode step of a Qwen2.5 model (defined below)
//   qmk_decode_multi_T T = 2 .. QMK_MT_MAX_TOKENS positions in one launch
//                      (decode/multi.cuh; defined below)
//   qmk_prefill_chunk  one prompt chunk on tensor cores (prefill/chunk.cuh)
//   qmk_stream_read    the streaming-read bandwidth floor (probes/stream.cuh)
//   qmk_probe_fill,
//   qmk_trap_probe     the 32-bit offset trap, demonstrated (probes/trap_probe.cuh)
// They come from one cubin so that they share the rendered plan, the
// parameter structs and the fingerprint the backend checks.
//
// Includes, in dependency order (the files do not include each other):
// Rendered per model by qmk_kernels:
#include "qmk_plan.h"            // shapes, strides, chunk tables, QMK_* constants
// The two macros of the rendered header: preprocessor conditions on an
// undefined name would silently read 0.
#if !defined(QMK_TP_RANKS) || !defined(QMK_TENSOR_CORES)
#error "QMK_TP_RANKS and QMK_TENSOR_CORES come from the rendered qmk_plan.h"
#endif
// Shared core:
#include "core/common.cuh"       // u16/u32/u64, koff_t, bf16 helpers, loads, fixed-order reductions
#include "core/params.cuh"       // Params, PrefillParams, probe params, flags, error and phase codes
#include "qmk_params_check.h"    // static_asserts: the structs above match the Rust ones
#include "core/tensors.cuh"      // weight addressing through the split plan's chunks (LayerView)
#include "core/rotary.cuh"       // rotary embedding of one (i, i + D/2) pair
#include "core/kv_cache.cuh"     // KV cache addressing and the bf16 append
#include "core/barrier.cuh"      // the grid barrier (bounded waits) and record_error
// Decode ops (qmk_decode_step; lm_head and argmax also end the prefill):
#include "decode/matvec.cuh"     // warp dot products of weight rows, the row-to-warp map
#include "decode/tc_phase.cuh"   // weight phases on tensor cores (opt-in, 7B and up)
#include "decode/embed.cuh"      // embedding row / residual read of layer 0
#include "decode/tp.cuh"         // tensor-parallel ranks: the all-reduces and the argmax fold
#include "decode/rms_norm.cuh"   // per-CTA RMSNorm into shared memory
#include "decode/qkv_proj.cuh"   // norm + q/k/v + bias + rotary + KV append
#include "decode/attention.cuh"  // attention over the cache: one CTA per head, and the split path
#include "decode/o_proj.cuh"     // output projection + residual
#include "decode/mlp.cuh"        // norm + gate/up + SiLU, then down + residual
#include "decode/lm_head.cuh"    // final norm + LM head + per-CTA argmax partials
#include "decode/argmax.cuh"     // the fixed-order argmax over the partials
#include "decode/multi.cuh"      // the multi-token step: T positions in one launch (one GPU)
// Probes:
#include "probes/stream.cuh"     // qmk_stream_read
#include "probes/trap_probe.cuh" // qmk_probe_fill, qmk_trap_probe
// Prefill ops (qmk_prefill_chunk):
#include "prefill/mma.cuh"         // mma.sync m16n8k16 and bf16 packing; chunk scratch pitches
#include "prefill/gemm.cuh"        // the mma.sync GEMM tile (sm_80 / sm_89, and the sm_90a oracle)
#include "prefill/wgmma.cuh"       // the wgmma GEMM (sm_90a): mainloop, epilogues, stream-K phases
#include "prefill/norm.cuh"        // RMSNorm over the chunk's rows (layer 0: + embedding)
#include "prefill/rope.cuh"        // rotary + K/V cache write as a phase (mma.sync path)
#include "prefill/attention.cuh"   // causal flash attention on tensor cores
#include "prefill/gemm_phases.cuh" // the qkv, o_proj, gate/up and down GEMM phases of a layer
#include "prefill/chunk.cuh"       // qmk_prefill_chunk (one GPU)

// Per arch, from the host's NVRTC options (qmk_kernels::KernelBuild::arch_options):
// the split attention's ring depth and the dynamic shared memory it sizes.
#if !defined(QMK_ATTN_RING) || !defined(QMK_SMEM_FLOATS)
#error "QMK_ATTN_RING and QMK_SMEM_FLOATS come from KernelBuild::arch_options"
#endif

// Shared memory: the activation vector of the current phase, or the
// attention merge buffers.
static_assert(QMK_SMEM_FLOATS >= QMK_HIDDEN && QMK_SMEM_FLOATS >= QMK_Q_DIM &&
                  QMK_SMEM_FLOATS >= QMK_INTER,
              "dynamic shared memory too small for an activation vector");
static_assert(QMK_SMEM_FLOATS >= 2 * QMK_WARPS + QMK_WARPS * QMK_HEAD_DIM,
              "dynamic shared memory too small for the attention merge");
static_assert(QMK_SMEM_FLOATS >= qmk::kAttnSplitSmemFloats,
              "dynamic shared memory too small for the split attention");
static_assert(QMK_THREADS_PER_CTA == QMK_THREADS, "host and kernel disagree on the block size");
static_assert((unsigned long long)QMK_EMBED_ROWS * QMK_HIDDEN * 2ull <= 0xffffffffull + 1ull &&
                  QMK_EMBED_ROWS >= QMK_VOCAB,
              "embedding/LM head rows are addressed with koff_t");
// A tensor-parallel rank: QMK_VOCAB is its LM head's rows, QMK_EMBED_ROWS
// the whole vocabulary (every rank embeds every token).
static_assert(QMK_TP_RANKS >= 1 && QMK_TP_RANKS <= QMK_TP_MAX_RANKS &&
                  (QMK_TP_RANKS == 1 || QMK_EMBED_ROWS == QMK_VOCAB * QMK_TP_RANKS),
              "tensor-parallel group size");

// The parameter block is passed by value and only ever read at constant
// offsets (ld.param), so it is never copied to local memory.
//
// Grid barriers per step: 5 per layer (after qkv, attention, o_proj, gate_up,
// down) + 1 (after the LM head, before the argmax reduce); a
// tensor-parallel rank adds one after each all-reduce.
static_assert(QMK_BARRIERS_PER_STEP == (QMK_TP_RANKS > 1 ? 7 : 5) * QMK_LAYERS + 1, "barrier count drifted");

extern "C" __global__ void __launch_bounds__(QMK_THREADS, 1)
    qmk_decode_step(const qmk::Params p) {
    using namespace qmk;
    extern __shared__ __align__(128) float4 qmk_dyn_smem[];  // 128: the bulk copies' stages
    float* xs = reinterpret_cast<float*>(qmk_dyn_smem);  // [QMK_SMEM_FLOATS] f32
    __shared__ float red[QMK_WARPS];

    u32 token = p.token;
    if (p.flags & kFlagTokenFromArgmax) token = ld_volatile_u32(p.argmax_out);
    const u32 pos = p.pos;
    // Uniform across the grid: every CTA returns before any barrier.
    if (token >= QMK_EMBED_ROWS || pos >= p.kv_capacity) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            record_error(p, token >= QMK_EMBED_ROWS ? kErrBadToken : kErrBadPos, kPhaseStart, 0);
        return;
    }

    // Test hook (kFlagDebugOob): an off-by-one read just past the logits
    // buffer, then a read with no mapping behind it. asm volatile loads are
    // never optimised away.
    if ((p.flags & kFlagDebugOob) && blockIdx.x == 0 && threadIdx.x == 0) {
        (void)ld_volatile_u32(p.logits + 4ull * QMK_VOCAB);
        (void)ld_volatile_u32(p.q_proj[0] + (1ull << 40));
    }

    const u32 skip = p.flags >> kSkipShift;  // profiling only; 0 in normal runs
    // Attention path, uniform over the grid (flags and pos are): the split
    // (flash-decoding) one from kAttnSplitMinContext cached positions on.
    const bool split_attn = (p.flags & kFlagAttnNoSplit) == 0u &&
                            ((p.flags & kFlagAttnForceSplit) != 0u || pos + 1u >= kAttnSplitMinContext);
    if (split_attn && blockIdx.x == 0) attention_zero_tickets(p);
#if QMK_TC_PHASES
    if (blockIdx.x == 0) tc::zero_counters(p);
#endif
    GridBarrierT<true> bar;
    bar.init(p);
    for (u32 layer = 0; layer < QMK_LAYERS; ++layer) {
        if (!(skip & 1u)) qkv_proj(p, layer, token, pos, xs, red);
        if (!bar.sync(p, kPhaseQkv, layer)) return;
        if (!(skip & 2u)) {
            const AttnIo io = attn_io(p, pos);
            if (split_attn) {
                if (!attention_split(p, layer, io, xs)) return;
            } else {
                attention(p, layer, io, xs);
            }
        }
        if (!bar.sync(p, kPhaseAttention, layer)) return;
        if (!(skip & 4u)) o_proj(p, layer, token, xs);
        if (!bar.sync(p, kPhaseOProj, layer)) return;
#if QMK_TP_RANKS > 1
        if (!tp_all_reduce(
                p, 2u * layer, [&](u32 i) { return residual(p, layer, token, i); }, kPhaseTpOProj, layer))
            return;
        if (!bar.sync(p, kPhaseTpOProj, layer)) return;
#endif
        if (!(skip & 8u)) mlp_gate_up(p, layer, xs, red);
        if (!bar.sync(p, kPhaseGateUp, layer)) return;
        if (!(skip & 16u)) mlp_down(p, layer, xs);
        if (!bar.sync(p, kPhaseDown, layer)) return;
#if QMK_TP_RANKS > 1
        if (!tp_all_reduce(
                p, 2u * layer + 1u, [&](u32 i) { return reinterpret_cast<const float*>(p.x)[i]; },
                kPhaseTpDown, layer))
            return;
        if (!bar.sync(p, kPhaseTpDown, layer)) return;
#endif
    }
    if (!(skip & 32u)) lm_head<kDecodeNormBatch, true>(p, xs, red);
    if (!bar.sync(p, kPhaseLmHead, QMK_LAYERS)) return;
    if (blockIdx.x == 0) {
#if QMK_TP_RANKS > 1
        float best = -QMK_INF;
        u32 pick = argmax<true>(p, &best);
        // Every rank folds the same picks in the same order: one pick.
        if (threadIdx.x == 0 && !tp_argmax(p, best, pick)) return;  // error recorded
#else
        const u32 pick = argmax(p);
#endif
        if (threadIdx.x == 0) {
            *reinterpret_cast<u32*>(p.argmax_out) = pick;
            volatile HostStatus* st = reinterpret_cast<volatile HostStatus*>(p.status);
            st->argmax = pick;
            st->barriers = bar.count;
            st->done = st->done + 1u;
            bar.finish(p);
            if (p.flags & kFlagTrace) trace_slot(p, 0)[1] = globaltimer_ns();
            __threadfence_system();
        }
    }
}

// The multi-token steps, one entry per token count (the count is a
// compile-time constant: the per-token sums live in registers).
#define QMK_MULTI_ENTRY(T)                                                                       \
    extern "C" __global__ void __launch_bounds__(QMK_THREADS, 1) qmk_decode_multi_##T(const qmk::MultiParams m) { \
        qmk::decode_multi<T>(m);                                                                  \
    }
#if QMK_MT_MAX_TOKENS >= 2
QMK_MULTI_ENTRY(2)
#endif
#if QMK_MT_MAX_TOKENS >= 3
QMK_MULTI_ENTRY(3)
#endif
#if QMK_MT_MAX_TOKENS >= 4
QMK_MULTI_ENTRY(4)
#endif
#if QMK_MT_MAX_TOKENS >= 5
QMK_MULTI_ENTRY(5)
#endif
#if QMK_MT_MAX_TOKENS >= 6
QMK_MULTI_ENTRY(6)
#endif
#if QMK_MT_MAX_TOKENS >= 7
QMK_MULTI_ENTRY(7)
#endif
#if QMK_MT_MAX_TOKENS >= 8
QMK_MULTI_ENTRY(8)
#endif
