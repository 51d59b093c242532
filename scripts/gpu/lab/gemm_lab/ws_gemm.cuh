// ws_gemm.cuh: a warp-specialised TMA + wgmma GEMM for the prefill shapes,
// built and measured standalone (gemm_lab.cu) before any integration into
// the cubin. Question it answers: does a CUTLASS-style pipeline (one producer
// thread issuing TMA boxes on an mbarrier full / empty ring, two consumer
// warpgroups with 232 registers each, optional 2-CTA multicast of the weight
// tile) beat the megakernel's all-threads cp.async mainloop on 7B gate/up
// and down at 2,048 tokens?
//
// Y[T, N] = X[T, K] . W[N, K]^T computed transposed (Y^T = W . X^T), as in
// kernels/cuda/prefill_wgmma.cuh: weight rows on wgmma's M side.
// CTA tile: 256 weight rows (two 128-row TMA boxes A0 / A1) x 128 tokens
// (box B), K step 64 (one 128-byte swizzle row). Consumer warpgroup c (0, 1)
// owns rows 64c.. of A0 and of A1 (two m64n128 accumulators, 128 f32): for
// gate/up, A0 = gate columns and A1 = up columns of the same 128 outputs, so
// SiLU(gate) * up is thread-local; for one weight tensor, A1 = rows + 128.
// With MC, the two CTAs of a cluster take token tiles 2u, 2u + 1 of the same
// weight tile; CTA r loads box A_r and multicasts it to both.
//
// Standalone on purpose (nvcc on the GPU machine, none of the megakernel's
// generated headers): the wgmma / mbarrier wrappers restate the ones in
// kernels/cuda/prefill_wgmma.cuh, and gemm() / gemm2() are two variants
// kept side by side for the comparison, not one code path.
// Results: docs/decisions/0010-warp-specialised-gemm-lab.md.
#pragma once

namespace ws {

typedef unsigned int u32;
typedef unsigned long long u64;
// A CUtensorMap's 128 bytes (cuda.h's type, which NVRTC sources lack).
struct alignas(64) TensorMap {
    u64 opaque[16];
};

constexpr u32 kBK = 64;
constexpr u32 kStages = 4;
constexpr u32 kBoxBytes = 128u * 128u;          // 128 rows x 128 B
constexpr u32 kStageBytes = 3u * kBoxBytes;     // A0, A1, B: 48 KB
constexpr u32 kSmemBytes = kStages * kStageBytes + 2u * 128u * 128u + 1024u;  // + staging, alignment
constexpr u32 kThreads = 384;                   // producer WG + 2 consumer WGs

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ u64 desc_sw128(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma128(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

// D[64 x 256] += A[64 x 16] . B[16 x 256] (f32 += bf16 . bf16), both K-major
// SWIZZLE_128B in shared memory.
__device__ __forceinline__ void wgmma256(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier at the same offset in cluster CTA `peer`.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 peer) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(peer)
        : "memory");
}
__device__ __forceinline__ void tma2d(u32 dst, const TensorMap* tm, u32 bar, u32 x, u32 y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(tm)), "r"(bar), "r"(x), "r"(y)
        : "memory");
}
__device__ __forceinline__ void tma2d_mc(u32 dst, const TensorMap* tm, u32 bar, u32 x, u32 y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(tm)), "r"(bar), "r"(x), "r"(y), "h"((unsigned short)3)
        : "memory");
}
__device__ __forceinline__ void tma4d(u32 dst, const TensorMap* tm, u32 bar, u32 x, u32 y, u32 z,
                                      u32 v) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(tm)), "r"(bar), "r"(x), "r"(y), "r"(z), "r"(v)
        : "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}

// What a launch computes. Tile p (of w_tiles x t_tiles, token tile fastest)
// covers weight rows: A0 = map a0 rows w * a_step .. + 128, A1 = map a1 rows
// w * a_step + a1_off .. + 128; tokens t * 128 .. + 128 of map b.
struct Job {
    u32 w_tiles, t_tiles, k_steps;
    u32 a_step, a1_off;
    u32 n_tokens;   // valid token rows
    u32 n_rows;     // valid output columns (per tensor)
    u32 out_pitch;  // output row pitch, elements
    void* out;
};

