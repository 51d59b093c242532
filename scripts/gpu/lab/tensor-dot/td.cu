// Tensor-core dot products for the multi-token step, and the one-token step
// they would also have to run.
//
// The multi-token step has to give every token the one-token step's bits.
// With CUDA-core sums that pins every lane's FMA order, and at T tokens the
// step issues about T times the arithmetic and shared-memory reads per
// weight byte (decision 0045's budget). A tensor core computes each column
// of D = A B + C from that column of B and C alone, so with the weights in
// A and token t in column t of B, a token's sums do not depend on how many
// other tokens share the launch, as long as the one-token step runs the
// same MMAs with its token in one column and the rest zero. This lab checks
// that and measures what such a step's weight stream costs.
//
// Part 1, columns: one warp chains mma.sync m16n8k16 (bf16 in, f32
// accumulate) over 1 .. 224 k-steps with random A and B (wide exponents,
// signed zeros, exact cancellations), then the same with one column of B
// moved to each of the 8 positions and the other seven columns zero,
// random, or filled with NaN, +-Inf, 3e38 and subnormals; every moved
// column must equal the original bit for bit.
//
// Part 2, the step: mt.cu's step shape (132 CTAs x 16 warps, 8 layers of
// q/k/v [Q + 2 KV, H], o_proj [H, Q], gate/up [2 I, H], down [H, I], each
// phase reading the previous one's output after a grid barrier) with the
// dot products on tensor cores:
//   - a unit is 16 weight rows x one of S equal k-slices of K (S per phase,
//     the fewest slices that keep 90 % of the grid's warps busy);
//   - a lane (g, q) = (lane / 4, lane % 4) loads 16 bytes of rows g and
//     g + 8 at columns 32 j + 8 q for k-step j, which are its A fragments
//     of two MMAs (the k order inside an MMA is a permutation both operands
//     share), and the same 16 bytes of token g's bf16 input from shared
//     memory as its B fragments; lanes of tokens >= T feed zeros;
//   - NB k-steps of loads in flight per set, two sets, the stream running
//     across the warp's units;
//   - S > 1: each unit stores its 16 x 8 partial sums, and the last unit of
//     a tile to arrive (a counter per tile) adds the S partials in slice
//     order and writes the outputs, so the order is fixed;
//   - inputs f32 in global memory, rounded to bf16 (nearest even) when a
//     phase copies them into shared memory ([T][K] bf16, the token pitch
//     64 bytes off a multiple of 128 so the 8 tokens' reads take distinct
//     banks); where T inputs do not fit, column chunks, each unit's sums
//     held across them.
// Variants, to find what holds the one-token stream below a plain read:
// -DLAB_TILED=1 stores the weights in tile order (a unit's k-steps one
// contiguous stream, 512 contiguous bytes per load instruction instead of
// 64 bytes from each of 8 rows); -DLAB_DEFER=1 moves the fence and the
// counters to the end of the warp's stream (a fence waits for the loads in
// flight, here the next batch's); -DLAB_EARLY=1 issues a phase's first
// batch of loads before the grid barrier and the input copy;
// -DLAB_BALANCE=1 gives each warp an equal contiguous share of the phase's
// k-steps in tile order instead of round-robin units (the shares depend on
// the shape only, so the partials' order does not depend on T);
// -DLAB_PF=N (with both) asks L2 for the stream N k-steps ahead;
// -DLAB_SKIP=bits leaves parts of each phase out, for timing only;
// -DLAB_OVERLAP=1 runs a phase's deferred arrivals after the next phase's
// first loads are issued; -DLAB_OVERLAP=2 also fences before those loads;
// -DLAB_LOCAL=1 adds the slices of a tile inside one CTA through shared
// memory; -DLAB_SUMS=N lets the last arrival at a tile load N slots'
// partials at once; -DLAB_COPY=N copies all T tokens' inputs as one index
// space with N loads in flight per thread; -DLAB_KBLK=N cuts each phase
// into column blocks, so a CTA copies one block's inputs; -DLAB_BULK=1
// copies them with the copy engine from bf16 planes the previous phase
// wrote; -DLAB_RELACQ=1 makes each arrival an acq_rel atomic instead of a
// full fence and an atomic; -DLAB_LATE=1 has the last arrival add its
// tile's slots after its stream; -DLAB_TILE8=1 orders the weights in 8-row
// bands; -DLAB_CLEAN=1 runs every phase through tc_phase.cuh, the chosen
// configuration written as the product would take it, and -DLAB_STAGED=1
// (with it) copies the last arrival's slots through shared memory.
// Every token's last-layer outputs of a T-token run are checked bit for
// bit against its own one-token run (token in column 0). Times are the
// median of 5 launches against a plain read of the same weights.
//
// Build and run (sm_90; LAB_SHAPE 0 = 0.5B, 1 = 7B, 2 = 14B, 3 = 32B, 4 = 1.5B, 5 = 3B):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Xptxas -v -DLAB_SHAPE=1 -o /tmp/td-7b td.cu && /tmp/td-7b
// `run.sh` builds and runs every shape.

#include "../multi-token/step_lab.cuh"  // shapes, weights, grid_sync, the plain read, timing; CK

#include <cmath>

#include "tc_phase.cuh"  // the chosen configuration, product-style (-DLAB_CLEAN=1)

