// prefill_attention.cuh: causal grouped-query attention of the chunk's
// queries over every cached position (earlier chunks and this one),
// flash-attention style on tensor cores: no T x T matrix in memory.
//
// Work unit = one warp, one head h, 16 consecutive queries t0..t0+15
// (positions start + t), all output dims (D = 64) or one half (D = 128).
// The warp walks keys 0 .. start + t0 + 15 in tiles of 16: S = Q K^T (mma),
// causal mask, online softmax in registers (row max / sum over the 4 lanes
// of a quad), then O += P V with P re-packed from the S accumulators as an
// A fragment (the FA2 register trick). Output attn bf16 [T, Q] (in xa,
// pitch QMK_PF_XA_COLS), the A operand of o_proj.
//
// 16-byte loads through permuted dimensions (a dot product does not care
// in which order its terms come, as long as both sides agree):
//  - Q K^T: in each 32-dim block p, lane quad c takes dims 32p + 8c .. +7
//    of its Q rows and K keys as one uint4; words x, y feed k-step 2p
//    (fragment positions 2c.. and 2c+8..), words z, w k-step 2p + 1.
//  - P V: output n-tile j, column x is dim dcol + 8x + j (lane group g
//    owns dims dcol + 8g .. +7 of every key: one uint4 per key, 4 keys per
//    tile); so a lane's accumulators hold 16 consecutive output dims
//    dcol + 16c .. +15 of rows g and g + 8 (two uint4 stores per row).
#pragma once

