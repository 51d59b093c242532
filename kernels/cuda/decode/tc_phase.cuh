// decode/tc_phase.cuh: a weight phase on tensor cores, shared by the
// one-token and the multi-token step (every weight phase of a layer from 7B
// up, where the build asks for them: QMK_TC_PHASES):
//
//   y[t][r] = W[r, :] . (hi[t][:] + lo[t][:])   for r < ROWS, t < T
//
// - Weights [ROWS, K] bf16 in tile order (qmk_layout::TileOrder): bands of
//   BAND rows, 32-column k-steps, then the BAND x 32 block row by row. A
//   tile is 16 rows: with BAND 16 one band; with BAND 8 a band of one tensor
//   (gate) and the same band of another (up), so one lane holds both rows
//   of its epilogue (q/k/v: bands i and i + D / 2 of a head, the rotary
//   pairs). Lane (g, q) loads 16 bytes of the tile's rows g and
//   g + 8 at column 8 q of a k-step: its A fragments of two m16n8k16 MMAs,
//   whose k order both operands share. Each load instruction of a warp reads
//   512 (BAND 16) or twice 256 contiguous bytes.
// - Inputs: two bf16 planes per token in shared memory, hi = bf16(x) and
//   lo = bf16(x - hi), so the sums keep 16 bits of each input's mantissa
//   (plain bf16 inputs move Hugging Face's logprobs a thousand times
//   further). Token t is column t of B; lanes of tokens T and up feed
//   zeros, and the columns of an MMA are independent, so a token's sums do
//   not depend on T.
// - Column blocks: the fewest blocks (dividing the grid and the k-steps)
//   whose tmax tokens' planes fit the input area; a CTA's share lies in one
//   block, and it fills that block only.
// - Shares: warp i of the nominal grid takes k-steps [i W / N, (i + 1) W /
//   N) of the phase's W, cut at tile ends into pieces. Pieces of a tile
//   inside one CTA add through shared memory in slot order; a tile that
//   spans two CTAs adds through global slots and a counter (its last
//   arrival copies every slot through shared memory in one round trip, then
//   adds them in slot order); a tile's column blocks add the same way, in
//   block order.
// Every cut depends on the shape and the nominal machine (QMK_TC_*, rendered
// from qmk_layout::TcPlan), never on T or on the grid that runs: a grid of
// another size runs the nominal CTAs in turn. So every token's outputs are
// bit-identical at every T, on every grid.
#pragma once

#if !defined(QMK_TC_PHASES)
#error "QMK_TC_PHASES comes from KernelBuild::arch_options"
#endif

