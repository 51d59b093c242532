// What the step labs share (mt.cu on CUDA cores, ../tensor-dot/td.cu on
// tensor cores): the model shapes (LAB_SHAPE 0 = 0.5B, 1 = 7B, 2 = 14B,
// 3 = 32B, 4 = 1.5B, 5 = 3B), one layer's weight layout and its fill, the weight load, the
// kernel's grid barrier, the plain read that defines the floor, and the
// timing of one step launch.
#pragma once
#include "../ring-tile/ring.cuh"  // CK, dot8 (the kernel's order), warp_sum

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int kGrid = 132;  // CTAs, one per SM
constexpr int kLayers = 8;  // each with its own weights
constexpr int kTMax = 8;

#ifndef LAB_SHAPE
#define LAB_SHAPE 1
#endif
#if LAB_SHAPE == 0
constexpr int H = 896, Q = 896, KV = 128, I = 4864;
static const char* kName = "0.5B";
#elif LAB_SHAPE == 1
constexpr int H = 3584, Q = 3584, KV = 512, I = 18944;
static const char* kName = "7B";
#elif LAB_SHAPE == 2
constexpr int H = 5120, Q = 5120, KV = 1024, I = 13824;
static const char* kName = "14B";
#elif LAB_SHAPE == 3
constexpr int H = 5120, Q = 5120, KV = 1024, I = 27648;
static const char* kName = "32B";
#elif LAB_SHAPE == 4
constexpr int H = 1536, Q = 1536, KV = 256, I = 8960;
static const char* kName = "1.5B";
#elif LAB_SHAPE == 5
constexpr int H = 2048, Q = 2048, KV = 256, I = 11008;
static const char* kName = "3B";
#else
#error "LAB_SHAPE is 0 to 5"
#endif
constexpr int QKV = Q + 2 * KV;

// Elements of one layer's weights and where each matrix starts in it.
constexpr size_t kOffQkv = 0, kOffO = kOffQkv + (size_t)QKV * H, kOffGu = kOffO + (size_t)H * Q,
                 kOffD = kOffGu + (size_t)2 * I * H, kLayerElems = kOffD + (size_t)H * I;

__device__ __forceinline__ uint4 ld_weight16(const void* p, uint64_t pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}

// f32 to bf16 bits, rounded to nearest even (NaN stays NaN).
__host__ __device__ __forceinline__ uint32_t bf16_bits(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
}

// The kernel's grid barrier: one counter, a release add, acquire polls.
__device__ __forceinline__ void grid_sync(unsigned* cnt, unsigned& gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        ++gen;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(cnt) : "memory");
        const unsigned target = gen * gridDim.x;
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(cnt) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

// Weights: uniform in +-sqrt(3 / K) (bf16, round to nearest even), so each
// output has about its input's scale through the layers.
__global__ void fill_weights(uint16_t* w, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t e = i % kLayerElems;
        const int k = e < kOffO ? H : e < kOffGu ? Q : e < kOffD ? H : I;
        uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 31;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 29;
        const float u = (float)(h >> 40) / (float)(1ull << 24) * 2.0f - 1.0f;
        w[i] = (uint16_t)bf16_bits(u * sqrtf(3.0f / (float)k));
    }
}

// The first layer's inputs [kTMax][H]: uniform in [-1, 1).
static std::vector<float> lab_inputs() {
    std::vector<float> hx((size_t)kTMax * H);
    uint32_t s = 12345;
    for (auto& v : hx) {
        s = s * 1664525u + 1013904223u;
        v = (float)(s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
    }
    return hx;
}

// The plain streaming read that defines the floor: 16-byte loads, 4 in
// flight per thread.
__global__ void plain_read(const uint4* p, size_t n, unsigned* sink) {
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = __ldcs(p + i + q * stride);
#pragma unroll
        for (int q = 0; q < 4; ++q) acc ^= v[q].x ^ v[q].y ^ v[q].z ^ v[q].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Median microseconds of `reps` launches after one warm-up; the barrier
// counter is zeroed before each.
template <class Kernel, class Args>
static float time_launches(Kernel k, const Args& args, int threads, int smem_bytes, unsigned* bar, int reps) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ts;
    for (int r = 0; r < reps + 1; ++r) {
        if (bar) CK(cudaMemset(bar, 0, 4));
        CK(cudaEventRecord(e0));
        k<<<kGrid, threads, smem_bytes>>>(args);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r) ts.push_back(ms * 1000.0f);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return median(ts);
}

// A step kernel with its dynamic shared memory set; exits where one CTA
// does not fit on an SM (the grid barrier needs every CTA resident).
template <class Kernel>
static void prepare_step(Kernel k, int threads, int smem_bytes, const char* what) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, threads, smem_bytes));
    if (per_sm < 1) {
        printf("%s: does not fit on an SM\n", what);
        exit(1);
    }
}

// The plain read of n bytes at w, median of 7 after a warm-up, in us.
static float plain_read_us(const void* w, size_t n) {
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> rt;
    for (int r = 0; r < 8; ++r) {
        CK(cudaEventRecord(e0));
        plain_read<<<kGrid * 4, 512>>>(reinterpret_cast<const uint4*>(w), n / 16, sink);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r) rt.push_back(ms * 1000.0f);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaFree(sink));
    return median(rt);
}
