// prefill/gemm.cuh: Y[T, N] = X[T, K] . W[N, K]^T on tensor cores, for the
// whole chunk, with the epilogue fused (bias, residual add, SiLU x up).
//
// X is bf16 in global memory (written earlier in this launch, by other CTAs:
// read with cp.async.cg, which goes through L2 and never a stale L1); W is a
// weight tensor's layer slice, rows addressed exactly as the decode kernel
// does (chunk base + koff_t offset). A layer slice lives in one chunk of the
// split plan (the planner cuts along layers), so a tile never straddles a
// chunk. NB = 1 or 2 weight tensors share one X tile (gate and up: the
// epilogue sees both results of the same output column).
//
// Multistage tensor-core mainloop (the CUTLASS sm80 "multistage" shape):
//   CTA tile BM x 128 B-rows (NB = 2: 64 columns of each tensor), K step 32,
//   kGemmStages shared-memory stages filled with 16-byte cp.async.cg
//   (zero-fill beyond the valid rows), fragments read with ldmatrix.x4 from
//   rows padded to 40 bf16 (80 B: the 8 row addresses of one 8x8 matrix hit
//   8 distinct 16-byte bank groups, no conflicts), mma.sync m16n8k16 bf16
//   with f32 accumulators. Both operands are K-contiguous, so neither needs
//   ldmatrix .trans.
//   16 warps: BM = 128 -> 4 (M) x 4 (N), warp tile 32 x 32;
//             BM =  64 -> 2 (M) x 8 (N), warp tile 32 x 16 (small chunks:
//             twice the tiles, fewer idle SMs).
// Work = ceil(T / BM) x ceil(N / (128 / NB)) tiles, strided over the grid.
#pragma once