constexpr int kWarps = 16, kThreads = kWarps * 32, kNwt = kGrid * kWarps;
#ifndef LAB_LOCAL
#define LAB_LOCAL 0
#endif
// 1: a tile whose contributors are all in one CTA adds their partials
// through shared memory after a block barrier at the phase's end; only the
// tiles at a CTA's edges go through global memory, at once, and the last
// warp of a CTA takes its edge piece first. 2: each CTA splits the k-steps
// of its two edge tiles evenly among its 16 warps as their first pieces,
// then the rest of its share; an edge tile's sum has 32 fixed slots (the
// 16 warps of each of its two CTAs, zeros where a warp has none of it).
// Needs balanced shares; 2 also needs per-unit arrivals (with 1 and
// -DLAB_DEFER=1 the edge tiles arrive after the warp's stream).
constexpr int kLocal = LAB_LOCAL;
#ifndef LAB_KBLK
#define LAB_KBLK 0
#endif
// With column blocks a CTA's inputs are one block's (kTMax tokens of them
// fit), so the local partials get more room; 1 KB stays for static shared
// memory (the bulk copies' mbarrier).
constexpr int kInputBytes = (LAB_KBLK ? 164 : kLocal ? 190 : 200) * 1024;  // T inputs per CTA
constexpr int kPartBytes = kLocal ? (LAB_KBLK ? 62 : 36) * 1024 : 0;        // local partials per CTA
constexpr int kSmemBytes = kInputBytes + kPartBytes;
#ifndef LAB_NB
#define LAB_NB 4
#endif
constexpr int NB = LAB_NB;  // k-steps of loads per register set
#ifndef LAB_SPLIT
#define LAB_SPLIT 0
#endif
// 1: each input as two bf16 planes, hi = bf16(x) and lo = bf16(x - hi),
// each multiplied in its own MMAs into the same sums (16 bits of the
// input's mantissa instead of 8).
constexpr int kPlanes = LAB_SPLIT ? 2 : 1;
#ifndef LAB_TILED
#define LAB_TILED 0
#endif
// 1: the weights in tile order, so each unit's k-steps are one contiguous
// stream and each 16-byte load instruction of a warp reads 512 contiguous
// bytes: tile r / 16, then k-step k / 32, then half (rows g, g + 8), then
// lane (g, q), 8 elements. 0: row-major [ROWS][K], where one load
// instruction reads 64 bytes from each of 8 rows.
constexpr bool kTiled = LAB_TILED;
#ifndef LAB_TILE8
#define LAB_TILE8 0
#endif
// 1 (with tiled): 8-row bands instead of 16-row tiles: band r / 8, then
// k-step, then row, then 32 elements. Lane (g, q) reads rows g and g + 8
// of a 16-row tile from two bands, each load instruction still 512
// contiguous bytes, but a unit streams two runs instead of one. Every
// tensor can then be ordered on its own, even where a tile's two halves
// come from two tensors (gate and up).
constexpr bool kTile8 = LAB_TILE8;
static_assert(!kTile8 || kTiled, "8-row bands are a tile order");
#ifndef LAB_DEFER
#define LAB_DEFER 0
#endif
// 1: a unit's slice partials are stored as it ends, and the fence, the
// tile counters and the last arrival's sums wait until the warp's stream
// ends; 0: fence and counter at each unit's end, while the next batch's
// loads are in flight.
constexpr bool kDefer = LAB_DEFER;
#ifndef LAB_EARLY
#define LAB_EARLY 0
#endif
// 1: a phase issues its first batch of weight loads before the grid
// barrier that ends the previous phase and before its input copy (the
// weights do not depend on them); 0: barrier, copy, then loads.
constexpr bool kEarly = LAB_EARLY;
#ifndef LAB_BALANCE
#define LAB_BALANCE 0
#endif
// 1: each warp takes an equal contiguous share of a phase's k-steps in tile
// order (with tiled weights one contiguous stream), cut at tile ends into
// pieces whose partials the last contributor adds in warp order; 0: units
// of 16 rows x one of S equal k-slices, dealt round-robin.
constexpr bool kBalance = LAB_BALANCE;
#ifndef LAB_PF
#define LAB_PF 0
#endif
// k-steps (1 KB each) ahead of its loads at which a warp asks L2 to fetch
// the next batch of its stream (cp.async.bulk.prefetch.L2): more of the
// stream in flight without registers; 0: no prefetch. Needs tiled weights
// and balanced shares (the share is one contiguous range).
constexpr int kPf = LAB_PF;
static_assert(!kTile8 || !kPf, "the prefetch follows 16-row tiles");
#ifndef LAB_SKIP
#define LAB_SKIP 0
#endif
// Timing only, to price the parts of a phase (outputs wrong, so the bits
// and the host check fail): bit 0 skips the slice arrivals (fence,
// counter, the last arrival's sums), bit 1 the input copy, bit 2 the grid
// barriers between phases.
constexpr int kSkip = LAB_SKIP;
#ifndef LAB_OVERLAP
#define LAB_OVERLAP 0
#endif
// 1: a phase's deferred arrivals run at the start of the next phase, after
// its first weight loads are issued and before the grid barrier, so their
// latency overlaps those loads. 2: the same, with the release fence at the
// end of the phase's stream (a fence waits for the loads in flight) and
// acquire atomics after the loads. Needs deferred arrivals and early
// loads.
constexpr int kOverlap = LAB_OVERLAP;
#ifndef LAB_COPY
#define LAB_COPY 0
#endif
// N > 0: a phase's input copy runs over all T tokens' inputs as one index
// space with N 16-byte loads in flight per thread; 0: token by token, 4
// loads in flight, so at least T round trips to L2.
[[maybe_unused]] constexpr int kCopyBatch = LAB_COPY > 0 ? LAB_COPY : 4;
constexpr bool kFlatCopy = LAB_COPY > 0;
#ifndef LAB_SUMS
#define LAB_SUMS 0
#endif
// The last arrival at a tile loads its slots' partials from L2 N at a time
// (all N in flight, then added in slot order); 0: one slot per round trip.
[[maybe_unused]] constexpr int kSumBatch = LAB_SUMS > 0 ? LAB_SUMS : 1;
constexpr bool kBatchSums = LAB_SUMS > 0;
// N > 0: a phase's k-steps are cut into column blocks, at least N and as
// few as let kTMax tokens' inputs of one block fit the input area (a
// block count dividing the grid and the k-steps, from the shape alone).
// The shares run over blocks, then tiles, then k-steps, so a CTA's share
// lies in one block and it copies that block's inputs only; a tile's
// blocks add their sums in block order through global memory. 0: one
// block, column chunks where T inputs do not fit.
constexpr int kKblk = LAB_KBLK;
#ifndef LAB_BULK
#define LAB_BULK 0
#endif
// 1: each phase's epilogue also writes its outputs as the next phase's
// inputs, bf16 hi and lo planes in global memory ([2][kTMax][width]), and
// a phase's input copy is one bulk copy (cp.async.bulk, the copy engine)
// per plane and token of the CTA's block into shared memory, waited on
// with an mbarrier: no registers, no conversion, all tokens at once.
// Needs column blocks (every T's inputs fit at once).
constexpr bool kBulk = LAB_BULK;
static_assert(!kOverlap || (LAB_DEFER && LAB_EARLY), "overlap moves deferred arrivals after early loads");
static_assert(!kLocal || (LAB_BALANCE && (kLocal == 1 || !LAB_DEFER)), "local sums need balanced shares; edge tiles first, per-unit arrivals");
static_assert(kPf == 0 || (LAB_TILED && LAB_BALANCE), "the prefetch follows one contiguous stream");
static_assert(!kKblk || (LAB_TILED && LAB_BALANCE && LAB_LOCAL != 2 && !LAB_OVERLAP && !LAB_COPY && !LAB_PF),
              "column blocks need tiled weights, balanced shares, per-tile-edge or global sums");
static_assert(!kBulk || kKblk, "bulk copies need column blocks");
#ifndef LAB_RELACQ
#define LAB_RELACQ 0
#endif
// 1: a slice's or block's arrival is the counter's atom.acq_rel.gpu (lane
// 0, after __syncwarp: release and acquire are cumulative through it)
// instead of __threadfence (fence.sc.gpu) and a relaxed atomicAdd, and the
// last arrival reads the slots after its acquire and a __syncwarp.
constexpr bool kRelAcq = LAB_RELACQ;
#ifndef LAB_LATE
#define LAB_LATE 0
#endif
// 1: the last arrival at a tile (slice sums, with balanced shares and
// in-CTA sums) notes the tile and adds its slots after the warp's stream,
// every slot's load in flight at once (no stream registers are live then),
// instead of one L2 round trip per slot in the middle of its stream.
constexpr bool kLate = LAB_LATE;
static_assert(!kLate || (LAB_LOCAL == 1 && !LAB_DEFER && !LAB_SUMS), "late sums: in-CTA sums, per-piece arrivals");

// ---------------------------------------------------------------- helpers

// m16n8k16, bf16 in, f32 accumulate: tc_phase.cuh's.
using tcp::mma16816;

// Output (row r, token t) = v into the planes [2][kTMax][stride] bf16: hi =
// bf16(v), lo = bf16(v - hi) (with one plane, hi only).
__device__ __forceinline__ void store_planes(uint16_t* yh, int stride, int t, int r, float v) {
    const uint32_t h = bf16_bits(v);
    yh[(size_t)t * stride + r] = (uint16_t)h;
    if constexpr (LAB_SPLIT) yh[(size_t)(kTMax + t) * stride + r] = (uint16_t)bf16_bits(v - __uint_as_float(h << 16));
}

__device__ __forceinline__ uint64_t mix(uint64_t h) {
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 32);
}

// ---------------------------------------------------------- part 1: columns

// A random bf16: sign, exponent in [-24, 24] around 1, random mantissa; one
// in 16 is a signed zero.
__device__ __forceinline__ uint32_t rnd_bf16(uint64_t key) {
    const uint64_t h = mix(key);
    if ((h & 15u) == 0u) return (uint32_t)((h >> 8) & 1u) << 15;
    const uint32_t sign = (uint32_t)((h >> 4) & 1u) << 15;
    const uint32_t exp = 127u - 24u + (uint32_t)((h >> 8) % 49u);
    return sign | (exp << 7) | (uint32_t)((h >> 20) & 0x7fu);
}
// Garbage for the other columns: kind 1 random, 2 NaN / +-Inf / 3e38 /
// subnormals.
__device__ __forceinline__ uint32_t junk_bf16(uint64_t key, int kind) {
    if (kind == 1) return rnd_bf16(key ^ 0x5555);
    const uint32_t pick = (uint32_t)(mix(key ^ 0xabcdef) % 6u);
    const uint32_t v[6] = {0x7fc0u, 0x7f80u, 0xff80u, 0x7f61u, 0x0001u, 0x807fu};
    return v[pick];
}

