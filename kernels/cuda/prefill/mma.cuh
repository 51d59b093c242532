// prefill/mma.cuh: the tensor-core building blocks of the prefill kernel:
// bf16 mma.sync m16n8k16 with f32 accumulation (sm_80+), fragment packing.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, .bf16), g = lane / 4, c = lane % 4:
//   A (16 x 16, row-major) a0 = A[g][2c..2c+1]   a1 = A[g+8][2c..2c+1]
//                          a2 = A[g][2c+8..+9]   a3 = A[g+8][2c+8..+9]
//   B (16 x 8, "col")      b0 = B[2c..2c+1][g]   b1 = B[2c+8..+9][g]
//   C (16 x 8, f32)        c0,c1 = C[g][2c..2c+1]  c2,c3 = C[g+8][2c..2c+1]
// The lower-indexed element of a pair sits in the low 16 bits.
#pragma once

namespace qmk {

// Scratch row pitches of the chunk buffers (elements); the host sizes the
// buffers with the same numbers (qmk_kernels::host::PrefillBuffer).
constexpr u32 QMK_PF_XA_COLS = QMK_HIDDEN > QMK_Q_DIM ? (u32)QMK_HIDDEN : (u32)QMK_Q_DIM;  // bf16
constexpr u32 QMK_PF_QKV_COLS = (u32)(QMK_Q_DIM + 2 * QMK_KV_DIM);                         // f32

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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
