// prefill/attention.cuh: causal grouped-query attention of the chunk's
// queries over every cached position (earlier chunks and this one),
// flash-attention style on tensor cores: no T x T matrix in memory.
//
// K/V tiles sit in shared memory, shared by a KV group's query heads.
// CTA work item = (kv head, QB consecutive 16-query blocks; 1 when there
// would be fewer items than CTAs). Its warps are the units (query block,
// query head of the group; and half of D where a unit holds half a head,
// see prefill_attention): GROUP x SPLIT x QB <= 16 warps (7B: 7 heads x 2
// blocks = 14 warps; 0.5B: 7 heads x 2 blocks). Every unit needs the same
// keys, so the CTA streams them once: tiles of kAttnKeys keys of K and V,
// 16-byte cp.async.cg into two shared-memory stages (the next tile loads
// while this one is used), rows padded by 16 bytes (the 8 row addresses of
// an ldmatrix hit 8 distinct bank groups). Keys past the item's last query
// read as zero (a never-written cache row could hold NaN bits; P is 0 there
// anyway).
//
// Per warp and 32-key step (a 16-key step did twice the softmax
// bookkeeping per key): S = Q K^T (mma m16n8k16, K fragments by
// ldmatrix.x4 from the K rows), causal mask (only on steps that reach the
// diagonal), online softmax in base 2 in registers (row max / sum over the
// 4 lanes of a quad), then O += P V with P re-packed from the S
// accumulators as an A fragment (the FA2 register trick) and V fragments by
// ldmatrix.x4.trans. Q fragments stay in registers up to D = 64. With
// D = 128 a whole-head unit keeps its Q block in shared memory and reads
// each k-step's fragment there by ldmatrix (32 registers of Q would not fit
// next to the 64 of O).
// Output attn bf16 [T, Q] (in xa, pitch QMK_PF_XA_COLS), the A operand of
// o_proj. Items in descending query order: the longest start first.
#pragma once

