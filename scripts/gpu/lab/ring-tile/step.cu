// A whole decode step's weight stream with a grid barrier after every
// phase: does a producer warp that takes no part in the ops or the barriers
// keep the step near the floor?
//
// Shapes of 0.5B, 7B and 14B with synthetic bf16 weights. Per layer:
// qkv [Q + 2 KV, H], o_proj [H, Q], gate and up as one [2 I, H], down
// [H, I]; then the LM head [V, H]. 132 CTAs x 16 warps. Each phase multiplies
// its matrix by an f32 vector copied from device memory into shared memory
// (16-byte loads). A grid barrier follows every phase: one thread per CTA
// does a release add and an acquire spin on a counter that only grows, as
// the kernel does. Every mode also runs once without the barrier (the
// phases then overlap freely: an upper bound, not a valid step). Ways to
// read the weights:
//
//   direct, static share   16 warps load their rows from device memory
//           (16-byte loads, 8 in flight per lane), each CTA a contiguous
//           balanced share of the rows, warp-strided. This is the kernel on
//           main without attention and norms, except that the kernel spreads
//           a phase's last partial round over every SM's warps, which
//           matters at 0.5B (a few rows per CTA).
//   direct, claim c rows   every warp takes c rows at a time from a
//           per-phase counter of the grid (asking for the next rows before
//           it computes the current ones), so faster SMs take more rows.
//   ring, share 15         warp 15 streams the CTA's share of every phase,
//           layer after layer, into fixed ring slots of one tile each
//           (G <= 15 rows x KT columns, one bulk copy per row from G lanes),
//           and waits only for free slots; optionally it also asks for the
//           tiles `ahead` further on into L2 (one bulk prefetch per row).
//           Warps 0-14 run the phases and synchronise among themselves with
//           a named barrier of 480 threads. Each warp takes one row of every
//           tile and accumulates across the row's tiles.
//   ring, claim g          the same ring, but the producer takes groups of
//           g rows from the grid's per-phase counter instead of a fixed
//           share; a header per slot tells the readers which rows it holds.
//   ring, share r, joined  the fixed-share ring as the kernel built it
//           (decision 0026): groups of at most r rows, and the producer
//           takes part in every CTA-wide step. Before each phase's end it
//           sends the phase's tiles and at most one ring beyond them (a
//           count of the phase's tiles bounds it, not the tiles sent so
//           far: 0026's flaw), then joins the CTA (512 threads) for the
//           barrier and for the next phase's vector copy, and only then
//           sends on.
//
// Every mode sums in the kernel's order (lane l takes 16-byte vectors l,
// l + 32, ... ascending; then the xor tree), so every output must equal the
// static direct one bit for bit. Prints the step time of each mode, best of
// 4 launches, and the bytes' rate against a plain read of the same bytes.
#include "step.cuh"

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

// This CTA's tiles over the whole step, in the one order the producer sends
// them and the readers take them: phase by phase, the CTA's share of rows in
// groups of G (group_rows), each group cut into tiles of at most kt columns.
struct Cursor {
    Phase ph;
    unsigned n, phases, kt, most, hi, G, g0, nrows, k0, kk;
    __device__ Cursor(const Model& m, unsigned kt_, unsigned most_ = 15u)
        : n(0), phases(4 * m.layers + 1), kt(kt_), most(most_) {
        open(m);
    }
    // Opens phase n, or the first later one where this CTA has rows.
    __device__ void open(const Model& m) {
        for (; n < phases; ++n) {
            ph = phase(m, n);
            unsigned lo_;
            share(ph.R, lo_, hi);
            if (lo_ < hi) {
                G = group_rows(hi - lo_, most);
                g0 = lo_;
                nrows = min_u(G, hi - g0);
                k0 = 0;
                kk = min_u(kt, ph.K);
                return;
            }
        }
    }
    __device__ bool valid() const { return n < phases; }
    __device__ bool group_end() const { return k0 + kk >= ph.K; }
    __device__ void next(const Model& m) {
        k0 += kk;
        if (k0 < ph.K) {
            kk = min_u(kt, ph.K - k0);
            return;
        }
        g0 += G;
        if (g0 < hi) {
            nrows = min_u(G, hi - g0);
            k0 = 0;
            kk = min_u(kt, ph.K);
            return;
        }
        ++n;
        open(m);
    }
    // Row j of the tile in device memory.
    __device__ const uint16_t* row(unsigned j) const { return ph.W + (uint64_t)(g0 + j) * ph.K + k0; }
};