// One warp per case: trial (A, B, the k-step count), the column c, its new
// position p and the fill of the others. A [ks][16][16], B [ks][16 k][8 n]
// as hash functions of their indices. Column c of A (B with B's columns
// permuted) must equal column p of A B'. Also checks that the element is
// not NaN for finite inputs (the fill did not leak into it).
__global__ void colcheck(int trials, unsigned* bad, unsigned* cases) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int per_trial = 8 * 8 * 3;
    if (warp >= trials * per_trial) return;
    const int trial = warp / per_trial, rest = warp % per_trial;
    const int c = rest / 24, p = (rest / 3) % 8, fill = rest % 3;
    const int ks = 1 + (int)(mix(trial * 7919u) % 224u);
    // Every 5th trial cancels exactly: A[k odd] = A[k - 1] and B[k odd] =
    // -B[k - 1], so the products come in pairs of opposite signs.
    const bool cancel = trial % 5 == 4;
    auto a_at = [&](int j, int row, int k) {
        if (cancel) k &= ~1;
        return rnd_bf16(((uint64_t)trial << 40) ^ ((uint64_t)j << 20) ^ (row << 8) ^ k);
    };
    auto b_at = [&](int j, int k, int n) {
        if (cancel && (k & 1)) {
            const uint32_t x = rnd_bf16(((uint64_t)(trial + 1) << 40) ^ ((uint64_t)j << 20) ^ ((k ^ 1) << 8) ^ n ^ 0x100000);
            return x ^ 0x8000u;
        }
        return rnd_bf16(((uint64_t)(trial + 1) << 40) ^ ((uint64_t)j << 20) ^ (k << 8) ^ n ^ 0x100000);
    };
    auto a_pair = [&](int j, int row, int k) { return a_at(j, row, k) | (a_at(j, row, k + 1) << 16); };
    float d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
    for (int j = 0; j < ks; ++j) {
        const uint32_t a0 = a_pair(j, g, 2 * q), a1 = a_pair(j, g + 8, 2 * q);
        const uint32_t a2 = a_pair(j, g, 2 * q + 8), a3 = a_pair(j, g + 8, 2 * q + 8);
        // B fragments: column n = g, rows 2q, 2q + 1 and 2q + 8, 2q + 9.
        auto b_pair = [&](int k, int n) { return b_at(j, k, n) | (b_at(j, k + 1, n) << 16); };
        const uint32_t b0 = b_pair(2 * q, g), b1 = b_pair(2 * q + 8, g);
        mma16816(d0, a0, a1, a2, a3, b0, b1);
        // B': column p holds column c; the others the fill.
        uint32_t e0, e1;
        if (g == p) {
            e0 = b_pair(2 * q, c);
            e1 = b_pair(2 * q + 8, c);
        } else if (fill == 0) {
            e0 = e1 = 0u;
        } else {
            const uint64_t key = ((uint64_t)trial << 40) ^ ((uint64_t)j << 20) ^ (g << 8) ^ q;
            e0 = junk_bf16(key, fill) | (junk_bf16(key ^ 1, fill) << 16);
            e1 = junk_bf16(key ^ 2, fill) | (junk_bf16(key ^ 3, fill) << 16);
        }
        mma16816(d1, a0, a1, a2, a3, e0, e1);
    }
    // D columns 2q, 2q + 1 (rows g, g + 8) live in lane (g, q). Gather the
    // original column c and the moved column p for rows g, g + 8.
    const int src_c = g * 4 + c / 2, src_p = g * 4 + p / 2;
    const float o0 = __shfl_sync(0xffffffffu, (c & 1) ? d0[1] : d0[0], src_c);
    const float o1 = __shfl_sync(0xffffffffu, (c & 1) ? d0[3] : d0[2], src_c);
    const float m0 = __shfl_sync(0xffffffffu, (p & 1) ? d1[1] : d1[0], src_p);
    const float m1 = __shfl_sync(0xffffffffu, (p & 1) ? d1[3] : d1[2], src_p);
    const bool same = __float_as_uint(o0) == __float_as_uint(m0) && __float_as_uint(o1) == __float_as_uint(m1) &&
                      o0 == o0 && o1 == o1;
    const unsigned wrong = __popc(__ballot_sync(0xffffffffu, !same));
    if (lane == 0) {
        atomicAdd(cases, 1u);
        if (wrong) atomicAdd(bad, 1u);
    }
}

// ------------------------------------------------------------ part 2: step

// Column blocks a phase may have: each block's sums get a slot per row tile.
constexpr int kMaxBlocks = 12;
// Column blocks of a phase with k inputs a row (see LAB_KBLK).
__host__ __device__ constexpr int kblocks(int k) {
    if (!kKblk) return 1;
    const int ks = k / 32;
    for (int d = kKblk; d <= ks; ++d)
        if (kGrid % d == 0 && ks % d == 0 && (k / d + 32) * kTMax * 2 * kPlanes <= kInputBytes) return d;
    return 0;
}

// Slices per 16-row tile: the fewest (each at least 4 k-steps) whose units
// keep 90 % of the grid's warps busy over the phase's rounds, else the best.
__host__ __device__ constexpr int slices(int rows, int k) {
    const int tiles = rows / 16, ks = k / 32;
    int best = 1;
    double best_eff = 0.0;
    for (int s = 1; s <= 64 && s * 4 <= ks; ++s) {
        const int units = tiles * s;
        const int rounds = (units + kNwt - 1) / kNwt;
        const double eff = (double)units / ((double)rounds * kNwt);
        if (eff >= 0.9) return s;
        if (eff > best_eff + 1e-9) {
            best_eff = eff;
            best = s;
        }
    }
    return best;
}

struct Scratch {
    float* part;     // [tiles][64][16][8] f32, partial sums (a slot per contributor)
    unsigned* cnt;   // [tiles], zero between phases
    float* bpart;    // [tiles][kMaxBlocks][16][8] f32, column blocks' sums (a slot per block)
    unsigned* bcnt;  // [tiles], zero between phases
    unsigned mbar;   // with kBulk: the CTA's mbarrier for the input copy (shared address)
};

