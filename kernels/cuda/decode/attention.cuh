// decode/attention.cuh: grouped-query attention of one position over cached
// positions 0..=pos (phase 2 of a layer). Both paths ship: the host's
// default picks by context length.
//
// attention_split (from kAttnSplitMinContext cached positions on;
// kFlagAttnForceSplit: always): flash-decoding. Work item = (kv head g,
// sequence block s); the item computes all GROUP query heads of g, so each
// K/V row is read from memory once per step, not GROUP times. The number of
// blocks S follows pos at run time (attn_splits). Inside an item, warps
// take tiles of 16 positions on tensor cores: the scores and P.V as bf16
// mma.sync with q and P split into hi + lo halves, one softmax step per
// tile, K/V streamed ahead by bulk tensor copies into per-warp stages
// (sm_90 on; before it, a per-lane cp.async ring; details at the function).
// S == 1: the item writes attn. S > 1: it writes its partial (m, l, acc[D])
// per head to p.attn_part and adds 1 to g's ticket (a counter per (layer,
// g), zeroed by CTA 0 at kernel start); then every CTA combines its share
// of attn's dims once the tickets of their kv heads reach S, in a fixed
// order: bit-identical run to run whichever CTA combines what.
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

// Where an attention phase reads and writes: tokens t = t0 .. t1 - 1 at
// positions pos0 + t, token t's rotated q at q + t Q and its output at
// attn + t Q ([Q] f32 each), its split-attention scratch (tickets, then
// partials) at part + t part_words. The one-token step has t0 = 0, t1 = 1.
struct AttnIo {
    const float* q;
    float* attn;
    u32* part;
    u64 part_words;
    u32 pos0, t0, t1;
};

// The one-token step's AttnIo.
__device__ __forceinline__ AttnIo attn_io(const Params& p, u32 pos) {
    return AttnIo{reinterpret_cast<const float*>(p.q), reinterpret_cast<float*>(p.attn),
                  reinterpret_cast<u32*>(p.attn_part), 0ull, pos, 0u, 1u};
}

