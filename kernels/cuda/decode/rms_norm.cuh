// decode/rms_norm.cuh: every CTA normalises the residual stream [H] into its own
// shared memory (no grid barrier, no global write): xs[i] = v[i] / rms * w[i]
// with rms = sqrt(mean(v^2) + eps). Fixed-order block reduction, so all CTAs
// compute identical bits. Used for input_layernorm, post_attention_layernorm
// and the final norm (final_norm).
#pragma once

namespace qmk {

// src(i) gives residual element i; w(i) the norm weight.
template <class Src, class W>
__device__ __forceinline__ void rms_norm(Src src, W w, float eps, float* xs, float* red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < QMK_HIDDEN; i += QMK_THREADS) {
        const float v = src(i);
        xs[i] = v;
        ss = fmaf(v, v, ss);
    }
    const float total = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(total / (float)QMK_HIDDEN + eps);
    for (int i = threadIdx.x; i < QMK_HIDDEN; i += QMK_THREADS) xs[i] = xs[i] * inv * w(i);
    __syncthreads();
}

}  // namespace qmk
