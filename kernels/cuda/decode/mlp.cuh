// decode/mlp.cuh: the SiLU MLP, two phases of a layer.
//   gate_up (phase 4): post_attention_layernorm, then h[r] = silu(gate[r]) * up[r]
//                      (one warp computes both rows r: shared activation reads)
//   down    (phase 5): x[r] += down[layer, r, :] . h (a tensor-parallel rank
//                      writes its partial instead, as o_proj does)
// Where the build asks for them (QMK_TC_PHASES), both run on tensor cores
// instead (decode/tc_phase.cuh), the multi-token step's arithmetic.
#pragma once

namespace qmk {

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ void mlp_gate_up(const Params& p, u32 layer, float* xs, float* red) {
#if QMK_TC_PHASES
    float* hr = reinterpret_cast<float*>(p.mlp_h);  // [I] f32
    tc::gate_up<1>(p, layer, reinterpret_cast<const float*>(p.x), xs,
                   [hr](int r, int, float gate, float up) { hr[r] = silu(gate) * up; });
    return;
#endif
    const LayerView<post_attention_layernorm_t> ln(p.post_attention_layernorm, layer);
    const float* x = reinterpret_cast<const float*>(p.x);  // [H] f32
    const LayerView<gate_proj_t> wg(p.gate_proj, layer);
    const LayerView<up_proj_t> wu(p.up_proj, layer);
    const auto rows_of = [&](u32 r, const char* (&rows)[2]) {
        rows[0] = wg.row(r);
        rows[1] = wu.row(r);
    };
    constexpr bool kStage = normed_stages<2>();
    float* ws = normed_prologue<2, kStage>([&](u32 i) { return x[i]; }, ln, QMK_INTER, rows_of,
                                           p.rms_norm_eps, xs, red);
    float* h = reinterpret_cast<float*>(p.mlp_h);  // [I] f32
    weight_phase<(int)QMK_HIDDEN, 2, kStage>(
        QMK_INTER, xs, rows_of, [](u32) { return 0; },
        [&](u32 r, const float (&o)[2], int) {
            if ((threadIdx.x & 31) == 0) h[r] = silu(o[0]) * o[1];
        },
        ws);
}

__device__ __forceinline__ void mlp_down(const Params& p, u32 layer, float* xs) {
#if QMK_TC_PHASES
    float* xr = reinterpret_cast<float*>(p.x);  // [H] f32
    tc::down<1>(p, layer, reinterpret_cast<const float*>(p.mlp_h), xs,
                [xr](int r, int, float v) { xr[r] = __ldcg(xr + r) + v; });
    return;
#endif
    const LayerView<down_proj_t> w(p.down_proj, layer);
    const auto rows_of = [&](u32 r, const char* (&rows)[1]) { rows[0] = w.row(r); };
    constexpr bool kStage = copied_stages<(int)QMK_INTER>();
    float* ws = copied_prologue<(int)QMK_INTER, kStage>(reinterpret_cast<const float*>(p.mlp_h),
                                                        QMK_HIDDEN, rows_of, xs);
#if QMK_TP_RANKS > 1
    float* x = tp_partial(p, p.tp_rank, tp_epoch(p, 2u * layer + 1u));  // [H] f32 partial
    const bool lane0 = (threadIdx.x & 31) == 0;
    weight_phase<(int)QMK_INTER, 1, kStage>(
        QMK_HIDDEN, xs, rows_of, [](u32) { return 0.0f; },
#else
    float* x = reinterpret_cast<float*>(p.x);  // [H] f32
    const bool lane0 = (threadIdx.x & 31) == 0;
    weight_phase<(int)QMK_INTER, 1, kStage>(
        QMK_HIDDEN, xs, rows_of, [&](u32 r) { return lane0 ? x[r] : 0.0f; },
#endif
        [&](u32 r, const float (&o)[1], float res) {
            if (lane0) x[r] = res + o[0];
        },
        ws);
}

}  // namespace qmk