namespace qmk {
namespace tc {

// Column blocks a phase may have (qmk_layout's TC_MAX_BLOCKS).
constexpr int kMaxBlocks = 12;
// Partial-sum slots a tile may have (TC_MAX_SLOTS).
constexpr int kMaxSlots = 64;
// k-steps of weight loads per register set (two sets in flight).
constexpr int kNb = 4;

// Not volatile: the compiler may schedule the MMAs among the loads.
__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where one phase's work goes: everything from the shape [ROWS, K] and the
// machine M (grid, warps, tmax, input_bytes, part_bytes, staged); the same
// arithmetic as qmk_layout::TcPlan.
template <int K, int ROWS, class M>
struct Plan {
    static_assert(ROWS % 16 == 0 && K % 32 == 0, "whole tiles and k-steps");
    static constexpr int NWT = M::grid * M::warps;
    static constexpr int blocks() {
        for (int d = 1; d <= K / 32 && d <= kMaxBlocks; ++d)
            if (M::grid % d == 0 && (K / 32) % d == 0 && (K / d + 32) * M::tmax * 4 <= M::input_bytes) return d;
        return 0;
    }
    static constexpr int NKB = blocks();
    static_assert(NKB >= 1, "tmax tokens' planes of a column block fit");
    static constexpr int KS = K / 32 / NKB;                // k-steps of a block
    static constexpr int KB = K / NKB;                     // columns of a block
    static constexpr int P = KB % 64 == 0 ? KB + 32 : KB;  // token pitch in shared memory, elements
    static constexpr int RTILES = ROWS / 16, TILES = RTILES * NKB;
    static constexpr int W = TILES * KS;  // the phase's k-steps
    static_assert((long long)(W + 1) * NWT < (1ll << 31), "32-bit share arithmetic");
    // Fewer k-steps than warps: a share is one k-step or none.
    static constexpr bool SPARSE = W < NWT;
    // Pieces per warp and contributors per tile, at most.
    static constexpr int MAXP = ((W + NWT - 1) / NWT + KS - 1) / KS + 1;
    static constexpr int SLOTS = SPARSE ? KS : (KS - 1) / (W / NWT) + 2;
    static_assert(SLOTS <= kMaxSlots, "partial slots a tile");
    // A CTA's k-steps, and the tiles its share touches, at most.
    static constexpr int CSH = (M::warps * W + NWT - 1) / NWT;
    static constexpr int MAXLT = (CSH + KS - 1) / KS + 1;
    // M::staged: after the local partials, two staging areas for the slots
    // of the CTA's spanning tiles (its first and its last).
    static constexpr int STAGE0 = MAXLT * SLOTS * 128;  // floats
    static_assert((MAXLT + (M::staged ? 2 : 0)) * SLOTS * 512 <= M::part_bytes, "a CTA's local partials fit");
    static_assert(2 * M::tmax * P * 2 <= M::input_bytes, "tmax tokens' planes fit");
    static_assert(KB % 8 == 0 && P % 8 == 0, "16-byte aligned plane rows");
};

// A phase's global scratch (Params::tc_scratch, laid out by qmk_layout's
// TcPlan): counters are zero between phases.
struct Scratch {
    float* part;     // [tiles][slots][16][8] f32: a tile's partials, a slot per contributor
    unsigned* cnt;   // [tiles]: arrivals
    float* bpart;    // [row tiles][blocks][16][8] f32: a tile's block sums
    unsigned* bcnt;  // [row tiles]: block arrivals
};

// Inputs [T][xstride] f32 in global memory (written by the previous phase),
// split into the hi and lo planes as the CTA copies its block: fill<T, P>(xs,
// b0, kb) leaves plane pl of token t, columns [b0, b0 + kb), at xs + (pl T
// + t) P (bf16); the phase then synchronises the CTA.
struct F32Planes {
    const float* x;
    int xstride;
    template <int T, int P>
    __device__ __forceinline__ void fill(u16* xs, int b0, int kb) const {
        const int nv = kb / 8, n = T * nv;  // 8-element groups
        // 4 groups of a thread in flight: their loads issue before any store.
        for (int i0 = threadIdx.x; i0 < n; i0 += 4 * (int)blockDim.x) {
            float4 a[4], b[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + u * (int)blockDim.x, t = i / nv;
                if (i < n) {
                    const float4* src = reinterpret_cast<const float4*>(x + (size_t)t * xstride + b0) + 2 * (i - t * nv);
                    a[u] = __ldcg(src);
                    b[u] = __ldcg(src + 1);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = i0 + u * (int)blockDim.x, t = i / nv;
                if (i < n) {
                    const float f[8] = {a[u].x, a[u].y, a[u].z, a[u].w, b[u].x, b[u].y, b[u].z, b[u].w};
                    u32 hi[4], lo[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        hi[j] = cvt_bf16x2(f[2 * j], f[2 * j + 1]);
                        lo[j] = cvt_bf16x2(f[2 * j] - bf16_lo(hi[j]), f[2 * j + 1] - bf16_hi(hi[j]));
                    }
                    const int v = i - t * nv;
                    reinterpret_cast<uint4*>(xs + t * P)[v] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
                    reinterpret_cast<uint4*>(xs + (T + t) * P)[v] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
                }
            }
        }
    }
};

// The RMSNorm of T residual streams [T][H] f32 (written by the previous
// phase; token t's embedding row [H] bf16 instead where emb[t] is set: layer
// 0) times the norm weight [H] bf16, split into the planes as the CTA fills
// its block. Each token's sum of squares takes rms_norm's order (a thread's
// elements ascending, then the warp and CTA trees) whatever T is. red:
// [tmax][QMK_WARPS] f32 in shared memory.
struct NormPlanes {
    const float* x;
    const char* w;
    float eps;
    float* red;
    const char* emb[8];
    __device__ __forceinline__ float at(int t, int i) const {
        return emb[t] ? ld_bf16(emb[t] + (size_t)i * 2) : __ldcg(x + (size_t)t * QMK_HIDDEN + i);
    }
    // Elements [col, col + 8) of token t.
    __device__ __forceinline__ void at8(int t, int col, float (&f)[8]) const {
        if (emb[t]) {
            const uint4 e = *reinterpret_cast<const uint4*>(emb[t] + (size_t)col * 2);
            const u32 ew[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                f[2 * j] = bf16_lo(ew[j]);
                f[2 * j + 1] = bf16_hi(ew[j]);
            }
        } else {
            const float4* src = reinterpret_cast<const float4*>(x + (size_t)t * QMK_HIDDEN + col);
            const float4 a = __ldcg(src), b = __ldcg(src + 1);
            f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
        }
    }
    template <int T, int P>
    __device__ __forceinline__ void fill(u16* xs, int b0, int kb) const {
        constexpr int PER = ((int)QMK_HIDDEN + QMK_THREADS - 1) / QMK_THREADS;
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = tid + j * QMK_THREADS;
                if (i < (int)QMK_HIDDEN) {
                    const float v = at(t, i);
                    ss = fmaf(v, v, ss);
                }
            }
            ss = warp_sum(ss);
            if (lane == 0) red[t * QMK_WARPS + warp] = ss;
        }
        __syncthreads();
        float inv[T];
#pragma unroll
        for (int t = 0; t < T; ++t) {
            float s = lane < QMK_WARPS ? red[t * QMK_WARPS + lane] : 0.0f;
            s = warp_sum(s);
            inv[t] = 1.0f / sqrtf(s / (float)QMK_HIDDEN + eps);
        }
        const int nv = kb / 8, n = T * nv;  // 8-element groups
        for (int i = tid; i < n; i += QMK_THREADS) {
            const int t = i / nv, v = i - t * nv, col = b0 + 8 * v;
            float f[8];
            at8(t, col, f);
            const uint4 wv = *reinterpret_cast<const uint4*>(w + (size_t)col * 2);
            float r = inv[0];
#pragma unroll
            for (int u = 1; u < T; ++u)
                if (u == t) r = inv[u];
            const u32 ww[4] = {wv.x, wv.y, wv.z, wv.w};
            u32 hi[4], lo[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float y0 = f[2 * j] * r * bf16_lo(ww[j]), y1 = f[2 * j + 1] * r * bf16_hi(ww[j]);
                hi[j] = cvt_bf16x2(y0, y1);
                lo[j] = cvt_bf16x2(y0 - bf16_lo(hi[j]), y1 - bf16_hi(hi[j]));
            }
            reinterpret_cast<uint4*>(xs + t * P)[v] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            reinterpret_cast<uint4*>(xs + (T + t) * P)[v] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
    }
};

// A phase's shares and its sums, for T tokens at nominal CTA `cta`: which
// k-steps a warp takes (pieces of tiles), and how a piece's partial sums
// reach the epilogue. The stream calls flush() once per piece; it is not
// inlined, so the epilogue's registers never compete with the weights the
// stream holds in flight (inlined, ptxas spilled those to local memory
// around it).
template <int K, int ROWS, int T, class M, class Epi>
struct Sums {
    using PL = Plan<K, ROWS, M>;
    static constexpr int NWT = PL::NWT, KS = PL::KS, RTILES = PL::RTILES, W = PL::W, SLOTS = PL::SLOTS;
    static constexpr int WARPS = M::warps;
    // k-steps [j0, j1) of one tile, the warp's slot among the tile's
    // contributors and their count.
    struct Piece {
        int tile, j0, j1, slot, count;
    };
    const Scratch& sc;
    u16* xs;
    int cta;
    const Epi& epi;
    int lane, warp, g, q, me;