// One weight phase on tensor cores: y[t][r] = W[r, :] . bf16(x[t][:]) for
// t < T, W [ROWS, K] bf16.
// `wait` is the grid barrier that ends the previous phase; with kOverlap,
// `prev` runs the previous phase's arrivals just before it. ARRIVALS: run
// only this phase's deferred arrivals (what `prev` calls).
// With kBulk: xh, yh are the input and output planes [2][kTMax][stride]
// bf16, and nb counts the CTA's bulk copies (the mbarrier's phase).
template <int K, int ROWS, int T, bool ARRIVALS = false, class Wait, class Prev>
__device__ __forceinline__ void phase(const uint16_t* __restrict__ w, const float* x, int xstride, float* y,
                                      int ystride, uint16_t* xs, Scratch sc, uint64_t pol, Wait wait, Prev prev,
                                      const uint16_t* xh = nullptr, uint16_t* yh = nullptr, unsigned* nb = nullptr) {
    static_assert(ROWS % 16 == 0 && K % 32 == 0, "shape");
    // Column blocks and a block's k-steps; below, a "tile" is a block's
    // part of a 16-row tile (tile v: block v / RTILES, rows of v % RTILES).
    constexpr int NKB = kblocks(K);
    static_assert(NKB >= 1 && NKB <= kMaxBlocks, "kTMax inputs of a column block fit");
    constexpr int KS = K / 32 / NKB;
    constexpr int KB = K / NKB;  // a block's columns
    constexpr int S = slices(ROWS, K);
    constexpr int RTILES = ROWS / 16, TILES = RTILES * NKB, UNITS = TILES * S;
    static_assert(NKB == 1 || kBalance, "column blocks need balanced shares");
    constexpr int MAXU = (UNITS + kNwt - 1) / kNwt;
    // Inputs per chunk (a multiple of 32) and the token pitch (elements,
    // = 32 mod 64: 64 bytes off a multiple of 128).
    constexpr int KC0 = (kInputBytes / 2 / kPlanes / T - 32) / 64 * 64;
    constexpr int KC = KB < KC0 ? KB : KC0;
    constexpr int NCH = (KB + KC - 1) / KC;
    constexpr int P = KC % 64 == 0 ? KC + 32 : KC;
    static_assert(P * T * 2 * kPlanes <= kInputBytes, "inputs fit");
    // Elements from one k-step's load to the next, and from rows g to g + 8.
    constexpr size_t JSTRIDE = kTile8 ? 256 : kTiled ? 512 : 32, HOFF = kTile8 ? (size_t)8 * K : kTiled ? 256 : (size_t)8 * K;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int me = blockIdx.x * kWarps + warp;
    const unsigned xs_base = (unsigned)__cvta_generic_to_shared(xs);

    auto copy_chunk = [&](int c) {
        if constexpr (kSkip & 2) return;
        // The first column of the CTA's block (its share lies in one).
        const int b0 = NKB == 1 ? 0 : (int)((long long)blockIdx.x * NKB / kGrid) * KB;
        if constexpr (kBulk) {
            static_assert(NCH == 1 && KB % 8 == 0 && P % 8 == 0, "one 16-byte aligned bulk copy per plane and token");
            if (threadIdx.x == 0) {
                // The planes were written through the generic proxy.
                asm volatile("fence.proxy.async.global;" ::: "memory");
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sc.mbar),
                             "r"((unsigned)(kPlanes * T * KB * 2))
                             : "memory");
                for (int pt = 0; pt < kPlanes * T; ++pt) {
                    const int pl = pt / T, t = pt - pl * T;
                    const uint16_t* src = xh + (size_t)(pl * kTMax + t) * xstride + b0;
                    asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                            xs_base + (unsigned)(pt * P * 2)),
                        "l"(src), "r"((unsigned)(KB * 2)), "r"(sc.mbar)
                        : "memory");
                }
            }
            const unsigned parity = *nb & 1u;
            asm volatile(
                "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra "
                "WAIT_%=;\n}" ::"r"(sc.mbar),
                "r"(parity)
                : "memory");
            ++*nb;
            return;
        }
        const int n = (c + 1 < NCH ? KC : KB - c * KC);  // elements, a multiple of 32
        const int n4 = n / 4;
        // Token t's 4 inputs at chunk column 4 j, rounded into both planes.
        auto put4 = [&](int t, int j, const float4& v) {
            uint2* d = reinterpret_cast<uint2*>(xs + t * P);
            uint2* dl = reinterpret_cast<uint2*>(xs + (T + t) * P);  // the lo plane
            const uint32_t h0 = bf16_bits(v.x), h1 = bf16_bits(v.y), h2 = bf16_bits(v.z), h3 = bf16_bits(v.w);
            d[j] = make_uint2(h0 | (h1 << 16), h2 | (h3 << 16));
            if constexpr (LAB_SPLIT) {
                auto rest = [](float x, uint32_t h) { return bf16_bits(x - __uint_as_float(h << 16)); };
                dl[j] = make_uint2(rest(v.x, h0) | (rest(v.y, h1) << 16), rest(v.z, h2) | (rest(v.w, h3) << 16));
            }
        };
        auto src = [&](int t) {
            return reinterpret_cast<const float4*>(x + (size_t)t * xstride + b0 + (size_t)c * KC);
        };
        if constexpr (kFlatCopy) {
            // All T tokens' loads in one index space, kCopyBatch in flight
            // per thread: about T n4 / (kCopyBatch kThreads) round trips.
            const int tot = T * n4;
            for (int f0 = threadIdx.x; f0 < tot; f0 += kCopyBatch * kThreads) {
                float4 v[kCopyBatch];
#pragma unroll
                for (int u = 0; u < kCopyBatch; ++u) {
                    const int f = f0 + u * kThreads, t = f / n4;
                    if (f < tot) v[u] = __ldcg(src(t) + (f - t * n4));
                }
#pragma unroll
                for (int u = 0; u < kCopyBatch; ++u) {
                    const int f = f0 + u * kThreads, t = f / n4;
                    if (f < tot) put4(t, f - t * n4, v[u]);
                }
            }
        } else {
            for (int t = 0; t < T; ++t) {
                const float4* s = src(t);
                for (int j0 = threadIdx.x; j0 < n4; j0 += 4 * kThreads) {
                    float4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int j = j0 + u * kThreads;
                        if (j < n4) v[u] = __ldcg(s + j);
                    }
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const int j = j0 + u * kThreads;
                        if (j < n4) put4(t, j, v[u]);
                    }
                }
            }
        }
    };
    // Token g's 16 bytes at input column 32 j + 8 q of the chunk starting
    // at column c0 (zeros for tokens >= T).
    auto xfrag = [&](int j, int c0, int plane) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (g < T) {
            const unsigned a = xs_base + (unsigned)((plane * T + g) * P + 32 * j - c0 + 8 * q) * 2u;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
        }
        return v;
    };
    auto step_mma = [&](float (&d)[4], const uint4& wa, const uint4& wb, int j, int c0) {
        const uint4 xb = xfrag(j, c0, 0);
        mma16816(d, wa.x, wb.x, wa.y, wb.y, xb.x, xb.y);
        mma16816(d, wa.z, wb.z, wa.w, wb.w, xb.z, xb.w);
        if constexpr (LAB_SPLIT) {
            const uint4 xl = xfrag(j, c0, 1);
            mma16816(d, wa.x, wb.x, wa.y, wb.y, xl.x, xl.y);
            mma16816(d, wa.z, wb.z, wa.w, wb.w, xl.z, xl.w);
        }
    };
    auto slice_lo = [](int s) { return s * KS / S; };
    // The phase's k-steps in tile order and each warp's equal share of
    // them (balanced pieces): warp w takes [start(w), start(w + 1)).
    constexpr int W = TILES * KS;
    // Fewer k-steps than warps (0.5B's q/k/v and o_proj): a share is one
    // k-step or none, and a tile's contributors are its k-steps, in order.
    constexpr bool SPARSE = kBalance && W < kNwt;
    static_assert(!SPARSE || kLocal != 2, "edge tiles first need a k-step per warp");
    static_assert((long long)(W + 1) * kNwt < (1ll << 31), "32-bit share arithmetic");
    // Pieces per warp, and contributors (slots) per tile, at most.
    constexpr int MAXP = kBalance ? (int)(((W + kNwt - 1) / kNwt + KS - 1) / KS + 1) + (kLocal == 2 ? 2 : 0) : MAXU;
    constexpr int SLOTS = SPARSE ? KS : kBalance ? (int)((KS - 1) / (W / kNwt) + 2) : S;
    static_assert(SLOTS <= 64, "the partial buffer holds 64 slots a tile");
    auto start = [](int wi) { return wi * W / kNwt; };
    // Of len k-steps in n equal shares (share i: [i len / n, (i + 1) len /
    // n)), the share that holds k-step p.
    auto share_of = [](int p, int len, int n) { return ((p + 1) * n + len - 1) / len - 1; };
    // The warp whose share holds k-step p.
    auto owner = [&](int p) { return share_of(p, W, kNwt); };
    // Whether tile t's contributors span two CTAs.
    auto spans = [&](int t) { return owner(t * KS) / kWarps != owner(t * KS + KS - 1) / kWarps; };
    // kLocal: a CTA's share, k-steps at most; the tiles it touches; its
    // first tile; whether a tile's contributors span CTAs; the partials.
    constexpr int CSH = (kWarps * W + kNwt - 1) / kNwt;
    constexpr int MAXLT = (CSH + KS - 1) / KS + 1;
    static_assert(kLocal != 1 || MAXLT * SLOTS * 128 * 4 <= kPartBytes, "local partials fit");
    // kLocal 2: the fewest local k-steps a CTA has after its edge tiles,
    // the local contributors a tile can have, global slots per tile.
    constexpr int CMIN = (kWarps * W) / kNwt - 1;
    constexpr int LMIN = CMIN - 2 * KS;
    constexpr int LSLOTS0 = LMIN >= kWarps ? (KS - 1) / (LMIN / kWarps) + 2 : kWarps;
    constexpr int LSLOTS = LSLOTS0 < kWarps ? LSLOTS0 : kWarps;
    constexpr int GSLOTS = kLocal == 2 ? 2 * kWarps : SLOTS;
    static_assert(kLocal != 2 || KS < CMIN, "a tile spans at most two CTAs");
    static_assert(kLocal != 2 || MAXLT * LSLOTS * 128 * 4 <= kPartBytes, "local partials fit");
    // Recomputed where used (rarely), to keep registers for the stream.
    auto cta_tile = [&] { return kBalance ? start(blockIdx.x * kWarps) / KS : 0; };
    auto lpart = [&] { return reinterpret_cast<float*>(reinterpret_cast<char*>(xs) + kInputBytes); };
    // A piece: k-steps [j0, j1) of one tile, the warp's slot among the
    // tile's contributors and their count. Units: piece k is unit
    // k kNwt + me (slice s of S). Balanced: the k-th tile the warp's share
    // touches, cut to the share. Neither depends on T.
    struct Piece {
        int tile, j0, j1, slot, count;
    };
    // kLocal 2: the CTA's range [A, B), its first and last tiles, the
    // k-steps of each that are edge k-steps (x1 at the front, x2 at the
    // back, zero where the tile is the CTA's own), the local range, and
    // this warp's part [es, ee) of the E edge k-steps: whether it holds
    // some of the first (h1) and of the last (h2) edge tile.
    struct Cta {
        int A, B, ft, lt, x1, x2, E, L0, L, es, ee;
        bool h1, h2;
    };
    auto cta = [&]() {
        Cta c;
        c.A = start(blockIdx.x * kWarps);
        c.B = start((blockIdx.x + 1) * kWarps);
        c.ft = c.A / KS;
        c.lt = (c.B - 1) / KS;
        c.x1 = spans(c.ft) ? min(c.B, (c.ft + 1) * KS) - c.A : 0;
        c.x2 = c.lt != c.ft && spans(c.lt) ? c.B - c.lt * KS : 0;
        c.E = c.x1 + c.x2;
        c.L0 = c.A + c.x1;
        c.L = c.B - c.x2 - c.L0;
        c.es = warp * c.E / kWarps;
        c.ee = (warp + 1) * c.E / kWarps;
        c.h1 = c.es < min(c.ee, c.x1);
        c.h2 = max(c.es, c.x1) < c.ee;
        return c;
    };
    auto piece = [&](int k, Piece& pc) -> bool {
        if constexpr (!kBalance) {
            const int u = k * kNwt + me;
            if (u >= UNITS) return false;
            pc.tile = u / S;
            pc.slot = u - pc.tile * S;
            pc.j0 = slice_lo(pc.slot);
            pc.j1 = slice_lo(pc.slot + 1);
            pc.count = S;
            return true;
        } else if constexpr (kLocal == 2) {
            const Cta c = cta();
            const int ne = c.h1 + c.h2;
            if (k < ne) {
                int p0, p1;
                if (k == 0 && c.h1) {
                    pc.tile = c.ft;
                    p0 = c.A + c.es;
                    p1 = c.A + min(c.ee, c.x1);
                    pc.slot = kWarps + warp;  // the upper CTA of its edge tile
                } else {
                    pc.tile = c.lt;
                    p0 = c.lt * KS + max(c.es, c.x1) - c.x1;
                    p1 = c.lt * KS + c.ee - c.x1;
                    pc.slot = warp;  // the lower CTA
                }
                pc.j0 = p0 - pc.tile * KS;
                pc.j1 = p1 - pc.tile * KS;
                pc.count = 2 * kWarps;
                return true;
            }
            // The local part: [ls, le) of [L0, L0 + L).
            const int ls = c.L0 + warp * c.L / kWarps, le = c.L0 + (warp + 1) * c.L / kWarps;
            if (ls >= le) return false;
            const int t = ls / KS + (k - ne);
            const int p0 = max(ls, t * KS);
            if (p0 >= le) return false;
            const int p1 = min(le, (t + 1) * KS);
            pc.tile = t;
            pc.j0 = p0 - t * KS;
            pc.j1 = p1 - t * KS;
            auto wl = [&](int p) { return share_of(p - c.L0, c.L, kWarps); };
            const int first = wl(max(c.L0, t * KS)), last = wl(min(c.L0 + c.L, (t + 1) * KS) - 1);
            pc.slot = warp - first;
            pc.count = last - first + 1;
            return true;
        } else {
            const int b0 = start(me), e0 = start(me + 1);
            if constexpr (kLocal == 1) {
                // The last warp of a CTA takes its last piece (the CTA's
                // edge tile) first.
                const int np = (e0 - 1) / KS - b0 / KS + 1;
                if (k >= np) return false;
                if (warp == kWarps - 1 && np > 1) k = k == 0 ? np - 1 : k - 1;
            }
            const int t = b0 / KS + k;
            const int p0 = max(b0, t * KS);
            if (p0 >= e0) return false;
            const int p1 = min(e0, (t + 1) * KS);
            pc.tile = t;
            pc.j0 = p0 - t * KS;
            pc.j1 = p1 - t * KS;
            const int first = owner(t * KS);
            pc.slot = SPARSE ? pc.j0 : me - first;
            pc.count = SPARSE ? KS : owner(t * KS + KS - 1) - first + 1;
            return true;
        }
    };
    // Lane 0's arrival at a counter: the old count.
    auto count_in = [](unsigned* c) {
        unsigned old;
        if constexpr (kRelAcq)
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c) : "memory");
        else
            old = atomicAdd(c, 1u);
        return old;
    };
    // kLate: tiles (tile | count << 16) whose slots this warp adds after
    // its stream.
    // In shared memory (registers are the stream's): [kWarps][2], -1 none.
    __shared__ int pend_s[kWarps][2];
    if constexpr (kLate) {
        if (lane == 0) pend_s[warp][0] = pend_s[warp][1] = -1;
        __syncwarp();
    }
    // Lane (g, q)'s sums of a tile: a = row g, b = row g + 8, each for
    // tokens 2q and 2q + 1. `write` writes them to y (with kBulk, to the
    // planes too), `put` to a partial slot [16][8].
    auto write = [&](int tile, float2 a, float2 b) {
        const int r0 = tile * 16 + g, t0 = 2 * q;
        // With kBulk, the next phase's hi and lo planes too.
        auto planes = [&](int t, int r, float v) {
            if constexpr (kBulk) store_planes(yh, ystride, t, r, v);
        };
        if (t0 < T) {
            y[(size_t)t0 * ystride + r0] = a.x;
            y[(size_t)t0 * ystride + r0 + 8] = b.x;
            planes(t0, r0, a.x);
            planes(t0, r0 + 8, b.x);
        }
        if (t0 + 1 < T) {
            y[(size_t)(t0 + 1) * ystride + r0] = a.y;
            y[(size_t)(t0 + 1) * ystride + r0 + 8] = b.y;
            planes(t0 + 1, r0, a.y);
            planes(t0 + 1, r0 + 8, b.y);
        }
    };
    auto put = [&](float* pt, float2 a, float2 b) {
        *reinterpret_cast<float2*>(pt + g * 8 + 2 * q) = a;
        *reinterpret_cast<float2*>(pt + (g + 8) * 8 + 2 * q) = b;
    };
    // A tile's whole sums (the whole warp holds them). With column blocks:
    // its block's slot, a fence and the row tile's counter; the last of
    // the NKB blocks to arrive adds them in block order and writes y.
    auto out = [&](int tile, float2 a, float2 b) {
        if constexpr (NKB == 1) {
            write(tile, a, b);
        } else {
            const int rt = tile % RTILES, t0 = 2 * q;
            float* pt = sc.bpart + (size_t)rt * kMaxBlocks * 128;  // [kMaxBlocks][16][8]
            put(pt + (tile / RTILES) * 128, a, b);
            if constexpr (!kRelAcq) __threadfence();
            __syncwarp();
            unsigned old = 0;
            if (lane == 0) old = count_in(sc.bcnt + rt);
            old = __shfl_sync(0xffffffffu, old, 0);
            if (old != NKB - 1u) return;
            if constexpr (kRelAcq)
                __syncwarp();
            else
                __threadfence();
            float2 ra[NKB], rb[NKB];
#pragma unroll
            for (int i = 0; i < NKB; ++i) {
                ra[i] = __ldcg(reinterpret_cast<const float2*>(pt + i * 128 + g * 8 + t0));
                rb[i] = __ldcg(reinterpret_cast<const float2*>(pt + i * 128 + (g + 8) * 8 + t0));
            }
            a = ra[0];
            b = rb[0];
#pragma unroll
            for (int i = 1; i < NKB; ++i) {
                a = make_float2(a.x + ra[i].x, a.y + ra[i].y);
                b = make_float2(b.x + rb[i].x, b.y + rb[i].y);
            }
            write(rt, a, b);
            if (lane == 0) sc.bcnt[rt] = 0u;
        }
    };
    // The counter of a piece's tile, after its partial is stored and
    // fenced: the last of the tile's contributors to arrive adds the
    // partials in slot order and writes the outputs.
    auto arrive = [&](const Piece& pc) {
        const int tile = pc.tile, t0 = 2 * q;
        float* pt = sc.part + (size_t)tile * GSLOTS * 128;  // [GSLOTS][16][8]
        __syncwarp();
        unsigned old = 0;
        if (lane == 0) {
            if constexpr (kOverlap == 2)
                asm volatile("atom.acquire.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(sc.cnt + tile) : "memory");
            else
                old = count_in(sc.cnt + tile);
        }
        old = __shfl_sync(0xffffffffu, old, 0);
        const int count = kBalance ? pc.count : S;
        if (old == (unsigned)count - 1u) {
            if constexpr (kLate) {
                // Added after the stream (late_sums).
                const int slot = pend_s[warp][0] < 0 ? 0 : pend_s[warp][1] < 0 ? 1 : 2;
                if (slot < 2) {
                    __syncwarp();
                    if (lane == 0) pend_s[warp][slot] = tile | (count << 16);
                    __syncwarp();
                    return;
                }
            }
            // With kOverlap 2 (or kRelAcq) the atomic's acquire orders the
            // loads below.
            if constexpr (kRelAcq)
                __syncwarp();
            else if constexpr (kOverlap != 2)
                __threadfence();
            float2 a = make_float2(0.0f, 0.0f), b = a;
            if constexpr (kBatchSums) {
                // kSumBatch slots' loads in flight at once, added in slot
                // order: one L2 round trip per batch, not one per slot.
#pragma unroll 1
                for (int k0 = 0; k0 < count; k0 += kSumBatch) {
                    float2 ra[kSumBatch], rb[kSumBatch];
#pragma unroll
                    for (int i = 0; i < kSumBatch; ++i)
                        if (k0 + i < count) {
                            ra[i] = __ldcg(reinterpret_cast<const float2*>(pt + (k0 + i) * 128 + g * 8 + t0));
                            rb[i] = __ldcg(reinterpret_cast<const float2*>(pt + (k0 + i) * 128 + (g + 8) * 8 + t0));
                        }
#pragma unroll
                    for (int i = 0; i < kSumBatch; ++i)
                        if (k0 + i < count) {
                            a = k0 + i ? make_float2(a.x + ra[i].x, a.y + ra[i].y) : ra[i];
                            b = k0 + i ? make_float2(b.x + rb[i].x, b.y + rb[i].y) : rb[i];
                        }
                }
            } else {
                a = __ldcg(reinterpret_cast<const float2*>(pt + g * 8 + t0));
                b = __ldcg(reinterpret_cast<const float2*>(pt + (g + 8) * 8 + t0));
#pragma unroll 1
                for (int k = 1; k < count; ++k) {
                    const float2 a1 = __ldcg(reinterpret_cast<const float2*>(pt + k * 128 + g * 8 + t0));
                    const float2 b1 = __ldcg(reinterpret_cast<const float2*>(pt + k * 128 + (g + 8) * 8 + t0));
                    a.x += a1.x;
                    a.y += a1.y;
                    b.x += b1.x;
                    b.y += b1.y;
                }
            }
            out(tile, a, b);
            if (lane == 0) sc.cnt[tile] = 0u;
        }
    };
    // With deferred arrivals: one fence for the warp's stored partials,
    // then each of its pieces' counters.
    auto arrive_all = [&]() {
        if constexpr (kDefer && !(kSkip & 1)) {
            // With kOverlap 2 the fence ran at the end of the phase's stream.
            if constexpr (kOverlap != 2) __threadfence();
            Piece pc;
            for (int k = 0; k < MAXP && piece(k, pc); ++k)
                if ((kBalance ? pc.count > 1 : S > 1) && (!kLocal || spans(pc.tile))) arrive(pc);
        }
    };
    // A piece's sums: lane (g, q) holds rows g, g + 8 of the tile, tokens
    // 2q, 2q + 1.
    auto flush = [&](const Piece& pc, const float (&d)[4]) {
        const float2 a = make_float2(d[0], d[1]), b = make_float2(d[2], d[3]);
        if (kLocal == 2 && pc.count == 2 * kWarps) {
            // An edge piece: its partial now, the arrival in edge_arrivals.
            put(sc.part + ((size_t)pc.tile * GSLOTS + pc.slot) * 128, a, b);
        } else if (kLocal && pc.count > 1 && (kLocal == 2 || !spans(pc.tile))) {
            const int stride = kLocal == 2 ? LSLOTS : SLOTS;
            put(lpart() + ((pc.tile - cta_tile()) * stride + pc.slot) * 128, a, b);
        } else if (kBalance ? pc.count == 1 : S == 1) {
            out(pc.tile, a, b);
        } else {
            put(sc.part + ((size_t)pc.tile * GSLOTS + pc.slot) * 128, a, b);
            if constexpr (!kDefer && !(kSkip & 1)) {
                if constexpr (!kRelAcq) __threadfence();
                arrive(pc);
            }
        }
    };
    // kLocal 2, once a warp's edge pieces are stored: zeros in its slots of
    // the edge tiles it has no k-steps of, one fence, then every edge
    // tile's counter (each has 32 contributors).
    auto edge_arrivals = [&]() {
        if constexpr (kLocal == 2) {
            const Cta c = cta();
            auto zero = [&](int tile, int slot) {
                put(sc.part + ((size_t)tile * GSLOTS + slot) * 128, make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f));
            };
            if (c.x1 && !c.h1) zero(c.ft, kWarps + warp);
            if (c.x2 && !c.h2) zero(c.lt, warp);
            if (!c.x1 && !c.x2) return;
            __threadfence();
            Piece pc;
            pc.count = 2 * kWarps;
            if (c.x1) {
                pc.tile = c.ft;
                arrive(pc);
            }
            if (c.x2) {
                pc.tile = c.lt;
                arrive(pc);
            }
        }
    };
    // With kLocal, at the phase's end: the last contributor of each tile
    // inside the CTA adds the tile's partials in slot order.
    auto local_sums = [&]() {
        if constexpr (kLocal) {
            __syncthreads();
            Piece pc;
            const int t0 = 2 * q;
            for (int k = 0; k < MAXP && piece(k, pc); ++k) {
                if (pc.count == 1 || pc.count == 2 * kWarps || (kLocal == 1 && spans(pc.tile)) ||
                    pc.slot != pc.count - 1)
                    continue;
                const int stride = kLocal == 2 ? LSLOTS : SLOTS;
                const float* pt = lpart() + (pc.tile - cta_tile()) * stride * 128;  // [stride][16][8]
                float2 a = *reinterpret_cast<const float2*>(pt + g * 8 + t0);
                float2 b = *reinterpret_cast<const float2*>(pt + (g + 8) * 8 + t0);
                for (int i = 1; i < pc.count; ++i) {
                    const float2 a1 = *reinterpret_cast<const float2*>(pt + i * 128 + g * 8 + t0);
                    const float2 b1 = *reinterpret_cast<const float2*>(pt + i * 128 + (g + 8) * 8 + t0);
                    a.x += a1.x;
                    a.y += a1.y;
                    b.x += b1.x;
                    b.y += b1.y;
                }
                out(pc.tile, a, b);
            }
        }
    };
    // kLate, after the warp's stream: the noted tiles' slots, all in
    // flight at once, added in slot order.
    auto late_sums = [&]() {
        if constexpr (kLate) {
            if (pend_s[warp][0] < 0) return;
            if constexpr (kRelAcq)
                __syncwarp();
            else
                __threadfence();
            const int t0 = 2 * q;
#pragma unroll 1
            for (int i = 0; i < 2; ++i) {
                const int pd = pend_s[warp][i];
                if (pd < 0) break;
                const int tile = pd & 0xffff, count = pd >> 16;
                const float* pt = sc.part + (size_t)tile * GSLOTS * 128;  // [GSLOTS][16][8]
                constexpr int LB = 4;  // slots in flight
                float2 a = make_float2(0.0f, 0.0f), b = a;
#pragma unroll 1
                for (int k0 = 0; k0 < count; k0 += LB) {
                    float2 ra[LB], rb[LB];
#pragma unroll
                    for (int k = 0; k < LB; ++k)
                        if (k0 + k < count) {
                            ra[k] = __ldcg(reinterpret_cast<const float2*>(pt + (k0 + k) * 128 + g * 8 + t0));
                            rb[k] = __ldcg(reinterpret_cast<const float2*>(pt + (k0 + k) * 128 + (g + 8) * 8 + t0));
                        }
#pragma unroll
                    for (int k = 0; k < LB; ++k)
                        if (k0 + k < count) {
                            a = k0 + k ? make_float2(a.x + ra[k].x, a.y + ra[k].y) : ra[k];
                            b = k0 + k ? make_float2(b.x + rb[k].x, b.y + rb[k].y) : rb[k];
                        }
                }
                out(tile, a, b);
                if (lane == 0) sc.cnt[tile] = 0u;
            }
        }
    };
    if constexpr (ARRIVALS) {
        arrive_all();
        return;
    }
    // Lane (g, q)'s first element of tile's k-step 0 (with column blocks,
    // of its block).
    auto rows_at = [&](int tile) {
        if constexpr (NKB > 1)
            return w + (size_t)(tile % RTILES) * 16 * K + (size_t)(tile / RTILES) * KS * JSTRIDE + 8 * lane;
        return w + (kTiled ? (size_t)tile * 16 * K + 8 * lane : (size_t)(tile * 16 + g) * K + 8 * q);
    };

    if constexpr (NCH == 1) {
        if constexpr (!kEarly) {
            wait();
            copy_chunk(0);
            __syncthreads();
        }
        // Two cursors over the warp's (piece, k-step) sequence, one for the
        // loads and one for the sums.
        struct Cur {
            int k, j, j1;       // j1 = 0: past the warp's last piece
            const uint16_t* r;  // row g of the piece's tile, column 8 q
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
        // A batch is up to NB k-steps of one piece; the loads run one batch
        // ahead of the sums, across pieces.
        auto load = [&](uint4 (&wa)[NB], uint4 (&wb)[NB]) {
            if (!lc.j1) return;
            if constexpr (kPf > 0) {
                // The stream position of this batch, in k-steps from the
                // phase's first, and the batch kPf k-steps ahead of it.
                const int p = (int)((lc.r - w - 8 * lane) / 512) + lc.j + kPf;
                if (lane == 0 && p + NB <= start(me + 1))
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + (size_t)p * 512),
                                 "r"(NB * 1024)
                                 : "memory");
            }
#pragma unroll
            for (int i = 0; i < NB; ++i)
                if (lc.j + i < lc.j1) {
                    wa[i] = ld_weight16(lc.r + JSTRIDE * (lc.j + i), pol);
                    wb[i] = ld_weight16(lc.r + HOFF + JSTRIDE * (lc.j + i), pol);
                }
            lc.j += NB;
            if (lc.j >= lc.j1) {
                ++lc.k;
                enter(lc);
            }
        };
        float d[4] = {0, 0, 0, 0};
        auto compute = [&](const uint4 (&wa)[NB], const uint4 (&wb)[NB]) {
#pragma unroll
            for (int i = 0; i < NB; ++i)
                if (cc.j + i < cc.j1) step_mma(d, wa[i], wb[i], cc.j + i, 0);
            cc.j += NB;
            if (cc.j >= cc.j1) {
                Piece pc;
                piece(cc.k, pc);
                flush(pc, d);
                if (kLocal == 2 && pc.count == 2 * kWarps) {
                    Piece nx;
                    if (!piece(cc.k + 1, nx) || nx.count != 2 * kWarps) edge_arrivals();
                }
                d[0] = d[1] = d[2] = d[3] = 0.0f;
                ++cc.k;
                enter(cc);
            }
        };
        uint4 wa0[NB], wb0[NB], wa1[NB], wb1[NB];
        load(wa0, wb0);
        if constexpr (kEarly) {
            if constexpr (kOverlap) prev();
            wait();
            copy_chunk(0);
            __syncthreads();
        }
        if constexpr (kLocal == 2) {
            Piece p0;
            if (!piece(0, p0) || p0.count != 2 * kWarps) edge_arrivals();
        }