namespace qmk {

constexpr u32 kAttnKeys = 64;                                 // keys per smem tile
constexpr u32 kAttnStep = 32;  // keys per online-softmax step (one rescale of O per step)
static_assert(kAttnKeys % kAttnStep == 0 && kAttnStep % 16 == 0, "whole steps per tile");
constexpr u32 kAttnPitch = (u32)QMK_HEAD_DIM * 2u + 16u;      // bytes per smem row
constexpr u32 kAttnStage = 2u * kAttnKeys * kAttnPitch;      // K + V tile, bytes
constexpr u32 kAttnSmemBytes = 2u * kAttnStage;               // two stages
// Dynamic shared memory of the prefill kernel (prefill/chunk.cuh): the wgmma
// stages where that path is compiled in, else the mma.sync ones.
constexpr u32 kPfSmemAvail =
    (QMK_WGMMA && kWgShapesOk && wg_smem_bytes() > gemm_smem_bytes()) ? wg_smem_bytes() : gemm_smem_bytes();

// Four 8x8 bf16 matrices, transposed on the way (the V operand).
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Shared memory of the K / V stages plus, for QSMEM, one 16-row Q block per
// warp.
constexpr u32 attn_smem_bytes(bool qsmem) {
    return kAttnSmemBytes + (qsmem ? QMK_WARPS * 16u * kAttnPitch : 0u);
}

// SPLIT: units per (query block, head), each with D / SPLIT output dims.
// QSMEM: Q fragments read from shared memory instead of kept in registers.
template <u32 SPLIT, bool QSMEM>
__device__ __forceinline__ void prefill_attention_t(const PrefillParams& pp, u32 layer, u16* smem) {
    const Params& p = pp.base;
    constexpr u32 D = QMK_HEAD_DIM;
    static_assert(D % 16 == 0 && D <= 128, "head_dim: a multiple of 16, at most 128");
    constexpr u32 KS = D / 16;  // k-steps of Q K^T
    constexpr u32 DN = D / 8 / SPLIT;  // n-tiles of the output per unit
    static_assert(DN % 2 == 0, "V fragments come two n-tiles per ldmatrix.x4");
    constexpr u32 GROUP = QMK_HEADS / QMK_KV_HEADS;
    constexpr u32 UPB = GROUP * SPLIT;  // units per query block
    static_assert(UPB <= QMK_WARPS, "a KV group's units must fit one CTA");
    constexpr u32 QB = QMK_WARPS / UPB;  // query blocks per item
    constexpr u32 CHUNKS = D * 2u / 16u;  // 16-byte chunks per K or V row
    static_assert((2u * kAttnKeys * CHUNKS) % QMK_THREADS == 0, "whole cp.async rounds");
    static_assert(attn_smem_bytes(QSMEM) <= kPfSmemAvail, "attention stages exceed the smem");
    // Softmax in base 2: scores scaled by log2(e) / sqrt(D), exp2 (P is
    // rounded to bf16 for the P V product anyway).
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)D);
    constexpr u32 NTS = kAttnStep / 8;  // 8-key n-tiles of S per step
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const char* qb = reinterpret_cast<const char*>(pp.qb);        // [T, Q] bf16
    char* out = reinterpret_cast<char*>(pp.xa);  // [T, QMK_PF_XA_COLS] bf16, first Q columns
    const u32 tid = threadIdx.x, warp = tid >> 5;
    const u32 lane = tid & 31, g = lane >> 2, c = lane & 3;
    const u32 n = pp.n_tokens, start = pp.start;
    const u32 qblocks = (n + 15) / 16;
    // One query block per item when QB-block items would leave SMs idle
    // (7B at 512 tokens: 64 items of 2 blocks on 132 SMs).
    const u32 qbr = (QB > 1 && ((qblocks + QB - 1) / QB) * QMK_KV_HEADS < gridDim.x) ? 1u : QB;
    const u32 groups = (qblocks + qbr - 1) / qbr;
    const u32 items = groups * QMK_KV_HEADS;
    const u32 sbase = smem_u32(smem);

    // This warp's unit inside an item.
    const bool active = warp < qbr * UPB;
    const u32 qbl = warp / UPB, h_in = (warp / SPLIT) % GROUP, dh = warp % SPLIT;
    const u32 dcol = dh * (D / SPLIT);

    // Items go heaviest first (grp counts down from the last query block),
    // dealt boustrophedon: round r gives CTA b item r G + b (r even) or
    // r G + G - 1 - b (r odd), so every CTA's total is near the mean. (Dealt
    // b, b + G, ..., 7B at 2,048 tokens, 256 items on 132 CTAs, give CTA 0
    // the two heaviest of its rounds: 1.5x the mean.)
    for (u32 r = 0; r * gridDim.x < items; ++r) {
        const u32 it = r * gridDim.x + ((r & 1u) ? gridDim.x - 1u - blockIdx.x : blockIdx.x);
        if (it >= items) continue;
        const u32 grp = groups - 1 - it / QMK_KV_HEADS;
        const u32 kvh = it % QMK_KV_HEADS;
        const u32 kvcol = kvh * D;
        // Keys 0 .. kmax inclusive: up to the item's last valid query.
        const u32 kmax = start + min((grp + 1) * qbr * 16 - 1, n - 1);
        const u32 ntiles = kmax / kAttnKeys + 1;

        // Loader: K and V rows of a tile, CHUNKS 16-byte pieces each.
        auto load_tile = [&](u32 tile, u32 s) {
            const u32 st = sbase + s * kAttnStage;
#pragma unroll
            for (u32 i = 0; i < 2u * kAttnKeys * CHUNKS / QMK_THREADS; ++i) {
                const u32 idx = tid + i * QMK_THREADS;
                const u32 is_v = idx / (kAttnKeys * CHUNKS);
                const u32 r = (idx / CHUNKS) % kAttnKeys, ch = idx % CHUNKS;
                const u32 key = tile * kAttnKeys + r;
                const bool ok = key <= kmax;
                const char* src = (is_v ? vl : kl) + kv_off(ok ? key : 0u, kvcol + ch * 8u);
                cp_async16(st + is_v * kAttnKeys * kAttnPitch + r * kAttnPitch + ch * 16u, src,
                           ok ? 16u : 0u);
            }
        };

        // The previous item's (or phase's) reads of the stages are done.
        __syncthreads();
        load_tile(0, 0);
        cp_async_commit();

        const u32 blk = grp * qbr + qbl;
        const u32 t0 = blk * 16;
        const u32 h = kvh * GROUP + h_in;
        const bool unit = active && t0 < n;
        const u32 ta = t0 + g, tb = t0 + g + 8;
        const u32 qpos[2] = {start + ta, start + tb};
        // This unit's last key (rows beyond the chunk attend like real ones;
        // their output is dropped).
        const u32 ukmax = unit ? start + min(t0 + 15, n - 1) : 0u;
        // Q fragments, k-step ks = dims 16 ks .. + 15 (rows beyond the
        // chunk are zero): in registers, or (QSMEM) this warp's 16 Q rows
        // copied to its shared-memory block (a cp.async group of its own,
        // waited for with K / V tile 0), fragments by ldmatrix.x4 in the
        // loop: lane l addresses row l % 16, dims + 8 (l / 16).
        constexpr u32 KSR = QSMEM ? 1 : KS;
        u32 qa[KSR][4];
        const u32 qs = sbase + kAttnSmemBytes + warp * 16u * kAttnPitch;
        if constexpr (QSMEM) {
            if (unit) {
#pragma unroll
                for (u32 i = 0; i < 16u * CHUNKS / 32u; ++i) {
                    const u32 idx = lane + 32u * i, r = idx / CHUNKS, ch = idx % CHUNKS;
                    const bool ok = t0 + r < n;
                    const char* src =
                        qb + (size_t)(ok ? t0 + r : 0u) * QMK_Q_DIM * 2 + ((size_t)h * D + ch * 8u) * 2;
                    cp_async16(qs + r * kAttnPitch + ch * 16u, src, ok ? 16u : 0u);
                }
            }
            cp_async_commit();
        } else {
#pragma unroll
            for (u32 ks = 0; ks < KS; ++ks) {
                const size_t col = ((size_t)h * D + ks * 16 + 2 * c) * 2;
                const bool oka = unit && ta < n, okb = unit && tb < n;
                const char* ra = qb + (size_t)ta * QMK_Q_DIM * 2 + col;
                const char* rb = qb + (size_t)tb * QMK_Q_DIM * 2 + col;
                qa[ks][0] = oka ? ld_u32(ra) : 0u;
                qa[ks][1] = okb ? ld_u32(rb) : 0u;
                qa[ks][2] = oka ? ld_u32(ra + 16) : 0u;
                qa[ks][3] = okb ? ld_u32(rb + 16) : 0u;
            }
        }
        const u32 q_lane = qs + (lane & 15u) * kAttnPitch + (lane >> 4) * 16u;
        float o[DN][4];
#pragma unroll
        for (u32 j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
        float m[2] = {-QMK_INF, -QMK_INF}, l[2] = {0.0f, 0.0f};

        // ldmatrix lane offsets inside a stage (bytes):
        //  K (non-trans), n-tile pair: key (lane & 7) + (lane >> 4) * 8,
        //    dims ((lane >> 3) & 1) * 8 -> b0, b1 of keys +0..7, b0, b1 of +8..15
        //  V (trans), dim-tile pair: key (lane & 7) + ((lane >> 3) & 1) * 8,
        //    dims (lane >> 4) * 8 -> b0, b1 of dims +0..7, b0, b1 of +8..15
        const u32 k_lane = ((lane & 7) + (lane >> 4) * 8) * kAttnPitch + ((lane >> 3) & 1) * 16;
        const u32 v_lane = kAttnKeys * kAttnPitch + ((lane & 7) + ((lane >> 3) & 1) * 8) * kAttnPitch +
                           (dcol + (lane >> 4) * 8) * 2;

#pragma unroll 1
        for (u32 tile = 0; tile < ntiles; ++tile) {
            cp_async_wait<0>();
            // Tile `tile` is in every thread's view; every warp is done with
            // the other stage (tile - 1), which the next load overwrites.
            __syncthreads();
            if (tile + 1 < ntiles) load_tile(tile + 1, (tile + 1) & 1);
            cp_async_commit();
            const u32 st = sbase + (tile & 1) * kAttnStage;
#pragma unroll 1
            for (u32 kk = 0; kk < kAttnKeys; kk += kAttnStep) {
                const u32 j0 = tile * kAttnKeys + kk;
                if (!unit || j0 > ukmax) break;
                float s[NTS][4];
#pragma unroll
                for (u32 nt = 0; nt < NTS; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
                for (u32 ks = 0; ks < KS; ++ks) {
                    if constexpr (QSMEM) ldmatrix_x4(qa[0], q_lane + ks * 32);
                    const u32(&qf)[4] = qa[QSMEM ? 0 : ks];
#pragma unroll
                    for (u32 hp = 0; hp < NTS / 2; ++hp) {
                        u32 kb[4];
                        ldmatrix_x4(kb, st + k_lane + (kk + 16 * hp) * kAttnPitch + ks * 32);
                        mma_bf16_16816(s[2 * hp], qf, kb[0], kb[1]);
                        mma_bf16_16816(s[2 * hp + 1], qf, kb[2], kb[3]);
                    }
                }
                // Scale (log2 units) + causal mask, the mask only on steps
                // that reach past the block's first query; row r = g
                // (elements 0, 1) or g + 8 (2, 3).
                const bool diag = j0 + kAttnStep - 1 > start + t0;
                float mx[2] = {-QMK_INF, -QMK_INF};
#pragma unroll
                for (u32 nt = 0; nt < NTS; ++nt)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) {
                        const u32 key = j0 + nt * 8 + 2 * c + (e & 1);
                        const u32 r = e >> 1;
                        float v = s[nt][e] * scale_log2;
                        if (diag && key > qpos[r]) v = -QMK_INF;
                        s[nt][e] = v;
                        mx[r] = fmaxf(mx[r], v);
                    }
                float corr[2];
#pragma unroll
                for (u32 r = 0; r < 2; ++r) {
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(QMK_FULL_MASK, mx[r], 1));
                    mx[r] = fmaxf(mx[r], __shfl_xor_sync(QMK_FULL_MASK, mx[r], 2));
                    const float m_new = fmaxf(m[r], mx[r]);
                    // Key 0 is visible to every row, so m_new is finite from
                    // the first step on (a row with every key of a later
                    // step masked keeps its m: corr = 1, p = 0).
                    corr[r] = exp2f(m[r] - m_new);
                    m[r] = m_new;
                    l[r] *= corr[r];
                }
#pragma unroll
                for (u32 nt = 0; nt < NTS; ++nt)
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) {
                        const float pe = exp2f(s[nt][e] - m[e >> 1]);
                        s[nt][e] = pe;
                        l[e >> 1] += pe;
                    }
#pragma unroll
                for (u32 j = 0; j < DN; ++j) {
                    o[j][0] *= corr[0];
                    o[j][1] *= corr[0];
                    o[j][2] *= corr[1];
                    o[j][3] *= corr[1];
                }
#pragma unroll
                for (u32 hp = 0; hp < NTS / 2; ++hp) {
                    const u32 pa[4] = {pack_bf16x2(s[2 * hp][0], s[2 * hp][1]),
                                       pack_bf16x2(s[2 * hp][2], s[2 * hp][3]),
                                       pack_bf16x2(s[2 * hp + 1][0], s[2 * hp + 1][1]),
                                       pack_bf16x2(s[2 * hp + 1][2], s[2 * hp + 1][3])};
#pragma unroll
                    for (u32 j = 0; j < DN; j += 2) {
                        u32 vb[4];
                        ldmatrix_x4_trans(vb, st + v_lane + (kk + 16 * hp) * kAttnPitch + j * 16);
                        mma_bf16_16816(o[j], pa, vb[0], vb[1]);
                        mma_bf16_16816(o[j + 1], pa, vb[2], vb[3]);
                    }
                }
            }
        }
        cp_async_wait<0>();
        if (!unit) continue;