// MULTI: items are (token, head) over io's tokens; else one token (t = 0).
template <bool MULTI = false>
__device__ __forceinline__ void attention(const Params& p, u32 layer, const AttnIo& io, float* smem) {
    constexpr int D = (int)QMK_HEAD_DIM;
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    constexpr int DPL = D / 32;
    constexpr u32 GROUP = QMK_HEADS / QMK_KV_HEADS;
    static_assert(QMK_HEADS % QMK_KV_HEADS == 0, "heads must divide into kv groups");
    const float scale = 1.0f / sqrtf((float)D);
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    float* wm = smem;                   // [WARPS] running max per warp
    float* wl = smem + QMK_WARPS;       // [WARPS] running sum per warp
    float* wacc = smem + 2 * QMK_WARPS; // [WARPS, D] accumulators
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 items = MULTI ? (io.t1 - io.t0) * QMK_HEADS : QMK_HEADS;

    for (u32 it = blockIdx.x; it < items; it += gridDim.x) {
        const u32 t = MULTI ? io.t0 + it / QMK_HEADS : 0u, h = MULTI ? it % QMK_HEADS : it;
        const u32 pos = io.pos0 + t;
        const float* q = io.q + (size_t)t * QMK_Q_DIM;  // [Q] f32
        float* attn = io.attn + (size_t)t * QMK_Q_DIM;  // [Q] f32
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
// Split path tiles: a warp takes kAttnTile positions at a time.
// Rendered from Rust (header::ATTN_TILE), which sizes the shared memory.
constexpr u32 kAttnTile = (u32)QMK_ATTN_TILE;
static_assert(kAttnTile == 16u, "split attention: the fragment map assumes 16-position tiles");
// 16-byte K/V slots in flight per lane: a ring in shared memory that
// cp.async fills, so the loads ahead hold no registers. Its depth follows
// the arch's shared memory (qmk_kernels::attn_ring, an NVRTC option).
constexpr u32 kAttnRing = (u32)QMK_ATTN_RING;
// Most bulk-copy stages per warp (their mbarriers are static shared memory).
constexpr u32 kAttnStagesMax = 8u;
// Its shared memory (floats): q [G, D], then either the K/V ring
// [WARPS, RING, 32] of 16 bytes (streaming) or the warp merge [WARPS, G]
// max + [WARPS, G] sum + [WARPS, G, D] acc (after the stream).
constexpr u32 kAttnSplitMergeFloats = QMK_WARPS * kAttnGroup * (QMK_HEAD_DIM + 2u);
constexpr u32 kAttnSplitStreamFloats = QMK_WARPS * kAttnRing * 32u * 4u;
constexpr u32 kAttnSplitSmemFloats =
    kAttnGroup * QMK_HEAD_DIM +
    (kAttnSplitMergeFloats > kAttnSplitStreamFloats ? kAttnSplitMergeFloats : kAttnSplitStreamFloats);

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

// The combine of one token's split attention (S > 1 blocks of SM), shared
// by every CTA once it has written its items' partials; smem from the
// split's q stage on. Returns false when the wait gave up.
__device__ __forceinline__ bool attention_combine(const Params& p, u32 layer, u32 S, u32 SM, const u32* tickets,
                                                  const float* part_acc, const float* part_ml, float* attn,
                                                  float* qs) {
    constexpr int D = (int)QMK_HEAD_DIM;
    constexpr int G = (int)kAttnGroup;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // The combine, shared by every CTA: unit u = (head u / (D / 4), dims
    // 4 (u % (D / 4)) .. + 3), CTA c takes units [c U / grid, (c + 1) U /
    // grid) and its warp w every WARPS-th of them from w. Thread 0 first
    // waits (bounded) until the tickets of the units' kv heads reach S. Per
    // unit, the warp stages the S partials in shared memory, lane sg < SG
    // merges blocks sg, sg + SG, ... in order and lane 0 merges the SG
    // results in order: the same grouping and order for every unit whichever
    // CTA takes it, so the bits do not depend on the grid's timing.
    constexpr u32 NQ = (u32)(G * D / 4);  // units per kv head
    constexpr u32 SG0 = QMK_THREADS / NQ, SG = SG0 < 1u ? 1u : (SG0 > 8u ? 8u : SG0);
    constexpr u32 U = QMK_HEADS * (u32)(D / 4);
    static_assert(SG <= 32u && kAttnMaxSplits <= 64u, "split attention: a warp stages 64 blocks");
    static_assert(G * D + QMK_WARPS * kAttnMaxSplits * 6u <= QMK_SMEM_FLOATS, "split attention: combine stage");
    const u32 u0 = (u32)((u64)blockIdx.x * U / gridDim.x), u1 = (u32)((u64)(blockIdx.x + 1u) * U / gridDim.x);
    if (u0 < u1) {
        __shared__ int s_ok;
        if (threadIdx.x == 0) {
            int ok = 1;
            for (u32 g = u0 / NQ; ok && g <= (u1 - 1u) / NQ; ++g) {
                const u32* t = tickets + layer * QMK_KV_HEADS + g;
                ok = bounded_wait(p, [&] { return ld_acquire_u32(t) >= S; }, kErrCounterTimeout, kPhaseAttention,
                                  layer);
            }
            s_ok = ok;
        }
        __syncthreads();
        if (!s_ok) return false;
        float* stage = qs + G * D + warp * kAttnMaxSplits * 6u;  // [SM, 6]: acc[4], m, l
        for (u32 u = u0 + warp; u < u1; u += QMK_WARPS) {
            const u32 hd = u / (u32)(D / 4), d = u % (u32)(D / 4) * 4u;
            const float* pa = part_acc + (size_t)hd * SM * D + d;  // [SM, D] f32, from dim d
            const float* pm = part_ml + (size_t)hd * SM * 2u;      // [SM, 2] f32
#pragma unroll
            for (u32 i = 0; i < 2u; ++i) {
                const u32 b = lane + 32u * i;
                if (b < S) {
                    const float4 a = __ldcg(reinterpret_cast<const float4*>(pa + (size_t)b * D));
                    const float2 ml = __ldcg(reinterpret_cast<const float2*>(pm + b * 2u));
                    float* st = stage + b * 6u;
                    st[0] = a.x; st[1] = a.y; st[2] = a.z; st[3] = a.w;
                    st[4] = ml.x; st[5] = ml.y;
                }
            }
            __syncwarp();
            float M = -QMK_INF, den = 0.0f;
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (lane < SG) {
                for (u32 b = lane; b < S; b += SG) {
                    const float* st = stage + b * 6u;
                    attn_merge_step(M, den, num, st[4], st[5], make_float4(st[0], st[1], st[2], st[3]));
                }
            }
            float fM = -QMK_INF, fden = 0.0f;
            float4 fnum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (u32 sg = 0; sg < SG; ++sg) {
                const float m = __shfl_sync(QMK_FULL_MASK, M, sg), l = __shfl_sync(QMK_FULL_MASK, den, sg);
                const float4 a = make_float4(__shfl_sync(QMK_FULL_MASK, num.x, sg), __shfl_sync(QMK_FULL_MASK, num.y, sg),
                                             __shfl_sync(QMK_FULL_MASK, num.z, sg), __shfl_sync(QMK_FULL_MASK, num.w, sg));
                attn_merge_step(fM, fden, fnum, m, l, a);
            }
            if (lane == 0)
                *reinterpret_cast<float4*>(attn + hd * D + d) =
                    make_float4(fnum.x / fden, fnum.y / fden, fnum.z / fden, fnum.w / fden);
            __syncwarp();  // the stage is rewritten by the warp's next unit
        }
    }
    return true;
}

// Split attention. Work item = (kv head g, sequence block s), one per CTA;
// warp w takes the tiles of kAttnTile positions starting at
// b0 + TILE * (w + WARPS * i), on tensor cores (bf16 mma.sync m16n8k16,
// f32 accumulation) with the group's G <= 8 query heads as the narrow
// dimension:
//   scores: S^T [16 positions, 8 heads] = K [16 positions, D] q^T, D / 16
//     k-steps; the dims of a k-step are permuted (the same way in K and q)
//     so that a lane's A fragments of two k-steps are one 16-byte piece of
//     a K row;
//   softmax: one step per tile and head in base 2 (a lane holds 2 heads x
//     2 positions; max and sum over the 8 lanes of a column);
//   P.V: O^T [D, 8 heads] += V^T [D, 16 positions] P^T [16 positions, 8
//     heads]; P^T goes from the score accumulators to a B fragment by
//     movmatrix, and V^T's A fragments are byte permutes of 16-byte pieces
//     of 4 V rows (the output dims permuted, undone where O is written).
// q and P enter the products as bf16 pairs hi + lo (hi = bf16(x), lo =
// bf16(x - hi)), two products each, so both keep about 16 bits (f32
// would give 24; one bf16 8): the logits stay within ~1e-6 of the
// one-CTA-per-head path's f32 maths (the long-context tests allow 1e-3).
// K and V of a tile are one stream of 16-byte slots per lane (D / 16 K
// slots, then D / 16 V slots). sm_90 on: lane 0 of each warp copies its
// tiles' K and V boxes [16 positions, D] whole from the caches' tensor
// descriptors (p.kv_maps) into NST stages of shared memory (the bytes of
// the ring below), two or four half-tiles ahead, each completing an
// mbarrier the lanes wait on; a lane reads its slots out of the stage and
// lane 0 refills the stage once the warp has read it. Rows past the block
// are read but their V is zeroed. The copy engine, not the lanes' load
// instructions, moves the bytes: a lab reads the kernel's tiles at 4.1
// TB/s this way against 3.0 with the ring. Before sm_90: each lane copies
// its next kAttnRing slots ahead into its own ring in shared memory with
// cp.async, across tiles, and reads back only what it copied
// (cp.async.wait_group is the whole synchronisation). S == 1: the item writes attn; S > 1: its partial (m, l,
// acc) per head to p.attn_part and a release add to g's ticket; then every
// CTA waits (bounded) for the tickets it needs and combines its share of
// the partials with the same online merge in a fixed grouping and order,
// so the result is bit-identical whichever CTA combines. No CTA waits for
// the last item alone: the combine is spread over the grid. Both kinds of
// copy go through L2 (cp.async.cg, bulk copies): this step's K/V row was
// written in this launch.
// With kFlagTrace, thread 0 marks when q is staged, the stream is done and
// the partial is out, and every CTA when its combine share is done
// (attn_marks; `bench --profile`). Returns false when a wait gave up (the
// error is recorded; the caller leaves the kernel).
// MULTI: the items of every token of io, dealt in one sequence (token t0's
// first), then each token's combine; else one token (t = 0).
template <bool MULTI = false>
__device__ __forceinline__ bool attention_split(const Params& p, u32 layer, const AttnIo& io, float* smem) {
    constexpr int D = (int)QMK_HEAD_DIM;
    constexpr int G = (int)kAttnGroup;
    constexpr int TILE = (int)kAttnTile;
    constexpr int KSTEP = D / 16;          // k-steps of the scores
    constexpr int KSL = D / 16;            // K slots per tile: rows r, r + 8 x D / 32 pieces
    constexpr int VB = D / 64;             // 64-dim blocks of V per lane
    constexpr int VSL = 4 * VB;            // V slots per tile: 4 rows x VB
    constexpr int MT = D / 16;             // 16-dim tiles of O^T
    constexpr int NSLOT = KSL + VSL;
    constexpr int R = (int)kAttnRing;
    static_assert(D == 64 || D == 128, "split attention: head_dim 64 or 128");
    static_assert((R & (R - 1)) == 0 && (R % NSLOT == 0 || NSLOT % R == 0), "split attention: ring of 2^k slots");
    static_assert(G >= 1 && G <= 8, "split attention: up to 8 query heads per kv head");
    constexpr u32 STRIDE = kAttnTile * QMK_WARPS;  // positions between a warp's tiles
    const u32 SM = attn_split_max();
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    // Token t's blocks S, q, output and scratch: tickets [L, KVH] u32, then
    // acc [HEADS, SM, D] f32 (16-byte aligned for float4 whatever HEADS *
    // SM is), then m/l [HEADS, SM, 2] f32.
    struct Tok {
        u32 S;
        const float* q;
        float* attn;
        u32* tickets;
        float* part_acc;
        float* part_ml;
    };
    const auto tok = [&](u32 t) {
        u32* tk = io.part + t * io.part_words;
        float* pa = reinterpret_cast<float*>(tk) + kAttnTicketWords;
        return Tok{attn_splits(io.pos0 + t), io.q + (size_t)t * QMK_Q_DIM, io.attn + (size_t)t * QMK_Q_DIM, tk,
                   pa, pa + (size_t)QMK_HEADS * SM * D};
    };
    float* qs = smem;                        // [G, D] q * scale * log2(e)
    float* wm = qs + G * D;                  // [WARPS, G] (merge, after the stream)
    float* wl = wm + QMK_WARPS * G;          // [WARPS, G]
    float* wacc = wl + QMK_WARPS * G;        // [WARPS, G, D]
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 gr = lane >> 2, gc = lane & 3u;  // fragment row group, column pair
    const float qscale = 1.4426950408889634f / sqrtf((float)D);
    const bool marks = (p.flags & kFlagTrace) && threadIdx.x == 0;  // timeline marks (thread 0)
    // [R] 16-byte slots 32 apart: this lane's ring (lanes side by side, no
    // bank conflicts); it shares its space with the merge buffers.
    uint4* ring = reinterpret_cast<uint4*>(qs + G * D) + warp * (u32)R * 32u + lane;
    // With bulk copies the same bytes are this warp's NST stages of HT
    // bytes, each a tile's K or V [TILE, D] bf16 as in the cache, filled by
    // lane 0 from the caches' descriptors and completed on an mbarrier.
    constexpr u32 HT = (u32)(TILE * D * 2);
    constexpr int NST = (int)((u32)R * 512u / HT);
    static_assert(!kHasBulkCopies || (NST >= 2 && NST <= (int)kAttnStagesMax), "split attention: 2-8 stages");
    static_assert((G * D) % 32 == 0, "split attention: stages 128-byte aligned");
    // The stages in use, not kAttnStagesMax: 512 B of static shared memory
    // at head_dim 128 instead of 1,280 (14B and 32B stay in the 132 KB
    // carveout).
    constexpr int NBAR = kHasBulkCopies ? NST : 1;
    __shared__ __align__(8) u64 s_kv_bar[QMK_WARPS][NBAR];
    // [NST, TILE, D] bf16 (shared-window addresses: 32-bit registers)
    const u32 st0 = smem_u32(qs + G * D) + warp * (u32)R * 512u, bar0 = smem_u32(&s_kv_bar[warp][0]);

    // MULTI: token tc's items are [ibase, ibase + KVH S_tc) of the sequence.
    u32 tc = io.t0, ibase = 0u;
    for (u32 item = blockIdx.x;; item += gridDim.x) {
        if constexpr (MULTI) {
            while (tc < io.t1 && item >= ibase + QMK_KV_HEADS * attn_splits(io.pos0 + tc)) {
                ibase += QMK_KV_HEADS * attn_splits(io.pos0 + tc);
                ++tc;
            }
            if (tc >= io.t1) break;
        } else if (item >= QMK_KV_HEADS * attn_splits(io.pos0)) {
            break;
        }
        const u32 pos = io.pos0 + (MULTI ? tc : 0u);
        const Tok tk = tok(MULTI ? tc : 0u);
        const u32 n = pos + 1u, S = tk.S, B = (n + S - 1u) / S;  // B: positions per block
        const float* q = tk.q;
        float* attn = tk.attn;
        float* part_acc = tk.part_acc;
        float* part_ml = tk.part_ml;
        const u32 g = (item - ibase) / S, s = (item - ibase) % S;
        const u32 b0 = s * B, b1 = min(n, b0 + B);
        // Copies slot k of the tile at t0 into ring slot r. K slot k: row
        // t0 + gr (+ 8 for odd k), dims 32 (k / 2) + 8 gc .. + 7. V slot
        // v = k - KSL: row t0 + 2 gc + {0, 1, 8, 9}[v % 4], dims
        // 64 (v / 4) + 8 gr .. + 7. Rows >= b1 are zero-filled, not read
        // (past the block, possibly never written); the source address
        // stays a valid one.
        auto issue_slot = [&](u32 t0, int k, u32 r) {
            u32 t, col;
            const char* base;
            if (k < KSL) {
                t = t0 + gr + ((k & 1) ? 8u : 0u);
                col = g * D + 32u * (u32)(k >> 1) + 8u * gc;
                base = kl;
            } else {
                const int v = k - KSL;
                t = t0 + 2u * gc + (u32)(v & 1) + ((v & 2) ? 8u : 0u);
                col = g * D + 64u * (u32)(v >> 2) + 8u * gr;
                base = vl;
            }
            const bool ok = t < b1;
            cp_async16(smem_u32(ring + r * 32u), base + kv_off(ok ? t : b0, col), ok ? 16u : 0u);
        };
        // q's loads go out first (their data would otherwise queue behind
        // the first copies), then the first NST half-tiles (bulk copies) or
        // the first R slots (ring), then q is staged. Ring slot j is slot
        // j % NSLOT of the tile j / NSLOT tiles on. Every slot is one commit
        // group (empty past the block), so waiting for all but the newest
        // R - 1 groups waits for the slot read next.
        constexpr u32 QPT = ((u32)(G * D) + QMK_THREADS - 1u) / QMK_THREADS;  // q values per thread
        float qv[QPT];
#pragma unroll
        for (u32 i = 0; i < QPT; ++i) {
            const u32 e = threadIdx.x + i * QMK_THREADS;
            qv[i] = e < (u32)(G * D) ? __ldcg(q + g * G * D + e) : 0.0f;
        }
        u32 t0 = b0 + warp * (u32)TILE;
        // This warp's half-tiles (a tile's K, then its V) and the cache
        // row of its first tile (the caches as [L * C, KV]).
        const u32 halves = t0 < b1 ? 2u * ((b1 - t0 + STRIDE - 1u) / STRIDE) : 0u;
        const u32 yfirst = layer * p.kv_capacity + t0;
        // Half-tile h (the K of tile h / 2 for even h, its V for odd) into
        // stage h % NST, completing that stage's phase h / NST.
        auto send = [&](u32 h) {
            const u32 sidx = h % (u32)NST;
            const char* maps = reinterpret_cast<const char*>(p.kv_maps);  // [2] CUtensorMap: K, V
            tma_load_2d(st0 + sidx * HT, maps + (h & 1u) * 128u, bar0 + 8u * sidx, HT, g * (u32)D,
                        yfirst + (h >> 1) * STRIDE);
        };
        if constexpr (kHasBulkCopies) {
            if (lane < (u32)NST) mbar_init(bar0 + 8u * lane, 1u);
            mbar_init_fence();
            __syncwarp();
            if (lane == 0u) {
                // The K/V rows of this step were stored in this launch (and
                // this region of shared memory read) through the generic
                // proxy; the copies read and write through the async one.
                fence_proxy_async_all();
                for (u32 h = 0; h < (u32)NST && h < halves; ++h) send(h);
            }
        } else {
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const u32 tj = t0 + (u32)(j / NSLOT) * STRIDE;
                if (tj < b1) issue_slot(tj, j % NSLOT, (u32)j);
                cp_async_commit();
            }
        }
#pragma unroll
        for (u32 i = 0; i < QPT; ++i) {
            const u32 e = threadIdx.x + i * QMK_THREADS;
            if (e < (u32)(G * D)) qs[e] = qv[i] * qscale;
        }
        __syncthreads();
        if (marks) attn_marks(p, layer)[0] = globaltimer_ns();
        // q^T's B fragments, hi and lo: head gr (zero past G), k-step ks =
        // dims 32 (ks / 2) + 8 gc + 4 (ks % 2) .. + 3.
        u32 qh[KSTEP][2], ql[KSTEP][2];
#pragma unroll
        for (int ks = 0; ks < KSTEP; ++ks) {
            float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (gr < (u32)G)
                f = *reinterpret_cast<const float4*>(qs + gr * D + 32u * (u32)(ks >> 1) + 8u * gc +
                                                     4u * (u32)(ks & 1));
            qh[ks][0] = cvt_bf16x2(f.x, f.y);
            qh[ks][1] = cvt_bf16x2(f.z, f.w);
            ql[ks][0] = cvt_bf16x2(f.x - bf16_lo(qh[ks][0]), f.y - bf16_hi(qh[ks][0]));
            ql[ks][1] = cvt_bf16x2(f.z - bf16_lo(qh[ks][1]), f.w - bf16_hi(qh[ks][1]));
        }
        // Per lane: heads 2 gc + e (e = 0, 1); o[mt][e + 2 i] is dim
        // 64 (mt / 4) + 8 gr + 2 (mt % 4) + i of head 2 gc + e.
        float m[2] = {-QMK_INF, -QMK_INF}, l[2] = {0.0f, 0.0f};
        float o[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
        // Warp-uniform bound: the shuffles and mma.sync below need every lane.
        u32 rb = 0u;  // ring slot of this tile's slot 0
        for (u32 i = 0; t0 < b1; t0 += STRIDE, ++i) {
            float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // S^T: rows gr, gr + 8; heads 2 gc, + 1
            uint4 xk[2], xv[4];
            u32 pb[2], plo[2];  // P^T's B fragments, hi and lo: positions 0-7, 8-15
#pragma unroll
            for (int k = 0; k < NSLOT; ++k) {
                uint4 x;
                if constexpr (kHasBulkCopies) {
                    // Half-tile h = 2 i (K) or 2 i + 1 (V): wait for its
                    // stage at the first slot, refill it after the last.
                    const u32 h = 2u * i + (k < KSL ? 0u : 1u), sidx = h % (u32)NST;
                    if (k == 0 || k == KSL) mbar_wait(bar0 + 8u * sidx, (h / (u32)NST) & 1u);
                    const u32 sp = st0 + sidx * HT;
                    if (k < KSL) {
                        x = ld_shared_v4(sp + (gr + 8u * (u32)(k & 1)) * (2u * D) + 64u * (u32)(k >> 1) + 16u * gc);
                    } else {
                        const int v = k - KSL;
                        const u32 row = 2u * gc + (u32)(v & 1) + ((v & 2) ? 8u : 0u);
                        x = ld_shared_v4(sp + row * (2u * D) + 128u * (u32)(v >> 2) + 16u * gr);
                        // Rows past the block are not this item's (past
                        // pos: possibly never written); their P is 0, and
                        // 0 x NaN would not be.
                        if (t0 + row >= b1) x = make_uint4(0u, 0u, 0u, 0u);
                    }
                    if (k == KSL - 1 || k == NSLOT - 1) {
                        __syncwarp();
                        if (lane == 0u && h + (u32)NST < halves) {
                            fence_proxy_async_all();
                            send(h + (u32)NST);
                        }
                    }
                } else {
                    const u32 r = (rb + (u32)k) & (u32)(R - 1);
                    cp_async_wait<R - 1>();
                    x = ring[r * 32u];
                    // The slot R on goes into the one just read (this
                    // lane's own load of it was issued first).
                    const u32 tq = t0 + (u32)((k + R) / NSLOT) * STRIDE;
                    if (tq < b1) issue_slot(tq, (k + R) % NSLOT, r);
                    cp_async_commit();
                }
                if (k < KSL) {
                    xk[k & 1] = x;
                    if (k & 1) {
                        // k-steps 2 (k / 2) and + 1: rows gr (xk[0]) and gr + 8 (xk[1]).
                        const int ks = k - 1;
                        const u32 a0[4] = {xk[0].x, xk[1].x, xk[0].y, xk[1].y};
                        const u32 a1[4] = {xk[0].z, xk[1].z, xk[0].w, xk[1].w};
                        mma_bf16_16816(sc, a0, qh[ks][0], qh[ks][1]);
                        mma_bf16_16816(sc, a0, ql[ks][0], ql[ks][1]);
                        mma_bf16_16816(sc, a1, qh[ks + 1][0], qh[ks + 1][1]);
                        mma_bf16_16816(sc, a1, ql[ks + 1][0], ql[ks + 1][1]);
                    }
                }
                if (k == KSL - 1) {
                    // Tile softmax. t0 < b1: position t0 (row 0) is valid,
                    // so every tile max is finite.
                    const bool ok0 = t0 + gr < b1, ok1 = t0 + gr + 8u < b1;
                    float pr[4];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float s0 = ok0 ? sc[e] : -QMK_INF, s1 = ok1 ? sc[2 + e] : -QMK_INF;
                        float mx = fmaxf(s0, s1);
                        mx = fmaxf(mx, __shfl_xor_sync(QMK_FULL_MASK, mx, 4));
                        mx = fmaxf(mx, __shfl_xor_sync(QMK_FULL_MASK, mx, 8));
                        mx = fmaxf(mx, __shfl_xor_sync(QMK_FULL_MASK, mx, 16));
                        mx = fmaxf(m[e], mx);
                        const float c = exp2f(m[e] - mx);
                        pr[e] = exp2f(s0 - mx);
                        pr[2 + e] = exp2f(s1 - mx);
                        l[e] = fmaf(l[e], c, pr[e] + pr[2 + e]);
                        m[e] = mx;
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            o[mt][e] *= c;
                            o[mt][2 + e] *= c;
                        }
                    }
                    // P^T rows 0-7 (pr[0..1]) and 8-15 (pr[2..3]) as m8n8
                    // fragments, transposed into B fragments.
#pragma unroll
                    for (int hlf = 0; hlf < 2; ++hlf) {
                        const u32 hi = cvt_bf16x2(pr[2 * hlf], pr[2 * hlf + 1]);
                        const u32 lo = cvt_bf16x2(pr[2 * hlf] - bf16_lo(hi), pr[2 * hlf + 1] - bf16_hi(hi));
                        pb[hlf] = movmatrix_trans(hi);
                        plo[hlf] = movmatrix_trans(lo);
                    }
                }
                if (k >= KSL) {
                    const int v = k - KSL;
                    xv[v & 3] = x;
                    if ((v & 3) == 3) {
                        // Block v / 4: rows 2 gc, + 1, + 8, + 9 of dims
                        // 64 b + 8 gr .. + 7; word w of a row holds dims
                        // 2 w, 2 w + 1 of those.
                        const int b = v >> 2;
                        const u32 r0[4] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w};
                        const u32 r1[4] = {xv[1].x, xv[1].y, xv[1].z, xv[1].w};
                        const u32 r8[4] = {xv[2].x, xv[2].y, xv[2].z, xv[2].w};
                        const u32 r9[4] = {xv[3].x, xv[3].y, xv[3].z, xv[3].w};
#pragma unroll
                        for (int w = 0; w < 4; ++w) {
                            const u32 a[4] = {__byte_perm(r0[w], r1[w], 0x5410), __byte_perm(r0[w], r1[w], 0x7632),
                                              __byte_perm(r8[w], r9[w], 0x5410), __byte_perm(r8[w], r9[w], 0x7632)};
                            mma_bf16_16816(o[4 * b + w], a, pb[0], pb[1]);
                            mma_bf16_16816(o[4 * b + w], a, plo[0], plo[1]);
                        }
                    }
                }
            }
            rb = (rb + (u32)NSLOT) & (u32)(R - 1);
        }
        // Nothing is left in flight (every copy issued was for a slot read
        // above); the merge buffers below reuse the ring.
        if constexpr (kHasBulkCopies) {
            __syncwarp();
            if (lane < (u32)NST) mbar_inval(bar0 + 8u * lane);
        } else {
            cp_async_wait<0>();
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            l[e] += __shfl_xor_sync(QMK_FULL_MASK, l[e], 4);
            l[e] += __shfl_xor_sync(QMK_FULL_MASK, l[e], 8);
            l[e] += __shfl_xor_sync(QMK_FULL_MASK, l[e], 16);
        }
        __syncthreads();
        if (marks) attn_marks(p, layer)[1] = globaltimer_ns();
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 h = 2u * gc + (u32)e;
            if (h < (u32)G) {
                if (gr == 0u) {
                    wm[warp * G + h] = m[e];
                    wl[warp * G + h] = l[e];
                }
                float* wa = wacc + (warp * G + h) * D + 8u * gr;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    wa[64 * (mt >> 2) + 2 * (mt & 3)] = o[mt][e];
                    wa[64 * (mt >> 2) + 2 * (mt & 3) + 1] = o[mt][2 + e];
                }
            }
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
            if (marks) attn_marks(p, layer)[2] = globaltimer_ns();
            continue;
        }
        // The partial is out: one release add to g's ticket (bar.sync makes
        // every thread's partial writes visible to thread 0 first).
        __syncthreads();
        if (threadIdx.x == 0) {
            const bool hook = (p.flags & kFlagDebugNoTicket) && item == 0u;  // fault test: never released
            if (!hook) red_release_add_u32(&tk.tickets[layer * QMK_KV_HEADS + g], 1u);
            if (marks) attn_marks(p, layer)[2] = globaltimer_ns();
        }
    }
    for (u32 t = MULTI ? io.t0 : 0u; t < (MULTI ? io.t1 : 1u); ++t) {
        const Tok tk = tok(t);
        if (tk.S == 1u) continue;
        // The previous token's combine has read its shared flag everywhere.
        if (MULTI && t != io.t0) __syncthreads();
        if (!attention_combine(p, layer, tk.S, SM, tk.tickets, tk.part_acc, tk.part_ml, tk.attn, qs)) return false;
    }
    if (marks) attn_marks(p, layer)[3] = globaltimer_ns();
    return true;
}

}  // namespace qmk
