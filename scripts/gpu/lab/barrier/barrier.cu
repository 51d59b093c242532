// Grid barrier lab: what one whole-grid barrier of the decode kernel's
// shape (132 CTAs x 512 threads, one CTA per SM, bar.sync on both sides)
// costs with different arrival structures. No product code depends on it.
//
//   counter      the kernel's: thread 0 adds 1 to one 64-bit counter
//                (red.release.gpu) and polls it (ld.acquire.gpu)
//   counters-C   C counters on their own 128-byte lines; CTA i adds to
//                counter i % C; lanes 0..C-1 of warp 0 poll one each
//   flags        one u32 per CTA, packed (132 x 4 B): thread 0 stores the
//                barrier's epoch (st.release.gpu); warp 0 reads every flag
//                (lane l: flags l, l + 32, ...) until all have reached it
//   flags-line   the same with each flag on its own 128-byte line
//
// Polls come in two forms: each poll an ld.acquire.gpu, or relaxed
// polls followed by one fence.acq_rel.gpu per lane once all are seen.
//
// Every round each CTA writes (plain stores by every warp) a word the next
// CTA reads right after the barrier; a stale read counts as an error, so a
// variant that orders nothing shows up as errors, not as a fast row.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/barrier barrier.cu && /tmp/barrier
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

