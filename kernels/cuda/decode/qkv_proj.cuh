// decode/qkv_proj.cuh: input_layernorm + q/k/v projections with bias, rotary fused
// into the epilogue, K/V appended to the cache (phase 1 of a layer).
//
// Work unit = one warp computing the row pair (h*D + i, h*D + i + D/2) of q,
// k or v, so the rotary pair is in one warp's registers. Units: Q/2 for q,
// KV/2 for k, KV/2 for v.
#pragma once

namespace qmk {

__device__ __forceinline__ void qkv_proj(const Params& p, u32 layer, u32 token, u32 pos,
                                         float* xs, float* red) {
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2;
    constexpr u32 QP = QMK_Q_DIM / 2, KP = QMK_KV_DIM / 2;
    const LayerView<input_layernorm_t> ln(p.input_layernorm, layer);
    rms_norm<kDecodeNormBatch>([&](u32 i) { return residual(p, layer, token, i); },
                               [&](u32 i) { return ln.elem(i); }, p.rms_norm_eps, xs, red);

    const LayerView<q_proj_t> wq(p.q_proj, layer);
    const LayerView<k_proj_t> wk(p.k_proj, layer);
    const LayerView<v_proj_t> wv(p.v_proj, layer);
    const LayerView<q_bias_t> bq(p.q_bias, layer);
    const LayerView<k_bias_t> bk(p.k_bias, layer);
    const LayerView<v_bias_t> bv(p.v_bias, layer);
    char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    float* q = reinterpret_cast<float*>(p.q);              // [Q] f32

    const u32 lane = threadIdx.x & 31;
    for (u32 k_ = 0, u; (u = unit_at(QP + 2 * KP, k_)) < QP + 2 * KP; ++k_) {
        const u32 which = u < QP ? 0u : (u < QP + KP ? 1u : 2u);
        const u32 uu = which == 0 ? u : (which == 1 ? u - QP : u - QP - KP);
        const u32 i = uu % HALF;
        const u32 r0 = (uu / HALF) * D + i, r1 = r0 + HALF;
        float o[2];
        if (which == 0) {
            const char* rows[2] = {wq.row(r0), wq.row(r1)};
            warp_dot_rows<(int)QMK_HIDDEN, 2>(rows, xs, o);
        } else if (which == 1) {
            const char* rows[2] = {wk.row(r0), wk.row(r1)};
            warp_dot_rows<(int)QMK_HIDDEN, 2>(rows, xs, o);
        } else {
            const char* rows[2] = {wv.row(r0), wv.row(r1)};
            warp_dot_rows<(int)QMK_HIDDEN, 2>(rows, xs, o);
        }
        if (lane == 0) {
            if (which == 0) {
                float lo = o[0] + bq.elem(r0), hi = o[1] + bq.elem(r1);
                rotary(p, pos, i, lo, hi);
                q[r0] = lo;
                q[r1] = hi;
            } else if (which == 1) {
                float lo = o[0] + bk.elem(r0), hi = o[1] + bk.elem(r1);
                rotary(p, pos, i, lo, hi);
                kv_append(kl, pos, r0, lo);
                kv_append(kl, pos, r1, hi);
            } else {
                kv_append(vl, pos, r0, o[0] + bv.elem(r0));
                kv_append(vl, pos, r1, o[1] + bv.elem(r1));
            }
        }
    }
}

}  // namespace qmk
