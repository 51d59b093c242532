// prefill_attention.cuh: causal grouped-query attention of the chunk's
// queries over every cached position (earlier chunks and this one),
// flash-attention style on tensor cores: no T x T matrix in memory.
//
// Work unit = one warp, one head h, 16 consecutive queries t0..t0+15
// (positions start + t), all output dims (D = 64) or one half (D = 128). The warp walks keys 0 .. start + t0 + 15 in tiles
// of 16: S = Q K^T (mma, K-cache rows loaded straight into B fragments, the
// pairs of a fragment are adjacent dims of one key), causal mask, online
// softmax in registers (row max / sum over the 4 lanes of a quad), then
// O += P V with P re-packed from the S accumulators as an A fragment (the
// FA2 register trick) and V gathered per key pair. Output attn bf16 [T, Q]
// (in xa, pitch QMK_PF_XA_COLS), the A operand of o_proj.
#pragma once

namespace qmk {

__device__ __forceinline__ void prefill_attention(const PrefillParams& pp, u32 layer) {
    const Params& p = pp.base;
    constexpr u32 D = QMK_HEAD_DIM;
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
    constexpr u32 DK = D / 16;  // k-steps of Q K^T
    // Output dims per unit: all of them for D = 64; half for D = 128 (S is
    // then computed twice, once per half, but the 64 -> 32 output
    // accumulators keep the warp under 128 registers).
    constexpr u32 SPLIT = D > 64 ? 2 : 1;
    constexpr u32 DN = D / 8 / SPLIT;  // n-tiles of the output per unit
    constexpr u32 GROUP = QMK_HEADS / QMK_KV_HEADS;
    constexpr u32 KVB = QMK_KV_DIM * 2u;  // bytes per cached position
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
        // dropped), held in registers. (Re-reading them per key tile
        // instead, with all D = 128 outputs per unit, gave more stack at 7B:
        // 248 B against 184 B; the output split above gives 8 B.)
        const u32 ta = t0 + g, tb = t0 + g + 8;
        u32 qa[DK][4];
        auto q_frag = [&](u32 kk, u32 (&f)[4]) {
            const size_t ca = ((size_t)h * D + kk * 16 + 2 * c) * 2;
            f[0] = ta < n ? ld_u32(qb + (size_t)ta * QMK_Q_DIM * 2 + ca) : 0u;
            f[1] = tb < n ? ld_u32(qb + (size_t)tb * QMK_Q_DIM * 2 + ca) : 0u;
            f[2] = ta < n ? ld_u32(qb + (size_t)ta * QMK_Q_DIM * 2 + ca + 16) : 0u;
            f[3] = tb < n ? ld_u32(qb + (size_t)tb * QMK_Q_DIM * 2 + ca + 16) : 0u;
        };
#pragma unroll
        for (u32 kk = 0; kk < DK; ++kk) q_frag(kk, qa[kk]);
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
                const char* kr = kl + kv_off(key, kvcol + 2 * c);
                const bool ok = key <= kmax;
#pragma unroll
                for (u32 kk = 0; kk < DK; ++kk) {
                    const u32 b0 = ok ? ld_u32(kr + kk * 32) : 0u;
                    const u32 b1 = ok ? ld_u32(kr + kk * 32 + 16) : 0u;
                    mma_bf16_16816(s[nt], qa[kk], b0, b1);
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
            // V as B (k = key, n = dim): b0 = V[j0+2c, +1][d], b1 = V[j0+2c+8, +9][d].
            const u32 k0 = j0 + 2 * c, k8 = k0 + 8;
            const bool v0 = k0 <= kmax, v1 = k0 + 1 <= kmax, v8 = k8 <= kmax, v9 = k8 + 1 <= kmax;
#pragma unroll
            for (u32 j = 0; j < DN; ++j) {
                const u32 d = kvcol + dcol + j * 8 + g;
                const u32 lo0 = v0 ? ld_u16(vl + kv_off(k0, d)) : 0u;
                const u32 hi0 = v1 ? ld_u16(vl + kv_off(k0, d) + KVB) : 0u;
                const u32 lo8 = v8 ? ld_u16(vl + kv_off(k8, d)) : 0u;
                const u32 hi8 = v9 ? ld_u16(vl + kv_off(k8, d) + KVB) : 0u;
                mma_bf16_16816(o[j], pa, lo0 | (hi0 << 16), lo8 | (hi8 << 16));
            }
        }
#pragma unroll
        for (u32 r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 1);
            l[r] += __shfl_xor_sync(QMK_FULL_MASK, l[r], 2);
        }
        const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
#pragma unroll
        for (u32 j = 0; j < DN; ++j) {
            const size_t col = (size_t)h * D + dcol + j * 8 + 2 * c;
            if (ta < n)
                *reinterpret_cast<u32*>(out + ((size_t)ta * QMK_PF_XA_COLS + col) * 2) =
                    pack_bf16x2(o[j][0] * inv[0], o[j][1] * inv[0]);
            if (tb < n)
                *reinterpret_cast<u32*>(out + ((size_t)tb * QMK_PF_XA_COLS + col) * 2) =
                    pack_bf16x2(o[j][2] * inv[1], o[j][3] * inv[1]);
        }
    }
}

}  // namespace qmk
