// decode/qkv_proj.cuh: input_layernorm + q/k/v projections with bias, rotary fused
// into the epilogue, K/V appended to the cache (phase 1 of a layer).
//
// Work unit = one warp computing the row pair (h*D + i, h*D + i + D/2) of q,
// k or v, so the rotary pair is in one warp's registers. Units: Q/2 for q,
// KV/2 for k, KV/2 for v. Where the phase does not stage its first rows
// (rows longer than the stage's 4 vectors per lane: 1.5B and up), v, which
// has no rotary, goes row by row instead: Q/2 + KV/2 pairs, then KV rows.
#pragma once

namespace qmk {

__device__ __forceinline__ void qkv_proj(const Params& p, u32 layer, u32 token, u32 pos,
                                         float* xs, float* red) {
#if QMK_TC_PHASES
    // On tensor cores (decode/tc_phase.cuh): the multi-token step's bits.
    const char* const emb[1] = {layer == 0 ? table_row(p.embed_tokens[0], token) : nullptr};  // [H] bf16
    tc::qkv<1>(p, layer, reinterpret_cast<const float*>(p.x), emb, pos, reinterpret_cast<float*>(p.q), xs);
    return;
#endif
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2;
    constexpr u32 QP = QMK_Q_DIM / 2, KP = QMK_KV_DIM / 2;
    const LayerView<input_layernorm_t> ln(p.input_layernorm, layer);
    const LayerView<q_proj_t> wq(p.q_proj, layer);
    const LayerView<k_proj_t> wk(p.k_proj, layer);
    const LayerView<v_proj_t> wv(p.v_proj, layer);
    const LayerView<q_bias_t> bq(p.q_bias, layer);
    const LayerView<k_bias_t> bk(p.k_bias, layer);
    const LayerView<v_bias_t> bv(p.v_bias, layer);
    char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    float* q = reinterpret_cast<float*>(p.q);              // [Q] f32

    // Unit u: which of q (0), k (1), v (2), its rotary index i and rows r0, r1.
    struct Unit {
        u32 which, i, r0, r1;
    };
    const auto unit = [&](u32 u) {
        const u32 which = u < QP ? 0u : (u < QP + KP ? 1u : 2u);
        const u32 uu = which == 0 ? u : (which == 1 ? u - QP : u - QP - KP);
        const u32 i = uu % HALF;
        const u32 r0 = (uu / HALF) * D + i;
        return Unit{which, i, r0, r0 + HALF};
    };
    const auto rows_of = [&](u32 u, const char* (&rows)[2]) {
        const Unit n = unit(u);
        if (n.which == 0) {
            rows[0] = wq.row(n.r0);
            rows[1] = wq.row(n.r1);
        } else if (n.which == 1) {
            rows[0] = wk.row(n.r0);
            rows[1] = wk.row(n.r1);
        } else {
            rows[0] = wv.row(n.r0);
            rows[1] = wv.row(n.r1);
        }
    };
    constexpr u32 kUnits = QP + 2 * KP;
    constexpr bool kStage = normed_stages<2>();
    float* ws = normed_prologue<2, kStage>([&](u32 i) { return residual(p, layer, token, i); }, ln,
                                           kUnits, rows_of, p.rms_norm_eps, xs, red);
    const auto early = [&](u32 u) {
        // Lane 0's epilogue inputs: the unit's two biases, then the
        // rotary (cos, sin) for q and k; zeros elsewhere.
        float4 e = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if ((threadIdx.x & 31) == 0) {
            const Unit n = unit(u);
            if (n.which == 2) {
                e.x = bv.elem(n.r0);
                e.y = bv.elem(n.r1);
            } else {
                const float2 cs = rotary_cs(p, pos, n.i);
                e.x = n.which == 0 ? bq.elem(n.r0) : bk.elem(n.r0);
                e.y = n.which == 0 ? bq.elem(n.r1) : bk.elem(n.r1);
                e.z = cs.x;
                e.w = cs.y;
            }
        }
        return e;
    };
    const auto epilogue = [&](u32 u, const float (&o)[2], float4 e) {
        if ((threadIdx.x & 31) != 0) return;
        const Unit n = unit(u);
        float lo = o[0] + e.x, hi = o[1] + e.y;
        if (n.which == 2) {
            kv_append(vl, pos, n.r0, lo);
            kv_append(vl, pos, n.r1, hi);
            return;
        }
        rotate(make_float2(e.z, e.w), lo, hi);
        if (n.which == 0) {
            q[n.r0] = lo;
            q[n.r1] = hi;
        } else {
            kv_append(kl, pos, n.r0, lo);
            kv_append(kl, pos, n.r1, hi);
        }
    };
    if constexpr (kStage) {
        weight_phase<(int)QMK_HIDDEN, 2, kStage>(kUnits, xs, rows_of, early, epilogue, ws);
    } else {
        // v row r: bias, dot product, append; the same sums as in a pair.
        const bool lane0 = (threadIdx.x & 31) == 0;
        weight_phase_pairs_then_rows<(int)QMK_HIDDEN>(
            QP + KP, QMK_KV_DIM, xs, rows_of, early, epilogue,
            [&](u32 r, const char* (&rows)[1]) { rows[0] = wv.row(r); },
            [&](u32 r) { return lane0 ? bv.elem(r) : 0.0f; },
            [&](u32 r, const float (&o)[1], float b) {
                if (lane0) kv_append(vl, pos, r, o[0] + b);
            });
    }
}

}  // namespace qmk
