// prefill/mma.cuh: the tensor-core building blocks of the prefill kernel:
// fragment packing and the chunk scratch pitches. The mma.sync m16n8k16
// itself and its fragment layouts are in core/common.cuh (the decode
// attention uses it too).
#pragma once

namespace qmk {

// Scratch row pitches of the chunk buffers (elements); the host sizes the
// buffers with the same numbers (qmk_kernels::host::PrefillBuffer).
constexpr u32 QMK_PF_XA_COLS = QMK_HIDDEN > QMK_Q_DIM ? (u32)QMK_HIDDEN : (u32)QMK_Q_DIM;  // bf16
constexpr u32 QMK_PF_QKV_COLS = (u32)(QMK_Q_DIM + 2 * QMK_KV_DIM);                         // f32

// Two f32 -> one bf16x2 word (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16_rne(lo) | ((u32)f32_to_bf16_rne(hi) << 16);
}

__device__ __forceinline__ void st_bf16(void* p, float v) {
    *reinterpret_cast<u16*>(p) = f32_to_bf16_rne(v);
}

// Coherent loads of data written earlier in this launch (never .nc).
__device__ __forceinline__ u32 ld_u32(const void* p) { return *reinterpret_cast<const u32*>(p); }
__device__ __forceinline__ u32 ld_u16(const void* p) { return *reinterpret_cast<const u16*>(p); }

}  // namespace qmk
