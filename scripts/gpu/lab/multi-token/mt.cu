// Multi-token weight phases: what a decode step's weight stream costs when
// every weight row is used for T consecutive tokens (T = 1..8) instead of
// one, as a speculative verify step would use it.
//
// The kernel's structure is kept: 132 CTAs x 16 warps, a grid barrier after
// every phase, each phase's input copied from global memory (written by
// other SMs in the same launch) into shared memory, each warp summing whole
// rows with the decode kernel's per-lane order (lane l takes 16-byte vectors
// l, l + 32, ... in ascending order, then the shuffle tree), so every
// token's sums are bit-identical to a one-token run; the lab checks that.
// A layer is four phases: q/k/v [Q + 2 KV, H], o_proj [H, Q], gate/up
// [2 I, H] (gate and up rows interleaved, a pair per unit as in the
// kernel) and down [H, I]; each reads the previous one's output. Where T
// inputs of K floats do not fit in shared memory (down from T = 3 at 7B)
// the phase runs over column chunks of a multiple of 256, each warp's
// sums held across the chunks, which keeps the order.
//
// Modes (rows per unit of q/k/v and gate/up / of o_proj and down; the
// shared-memory layout of the T input vectors):
//   0  2 / 1, each vector's 8 floats together (the kernel's layout: a
//      lane's two 16-byte shared loads are 32 bytes apart from its
//      neighbour's, two-way bank conflicts)
//   1  2 / 1, split halves (floats 0-3 of every vector, then floats 4-7:
//      neighbouring lanes read neighbouring 16 bytes)
//   2  4 / 2, split halves: each shared load feeds twice the rows
//   3  as 1, loads a batch ahead: two register sets of 8 vectors per lane
//      over the unit's rows, the next batch's loads issued before the
//      current batch's arithmetic
//   4  as 2, loads a batch ahead
// -DLAB_MODES_FROM=3 builds modes 3 and 4 only (and the reference, mode 0
// at T = 1); -DLAB_WARPS=8 runs 8 warps per CTA instead of 16, with twice
// the registers per thread.
//
// Build and run (sm_90; LAB_SHAPE 0 = 0.5B, 1 = 7B, 2 = 14B, 3 = 32B, 4 = 1.5B, 5 = 3B):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v -DLAB_SHAPE=1 -o /tmp/mt-7b mt.cu && /tmp/mt-7b
// `run.sh` builds and runs every shape.

#include "step_lab.cuh"  // shapes, weights, grid_sync, the plain read, timing; CK, dot8, warp_sum

#ifndef LAB_WARPS
#define LAB_WARPS 16
#endif
// Warps per CTA: the kernel's 16 (128 registers a thread), or 8 (255).
constexpr int kWarps = LAB_WARPS, kThreads = kWarps * 32;
constexpr int kSmemFloats = 50 * 1024;  // 200 KB of inputs per CTA

#ifndef LAB_MODES_FROM
#define LAB_MODES_FROM 0
#endif
__host__ __device__ constexpr int lane_vectors(int k) { return (k / 8 + 31) / 32; }
__host__ __device__ constexpr int even_batch(int n, int most) {
    return (n + (n + most - 1) / most - 1) / ((n + most - 1) / most);
}
// Vectors per lane per row in flight: the kernel's rule for one row (the
// whole row up to 20, else 8) and pairs (equal batches of at most 10);
// four rows at most 4 each.
__host__ __device__ constexpr int batch(int nr, int lv) {
    return nr == 1 ? (lv <= 20 ? lv : 8) : even_batch(lv, nr == 2 ? 10 : 4);
}
// With two batches in flight: 8 vectors per lane per set over the rows.
__host__ __device__ constexpr int pipe_batch(int nr) { return 8 / nr; }

