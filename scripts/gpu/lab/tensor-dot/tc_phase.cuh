// tc_phase.cuh: the tensor-core weight phase in the one configuration the
// lab chose (decisions 0046-0050), written as the product kernel would take
// it: no variant flags, every size from the shape and a compile-time
// machine description, and the outputs handed to an epilogue functor.
//
//   y[t][r] = W[r, :] . (hi[t][:] + lo[t][:])   for r < ROWS, t < T
//
// - Weights [ROWS, K] bf16 in tile order: 16-row tile, then 32-column
//   k-step, then the 16 x 32 block row by row (Machine::tile8: 8-row bands
//   instead, the two halves of a tile in two bands). Lane (g, q) loads 16
//   bytes of rows g and g + 8 at column 8 q of a k-step: its A fragments of
//   two m16n8k16 MMAs, whose k order both operands share.
// - Inputs: two bf16 planes in global memory, hi = bf16(x) and lo =
//   bf16(x - hi), [2][tmax][xstride], written by the previous phase's
//   epilogue. Token t is column t of B; lanes of tokens T and up feed zeros,
//   so a token's sums do not depend on T.
// - Column blocks: the fewest blocks (dividing the grid and the k-steps)
//   whose tmax tokens' planes fit the input area; shares run over blocks,
//   then tiles, then k-steps, so a CTA's share lies in one block and it
//   copies that block only, through an input policy (BulkPlanes: one
//   cp.async.bulk per plane and token; ThreadPlanes where there is no bulk
//   copy; or the caller's prologue, such as a norm).
// - Shares: warp i of the grid takes k-steps [i W / N, (i + 1) W / N) of
//   the phase's W, cut at tile ends into pieces. Pieces of one tile inside
//   one CTA add through shared memory; a tile that spans two CTAs adds
//   through global slots and a counter (the last arrival adds them in slot
//   order; Machine::staged: all slots copied through shared memory in one
//   round trip first); a tile's column blocks add the same way, in block
//   order.
// Every cut depends on the shape and the machine only, never on T, so every
// token's outputs are bit-identical at every T.
//
// The caller: issues fence.proxy.async.global before the grid barrier that
// ends the phase writing the planes; zeroes the counters once (each last
// arrival resets its own); with BulkPlanes, initialises the mbarrier (one
// arrival) and counts its phases in `nb`.
#pragma once

#include <cstdint>

