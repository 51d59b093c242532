// decode/rms_norm.cuh: every CTA normalises the residual stream [H] into its own
// shared memory (no grid barrier, no global write): xs[i] = v[i] / rms * w[i]
// with rms = sqrt(mean(v^2) + eps). Fixed-order block reduction, so all CTAs
// compute identical bits. Used for input_layernorm, post_attention_layernorm
// and the final norm (final_norm).
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
template <int RB, class Src, class W>
__device__ __forceinline__ void rms_norm(Src src, W w, float eps, float* xs, float* red) {
    constexpr int PER = (QMK_HIDDEN + QMK_THREADS - 1) / QMK_THREADS;  // elements per thread
    const int t = (int)threadIdx.x;
    float ss = 0.0f;
    if constexpr (RB == 1) {
        for (int i = t; i < QMK_HIDDEN; i += QMK_THREADS) {
            const float v = src(i);
            xs[i] = v;
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
                    xs[i] = v[j];
                    ss = fmaf(v[j], v[j], ss);
                }
            }
        }
    }
    const float total = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(total / (float)QMK_HIDDEN + eps);
    if constexpr (RB == 1) {
        for (int i = t; i < QMK_HIDDEN; i += QMK_THREADS) xs[i] = xs[i] * inv * w(i);
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
                if (j0 + j < PER && i < QMK_HIDDEN) xs[i] = xs[i] * inv * wv[j];
            }
        }
    }
    __syncthreads();
}

}  // namespace qmk
