// decode/lm_head.cuh: final norm + LM head + the per-CTA half of the argmax.
// logits[r] = lm_head[r, :] . final_norm(x); each CTA writes its best
// (value, index) to partial_val/partial_idx; decode/argmax.cuh reduces
// those. The prefill kernel ends with the same two.
#pragma once

namespace qmk {

// RB: the final norm's load batch (rms_norm). PAIR: whether short rows go
// two at a time (below); the prefill kernel, at its register cap, keeps one.
template <int RB, bool PAIR>
__device__ __forceinline__ void lm_head(const Params& p, float* xs, float* red) {
    const float* x = reinterpret_cast<const float*>(p.x);       // [H] f32
    const char* nw = reinterpret_cast<const char*>(p.norm[0]);  // [H] bf16
    rms_norm<RB>([&](u32 i) { return x[i]; }, [&](u32 i) { return ld_bf16(nw + (koff_t)i * 2u); },
                 p.rms_norm_eps, xs, red);
    float* logits = reinterpret_cast<float*>(p.logits);  // [V] f32
    const u32 nwt = gridDim.x * QMK_WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best = -QMK_INF;
    u32 besti = 0xffffffffu;
    const auto take = [&](u32 r, float o) {
        if (lane == 0) logits[r] = o;
        if (o > best) {
            best = o;
            besti = r;
        }
    };
    // Short rows (4 vectors per lane or fewer) go two at a time, rows r and
    // r + nwt, so that a warp keeps as many bytes in flight as a longer row
    // would. Rows still ascend within a warp, so a strict '>' keeps the
    // lowest index on ties.
    constexpr bool kTwoRows = PAIR && lane_vectors((int)QMK_HIDDEN) <= 4;
    u32 r = blockIdx.x * QMK_WARPS + warp;
    if (kTwoRows) {
        for (; r + nwt < QMK_VOCAB; r += 2 * nwt) {
            const char* rows[2] = {table_row(p.lm_head[0], r), table_row(p.lm_head[0], r + nwt)};
            float o[2];
            warp_dot_rows<(int)QMK_HIDDEN, 2>(rows, xs, o);
            take(r, o[0]);
            take(r + nwt, o[1]);
        }
    }
    for (; r < QMK_VOCAB; r += nwt) {
        const char* rows[1] = {table_row(p.lm_head[0], r)};
        float o[1];
        warp_dot_rows<(int)QMK_HIDDEN, 1>(rows, xs, o);
        take(r, o[0]);
    }
    __shared__ float s_val[QMK_WARPS];
    __shared__ u32 s_idx[QMK_WARPS];
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = besti;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float bv = s_val[0];
        u32 bi = s_idx[0];
        for (int w = 1; w < QMK_WARPS; ++w)
            if (better(s_val[w], s_idx[w], bv, bi)) {
                bv = s_val[w];
                bi = s_idx[w];
            }
        reinterpret_cast<float*>(p.partial_val)[blockIdx.x] = bv;
        reinterpret_cast<u32*>(p.partial_idx)[blockIdx.x] = bi;
    }
}

}  // namespace qmk