namespace tcp {

// Column blocks a phase may have (block-sum slots per row tile).
constexpr int kMaxBlocks = 12;
// k-steps of weight loads per register set (two sets in flight).
constexpr int kNb = 4;

// 16 bytes of weights: read once, so not kept in L1, and marked by the
// caller's L2 policy (evict-first).
__device__ __forceinline__ uint4 ld_w16(const uint16_t* p, uint64_t pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where one phase's work goes: everything from the shape [ROWS, K] and the
// machine M (grid, warps, tmax, input_bytes, part_bytes, tile8, relacq,
// staged).
template <int K, int ROWS, class M>
struct Plan {
    static_assert(ROWS % 16 == 0 && K % 32 == 0, "whole tiles and k-steps");
    static constexpr int NWT = M::grid * M::warps;
    static constexpr int blocks() {
        for (int d = 1; d <= K / 32; ++d)
            if (M::grid % d == 0 && (K / 32) % d == 0 && (K / d + 32) * M::tmax * 4 <= M::input_bytes) return d;
        return 0;
    }
    static constexpr int NKB = blocks();
    static_assert(NKB >= 1 && NKB <= kMaxBlocks, "tmax tokens' planes of a column block fit");
    static constexpr int KS = K / 32 / NKB;                   // k-steps of a block
    static constexpr int KB = K / NKB;                        // columns of a block
    static constexpr int P = KB % 64 == 0 ? KB + 32 : KB;     // token pitch in shared memory, elements
    static constexpr int RTILES = ROWS / 16, TILES = RTILES * NKB;
    static constexpr int W = TILES * KS;                      // the phase's k-steps
    static_assert((long long)(W + 1) * NWT < (1ll << 31), "32-bit share arithmetic");
    // Fewer k-steps than warps: a share is one k-step or none.
    static constexpr bool SPARSE = W < NWT;
    // Pieces per warp and contributors per tile, at most.
    static constexpr int MAXP = ((W + NWT - 1) / NWT + KS - 1) / KS + 1;
    static constexpr int SLOTS = SPARSE ? KS : (KS - 1) / (W / NWT) + 2;
    static_assert(SLOTS <= 64, "64 partial slots a tile");
    // A CTA's k-steps, and the tiles its share touches, at most.
    static constexpr int CSH = (M::warps * W + NWT - 1) / NWT;
    static constexpr int MAXLT = (CSH + KS - 1) / KS + 1;
    // M::staged: after them, two staging areas for the slots of the CTA's
    // spanning tiles (its first and its last).
    static constexpr int STAGE0 = MAXLT * SLOTS * 128;  // floats
    static_assert((MAXLT + (M::staged ? 2 : 0)) * SLOTS * 512 <= M::part_bytes, "a CTA's local partials fit");
    static_assert(2 * M::tmax * P * 2 <= M::input_bytes, "tmax tokens' planes fit");
    static_assert(KB % 8 == 0 && P % 8 == 0, "16-byte aligned bulk copies");
    // Elements from one k-step's load to the next, and from rows g to g + 8.
    static constexpr int JSTRIDE = M::tile8 ? 256 : 512;
    static constexpr int HOFF = M::tile8 ? 8 * K : 256;
};

// Global scratch shared by every phase (sized for the widest).
struct Scratch {
    float* part;     // [tiles][64][16][8] f32: a tile's partials, a slot per contributor
    unsigned* cnt;   // [tiles]: arrivals; zero between phases
    float* bpart;    // [row tiles][kMaxBlocks][16][8] f32: a tile's block sums
    unsigned* bcnt;  // [row tiles]: block arrivals; zero between phases
};

// Where a phase's inputs come from: fill<T, P>(xs, b0, kb) leaves plane pl
// of token t, columns [b0, b0 + kb), at xs + (pl T + t) P (bf16) in the
// calling thread's view; the phase then synchronises the CTA.
//
// Planes in global memory [2][tmax][xstride] bf16 (written by the previous
// phase's epilogue), copied by the copy engine (sm_90): one bulk copy per
// plane and token, thread 0 issues, every thread waits on the mbarrier
// (one arrival; nb counts its completed phases).
struct BulkPlanes {
    const uint16_t* xh;
    int xstride, tmax;
    unsigned mbar;
    unsigned* nb;
    template <int T, int P>
    __device__ __forceinline__ void fill(uint16_t* xs, int b0, int kb) const {
        const unsigned xs_base = (unsigned)__cvta_generic_to_shared(xs);
        if (threadIdx.x == 0) {
            // The planes were written through the generic proxy.
            asm volatile("fence.proxy.async.global;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mbar),
                         "r"((unsigned)(2 * T * kb * 2))
                         : "memory");
            for (int pt = 0; pt < 2 * T; ++pt) {
                const int pl = pt / T, t = pt - pl * T;
                const uint16_t* src = xh + (size_t)(pl * tmax + t) * xstride + b0;
                asm volatile(
                    "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                        xs_base + (unsigned)(pt * P * 2)),
                    "l"(src), "r"((unsigned)(kb * 2)), "r"(mbar)
                    : "memory");
            }
        }
        asm volatile(
            "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra "
            "WAIT_%=;\n}" ::"r"(mbar),
            "r"(*nb & 1u)
            : "memory");
        ++*nb;
    }
};

// The same planes copied by every thread, 16 bytes at a time, 4 loads in
// flight (any arch).
struct ThreadPlanes {
    const uint16_t* xh;
    int xstride, tmax;
    template <int T, int P>
    __device__ __forceinline__ void fill(uint16_t* xs, int b0, int kb) const {
        const int nv = kb / 8, n = 2 * T * nv;
        for (int i0 = threadIdx.x; i0 < n; i0 += 4 * (int)blockDim.x) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + u * (int)blockDim.x, pt = i / nv, pl = pt / T;
                if (i < n)
                    v[u] = __ldcg(reinterpret_cast<const uint4*>(xh + (size_t)(pl * tmax + pt - pl * T) * xstride + b0) +
                                  (i - pt * nv));
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + u * (int)blockDim.x, pt = i / nv;
                if (i < n) reinterpret_cast<uint4*>(xs + pt * P)[i - pt * nv] = v[u];
            }
        }
    }
};

