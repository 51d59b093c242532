// attention.cuh: grouped-query attention of one position over cached
// positions 0..=pos (phase 2 of a layer).
//
// Two paths (NOTES.md, v1.3):
//
// attention_split (default from kAttnSplitMinContext cached positions on;
// kFlagAttnForceSplit: always): flash-decoding. Work item = (kv head g,
// sequence block s); the item computes all GROUP query heads of g, so each
// K/V row is read from memory once per step, not GROUP times. The number of
// blocks S follows pos at run time (attn_splits). Inside an item, a lane
// group of LP = D/8 lanes owns one position at a time (one 16-byte K and V
// load per lane), PPW = 32/LP positions per warp, two positions per lane
// group in flight; online softmax in log2 units per (lane group, head), then
// merged across lane groups (xor shuffles), across warps (shared memory),
// all in fixed order. S == 1: the item writes attn. S > 1: it writes its
// partial (m, l, acc[D]) per head to p.attn_part; the last of the S items of
// g to finish (a ticket counter per (layer, g), zeroed by CTA 0 at kernel
// start) combines the S partials in order s = 0..S-1: bit-identical run to
// run whichever CTA combines.
//
// attention (short contexts, or kFlagAttnNoSplit: the v1 path): one CTA per head (heads
// strided over the grid). Inside, warp w takes positions w, w + WARPS, ...
// with an online softmax (running max m, sum l, accumulator acc[D]); the
// warps' partials are merged in fixed order. Lane j holds dims
// [j*DPL, (j+1)*DPL) of the head.
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

// ---- split path ----------------------------------------------------------

constexpr u32 kAttnGroup = QMK_HEADS / QMK_KV_HEADS;
// Blocks of fewer positions than this are not split further (below it the
// ticket + combine would cost more than the parallelism gains).
constexpr u32 kAttnSplitMinPositions = 128u;
// Ticket words [L, KV heads], padded to 16 bytes.
constexpr u32 kAttnTicketWords = (QMK_LAYERS * QMK_KV_HEADS + 3u) / 4u * 4u;

// Most blocks per kv head: one item per CTA, capped (scratch and the
// combine's shared memory are sized for kAttnMaxSplits). The host's
// MemoryPlan uses the same formula (qmk_kernels::host::attn_max_splits).
__device__ __forceinline__ u32 attn_split_max() {
    const u32 s = gridDim.x / QMK_KV_HEADS;
    return s < 1u ? 1u : (s > kAttnMaxSplits ? kAttnMaxSplits : s);
}

// Blocks per kv head for n = pos + 1 cached positions.
__device__ __forceinline__ u32 attn_splits(u32 pos) {
    const u32 s = (pos + 1u) / kAttnSplitMinPositions, m = attn_split_max();
    return s < 1u ? 1u : (s > m ? m : s);
}

// CTA 0 at kernel start; the grid barrier after layer 0's qkv orders it
// before every ticket of this step.
__device__ __forceinline__ void attention_zero_tickets(const Params& p) {
    u32* t = reinterpret_cast<u32*>(p.attn_part);
    for (u32 i = threadIdx.x; i < kAttnTicketWords; i += QMK_THREADS) t[i] = 0u;
    __threadfence();
}

__device__ __forceinline__ float exp2_guard(float m, float mx) {
    return m == -QMK_INF ? 0.0f : exp2f(m - mx);
}