    __device__ __forceinline__ Sums(const Scratch& s, u16* x, int c, const Epi& e)
        : sc(s), xs(x), cta(c), epi(e), lane((int)threadIdx.x & 31), warp((int)threadIdx.x >> 5),
          g(((int)threadIdx.x & 31) >> 2), q((int)threadIdx.x & 3), me(c * WARPS + ((int)threadIdx.x >> 5)) {}

    __device__ __forceinline__ static int start(int wi) { return wi * W / NWT; }
    // The warp whose share holds k-step p: the i with start(i) <= p < start(i + 1).
    __device__ __forceinline__ static int owner(int p) { return ((p + 1) * NWT + W - 1) / W - 1; }
    // Whether tile t's contributors span two CTAs.
    __device__ __forceinline__ static bool spans(int t) {
        return owner(t * KS) / WARPS != owner(t * KS + KS - 1) / WARPS;
    }
    __device__ __forceinline__ int cta_tile() const { return start(cta * WARPS) / KS; }
    // The local partials after the inputs.
    __device__ __forceinline__ float* lpart() const {
        return reinterpret_cast<float*>(reinterpret_cast<char*>(xs) + M::input_bytes);
    }

    // The warp's k-th piece. The last warp of a CTA takes its last piece
    // (the CTA's edge tile) first, so that arrival finishes while the rest
    // still streams.
    __device__ __forceinline__ bool piece(int k, Piece& pc) const {
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
    }

