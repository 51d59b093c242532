// A whole decode step's weight stream in which every phase reads the
// previous phase's output: can counters per block of columns take the
// place of the grid barrier, so that a phase streams its weights while the
// phase before it finishes?
//
// Shapes of 0.5B, 7B and 14B with synthetic bf16 weights, the matrices of
// step.cu: per layer qkv [Q + 2 KV, H], o_proj [H, Q], gate and up as one
// [2 I, H] with gate and up rows interleaved, down [H, I]; then the LM head
// [V, H]. 132 CTAs x 16 warps. Phase n's input column c is a squashed copy of
// the previous output's row c (o_proj takes the first Q rows of qkv, down
// takes the product of rows 2c and 2c + 1), so each phase depends on the
// whole output of the one before, as in the model. Ways to order the phases:
//
//   barrier    a grid barrier after every phase (the kernel today).
//   counters   each output row, once stored, adds 1 to the counter of its
//              block of 1,024 input columns of the next phase (a release
//              add by the writing lane). A phase takes its input block by
//              block: it waits for block b (one warp polls every block's
//              counter at once, one lane each) only when it first needs
//              column b x 1,024, and then copies every block that is
//              complete.
//   none       no ordering at all: an upper bound, not a valid step.
//
// Ways to read the weights (see step.cu): direct loads by 16 warps, each CTA
// a fixed share (the counters then wait for the whole input before the
// phase); or a producer warp streaming tiles of 15 rows x 1,024 columns into
// a ring for 15 reading warps, either the CTA's fixed share or groups of 15
// rows claimed from a per-phase grid counter. The producer never waits for
// the activations, only for free slots, so under counters it streams the
// next phase's rows while its readers wait for their input.
//
// Every valid mode sums each row in the kernel's column order, so its
// outputs must equal the barrier's direct loads bit for bit. A wait that
// does not end within about 2 s traps. Prints the step time of each mode
// (best of 4 launches) and its rate against a plain read of the same bytes.
#include "step.cuh"

constexpr unsigned kBlock = 1024;    // input columns per dependency counter
constexpr unsigned kMaxBlocks = 32;  // per phase: one polling lane each
constexpr unsigned kMaxPhases = 256;
constexpr unsigned kMaxLaunches = 64;  // each launch its own zeroed counters
constexpr long long kDeadlineCycles = 4000000000ll;

enum Sync : unsigned { kBarrier = 0, kCounters = 1, kNone = 2 };

// The step's matrices: 0 qkv, 1 o_proj, 2 gate/up, 3 down (per layer), 4 the
// LM head (once). y[t] holds every layer's output of matrix t.
struct Model {
    const uint16_t* w[5];
    float* y[5];
    unsigned R[5], K[5];
    unsigned layers;
    const float* x0;  // the first phase's input [H]
};

// Phase n of the step (n < 4 x layers + 1).
struct Phase {
    const uint16_t* W;  // [R][K] bf16
    float* y;           // [R]
    const float* in;    // the previous phase's output (the first phase: x0)
    unsigned R, K;
    bool pair;       // input column c is made of rows 2c and 2c + 1 of `in`
    bool feeds;      // the rows feed a next phase (all but the LM head's)
    bool next_pair;  // the next phase pairs this phase's rows
    unsigned next_K;
};
__device__ __forceinline__ unsigned type_of(const Model& m, unsigned n) { return n < 4 * m.layers ? n % 4 : 4u; }
__device__ __forceinline__ Phase phase(const Model& m, unsigned n) {
    const unsigned t = type_of(m, n), layer = n / 4;
    Phase p;
    p.R = m.R[t];
    p.K = m.K[t];
    p.W = m.w[t] + (t == 4 ? 0ull : (uint64_t)layer * p.R * p.K);
    p.y = m.y[t] + (t == 4 ? 0ull : (uint64_t)layer * p.R);
    if (n == 0) {
        p.in = m.x0;
        p.pair = false;
    } else {
        const unsigned tp = type_of(m, n - 1);
        p.in = m.y[tp] + (tp == 4 ? 0ull : (uint64_t)((n - 1) / 4) * m.R[tp]);
        p.pair = t == 3;
    }
    p.feeds = n < 4 * m.layers;
    p.next_pair = p.feeds && type_of(m, n + 1) == 3;
    p.next_K = p.feeds ? m.K[type_of(m, n + 1)] : 0u;
    return p;
}

