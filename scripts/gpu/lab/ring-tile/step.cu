// A whole decode step's weight stream with a grid barrier after every
// phase: does a producer warp that takes no part in the ops or the barriers
// keep the step near the floor?
//
// Shapes of 0.5B, 7B and 14B with synthetic bf16 weights. Per layer:
// qkv [Q + 2 KV, H], o_proj [H, Q], gate and up as one [2 I, H], down
// [H, I]; then the LM head [V, H]. 132 CTAs x 16 warps. Each phase multiplies
// its matrix by an f32 vector loaded from device memory into shared memory;
// each CTA owns a contiguous balanced share of the rows. A grid barrier
// follows every phase: one thread per CTA does a release add and an acquire
// spin on a counter that only grows, as the kernel does. Two ways to read
// the weights:
//
//   direct  16 warps load their rows from device memory (16-byte loads, 8
//           in flight per lane), rows of the share warp-strided. This is
//           the kernel on main without attention and norms, except that the
//           kernel spreads a phase's last partial round over every SM's
//           warps, which matters at 0.5B (a few rows per CTA).
//   ring    warp 15 streams the CTA's share of every phase, layer after
//           layer, into fixed ring slots of one tile each (G <= 15 rows x
//           KT columns, one bulk copy per row from G lanes), and waits only
//           for free slots. Warps 0-14 run the phases and synchronise among
//           themselves with a named barrier of 480 threads. Each warp takes
//           one row of every tile and accumulates across the row's tiles.
//
// Both sum in the kernel's order (lane l takes 16-byte vectors l, l + 32,
// ... ascending; then the xor tree), so their outputs must be equal bit for
// bit. Prints the step time of each mode, best of 4 launches, and the
// bytes' rate against a plain read of the same bytes.
#include "ring.cuh"

constexpr int kSlots = 64;
constexpr unsigned kConsumers = 480;  // warps 0-14

// The step's matrices: 0 qkv, 1 o_proj, 2 gate/up, 3 down (per layer), 4 the
// LM head (once). y[t] holds every layer's output of matrix t.
struct Model {
    const uint16_t* w[5];
    float* y[5];
    unsigned R[5], K[5];
    unsigned layers;
};

// Phase n of the step (n < 4 x layers + 1): its matrix W [R][K] and its
// output y [R].
struct Phase {
    const uint16_t* W;
    float* y;
    unsigned R, K;
};
__device__ __forceinline__ Phase phase(const Model& m, unsigned n) {
    const unsigned t = n < 4 * m.layers ? n % 4 : 4, layer = n / 4;
    const unsigned R = m.R[t], K = m.K[t];
    return {m.w[t] + (t == 4 ? 0ull : (uint64_t)layer * R * K), m.y[t] + (t == 4 ? 0ull : (uint64_t)layer * R), R,
            K};
}

// Rows per tile: the share cut into as few groups of at most 15 as possible,
// evenly.
__device__ __forceinline__ unsigned group_rows(unsigned share_rows) {
    const unsigned groups = (share_rows + 14u) / 15u;
    return groups == 0 ? 1u : (share_rows + groups - 1u) / groups;
}

// This CTA's tiles of a phase of R rows x K columns, in the one order the
// producer sends them and the readers take them: groups [g0, g0 + nrows)
// of its share, each cut into tiles of at most kt columns from k0.
// tile(g0, nrows, k0, kk, b) runs per tile, b counting the CTA's tiles over
// the step; done(g0, nrows) after a group's last tile.
template <class Tile, class Done>
__device__ __forceinline__ void walk_tiles(unsigned R, unsigned K, unsigned kt, unsigned& b, Tile tile, Done done) {
    unsigned lo_, hi_;
    share(R, lo_, hi_);
    const unsigned G = group_rows(hi_ - lo_);
    for (unsigned g0 = lo_; g0 < hi_; g0 += G) {
        const unsigned nrows = min_u(G, hi_ - g0);
        for (unsigned k0 = 0; k0 < K; k0 += kt, ++b) tile(g0, nrows, k0, min_u(kt, K - k0), b);
        done(g0, nrows);
    }
}

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