__device__ __forceinline__ void attention_split(const Params& p, u32 layer, u32 pos, float* smem) {
    constexpr int D = (int)QMK_HEAD_DIM;
    constexpr int G = (int)kAttnGroup;
    constexpr int LP = D / 8;               // lanes per position
    constexpr int PPW = 32 / LP;            // positions per warp at once
    constexpr u32 NG = QMK_WARPS * PPW;     // lane groups per CTA
    static_assert(D % 8 == 0 && LP >= 1 && LP <= 32 && 32 % LP == 0, "head_dim / 8 must divide 32");
    constexpr u32 KMAX = kAttnMaxSplits;
    const u32 n = pos + 1u, S = attn_splits(pos), SM = attn_split_max();
    const u32 B = (n + S - 1u) / S;  // positions per block
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);
    const float* q = reinterpret_cast<const float*>(p.q);
    float* attn = reinterpret_cast<float*>(p.attn);
    u32* tickets = reinterpret_cast<u32*>(p.attn_part);
    float* part_ml = reinterpret_cast<float*>(p.attn_part) + kAttnTicketWords;  // [HEADS, SM, 2]
    float* part_acc = part_ml + (size_t)QMK_HEADS * SM * 2u;                      // [HEADS, SM, D]
    float* qs = smem;                       // [G, D] q * scale * log2(e)
    float* wm = qs + G * D;                 // [WARPS]
    float* wl = wm + QMK_WARPS;             // [WARPS]
    float* wacc = wl + QMK_WARPS;           // [WARPS, D]
    float* fm = wacc + QMK_WARPS * D;       // [G, KMAX] block max, then weight
    float* fl = fm + G * KMAX;              // [G, KMAX] block sum
    float* rden = fl + G * KMAX;            // [G] combined sum
    __shared__ int s_last;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 sub = lane % LP, grp = warp * PPW + lane / LP;
    const float qscale = 1.4426950408889634f / sqrtf((float)D);

    for (u32 item = blockIdx.x; item < QMK_KV_HEADS * S; item += gridDim.x) {
        const u32 g = item / S, s = item % S;
        const u32 b0 = s * B, b1 = min(n, b0 + B);
        for (u32 i = threadIdx.x; i < (u32)(G * D); i += QMK_THREADS)
            qs[i] = q[g * G * D + i] * qscale;
        __syncthreads();
        float m[G], l[G], acc[G][8];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            m[h] = -QMK_INF;
            l[h] = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][j] = 0.0f;
        }
        const koff_t col = (koff_t)(g * D + sub * 8u) * 2u;
        // The loop bound is warp-uniform (the shuffles below need every
        // lane); a lane group past the block end skips its update. The next
        // position's K/V are loaded before the current one is used; K/V of
        // this step's position were written in this launch: L2-coherent
        // loads.
        const u32 lg = lane / LP;
        uint4 kn = make_uint4(0, 0, 0, 0), vn = make_uint4(0, 0, 0, 0);
        if (b0 + warp * PPW + lg < b1) {
            kn = __ldcg(reinterpret_cast<const uint4*>(kl + kv_off(b0 + warp * PPW + lg, 0) + col));
            vn = __ldcg(reinterpret_cast<const uint4*>(vl + kv_off(b0 + warp * PPW + lg, 0) + col));
        }
        for (u32 tb = b0 + warp * PPW; tb < b1; tb += NG) {
            const u32 t = tb + lg, tn = t + NG;
            const bool ok = t < b1;
            const uint4 k0 = kn, v0 = vn;
            if (tn < b1) {
                kn = __ldcg(reinterpret_cast<const uint4*>(kl + kv_off(tn, 0) + col));
                vn = __ldcg(reinterpret_cast<const uint4*>(vl + kv_off(tn, 0) + col));
            }
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float4* qq = reinterpret_cast<const float4*>(qs + h * D + sub * 8u);
                float s0 = dot8(k0, qq[0], qq[1], 0.0f);
#pragma unroll
                for (int o = LP / 2; o > 0; o >>= 1) s0 += __shfl_xor_sync(QMK_FULL_MASK, s0, o);
                if (ok) {
                    // s0 is finite, so mx is: no inf - inf below.
                    const float mx = fmaxf(m[h], s0);
                    const float c = exp2f(m[h] - mx), e = exp2f(s0 - mx);
                    l[h] = fmaf(l[h], c, e);
                    acc[h][0] = fmaf(acc[h][0], c, e * bf16_lo(v0.x));
                    acc[h][1] = fmaf(acc[h][1], c, e * bf16_hi(v0.x));
                    acc[h][2] = fmaf(acc[h][2], c, e * bf16_lo(v0.y));
                    acc[h][3] = fmaf(acc[h][3], c, e * bf16_hi(v0.y));
                    acc[h][4] = fmaf(acc[h][4], c, e * bf16_lo(v0.z));
                    acc[h][5] = fmaf(acc[h][5], c, e * bf16_hi(v0.z));
                    acc[h][6] = fmaf(acc[h][6], c, e * bf16_lo(v0.w));
                    acc[h][7] = fmaf(acc[h][7], c, e * bf16_hi(v0.w));
                    m[h] = mx;
                }
            }
        }
        // Merge the PPW lane groups of the warp (xor tree, fixed order).