__device__ __forceinline__ float squash(float v) { return v / (1.0f + fabsf(v)); }

// Input columns [c0, c1) of phase ph (not the first) into xs, by `threads`
// threads from `tid` (c0 and c1 multiples of 4). The previous output is read
// through L2 only: this launch wrote it.
__device__ __forceinline__ void load_in(const Phase& ph, float* xs, unsigned c0, unsigned c1, unsigned tid,
                                        unsigned threads) {
    float4* dst = reinterpret_cast<float4*>(xs);
    const float4* in4 = reinterpret_cast<const float4*>(ph.in);
#pragma unroll 2
    for (unsigned i = c0 / 4 + tid; i < c1 / 4; i += threads) {
        if (ph.pair) {
            const float4 a = __ldcg(in4 + 2 * i), b = __ldcg(in4 + 2 * i + 1);
            dst[i] = make_float4(squash(a.x) * squash(a.y), squash(a.z) * squash(a.w), squash(b.x) * squash(b.y),
                                 squash(b.z) * squash(b.w));
        } else {
            const float4 a = __ldcg(in4 + i);
            dst[i] = make_float4(squash(a.x), squash(a.y), squash(a.z), squash(a.w));
        }
    }
}

__device__ __forceinline__ unsigned blocks_of(unsigned K) { return (K + kBlock - 1) / kBlock; }

// One warp: waits until blocks [0, need) of phase ph's input are complete
// (counters f, lane b polls block b) and returns how many leading blocks
// are.
__device__ __forceinline__ unsigned wait_blocks(const unsigned* f, const Phase& ph, unsigned need, unsigned lane) {
    const unsigned nb = blocks_of(ph.K);
    unsigned target = 0;
    if (lane < nb) {
        const unsigned cols = min_u(kBlock, ph.K - lane * kBlock);
        target = ph.pair ? 2 * cols : cols;
    }
    const long long t0 = clock64();
    for (;;) {
        unsigned v = target;
        if (lane < nb) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(f + lane) : "memory");
        const unsigned done = __ballot_sync(0xffffffffu, v >= target);
        const unsigned ready = min_u(done == 0xffffffffu ? 32u : (unsigned)(__ffs(~done) - 1), nb);
        if (ready >= need) return ready;
        if (clock64() - t0 > kDeadlineCycles) __trap();
    }
}

// Output row r of phase n is stored: count it into its block of the next
// phase's input.
__device__ __forceinline__ void signal_row(unsigned* flags, unsigned n, const Phase& ph, unsigned r) {
    if (!ph.feeds) return;
    const unsigned c = ph.next_pair ? r / 2 : r;
    if (c < ph.next_K)
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(flags + (n + 1) * kMaxBlocks + c / kBlock)
                     : "memory");
}

// Direct loads, each CTA a fixed share of every phase (rows warp-strided).
// Under counters a phase waits for its whole input first.
__global__ void __launch_bounds__(512, 1)
    flow_direct(Model m, unsigned sync, unsigned long long* arrived, unsigned long long base, unsigned* flags) {
    extern __shared__ __align__(128) unsigned char dyn[];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned phases = 4 * m.layers + 1;
    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        if (n == 0) {
            load_x(xs, m.x0, ph.K, 512);
        } else {
            if (sync == kCounters) {
                if (warp == 0) wait_blocks(flags + n * kMaxBlocks, ph, blocks_of(ph.K), lane);
                __syncthreads();
            }
            load_in(ph, xs, 0, ph.K, threadIdx.x, 512);
        }
        __syncthreads();
        unsigned lo_, hi_;
        share(ph.R, lo_, hi_);
        for (unsigned r = lo_ + warp; r < hi_; r += 16) {
            const float acc = row_dot(ph.W + (uint64_t)r * ph.K, ph.K, xs4, lane);
            if (lane == 0) {
                ph.y[r] = acc;
                if (sync == kCounters) signal_row(flags, n, ph, r);
            }
        }
        __syncthreads();
        if (sync == kBarrier && threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        __syncthreads();
    }
}