__global__ void __launch_bounds__(512, 1)
    step_direct(Model m, const float* xg, unsigned long long* arrived, unsigned long long base) {
    extern __shared__ __align__(128) unsigned char dyn[];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned phases = 4 * m.layers + 1;
    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        for (unsigned i = threadIdx.x; i < ph.K; i += 512) xs[i] = xg[i];
        __syncthreads();
        unsigned lo_, hi_;
        share(ph.R, lo_, hi_);
        const unsigned nv = ph.K / 8;
        for (unsigned r = lo_ + warp; r < hi_; r += 16) {
            const uint4* w = reinterpret_cast<const uint4*>(ph.W + (uint64_t)r * ph.K);
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
            acc = warp_sum(acc);
            if (lane == 0) ph.y[r] = acc;
        }
        __syncthreads();
        if (threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        __syncthreads();
    }
}

__global__ void __launch_bounds__(512, 1)
    step_ring(Model m, const float* xg, unsigned long long* arrived, unsigned long long base, unsigned x_bytes,
              unsigned ring_bytes, unsigned kt) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned ring = (sa(dyn) + x_bytes + 127u) & ~127u;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned slot_bytes = 15u * kt * 2u;
    const unsigned slots = min_u((unsigned)kSlots, ring_bytes / slot_bytes);
    const unsigned phases = 4 * m.layers + 1;
    if (threadIdx.x == 0) {
        for (unsigned s = 0; s < slots; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 15);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == 15) {
        // The producer: the whole step's tiles in order, waiting only for
        // a free slot.
        unsigned b = 0;
        for (unsigned n = 0; n < phases; ++n) {
            const Phase ph = phase(m, n);
            walk_tiles(
                ph.R, ph.K, kt, b,
                [&](unsigned g0, unsigned nrows, unsigned k0, unsigned kk, unsigned bt) {
                    const unsigned s = bt % slots;
                    if (bt >= slots) mbar_wait(&empty[s], ((bt / slots) - 1) & 1);
                    if (lane == 0) mbar_expect(&full[s], nrows * kk * 2);
                    __syncwarp();
                    if (lane < nrows)
                        bulk(ring + s * slot_bytes + lane * kk * 2, ph.W + (uint64_t)(g0 + lane) * ph.K + k0,
                             kk * 2, &full[s]);
                },
                [](unsigned, unsigned) {});
        }
        return;
    }

    unsigned b = 0;
    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        for (unsigned i = threadIdx.x; i < ph.K; i += kConsumers) xs[i] = xg[i];
        consumers_sync();
        float acc = 0.0f;
        walk_tiles(
            ph.R, ph.K, kt, b,
            [&](unsigned g0, unsigned nrows, unsigned k0, unsigned kk, unsigned bt) {
                const unsigned s = bt % slots;
                mbar_wait(&full[s], (bt / slots) & 1);
                if (warp < nrows) {
                    const unsigned row = ring + s * slot_bytes + warp * kk * 2;
                    // kk may end in half a chunk (0.5B's 896 columns).
                    for (unsigned ch = 0; ch * 256 < kk; ++ch) {
                        const unsigned i = k0 / 8 + ch * 32 + lane;
                        if ((ch * 32 + lane) * 8 < kk)
                            acc = dot8(lds16(row + ch * 512 + lane * 16), xs4[2 * i], xs4[2 * i + 1], acc);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);
            },
            [&](unsigned g0, unsigned nrows) {
                acc = warp_sum(acc);
                if (warp < nrows && lane == 0) ph.y[g0 + warp] = acc;
                acc = 0.0f;
            });
        consumers_sync();
        if (threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        consumers_sync();
    }
}