// Epilogue kinds: kGateUp: out bf16 [T, pitch] = silu(a0) * a1 at column
// w * 128 + r; kResidual: out f32 [T, pitch] += a0 at column w * 256 + r and
// a1 at column w * 256 + 128 + r.
// kProbe: no stores unless a value is exactly 1e30 (never, here): the
// mainloop alone, to time the epilogue by difference.
// kGateUpStaged: as kGateUp, through a per-warpgroup shared-memory tile
// (128 tokens x 64 columns, 16-byte chunks XOR-swizzled by token) so each
// token's 128 bytes leave in whole 16-byte stores; kResidualRed: as
// kResidual with red.global.add (one add per element: the same result,
// no load round trip).
enum : int { kGateUp = 0, kResidual = 1, kProbe = 2, kGateUpStaged = 3, kResidualRed = 4 };
constexpr u32 kOutWgBytes = 128u * 128u;  // staged epilogue, per consumer warpgroup

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    u32 u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

template <bool MC, int EPI>
__device__ __forceinline__ void gemm(const TensorMap* ma0, const TensorMap* ma1,
                                     const TensorMap* mb, const Job& job, char* dyn) {
    __shared__ __align__(8) u64 bars[2 * kStages];
    const u32 tid = threadIdx.x, warp = tid >> 5, wgi = warp >> 2;
    const u32 base = (smem_u32(dyn) + 1023u) & ~1023u;
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
    const u32 csize = MC ? 2u : 1u;
    const u32 rank = MC ? cluster_rank() : 0u;
    if (tid == 0) {
        for (u32 s = 0; s < kStages; ++s) {
            mbar_init(full0 + 8u * s, 1);
            // Every consumer warp of every CTA that reads this stage's bytes.
            mbar_init(empty0 + 8u * s, 8u * csize);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (MC)
        cluster_sync();
    else
        __syncthreads();

    const u32 tpairs = (job.t_tiles + csize - 1) / csize;
    const u32 units = job.w_tiles * tpairs;
    const u32 unit0 = blockIdx.x / csize, ustep = gridDim.x / csize;

    if (wgi == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            u32 s = 0, ph = 0;
            for (u32 u = unit0; u < units; u += ustep) {
                const u32 w = u / tpairs, t = (u % tpairs) * csize + rank;
                const u32 ra0 = w * job.a_step, ra1 = w * job.a_step + job.a1_off;
                for (u32 k = 0; k < job.k_steps; ++k) {
                    mbar_wait(empty0 + 8u * s, ph ^ 1u);
                    const u32 fb = full0 + 8u * s, st = base + s * kStageBytes;
                    mbar_expect_tx(fb, kStageBytes);
                    if (MC) {
                        if (rank == 0)
                            tma2d_mc(st, ma0, fb, k * kBK, ra0);
                        else
                            tma2d_mc(st + kBoxBytes, ma1, fb, k * kBK, ra1);
                    } else {
                        tma2d(st, ma0, fb, k * kBK, ra0);
                        tma2d(st + kBoxBytes, ma1, fb, k * kBK, ra1);
                    }
                    tma2d(st + 2u * kBoxBytes, mb, fb, k * kBK, t * 128u);
                    if (++s == kStages) {
                        s = 0;
                        ph ^= 1u;
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const u32 c = wgi - 1, lane = tid & 31, q = warp & 3u;
        u32 s = 0, ph = 0;
        float a0[64], a1[64];
        for (u32 u = unit0; u < units; u += ustep) {
            const u32 w = u / tpairs, t = (u % tpairs) * csize + rank;
#pragma unroll
            for (int i = 0; i < 64; ++i) {
                a0[i] = 0.0f;
                a1[i] = 0.0f;
            }
            u32 prev = 0;
            for (u32 k = 0; k < job.k_steps; ++k) {
                mbar_wait(full0 + 8u * s, ph);
                const u32 st = base + s * kStageBytes;
                const u64 d0 = desc_sw128(st + c * 64u * 128u);
                const u64 d1 = desc_sw128(st + kBoxBytes + c * 64u * 128u);
                const u64 db = desc_sw128(st + 2u * kBoxBytes);
                fence_acc(a0);
                fence_acc(a1);
                wg_fence();
#pragma unroll
                for (u32 kk = 0; kk < kBK / 16; ++kk) {
                    wgmma128(a0, d0 + kk * 2u, db + kk * 2u);
                    wgmma128(a1, d1 + kk * 2u, db + kk * 2u);
                }
                wg_commit();
                wg_wait<1>();
                fence_acc(a0);
                fence_acc(a1);
                // The previous stage's reads have retired in this warp.
                if (k > 0 && lane == 0) {
                    mbar_arrive(empty0 + 8u * prev);
                    if (MC) mbar_arrive_cluster(empty0 + 8u * prev, rank ^ 1u);
                }
                prev = s;
                if (++s == kStages) {
                    s = 0;
                    ph ^= 1u;
                }
            }
            wg_wait<0>();
            fence_acc(a0);
            fence_acc(a1);
            if (lane == 0) {
                mbar_arrive(empty0 + 8u * prev);
                if (MC) mbar_arrive_cluster(empty0 + 8u * prev, rank ^ 1u);
            }
            // Epilogue: acc[4j + 2h + e] = row 16q + g + 8h (of this
            // warpgroup's 64), token 8j + 2cc + e.
            const u32 g = lane >> 2, cc = lane & 3u;
            if (EPI == kGateUpStaged) {
                const u32 so = base + kStages * kStageBytes + c * kOutWgBytes;
                // The previous tile's reads of this buffer are done.
                asm volatile("bar.sync %0, 128;\n" ::"r"(1u + c) : "memory");
#pragma unroll
                for (u32 j = 0; j < 16; ++j)
#pragma unroll
                    for (u32 e = 0; e < 2; ++e)
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 tok = j * 8u + 2u * cc + e, col = q * 16u + g + 8u * h;
                            const int i = 4 * j + 2 * h + e;
                            const u32 addr = so + tok * 128u + (((col >> 3) ^ (tok & 7u)) << 4) + (col & 7u) * 2u;
                            asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr),
                                         "h"(f2bf(silu(a0[i]) * a1[i])));
                        }
                asm volatile("bar.sync %0, 128;\n" ::"r"(1u + c) : "memory");
                const u32 ti = tid & 127u;
#pragma unroll
                for (u32 k = 0; k < 8; ++k) {
                    const u32 idx = ti + 128u * k, tok = idx >> 3, ch = idx & 7u;
                    const u32 gt = t * 128u + tok, n = w * 128u + c * 64u + ch * 8u;
                    uint4 v;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                 : "r"(so + tok * 128u + ((ch ^ (tok & 7u)) << 4)));
                    if (gt < job.n_tokens && n < job.n_rows)
                        *reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(job.out) +
                                                  (size_t)gt * job.out_pitch + n) = v;
                }
                continue;
            }
#pragma unroll
            for (u32 j = 0; j < 16; ++j) {
#pragma unroll
                for (u32 e = 0; e < 2; ++e) {
                    const u32 tok = t * 128u + j * 8u + 2u * cc + e;
                    if (tok >= job.n_tokens) continue;
#pragma unroll
                    for (u32 h = 0; h < 2; ++h) {
                        const u32 r = c * 64u + q * 16u + g + 8u * h;
                        const int i = 4 * j + 2 * h + e;
                        if (EPI == kProbe) {
                            if (a0[i] == 1e30f) reinterpret_cast<float*>(job.out)[r] = a1[i];
                        } else if (EPI == kGateUp) {
                            const u32 n = w * 128u + r;
                            if (n < job.n_rows)
                                reinterpret_cast<unsigned short*>(job.out)[(size_t)tok * job.out_pitch + n] =
                                    f2bf(silu(a0[i]) * a1[i]);
                        } else if (EPI == kResidualRed) {
                            float* o = reinterpret_cast<float*>(job.out) + (size_t)tok * job.out_pitch;
                            const u32 n = w * 256u + r;
                            if (n < job.n_rows) atomicAdd(o + n, a0[i]);
                            if (n + 128u < job.n_rows) atomicAdd(o + n + 128u, a1[i]);
                        } else {
                            float* o = reinterpret_cast<float*>(job.out) + (size_t)tok * job.out_pitch;
                            const u32 n = w * 256u + r;
                            if (n < job.n_rows) o[n] += a0[i];
                            if (n + 128u < job.n_rows) o[n + 128u] += a1[i];
                        }
                    }
                }
            }
        }
    }
    // No CTA leaves while its peer may still multicast into it or arrive
    // on its barriers.
    if (MC) cluster_sync();
}

