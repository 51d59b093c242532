// The all-reduce a tensor-parallel decode step needs inside its megakernel:
// each of R ranks has a partial [H] f32 (its o_proj or down output over its
// shard of the inputs), and every rank needs the sum over ranks, bit-identical
// on every rank (the same rank-ordered adds), before its next phase. The lab
// runs it the way the kernel would: a persistent grid of CTAs per rank, a
// grid barrier after every phase, no host round trip; the exchange through
// peer-mapped buffers and system-scope flags, one-shot (no NCCL, no
// multicast).
//
// Per iteration (a layer's half):
//   produce  every thread writes its elements' partial values: to its own
//            buffer (pull), or straight into every rank's receive slot for
//            this rank (push: the stores cross NVLink while the phase runs)
//   barrier  the rank's grid barrier
//   publish  CTA 0 thread 0 stores the iteration's epoch into every rank's
//            flag slot for this rank (st.release.sys)
//   wait     thread 0 of every CTA waits for every rank's flag (ld.acquire.sys,
//            bounded: a timeout, the host's abort or a peer's error marker
//            ends it with an error, and the error marker goes to every peer)
//   reduce   each CTA sums its slice of [H] over ranks 0, 1, ..., R - 1
//            (pull: reading the peers' buffers; push: its own receive slots)
//            and checks every element against the same sum recomputed from
//            the formula the partials came from: any difference is an error
//   barrier  the next phase reads the sum
// Buffers alternate by the iteration's parity: a rank can be at most one
// iteration ahead of the slowest (it waits for every rank's flag), so the
// buffer it overwrites is never one a peer still reads.
//
// Modes: 0 no exchange (produce, barrier, reduce of its own partial, barrier:
// the cost of the phases without the all-reduce), 1 pull, 2 push.
//
// Ranks: one per GPU where there are R GPUs with peer access; with
// --co-resident, R concurrent grids on GPU 0 (each of SMs / R CTAs), which
// checks the protocol and its bounded waits on one GPU (the flags and
// buffers then stay in one device's memory).
//
// --stop RANK,ITER: that rank stops (returns without publishing) at that
// iteration; every other rank must then end with a flag-wait error, not
// hang, within the timeout.
//
// Build (here or there): nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/ar ar.cu
// Run: ./ar --ranks 2 --hidden 8192 --mode 2 [--co-resident] [--iters 2000]

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                                        \
    do {                                                                                             \
        cudaError_t e_ = (x);                                                                        \
        if (e_ != cudaSuccess) {                                                                     \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));       \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

constexpr int kThreads = 512, kMaxRanks = 8;
constexpr unsigned kFlagError = 0xffffffffu;  // a rank's flag once it failed
enum : int { kOk = 0, kErrBarrier = 1, kErrFlag = 2, kErrPeer = 3, kErrSum = 4, kErrAbort = 5 };

