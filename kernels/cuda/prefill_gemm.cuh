// prefill_gemm.cuh: Y[T, N] = X[T, K] . W[N, K]^T on tensor cores, for the
// whole chunk, with the epilogue fused (bias, residual add, SiLU x up).
//
// X is bf16 in global memory (written earlier in this launch: coherent
// loads); W is a weight tensor's layer slice, rows addressed exactly as the
// decode kernel does (chunk base + koff_t offset). NB = 1 or 2 weight
// tensors share one X tile (gate and up: the epilogue sees both results).
//
// CTA tile BM x BN = 64 x 128, K step BK = 32; 16 warps as 4 (M) x 4 (N),
// each warp 16 x 32 = 4 mma n-tiles per 16-wide k-step. One shared-memory
// stage; the next K step's global loads are issued before the current
// step's mma (register double buffer). Rows padded to 40 bf16 (80 B): the
// fragment reads of a warp hit 32 distinct banks.
// Work = ceil(T / BM) x ceil(N / BN) tiles, strided over the grid.
#pragma once

namespace qmk {

constexpr u32 kGemmBM = 64, kGemmBN = 128, kGemmBK = 32, kGemmLd = kGemmBK + 8;
// Shared memory of one GEMM with NB weight tensors, bytes.
constexpr u32 gemm_smem_bytes(u32 nb) { return (kGemmBM + nb * kGemmBN) * kGemmLd * 2u; }
static_assert(QMK_THREADS == 512, "the GEMM tile assumes 16 warps");

// Rows of one weight tensor's layer slice: row(n) = base + li*s0 + n*s1 in
// koff_t, the same value LayerView::row gives (offset3), selectable at run
// time (q, k and v tiles share one instantiation).
struct WRows {
    const char* base;
    koff_t layer_off;  // li * stride0 bytes (koff_t)
    koff_t row_bytes;  // stride1 bytes
    __device__ __forceinline__ const char* row(u32 n) const {
        return base + (koff_t)(layer_off + (koff_t)n * row_bytes);
    }
};

template <class T>
__device__ __forceinline__ WRows wrows(const u64 (&chunks)[QMK_MAX_CHUNKS], u32 layer) {
    const LayerView<T> v(chunks, layer);
    WRows r;
    r.base = v.base;
    r.layer_off = (koff_t)(v.li * (koff_t)(T::kStride0 * 2u));
    r.row_bytes = (koff_t)(T::kStride1 * 2u);
    return r;
}

// One BM x BN output tile: rows m0.., columns n0.. of W (n < n_end valid).
// a: X [T, K] bf16 with row pitch lda_bytes; rows >= t_end read as zero.
// epi(t, n, v0[NB], v1[NB]): columns n and n + 1 of row t (both valid).
template <int NB, int K, class Epi>
__device__ __forceinline__ void gemm_tile(const char* a, u32 lda_bytes, u32 t_end, u32 m0,
                                          const WRows (&w)[NB], u32 n0, u32 n_end, u16* smem,
                                          Epi epi) {
    static_assert(K % kGemmBK == 0, "K must be a multiple of the K step");
    u16* As = smem;                       // [BM][Ld]
    u16* Bs = smem + kGemmBM * kGemmLd;   // [NB][BN][Ld]
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, c = lane & 3;
    const u32 wm = warp >> 2, wn = warp & 3;
    // Loader roles: A: threads 0..255, row tid/4, 16-byte piece tid%4.
    //               B: every thread, row tid/4 (0..127), piece tid%4, per tensor.
    const u32 lrow = tid >> 2, lpiece = tid & 3;
    const bool a_loader = tid < kGemmBM * 4;
    const bool a_valid = a_loader && m0 + lrow < t_end;
    const char* a_src = a + (size_t)(m0 + (a_valid ? lrow : 0)) * lda_bytes + lpiece * 16u;
    const bool b_valid = n0 + lrow < n_end;
    const char* b_src[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) b_src[b] = w[b].row(b_valid ? n0 + lrow : n0) + lpiece * 16u;

    float acc[NB][4][4];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[b][j][e] = 0.0f;

    uint4 ra = make_uint4(0, 0, 0, 0), rb[NB];
    auto load = [&](u32 k0) {
        if (a_valid) ra = *reinterpret_cast<const uint4*>(a_src + (size_t)k0 * 2);
#pragma unroll
        for (int b = 0; b < NB; ++b)
            rb[b] = b_valid ? ld_weight16(b_src[b] + (size_t)k0 * 2) : make_uint4(0, 0, 0, 0);
    };
    load(0);
#pragma unroll 1
    for (u32 k0 = 0; k0 < (u32)K; k0 += kGemmBK) {
        __syncthreads();  // the previous step's fragment reads are done
        if (a_loader) *reinterpret_cast<uint4*>(As + lrow * kGemmLd + lpiece * 8) = ra;
#pragma unroll
        for (int b = 0; b < NB; ++b)
            *reinterpret_cast<uint4*>(Bs + (b * kGemmBN + lrow) * kGemmLd + lpiece * 8) = rb[b];
        __syncthreads();
        if (k0 + kGemmBK < (u32)K) load(k0 + kGemmBK);
#pragma unroll
        for (u32 kk = 0; kk < kGemmBK; kk += 16) {
            u32 af[4];
            const u16* ap = As + (wm * 16 + g) * kGemmLd + kk + 2 * c;
            af[0] = *reinterpret_cast<const u32*>(ap);
            af[1] = *reinterpret_cast<const u32*>(ap + 8 * kGemmLd);
            af[2] = *reinterpret_cast<const u32*>(ap + 8);
            af[3] = *reinterpret_cast<const u32*>(ap + 8 * kGemmLd + 8);
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u16* bp = Bs + (b * kGemmBN + wn * 32 + j * 8 + g) * kGemmLd + kk + 2 * c;
                    mma_bf16_16816(acc[b][j], af, *reinterpret_cast<const u32*>(bp),
                                   *reinterpret_cast<const u32*>(bp + 8));
                }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 n = n0 + wn * 32 + j * 8 + 2 * c;
        if (n >= n_end) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 t = m0 + wm * 16 + g + 8 * h;
            if (t >= t_end) continue;
            float v0[NB], v1[NB];
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                v0[b] = acc[b][j][2 * h];
                v1[b] = acc[b][j][2 * h + 1];
            }
            epi(t, n, v0, v1);
        }
    }
}

}  // namespace qmk
