// decode/attention.cuh: grouped-query attention of one position over cached
// positions 0..=pos (phase 2 of a layer). Both paths ship: the host's
// default picks by context length.
//
// attention_split (from kAttnSplitMinContext cached positions on;
// kFlagAttnForceSplit: always): flash-decoding. Work item = (kv head g,
// sequence block s); the item computes all GROUP query heads of g, so each
// K/V row is read from memory once per step, not GROUP times. The number of
// blocks S follows pos at run time (attn_splits). Inside an item, warps
// take tiles of 16 positions: scores with two lanes per position, one
// softmax step per tile, P.V with lane = dims (details at the function).
// S == 1: the item writes attn. S > 1: it writes its partial (m, l, acc[D])
// per head to p.attn_part; the last of the S items of g to finish (a ticket
// counter per (layer, g), zeroed by CTA 0 at kernel start) combines the S
// partials in a fixed order: bit-identical run to run whichever CTA
// combines.
//
// attention (below kAttnSplitMinContext, where it is faster: the split's
// tickets and combine cost more than its parallelism gains;
// kFlagAttnNoSplit: always): one CTA per head (heads strided over the
// grid). Inside, warp w takes positions w, w + WARPS, ... with an online
// softmax (running max m, sum l, accumulator acc[D]); the warps' partials
// are merged in fixed order. Lane j holds dims [j*DPL, (j+1)*DPL) of the
// head.
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
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const float* q = reinterpret_cast<const float*>(p.q);        // [Q] f32
    float* attn = reinterpret_cast<float*>(p.attn);              // [Q] f32
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
// Split path tiles: a warp takes kAttnTile positions at a time, two
// lanes per position for the scores (each half of the head's dims).
// Rendered from Rust (header::ATTN_TILE), which sizes the shared memory.
constexpr u32 kAttnTile = (u32)QMK_ATTN_TILE;
static_assert(kAttnTile == 16u, "split attention: the lane map assumes 16-position tiles");
// Its shared memory (floats): q [G, D], then either the per-warp
// probabilities [WARPS, TILE, 8] (streaming) or the warp merge
// [WARPS, G] max + [WARPS, G] sum + [WARPS, G, D] acc (after the stream).
constexpr u32 kAttnSplitMergeFloats = QMK_WARPS * kAttnGroup * (QMK_HEAD_DIM + 2u);
constexpr u32 kAttnSplitSmemFloats =
    kAttnGroup * QMK_HEAD_DIM +
    (kAttnSplitMergeFloats > QMK_WARPS * kAttnTile * 8u ? kAttnSplitMergeFloats : QMK_WARPS * kAttnTile * 8u);

// Most blocks per kv head: one item per CTA, capped (the scratch is sized
// for it). The host's MemoryPlan uses the same formula
// (qmk_kernels::host::attn_max_splits).
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
    u32* t = reinterpret_cast<u32*>(p.attn_part);  // [kAttnTicketWords] u32
    for (u32 i = threadIdx.x; i < kAttnTicketWords; i += QMK_THREADS) t[i] = 0u;
    __threadfence();
}

// One step of a fixed-order online merge of partials (m, l, acc): the same
// inputs in the same order give the same bits in any CTA. An empty partial
// (l == 0) is skipped; after the first non-empty one M is finite, so no
// inf - inf.
__device__ __forceinline__ void attn_merge_step(float& M, float& den, float4& num, float m, float l,
                                                const float4 a) {
    if (l > 0.0f) {
        const float mx = fmaxf(M, m);
        const float c = exp2f(M - mx), e = exp2f(m - mx);
        den = fmaf(den, c, l * e);
        num.x = fmaf(num.x, c, a.x * e);
        num.y = fmaf(num.y, c, a.y * e);
        num.z = fmaf(num.z, c, a.z * e);
        num.w = fmaf(num.w, c, a.w * e);
        M = mx;
    }
}

