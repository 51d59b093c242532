// attention.cuh: grouped-query attention of one position over cached
// positions 0..=pos (phase 2 of a layer).
//
// One CTA per head (heads strided over the grid). Inside, warp w takes
// positions w, w + WARPS, ... with an online softmax (running max m, sum l,
// accumulator acc[D]); the warps' partials are merged in fixed order. The
// same (m, l, acc) merge is what a later split of the sequence across CTAs
// will use. Lane j holds dims [j*DPL, (j+1)*DPL) of the head.
#pragma once

namespace qmk {

template <int N>
__device__ __forceinline__ void load_bf16_n(const char* p, float (&out)[N]) {
    if constexpr (N == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        out[0] = bf16_lo(v.x); out[1] = bf16_hi(v.x);
        out[2] = bf16_lo(v.y); out[3] = bf16_hi(v.y);
    } else if constexpr (N == 2) {
        const u32 v = *reinterpret_cast<const u32*>(p);
        out[0] = bf16_lo(v); out[1] = bf16_hi(v);
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = ld_bf16(p + 2 * j);
    }
}

__device__ __forceinline__ void attention(const Params& p, u32 layer, u32 pos, float* smem) {
    constexpr int D = (int)QMK_HEAD_DIM;
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    constexpr int DPL = D / 32;
    constexpr u32 GROUP = QMK_HEADS / QMK_KV_HEADS;
    static_assert(QMK_HEADS % QMK_KV_HEADS == 0, "heads must divide into kv groups");
    const float scale = 1.0f / sqrtf((float)D);
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);
    const float* q = reinterpret_cast<const float*>(p.q);
    float* attn = reinterpret_cast<float*>(p.attn);
    float* wm = smem;                   // [WARPS] running max per warp
    float* wl = smem + QMK_WARPS;       // [WARPS] running sum per warp
    float* wacc = smem + 2 * QMK_WARPS; // [WARPS, D] accumulators
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (u32 h = blockIdx.x; h < QMK_HEADS; h += gridDim.x) {
        const u32 g = h / GROUP;
        const u32 col = g * D + lane * DPL;
        float qv[DPL], acc[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) {
            qv[j] = q[h * D + lane * DPL + j] * scale;
            acc[j] = 0.0f;
        }
        float m = -QMK_INF, l = 0.0f;
        // Positions in groups of U per warp: all U K/V loads are issued
        // before the first use (latency, not bandwidth, bounds this phase at
        // short context). The online-softmax updates still run in position
        // order, so the result is bit-identical to one position at a time.
        constexpr int U = 4;
        for (u32 t0 = warp; t0 <= pos; t0 += U * QMK_WARPS) {
            float kv[U][DPL], vv[U][DPL], s[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 t = t0 + u * QMK_WARPS;
                if (t <= pos) {
                    load_bf16_n<DPL>(kl + kv_off(t, col), kv[u]);
                    load_bf16_n<DPL>(vl + kv_off(t, col), vv[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u] = 0.0f;
                if (t0 + u * QMK_WARPS <= pos) {
#pragma unroll
                    for (int j = 0; j < DPL; ++j) s[u] = fmaf(qv[j], kv[u][j], s[u]);
                }
                s[u] = warp_sum(s[u]);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (t0 + u * QMK_WARPS > pos) break;
                const float m_new = fmaxf(m, s[u]);
                const float c = expf(m - m_new);
                const float e = expf(s[u] - m_new);
                l = l * c + e;
#pragma unroll
                for (int j = 0; j < DPL; ++j) acc[j] = fmaf(acc[j], c, e * vv[u][j]);
                m = m_new;
            }
        }
        if (lane == 0) {
            wm[warp] = m;
            wl[warp] = l;
        }
#pragma unroll
        for (int j = 0; j < DPL; ++j) wacc[warp * D + lane * DPL + j] = acc[j];
        __syncthreads();
        if (threadIdx.x < D) {
            float M = -QMK_INF;
            for (int w = 0; w < QMK_WARPS; ++w)
                if (wl[w] > 0.0f) M = fmaxf(M, wm[w]);
            float num = 0.0f, den = 0.0f;
            for (int w = 0; w < QMK_WARPS; ++w) {
                if (wl[w] > 0.0f) {
                    const float e = expf(wm[w] - M);
                    den = fmaf(wl[w], e, den);
                    num = fmaf(wacc[w * D + threadIdx.x], e, num);
                }
            }
            attn[h * D + threadIdx.x] = num / den;
        }
        __syncthreads();
    }
}

}  // namespace qmk