// One weight phase: y[t][r] = W[r, :] . x[t][:] for t < T, rows [ROWS, K].
template <int K, int ROWS, int NR, int T, bool SPLIT, bool PIPE>
__device__ __forceinline__ void phase(const uint16_t* __restrict__ w, const float* x, int xstride,
                                      float* y, int ystride, float* xs, uint64_t pol) {
    constexpr int KC0 = (kSmemFloats / T) / 256 * 256;
    constexpr int KC = K < KC0 ? K : KC0;  // columns per chunk
    constexpr int NCH = (K + KC - 1) / KC;
    constexpr int NVC = KC / 8;  // vectors per chunk (the last may have fewer)
    constexpr int UNITS = ROWS / NR;
    constexpr int NWT = kGrid * kWarps;
    constexpr int MAXU = (UNITS + NWT - 1) / NWT;
    static_assert(ROWS % NR == 0 && K % 8 == 0, "shape");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int me = blockIdx.x * kWarps + warp;
    const float4* xs4 = reinterpret_cast<const float4*>(xs);

    // Chunk c of every token's input into shared memory: token t's vector
    // i at [t][2i], [t][2i + 1], or split: [t][i] and [t][NVC + i].
    auto copy_chunk = [&](int c) {
        const int n4 = (c + 1 < NCH ? KC : K - c * KC) / 4;
        float4* d = reinterpret_cast<float4*>(xs);
        for (int t = 0; t < T; ++t) {
            const float4* s = reinterpret_cast<const float4*>(x + (size_t)t * xstride + (size_t)c * KC);
            for (int j0 = threadIdx.x; j0 < n4; j0 += 4 * kThreads) {
                float4 v[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int j = j0 + q * kThreads;
                    if (j < n4) v[q] = __ldcg(s + j);
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int j = j0 + q * kThreads;
                    if (j < n4) d[t * 2 * NVC + (SPLIT ? (j & 1) * NVC + (j >> 1) : j)] = v[q];
                }
            }
        }
    };
    // acc[r][t] += rows . x over this chunk's vectors (nv of them).
    // PIPE: two register sets, the next batch's loads issued before the
    // current batch's arithmetic.
    constexpr int U = PIPE ? pipe_batch(NR) : batch(NR, (NVC + 31) / 32);
    auto load = [&](const uint16_t* const (&rows)[NR], int c, int nv, int base, uint4 (&wv)[NR][U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r)
                wv[r][u] = i < nv ? ld_weight16(rows[r] + ((size_t)c * NVC + i) * 8, pol)
                                  : make_uint4(0, 0, 0, 0);
        }
    };
    auto compute = [&](int nv, int base, const uint4 (&wv)[NR][U], float (&acc)[NR][T]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * 32 + lane;
            if (i < nv) {
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const float4 a = xs4[t * 2 * NVC + (SPLIT ? i : 2 * i)];
                    const float4 b = xs4[t * 2 * NVC + (SPLIT ? NVC + i : 2 * i + 1)];
#pragma unroll
                    for (int r = 0; r < NR; ++r) acc[r][t] = dot8(wv[r][u], a, b, acc[r][t]);
                }
            }
        }
    };
    auto chunk_dot = [&](const uint16_t* const (&rows)[NR], int c, int nv, float (&acc)[NR][T]) {
        if constexpr (PIPE) {
            uint4 wa[NR][U], wb[NR][U];
            load(rows, c, nv, 0, wa);
#pragma unroll 1
            for (int base = 0; base < nv; base += 64 * U) {
                if (base + 32 * U < nv) load(rows, c, nv, base + 32 * U, wb);
                compute(nv, base, wa, acc);
                if (base + 32 * U >= nv) break;
                if (base + 64 * U < nv) load(rows, c, nv, base + 64 * U, wa);
                compute(nv, base + 32 * U, wb, acc);
            }
        } else {
#pragma unroll 1
            for (int base = 0; base < nv; base += 32 * U) {
                uint4 wv[NR][U];
                load(rows, c, nv, base, wv);
                compute(nv, base, wv, acc);
            }
        }
    };
    auto finish = [&](int u, float (&acc)[NR][T]) {
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float s = warp_sum(acc[r][t]);
                if (lane == 0) y[(size_t)t * ystride + u * NR + r] = s;
            }
    };

    if constexpr (NCH == 1) {
        copy_chunk(0);
        __syncthreads();
#pragma unroll 1
        for (int u = me; u < UNITS; u += NWT) {
            const uint16_t* rows[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) rows[r] = w + (size_t)(u * NR + r) * K;
            float acc[NR][T];
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;
            chunk_dot(rows, 0, NVC, acc);
            finish(u, acc);
        }
    } else {
        float acc[MAXU][NR][T];
#pragma unroll
        for (int k = 0; k < MAXU; ++k)
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int t = 0; t < T; ++t) acc[k][r][t] = 0.0f;
#pragma unroll 1
        for (int c = 0; c < NCH; ++c) {
            if (c) __syncthreads();  // every warp is done with the last chunk
            copy_chunk(c);
            __syncthreads();
            const int nv = (c + 1 < NCH ? KC : K - c * KC) / 8;
#pragma unroll
            for (int k = 0; k < MAXU; ++k) {
                const int u = k * NWT + me;
                if (u < UNITS) {
                    const uint16_t* rows[NR];
#pragma unroll
                    for (int r = 0; r < NR; ++r) rows[r] = w + (size_t)(u * NR + r) * K;
                    chunk_dot(rows, c, nv, acc[k]);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < MAXU; ++k)
            if (k * NWT + me < UNITS) finish(k * NWT + me, acc[k]);
    }
}

struct Bufs {
    const uint16_t* w;  // [kLayers][kLayerElems] bf16
    const float* x0;    // [T][H]
    float *yqkv, *yo, *ygu, *yd;  // [T][QKV], [T][H], [T][2 I], [T][H]
    unsigned* bar;
};