struct RankParams {
    int rank, ranks, hidden, iters;
    int stop_at;                         // this rank returns unannounced at this iteration (-1: never)
    unsigned epoch0;                     // epochs of this launch: epoch0 + 1 ..= epoch0 + iters
    unsigned long long timeout_ns;
    float* partial;                      // [2, H] this rank's partials (pull)
    float* recv;                         // [2, R, H] what each rank sent here (push)
    float* peer_partial[kMaxRanks];      // every rank's `partial`
    float* peer_recv[kMaxRanks];         // every rank's `recv`
    unsigned* flags;                     // [R] here: the last epoch rank k published
    unsigned* peer_flags[kMaxRanks];     // every rank's `flags`
    unsigned long long* bar;             // this rank's grid barrier counter (0 at launch)
    float* x;                            // [H] the sum
    int* error;                          // [2] here: first error code, iteration
    volatile int* abort;                 // host-mapped: nonzero stops every wait
};

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu(unsigned long long* p, unsigned long long v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Rank k's partial of element i at iteration `it`: a value in [-0.5, 0.5)
// with 16 significant bits, so rank-ordered sums round differently from
// other orders and a stale or misplaced value shows.
__device__ __forceinline__ float value(int k, int it, int i) {
    unsigned h = (unsigned)i * 2654435761u ^ (unsigned)(k + 1) * 40503u ^ (unsigned)it * 2246822519u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return (float)(h & 0xffffu) / 65536.0f - 0.5f + (float)(k + 1) * 1e-3f;
}

// First error wins; tells every peer (so they stop waiting for this rank).
__device__ void fail(const RankParams& p, int code, int it) {
    if (atomicCAS(p.error, 0, code) == 0) {
        p.error[1] = it;
        for (int k = 0; k < p.ranks; ++k) st_release_sys(p.peer_flags[k] + p.rank, kFlagError);
        __threadfence_system();
    }
}

// Thread 0's bounded spin; false once it gave up (error recorded). As the
// engine's bounded wait, it reads the clock, the host-mapped abort flag and
// the error word only every 128th poll: a read of host memory crosses PCIe,
// and one at every wait's first poll, from every CTA, would cost more than
// the exchange being measured.
template <class Ready>
__device__ bool wait_for(const RankParams& p, Ready ready, int code, int it) {
    unsigned long long t0 = 0;
    for (unsigned n = 0;;) {
        const int r = ready();
        if (r > 0) return true;
        if (r < 0) {
            fail(p, kErrPeer, it);
            return false;
        }
        if ((++n & 127u) == 0u) {
            const unsigned long long t = now_ns();
            if (t0 == 0) t0 = t;
            if (*p.abort) {
                fail(p, kErrAbort, it);
                return false;
            }
            if (*(volatile int*)p.error != 0) return false;
            if (t - t0 > p.timeout_ns) {
                fail(p, code, it);
                return false;
            }
        }
    }
}

// The rank's grid barrier (count-th of the launch); uniform result per CTA.
// SYS: the CTA's stores so far (ordered before thread 0's fence by bar.sync)
// are made visible at system scope first: push mode's remote stores then
// reach the peers before the flag that follows the barrier.
template <bool SYS>
__device__ bool grid_sync(const RankParams& p, unsigned count, int it) {
    __shared__ int ok;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (SYS) __threadfence_system();
        red_release_gpu(p.bar, 1ull);
        const unsigned long long target = (unsigned long long)count * gridDim.x;
        ok = wait_for(
            p, [&] { return ld_acquire_gpu(p.bar) >= target ? 1 : 0; }, kErrBarrier, it);
    }
    __syncthreads();
    return ok != 0;
}

template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) ar_kernel(const RankParams p) {
    const int H = p.hidden, R = p.ranks;
    const int tid = blockIdx.x * kThreads + threadIdx.x, nt = gridDim.x * kThreads;
    // This CTA's slice of [H] to reduce.
    const int per = (H + gridDim.x - 1) / gridDim.x;
    const int i0 = min(H, (int)blockIdx.x * per), i1 = min(H, i0 + per);
    unsigned count = 0;
    __shared__ int ok;
    for (int it = 0; it < p.iters; ++it) {
        const int par = it & 1;
        const unsigned epoch = p.epoch0 + (unsigned)it + 1u;
        // produce
        for (int i = tid; i < H; i += nt) {
            const float v = value(p.rank, it, i);
            if (MODE == 2) {
                for (int k = 0; k < R; ++k) p.peer_recv[k][((size_t)par * R + p.rank) * H + i] = v;
            } else {
                p.partial[(size_t)par * H + i] = v;
            }
        }
        if (!grid_sync<MODE == 2>(p, ++count, it)) return;
        if (MODE != 0) {
            if (threadIdx.x == 0) {
                const bool stopped = p.stop_at >= 0 && it >= p.stop_at;
                if (blockIdx.x == 0 && !stopped)
                    for (int k = 0; k < R; ++k) st_release_sys(p.peer_flags[k] + p.rank, epoch);
                ok = stopped ? 0
                             : wait_for(
                                   p,
                                   [&] {
                                       int all = 1;
                                       for (int k = 0; k < R; ++k) {
                                           const unsigned f = ld_acquire_sys(p.flags + k);
                                           if (f == kFlagError) return -1;
                                           if (f < epoch) all = 0;
                                       }
                                       return all;
                                   },
                                   kErrFlag, it);
            }
            __syncthreads();
            if (!ok) return;
        }
        // reduce, and check against the formula
        bool bad = false;
        for (int i = i0 + (int)threadIdx.x; i < i1; i += kThreads) {
            float s, want;
            if (MODE == 0) {
                s = __ldcg(p.partial + (size_t)par * H + i);
                want = value(p.rank, it, i);
            } else {
                s = MODE == 1 ? __ldcg(p.peer_partial[0] + (size_t)par * H + i) : __ldcg(p.recv + (size_t)par * R * H + i);
                want = value(0, it, i);
                for (int k = 1; k < R; ++k) {
                    s += MODE == 1 ? __ldcg(p.peer_partial[k] + (size_t)par * H + i)
                                   : __ldcg(p.recv + ((size_t)par * R + k) * H + i);
                    want += value(k, it, i);
                }
            }
            p.x[i] = s;
            bad |= __float_as_uint(s) != __float_as_uint(want);
        }
        if (bad) fail(p, kErrSum, it);
        if (!grid_sync<false>(p, ++count, it)) return;
    }
}

