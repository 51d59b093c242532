// Lab kernels for the decode redesign's first question (no product code
// depends on them): what one dependency edge between CTAs costs, and
// whether a producer warp streaming weights into a shared-memory ring
// through bulk copies keeps up with a plain streaming read.
#pragma once
#include <cstdint>

namespace m0 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// (a1) Ping-pong between CTA 0 and CTA 1 (one CTA per SM: the launch asks
// for more shared memory than two CTAs can share). One round trip is two
// edges: a release store seen by the other CTA's acquire poll.
__global__ void pingpong(unsigned* flags, int iters, int sleep_ns) {
    extern __shared__ unsigned char pad[];
    if (threadIdx.x != 0 || blockIdx.x > 1) return;
    pad[0] = 0;
    unsigned* a = flags;       // CTA 0 -> 1
    unsigned* b = flags + 64;  // CTA 1 -> 0, another 256-byte line
    if (blockIdx.x == 0) {
        for (int i = 1; i <= iters; ++i) {
            st_release(a, (unsigned)i);
            while (ld_acquire(b) != (unsigned)i) {
                if (sleep_ns) __nanosleep(sleep_ns);
            }
        }
    } else {
        for (int i = 1; i <= iters; ++i) {
            while (ld_acquire(a) != (unsigned)i) {
                if (sleep_ns) __nanosleep(sleep_ns);
            }
            st_release(b, (unsigned)i);
        }
    }
}

// (a2) Every CTA to every CTA: each round, each CTA adds 1 to one counter
// (release) and waits until it holds gridDim.x x round (acquire): the
// all-to-all dependency a grid barrier implements, as one counter.
__global__ void all_to_all(unsigned* counter, int iters, int sleep_ns) {
    extern __shared__ unsigned char pad[];
    if (threadIdx.x == 0) {
        pad[0] = 0;
        for (int r = 1; r <= iters; ++r) {
            red_release_add(counter, 1u);
            const unsigned want = gridDim.x * (unsigned)r;
            while (ld_acquire(counter) < want) {
                if (sleep_ns) __nanosleep(sleep_ns);
            }
        }
    }
    __syncthreads();
}

// (a3) One producer CTA to all: CTA 0 publishes round r, every other CTA
// waits for it and acknowledges on a counter CTA 0 waits on (a broadcast
// edge plus its gather).
__global__ void one_to_all(unsigned* flags, int iters, int sleep_ns) {
    extern __shared__ unsigned char pad[];
    if (threadIdx.x != 0) return;
    pad[0] = 0;
    unsigned* go = flags;
    unsigned* ack = flags + 64;
    const unsigned others = gridDim.x - 1;
    for (int r = 1; r <= iters; ++r) {
        if (blockIdx.x == 0) {
            st_release(go, (unsigned)r);
            while (ld_acquire(ack) < others * (unsigned)r) {
                if (sleep_ns) __nanosleep(sleep_ns);
            }
        } else {
            while (ld_acquire(go) < (unsigned)r) {
                if (sleep_ns) __nanosleep(sleep_ns);
            }
            red_release_add(ack, 1u);
        }
    }
}

// --- (b) the ring stream -------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

// 8 bf16 of one 16-byte word, summed in f32 (the consumer's stand-in for a
// dot product against an activation of ones).
__device__ __forceinline__ float sum8(uint4 w) {
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s += __uint_as_float(u[i] << 16);
        s += __uint_as_float(u[i] & 0xffff0000u);
    }
    return s;
}

constexpr int CONSUMER_WARPS = 16;
constexpr int MAX_SLOTS = 32;

// Warp 16 (one lane) streams this CTA's contiguous block of `src` into a
// ring of `slots` stages of `stage` bytes with bulk copies; warps 0..15
// wait for each stage, sum it, and release the slot. The producer never
// waits on anything but a free slot.
__global__ void __launch_bounds__((CONSUMER_WARPS + 1) * 32, 1)
    ring_stream(const uint4* src, unsigned long long per_cta, unsigned stage, unsigned slots, float* out) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ uint64_t full[MAX_SLOTS], empty[MAX_SLOTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (unsigned s = 0; s < slots; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const unsigned long long n = per_cta / stage;  // stages of this CTA
    const char* base = reinterpret_cast<const char*>(src) + (unsigned long long)blockIdx.x * per_cta;
    if (warp == CONSUMER_WARPS) {
        if (lane == 0) {
            for (unsigned long long k = 0; k < n; ++k) {
                const unsigned s = (unsigned)(k % slots);
                if (k >= slots) mbar_wait(&empty[s], (unsigned)((k / slots - 1) & 1));
                mbar_expect_tx(&full[s], stage);
                bulk_copy(ring + (size_t)s * stage, base + k * stage, stage, &full[s]);
            }
        }
        return;
    }
    float acc = 0.f;
    const unsigned words = stage / 16;
    for (unsigned long long k = 0; k < n; ++k) {
        const unsigned s = (unsigned)(k % slots);
        mbar_wait(&full[s], (unsigned)((k / slots) & 1));
        const uint4* st = reinterpret_cast<const uint4*>(ring + (size_t)s * stage);
        for (unsigned i = warp * 32 + lane; i < words; i += CONSUMER_WARPS * 32) acc += sum8(st[i]);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    out[blockIdx.x * (CONSUMER_WARPS * 32) + threadIdx.x] = acc;
}

// The plain streaming read (as the engine's floor probe does it): 16-byte
// non-coherent loads, four in flight per thread, grid-stride.
__global__ void __launch_bounds__(512) stream_read(const uint4* src, unsigned long long n16, float* out) {
    float acc = 0.f;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
              d = __ldg(src + i + 3 * stride);
        acc += sum8(a) + sum8(b) + sum8(c) + sum8(d);
    }
    for (; i < n16; i += stride) acc += sum8(__ldg(src + i));
    out[(unsigned long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

}  // namespace m0