#pragma unroll 1
        while (cc.j1) {
            load(wa1, wb1);
            compute(wa0, wb0);
            if (!cc.j1) break;
            load(wa0, wb0);
            compute(wa1, wb1);
        }
        if constexpr (!kOverlap) arrive_all();
        late_sums();
        local_sums();
        // The release half of the arrivals, while no load is in flight.
        if constexpr (kOverlap == 2 && !(kSkip & 1)) __threadfence();
    } else {
        if constexpr (kOverlap) prev();
        wait();
        float d[MAXP][4];
#pragma unroll
        for (int k = 0; k < MAXP; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.0f;
#pragma unroll 1
        for (int c = 0; c < NCH; ++c) {
            if (c) __syncthreads();
            copy_chunk(c);
            __syncthreads();
            const int c0 = c * KC, cj0 = c0 / 32, cj1 = min(KS, (c0 + KC) / 32);
#pragma unroll
            for (int k = 0; k < MAXP; ++k) {
                Piece pc;
                if (!piece(k, pc)) break;
                const int j0 = max(pc.j0, cj0), j1 = min(pc.j1, cj1);
                const uint16_t* r = rows_at(pc.tile);
#pragma unroll 1
                for (int j = j0; j < j1; j += NB) {
                    uint4 wa[NB], wb[NB];
#pragma unroll
                    for (int i = 0; i < NB; ++i)
                        if (j + i < j1) {
                            wa[i] = ld_weight16(r + JSTRIDE * (j + i), pol);
                            wb[i] = ld_weight16(r + HOFF + JSTRIDE * (j + i), pol);
                        }
#pragma unroll
                    for (int i = 0; i < NB; ++i)
                        if (j + i < j1) step_mma(d[k], wa[i], wb[i], j + i, c0);
                }
            }
        }
        Piece pc;
#pragma unroll
        for (int k = 0; k < MAXP; ++k)
            if (piece(k, pc)) flush(pc, d[k]);
        if constexpr (!kOverlap) arrive_all();
        edge_arrivals();
        late_sums();
        local_sums();
        // The release half of the arrivals, while no load is in flight.
        if constexpr (kOverlap == 2 && !(kSkip & 1)) __threadfence();
    }
}