namespace qmk {

constexpr u32 kGemmBN = 128;  // B rows per CTA tile (all NB tensors together)
constexpr u32 kGemmBK = 32, kGemmLd = kGemmBK + 8, kGemmStages = 4;
constexpr u32 kGemmBMMax = 128;
// Shared memory of the GEMM mainloop (largest BM), bytes; the host's twin is
// qmk_kernels::prefill_smem_bytes (PREFILL_GEMM_TILE, PREFILL_GEMM_STAGES).
constexpr u32 gemm_smem_bytes() { return kGemmStages * (kGemmBMMax + kGemmBN) * kGemmLd * 2u; }
static_assert(QMK_THREADS == 512, "the GEMM tile assumes 16 warps");

// Rows of one weight tensor's layer slice: row(n) = base + li*s0 + n*s1 in
// koff_t, the same value LayerView::row gives (offset3), selectable at run
// time (q, k and v tiles share one instantiation). A tensor the decode step
// reads on tensor cores is stored in tile order (TileOrder): bands of B rows
// (16 or 8) of 32-column k-steps, each B x 32 block row by row; its 16-byte
// pieces stay whole, so the loaders change only their addresses (piece,
// kmul).
struct WRows {
    const char* base;
    koff_t layer_off;  // li * stride0 bytes (koff_t)
    koff_t row_bytes;  // stride1 bytes
    u32 kmul;          // 1 in row-major order; B, the band's rows, in tile order
    __device__ __forceinline__ const char* row(u32 n) const {
        return base + (koff_t)(layer_off + (koff_t)n * row_bytes);
    }
    // The 16-byte piece at byte kb (a multiple of 16) of row n; byte kb + d
    // of a k-step start d (a multiple of 64 bytes) lies d * kmul further.
    __device__ __forceinline__ const char* piece(u32 n, u32 kb) const {
        if (kmul == 1u) return row(n) + kb;
        return base + (koff_t)(layer_off + (koff_t)(n & ~(kmul - 1u)) * row_bytes + (n & (kmul - 1u)) * 64u +
                               (kb / 64u) * (kmul * 64u) + kb % 64u);
    }
};

template <class T>
__device__ __forceinline__ WRows wrows(const u64 (&chunks)[QMK_MAX_CHUNKS], u32 layer) {
    const LayerView<T> v(chunks, layer);
    WRows r;
    r.base = v.base;
    r.layer_off = (koff_t)(v.li * (koff_t)(T::kStride0 * 2u));
    r.row_bytes = (koff_t)(T::kStride1 * 2u);
    r.kmul = TileOrder<T>::rows ? TileOrder<T>::rows : 1u;
    return r;
}

// Four 8x8 bf16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// One BM x (128 / NB per tensor) output tile: rows m0.., columns n0.. of
// each W (n < n_end valid). a: X [T, K] bf16 with row pitch lda_bytes; rows
// >= t_end read as zero. epi(t, n, v0[NB], v1[NB]): columns n and n + 1 of
// row t (both valid), one value per tensor.
template <int BM, int NB, int K, class Epi>
__device__ __forceinline__ void gemm_tile(const char* a, u32 lda_bytes, u32 t_end, u32 m0,
                                          const WRows (&w)[NB], u32 n0, u32 n_end, u16* smem,
                                          Epi epi) {
    static_assert(BM == 64 || BM == 128, "BM is 64 or 128");
    static_assert(NB == 1 || NB == 2, "one or two weight tensors");
    static_assert(K % kGemmBK == 0, "K must be a multiple of the K step");
    constexpr u32 WM = BM / 32;              // warps along M (32 rows each)
    constexpr u32 WN = QMK_WARPS / WM;       // warps along N
    constexpr u32 WNC = kGemmBN / WN;        // B rows (columns of Y) per warp: 32 or 16
    constexpr u32 WNT = WNC / NB;            // of which per tensor
    constexpr u32 JT = WNC / 8;              // mma n-tiles per warp
    constexpr u32 JTB = JT / NB;             // per tensor
    constexpr u32 KT = (u32)K / kGemmBK;     // K steps
    constexpr u32 STAGE = (BM + kGemmBN) * kGemmLd;  // u16 per stage
    static_assert(JTB >= 1 && JT % 2 == 0, "the B ldmatrix.x4 covers two n-tiles");
    static_assert(kGemmStages * STAGE * 2u <= gemm_smem_bytes(), "GEMM stages exceed the smem");

    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, c = lane & 3;
    const u32 wm = warp / WN, wn = warp % WN;

    // Loader roles, 16-byte pieces (4 per 32-wide row): A: BM x 4 pieces
    // (threads 0 .. 4 BM - 1); B: 128 x 4 = one piece per thread.
    const u32 lrow = tid >> 2, lpiece = tid & 3;
    const bool a_loader = lrow < (u32)BM;
    const u32 a_ok = (a_loader && m0 + lrow < t_end) ? 16u : 0u;
    const char* a_src = a + (size_t)(m0 + (a_ok ? lrow : 0u)) * lda_bytes + lpiece * 16u;
    // B row lrow of the tile: warp column group lrow / WNC; inside it the
    // first WNT rows belong to tensor 0, the next WNT to tensor 1, so one
    // warp holds gate and up of the same output columns.
    const u32 bgrp = lrow / WNC, bin = lrow % WNC;
    const u32 bt = bin / WNT;
    const u32 bn = n0 + bgrp * WNT + bin % WNT;
    const u32 b_ok = bn < n_end ? 16u : 0u;
    const WRows wb = NB == 1 ? w[0] : w[bt < 1 ? 0 : NB - 1];
    const char* b_src = wb.piece(b_ok ? bn : n0, lpiece * 16u);
    const u32 b_kmul = wb.kmul;
    const u32 sbase = smem_u32(smem);
    const u32 a_dst = sbase + (lrow * kGemmLd + lpiece * 8u) * 2u;
    const u32 b_dst = sbase + ((BM + lrow) * kGemmLd + lpiece * 8u) * 2u;

    auto load_stage = [&](u32 kt, u32 s) {
        const u32 so = s * STAGE * 2u;
        const size_t ko = (size_t)kt * kGemmBK * 2u;
        if (a_loader) cp_async16(a_dst + so, a_src + ko, a_ok);
        cp_async16(b_dst + so, b_src + ko * b_kmul, b_ok);
    };

    float acc[2][JT][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < (int)JT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    // ldmatrix lane addresses (u16 offsets inside a stage).
    //   A, m-tile i: row wm*32 + i*16 + lane%16, k (lane/16)*8
    //   B, n-tile pair jp: row BM + wn*WNC + jp*16 + (lane/16)*8 + lane%8,
    //      k ((lane/8)%2)*8   (matrices: n 0-7 k 0-7 | n 0-7 k 8-15 |
    //      n 8-15 k 0-7 | n 8-15 k 8-15 = b0, b1 of two n-tiles)
    const u32 a_frag = ((wm * 32 + (lane & 15)) * kGemmLd + (lane >> 4) * 8u) * 2u;
    const u32 b_frag =
        ((BM + wn * WNC + (lane >> 4) * 8u + (lane & 7)) * kGemmLd + ((lane >> 3) & 1u) * 8u) * 2u;

    // The previous tile's last fragment reads are done before the prologue
    // overwrites its stages.
    __syncthreads();
#pragma unroll
    for (u32 s = 0; s < kGemmStages - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
#pragma unroll 1
    for (u32 kt = 0; kt < KT; ++kt) {
        // Stage kt has landed (this thread's copies), then every thread's.
        cp_async_wait<(int)kGemmStages - 2>();
        __syncthreads();
        // Refill the stage consumed in iteration kt - 1 (every warp is past
        // it: the barrier above).
        const u32 nk = kt + kGemmStages - 1;
        if (nk < KT) load_stage(nk, nk % kGemmStages);
        cp_async_commit();
        const u32 so = sbase + (kt % kGemmStages) * STAGE * 2u;
#pragma unroll
        for (u32 kk = 0; kk < kGemmBK; kk += 16) {
            u32 af[2][4];
#pragma unroll
            for (u32 i = 0; i < 2; ++i) ldmatrix_x4(af[i], so + a_frag + (i * 16 * kGemmLd + kk) * 2u);
#pragma unroll
            for (u32 jp = 0; jp < JT / 2; ++jp) {
                u32 bf[4];
                ldmatrix_x4(bf, so + b_frag + (jp * 16 * kGemmLd + kk) * 2u);
#pragma unroll
                for (u32 i = 0; i < 2; ++i) {
                    mma_bf16_16816(acc[i][2 * jp], af[i], bf[0], bf[1]);
                    mma_bf16_16816(acc[i][2 * jp + 1], af[i], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (u32 j = 0; j < JTB; ++j) {
        const u32 n = n0 + wn * WNT + j * 8 + 2 * c;
        if (n >= n_end) continue;
#pragma unroll
        for (u32 i = 0; i < 2; ++i)
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 t = m0 + wm * 32 + i * 16 + g + 8 * h;
                if (t >= t_end) continue;
                float v0[NB], v1[NB];
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    v0[b] = acc[i][j + b * JTB][2 * h];
                    v1[b] = acc[i][j + b * JTB][2 * h + 1];
                }
                epi(t, n, v0, v1);
            }
    }
}

// Row-tile height of a GEMM phase over t rows and nt column tiles on `grid`
// CTAs: 64-row tiles when their waves finish sooner (fewer idle CTAs in the
// last wave); a 64-row tile is costed at 0.6 of a 128-row one (lower
// mma : ldmatrix ratio, same per-tile fixed cost). Uniform over the grid.
__device__ __forceinline__ bool gemm_use_bm64(u32 t, u32 nt, u32 grid) {
    const u32 t128 = ((t + 127) / 128) * nt, t64 = ((t + 63) / 64) * nt;
    const u32 w128 = (t128 + grid - 1) / grid, w64 = (t64 + grid - 1) / grid;
    return w64 * 6u < w128 * 10u;
}

}  // namespace qmk