#pragma unroll
        for (int o = LP; o < 32; o <<= 1) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float m2 = __shfl_xor_sync(QMK_FULL_MASK, m[h], o);
                const float l2 = __shfl_xor_sync(QMK_FULL_MASK, l[h], o);
                const float mx = fmaxf(m[h], m2);
                const float ca = exp2_guard(m[h], mx), cb = exp2_guard(m2, mx);
                l[h] = l[h] * ca + l2 * cb;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float a2 = __shfl_xor_sync(QMK_FULL_MASK, acc[h][j], o);
                    acc[h][j] = acc[h][j] * ca + a2 * cb;
                }
                m[h] = mx;
            }
        }
        // Merge the warps, one head at a time, in warp order.
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (lane == 0) {
                wm[warp] = m[h];
                wl[warp] = l[h];
            }
            if (lane < (u32)LP) {
#pragma unroll
                for (int j = 0; j < 8; ++j) wacc[warp * D + sub * 8u + j] = acc[h][j];
            }
            __syncthreads();
            if (threadIdx.x < (u32)D) {
                float M = -QMK_INF;
                for (int w = 0; w < QMK_WARPS; ++w)
                    if (wl[w] > 0.0f) M = fmaxf(M, wm[w]);
                float num = 0.0f, den = 0.0f;
                for (int w = 0; w < QMK_WARPS; ++w) {
                    if (wl[w] > 0.0f) {
                        const float e = exp2f(wm[w] - M);
                        den = fmaf(wl[w], e, den);
                        num = fmaf(wacc[w * D + threadIdx.x], e, num);
                    }
                }
                const u32 hd = g * G + h;
                if (S == 1u) {
                    attn[hd * D + threadIdx.x] = num / den;
                } else {
                    part_acc[((size_t)hd * SM + s) * D + threadIdx.x] = num;
                    if (threadIdx.x == 0) {
                        part_ml[((size_t)hd * SM + s) * 2u] = M;
                        part_ml[((size_t)hd * SM + s) * 2u + 1u] = den;
                    }
                }
            }
            __syncthreads();
        }
        if (S == 1u) continue;
        // The last of g's S items combines (classic threadfence reduction:
        // writers fence, one ticket per item, the last one fences again).
        if (threadIdx.x < (u32)D) __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 old = atomicAdd(&tickets[layer * QMK_KV_HEADS + g], 1u);
            s_last = old == S - 1u;
            if (s_last) __threadfence();
        }
        __syncthreads();
        if (!s_last) continue;
        __threadfence();
        for (u32 i = threadIdx.x; i < (u32)G * S; i += QMK_THREADS) {
            const u32 h = i / S, b = i % S;
            const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml + ((size_t)(g * G + h) * SM + b) * 2u));
            fm[h * KMAX + b] = ml.x;
            fl[h * KMAX + b] = ml.y;
        }
        __syncthreads();
        if (warp < (u32)G) {
            // Warp h: max over blocks, weights, combined sum (xor trees).
            const u32 h = warp;
            float M = -QMK_INF;
            for (u32 b = lane; b < S; b += 32u)
                if (fl[h * KMAX + b] > 0.0f) M = fmaxf(M, fm[h * KMAX + b]);
            M = warp_max(M);
            __syncwarp();
            float den = 0.0f;
            for (u32 b = lane; b < S; b += 32u) {
                const float lb = fl[h * KMAX + b];
                const float w = lb > 0.0f ? exp2f(fm[h * KMAX + b] - M) : 0.0f;
                fm[h * KMAX + b] = w;
                den = fmaf(lb, w, den);
            }
            den = warp_sum(den);
            if (lane == 0) rden[h] = den;
        }
        __syncthreads();
        for (u32 i = threadIdx.x; i < (u32)(G * D); i += QMK_THREADS) {
            const u32 h = i / D, d = i % D, hd = g * G + h;
            const float* pa = part_acc + (size_t)hd * SM * D + d;
            float num = 0.0f;
#pragma unroll 16
            for (u32 b = 0; b < S; ++b) num = fmaf(__ldcg(pa + (size_t)b * D), fm[h * KMAX + b], num);
            attn[hd * D + d] = num / rden[h];
        }
        __syncthreads();
    }
}

}  // namespace qmk
