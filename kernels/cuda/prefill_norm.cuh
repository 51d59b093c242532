// prefill_norm.cuh: RMSNorm over the rows of the chunk, one warp per row:
//     xa[t, i] = bf16(v[t, i] / rms(v[t]) * w[i]),  rms = sqrt(mean(v^2) + eps)
// Layer 0 reads the residual from the embedding table (and writes it into
// act, the chunk's f32 residual stream [T, H]); later layers read act.
#pragma once

namespace qmk {

template <class W>
__device__ __forceinline__ void prefill_rms_norm(const PrefillParams& pp, bool from_embedding,
                                                 W w) {
    const Params& p = pp.base;
    float* act = reinterpret_cast<float*>(pp.act);
    char* xa = reinterpret_cast<char*>(pp.xa);
    const u32* tokens = reinterpret_cast<const u32*>(pp.tokens);
    const u32 lane = threadIdx.x & 31;
    const u32 nwt = gridDim.x * QMK_WARPS;
    for (u32 t = blockIdx.x * QMK_WARPS + (threadIdx.x >> 5); t < pp.n_tokens; t += nwt) {
        float* row = act + (size_t)t * QMK_HIDDEN;
        const char* emb = from_embedding ? table_row(p.embed_tokens[0], tokens[t]) : nullptr;
        float ss = 0.0f;
        for (u32 i = lane; i < QMK_HIDDEN; i += 32) {
            float v;
            if (from_embedding) {
                v = ld_bf16(emb + (size_t)i * 2);
                row[i] = v;
            } else {
                v = row[i];
            }
            ss = fmaf(v, v, ss);
        }
        const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)QMK_HIDDEN + p.rms_norm_eps);
        char* out = xa + (size_t)t * (QMK_PF_XA_COLS * 2u);
        for (u32 i = lane; i < QMK_HIDDEN; i += 32) st_bf16(out + (size_t)i * 2, row[i] * inv * w(i));
    }
}

}  // namespace qmk
