// core/common.cuh: types, bf16 helpers, loads, reductions shared by every op.
//
// Included after the rendered plan header (qmk_plan.h), which defines the
// model shape constants (QMK_*) and the split plan (namespace qmk_plan).
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// THE in-kernel offset type. Every weight offset is computed in this type:
// 32-bit byte offsets relative to a chunk base (qmk_layout::KERNEL_OFFSET_MODEL).
// The split planner guarantees every offset inside a chunk fits it; the probe
// kernel shows what happens when it does not (the offset wraps mod 2^32).
typedef u32 koff_t;
static_assert(sizeof(koff_t) * 8 == qmk_plan::kOffsetBits,
              "koff_t must be as wide as the offset model the plan was made for");

#define QMK_THREADS 512
#define QMK_WARPS (QMK_THREADS / 32)
#define QMK_FULL_MASK 0xffffffffu
#define QMK_INF __int_as_float(0x7f800000)

namespace qmk {

// bf16 -> f32 is a 16-bit shift (no header needed, exact).
__device__ __forceinline__ float bf16_bits_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float ld_bf16(const void* p) {
    return bf16_bits_to_f32(*reinterpret_cast<const u16*>(p));
}

// f32 -> bf16, round to nearest even, NaN stays a quiet NaN: the same rule as
// half::bf16::from_f32, so the CPU reference's bf16 KV rounding matches bit
// for bit.
__device__ __forceinline__ u16 f32_to_bf16_rne(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);
    return (u16)((u + rounding) >> 16);
}

// L2 eviction priority of a read: `first` marks bytes that are read once
// and should leave L2 before anything else does.
enum class L2 : int { normal, first };

// The evict-first cache policy (a constant: it folds into the load's memory
// descriptor).
__device__ __forceinline__ u64 l2_evict_first() {
    u64 pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

// Weights are read once per step: 16-byte loads through the non-coherent path,
// not kept in L1. Only for data no CTA writes during the launch.
template <L2 H = L2::normal>
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    uint4 v;
    if constexpr (H == L2::normal) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p), "l"(l2_evict_first()));
    }
    return v;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
// 16 bytes from a shared-window address (a 32-bit register, not a
// generic pointer). Ordered after the writes that completed an mbarrier
// phase this thread waited for; volatile keeps it after that wait.
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 writes zeros (rows
// beyond the matrix; the source address must still be a valid one).
template <L2 H = L2::normal>
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    if constexpr (H == L2::normal) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                     "r"(src_bytes)
                     : "memory");
    } else {
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                     "l"(src), "r"(src_bytes), "l"(l2_evict_first())
                     : "memory");
    }
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Bulk tensor copies (sm_90 and later): one instruction moves a box of a
// 2-D tensor (a CUtensorMap the host encoded) into shared memory and
// completes its bytes on an mbarrier. No swizzle: the destination is
// 128-byte aligned. Defined on every arch so that code choosing by
// kHasBulkCopies compiles everywhere; before sm_90 they trap.
#if __CUDA_ARCH__ >= 900
constexpr bool kHasBulkCopies = true;
#define QMK_BULK_ASM(...) asm volatile(__VA_ARGS__)
#else
constexpr bool kHasBulkCopies = false;
#define QMK_BULK_ASM(...) __trap()
#endif
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    QMK_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(u32 bar) {
    QMK_BULK_ASM("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's mbarrier inits before their use by the copies.
__device__ __forceinline__ void mbar_init_fence() {
    QMK_BULK_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's earlier generic-proxy accesses (shared and global)
// before its later bulk copies.
__device__ __forceinline__ void fence_proxy_async_all() {
    QMK_BULK_ASM("fence.proxy.async;\n" ::: "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    QMK_BULK_ASM(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Arrives on bar expecting `bytes`, then copies the box at (x, y) of the
// tensor `map` into dst; the copy's bytes complete the phase.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* map, u32 bar, u32 bytes, u32 x, u32 y) {
    QMK_BULK_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    QMK_BULK_ASM(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
#undef QMK_BULK_ASM

// D += A B on tensor cores: bf16 m16n8k16, f32 accumulation (sm_80+).
// Fragments (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, c = lane % 4):
//   A (16 x 16, row-major) a0 = A[g][2c..2c+1]   a1 = A[g+8][2c..2c+1]
//                          a2 = A[g][2c+8..+9]   a3 = A[g+8][2c+8..+9]
//   B (16 x 8, "col")      b0 = B[2c..2c+1][g]   b1 = B[2c+8..+9][g]
//   C (16 x 8, f32)        c0,c1 = C[g][2c..2c+1]  c2,c3 = C[g+8][2c..2c+1]
// The lower-indexed element of a pair sits in the low 16 bits.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The transpose of an 8 x 8 bf16 matrix held as m8n8 fragments (lane l:
// row l / 4, columns 2 (l % 4) and + 1), in registers.
__device__ __forceinline__ u32 movmatrix_trans(u32 a) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}

// Two f32 -> one bf16x2 word (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 cvt_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A plain volatile load as its own instruction: the compiler may merge a C++
// `cond ? *ptr : param` into one load through a parameter-space address.
__device__ __forceinline__ u32 ld_volatile_u32(u64 addr) {
    u32 v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
    return v;
}

__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// System scope: a tensor-parallel rank's flags are read and written by
// peers on other GPUs.
__device__ __forceinline__ u32 ld_acquire_sys_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys_u32(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_add_u32(u32* p, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_add_u64(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_u64(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Fixed-order reductions: the same inputs give the same bits in every CTA and
// every run (no float atomics anywhere in the kernel).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(QMK_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(QMK_FULL_MASK, v, o));
    return v;
}

// Sum over the CTA; every thread gets the total. `red` holds QMK_WARPS floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < QMK_WARPS ? red[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();  // red is reused by the next call
    return t;
}

// 8 bf16 weights (one 16-byte load) dotted with 8 f32 activations, fixed order.
__device__ __forceinline__ float dot8(const uint4 w, const float4 a, const float4 b, float acc) {
    acc = fmaf(bf16_lo(w.x), a.x, acc);
    acc = fmaf(bf16_hi(w.x), a.y, acc);
    acc = fmaf(bf16_lo(w.y), a.z, acc);
    acc = fmaf(bf16_hi(w.y), a.w, acc);
    acc = fmaf(bf16_lo(w.z), b.x, acc);
    acc = fmaf(bf16_hi(w.z), b.y, acc);
    acc = fmaf(bf16_lo(w.w), b.z, acc);
    acc = fmaf(bf16_hi(w.w), b.w, acc);
    return acc;
}

// Argmax pair ordering: larger value wins, ties go to the lower index, NaN
// never wins (comparisons with NaN are false).
__device__ __forceinline__ bool better(float v, u32 i, float bv, u32 bi) {
    return v > bv || (v == bv && i < bi);
}

}  // namespace qmk