// Split attention. Work item = (kv head g, sequence block
// s), one per CTA; warp w takes the tiles of kAttnTile positions starting at
// b0 + TILE * (w + WARPS * i). Per tile:
//   scores: lane = (position lane % TILE, half lane / TILE of the dims); the
//     lane's K half-row against all G heads' q (shared memory, broadcast
//     reads), one xor shuffle joins the halves: no shuffle per position;
//   softmax: one warp max per head per tile (m is warp-uniform), per-lane
//     partial sums l, acc rescaled once per tile;
//   P.V: lane = D/32 dims, the tile's positions in order, p[pos][h] from
//     shared memory (broadcast), V rows read by the whole warp (coalesced),
//     acc[G][D/32] in registers.
// K and V of a tile are one stream of 16-byte slots per lane (D/16 K slots,
// then D/16 V slots); a ring of kRing slots keeps the next ones in flight,
// across tiles: 16 warps x 32 lanes x 4 (D = 128) or 8 (D = 64) x 16 B =
// 32 / 64 KB of KV loads outstanding per SM. S == 1: the item
// writes attn; S > 1: its partial (m, l, acc) per head to p.attn_part, and
// the last of g's items (ticket) combines the S partials with the same
// online merge in a fixed grouping and order, so the result is
// bit-identical whichever CTA combines. Loads of K/V use __ldcg (this
// step's row was written in this launch).
__device__ __forceinline__ void attention_split(const Params& p, u32 layer, u32 pos, float* smem) {
    constexpr int D = (int)QMK_HEAD_DIM;
    constexpr int G = (int)kAttnGroup;
    constexpr int TILE = (int)kAttnTile;
    constexpr int HL = 32 / TILE;          // lanes per position in the scores
    constexpr int VPL = D / 32;            // dims per lane in P.V
    constexpr int PS = 16 / (2 * VPL);     // positions per V slot
    constexpr int KS = D / HL / 8;         // K slots per tile
    constexpr int VS = TILE / PS;          // V slots per tile
    constexpr int NSLOT = KS + VS;
    // A whole tile in flight when it has at most 8 slots (D <= 64), else 4:
    // a ring of 8 spills at D = 128 (measured with ptxas, 128 registers).
    constexpr int kRing = NSLOT <= 8 ? NSLOT : 4;
    static_assert(D == 32 || D == 64 || D == 128 || D == 256, "split attention: head_dim 32/64/128/256");
    static_assert(HL == 2 && KS >= 1 && NSLOT % kRing == 0, "split attention: slot layout");
    static_assert(G >= 1 && G <= 8, "split attention: up to 8 query heads per kv head");
    constexpr u32 STRIDE = kAttnTile * QMK_WARPS;  // positions between a warp's tiles
    const u32 n = pos + 1u, S = attn_splits(pos), SM = attn_split_max();
    const u32 B = (n + S - 1u) / S;  // positions per block
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const float* q = reinterpret_cast<const float*>(p.q);        // [Q] f32
    float* attn = reinterpret_cast<float*>(p.attn);              // [Q] f32
    u32* tickets = reinterpret_cast<u32*>(p.attn_part);          // [L, KVH] u32
    // acc first: 16-byte aligned for float4 whatever HEADS * SM is.
    float* part_acc = reinterpret_cast<float*>(p.attn_part) + kAttnTicketWords;  // [HEADS, SM, D]
    float* part_ml = part_acc + (size_t)QMK_HEADS * SM * D;                       // [HEADS, SM, 2]
    float* qs = smem;                        // [G, D] q * scale * log2(e)
    float* pb = qs + G * D;                  // [WARPS, TILE, 8] tile probabilities
    float* wm = qs + G * D;                  // [WARPS, G] (merge, after the stream)
    float* wl = wm + QMK_WARPS * G;          // [WARPS, G]
    float* wacc = wl + QMK_WARPS * G;        // [WARPS, G, D]
    __shared__ int s_last;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 tl = lane % (u32)TILE, half = lane / (u32)TILE;
    const float qscale = 1.4426950408889634f / sqrtf((float)D);
    float* pw = pb + warp * (u32)(TILE * 8);  // [TILE, 8] this warp's probabilities

    for (u32 item = blockIdx.x; item < QMK_KV_HEADS * S; item += gridDim.x) {
        const u32 g = item / S, s = item % S;
        const u32 b0 = s * B, b1 = min(n, b0 + B);
        const koff_t kcol = (koff_t)(g * D + half * (D / HL)) * 2u;  // this lane's K half-row
        const koff_t vcol = (koff_t)(g * D + lane * VPL) * 2u;       // this lane's V dims
        // Slot k of the tile at t0; positions >= b1 read as zeros (never
        // loaded: past the block, possibly never written).
        auto load_slot = [&](u32 t0, int k) -> uint4 {
            uint4 r = make_uint4(0u, 0u, 0u, 0u);
            if (k < KS) {
                const u32 t = t0 + tl;
                if (t < b1) r = __ldcg(reinterpret_cast<const uint4*>(kl + kv_off(t, 0) + kcol + k * 16));
            } else {
                u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int u = 0; u < PS; ++u) {
                    const u32 t = t0 + (u32)((k - KS) * PS + u);
                    if (t < b1) {
                        const char* a = vl + kv_off(t, 0) + vcol;
                        if constexpr (VPL == 8) {
                            const uint4 x = __ldcg(reinterpret_cast<const uint4*>(a));
                            w[0] = x.x; w[1] = x.y; w[2] = x.z; w[3] = x.w;
                        } else if constexpr (VPL == 4) {
                            const uint2 x = __ldcg(reinterpret_cast<const uint2*>(a));
                            w[2 * u] = x.x; w[2 * u + 1] = x.y;
                        } else if constexpr (VPL == 2) {
                            w[u] = __ldcg(reinterpret_cast<const unsigned int*>(a));
                        } else {
                            w[u / 2] |= (u32)__ldcg(reinterpret_cast<const unsigned short*>(a)) << (16 * (u % 2));
                        }
                    }
                }
                r = make_uint4(w[0], w[1], w[2], w[3]);
            }
            return r;
        };
        // The first slots go out before q is staged (independent of it).
        u32 t0 = b0 + warp * (u32)TILE;
        uint4 ring[kRing];
#pragma unroll
        for (int k = 0; k < kRing; ++k) ring[k] = load_slot(t0, k);
        for (u32 i = threadIdx.x; i < (u32)(G * D); i += QMK_THREADS)
            qs[i] = __ldcg(q + g * G * D + i) * qscale;
        __syncthreads();
        float m[G], l[G], acc[G][VPL];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            m[h] = -QMK_INF;
            l[h] = 0.0f;
#pragma unroll
            for (int j = 0; j < VPL; ++j) acc[h][j] = 0.0f;
        }
        // Warp-uniform bound: the shuffles below need every lane.
        for (; t0 < b1; t0 += STRIDE) {
            const u32 tn = t0 + STRIDE;
            float sc[G];
#pragma unroll
            for (int h = 0; h < G; ++h) sc[h] = 0.0f;
#pragma unroll
            for (int k = 0; k < NSLOT; ++k) {
                const uint4 x = ring[k % kRing];
                ring[k % kRing] = k + kRing < NSLOT ? load_slot(t0, k + kRing) : load_slot(tn, k + kRing - NSLOT);
                if (k < KS) {
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        const float4* qq =
                            reinterpret_cast<const float4*>(qs + h * D + half * (u32)(D / HL) + k * 8);
                        sc[h] = dot8(x, qq[0], qq[1], sc[h]);
                    }
                }
                if (k == KS - 1) {
                    // Tile softmax. t0 < b1: position t0 (lanes 0 and
                    // TILE) is valid, so every tile max is finite.
                    const bool ok = t0 + tl < b1;
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        // a + b == b + a: both halves get the same bits.
                        float sv = sc[h] + __shfl_xor_sync(QMK_FULL_MASK, sc[h], TILE);
                        sv = ok ? sv : -QMK_INF;
                        float mx = sv;
#pragma unroll
                        for (int o = TILE / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(QMK_FULL_MASK, mx, o));
                        mx = fmaxf(m[h], mx);
                        const float c = exp2f(m[h] - mx), e = exp2f(sv - mx);
                        l[h] = fmaf(l[h], c, half == 0u ? e : 0.0f);
#pragma unroll
                        for (int j = 0; j < VPL; ++j) acc[h][j] *= c;
                        m[h] = mx;
                        if (half == 0u) pw[tl * 8u + h] = e;
                    }
                    __syncwarp();
                }
                if (k >= KS) {
                    const u32 xw[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                    for (int u = 0; u < PS; ++u) {
                        const int tt = (k - KS) * PS + u;
                        float pv[8];
                        const float4 p0 = *reinterpret_cast<const float4*>(pw + tt * 8);
                        pv[0] = p0.x; pv[1] = p0.y; pv[2] = p0.z; pv[3] = p0.w;
                        if constexpr (G > 4) {
                            const float4 p1 = *reinterpret_cast<const float4*>(pw + tt * 8 + 4);
                            pv[4] = p1.x; pv[5] = p1.y; pv[6] = p1.z; pv[7] = p1.w;
                        }
                        float v[VPL];
#pragma unroll
                        for (int j = 0; j < VPL; ++j) {
                            const int e = u * VPL + j;  // bf16 index in the slot
                            v[j] = (e & 1) ? bf16_hi(xw[e / 2]) : bf16_lo(xw[e / 2]);
                        }
#pragma unroll
                        for (int h = 0; h < G; ++h)
#pragma unroll
                            for (int j = 0; j < VPL; ++j) acc[h][j] = fmaf(pv[h], v[j], acc[h][j]);
                    }
                }
            }
            // The next tile's probabilities overwrite pw.
            __syncwarp();
        }
