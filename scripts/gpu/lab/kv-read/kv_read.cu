// kv_read.cu: how fast 132 CTAs read a decode step's K/V cache (7B at
// 32,768 positions: 28 layers x [32,768 rows, 4 kv heads x 128 dims] bf16,
// K and V, 1.88 GB) in the access patterns a split attention can use.
//   quarter, head-major items: CTA c reads kv head g = c / 33 of the rows of
//     block s = c % 33 (256 of each row's 1,024 bytes), as the kernel's
//     split attention does (item = g * S + s);
//   quarter, block-major items: the same items dealt g = c % 4, s = c / 4
//     (the four CTAs that share a row block are neighbours);
//   whole rows: CTA c reads all 4 heads of rows [c B', (c + 1) B'), B' =
//     32,768 / 132;
//   plain: each CTA a contiguous 1 / 132 of every layer's K and V bytes.
// Every lane keeps 8 16-byte loads in flight (ld.global.cg, as the kernel's
// copies go through L2). Best of 5 launches, GB/s of the 1.88 GB.
// Build and run: bash scripts/gpu/lab/kv-read/run.sh
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

constexpr int kLayers = 28, kRows = 32768, kRowBytes = 1024, kHeads = 4, kCtas = 132, kThreads = 512;
constexpr size_t kLayerBytes = (size_t)kRows * kRowBytes;  // one of K or V

__device__ __forceinline__ uint4 ldcg(const char* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

// Reads `pieces` 16-byte pieces; piece i is at addr(i). 8 in flight per lane.
template <typename F>
__device__ __forceinline__ uint32_t read_pieces(uint32_t pieces, F addr) {
    uint32_t acc = 0;
    for (uint32_t i0 = threadIdx.x; i0 < pieces; i0 += 8 * kThreads) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const uint32_t i = i0 + u * kThreads;
            v[u] = i < pieces ? ldcg(addr(i)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    return acc;
}

__global__ void __launch_bounds__(kThreads, 1) kv_read(const char* k, const char* v, int mode, uint32_t* sink) {
    uint32_t acc = 0;
    const int c = blockIdx.x;
    for (int layer = 0; layer < kLayers; ++layer) {
        for (int kv = 0; kv < 2; ++kv) {
            const char* base = (kv ? v : k) + (size_t)layer * kLayerBytes;
            if (mode == 0 || mode == 1) {
                const int S = kCtas / kHeads;  // 33
                const int g = mode == 0 ? c / S : c % kHeads, s = mode == 0 ? c % S : c / kHeads;
                const uint32_t B = (kRows + S - 1) / S, r0 = s * B, r1 = min((uint32_t)kRows, r0 + B);
                // 16 pieces of 16 bytes per row (the head's 256 bytes)
                acc ^= read_pieces((r1 - r0) * 16, [&](uint32_t i) {
                    return base + (size_t)(r0 + i / 16) * kRowBytes + g * 256 + (i % 16) * 16;
                });
            } else if (mode == 2) {
                const uint32_t B = (kRows + kCtas - 1) / kCtas, r0 = c * B, r1 = min((uint32_t)kRows, r0 + B);
                acc ^= read_pieces((r1 - r0) * 64, [&](uint32_t i) { return base + (size_t)r0 * kRowBytes + (size_t)i * 16; });
            } else {
                const size_t per = kLayerBytes / kCtas / 16 * 16;
                acc ^= read_pieces((uint32_t)(per / 16), [&](uint32_t i) { return base + c * per + (size_t)i * 16; });
            }
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
    char *k, *v;
    uint32_t* sink;
    const size_t bytes = (size_t)kLayers * kLayerBytes;
    if (cudaMalloc(&k, bytes) || cudaMalloc(&v, bytes) || cudaMalloc(&sink, 4)) { printf("alloc failed\n"); return 1; }
    cudaMemset(k, 1, bytes);
    cudaMemset(v, 2, bytes);
    const char* names[4] = {"quarter rows, head-major items (the kernel's)", "quarter rows, block-major items",
                            "whole rows, one block per CTA", "plain contiguous read"};
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int round = 0; round < 2; ++round)
        for (int mode = 0; mode < 4; ++mode) {
            float best = 1e9f;
            for (int it = 0; it < 5; ++it) {
                cudaEventRecord(a);
                kv_read<<<kCtas, kThreads>>>(k, v, mode, sink);
                cudaEventRecord(b);
                cudaEventSynchronize(b);
                float ms;
                cudaEventElapsedTime(&ms, a, b);
                if (ms < best) best = ms;
            }
            if (cudaGetLastError() != cudaSuccess) { printf("launch failed\n"); return 1; }
            printf("%-48s %8.1f us  %7.0f GB/s\n", names[mode], best * 1e3, 2.0 * bytes / (best * 1e-3) / 1e9);
        }
    return 0;
}
