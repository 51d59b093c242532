// decode/argmax.cuh: CTA 0 reduces the per-CTA (value, index) partials in a fixed
// order (lane-strided, then a shuffle tree with the same tie rule) and writes
// the greedy pick to device memory and to the host-visible status block.
#pragma once

namespace qmk {

// Returns the pick in thread 0 (warp 0 only does the work); with kValue,
// its logit in *best too (a tensor-parallel rank folds picks by value). The
// one-GPU step keeps the plain form: an output reference there changed its
// register allocation.
template <bool kValue = false>
__device__ __forceinline__ u32 argmax(const Params& p, float* best = nullptr) {
    u32 result = 0xffffffffu;
    if (threadIdx.x < 32) {
        const float* pv = reinterpret_cast<const float*>(p.partial_val);  // [grid] f32
        const u32* pi = reinterpret_cast<const u32*>(p.partial_idx);      // [grid] u32
        float bv = -QMK_INF;
        u32 bi = 0xffffffffu;
        for (u32 c = threadIdx.x; c < gridDim.x; c += 32) {
            const float v = pv[c];
            const u32 i = pi[c];
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(QMK_FULL_MASK, bv, o);
            const u32 oi = __shfl_xor_sync(QMK_FULL_MASK, bi, o);
            if (better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        result = bi;
        if constexpr (kValue) *best = bv;
    }
    return result;
}

}  // namespace qmk
