// decode/embed.cuh: the embedding row of the input token, [H] bf16 -> f32.
// Fused into its consumers: layer 0 reads the residual from this row instead
// of from Params::x (saves one grid barrier per step).
#pragma once

namespace qmk {

// Residual stream value i for this layer: embedding row for layer 0, else x.
__device__ __forceinline__ float embed(const Params& p, u32 token, u32 i) {
    return ld_bf16(table_row(p.embed_tokens[0], token) + (size_t)i * 2);
}

__device__ __forceinline__ float residual(const Params& p, u32 layer, u32 token, u32 i) {
    return layer == 0 ? embed(p, token, i) : reinterpret_cast<const float*>(p.x)[i];
}

}  // namespace qmk