__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Tiles of phase n for this CTA, as Cursor walks them: its share's groups
// of at most `most` rows, each cut into tiles of at most kt columns.
__device__ __forceinline__ unsigned tiles_in(const Model& m, unsigned n, unsigned kt, unsigned most) {
    const Phase ph = phase(m, n);
    unsigned lo_, hi_;
    share(ph.R, lo_, hi_);
    if (lo_ == hi_) return 0;
    const unsigned G = group_rows(hi_ - lo_, most);
    return (hi_ - lo_ + G - 1) / G * ((ph.K + kt - 1) / kt);
}

// Direct loads. claim_rows = 0: each CTA's balanced share, rows
// warp-strided (the kernel's map); claim_rows = c: every warp takes c rows
// at a time from a per-phase counter of the grid, asking for its next rows
// before it computes the current ones, so faster SMs take more rows.
__global__ void __launch_bounds__(512, 1)
    step_direct(Model m, const float* xg, unsigned long long* arrived, unsigned long long base, bool bar,
                unsigned* claims, unsigned claim_rows) {
    extern __shared__ __align__(128) unsigned char dyn[];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned phases = 4 * m.layers + 1;
    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        unsigned next = claim_rows ? claim(claims, n, claim_rows, lane) : 0u;
        load_x(xs, xg, ph.K, 512);
        __syncthreads();
        if (claim_rows) {
            for (unsigned r0 = __shfl_sync(0xffffffffu, next, 0); r0 < ph.R;) {
                next = claim(claims, n, claim_rows, lane);
                for (unsigned r = r0; r < min_u(r0 + claim_rows, ph.R); ++r) {
                    const float acc = row_dot(ph.W + (uint64_t)r * ph.K, ph.K, xs4, lane);
                    if (lane == 0) ph.y[r] = acc;
                }
                r0 = __shfl_sync(0xffffffffu, next, 0);
            }
        } else {
            unsigned lo_, hi_;
            share(ph.R, lo_, hi_);
            for (unsigned r = lo_ + warp; r < hi_; r += 16) {
                const float acc = row_dot(ph.W + (uint64_t)r * ph.K, ph.K, xs4, lane);
                if (lane == 0) ph.y[r] = acc;
            }
        }
        __syncthreads();
        if (bar && threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        __syncthreads();
    }
}

__global__ void __launch_bounds__(512, 1)
    step_ring_claim(Model m, const float* xg, unsigned long long* arrived, unsigned long long base, bool bar,
                    unsigned x_bytes, unsigned ring_bytes, unsigned kt, unsigned gd, unsigned* claims) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    __shared__ SlotHead head[kSlots];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned ring = (sa(dyn) + x_bytes + 127u) & ~127u;
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const unsigned slot_bytes = gd * kt * 2u;
    const unsigned slots = min_u((unsigned)kSlots, ring_bytes / slot_bytes);
    const unsigned phases = 4 * m.layers + 1;
    init_slots(full, empty, slots);

    HeadedRing rg{full, empty, head, ring, slot_bytes, slots};
    if (warp == 15) {
        for (unsigned n = 0; n < phases; ++n) {
            const Phase ph = phase(m, n);
            unsigned next = claim(claims, n, gd, lane);
            for (unsigned g0 = __shfl_sync(0xffffffffu, next, 0); g0 < ph.R;) {
                next = claim(claims, n, gd, lane);
                rg.send(ph.W, ph.K, g0, min_u(gd, ph.R - g0), kt, lane);
                g0 = __shfl_sync(0xffffffffu, next, 0);
            }
            rg.end_phase(lane);
        }
        return;
    }

    for (unsigned n = 0; n < phases; ++n) {
        const Phase ph = phase(m, n);
        load_x(xs, xg, ph.K, kConsumers);
        consumers_sync();
        float acc = 0.0f;
        unsigned s;
        for (SlotHead h; rg.next(s, h, lane);) {
            acc = read_tile(rg.tile(s), &empty[s], h.nrows, h.k0, h.kk, xs4, acc);
            if (h.k0 + h.kk >= ph.K) acc = finish_row(acc, h.nrows, ph.y + h.g0);
        }
        consumers_sync();
        if (bar && threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        consumers_sync();
    }
}