__global__ void fill(uint16_t* w, uint64_t n) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        const float f = ((int)((i * 2654435761ull >> 7) % 2001) - 1000) / 4096.0f;
        w[i] = (uint16_t)(__float_as_uint(f) >> 16);
    }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(step_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    CK(cudaFuncSetAttribute(step_direct, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    unsigned* sink;
    unsigned long long* arrived;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMalloc(&arrived, 8));

    struct Shape { const char* name; unsigned H, Q, KV, I, V, L; };
    const Shape shapes[] = {{"0.5B", 896, 896, 128, 4864, 151936, 24},
                            {"7B", 3584, 3584, 512, 18944, 152064, 28},
                            {"14B", 5120, 5120, 1024, 13824, 152064, 48}};
    for (const Shape& sh : shapes) {
        Model m{};
        m.layers = sh.L;
        const unsigned R[5] = {sh.Q + 2 * sh.KV, sh.H, 2 * sh.I, sh.H, sh.V};
        const unsigned K[5] = {sh.H, sh.Q, sh.H, sh.I, sh.H};
        uint64_t welems = 0, yelems = 0, wofs[5], yofs[5];
        for (int t = 0; t < 5; ++t) {
            const uint64_t copies = t == 4 ? 1 : sh.L;
            m.R[t] = R[t];
            m.K[t] = K[t];
            wofs[t] = welems;
            yofs[t] = yelems;
            welems += copies * R[t] * K[t];
            yelems += copies * R[t];
        }
        uint16_t* W;
        float *y_direct, *y_ring, *xg;
        CK(cudaMalloc(&W, welems * 2));
        CK(cudaMalloc(&y_direct, yelems * 4));
        CK(cudaMalloc(&y_ring, yelems * 4));
        CK(cudaMalloc(&xg, 32768 * 4));
        fill<<<sms * 8, 512>>>(W, welems);
        {
            std::vector<float> hx(32768);
            for (unsigned i = 0; i < hx.size(); ++i) hx[i] = (float)((int)((i * 37u) % 101u) - 50) / 64.0f;
            CK(cudaMemcpy(xg, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
        }
        CK(cudaDeviceSynchronize());
        for (int t = 0; t < 5; ++t) m.w[t] = W + wofs[t];
        const uint64_t bytes = welems * 2;

        const float read_ms = plain_read_ms(W, bytes, sms, sink);
        const unsigned xmax = std::max(std::max(sh.H, sh.Q), sh.I);
        const unsigned x_bytes = (xmax * 4 + 127) / 128 * 128;
        printf("== %s: %u layers, %.2f GB of weights; plain read %.0f GB/s (%.1f us); vector %u B\n", sh.name, sh.L,
               bytes / 1e9, bytes / read_ms / 1e6, read_ms * 1e3, x_bytes);
        std::vector<float> hd(yelems), hr(yelems);

        for (int t = 0; t < 5; ++t) m.y[t] = y_direct + yofs[t];
        // The barrier counter only grows: each launch starts from where the
        // last one left it.
        const unsigned long long per_launch = (4ull * sh.L + 1) * sms;
        unsigned long long launches = 0;
        CK(cudaMemset(arrived, 0, 8));
        const float direct_ms =
            best_ms([&] { step_direct<<<sms, 512, x_bytes>>>(m, xg, arrived, per_launch * launches++); });
        CK(cudaMemcpy(hd.data(), y_direct, yelems * 4, cudaMemcpyDeviceToHost));
        printf("direct                    : %8.1f us  %5.1f %% of read\n", direct_ms * 1e3, 100.0 * read_ms / direct_ms);
        for (int t = 0; t < 5; ++t) m.y[t] = y_ring + yofs[t];
        for (unsigned target : {190u * 1024, 224u * 1024})
            for (unsigned kt : {512u, 1024u}) {
                const unsigned ring_bytes = (target - x_bytes - 128) / 128 * 128;
                if (ring_bytes / (15u * kt * 2u) < 2) continue;
                CK(cudaMemset(y_ring, 0xff, yelems * 4));
                const float ms = best_ms([&] {
                    step_ring<<<sms, 512, x_bytes + ring_bytes + 128>>>(m, xg, arrived, per_launch * launches++,
                                                                        x_bytes, ring_bytes, kt);
                });
                CK(cudaMemcpy(hr.data(), y_ring, yelems * 4, cudaMemcpyDeviceToHost));
                const bool same = memcmp(hd.data(), hr.data(), yelems * 4) == 0;
                printf("ring %3u KB (%2u slots) kt %4u: %8.1f us  %5.1f %% of read  %.3fx direct  %s\n", ring_bytes / 1024,
                       ring_bytes / (15u * kt * 2u) < (unsigned)kSlots ? ring_bytes / (15u * kt * 2u) : (unsigned)kSlots,
                       kt, ms * 1e3, 100.0 * read_ms / ms, direct_ms / ms, same ? "bit-identical" : "DIFFERS");
            }
        CK(cudaFree(W));
        CK(cudaFree(y_direct));
        CK(cudaFree(y_ring));
        CK(cudaFree(xg));
    }
    return 0;
}
