// prefill/norm.cuh: RMSNorm over the rows of the chunk, one warp per row:
//     xa[t, i] = bf16(v[t, i] / rms(v[t]) * w[i]),  rms = sqrt(mean(v^2) + eps)
// Layer 0 reads the residual from the embedding table (and writes it into
// act, the chunk's f32 residual stream [T, H]); later layers read act.
//
// Lane l owns the float4 groups l, l + 32, ... of the row (H % 128 == 0 for
// every Qwen2.5 shape; others take the scalar loop). The loads of a batch of
// 8 groups are issued before their first use: a warp has ~8 x 512 B in
// flight instead of one 128-byte load per round trip (one scalar load per
// round trip is latency-bound: ~100 us a layer at 7B, whatever T).
#pragma once

namespace qmk {

template <class W>
__device__ __forceinline__ void prefill_rms_norm(const PrefillParams& pp, bool from_embedding,
                                                 W w) {
    const Params& p = pp.base;
    float* act = reinterpret_cast<float*>(pp.act);                // [T, H] f32
    char* xa = reinterpret_cast<char*>(pp.xa);                    // [T, QMK_PF_XA_COLS] bf16
    const u32* tokens = reinterpret_cast<const u32*>(pp.tokens);  // [n] u32
    const u32 lane = threadIdx.x & 31;
    const u32 nwt = gridDim.x * QMK_WARPS;
    for (u32 t = blockIdx.x * QMK_WARPS + (threadIdx.x >> 5); t < pp.n_tokens; t += nwt) {
        float* row = act + (size_t)t * QMK_HIDDEN;  // [H] f32
        const char* emb = from_embedding ? table_row(p.embed_tokens[0], tokens[t]) : nullptr;
        char* out = xa + (size_t)t * (QMK_PF_XA_COLS * 2u);
        float ss = 0.0f;
        if constexpr (QMK_HIDDEN % 128 == 0) {
            constexpr u32 NV = QMK_HIDDEN / 128, B = 8;  // float4 groups per lane, batch
#pragma unroll
            for (u32 b = 0; b < NV; b += B) {
                float4 x[B];
#pragma unroll
                for (u32 k = 0; k < B; ++k) {
                    if (b + k >= NV) break;
                    const u32 i = (b + k) * 128u + lane * 4u;
                    if (from_embedding) {
                        const uint2 e = *reinterpret_cast<const uint2*>(emb + (size_t)i * 2);
                        x[k] = make_float4(bf16_bits_to_f32(e.x & 0xFFFFu), bf16_bits_to_f32(e.x >> 16),
                                           bf16_bits_to_f32(e.y & 0xFFFFu), bf16_bits_to_f32(e.y >> 16));
                        *reinterpret_cast<float4*>(row + i) = x[k];
                    } else {
                        x[k] = *reinterpret_cast<const float4*>(row + i);
                    }
                }
#pragma unroll
                for (u32 k = 0; k < B; ++k) {
                    if (b + k >= NV) break;
                    ss = fmaf(x[k].x, x[k].x, ss);
                    ss = fmaf(x[k].y, x[k].y, ss);
                    ss = fmaf(x[k].z, x[k].z, ss);
                    ss = fmaf(x[k].w, x[k].w, ss);
                }
            }
            const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)QMK_HIDDEN + p.rms_norm_eps);
#pragma unroll
            for (u32 b = 0; b < NV; b += B) {
                float4 x[B];
#pragma unroll
                for (u32 k = 0; k < B; ++k) {
                    if (b + k >= NV) break;
                    x[k] = *reinterpret_cast<const float4*>(row + (b + k) * 128u + lane * 4u);
                }
#pragma unroll
                for (u32 k = 0; k < B; ++k) {
                    if (b + k >= NV) break;
                    const u32 i = (b + k) * 128u + lane * 4u;
                    uint2 o;
                    o.x = pack_bf16x2(x[k].x * inv * w(i), x[k].y * inv * w(i + 1));
                    o.y = pack_bf16x2(x[k].z * inv * w(i + 2), x[k].w * inv * w(i + 3));
                    *reinterpret_cast<uint2*>(out + (size_t)i * 2) = o;
                }
            }
        } else {
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
            for (u32 i = lane; i < QMK_HIDDEN; i += 32)
                st_bf16(out + (size_t)i * 2, row[i] * inv * w(i));
        }
    }
}

}  // namespace qmk