#pragma unroll
        for (int h = 0; h < G; ++h) l[h] = warp_sum(l[h]);
        // pb and the merge buffers overlap: every warp is done with pb.
        __syncthreads();
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (lane == 0) {
                wm[warp * G + h] = m[h];
                wl[warp * G + h] = l[h];
            }
#pragma unroll
            for (int j = 0; j < VPL; ++j) wacc[(warp * G + h) * D + lane * VPL + j] = acc[h][j];
        }
        __syncthreads();
        // Merge the warps, in warp order; thread = (head, 4 dims).
        if (threadIdx.x < (u32)(G * D / 4)) {
            const u32 h = threadIdx.x / (D / 4), d = threadIdx.x % (D / 4) * 4u, hd = g * G + h;
            float M = -QMK_INF, den = 0.0f;
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int w = 0; w < QMK_WARPS; ++w)
                attn_merge_step(M, den, num, wm[w * G + h], wl[w * G + h],
                                *reinterpret_cast<const float4*>(wacc + (w * G + h) * D + d));
            if (S == 1u) {
                *reinterpret_cast<float4*>(attn + hd * D + d) =
                    make_float4(num.x / den, num.y / den, num.z / den, num.w / den);
            } else {
                *reinterpret_cast<float4*>(part_acc + ((size_t)hd * SM + s) * D + d) = num;
                if (d == 0u) *reinterpret_cast<float2*>(part_ml + ((size_t)hd * SM + s) * 2u) = make_float2(M, den);
            }
        }
        if (S == 1u) {
            __syncthreads();  // qs / wacc are rewritten by the next item
            continue;
        }
        // The last of g's S items combines (classic threadfence reduction:
        // writers fence, one ticket per item, the last one fences again).
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            const u32 old = atomicAdd(&tickets[layer * QMK_KV_HEADS + g], 1u);
            s_last = old == S - 1u;
        }
        __syncthreads();
        if (!s_last) continue;
        __threadfence();
        // Thread = (quad of 4 dims of a head, block group): group sg merges
        // blocks sg, sg + SG, ... (SG chains in flight instead of one S long),
        // then thread sg = 0 merges the SG results in order. Fixed
        // assignment and order: the same bits whichever CTA combines.
        constexpr u32 NQ = (u32)(G * D / 4);
        constexpr u32 SG0 = QMK_THREADS / NQ, SG = SG0 < 1u ? 1u : (SG0 > 8u ? 8u : SG0);
        static_assert(NQ <= QMK_THREADS && SG * NQ * 6u <= kAttnSplitMergeFloats, "split attention: combine layout");
        float* cm = wm;  // [SG, NQ, 6]: num[4], M, den (the warp merge is done)
        if (threadIdx.x < NQ * SG) {
            const u32 qd = threadIdx.x % NQ, sg = threadIdx.x / NQ;
            const u32 h = qd / (D / 4), d = qd % (D / 4) * 4u, hd = g * G + h;
            const float* pa = part_acc + (size_t)hd * SM * D + d;  // [SM, D] f32, from dim d
            const float* pm = part_ml + (size_t)hd * SM * 2u;      // [SM, 2] f32
            float M = -QMK_INF, den = 0.0f;
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            // Unrolled: the loads of 8 blocks are in flight together.
#pragma unroll 8
            for (u32 b = sg; b < S; b += SG) {
                const float2 ml = __ldcg(reinterpret_cast<const float2*>(pm + b * 2u));
                attn_merge_step(M, den, num, ml.x, ml.y, __ldcg(reinterpret_cast<const float4*>(pa + (size_t)b * D)));
            }
            float* c = cm + (sg * NQ + qd) * 6u;
            c[0] = num.x; c[1] = num.y; c[2] = num.z; c[3] = num.w;
            c[4] = M; c[5] = den;
        }
        __syncthreads();
        if (threadIdx.x < NQ) {
            const u32 qd = threadIdx.x, h = qd / (D / 4), d = qd % (D / 4) * 4u, hd = g * G + h;
            float M = -QMK_INF, den = 0.0f;
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (u32 sg = 0; sg < SG; ++sg) {
                const float* c = cm + (sg * NQ + qd) * 6u;
                attn_merge_step(M, den, num, c[4], c[5], make_float4(c[0], c[1], c[2], c[3]));
            }
            *reinterpret_cast<float4*>(attn + hd * D + d) =
                make_float4(num.x / den, num.y / den, num.z / den, num.w / den);
        }
        __syncthreads();
    }
}

}  // namespace qmk