// The fixed-share ring's slots: the producer sends tile b of cursor c into
// slot b % slots; the readers take a phase's tiles in the same order.
struct ShareRing {
    uint64_t* full;
    uint64_t* empty;
    unsigned ring, slot_bytes, slots;

    // The ring after the activation vector (x_bytes) in `dyn`, 128-byte
    // aligned, in slots of `rows` x kt bf16. The whole CTA calls it.
    __device__ static ShareRing make(uint64_t* full, uint64_t* empty, const unsigned char* dyn, unsigned x_bytes,
                                     unsigned ring_bytes, unsigned rows, unsigned kt) {
        const unsigned slot_bytes = rows * kt * 2u;
        const unsigned slots = min_u((unsigned)kSlots, ring_bytes / slot_bytes);
        init_slots(full, empty, slots);
        return {full, empty, (sa(dyn) + x_bytes + 127u) & ~127u, slot_bytes, slots};
    }

    __device__ void send(const Cursor& c, unsigned b, unsigned lane) {
        const unsigned s = b % slots;
        if (b >= slots) mbar_wait(&empty[s], ((b / slots) - 1) & 1);
        if (lane == 0) mbar_expect(&full[s], c.nrows * c.kk * 2);
        __syncwarp();
        if (lane < c.nrows) bulk(ring + s * slot_bytes + lane * c.kk * 2, c.row(lane), c.kk * 2, &full[s]);
    }
    // A reading warp's part of phase n: its row of every tile, each row's
    // total to the phase's output at the group's end.
    __device__ void read_phase(const Model& m, Cursor& c, unsigned& b, unsigned n, const float4* xs4) {
        float acc = 0.0f;
        for (; c.valid() && c.n == n; ++b, c.next(m)) {
            const unsigned s = b % slots;
            mbar_wait(&full[s], (b / slots) & 1);
            acc = read_tile(ring + s * slot_bytes, &empty[s], c.nrows, c.k0, c.kk, xs4, acc);
            if (c.group_end()) acc = finish_row(acc, c.nrows, c.ph.y + c.g0);
        }
    }
};

__global__ void __launch_bounds__(512, 1)
    step_ring(Model m, const float* xg, unsigned long long* arrived, unsigned long long base, bool bar,
              unsigned x_bytes, unsigned ring_bytes, unsigned kt, unsigned ahead, unsigned most) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    ShareRing rg = ShareRing::make(full, empty, dyn, x_bytes, ring_bytes, most, kt);

    if (warp == 15) {
        // The producer: the whole step's tiles in order, waiting only for
        // a free slot; `ahead` tiles further on are asked into L2 before
        // that wait, so DRAM keeps streaming while the ring is full.
        Cursor c(m, kt, most), p(m, kt, most);
        for (unsigned a = 0; a < ahead && p.valid(); ++a, p.next(m))
            if (lane < p.nrows) prefetch_l2(p.row(lane), p.kk * 2);
        for (unsigned b = 0; c.valid(); ++b, c.next(m)) {
            if (ahead && p.valid()) {
                if (lane < p.nrows) prefetch_l2(p.row(lane), p.kk * 2);
                p.next(m);
            }
            rg.send(c, b, lane);
        }
        return;
    }

    Cursor c(m, kt, most);
    unsigned b = 0;
    for (unsigned n = 0; n < c.phases; ++n) {
        load_x(xs, xg, phase(m, n).K, kConsumers);
        consumers_sync();
        rg.read_phase(m, c, b, n, xs4);
        consumers_sync();
        if (bar && threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        consumers_sync();
    }
}

