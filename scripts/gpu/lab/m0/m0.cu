// Lab M0 of the decode redesign: (a) the cost of one dependency edge
// between CTAs, (b) a producer-warp bulk-copy ring stream against a plain
// streaming read. Prints one line per measurement. See README.md.
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>
#include "m0_kernels.cuh"

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <typename F>
static float time_ms(F launch, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    launch();  // warm-up
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    return median(t);
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    const int sms = p.multiProcessorCount;
    printf("device %s, %d SMs\n", p.name, sms);

    // (a) edges. 100 KB of shared memory per CTA: one CTA per SM.
    const int pad = 100 << 10;
    CK(cudaFuncSetAttribute(m0::pingpong, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    CK(cudaFuncSetAttribute(m0::all_to_all, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    CK(cudaFuncSetAttribute(m0::one_to_all, cudaFuncAttributeMaxDynamicSharedMemorySize, pad));
    unsigned* flags;
    CK(cudaMalloc(&flags, 4096));
    const int iters = 20000;
    for (int sleep_ns : {0, 32, 100}) {
        float ms = time_ms([&] {
            CK(cudaMemset(flags, 0, 4096));
            m0::pingpong<<<sms, 32, pad>>>(flags, iters, sleep_ns);
        }, 5);
        printf("edge ping-pong, nanosleep %3d: %.3f us per edge (%d round trips)\n", sleep_ns,
               ms * 1e3 / (2.0 * iters), iters);
    }
    for (int sleep_ns : {0, 32, 100}) {
        float ms = time_ms([&] {
            CK(cudaMemset(flags, 0, 4096));
            m0::all_to_all<<<sms, 32, pad>>>(flags, iters, sleep_ns);
        }, 5);
        printf("all-to-all counter, %d CTAs, nanosleep %3d: %.3f us per round\n", sms, sleep_ns,
               ms * 1e3 / iters);
    }
    for (int sleep_ns : {0, 32}) {
        float ms = time_ms([&] {
            CK(cudaMemset(flags, 0, 4096));
            m0::one_to_all<<<sms, 32, pad>>>(flags, iters, sleep_ns);
        }, 5);
        printf("one-to-all edge + gather, %d CTAs, nanosleep %3d: %.3f us per round\n", sms, sleep_ns,
               ms * 1e3 / iters);
    }

    // (b) streams over a 4 GiB buffer of bf16 1.0 pairs.
    const unsigned long long bytes = 4ull << 30;
    uint4* src;
    float* out;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMemset(src, 0x3f, bytes));
    CK(cudaMalloc(&out, (size_t)sms * 8 * 1024 * sizeof(float)));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, m0::stream_read, 512, 0));
    const int grid = std::max(1, occ) * sms;
    float base_ms = time_ms([&] { m0::stream_read<<<grid, 512>>>(src, bytes / 16, out); }, 7);
    const double base = bytes / (base_ms * 1e-3) / 1e9;
    printf("stream_read (ld.global.nc x4, grid %d x 512): %.1f GB/s\n", grid, base);
    const int threads = (m0::CONSUMER_WARPS + 1) * 32;
    for (unsigned ring_kb : {96u, 144u, 176u}) {
        for (unsigned stage_kb : {8u, 16u, 32u}) {
            const unsigned stage = stage_kb << 10, slots = ring_kb / stage_kb;
            if (slots > (unsigned)m0::MAX_SLOTS || slots < 2) continue;
            const size_t smem = (size_t)slots * stage;
            CK(cudaFuncSetAttribute(m0::ring_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            const unsigned long long per_cta = bytes / sms / stage * stage;
            float ms = time_ms([&] { m0::ring_stream<<<sms, threads, smem>>>(src, per_cta, stage, slots, out); }, 7);
            const double gbps = per_cta * sms / (ms * 1e-3) / 1e9;
            printf("ring_stream ring %3u KB, stage %2u KB (%2u slots), %d CTAs x %d threads: %.1f GB/s = %.1f %% of stream_read\n",
                   ring_kb, stage_kb, slots, sms, threads, gbps, 100.0 * gbps / base);
        }
    }
    // Same run, stream_read again: drift check.
    float again = time_ms([&] { m0::stream_read<<<grid, 512>>>(src, bytes / 16, out); }, 7);
    printf("stream_read again: %.1f GB/s\n", bytes / (again * 1e-3) / 1e9);
    CK(cudaDeviceSynchronize());
    return 0;
}