    // The warp's arrival at a counter (after its partial is stored):
    // whether it is the last of n. The block barrier of __syncwarp orders
    // the lanes' stores before lane 0's release; its acquire makes every
    // partial visible to the last arrival's loads.
    __device__ __forceinline__ bool last_of(unsigned* c, unsigned n) const {
        __syncwarp();
        unsigned old = 0;
        if (lane == 0) asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
        old = __shfl_sync(QMK_FULL_MASK, old, 0);
        if (old != n - 1u) return false;
        __syncwarp();
        return true;
    }
    // Lane (g, q) holds rows g, g + 8 of a tile for tokens 2q, 2q + 1.
    __device__ __forceinline__ void put(float* pt, float2 a, float2 b) const {
        *reinterpret_cast<float2*>(pt + g * 8 + 2 * q) = a;
        *reinterpret_cast<float2*>(pt + (g + 8) * 8 + 2 * q) = b;
    }
    __device__ __forceinline__ void get(const float* pt, float2& a, float2& b) const {
        a = __ldcg(reinterpret_cast<const float2*>(pt + g * 8 + 2 * q));
        b = __ldcg(reinterpret_cast<const float2*>(pt + (g + 8) * 8 + 2 * q));
    }
    __device__ __forceinline__ static void add(float2& a, float2 b) { a = make_float2(a.x + b.x, a.y + b.y); }
    __device__ __forceinline__ void write(int rt, float2 a, float2 b) const {
        const int t0 = 2 * q;
        if (t0 < T) epi(rt, g, t0, a.x, b.x);
        if (t0 + 1 < T) epi(rt, g, t0 + 1, a.y, b.y);
    }
    // A tile's whole sums over its block; with column blocks the last of the
    // NKB blocks to arrive adds them in block order.
    __device__ __forceinline__ void out(int tile, float2 a, float2 b) const {
        if constexpr (PL::NKB == 1) {
            write(tile, a, b);
        } else {
            const int rt = tile % RTILES;
            float* pt = sc.bpart + (size_t)rt * PL::NKB * 128;  // [NKB][16][8]
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
    }
    // A spanning tile's partial: its global slot, then the counter; the last
    // contributor adds the slots in order.
    __device__ __forceinline__ void arrive(const Piece& pc, float2 a, float2 b) const {
        float* pt = sc.part + (size_t)pc.tile * SLOTS * 128;  // [SLOTS][16][8]
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
    }
    // A piece's sums d: to the epilogue, the CTA's slots, or a global slot.
    __device__ __noinline__ void flush(const Piece pc, float d0, float d1, float d2, float d3) const {
        const float2 a = make_float2(d0, d1), b = make_float2(d2, d3);
        if (pc.count == 1)
            out(pc.tile, a, b);
        else if (!spans(pc.tile))
            put(lpart() + ((pc.tile - cta_tile()) * SLOTS + pc.slot) * 128, a, b);
        else
            arrive(pc, a, b);
    }
    // After the stream: the last contributor of each tile inside the CTA
    // adds its slots in order.
    __device__ __forceinline__ void local_sums() const {
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
    }
};

// One phase for T tokens, nominal CTA `cta`. tile(rt): row tile rt's first
// element (its top band, block 0, k-step 0) in the layer's weights in tile
// order, bands of BAND rows; hoff: elements from a tile's row g to its row
// g + 8 (256 in 16-row bands; with 8-row bands, to the bottom band); in: the
// inputs (fill<T, P>); xs: the CTA's dynamic shared memory (input_bytes of
// planes, then part_bytes of local partials); epi(rt, g, t, top, bottom):
// the sums of tile rt's rows g and g + 8 for token t, called once for each
// rt, g < 8, t < T. The caller separates two nominal CTAs of one CTA with a
// block barrier.
template <int K, int ROWS, int T, int BAND, class M, class Tile, class In, class Epi>
__device__ __forceinline__ void phase(Tile tile_at, long long hoff, const In& in, u16* xs, const Scratch& sc, int cta,
                                      const Epi& epi) {
    using S = Sums<K, ROWS, T, M, Epi>;
    using PL = typename S::PL;
    using Piece = typename S::Piece;
    constexpr int KS = PL::KS, RTILES = PL::RTILES;
    static_assert(T >= 1 && T <= M::tmax && T <= 8, "tokens are the 8 columns of B");
    static_assert(M::warps == QMK_WARPS, "the plan's warps are the CTA's");
    static_assert(BAND == 16 || BAND == 8, "bands of 16 or 8 rows");
    // Elements from one k-step's loads to the next.
    constexpr int JSTRIDE = BAND * 32;
    const S s(sc, xs, cta, epi);
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned xs_base = (unsigned)__cvta_generic_to_shared(xs);

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
        return tile_at(tile % RTILES) + (size_t)(tile / RTILES) * KS * JSTRIDE + 8 * lane;
    };

