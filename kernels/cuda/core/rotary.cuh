// core/rotary.cuh: rotate-half (neox) rotary embedding of one pair (i, i + D/2) of
// a head, fused into the q/k projection epilogue:
//     out[i]       = x[i] * cos[pos, i] - x[i + D/2] * sin[pos, i]
//     out[i + D/2] = x[i + D/2] * cos[pos, i] + x[i] * sin[pos, i]
// cos/sin come from a host-computed table [C, D/2] f32.
#pragma once

namespace qmk {

// (cos, sin) of pair i at position pos.
__device__ __forceinline__ float2 rotary_cs(const Params& p, u32 pos, u32 i) {
    const size_t t = (size_t)pos * (QMK_HEAD_DIM / 2) + i;
    return make_float2(reinterpret_cast<const float*>(p.rope_cos)[t],
                       reinterpret_cast<const float*>(p.rope_sin)[t]);
}

__device__ __forceinline__ void rotary(const Params& p, u32 pos, u32 i, float& lo, float& hi) {
    const float2 cs = rotary_cs(p, pos, i);
    const float a = lo, b = hi;
    lo = a * cs.x - b * cs.y;
    hi = b * cs.x + a * cs.y;
}

// The same rotation for the decode step, which fetches (cos, sin) before its
// dot products. Its fused multiply-adds are written out: they are the ones
// the compiler chose for rotary() in the decode step, and leaving the choice
// to it moves bits when the code around it changes.
__device__ __forceinline__ void rotate(float2 cs, float& lo, float& hi) {
    const float a = lo, b = hi;
    lo = fmaf(a, cs.x, -(b * cs.y));
    hi = fmaf(b, cs.x, a * cs.y);
}

}  // namespace qmk
