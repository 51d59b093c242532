// core/kv_cache.cuh: KV cache addressing and the append of this position's K/V.
//
// Cache [L, C, KV] bf16. A layer's base is computed in 64 bits (the whole
// cache exceeds 2^32 bytes for 32B at 32k context); inside a layer offsets are
// koff_t: C * KV * 2 < 2^32 is checked on the host before launch.
#pragma once

namespace qmk {

__device__ __forceinline__ char* kv_layer(u64 cache, u32 layer, u32 capacity) {
    return reinterpret_cast<char*>(cache) + (u64)layer * (u64)capacity * (u64)(QMK_KV_DIM * 2u);
}

// Byte offset of element j of position t inside a layer's cache.
__device__ __forceinline__ koff_t kv_off(u32 t, u32 j) {
    return (koff_t)t * (koff_t)(QMK_KV_DIM * 2u) + (koff_t)j * 2u;
}

// Stored rounded to bf16 (round to nearest even): the CPU reference's
// "bf16 KV" option does the same.
__device__ __forceinline__ void kv_append(char* layer_base, u32 pos, u32 j, float v) {
    *reinterpret_cast<u16*>(layer_base + kv_off(pos, j)) = f32_to_bf16_rne(v);
}

}  // namespace qmk
