// megakernel.cu: one launch = one decode step of a Qwen2.5 model, plus the
// two helper kernels that must come from the same cubin (the streaming-read
// bandwidth floor and the 32-bit trap probe).
//
// Compiled by NVRTC per (model config, split plan, arch); qmk_plan.h is
// rendered by qmk_kernels (shapes, strides, chunk tables, QMK_* constants)
// and qmk_params_check.h static_asserts the parameter block's layout.
#include "qmk_plan.h"
#include "common.cuh"
#include "params.cuh"
#include "qmk_params_check.h"
#include "tensors.cuh"
#include "matvec.cuh"
#include "embed.cuh"
#include "rms_norm.cuh"
#include "rotary.cuh"
#include "kv_append.cuh"
#include "barrier.cuh"
#include "qkv_proj.cuh"
#include "attention.cuh"
#include "o_proj.cuh"
#include "mlp.cuh"
#include "lm_head.cuh"
#include "argmax.cuh"
#include "stream.cuh"
#include "trap_probe.cuh"
// The prefill kernel (issue 9): same cubin, own entry point.
#include "prefill_mma.cuh"
#include "prefill_gemm.cuh"
#include "prefill_wgmma.cuh"
#include "prefill_norm.cuh"
#include "prefill_rope.cuh"
#include "prefill_attention.cuh"
#include "prefill_ops.cuh"
#include "prefill.cuh"

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
static_assert((unsigned long long)QMK_VOCAB * QMK_HIDDEN * 2ull <= 0xffffffffull + 1ull,
              "embedding/LM head rows are addressed with koff_t");

// The parameter block is passed by value and only ever read at constant
// offsets (ld.param); ptxas reports 0 bytes of stack, i.e. no local copy.
//
// Grid barriers per step: 5 per layer (after qkv, attention, o_proj, gate_up,
// down) + 1 (after the LM head, before the argmax reduce).
static_assert(QMK_BARRIERS_PER_STEP == 5 * QMK_LAYERS + 1, "barrier count drifted");

extern "C" __global__ void __launch_bounds__(QMK_THREADS, 1)
    qmk_decode_step(const qmk::Params p) {
    using namespace qmk;
    extern __shared__ float4 qmk_dyn_smem[];
    float* xs = reinterpret_cast<float*>(qmk_dyn_smem);
    __shared__ float red[QMK_WARPS];

    u32 token = p.token;
    if (p.flags & kFlagTokenFromArgmax) token = ld_volatile_u32(p.argmax_out);
    const u32 pos = p.pos;
    // Uniform across the grid: every CTA returns before any barrier.
    if (token >= QMK_VOCAB || pos >= p.kv_capacity) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            record_error(p, token >= QMK_VOCAB ? kErrBadToken : kErrBadPos, kPhaseStart, 0);
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
    GridBarrier bar;
    bar.init(p);
    for (u32 layer = 0; layer < QMK_LAYERS; ++layer) {
        if (!(skip & 1u)) qkv_proj(p, layer, token, pos, xs, red);
        if (!bar.sync(p, kPhaseQkv, layer)) return;
        if (!(skip & 2u)) {
            if (split_attn) attention_split(p, layer, pos, xs);
            else attention(p, layer, pos, xs);
        }
        if (!bar.sync(p, kPhaseAttention, layer)) return;
        if (!(skip & 4u)) o_proj(p, layer, token, xs);
        if (!bar.sync(p, kPhaseOProj, layer)) return;
        if (!(skip & 8u)) mlp_gate_up(p, layer, xs, red);
        if (!bar.sync(p, kPhaseGateUp, layer)) return;
        if (!(skip & 16u)) mlp_down(p, layer, xs);
        if (!bar.sync(p, kPhaseDown, layer)) return;
    }
    if (!(skip & 32u)) lm_head(p, xs, red);
    if (!bar.sync(p, kPhaseLmHead, QMK_LAYERS)) return;
    if (blockIdx.x == 0) {
        const u32 pick = argmax(p);
        if (threadIdx.x == 0) {
            *reinterpret_cast<u32*>(p.argmax_out) = pick;
            volatile HostStatus* st = reinterpret_cast<volatile HostStatus*>(p.status);
            st->argmax = pick;
            st->barriers = bar.count;
            st->done = st->done + 1u;
            bar.finish(p);
            __threadfence_system();
        }
    }
}
