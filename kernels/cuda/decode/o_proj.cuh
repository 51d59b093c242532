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
    for (u32 k_ = 0, r; (r = unit_at(QMK_HIDDEN, k_)) < QMK_HIDDEN; ++k_) {
        const char* rows[1] = {w.row(r)};
        float o[1];
        warp_dot_rows<(int)QMK_Q_DIM, 1>(rows, xs, o);
        if ((threadIdx.x & 31) == 0) x[r] = residual(p, layer, token, r) + o[0];
    }
}

}  // namespace qmk