// One phase for T tokens. w: the weights in tile order; in: the inputs
// (BulkPlanes, ThreadPlanes, or a prologue with fill<T, P>); xs: the CTA's
// dynamic shared memory (input_bytes of planes, then part_bytes of local
// partials); wait(): the grid barrier that ends the previous phase (the
// first weight loads go out before it); epi(r, t, v): output (row r, token
// t) = v, called once for each r < ROWS, t < T.
template <int K, int ROWS, int T, class M, class In, class Wait, class Epi>
__device__ __forceinline__ void phase(const uint16_t* __restrict__ w, const In& in, uint16_t* xs, const Scratch& sc,
                                      uint64_t pol, Wait wait, Epi epi) {
    using PL = Plan<K, ROWS, M>;
    constexpr int NWT = PL::NWT, KS = PL::KS, RTILES = PL::RTILES, W = PL::W, SLOTS = PL::SLOTS;
    constexpr int WARPS = M::warps;
    static_assert(T >= 1 && T <= M::tmax && T <= 8, "tokens are the 8 columns of B");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int me = blockIdx.x * WARPS + warp;
    const unsigned xs_base = (unsigned)__cvta_generic_to_shared(xs);
    // The local partials after the inputs (recomputed where used, rarely).
    auto lpart = [&] { return reinterpret_cast<float*>(reinterpret_cast<char*>(xs) + M::input_bytes); };

    auto start = [](int wi) { return wi * W / NWT; };
    // The warp whose share holds k-step p: the i with start(i) <= p < start(i + 1).
    auto owner = [](int p) { return ((p + 1) * NWT + W - 1) / W - 1; };
    // Whether tile t's contributors span two CTAs.
    auto spans = [&](int t) { return owner(t * KS) / WARPS != owner(t * KS + KS - 1) / WARPS; };
    // Recomputed where used (rarely), to keep registers for the stream.
    auto cta_tile = [&] { return start(blockIdx.x * WARPS) / KS; };

    // A piece: k-steps [j0, j1) of one tile, the warp's slot among the
    // tile's contributors and their count. The last warp of a CTA takes
    // its last piece (the CTA's edge tile) first.
    struct Piece {
        int tile, j0, j1, slot, count;
    };
    auto piece = [&](int k, Piece& pc) -> bool {
        const int b0 = start(me), e0 = start(me + 1);
        const int np = e0 > b0 ? (e0 - 1) / KS - b0 / KS + 1 : 0;
        if (k >= np) return false;
        if (warp == WARPS - 1 && np > 1) k = k == 0 ? np - 1 : k - 1;
        const int t = b0 / KS + k;
        const int p0 = max(b0, t * KS), p1 = min(e0, (t + 1) * KS);
        pc.tile = t;
        pc.j0 = p0 - t * KS;
        pc.j1 = p1 - t * KS;
        if constexpr (PL::SPARSE) {
            pc.slot = pc.j0;
            pc.count = KS;
        } else {
            const int first = owner(t * KS);
            pc.slot = me - first;
            pc.count = owner(t * KS + KS - 1) - first + 1;
        }
        return true;
    };

    // Lane 0's arrival at a counter: the count before it.
    auto count_in = [](unsigned* c) {
        unsigned old;
        if constexpr (M::relacq)
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
        else
            old = atomicAdd(c, 1u);
        return old;
    };
    // The warp's arrival (after its partial is stored): whether it is the
    // last of n; if so its later loads see every partial.
    auto last_of = [&](unsigned* c, unsigned n) {
        if constexpr (!M::relacq) __threadfence();
        __syncwarp();
        unsigned old = 0;
        if (lane == 0) old = count_in(c);
        old = __shfl_sync(0xffffffffu, old, 0);
        if (old != n - 1u) return false;
        if constexpr (M::relacq)
            __syncwarp();
        else
            __threadfence();
        return true;
    };
    // Lane (g, q) holds rows g, g + 8 of a tile for tokens 2q, 2q + 1.
    auto put = [&](float* pt, float2 a, float2 b) {
        *reinterpret_cast<float2*>(pt + g * 8 + 2 * q) = a;
        *reinterpret_cast<float2*>(pt + (g + 8) * 8 + 2 * q) = b;
    };
    auto get = [&](const float* pt, float2& a, float2& b) {
        a = __ldcg(reinterpret_cast<const float2*>(pt + g * 8 + 2 * q));
        b = __ldcg(reinterpret_cast<const float2*>(pt + (g + 8) * 8 + 2 * q));
    };
    auto add = [](float2& a, float2 b) { a = make_float2(a.x + b.x, a.y + b.y); };
    auto write = [&](int rt, float2 a, float2 b) {
        const int r0 = rt * 16 + g, t0 = 2 * q;
        if (t0 < T) {
            epi(r0, t0, a.x);
            epi(r0 + 8, t0, b.x);
        }
        if (t0 + 1 < T) {
            epi(r0, t0 + 1, a.y);
            epi(r0 + 8, t0 + 1, b.y);
        }
    };
    // A tile's whole sums over its block; with column blocks the last of
    // the NKB blocks to arrive adds them in block order.
    auto out = [&](int tile, float2 a, float2 b) {
        if constexpr (PL::NKB == 1) {
            write(tile, a, b);
        } else {
            const int rt = tile % RTILES;
            float* pt = sc.bpart + (size_t)rt * kMaxBlocks * 128;  // [kMaxBlocks][16][8]
            put(pt + (tile / RTILES) * 128, a, b);
            if (!last_of(sc.bcnt + rt, PL::NKB)) return;
            float2 ra[PL::NKB], rb[PL::NKB];
#pragma unroll
            for (int i = 0; i < PL::NKB; ++i) get(pt + i * 128, ra[i], rb[i]);
            a = ra[0];
            b = rb[0];
#pragma unroll
            for (int i = 1; i < PL::NKB; ++i) {
                add(a, ra[i]);
                add(b, rb[i]);
            }
            write(rt, a, b);
            if (lane == 0) sc.bcnt[rt] = 0u;
        }
    };
    // A spanning tile's partial: its global slot, then the counter; the
    // last contributor adds the slots in order.
    auto arrive = [&](const Piece& pc, float2 a, float2 b) {
        float* pt = sc.part + (size_t)pc.tile * 64 * 128;  // [64][16][8]
        put(pt + pc.slot * 128, a, b);
        if (!last_of(sc.cnt + pc.tile, (unsigned)pc.count)) return;
        if constexpr (M::staged) {
            // Every slot in one round trip, through shared memory (no
            // registers: the stream's are live), then added in order.
            float* st = lpart() + PL::STAGE0 + (pc.tile == cta_tile() ? 0 : SLOTS * 128);  // [SLOTS][16][8]
            const unsigned st_s = (unsigned)__cvta_generic_to_shared(st) + lane * 16u;
#pragma unroll 1
            for (int k = 0; k < pc.count; ++k)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(st_s + k * 512u), "l"(pt + k * 128 + lane * 4)
                             : "memory");
            asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
            __syncwarp();
            a = *reinterpret_cast<const float2*>(st + g * 8 + 2 * q);
            b = *reinterpret_cast<const float2*>(st + (g + 8) * 8 + 2 * q);
            for (int k = 1; k < pc.count; ++k) {
                add(a, *reinterpret_cast<const float2*>(st + k * 128 + g * 8 + 2 * q));
                add(b, *reinterpret_cast<const float2*>(st + k * 128 + (g + 8) * 8 + 2 * q));
            }
            __syncwarp();
        } else {
            get(pt, a, b);
#pragma unroll 1
            for (int k = 1; k < pc.count; ++k) {
                float2 a1, b1;
                get(pt + k * 128, a1, b1);
                add(a, a1);
                add(b, b1);
            }
        }
        out(pc.tile, a, b);
        if (lane == 0) sc.cnt[pc.tile] = 0u;
    };
    auto flush = [&](const Piece& pc, const float (&d)[4]) {
        const float2 a = make_float2(d[0], d[1]), b = make_float2(d[2], d[3]);
        if (pc.count == 1)
            out(pc.tile, a, b);
        else if (!spans(pc.tile))
            put(lpart() + ((pc.tile - cta_tile()) * SLOTS + pc.slot) * 128, a, b);
        else
            arrive(pc, a, b);
    };
    // After the stream: the last contributor of each tile inside the CTA
    // adds its slots in order.
    auto local_sums = [&]() {
        __syncthreads();
        Piece pc;
        for (int k = 0; k < PL::MAXP && piece(k, pc); ++k) {
            if (pc.count == 1 || spans(pc.tile) || pc.slot != pc.count - 1) continue;
            const float* pt = lpart() + (pc.tile - cta_tile()) * SLOTS * 128;  // [SLOTS][16][8]
            float2 a = *reinterpret_cast<const float2*>(pt + g * 8 + 2 * q);
            float2 b = *reinterpret_cast<const float2*>(pt + (g + 8) * 8 + 2 * q);
            for (int i = 1; i < pc.count; ++i) {
                add(a, *reinterpret_cast<const float2*>(pt + i * 128 + g * 8 + 2 * q));
                add(b, *reinterpret_cast<const float2*>(pt + i * 128 + (g + 8) * 8 + 2 * q));
            }
            out(pc.tile, a, b);
        }
    };

    // The CTA's block of both planes of every token.
    auto copy_inputs = [&]() {
        const int b0 = PL::NKB == 1 ? 0 : (int)((long long)blockIdx.x * PL::NKB / M::grid) * PL::KB;
        in.template fill<T, PL::P>(xs, b0, PL::KB);
    };
    // Token g's 16 bytes of a plane at block column 32 j + 8 q (zeros for
    // tokens >= T).
    auto xfrag = [&](int j, int plane) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (g < T) {
            const unsigned a = xs_base + (unsigned)((plane * T + g) * PL::P + 32 * j + 8 * q) * 2u;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
        }
        return v;
    };
    auto step_mma = [&](float (&d)[4], const uint4& wa, const uint4& wb, int j) {
        const uint4 xh4 = xfrag(j, 0), xl4 = xfrag(j, 1);
        mma16816(d, wa.x, wb.x, wa.y, wb.y, xh4.x, xh4.y);
        mma16816(d, wa.z, wb.z, wa.w, wb.w, xh4.z, xh4.w);
        mma16816(d, wa.x, wb.x, wa.y, wb.y, xl4.x, xl4.y);
        mma16816(d, wa.z, wb.z, wa.w, wb.w, xl4.z, xl4.w);
    };
    // Lane (g, q)'s first element of the tile's block at k-step 0.
    auto rows_at = [&](int tile) {
        return w + (size_t)(tile % RTILES) * 16 * K + (size_t)(tile / RTILES) * KS * PL::JSTRIDE + 8 * lane;
    };

    // Two cursors over the warp's (piece, k-step) sequence: the loads run
    // one batch ahead of the sums, across pieces.
    struct Cur {
        int k, j, j1;       // j1 = 0: past the warp's last piece
        const uint16_t* r;  // the piece's tile at lane (g, q)
    };
    auto enter = [&](Cur& c) {
        Piece pc;
        c.j1 = 0;
        if (piece(c.k, pc)) {
            c.j = pc.j0;
            c.j1 = pc.j1;
            c.r = rows_at(pc.tile);
        }
    };
    Cur lc{0, 0, 0, nullptr}, cc{0, 0, 0, nullptr};
    enter(lc);
    enter(cc);
    auto load = [&](uint4 (&wa)[kNb], uint4 (&wb)[kNb]) {
        if (!lc.j1) return;
#pragma unroll
        for (int i = 0; i < kNb; ++i)
            if (lc.j + i < lc.j1) {
                wa[i] = ld_w16(lc.r + (size_t)PL::JSTRIDE * (lc.j + i), pol);
                wb[i] = ld_w16(lc.r + PL::HOFF + (size_t)PL::JSTRIDE * (lc.j + i), pol);
            }
        lc.j += kNb;
        if (lc.j >= lc.j1) {
            ++lc.k;
            enter(lc);
        }
    };
    float d[4] = {0, 0, 0, 0};
    auto compute = [&](const uint4 (&wa)[kNb], const uint4 (&wb)[kNb]) {
#pragma unroll
        for (int i = 0; i < kNb; ++i)
            if (cc.j + i < cc.j1) step_mma(d, wa[i], wb[i], cc.j + i);
        cc.j += kNb;
        if (cc.j >= cc.j1) {
            Piece pc;
            piece(cc.k, pc);
            flush(pc, d);
            d[0] = d[1] = d[2] = d[3] = 0.0f;
            ++cc.k;
            enter(cc);
        }
    };
    uint4 wa0[kNb], wb0[kNb], wa1[kNb], wb1[kNb];
    load(wa0, wb0);  // before the barrier: the weights depend on nothing
    wait();
    copy_inputs();
    __syncthreads();
#pragma unroll 1
    while (cc.j1) {
        load(wa1, wb1);
        compute(wa0, wb0);
        if (!cc.j1) break;
        load(wa0, wb0);
        compute(wa1, wb1);
    }
    local_sums();
}

}  // namespace tcp
