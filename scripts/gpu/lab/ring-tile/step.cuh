// Helpers shared by the whole-step labs (step.cu, flow.cu): the grid
// barrier, the ring's slots and its readers' tile, direct row loads, row
// claims, the synthetic weights.
#pragma once
#include "ring.cuh"

constexpr int kSlots = 64;
constexpr unsigned kConsumers = 480;  // warps 0-14

__device__ __forceinline__ void grid_arrive_wait(unsigned long long* arrived, unsigned long long target) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(arrived) : "memory");
    unsigned long long v;
    do {
        asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(arrived) : "memory");
    } while (v < target);
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ uint4 ldg16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The ring's slot barriers: full waits for the producer's one arrival and
// the slot's bytes, empty for the 15 reading warps. The whole CTA calls it.
__device__ __forceinline__ void init_slots(uint64_t* full, uint64_t* empty, unsigned slots) {
    if (threadIdx.x == 0) {
        for (unsigned s = 0; s < slots; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 15);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// A reading warp's part of one landed tile of nrows rows x kk columns (from
// column k0) at shared address `tile`: warp w adds row w's columns to acc
// in the kernel's order, then every warp frees the slot.
__device__ __forceinline__ float read_tile(unsigned tile, uint64_t* empty, unsigned nrows, unsigned k0, unsigned kk,
                                           const float4* xs4, float acc) {
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (warp < nrows) {
        const unsigned row = tile + warp * kk * 2;
        // kk may end in half a chunk (0.5B's 896 columns).
        for (unsigned ch = 0; ch * 256 < kk; ++ch) {
            const unsigned i = k0 / 8 + ch * 32 + lane;
            if ((ch * 32 + lane) * 8 < kk) acc = dot8(lds16(row + ch * 512 + lane * 16), xs4[2 * i], xs4[2 * i + 1], acc);
        }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty);
    return acc;
}

// After a row group's last tile: warp w's row total to y[w]; the next
// group starts from zero.
__device__ __forceinline__ float finish_row(float acc, unsigned nrows, float* y) {
    const unsigned warp = threadIdx.x / 32;
    acc = warp_sum(acc);
    if (warp < nrows && (threadIdx.x & 31) == 0) y[warp] = acc;
    return 0.0f;
}

// x [K] f32 into shared memory by `threads` threads (K a multiple of 4).
__device__ __forceinline__ void load_x(float* xs, const float* xg, unsigned K, unsigned threads) {
    const float4* src = reinterpret_cast<const float4*>(xg);
    float4* dst = reinterpret_cast<float4*>(xs);
#pragma unroll 4
    for (unsigned i = threadIdx.x; i < K / 4; i += threads) dst[i] = src[i];
}

// One warp's dot product of a row of K bf16 weights with xs, the kernel's
// order.
__device__ __forceinline__ float row_dot(const uint16_t* row, unsigned K, const float4* xs4, unsigned lane) {
    const uint4* w = reinterpret_cast<const uint4*>(row);
    const unsigned nv = K / 8;
    float acc = 0.0f;
    for (unsigned v0 = 0; v0 < nv; v0 += 32 * 8) {
        uint4 v[8];
#pragma unroll
        for (unsigned u = 0; u < 8; ++u) {
            const unsigned i = v0 + u * 32 + lane;
            v[u] = i < nv ? ldg16(w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (unsigned u = 0; u < 8; ++u) {
            const unsigned i = v0 + u * 32 + lane;
            if (i < nv) acc = dot8(v[u], xs4[2 * i], xs4[2 * i + 1], acc);
        }
    }
    return warp_sum(acc);
}

// Rows per group of a CTA's share: the share cut into as few groups of at
// most `most` (15: one per reading warp) as possible, evenly.
__device__ __forceinline__ unsigned group_rows(unsigned share_rows, unsigned most = 15u) {
    const unsigned groups = (share_rows + most - 1u) / most;
    return groups == 0 ? 1u : (share_rows + groups - 1u) / groups;
}

// Lane 0 takes the next `c` rows of phase n from the grid's counter; the
// atomic's result is read only when the warp needs it.
__device__ __forceinline__ unsigned claim(unsigned* claims, unsigned n, unsigned c, unsigned lane) {
    return lane == 0 ? atomicAdd(&claims[n], c) : 0u;
}

// The ring with claimed groups: the producer takes groups of `gd` rows of
// each phase from the grid's per-phase counter (the next group asked for
// when the current one starts), sends their tiles, and ends the CTA's part
// of a phase with an empty slot marked done. The slot's header tells the
// readers which rows it holds.
struct SlotHead {
    unsigned g0, nrows, k0, kk;  // nrows = 0: this CTA's part of the phase is done
};

// A ring whose slots carry a SlotHead, at shared address `ring`: the
// producing warp sends row groups as tiles and ends each phase with an empty
// slot; the reading warps take slots in the same order.
struct HeadedRing {
    uint64_t* full;
    uint64_t* empty;
    SlotHead* head;
    unsigned ring, slot_bytes, slots;
    unsigned b = 0;  // slots taken so far

    // The producer's next slot, once the readers have freed it.
    __device__ unsigned take() {
        const unsigned s = b % slots;
        if (b >= slots) mbar_wait(&empty[s], ((b / slots) - 1) & 1);
        ++b;
        return s;
    }
    // Rows [g0, g0 + nrows) of W [.][K] as tiles of at most kt columns, one
    // bulk copy per row from lanes 0..nrows-1.
    __device__ void send(const uint16_t* W, unsigned K, unsigned g0, unsigned nrows, unsigned kt, unsigned lane) {
        for (unsigned k0 = 0; k0 < K; k0 += kt) {
            const unsigned kk = min_u(kt, K - k0), s = take();
            if (lane == 0) {
                head[s] = {g0, nrows, k0, kk};
                mbar_expect(&full[s], nrows * kk * 2);
            }
            __syncwarp();
            if (lane < nrows) bulk(ring + s * slot_bytes + lane * kk * 2, W + (uint64_t)(g0 + lane) * K + k0, kk * 2, &full[s]);
        }
    }
    // This CTA's part of the phase is done.
    __device__ void end_phase(unsigned lane) {
        const unsigned s = take();
        if (lane == 0) {
            head[s] = {0, 0, 0, 0};
            mbar_arrive(&full[s]);
        }
        __syncwarp();
    }
    // A reading warp's next slot: waits for it and returns its header in h;
    // false (the slot freed) at the end of the CTA's part of a phase.
    __device__ bool next(unsigned& s, SlotHead& h, unsigned lane) {
        s = b % slots;
        mbar_wait(&full[s], (b / slots) & 1);
        ++b;
        h = head[s];
        if (h.nrows != 0) return true;
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
        return false;
    }
    __device__ unsigned tile(unsigned s) const { return ring + s * slot_bytes; }
};

__global__ void fill(uint16_t* w, uint64_t n) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        const float f = ((int)((i * 2654435761ull >> 7) % 2001) - 1000) / 4096.0f;
        w[i] = (uint16_t)(__float_as_uint(f) >> 16);
    }
}

// The step's shapes: hidden, q, kv, intermediate, vocab, layers.
struct Shape {
    const char* name;
    unsigned H, Q, KV, I, V, L;
};
constexpr Shape kShapes[] = {{"0.5B", 896, 896, 128, 4864, 151936, 24},
                             {"7B", 3584, 3584, 512, 18944, 152064, 28},
                             {"14B", 5120, 5120, 1024, 13824, 152064, 48}};

// One shape's synthetic weights on the device, one buffer: matrix t (0 qkv
// [Q + 2 KV, H], 1 o_proj [H, Q], 2 gate/up [2 I, H], 3 down [H, I], each
// per layer; 4 the LM head [V, H], once) from element wofs[t], its outputs
// from yofs[t] of either of two output buffers y[] of yelems floats (a
// reference and a mode under test). Also a fixed input x [32768] f32, and a
// plain read of the weights, timed and printed.
struct Weights {
    unsigned L, R[5], K[5];
    uint64_t wofs[5], yofs[5], welems = 0, yelems = 0;
    uint16_t* W = nullptr;
    float* x = nullptr;
    float* y[2] = {nullptr, nullptr};
    unsigned x_bytes;  // the largest input vector, 128-byte rounded
    float read_ms;
    Weights(const Shape& sh, int sms, unsigned* sink) {
        const unsigned r[5] = {sh.Q + 2 * sh.KV, sh.H, 2 * sh.I, sh.H, sh.V};
        const unsigned k[5] = {sh.H, sh.Q, sh.H, sh.I, sh.H};
        for (int t = 0; t < 5; ++t) {
            const uint64_t copies = t == 4 ? 1 : sh.L;
            R[t] = r[t];
            K[t] = k[t];
            wofs[t] = welems;
            yofs[t] = yelems;
            welems += copies * r[t] * k[t];
            yelems += copies * r[t];
        }
        L = sh.L;
        CK(cudaMalloc(&W, welems * 2));
        CK(cudaMalloc(&x, 32768 * 4));
        CK(cudaMalloc(&y[0], yelems * 4));
        CK(cudaMalloc(&y[1], yelems * 4));
        fill<<<sms * 8, 512>>>(W, welems);
        std::vector<float> hx(32768);
        for (unsigned i = 0; i < hx.size(); ++i) hx[i] = (float)((int)((i * 37u) % 101u) - 50) / 64.0f;
        CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaDeviceSynchronize());
        const uint64_t bytes = welems * 2;
        read_ms = plain_read_ms(W, bytes, sms, sink);
        x_bytes = (std::max(std::max(sh.H, sh.Q), sh.I) * 4 + 127) / 128 * 128;
        printf("== %s: %u layers, %.2f GB of weights; plain read %.0f GB/s (%.1f us); vector %u B\n", sh.name, sh.L,
               bytes / 1e9, bytes / read_ms / 1e6, read_ms * 1e3, x_bytes);
    }
    Weights(const Weights&) = delete;
    Weights& operator=(const Weights&) = delete;
    ~Weights() {
        cudaFree(W);
        cudaFree(x);
        cudaFree(y[0]);
        cudaFree(y[1]);
    }
    // Points a lab's model (layers, R, K, w, y) at these weights and at
    // output buffer y[out].
    template <class M>
    void point(M& m, int out) const {
        m.layers = L;
        for (int t = 0; t < 5; ++t) {
            m.R[t] = R[t];
            m.K[t] = K[t];
            m.w[t] = W + wofs[t];
            m.y[t] = y[out] + yofs[t];
        }
    }
};