struct Bufs {
    const uint16_t* w;            // [kLayers][kLayerElems] bf16
    const float* x0;              // [T][H]
    float *yqkv, *yo, *ygu, *yd;  // [T][QKV], [T][H], [T][2 I], [T][H]
    unsigned* bar;
    Scratch sc;
    // With kBulk, x0's and each y's bf16 hi and lo planes [2][kTMax][width].
    const uint16_t* hx0;
    uint16_t *hqkv, *ho, *hgu, *hd;
};

#ifndef LAB_CLEAN
#define LAB_CLEAN 0
#endif
#ifndef LAB_STAGED
#define LAB_STAGED 0
#endif
// With LAB_CLEAN: 1 lets the last arrival at a spanning tile copy every
// slot into shared memory at once (cp.async) before adding them in order,
// instead of one L2 round trip per slot.
#ifndef LAB_THREADCOPY
#define LAB_THREADCOPY 0
#endif
// With LAB_CLEAN: 1 copies the input planes with every thread's 16-byte
// loads (the path of GPUs without bulk copies) instead of cp.async.bulk.
// 1: every phase runs tc_phase.cuh, the chosen configuration written as
// the product would take it (tiled, balanced, in-CTA sums, column blocks,
// bulk copies, early loads; -DLAB_TILE8 and -DLAB_RELACQ still apply).
// Its builds need the flags of that configuration, so the host side
// (scratch, planes, the host check) is the same.
static_assert(!LAB_CLEAN || (LAB_SPLIT && kTiled && kBalance && kLocal == 1 && kKblk == 1 && kBulk && kEarly &&
                             !kDefer && !kOverlap && !kSkip && !kLate && !kBatchSums && !kFlatCopy && !kPf),
              "the clean phase is one configuration");