// The fixed-share ring with the producer inside the CTA's steps, as the
// kernel built it: groups of at most `most` rows; the producer sends a
// phase's tiles, then at most `slots` beyond (their slots are freed by this
// phase's tiles), then joins the whole CTA for the barrier and the next
// phase's vector copy.
__global__ void __launch_bounds__(512, 1)
    step_ring_joined(Model m, const float* xg, unsigned long long* arrived, unsigned long long base, bool bar,
                     unsigned x_bytes, unsigned ring_bytes, unsigned kt, unsigned most) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    float* xs = reinterpret_cast<float*>(dyn);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    ShareRing rg = ShareRing::make(full, empty, dyn, x_bytes, ring_bytes, most, kt);

    Cursor c(m, kt, most);
    unsigned b = 0;
    auto send = [&] {
        rg.send(c, b++, lane);
        c.next(m);
    };
    unsigned through = 0;  // producer: the tiles of phases 0..n
    if (warp == 15)
        while (c.valid() && b < rg.slots) send();
    for (unsigned n = 0; n < c.phases; ++n) {
        load_x(xs, xg, phase(m, n).K, 512);
        __syncthreads();
        if (warp == 15) {
            // Tile b's slot is freed by tile b - slots: wait only for those
            // of phases 0..n, which the readers take before the next step.
            through += tiles_in(m, n, kt, most);
            while (c.valid() && b < through + rg.slots) send();
        } else {
            rg.read_phase(m, c, b, n, xs4);
        }
        __syncthreads();
        if (bar && threadIdx.x == 0) grid_arrive_wait(arrived, base + (unsigned long long)(n + 1) * gridDim.x);
        __syncthreads();
    }
}

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);  // each line out as it is done, even into a file
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(step_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    CK(cudaFuncSetAttribute(step_direct, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    CK(cudaFuncSetAttribute(step_ring_claim, cudaFuncAttributeMaxDynamicSharedMemorySize, 225 * 1024));
    CK(cudaFuncSetAttribute(step_ring_joined, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    unsigned* claims;  // one counter per phase, zeroed before every launch
    CK(cudaMalloc(&claims, 256 * 4));
    unsigned* sink;
    unsigned long long* arrived;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMalloc(&arrived, 8));

    for (const Shape& sh : kShapes) {
        const Weights wt(sh, sms, sink);
        Model m{};
        wt.point(m, 0);
        std::vector<float> hd(wt.yelems), hr(wt.yelems);
        // The barrier counter only grows: each launch starts from where the
        // last one left it.
        const unsigned long long per_launch = (4ull * sh.L + 1) * sms;
        unsigned long long launches = 0;
        CK(cudaMemset(arrived, 0, 8));
        // Without the grid barrier the counter stays put, so only barrier
        // launches advance the base.
        auto base = [&](bool bar) { return bar ? per_launch * launches++ : 0ull; };
        float direct_ms = 0.0f;
        struct Direct { unsigned claim_rows; bool bar; };
        for (const Direct& d : {Direct{0, true}, Direct{0, false}, Direct{1, true}, Direct{2, true}, Direct{4, true}}) {
            CK(cudaMemset(wt.y[0], 0xff, wt.yelems * 4));
            const float ms = best_ms([&] {
                if (d.claim_rows) cudaMemsetAsync(claims, 0, 256 * 4);
                step_direct<<<sms, 512, wt.x_bytes>>>(m, wt.x, arrived, base(d.bar), d.bar, claims, d.claim_rows);
            });
            if (!d.claim_rows && d.bar) {
                direct_ms = ms;
                CK(cudaMemcpy(hd.data(), wt.y[0], wt.yelems * 4, cudaMemcpyDeviceToHost));
            } else {
                CK(cudaMemcpy(hr.data(), wt.y[0], wt.yelems * 4, cudaMemcpyDeviceToHost));
            }
            const bool same = memcmp(hd.data(), hr.data(), wt.yelems * 4) == 0;
            printf("direct, %-13s%s: %8.1f us  %5.1f %% of read  %.3fx direct  %s\n",
                   d.claim_rows ? (d.claim_rows == 1 ? "claim 1 row" : d.claim_rows == 2 ? "claim 2 rows" : "claim 4 rows")
                                : "static share",
                   d.bar ? "" : ", no grid barrier", ms * 1e3, 100.0 * wt.read_ms / ms, direct_ms / ms,
                   (!d.claim_rows && d.bar) ? "" : same ? "bit-identical" : "DIFFERS");
        }
        wt.point(m, 1);
        // Rings: static shares (Cursor) of groups of at most `most` rows,
        // the producer outside the CTA's steps or `joined` to them; or
        // claimed groups of gd rows.
        struct Ring {
            unsigned target, kt, ahead, gd;
            bool bar;
            unsigned most = 15;
            bool joined = false;
        };
        const Ring rings[] = {{224u * 1024, 1024, 0, 0, true},  {224u * 1024, 1024, 0, 0, false},
                              {224u * 1024, 512, 0, 0, true},   {224u * 1024, 2048, 0, 0, true},
                              {224u * 1024, 1024, 4, 0, true},  {223u * 1024, 1024, 0, 15, true},
                              {223u * 1024, 1024, 0, 8, true},  {223u * 1024, 1024, 0, 4, true},
                              {223u * 1024, 1024, 0, 15, false},
                              {224u * 1024, 1024, 0, 0, true, 14, false},
                              {224u * 1024, 1024, 0, 0, true, 15, true},
                              {224u * 1024, 1024, 0, 0, true, 14, true}};
        for (const Ring& r : rings) {
            const unsigned ring_bytes = (r.target - wt.x_bytes - 128) / 128 * 128;
            const unsigned rows = r.gd ? r.gd : r.most;
            const unsigned slots = std::min(ring_bytes / (rows * r.kt * 2u), (unsigned)kSlots);
            if (slots < 2) continue;
            CK(cudaMemset(wt.y[1], 0xff, wt.yelems * 4));
            const float ms = best_ms([&] {
                if (r.gd) {
                    cudaMemsetAsync(claims, 0, 256 * 4);
                    step_ring_claim<<<sms, 512, wt.x_bytes + ring_bytes + 128>>>(m, wt.x, arrived, base(r.bar), r.bar,
                                                                              wt.x_bytes, ring_bytes, r.kt, r.gd, claims);
                } else if (r.joined) {
                    step_ring_joined<<<sms, 512, wt.x_bytes + ring_bytes + 128>>>(
                        m, wt.x, arrived, base(r.bar), r.bar, wt.x_bytes, ring_bytes, r.kt, r.most);
                } else {
                    step_ring<<<sms, 512, wt.x_bytes + ring_bytes + 128>>>(m, wt.x, arrived, base(r.bar), r.bar, wt.x_bytes,
                                                                        ring_bytes, r.kt, r.ahead, r.most);
                }
            });
            CK(cudaMemcpy(hr.data(), wt.y[1], wt.yelems * 4, cudaMemcpyDeviceToHost));
            const bool same = memcmp(hd.data(), hr.data(), wt.yelems * 4) == 0;
            char ahead[32] = "";
            if (r.ahead) snprintf(ahead, sizeof ahead, ", L2 +%u tiles", r.ahead);
            printf("ring %3u KB (%2u slots) kt %4u %s%2u%s%s%s: %8.1f us  %5.1f %% of read  %.3fx direct  %s\n",
                   ring_bytes / 1024, slots, r.kt, r.gd ? "claim " : "share ", rows, ahead,
                   r.joined ? ", producer joined" : "", r.bar ? "" : ", no grid barrier",
                   ms * 1e3, 100.0 * wt.read_ms / ms, direct_ms / ms, same ? "bit-identical" : "DIFFERS");
        }
    }
    return 0;
}