template <int T, int MODE>
__global__ void __launch_bounds__(kThreads, 1) step(Bufs b) {
    extern __shared__ __align__(16) float xs[];
    constexpr bool SPLIT = MODE != 0, PIPE = MODE >= 3;
    constexpr int NRP = MODE == 2 || MODE == 4 ? 4 : 2, NRS = MODE == 2 || MODE == 4 ? 2 : 1;
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    unsigned gen = 0;
    for (int l = 0; l < kLayers; ++l) {
        const uint16_t* wl = b.w + (size_t)l * kLayerElems;
        phase<H, QKV, NRP, T, SPLIT, PIPE>(wl + kOffQkv, l ? b.yd : b.x0, H, b.yqkv, QKV, xs, pol);
        grid_sync(b.bar, gen);
        phase<Q, H, NRS, T, SPLIT, PIPE>(wl + kOffO, b.yqkv, QKV, b.yo, H, xs, pol);
        grid_sync(b.bar, gen);
        phase<H, 2 * I, NRP, T, SPLIT, PIPE>(wl + kOffGu, b.yo, H, b.ygu, 2 * I, xs, pol);
        grid_sync(b.bar, gen);
        phase<I, H, NRS, T, SPLIT, PIPE>(wl + kOffD, b.ygu, 2 * I, b.yd, H, xs, pol);
        grid_sync(b.bar, gen);
    }
}

struct Run {
    float us;
    std::vector<float> out;  // [T][H], the last layer's down output
};

template <int T, int MODE>
static Run run(Bufs b, float* yd, int reps) {
    auto k = step<T, MODE>;
    prepare_step(k, kThreads, kSmemFloats * 4, "a step");
    Run out{time_launches(k, b, kThreads, kSmemFloats * 4, b.bar, reps), std::vector<float>((size_t)T * H)};
    CK(cudaMemcpy(out.out.data(), yd, out.out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (prop.multiProcessorCount != kGrid) printf("note: %d SMs, the lab assumes %d\n", prop.multiProcessorCount, kGrid);
    const size_t n = kLayerElems * kLayers;
    uint16_t* w;
    CK(cudaMalloc(&w, n * 2));
    fill_weights<<<1024, 256>>>(w, n);
    float *x0, *yqkv, *yo, *ygu, *yd;
    unsigned* bar;
    CK(cudaMalloc(&x0, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&yqkv, (size_t)kTMax * QKV * 4));
    CK(cudaMalloc(&yo, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&ygu, (size_t)kTMax * 2 * I * 4));
    CK(cudaMalloc(&yd, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&bar, 64));
    const std::vector<float> hx = lab_inputs();
    CK(cudaMemcpy(x0, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());

    // The floor: a plain read of the same weights, median of 7.
    const double bytes = (double)n * 2;
    const float read_us = plain_read_us(w, n * 2);
    printf("%s, %d warps per CTA: %d layers, %.2f GB of weights; plain read %.1f us (%.0f GB/s)\n", kName,
           kWarps, kLayers, bytes / 1e9, read_us, bytes / read_us / 1e3);

    Bufs b{w, x0, yqkv, yo, ygu, yd, bar};
    // Every token's one-token run (mode 0, T = 1): the bits to match.
    std::vector<std::vector<float>> ref(kTMax);
    float t1_us = 0;
    for (int t = 0; t < kTMax; ++t) {
        Bufs bt = b;
        bt.x0 = x0 + (size_t)t * H;
        Run r = run<1, 0>(bt, yd, t == 0 ? 5 : 1);
        if (t == 0) t1_us = r.us;
        ref[t] = r.out;
    }
    printf("%-5s %-4s %10s %9s %8s %10s %s\n", "mode", "T", "us/layer", "% read", "x T=1", "us/token", "bits");
    auto report = [&](int mode, int T, const Run& r) {
        bool same = true;
        for (int t = 0; t < T && same; ++t)
            for (int i = 0; i < H; ++i)
                if (__builtin_memcmp(&r.out[(size_t)t * H + i], &ref[t][i], 4) != 0) {
                    same = false;
                    break;
                }
        printf("%-5d %-4d %10.2f %8.1f%% %8.3f %10.2f %s\n", mode, T, r.us / kLayers,
               100.0 * read_us / r.us, r.us / t1_us, r.us / kLayers / T, same ? "equal" : "DIFFER");
    };
#define ROW(T, M) report(M, T, run<T, M>(b, yd, 5))
#define MODE_ROWS(M) ROW(1, M); ROW(2, M); ROW(3, M); ROW(4, M); ROW(5, M); ROW(6, M); ROW(8, M)
#if LAB_MODES_FROM <= 0
    MODE_ROWS(0);
#endif
#if LAB_MODES_FROM <= 1
    MODE_ROWS(1);
#endif
#if LAB_MODES_FROM <= 2
    MODE_ROWS(2);
#endif
    MODE_ROWS(3);
    MODE_ROWS(4);
    return 0;
}