    // Two cursors over the warp's (piece, k-step) sequence: the loads run one
    // batch ahead of the sums, across pieces.
    struct Cur {
        int k, j, j1;  // j1 = 0: past the warp's last piece
        const u16* r;  // the piece's tile at lane (g, q)
    };
    auto enter = [&](Cur& c) {
        Piece pc;
        c.j1 = 0;
        if (s.piece(c.k, pc)) {
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
                wa[i] = ld_weight16<L2::first>(lc.r + (size_t)JSTRIDE * (lc.j + i));
                wb[i] = ld_weight16<L2::first>(lc.r + (BAND == 16 ? 256 : hoff) + (size_t)JSTRIDE * (lc.j + i));
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
            s.piece(cc.k, pc);
            s.flush(pc, d[0], d[1], d[2], d[3]);
            d[0] = d[1] = d[2] = d[3] = 0.0f;
            ++cc.k;
            enter(cc);
        }
    };
    uint4 wa0[kNb], wb0[kNb], wa1[kNb], wb1[kNb];
    load(wa0, wb0);  // before the input copy: the weights depend on nothing
    {
        const int b0 = PL::NKB == 1 ? 0 : (int)((long long)cta * PL::NKB / M::grid) * PL::KB;
        in.template fill<T, PL::P>(xs, b0, PL::KB);
    }
    __syncthreads();
#pragma unroll 1
    while (cc.j1) {
        load(wa1, wb1);
        compute(wa0, wb0);
        if (!cc.j1) break;
        load(wa0, wb0);
        compute(wa1, wb1);
    }
    s.local_sums();
}

#if QMK_TC_PHASES && !QMK_TENSOR_CORES
#error "the tensor-core phases run only where the build asks for them"
#endif

#if QMK_TC_PHASES
// The nominal machine the plans are rendered for (qmk_layout::TcMachine).
struct Machine {
    static constexpr int grid = QMK_TC_GRID, warps = QMK_WARPS, tmax = QMK_TC_TMAX;
    static constexpr int input_bytes = QMK_TC_INPUT_BYTES, part_bytes = QMK_TC_PART_BYTES;
    static constexpr bool staged = QMK_TC_STAGED != 0;
};
static_assert(QMK_TP_RANKS == 1, "a tensor-parallel rank keeps CUDA cores");
static_assert(Machine::input_bytes + Machine::part_bytes <= QMK_SMEM_FLOATS * 4,
              "the one-token step's shared memory holds the tensor-core phases");
// o_proj [H, Q] and down [H, I] in 16-row bands; gate/up [2 I, H]: tile rt
// is rows 8 rt .. 8 rt + 7 of gate, then the same rows of up; q/k/v [Q + 2
// KV, H]: q's tiles, then k's, then v's, each 8 rotary indices of a head.
using QkvPlan = Plan<(int)QMK_HIDDEN, (int)(QMK_Q_DIM + 2 * QMK_KV_DIM), Machine>;
using OProjPlan = Plan<(int)QMK_Q_DIM, (int)QMK_HIDDEN, Machine>;
using DownPlan = Plan<(int)QMK_INTER, (int)QMK_HIDDEN, Machine>;
using GateUpPlan = Plan<(int)QMK_HIDDEN, 2 * (int)QMK_INTER, Machine>;
static_assert(QkvPlan::NKB == QMK_TC_QKV_NKB && QkvPlan::SLOTS == QMK_TC_QKV_SLOTS &&
                  QkvPlan::MAXLT == QMK_TC_QKV_MAXLT,
              "the kernel's q/k/v plan differs from qmk_layout::TcPlan");
static_assert(QMK_HEAD_DIM % 16 == 0 && QMK_KV_DIM % 16 == 0, "whole tiles of rotary pairs");
static_assert(OProjPlan::NKB == QMK_TC_O_NKB && OProjPlan::SLOTS == QMK_TC_O_SLOTS &&
                  OProjPlan::MAXLT == QMK_TC_O_MAXLT,
              "the kernel's o_proj plan differs from qmk_layout::TcPlan");
static_assert(DownPlan::NKB == QMK_TC_DOWN_NKB && DownPlan::SLOTS == QMK_TC_DOWN_SLOTS &&
                  DownPlan::MAXLT == QMK_TC_DOWN_MAXLT,
              "the kernel's down plan differs from qmk_layout::TcPlan");
static_assert(GateUpPlan::NKB == QMK_TC_GU_NKB && GateUpPlan::SLOTS == QMK_TC_GU_SLOTS &&
                  GateUpPlan::MAXLT == QMK_TC_GU_MAXLT,
              "the kernel's gate/up plan differs from qmk_layout::TcPlan");
// The scratch (qmk_layout::TcScratch) holds either phase.
template <class PL>
constexpr bool fits_scratch() {
    return PL::TILES * 4 <= QMK_TC_BCNT_OFF && PL::RTILES * 4 <= QMK_TC_PART_OFF - QMK_TC_BCNT_OFF &&
           (long long)PL::TILES * PL::SLOTS * 512 <= (long long)QMK_TC_BPART_OFF - QMK_TC_PART_OFF &&
           (long long)PL::RTILES * PL::NKB * 512 <= (long long)QMK_TC_SCRATCH_BYTES - QMK_TC_BPART_OFF;
}
static_assert(fits_scratch<QkvPlan>() && fits_scratch<OProjPlan>() && fits_scratch<DownPlan>() && fits_scratch<GateUpPlan>() &&
                  QMK_TC_PART_OFF % 16 == 0,
              "the scratch layout differs from qmk_layout::TcScratch");

__device__ __forceinline__ Scratch scratch(const Params& p) {
    char* b = reinterpret_cast<char*>(p.tc_scratch);
    return Scratch{reinterpret_cast<float*>(b + QMK_TC_PART_OFF), reinterpret_cast<unsigned*>(b),
                   reinterpret_cast<float*>(b + QMK_TC_BPART_OFF), reinterpret_cast<unsigned*>(b + QMK_TC_BCNT_OFF)};
}

// CTA 0 at a step's start: every counter to zero (a step that ended early
// may have left some raised); the grid barriers before the first phase
// publish it.
__device__ __forceinline__ void zero_counters(const Params& p) {
    u32* c = reinterpret_cast<u32*>(p.tc_scratch);
    for (u32 i = threadIdx.x; i < (u32)QMK_TC_PART_OFF / 4u; i += QMK_THREADS) c[i] = 0u;
    __threadfence();
}

// Runs the nominal CTAs of this CTA in turn.
template <class Run>
__device__ __forceinline__ void each_cta(Run run) {
    for (u32 cta = blockIdx.x; cta < (u32)Machine::grid; cta += gridDim.x) {
        if (cta != blockIdx.x) __syncthreads();  // the previous nominal CTA's shared memory is read
        run((int)cta);
    }
}

// o_proj for T tokens: epi(r, t, v) gets o_proj[r] . a[t] (a [T, Q] f32).
template <int T, class Epi>
__device__ __forceinline__ void o_proj(const Params& p, u32 layer, const float* a, float* xs, Epi epi) {
    const LayerView<o_proj_t> wv(p.o_proj, layer);
    const u16* w = reinterpret_cast<const u16*>(wv.row(0));  // [H, Q] bf16, 16-row bands
    const Scratch sc = scratch(p);
    const F32Planes in{a, (int)QMK_Q_DIM};
    each_cta([&](int cta) {
        phase<(int)QMK_Q_DIM, (int)QMK_HIDDEN, T, 16, Machine>(
            [w](int rt) { return w + (size_t)rt * 16 * QMK_Q_DIM; }, 256, in, reinterpret_cast<u16*>(xs), sc, cta, [epi](int rt, int g, int t, float top, float bottom) {
                epi(rt * 16 + g, t, top);
                epi(rt * 16 + g + 8, t, bottom);
            });
    });
}

// down for T tokens: epi(r, t, v) gets down[r] . h[t] (h [T, I] f32).
template <int T, class Epi>
__device__ __forceinline__ void down(const Params& p, u32 layer, const float* h, float* xs, Epi epi) {
    const LayerView<down_proj_t> wv(p.down_proj, layer);
    const u16* w = reinterpret_cast<const u16*>(wv.row(0));  // [H, I] bf16, 16-row bands
    const Scratch sc = scratch(p);
    const F32Planes in{h, (int)QMK_INTER};
    each_cta([&](int cta) {
        phase<(int)QMK_INTER, (int)QMK_HIDDEN, T, 16, Machine>(
            [w](int rt) { return w + (size_t)rt * 16 * QMK_INTER; }, 256, in, reinterpret_cast<u16*>(xs), sc, cta, [epi](int rt, int g, int t, float top, float bottom) {
                epi(rt * 16 + g, t, top);
                epi(rt * 16 + g + 8, t, bottom);
            });
    });
}

// post_attention_layernorm + gate/up for T tokens: epi(r, t, gate, up)
// gets gate[r] . n[t] and up[r] . n[t], n[t] the normed residual x[t]
// ([T, H] f32).
template <int T, class Epi>
__device__ __forceinline__ void gate_up(const Params& p, u32 layer, const float* x, float* xs, Epi epi) {
    __shared__ float red[QMK_TC_TMAX * QMK_WARPS];
    const LayerView<post_attention_layernorm_t> ln(p.post_attention_layernorm, layer);
    const LayerView<gate_proj_t> wg(p.gate_proj, layer);
    const LayerView<up_proj_t> wu(p.up_proj, layer);
    const u16* g0 = reinterpret_cast<const u16*>(wg.row(0));  // [I, H] bf16, 8-row bands
    const u16* u0 = reinterpret_cast<const u16*>(wu.row(0));  // [I, H] bf16, 8-row bands
    const long long hoff = (reinterpret_cast<const char*>(u0) - reinterpret_cast<const char*>(g0)) / 2;
    const Scratch sc = scratch(p);
    const NormPlanes in{x, ln.at(0), p.rms_norm_eps, red, {}};
    each_cta([&](int cta) {
        phase<(int)QMK_HIDDEN, 2 * (int)QMK_INTER, T, 8, Machine>(
            [g0](int rt) { return g0 + (size_t)rt * 8 * QMK_HIDDEN; }, hoff, in, reinterpret_cast<u16*>(xs), sc, cta,
            [epi](int rt, int g, int t, float gate, float up) { epi(rt * 8 + g, t, gate, up); });
    });
}

// input_layernorm + q/k/v + bias + rotary + K/V append for T tokens at
// positions start + t. x: the residuals [T, H] f32; emb[t]: token t's
// embedding row instead (layer 0), else null; q: [T, Q] f32 out. A tile
// holds 8 rotary indices i of one head in its rows g and their partners
// i + D / 2 in rows g + 8, so the lane has both halves of each pair.
template <int T>
__device__ __forceinline__ void qkv(const Params& p, u32 layer, const float* x, const char* const (&emb)[T], u32 start,
                                    float* q, float* xs) {
    __shared__ float red[QMK_TC_TMAX * QMK_WARPS];
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2;
    constexpr int QT = (int)QMK_Q_DIM / 16, KT = (int)QMK_KV_DIM / 16;  // row tiles of q, of k (and v)
    constexpr int TPH = (int)HALF / 8;                                  // row tiles per head
    const LayerView<input_layernorm_t> ln(p.input_layernorm, layer);
    const LayerView<q_proj_t> wq(p.q_proj, layer);
    const LayerView<k_proj_t> wk(p.k_proj, layer);
    const LayerView<v_proj_t> wv(p.v_proj, layer);
    const u16* bases[3] = {reinterpret_cast<const u16*>(wq.row(0)), reinterpret_cast<const u16*>(wk.row(0)),
                           reinterpret_cast<const u16*>(wv.row(0))};  // [Q or KV, H] bf16, 8-row bands
    const LayerView<q_bias_t> bq(p.q_bias, layer);
    const LayerView<k_bias_t> bk(p.k_bias, layer);
    const LayerView<v_bias_t> bv(p.v_bias, layer);
    const char* bias[3] = {bq.at(0), bk.at(0), bv.at(0)};  // [Q or KV] bf16
    char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    const float* cosv = reinterpret_cast<const float*>(p.rope_cos);  // [C, D/2] f32
    const float* sinv = reinterpret_cast<const float*>(p.rope_sin);  // [C, D/2] f32
    const Scratch sc = scratch(p);
    NormPlanes in{x, ln.at(0), p.rms_norm_eps, red, {}};
#pragma unroll
    for (int t = 0; t < T; ++t) in.emb[t] = emb[t];
    // Row tile rt: which tensor, its head h and first rotary index 8 j.
    struct Where {
        int which, h, j;
    };
    auto where = [](int rt) {
        const int which = rt < QT ? 0 : (rt < QT + KT ? 1 : 2);
        const int lt = rt - (which == 0 ? 0 : (which == 1 ? QT : QT + KT));
        return Where{which, lt / TPH, lt % TPH};
    };
    each_cta([&](int cta) {
        phase<(int)QMK_HIDDEN, (int)(QMK_Q_DIM + 2 * QMK_KV_DIM), T, 8, Machine>(
            [bases, where](int rt) {
                const Where w = where(rt);
                const u16* b = w.which == 0 ? bases[0] : (w.which == 1 ? bases[1] : bases[2]);
                return b + (size_t)(w.h * (int)D + 8 * w.j) * QMK_HIDDEN;
            },
            (long long)HALF * QMK_HIDDEN, in, reinterpret_cast<u16*>(xs), sc, cta,
            [where, bias, kl, vl, cosv, sinv, q, start](int rt, int g, int t, float top, float bottom) {
                const Where w = where(rt);
                const u32 i = 8u * (u32)w.j + (u32)g, r0 = (u32)w.h * D + i, r1 = r0 + HALF, pos = start + (u32)t;
                const char* b = w.which == 0 ? bias[0] : (w.which == 1 ? bias[1] : bias[2]);
                float lo = top + ld_bf16(b + (size_t)r0 * 2), hi = bottom + ld_bf16(b + (size_t)r1 * 2);
                if (w.which == 2) {
                    kv_append(vl, pos, r0, lo);
                    kv_append(vl, pos, r1, hi);
                    return;
                }
                const size_t c = (size_t)pos * HALF + i;
                rotate(make_float2(cosv[c], sinv[c]), lo, hi);
                if (w.which == 0) {
                    q[(size_t)t * QMK_Q_DIM + r0] = lo;
                    q[(size_t)t * QMK_Q_DIM + r1] = hi;
                } else {
                    kv_append(kl, pos, r0, lo);
                    kv_append(kl, pos, r1, hi);
                }
            });
    });
}
#endif

}  // namespace tc
}  // namespace qmk