namespace qmk {

// Four bf16 pairs (a.lo|b.lo, a.hi|b.hi per word) -> the B fragment word of
// element j of two uint4 rows a, b (j in 0..7): lo 16 bits from a, hi from b.
__device__ __forceinline__ u32 pair_elem(const uint4& a, const uint4& b, u32 j) {
    const u32 wa = j < 2 ? a.x : (j < 4 ? a.y : (j < 6 ? a.z : a.w));
    const u32 wb = j < 2 ? b.x : (j < 4 ? b.y : (j < 6 ? b.z : b.w));
    return __byte_perm(wa, wb, (j & 1) ? 0x7632u : 0x5410u);
}

__device__ __forceinline__ uint4 ld_u128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void prefill_attention(const PrefillParams& pp, u32 layer) {
    const Params& p = pp.base;
    constexpr u32 D = QMK_HEAD_DIM;
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32 (16-byte permuted loads)");
    constexpr u32 DP = D / 32;  // 32-dim blocks = pairs of k-steps of Q K^T
    // Output dims per unit: all of them for D = 64; half for D = 128 (S is
    // then computed twice, once per half, but the 64 -> 32 output
    // accumulators keep the warp under 128 registers).
    constexpr u32 SPLIT = D > 64 ? 2 : 1;
    constexpr u32 DN = D / 8 / SPLIT;  // n-tiles of the output per unit
    static_assert(DN == 8, "P V loads one uint4 (8 dims) per key and lane group");
    constexpr u32 GROUP = QMK_HEADS / QMK_KV_HEADS;
    const float scale = 1.0f / sqrtf((float)D);
    const char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);
    const char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);
    const char* qb = reinterpret_cast<const char*>(pp.qb);
    char* out = reinterpret_cast<char*>(pp.xa);
    const u32 lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const u32 n = pp.n_tokens, start = pp.start;
    const u32 qblocks = (n + 15) / 16;
    const u32 units = qblocks * QMK_HEADS * SPLIT;
    const u32 nwt = gridDim.x * QMK_WARPS;
    // Units in descending query block order: the longest rows start first.
    for (u32 u = blockIdx.x * QMK_WARPS + (threadIdx.x >> 5); u < units; u += nwt) {
        const u32 blk = qblocks - 1 - u / (QMK_HEADS * SPLIT);
        const u32 h = (u / SPLIT) % QMK_HEADS, dh = u % SPLIT;
        const u32 dcol = dh * (D / SPLIT);  // first output dim of this unit
        const u32 t0 = blk * 16;
        const u32 kvcol = (h / GROUP) * D;
        // Q fragments (rows beyond the chunk are zero; their output is
        // dropped), held in registers: qa[2p + s] is k-step 2p + s.
        const u32 ta = t0 + g, tb = t0 + g + 8;
        u32 qa[2 * DP][4];
#pragma unroll
        for (u32 pb = 0; pb < DP; ++pb) {
            const size_t col = ((size_t)h * D + pb * 32 + 8 * c) * 2;
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 ra = ta < n ? ld_u128(qb + (size_t)ta * QMK_Q_DIM * 2 + col) : z;
            const uint4 rb = tb < n ? ld_u128(qb + (size_t)tb * QMK_Q_DIM * 2 + col) : z;
            qa[2 * pb][0] = ra.x;
            qa[2 * pb][1] = rb.x;
            qa[2 * pb][2] = ra.y;
            qa[2 * pb][3] = rb.y;
            qa[2 * pb + 1][0] = ra.z;
            qa[2 * pb + 1][1] = rb.z;
            qa[2 * pb + 1][2] = ra.w;
            qa[2 * pb + 1][3] = rb.w;
        }
        float o[DN][4];
#pragma unroll
        for (u32 j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
        float m[2] = {-QMK_INF, -QMK_INF}, l[2] = {0.0f, 0.0f};
        const u32 qpos[2] = {start + ta, start + tb};
        // Keys 0 .. kmax inclusive (the last valid query of this block).
        const u32 kmax = start + min(t0 + 15, n - 1);
#pragma unroll 1
        for (u32 j0 = 0; j0 <= kmax; j0 += 16) {
            float s[2][4];
#pragma unroll
            for (u32 nt = 0; nt < 2; ++nt) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
                const u32 key = j0 + nt * 8 + g;
                const char* kr = kl + kv_off(key, kvcol + 8 * c);
                const bool ok = key <= kmax;
#pragma unroll
                for (u32 pb = 0; pb < DP; ++pb) {
                    const uint4 kv = ok ? ld_u128(kr + pb * 64) : make_uint4(0, 0, 0, 0);
                    mma_bf16_16816(s[nt], qa[2 * pb], kv.x, kv.y);
                    mma_bf16_16816(s[nt], qa[2 * pb + 1], kv.z, kv.w);
                }
            }
            // Causal mask + scale; row r = g (elements 0, 1) or g + 8 (2, 3).
            float mx[2] = {-QMK_INF, -QMK_INF};
#pragma unroll
            for (u32 nt = 0; nt < 2; ++nt)
#pragma unroll
                for (u32 e = 0; e < 4; ++e) {
                    const u32 key = j0 + nt * 8 + 2 * c + (e & 1);
                    const u32 r = e >> 1;
                    const float v = key <= qpos[r] ? s[nt][e] * scale : -QMK_INF;
                    s[nt][e] = v;
                    mx[r] = fmaxf(mx[r], v);
                }
            float corr[2];
#pragma unroll
            for (u32 r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(QMK_FULL_MASK, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(QMK_FULL_MASK, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]);
                // Key 0 is visible to every row, so m_new is finite from the
                // first tile on.
                corr[r] = expf(m[r] - m_new);
                m[r] = m_new;
                l[r] *= corr[r];
            }
#pragma unroll
            for (u32 nt = 0; nt < 2; ++nt)
#pragma unroll
                for (u32 e = 0; e < 4; ++e) {
                    const float pe = expf(s[nt][e] - m[e >> 1]);
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
            const u32 pa[4] = {pack_bf16x2(s[0][0], s[0][1]), pack_bf16x2(s[0][2], s[0][3]),
                               pack_bf16x2(s[1][0], s[1][1]), pack_bf16x2(s[1][2], s[1][3])};
            // V as B (k = key, n = dim): b0 = V[j0+2c, +1][d], b1 =
            // V[j0+2c+8, +9][d], d = kvcol + dcol + 8g + j for n-tile j: one
            // uint4 per key (masked keys read as zero: P is 0 there, but a
            // never-written cache row could hold NaN bits).
            const u32 k0 = j0 + 2 * c, k8 = k0 + 8;
            const char* vr = vl + kv_off(k0, kvcol + dcol + 8 * g);
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 v0 = k0 <= kmax ? ld_u128(vr) : z;
            const uint4 v1 = k0 + 1 <= kmax ? ld_u128(vr + QMK_KV_DIM * 2u) : z;
            const uint4 v8 = k8 <= kmax ? ld_u128(vr + 8u * QMK_KV_DIM * 2u) : z;
            const uint4 v9 = k8 + 1 <= kmax ? ld_u128(vr + 9u * QMK_KV_DIM * 2u) : z;
#pragma unroll
            for (u32 j = 0; j < DN; ++j)
                mma_bf16_16816(o[j], pa, pair_elem(v0, v1, j), pair_elem(v8, v9, j));
        }
#pragma unroll
        for (u32 r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 1);
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 2);
        }
        const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
        // Lane (g, c) holds dims dcol + 16c + j (o[j][0 | 2]) and
        // dcol + 16c + 8 + j (o[j][1 | 3]) of rows ta | tb.
        const size_t col = ((size_t)h * D + dcol + 16 * c) * 2;
#pragma unroll
        for (u32 r = 0; r < 2; ++r) {
            const u32 t = r ? tb : ta;
            if (t >= n) continue;
            uint4 lo, hi;
            u32* lw = reinterpret_cast<u32*>(&lo);
            u32* hw = reinterpret_cast<u32*>(&hi);
#pragma unroll
            for (u32 j = 0; j < DN; j += 2) {
                lw[j / 2] = pack_bf16x2(o[j][2 * r] * inv[r], o[j + 1][2 * r] * inv[r]);
                hw[j / 2] = pack_bf16x2(o[j][2 * r + 1] * inv[r], o[j + 1][2 * r + 1] * inv[r]);
            }
            char* dst = out + (size_t)t * QMK_PF_XA_COLS * 2 + col;
            *reinterpret_cast<uint4*>(dst) = lo;
            *reinterpret_cast<uint4*>(dst + 16) = hi;
        }
    }
}

}  // namespace qmk
