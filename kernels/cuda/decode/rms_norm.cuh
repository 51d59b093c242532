// decode/rms_norm.cuh: every CTA normalises the residual stream [H] into its own
// shared memory (no grid barrier, no global write): xs[i] = v[i] / rms * w[i]
// with rms = sqrt(mean(v^2) + eps), stored in xs_slot order. Fixed-order
// block reduction, so all CTAs compute identical bits. Used for
// input_layernorm, post_attention_layernorm and the final norm (final_norm).
#pragma once

namespace qmk {

// The decode step's RMSNorm load batch (rms_norm's RB).
constexpr int kDecodeNormBatch = 4;

// src(i) gives residual element i; w(i) the norm weight. The stores to xs
// may alias the loads as far as the compiler knows, so each loop loads a
// batch of RB elements before it stores any: PER / RB memory round trips
// per loop instead of PER, with RB registers held. The decode step sits
// behind these round trips after every barrier, so it takes 4. RB = 1 is
// the plain loop: the prefill kernel, whose GEMMs run at the register cap,
// runs its one final norm per chunk that way, which leaves its register
// allocation as it was. Every RB sums in the same order.
//
// STAGED_W: w reads shared memory that stage_norm_weight filled; every
// thread waits for its copies (all its cp.async groups but the newest, the
// weight stage's) before the reduction's barrier makes them visible.
//
// SPLIT: xs's order (xs_slot); the multi-token step always splits.
template <int RB, bool STAGED_W = false, bool SPLIT = kXsSplit, class Src, class W>
__device__ __forceinline__ void rms_norm(Src src, W w, float eps, float* xs, float* red) {
    constexpr int PER = (QMK_HIDDEN + QMK_THREADS - 1) / QMK_THREADS;  // elements per thread
    const int t = (int)threadIdx.x;
    float ss = 0.0f;
    if constexpr (RB == 1) {
        for (int i = t; i < QMK_HIDDEN; i += QMK_THREADS) {
            const float v = src(i);
            xs[xs_slot<(int)QMK_HIDDEN, SPLIT>(i)] = v;
            ss = fmaf(v, v, ss);
        }
    } else {
#pragma unroll
        for (int j0 = 0; j0 < PER; j0 += RB) {
            float v[RB];
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int i = t + (j0 + j) * QMK_THREADS;
                if (j0 + j < PER && i < QMK_HIDDEN) v[j] = src(i);
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int i = t + (j0 + j) * QMK_THREADS;
                if (j0 + j < PER && i < QMK_HIDDEN) {
                    xs[xs_slot<(int)QMK_HIDDEN, SPLIT>(i)] = v[j];
                    ss = fmaf(v[j], v[j], ss);
                }
            }
        }
    }
    if constexpr (STAGED_W) cp_async_wait<1>();
    const float total = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(total / (float)QMK_HIDDEN + eps);
    if constexpr (RB == 1) {
        for (int i = t; i < QMK_HIDDEN; i += QMK_THREADS) {
            const auto k = xs_slot<(int)QMK_HIDDEN, SPLIT>(i);
            xs[k] = xs[k] * inv * w(i);
        }
    } else {
#pragma unroll
        for (int j0 = 0; j0 < PER; j0 += RB) {
            float wv[RB];
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int i = t + (j0 + j) * QMK_THREADS;
                if (j0 + j < PER && i < QMK_HIDDEN) wv[j] = w(i);
            }
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                const int i = t + (j0 + j) * QMK_THREADS;
                if (j0 + j < PER && i < QMK_HIDDEN) {
                    const auto k = xs_slot<(int)QMK_HIDDEN, SPLIT>(i);
                    xs[k] = xs[k] * inv * wv[j];
                }
            }
        }
    }
    __syncthreads();
}

// Floats of shared memory in front of a normed phase's weight stage: the
// normed vector [H] f32 (128-byte rounded), then the norm weight [H] bf16.
constexpr u32 kNormedFront = stage_offset(QMK_HIDDEN) + QMK_HIDDEN / 2;

// Copies a norm weight [H] bf16 (16-byte aligned) into shared memory with
// cp.async, one commit group: its L2 round trip then runs beside the
// residual's instead of after the reduction.
__device__ __forceinline__ void stage_norm_weight(const char* w, float* dst) {
    static_assert(QMK_HIDDEN % 8 == 0, "the norm weight goes in 16-byte vectors");
    const u32 d = smem_u32(dst);
    for (u32 i = threadIdx.x; i < QMK_HIDDEN / 8; i += QMK_THREADS) cp_async16(d + i * 16, w + i * 16, 16);
    cp_async_commit();
}

// Element i of a norm weight staged by stage_norm_weight.
__device__ __forceinline__ float staged_norm_elem(const float* src, u32 i) {
    return bf16_bits_to_f32(reinterpret_cast<const u16*>(src)[i]);
}

// Whether a normed phase of NR-row units [H] stages its first rows.
template <int NR>
constexpr bool normed_stages() {
    return stages_after<(int)QMK_HIDDEN, NR>(kNormedFront);
}

// The prologue of a normed weight phase (q/k/v, gate/up): where it stages
// (STAGE = normed_stages<NR>()), the norm weight `ln` and this warp's first
// unit of rows_of go out first, then xs = RMSNorm(src) with `ln`. Returns
// the stage for weight_phase: [WARPS, NR, U, 32] 16-byte vectors.
template <int NR, bool STAGE, class Src, class Norm, class RowsOf>
__device__ __forceinline__ float* normed_prologue(Src src, const Norm& ln, u32 units, RowsOf rows_of,
                                                  float eps, float* xs, float* red) {
    float* gs = xs + stage_offset(QMK_HIDDEN);    // [H] bf16 norm weight
    float* ws = xs + stage_offset(kNormedFront);  // [WARPS, NR, U, 32] 16-byte vectors
    if constexpr (STAGE) {
        stage_norm_weight(ln.at(0), gs);
        stage_first_unit<(int)QMK_HIDDEN, NR>(units, rows_of, ws);
    }
    rms_norm<kDecodeNormBatch, STAGE>(
        src, [&](u32 i) { return STAGE ? staged_norm_elem(gs, i) : ln.elem(i); }, eps, xs, red);
    return ws;
}

}  // namespace qmk