namespace lab {

using u32 = uint32_t;
using u64 = uint64_t;

__device__ __forceinline__ void red_release_add_u64(u64* p, u64 v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_u32(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u32 ld_relaxed_u32(const u32* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

enum Mode : int { kCounter = 0, kCounters = 1, kFlags = 2, kFlagsLine = 3 };

__device__ __forceinline__ u64 ld_relaxed_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Barrier number `epoch` of the launch, counted from 1 (the buffers are
// zeroed before each launch).
template <int MODE, bool ACQ_POLL>
__device__ __forceinline__ void grid_sync(u64* counter, u32* flags, u32 ncounters, u32 epoch) {
    __syncthreads();
    const u32 n = gridDim.x;
    if constexpr (MODE == kCounter) {
        if (threadIdx.x == 0) {
            red_release_add_u64(counter, 1ull);
            const u64 target = (u64)epoch * n;
            if constexpr (ACQ_POLL) {
                while (ld_acquire_u64(counter) < target) {
                }
            } else {
                while (ld_relaxed_u64(counter) < target) {
                }
                fence_acq_rel();
            }
        }
    } else if constexpr (MODE == kCounters) {
        if (threadIdx.x < 32) {
            const u32 lane = threadIdx.x;
            // Counter c sits on its own 128-byte line (16 u64 apart).
            if (lane == 0) red_release_add_u64(counter + (blockIdx.x % ncounters) * 16, 1ull);
            if (lane < ncounters) {
                const u32 members = n / ncounters + (lane < n % ncounters ? 1u : 0u);
                const u64 target = (u64)epoch * members;
                while (ld_acquire_u64(counter + lane * 16) < target) {
                }
            }
            __syncwarp();
        }
    } else {
        constexpr u32 S = MODE == kFlagsLine ? 32u : 1u;  // u32 between flags
        if (threadIdx.x < 32) {
            const u32 lane = threadIdx.x;
            if (lane == 0) st_release_u32(flags + blockIdx.x * S, epoch);
            __syncwarp();
            bool done = false;
            while (!done) {
                bool mine = true;
                for (u32 c = lane; c < n; c += 32) {
                    const u32 v = ACQ_POLL ? ld_acquire_u32(flags + c * S) : ld_relaxed_u32(flags + c * S);
                    mine &= (int)(v - epoch) >= 0;
                }
                done = __all_sync(0xffffffffu, mine);
            }
            if (!ACQ_POLL) fence_acq_rel();
        }
    }
    __syncthreads();
}

// `rounds` barriers; before each, every warp of CTA i writes its word of
// data[i] (16 words per CTA); after it, warp w reads CTA (i + 1)'s word w
// and counts a value other than the round as an error.
template <int MODE, bool ACQ_POLL>
__global__ void __launch_bounds__(512, 1)
    run(u64* counter, u32* flags, u32 ncounters, u32* data, u32* errors, int rounds) {
    extern __shared__ unsigned char pad[];
    if (threadIdx.x == 0) pad[0] = 0;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 next = (blockIdx.x + 1) % gridDim.x;
    u32 bad = 0;
    for (int r = 1; r <= rounds; ++r) {
        if (lane == 0) data[blockIdx.x * 16 + warp] = (u32)r;
        grid_sync<MODE, ACQ_POLL>(counter, flags, ncounters, (u32)(2 * r - 1));
        if (lane == 0) bad += data[next * 16 + warp] < (u32)r ? 1u : 0u;
        // A second barrier keeps the next round's writes after every read.
        grid_sync<MODE, ACQ_POLL>(counter, flags, ncounters, (u32)(2 * r));
    }
    if (lane == 0 && bad) atomicAdd(errors, bad);
}

}  // namespace lab

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 10000;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("device %s, %d SMs, %d rounds of 2 barriers, 512 threads per CTA\n", prop.name, sms, rounds);
    const int smem = 150 << 10;  // one CTA per SM
    lab::u64* counter;
    lab::u32 *flags, *data, *errors;
    CK(cudaMalloc(&counter, 64 << 10));
    CK(cudaMalloc(&flags, 64 << 10));
    CK(cudaMalloc(&data, 64 << 10));
    CK(cudaMalloc(&errors, 4));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));

    struct Variant {
        const char* name;
        void (*kernel)(lab::u64*, lab::u32*, lab::u32, lab::u32*, lab::u32*, int);
        unsigned ncounters;
    };
    const Variant variants[] = {
        {"counter (the kernel's)", lab::run<lab::kCounter, true>, 1},
        {"counter, relaxed polls + fence", lab::run<lab::kCounter, false>, 1},
        {"counters-2", lab::run<lab::kCounters, true>, 2},
        {"counters-4", lab::run<lab::kCounters, true>, 4},
        {"counters-8", lab::run<lab::kCounters, true>, 8},
        {"counters-16", lab::run<lab::kCounters, true>, 16},
        {"counters-32", lab::run<lab::kCounters, true>, 32},
        {"flags, acquire polls", lab::run<lab::kFlags, true>, 0},
        {"flags, relaxed polls + fence", lab::run<lab::kFlags, false>, 0},
        {"flags-line, acquire polls", lab::run<lab::kFlagsLine, true>, 0},
        {"flags-line, relaxed polls + fence", lab::run<lab::kFlagsLine, false>, 0},
    };
    // Two passes over the variants, interleaved, so drift shows as a
    // difference between passes rather than between variants.
    for (int pass = 0; pass < 2; ++pass) {
        for (const Variant& v : variants) {
            CK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            std::vector<float> t;
            unsigned errs = 0;
            for (int rep = 0; rep < 6; ++rep) {
                CK(cudaMemset(counter, 0, 64 << 10));
                CK(cudaMemset(flags, 0, 64 << 10));
                CK(cudaMemset(data, 0, 64 << 10));
                CK(cudaMemset(errors, 0, 4));
                CK(cudaEventRecord(a));
                v.kernel<<<sms, 512, smem>>>(counter, flags, v.ncounters, data, errors, rounds);
                CK(cudaEventRecord(b));
                CK(cudaEventSynchronize(b));
                CK(cudaGetLastError());
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, a, b));
                unsigned e = 0;
                CK(cudaMemcpy(&e, errors, 4, cudaMemcpyDeviceToHost));
                errs += e;
                if (rep > 0) t.push_back(ms);  // the first is a warm-up
            }
            std::sort(t.begin(), t.end());
            printf("pass %d  %-36s %.3f us per barrier (min %.3f)  stale reads %u\n", pass, v.name,
                   median(t) * 1e3 / (2.0 * rounds), t.front() * 1e3 / (2.0 * rounds), errs);
        }
    }
    return 0;
}