struct Args {
    int ranks = 2, hidden = 8192, mode = 2, iters = 2000, stop_rank = -1, stop_iter = -1;
    bool co_resident = false;
    double timeout_ms = 200.0;
};

static Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string s = argv[i];
        auto next = [&]() -> const char* {
            if (i + 1 >= argc) {
                fprintf(stderr, "%s needs a value\n", s.c_str());
                exit(2);
            }
            return argv[++i];
        };
        if (s == "--ranks") a.ranks = atoi(next());
        else if (s == "--hidden") a.hidden = atoi(next());
        else if (s == "--mode") a.mode = atoi(next());
        else if (s == "--iters") a.iters = atoi(next());
        else if (s == "--timeout-ms") a.timeout_ms = atof(next());
        else if (s == "--co-resident") a.co_resident = true;
        else if (s == "--stop") {
            if (sscanf(next(), "%d,%d", &a.stop_rank, &a.stop_iter) != 2) {
                fprintf(stderr, "--stop RANK,ITER\n");
                exit(2);
            }
        } else {
            fprintf(stderr, "unknown argument %s\n", s.c_str());
            exit(2);
        }
    }
    if (a.ranks < 1 || a.ranks > kMaxRanks || a.hidden < 1 || a.mode < 0 || a.mode > 2 || a.iters < 1) {
        fprintf(stderr, "ranks 1..%d, hidden >= 1, mode 0..2, iters >= 1\n", kMaxRanks);
        exit(2);
    }
    return a;
}

