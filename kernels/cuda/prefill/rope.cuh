// prefill/rope.cuh: rotary embedding of the chunk's q and k, K/V written to
// the cache for every position of the chunk (phase after the qkv GEMM).
//   qkv [T, Q + 2 KV] f32 (projection + bias) ->
//   qb  [T, Q] bf16 rotated queries; k_cache/v_cache [L, C, KV] bf16 at
//   positions start .. start + T (rotated k, plain v), same rounding as the
//   decode kernel's kv_append.
// Work item = one rotary pair (q, k) or one pair of adjacent v elements.
#pragma once

namespace qmk {

__device__ __forceinline__ void prefill_rope_kv(const PrefillParams& pp, u32 layer) {
    const Params& p = pp.base;
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2;
    constexpr u32 QP = QMK_Q_DIM / 2, KP = QMK_KV_DIM / 2, VP = QMK_KV_DIM / 2;
    constexpr u32 PER_ROW = QP + KP + VP;
    const float* qkv = reinterpret_cast<const float*>(pp.qkv);  // [T, Q + 2 KV] f32
    char* qb = reinterpret_cast<char*>(pp.qb);                  // [T, Q] bf16
    char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);       // [C, KV] bf16
    char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);       // [C, KV] bf16
    const u32 total = pp.n_tokens * PER_ROW;
    for (u32 u = blockIdx.x * QMK_THREADS + threadIdx.x; u < total; u += gridDim.x * QMK_THREADS) {
        const u32 t = u / PER_ROW, w = u % PER_ROW;
        const u32 pos = pp.start + t;
        const float* row = qkv + (size_t)t * QMK_PF_QKV_COLS;  // [Q + 2 KV] f32
        if (w < QP + KP) {
            const bool is_q = w < QP;
            const u32 ww = is_q ? w : w - QP;
            const u32 i = ww % HALF, r0 = (ww / HALF) * D + i, r1 = r0 + HALF;
            const float* src = is_q ? row : row + QMK_Q_DIM;
            float lo = src[r0], hi = src[r1];
            rotary(p, pos, i, lo, hi);
            if (is_q) {
                st_bf16(qb + ((size_t)t * QMK_Q_DIM + r0) * 2, lo);
                st_bf16(qb + ((size_t)t * QMK_Q_DIM + r1) * 2, hi);
            } else {
                kv_append(kl, pos, r0, lo);
                kv_append(kl, pos, r1, hi);
            }
        } else {
            const u32 j = 2 * (w - QP - KP);
            const float* src = row + QMK_Q_DIM + QMK_KV_DIM;
            kv_append(vl, pos, j, src[j]);
            kv_append(vl, pos, j + 1, src[j + 1]);
        }
    }
}

}  // namespace qmk