#pragma unroll
        for (u32 r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 1);
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 2);
        }
        const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
        // Lane (g, c) holds dims dcol + 8j + 2c, + 1 of rows ta (o[j][0..1])
        // and tb (o[j][2..3]).
#pragma unroll
        for (u32 r = 0; r < 2; ++r) {
            const u32 t = r ? tb : ta;
            if (t >= n) continue;
            char* dst = out + (size_t)t * QMK_PF_XA_COLS * 2 + ((size_t)h * D + dcol + 2 * c) * 2;
#pragma unroll
            for (u32 j = 0; j < DN; ++j)
                *reinterpret_cast<u32*>(dst + j * 16) =
                    pack_bf16x2(o[j][2 * r] * inv[r], o[j][2 * r + 1] * inv[r]);
        }
    }
}

// Head_dim 128 (7B-like): whole-head units with Q in shared memory where
// the stages fit (sm_90a, whose wgmma stages are large enough), else (sm_80
// / sm_89) two half-D units per head and query block, Q in registers. A
// half-D unit computes the whole S for its half of O: 1.5x the MMAs and
// twice the softmax of a whole-head unit, which took attention at 7B, 2,048
// tokens from 5.0 to 3.5 ms on sm_90a. Head_dim <= 64: whole heads, Q in
// registers.
__device__ __forceinline__ void prefill_attention(const PrefillParams& pp, u32 layer, u16* smem) {
    if constexpr (QMK_HEAD_DIM <= 64) {
        prefill_attention_t<1, false>(pp, layer, smem);
    } else if constexpr (attn_smem_bytes(true) <= kPfSmemAvail &&
                         QMK_HEADS / QMK_KV_HEADS <= QMK_WARPS) {
        prefill_attention_t<1, true>(pp, layer, smem);
    } else {
        prefill_attention_t<2, false>(pp, layer, smem);
    }
}

}  // namespace qmk