int main(int argc, char** argv) {
    const Args a = parse(argc, argv);
    int devices = 0;
    CK(cudaGetDeviceCount(&devices));
    const bool co = a.co_resident;
    if (!co && devices < a.ranks) {
        fprintf(stderr, "%d ranks need %d GPUs; this machine has %d (--co-resident runs them on GPU 0)\n", a.ranks,
                a.ranks, devices);
        return 2;
    }
    const int R = a.ranks, H = a.hidden;
    if (!co) {
        for (int i = 0; i < R; ++i) {
            CK(cudaSetDevice(i));
            for (int j = 0; j < R; ++j) {
                if (i == j) continue;
                int can = 0;
                CK(cudaDeviceCanAccessPeer(&can, i, j));
                if (!can) {
                    fprintf(stderr, "GPU %d cannot map GPU %d's memory\n", i, j);
                    return 2;
                }
                cudaError_t e = cudaDeviceEnablePeerAccess(j, 0);
                if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
                (void)cudaGetLastError();
            }
        }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int grid = co ? prop.multiProcessorCount / R : prop.multiProcessorCount;
    // One CTA per SM, as the megakernel runs: ask for more than half an SM's
    // shared memory.
    const size_t smem = prop.sharedMemPerBlockOptin / 2 + 1024;
    int* abort_host = nullptr;
    CK(cudaHostAlloc((void**)&abort_host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
    *abort_host = 0;
    int* abort_dev = nullptr;
    CK(cudaHostGetDevicePointer((void**)&abort_dev, abort_host, 0));

    std::vector<RankParams> p(R);
    std::vector<cudaStream_t> streams(R);
    std::vector<cudaEvent_t> ev0(R), ev1(R);
    for (int r = 0; r < R; ++r) {
        CK(cudaSetDevice(co ? 0 : r));
        RankParams& q = p[r];
        memset(&q, 0, sizeof q);
        q.rank = r;
        q.ranks = R;
        q.hidden = H;
        q.iters = a.iters;
        q.stop_at = r == a.stop_rank ? a.stop_iter : -1;
        q.epoch0 = 0;
        q.timeout_ns = (unsigned long long)(a.timeout_ms * 1e6);
        CK(cudaMalloc(&q.partial, sizeof(float) * 2 * H));
        CK(cudaMalloc(&q.recv, sizeof(float) * 2 * R * H));
        CK(cudaMalloc(&q.flags, sizeof(unsigned) * R));
        CK(cudaMemset(q.flags, 0, sizeof(unsigned) * R));
        CK(cudaMalloc(&q.bar, sizeof(unsigned long long)));
        CK(cudaMemset(q.bar, 0, sizeof(unsigned long long)));
        CK(cudaMalloc(&q.x, sizeof(float) * H));
        CK(cudaMalloc(&q.error, sizeof(int) * 2));
        CK(cudaMemset(q.error, 0, sizeof(int) * 2));
        q.abort = abort_dev;
        CK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
        CK(cudaEventCreate(&ev0[r]));
        CK(cudaEventCreate(&ev1[r]));
        CK(cudaFuncSetAttribute(ar_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaFuncSetAttribute(ar_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CK(cudaFuncSetAttribute(ar_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < R; ++k) {
            p[r].peer_partial[k] = p[k].partial;
            p[r].peer_recv[k] = p[k].recv;
            p[r].peer_flags[k] = p[k].flags;
        }
    for (int r = 0; r < R; ++r) {
        CK(cudaSetDevice(co ? 0 : r));
        CK(cudaDeviceSynchronize());
    }
    for (int r = 0; r < R; ++r) {
        CK(cudaSetDevice(co ? 0 : r));
        CK(cudaEventRecord(ev0[r], streams[r]));
        void (*k)(RankParams) = a.mode == 0 ? ar_kernel<0> : a.mode == 1 ? ar_kernel<1> : ar_kernel<2>;
        k<<<grid, kThreads, smem, streams[r]>>>(p[r]);
        CK(cudaGetLastError());
        CK(cudaEventRecord(ev1[r], streams[r]));
    }
    int worst = 0;
    double us_max = 0.0;
    for (int r = 0; r < R; ++r) {
        CK(cudaSetDevice(co ? 0 : r));
        CK(cudaStreamSynchronize(streams[r]));
        float ms = 0.0f;
        CK(cudaEventElapsedTime(&ms, ev0[r], ev1[r]));
        int err[2];
        CK(cudaMemcpy(err, p[r].error, sizeof err, cudaMemcpyDeviceToHost));
        us_max = std::max(us_max, 1e3 * ms / a.iters);
        printf("rank %d: %s%s at iteration %d, %.3f ms\n", r, err[0] == kOk ? "ok" : "error ",
               err[0] == kOk         ? ""
               : err[0] == kErrBarrier ? "barrier timeout"
               : err[0] == kErrFlag    ? "flag timeout"
               : err[0] == kErrPeer    ? "a peer failed"
               : err[0] == kErrSum     ? "sum differs"
                                       : "aborted",
               err[0] == kOk ? a.iters : err[1], ms);
        if (r != a.stop_rank) worst = std::max(worst, err[0]);
    }
    const char* mode = a.mode == 0 ? "none" : a.mode == 1 ? "pull" : "push";
    printf("RESULT ranks=%d %s hidden=%d mode=%s grid=%d iters=%d us_per_iter=%.3f errors=%d\n", R,
           co ? "co-resident" : "gpus", H, mode, grid, a.iters, us_max, worst);
    // With --stop the others must fail by a flag wait (or a peer's marker),
    // not hang and not pass.
    if (a.stop_rank >= 0) return worst == kErrFlag || worst == kErrPeer ? 0 : 1;
    return worst == kOk ? 0 : 1;
}