// The producer warp and 15 reading warps. gd = 0: the CTA's fixed share of
// every phase, in groups of group_rows; gd > 0: groups of gd rows claimed
// from the phase's grid counter (the next asked for when the current one
// starts). Each group goes out as tiles of kt columns; a slot with no rows
// ends the CTA's part of a phase.
__global__ void __launch_bounds__(512, 1)
    flow_ring(Model m, unsigned sync, unsigned long long* arrived, unsigned long long base, unsigned* flags,
              unsigned x_bytes, unsigned ring_bytes, unsigned kt, unsigned gd, unsigned* claims) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    __shared__ SlotHead head[kSlots];
    __shared__ unsigned ready_shared;
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned ring = (sa(dyn) + x_bytes + 127u) & ~127u;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned slot_bytes = (gd ? gd : 15u) * kt * 2u;
    const unsigned slots = min_u((unsigned)kSlots, ring_bytes / slot_bytes);
    const unsigned phases = 4 * m.layers + 1;
    init_slots(full, empty, slots);

    HeadedRing rg{full, empty, head, ring, slot_bytes, slots};
    if (warp == 15) {
        for (unsigned n = 0; n < phases; ++n) {
            const Phase ph = phase(m, n);
            if (gd) {
                unsigned next = claim(claims, n, gd, lane);
                for (unsigned g0 = __shfl_sync(0xffffffffu, next, 0); g0 < ph.R;) {
                    next = claim(claims, n, gd, lane);
                    rg.send(ph.W, ph.K, g0, min_u(gd, ph.R - g0), kt, lane);
                    g0 = __shfl_sync(0xffffffffu, next, 0);
                }
            } else {
                unsigned lo_, hi_;
                share(ph.R, lo_, hi_);
                const unsigned G = group_rows(hi_ - lo_);
                for (unsigned g0 = lo_; g0 < hi_; g0 += G) rg.send(ph.W, ph.K, g0, min_u(G, hi_ - g0), kt, lane);
            }
            rg.end_phase(lane);
        }
        return;
    }

    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        unsigned ready = 0;  // input columns in xs
        if (n == 0 || sync != kCounters) {
            if (n == 0)
                load_x(xs, m.x0, ph.K, kConsumers);
            else
                load_in(ph, xs, 0, ph.K, threadIdx.x, kConsumers);
            consumers_sync();
            ready = ph.K;
        }
        float acc = 0.0f;
        unsigned s;
        for (SlotHead h; rg.next(s, h, lane);) {
            if (h.k0 + h.kk > ready) {
                // Every reading warp is here, at the same tile: none reads xs
                // while it grows.
                consumers_sync();
                if (warp == 0) {
                    const unsigned r = wait_blocks(flags + n * kMaxBlocks, ph, blocks_of(h.k0 + h.kk), lane);
                    if (lane == 0) ready_shared = min_u(r * kBlock, ph.K);
                }
                consumers_sync();
                const unsigned now = ready_shared;
                load_in(ph, xs, ready, now, threadIdx.x, kConsumers);
                consumers_sync();
                ready = now;
            }
            acc = read_tile(rg.tile(s), &empty[s], h.nrows, h.k0, h.kk, xs4, acc);
            if (h.k0 + h.kk >= ph.K) {
                acc = finish_row(acc, h.nrows, ph.y + h.g0);
                if (sync == kCounters && warp < h.nrows && lane == 0) signal_row(flags, n, ph, h.g0 + warp);
            }
        }
        if (sync != kCounters) {
            consumers_sync();
            if (sync == kBarrier && threadIdx.x == 0)
                grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
            consumers_sync();
        }
    }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(flow_direct, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    CK(cudaFuncSetAttribute(flow_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 224 * 1024));
    unsigned *claims, *flags, *sink;
    unsigned long long* arrived;
    CK(cudaMalloc(&claims, kMaxLaunches * kMaxPhases * 4));
    CK(cudaMalloc(&flags, kMaxLaunches * kMaxPhases * kMaxBlocks * 4));
    CK(cudaMalloc(&sink, 4));
    CK(cudaMalloc(&arrived, 8));

    for (const Shape& sh : kShapes) {
        const Weights wt(sh, sms, sink);
        Model m{};
        wt.point(m, 0);
        m.x0 = wt.x;
        CK(cudaMemset(claims, 0, kMaxLaunches * kMaxPhases * 4));
        CK(cudaMemset(flags, 0, kMaxLaunches * kMaxPhases * kMaxBlocks * 4));
        CK(cudaMemset(arrived, 0, 8));
        CK(cudaDeviceSynchronize());

        // The barrier counter only grows; every launch has its own zeroed
        // claim and block counters.
        const unsigned long long per_launch = (4ull * sh.L + 1) * sms;
        unsigned long long bar_launches = 0;
        unsigned launches = 0;
        std::vector<float> hr(wt.yelems), ht(wt.yelems);
        float ref_ms = 0.0f;
        struct Mode { const char* name; bool ring; unsigned sync, gd; };
        const Mode modes[] = {{"direct, barrier", false, kBarrier, 0},
                              {"direct, counters (whole input)", false, kCounters, 0},
                              {"direct, none", false, kNone, 0},
                              {"ring share 15, barrier", true, kBarrier, 0},
                              {"ring share 15, counters", true, kCounters, 0},
                              {"ring share 15, none", true, kNone, 0},
                              {"ring claim 15, barrier", true, kBarrier, 15},
                              {"ring claim 15, counters", true, kCounters, 15},
                              {"ring claim 15, none", true, kNone, 15}};
        for (const Mode& md : modes) {
            const int out = md.ring || md.sync != kBarrier ? 1 : 0;
            wt.point(m, out);
            float* y = wt.y[out];
            CK(cudaMemset(y, 0xff, wt.yelems * 4));
            const unsigned ring_bytes = (223u * 1024 - wt.x_bytes - 128) / 128 * 128;
            const float ms = best_ms([&] {
                if (launches == kMaxLaunches) {
                    printf("out of counters\n");
                    exit(1);
                }
                unsigned* f = flags + (size_t)launches * kMaxPhases * kMaxBlocks;
                unsigned* c = claims + (size_t)launches * kMaxPhases;
                ++launches;
                const unsigned long long base = md.sync == kBarrier ? per_launch * bar_launches++ : 0ull;
                if (md.ring)
                    flow_ring<<<sms, 512, wt.x_bytes + ring_bytes + 128>>>(m, md.sync, arrived, base, f,
                                                                           wt.x_bytes, ring_bytes, 1024, md.gd, c);
                else
                    flow_direct<<<sms, 512, wt.x_bytes>>>(m, md.sync, arrived, base, f);
            });
            const bool is_ref = out == 0;
            if (is_ref) {
                ref_ms = ms;
                CK(cudaMemcpy(hr.data(), wt.y[0], wt.yelems * 4, cudaMemcpyDeviceToHost));
            } else {
                CK(cudaMemcpy(ht.data(), wt.y[1], wt.yelems * 4, cudaMemcpyDeviceToHost));
            }
            const char* check = is_ref ? ""
                                : md.sync == kNone ? "(not a valid step)"
                                : memcmp(hr.data(), ht.data(), wt.yelems * 4) == 0 ? "bit-identical"
                                                                                    : "DIFFERS";
            printf("%-32s: %8.1f us  %5.1f %% of read  %.3fx direct barrier  %s\n", md.name, ms * 1e3,
                   100.0 * wt.read_ms / ms, ref_ms / ms, check);
        }
    }
    return 0;
}
