// decode/o_proj.cuh: attention output projection + residual (phase 3 of a layer):
// x[r] = residual[r] + o_proj[layer, r, :] . attn. One warp per row; each row
// of x is written by exactly one warp. A tensor-parallel rank writes its
// partial (its heads' share of the dot product) to its exchange region
// instead; the all-reduce adds the residual (decode/tp.cuh).
#pragma once

namespace qmk {

__device__ __forceinline__ void o_proj(const Params& p, u32 layer, u32 token, float* xs) {
#if QMK_TC_PHASES
    // On tensor cores (decode/tc_phase.cuh): the multi-token step's bits.
    // The epilogue goes to a function of its own: it holds the residual's
    // addresses, not the parameter block.
    float* xr = reinterpret_cast<float*>(p.x);                       // [H] f32
    const char* emb = layer == 0 ? table_row(p.embed_tokens[0], token) : nullptr;  // [H] bf16
    tc::o_proj<1>(p, layer, reinterpret_cast<const float*>(p.attn), xs, [xr, emb](int r, int, float v) {
        xr[r] = (emb ? ld_bf16(emb + (size_t)r * 2) : __ldcg(xr + r)) + v;
    });
    return;
#endif
    const LayerView<o_proj_t> w(p.o_proj, layer);
    const auto rows_of = [&](u32 r, const char* (&rows)[1]) { rows[0] = w.row(r); };
    constexpr bool kStage = copied_stages<(int)QMK_Q_DIM>();
    float* ws = copied_prologue<(int)QMK_Q_DIM, kStage>(reinterpret_cast<const float*>(p.attn),
                                                        QMK_HIDDEN, rows_of, xs);
#if QMK_TP_RANKS > 1
    float* x = tp_partial(p, p.tp_rank, tp_epoch(p, 2u * layer));  // [H] f32 partial
    const bool lane0 = (threadIdx.x & 31) == 0;
    weight_phase<(int)QMK_Q_DIM, 1, kStage>(
        QMK_HIDDEN, xs, rows_of, [](u32) { return 0.0f; },
#else
    float* x = reinterpret_cast<float*>(p.x);  // [H] f32
    const bool lane0 = (threadIdx.x & 31) == 0;
    weight_phase<(int)QMK_Q_DIM, 1, kStage>(
        QMK_HIDDEN, xs, rows_of, [&](u32 r) { return lane0 ? residual(p, layer, token, r) : 0.0f; },
#endif
        [&](u32 r, const float (&o)[1], float res) {
            if (lane0) x[r] = res + o[0];
        },
        ws);
}

}  // namespace qmk