struct LabMachine {
    static constexpr int grid = kGrid, warps = kWarps, tmax = kTMax, input_bytes = kInputBytes,
                         part_bytes = kPartBytes;
    static constexpr bool tile8 = kTile8, relacq = kRelAcq, staged = LAB_STAGED;
};

template <int T>
__global__ void __launch_bounds__(kThreads, 1) step(Bufs b) {
#if LAB_CLEAN
    extern __shared__ __align__(128) uint16_t xs[];
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    unsigned gen = 0, nb = 0;
    __shared__ __align__(8) uint64_t copied;
    const unsigned mbar = (unsigned)__cvta_generic_to_shared(&copied);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mbar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const tcp::Scratch sc{b.sc.part, b.sc.cnt, b.sc.bpart, b.sc.bcnt};
    auto sync = [&] {
        asm volatile("fence.proxy.async.global;" ::: "memory");
        grid_sync(b.bar, gen);
    };
    // Output (r, t): y and its hi and lo planes.
    auto epi = [](float* y, int ystride, uint16_t* yh) {
        return [=](int r, int t, float v) {
            y[(size_t)t * ystride + r] = v;
            store_planes(yh, ystride, t, r, v);
        };
    };
    // The planes [2][kTMax][stride] of a phase's input.
    auto in = [&](const uint16_t* xh, int stride) {
        if constexpr (LAB_THREADCOPY)
            return tcp::ThreadPlanes{xh, stride, kTMax};
        else
            return tcp::BulkPlanes{xh, stride, kTMax, mbar, &nb};
    };
    for (int l = 0; l < kLayers; ++l) {
        const uint16_t* wl = b.w + (size_t)l * kLayerElems;
        tcp::phase<H, QKV, T, LabMachine>(
            wl + kOffQkv, in(l ? b.hd : b.hx0, H), xs, sc, pol,
            [&] {
                if (l) sync();
            },
            epi(b.yqkv, QKV, b.hqkv));
        tcp::phase<Q, H, T, LabMachine>(wl + kOffO, in(b.hqkv, QKV), xs, sc, pol, sync, epi(b.yo, H, b.ho));
        tcp::phase<H, 2 * I, T, LabMachine>(wl + kOffGu, in(b.ho, H), xs, sc, pol, sync, epi(b.ygu, 2 * I, b.hgu));
        tcp::phase<I, H, T, LabMachine>(wl + kOffD, in(b.hgu, 2 * I), xs, sc, pol, sync, epi(b.yd, H, b.hd));
    }
    sync();
#else
    extern __shared__ __align__(128) uint16_t xs[];
    uint64_t pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    unsigned gen = 0, nb = 0;
    __shared__ __align__(8) uint64_t copied;  // the input copy's mbarrier (kBulk)
    if constexpr (kBulk) {
        b.sc.mbar = (unsigned)__cvta_generic_to_shared(&copied);
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b.sc.mbar) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }
    auto sync = [&] {
        // The planes this phase wrote, for the next phase's bulk copies.
        if constexpr (kBulk) asm volatile("fence.proxy.async.global;" ::: "memory");
        if constexpr (kSkip & 4)
            __syncthreads();
        else
            grid_sync(b.bar, gen);
    };
    auto nop = [] {};
    // The previous phase's arrivals, for kOverlap.
    auto down_arrivals = [&] { phase<I, H, T, true>(nullptr, nullptr, 0, b.yd, H, xs, b.sc, pol, nop, nop); };
    auto qkv_arrivals = [&] { phase<H, QKV, T, true>(nullptr, nullptr, 0, b.yqkv, QKV, xs, b.sc, pol, nop, nop); };
    auto o_arrivals = [&] { phase<Q, H, T, true>(nullptr, nullptr, 0, b.yo, H, xs, b.sc, pol, nop, nop); };
    auto gu_arrivals = [&] { phase<H, 2 * I, T, true>(nullptr, nullptr, 0, b.ygu, 2 * I, xs, b.sc, pol, nop, nop); };
    for (int l = 0; l < kLayers; ++l) {
        const uint16_t* wl = b.w + (size_t)l * kLayerElems;
        phase<H, QKV, T>(
            wl + kOffQkv, l ? b.yd : b.x0, H, b.yqkv, QKV, xs, b.sc, pol,
            [&] {
                if (l) sync();
            },
            [&] {
                if (l) down_arrivals();
            },
            l ? b.hd : b.hx0, b.hqkv, &nb);
        phase<Q, H, T>(wl + kOffO, b.yqkv, QKV, b.yo, H, xs, b.sc, pol, sync, qkv_arrivals, b.hqkv, b.ho, &nb);
        phase<H, 2 * I, T>(wl + kOffGu, b.yo, H, b.ygu, 2 * I, xs, b.sc, pol, sync, o_arrivals, b.ho, b.hgu, &nb);
        phase<I, H, T>(wl + kOffD, b.ygu, 2 * I, b.yd, H, xs, b.sc, pol, sync, gu_arrivals, b.hgu, b.hd, &nb);
    }
    if constexpr (kOverlap) down_arrivals();
    sync();
#endif
}

struct Run {
    float us;
    std::vector<float> out;  // [T][H], the last layer's down output
};

