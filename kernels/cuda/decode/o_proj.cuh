// decode/o_proj.cuh: attention output projection + residual (phase 3 of a layer):
// x[r] = residual[r] + o_proj[layer, r, :] . attn. One warp per row; each row
// of x is written by exactly one warp.
#pragma once

namespace qmk {

__device__ __forceinline__ void o_proj(const Params& p, u32 layer, u32 token, float* xs) {
    load_vec_to_smem<(int)QMK_Q_DIM>(reinterpret_cast<const float*>(p.attn), xs);
    __syncthreads();
    const LayerView<o_proj_t> w(p.o_proj, layer);
    float* x = reinterpret_cast<float*>(p.x);  // [H] f32
    const bool lane0 = (threadIdx.x & 31) == 0;
    weight_phase<(int)QMK_Q_DIM, 1>(
        QMK_HIDDEN, xs, [&](u32 r, const char* (&rows)[1]) { rows[0] = w.row(r); },
        [&](u32 r) { return lane0 ? residual(p, layer, token, r) : 0.0f; },
        [&](u32 r, const float (&o)[1], float res) {
            if (lane0) x[r] = res + o[0];
        });
}

}  // namespace qmk