// Variant 2: CTA tile 128 weight rows x 256 tokens, consumer warpgroup c
// owns A rows 64c.. (one m64n256 accumulator, 128 f32): half the wgmma
// instructions of gemm() and B read once per warpgroup per k16 (shared
// memory reads per FLOP -17 %). A is one box of 128 rows: for gate/up a 4-D
// map over both tensors (K, 8 rows, gate / up, 8-row blocks) that lands
// blocks of 8 gate rows and the same 8 up rows alternately, so a thread's
// rows g and g + 8 are gate and up of one column (the megakernel's
// interleave, done by the copy engine). B is one box of 256 tokens.
struct Job2 {
    u32 w_tiles, t_tiles, k_steps;
    u32 n_tokens, n_rows, out_pitch;
    void* out;
};
constexpr u32 kStage2 = 128u * 128u + 256u * 128u;  // 48 KB

template <int EPI>
__device__ __forceinline__ void gemm2(const TensorMap* ma, const TensorMap* mb, const Job2& job,
                                      char* dyn) {
    __shared__ __align__(8) u64 bars[2 * kStages];
    const u32 tid = threadIdx.x, warp = tid >> 5, wgi = warp >> 2;
    const u32 base = (smem_u32(dyn) + 1023u) & ~1023u;
    const u32 full0 = smem_u32(&bars[0]), empty0 = smem_u32(&bars[kStages]);
    if (tid == 0) {
        for (u32 s = 0; s < kStages; ++s) {
            mbar_init(full0 + 8u * s, 1);
            mbar_init(empty0 + 8u * s, 8u);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const u32 units = job.w_tiles * job.t_tiles;
    if (wgi == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            u32 s = 0, ph = 0;
            for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
                const u32 w = u / job.t_tiles, t = u % job.t_tiles;
                for (u32 k = 0; k < job.k_steps; ++k) {
                    mbar_wait(empty0 + 8u * s, ph ^ 1u);
                    const u32 fb = full0 + 8u * s, st = base + s * kStage2;
                    mbar_expect_tx(fb, kStage2);
                    if (EPI == kGateUp)
                        tma4d(st, ma, fb, k * kBK, 0, 0, w * 8u);
                    else
                        tma2d(st, ma, fb, k * kBK, w * 128u);
                    tma2d(st + 128u * 128u, mb, fb, k * kBK, t * 256u);
                    if (++s == kStages) {
                        s = 0;
                        ph ^= 1u;
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const u32 c = wgi - 1, lane = tid & 31, q = warp & 3u;
        u32 s = 0, ph = 0;
        float a[128];
        for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
            const u32 w = u / job.t_tiles, t = u % job.t_tiles;
#pragma unroll
            for (int i = 0; i < 128; ++i) a[i] = 0.0f;
            u32 prev = 0;
            for (u32 k = 0; k < job.k_steps; ++k) {
                mbar_wait(full0 + 8u * s, ph);
                const u32 st = base + s * kStage2;
                const u64 da = desc_sw128(st + c * 64u * 128u);
                const u64 db = desc_sw128(st + 128u * 128u);
                fence_acc(a);
                wg_fence();
#pragma unroll
                for (u32 kk = 0; kk < kBK / 16; ++kk) wgmma256(a, da + kk * 2u, db + kk * 2u);
                wg_commit();
                wg_wait<1>();
                fence_acc(a);
                if (k > 0 && lane == 0) mbar_arrive(empty0 + 8u * prev);
                prev = s;
                if (++s == kStages) {
                    s = 0;
                    ph ^= 1u;
                }
            }
            wg_wait<0>();
            fence_acc(a);
            if (lane == 0) mbar_arrive(empty0 + 8u * prev);
            // acc[4j + 2h + e] = A row 64c + 16q + g + 8h, token 8j + 2cc + e.
            const u32 g = lane >> 2, cc = lane & 3u;
#pragma unroll
            for (u32 j = 0; j < 32; ++j) {
#pragma unroll
                for (u32 e = 0; e < 2; ++e) {
                    const u32 tok = t * 256u + j * 8u + 2u * cc + e;
                    if (tok >= job.n_tokens) continue;
                    if (EPI == kGateUp) {
                        const u32 n = w * 64u + c * 32u + q * 8u + g;
                        if (n < job.n_rows)
                            reinterpret_cast<unsigned short*>(job.out)[(size_t)tok * job.out_pitch + n] =
                                f2bf(silu(a[4 * j + e]) * a[4 * j + 2 + e]);
                    } else {
                        float* o = reinterpret_cast<float*>(job.out) + (size_t)tok * job.out_pitch;
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 n = w * 128u + c * 64u + q * 16u + g + 8u * h;
                            if (n < job.n_rows) o[n] += a[4 * j + 2 * h + e];
                        }
                    }
                }
            }
        }
    }
}

}  // namespace ws