template <int T>
static Run run(Bufs b, float* yd, int reps) {
    auto k = step<T>;
    prepare_step(k, kThreads, kSmemBytes, "a step");
    Run out{time_launches(k, b, kThreads, kSmemBytes, b.bar, reps), std::vector<float>((size_t)T * H)};
    CK(cudaMemcpy(out.out.data(), yd, out.out.size() * 4, cudaMemcpyDeviceToHost));
    return out;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    printf("%s, %d SMs, %d MHz\n", prop.name, prop.multiProcessorCount, khz / 1000);
    if (prop.multiProcessorCount < kGrid) {
        printf("the lab needs %d SMs\n", kGrid);
        return 1;
    }

    // Part 1.
    {
        unsigned* d;
        CK(cudaMalloc(&d, 8));
        CK(cudaMemset(d, 0, 8));
        const int trials = 400, warps = trials * 192;
        colcheck<<<(warps + 7) / 8, 256>>>(trials, d, d + 1);
        CK(cudaDeviceSynchronize());
        unsigned h[2];
        CK(cudaMemcpy(h, d, 8, cudaMemcpyDeviceToHost));
        printf("columns: %u cases (%d trials x 8 columns x 8 positions x 3 fills), %u differ\n", h[1], trials, h[0]);
        CK(cudaFree(d));
    }

    // Part 2.
    const size_t n = kLayerElems * kLayers;
    uint16_t* w;
    CK(cudaMalloc(&w, n * 2));
    fill_weights<<<1024, 256>>>(w, n);
    float *x0, *yqkv, *yo, *ygu, *yd, *part;
    unsigned *bar, *cnt;
    CK(cudaMalloc(&x0, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&yqkv, (size_t)kTMax * QKV * 4));
    CK(cudaMalloc(&yo, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&ygu, (size_t)kTMax * 2 * I * 4));
    CK(cudaMalloc(&yd, (size_t)kTMax * H * 4));
    CK(cudaMalloc(&bar, 64));
    // Tiles of the widest phase, column blocks counted.
    const int max_tiles = std::max({QKV / 16 * kblocks(H), H / 16 * kblocks(Q), 2 * I / 16 * kblocks(H),
                                    H / 16 * kblocks(I)});
    const size_t part_floats = (size_t)max_tiles * 64 * 128;
    CK(cudaMalloc(&part, part_floats * 4));
    CK(cudaMalloc(&cnt, max_tiles * 4));
    CK(cudaMemset(cnt, 0, max_tiles * 4));
    float* bpart;
    unsigned* bcnt;
    CK(cudaMalloc(&bpart, (size_t)max_tiles * kMaxBlocks * 128 * 4));
    CK(cudaMalloc(&bcnt, max_tiles * 4));
    CK(cudaMemset(bcnt, 0, max_tiles * 4));
    const std::vector<float> hx = lab_inputs();
    CK(cudaMemcpy(x0, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());

    const double bytes = (double)n * 2;
    const float read_us = plain_read_us(w, n * 2);
    printf("%s: %d layers, %.2f GB of weights; plain read %.1f us (%.0f GB/s); slices q/k/v %d, o_proj %d, "
           "gate/up %d, down %d; NB %d; inputs %s; weights %s; arrivals %s; first loads %s; split %s; L2 prefetch %d k-steps ahead; skipped (timing only) %d; deferred arrivals %s; slice sums through %s; column blocks q/k/v %d, o_proj %d, gate/up %d, down %d; input copy %s\n",
           kName, kLayers, bytes / 1e9, read_us, bytes / read_us / 1e3, slices(QKV, H), slices(H, Q),
           slices(2 * I, H), slices(H, I), NB, LAB_SPLIT ? "bf16 hi + lo" : "bf16", kTiled ? "tiled" : "row-major",
           kDefer ? "deferred to the stream's end" : "per unit", kEarly ? "before the barrier" : "after the copy",
           kBalance ? "balanced shares" : "units", kPf, kSkip, kOverlap == 2 ? "at the next phase's start, fenced at the end" : kOverlap ? "at the next phase's start" : "at the phase's end",
           kLocal == 2 ? "shared memory inside a CTA, edge tiles first" : kLocal ? "shared memory inside a CTA" : "global memory",
           kblocks(H), kblocks(Q), kblocks(H), kblocks(I), kBulk ? "bulk, from bf16 planes" : "by the threads, from f32");

    // The planes of x0 and of every phase's output, [2][kTMax][width].
    uint16_t *hx0, *hqkv, *ho, *hgu, *hd;
    CK(cudaMalloc(&hx0, (size_t)2 * kTMax * H * 2));
    CK(cudaMalloc(&hqkv, (size_t)2 * kTMax * QKV * 2));
    CK(cudaMalloc(&ho, (size_t)2 * kTMax * H * 2));
    CK(cudaMalloc(&hgu, (size_t)2 * kTMax * 2 * I * 2));
    CK(cudaMalloc(&hd, (size_t)2 * kTMax * H * 2));
    {
        std::vector<uint16_t> hp((size_t)2 * kTMax * H);
        for (size_t i = 0; i < (size_t)kTMax * H; ++i) {
            const uint32_t h = bf16_bits(hx[i]);
            float hf;
            const uint32_t u = h << 16;
            memcpy(&hf, &u, 4);
            hp[i] = (uint16_t)h;
            hp[(size_t)kTMax * H + i] = (uint16_t)bf16_bits(hx[i] - hf);
        }
        CK(cudaMemcpy(hx0, hp.data(), hp.size() * 2, cudaMemcpyHostToDevice));
    }
    Bufs b{w, x0, yqkv, yo, ygu, yd, bar, Scratch{part, cnt, bpart, bcnt, 0u}, hx0, hqkv, ho, hgu, hd};
    std::vector<std::vector<float>> ref(kTMax);
    float t1_us = 0;
    for (int t = 0; t < kTMax; ++t) {
        Bufs bt = b;
        bt.x0 = x0 + (size_t)t * H;
        bt.hx0 = hx0 + (size_t)t * H;
        Run r = run<1>(bt, yd, t == 0 ? 5 : 1);
        if (t == 0) {
            t1_us = r.us;
            // The last layer's down phase against the host in double: its
            // input (gate/up's output, rounded to bf16 as the phase rounds
            // it) and its weights, read back.
            std::vector<float> in(I);
            std::vector<uint16_t> wd((size_t)H * I);
            CK(cudaMemcpy(in.data(), ygu, (size_t)I * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(wd.data(), w + (kLayers - 1) * kLayerElems + kOffD, wd.size() * 2, cudaMemcpyDeviceToHost));
            auto f = [](uint32_t bits) {
                const uint32_t u = bits << 16;
                float v;
                memcpy(&v, &u, 4);
                return (double)v;
            };
            double worst = 0, scale = 0;
            for (int row = 0; row < H; ++row) {
                double acc = 0;
                for (int k = 0; k < I; ++k) {
                    const uint32_t h = bf16_bits(in[k]);
                    double v = f(h);
                    if (LAB_SPLIT) v += f(bf16_bits(in[k] - (float)f(h)));
                    size_t at = (size_t)row * I + k;
                    if (kTile8) {
                        at = ((size_t)(row / 8) * (I / 32) + k / 32) * 256 + (row % 8) * 32 + k % 32;
                    } else if (kTiled) {
                        const int r16 = row % 16, c = k % 32;
                        at = ((size_t)(row / 16) * (I / 32) + k / 32) * 512 + (r16 / 8) * 256 +
                             ((r16 % 8) * 4 + c / 8) * 8 + c % 8;
                    }
                    acc += f(wd[at]) * v;
                }
                worst = std::max(worst, std::fabs(acc - (double)r.out[row]));
                scale = std::max(scale, std::fabs(acc));
            }
            printf("down, last layer, T=1 against the host: max |error| %.3g of max |value| %.3g (%s)\n", worst, scale,
                   worst <= 1e-4 * scale ? "ok" : "WRONG");
        }
        ref[t] = r.out;
    }
    // The outputs are not all zero or non-finite (the chain carries values).
    int finite = 0;
    for (float v : ref[0]) finite += (v == v && v != 0.0f && v < 1e30f && v > -1e30f);
    printf("T=1 run: %d of %d last-layer outputs finite and non-zero\n", finite, H);
    printf("%-4s %10s %9s %8s %10s %s\n", "T", "us/layer", "% read", "x T=1", "us/token", "bits");
    auto report = [&](int T, const Run& r) {
        int differ = 0;
        for (int t = 0; t < T; ++t)
            for (int i = 0; i < H; ++i)
                if (std::memcmp(&r.out[(size_t)t * H + i], &ref[t][i], 4) != 0) ++differ;
        printf("%-4d %10.2f %8.1f%% %8.3f %10.2f %s", T, r.us / kLayers, 100.0 * read_us / r.us, r.us / t1_us,
               r.us / kLayers / T, differ ? "DIFFER" : "equal");
        if (differ) printf(" (%d of %d)", differ, T * H);
        printf("\n");
    };
    report(1, run<1>(b, yd, 5));
    report(2, run<2>(b, yd, 5));
    report(3, run<3>(b, yd, 5));
    report(4, run<4>(b, yd, 5));
    report(5, run<5>(b, yd, 5));
    report(6, run<6>(b, yd, 5));
    report(8, run<8>(b, yd, 5));
    return 0;
}
