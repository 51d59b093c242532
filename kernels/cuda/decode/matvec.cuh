// decode/matvec.cuh: one warp computes NR dot products of bf16 weight rows [K] with
// an f32 activation vector in shared memory. 16-byte coalesced weight loads,
// U loads per row in flight before the first FMA, fixed-order accumulation
// (lane-strided, then a xor-shuffle tree): bit-identical run to run.
#pragma once

namespace qmk {

// Every decode weight read is marked evict-first in L2. A step streams
// every weight once, far more bytes than L2 holds, so in plain LRU the
// weights push out what the next step reads again (the K/V cache, norm
// weights, biases, rotary tables, the activations); marked, those stay.
// Keeping a small weight tensor instead (evict-last o_proj or q/k/v at
// 0.5B) measured slower.
constexpr L2 kWeightL2 = L2::first;

// 16-byte vectors per lane in a bf16 row of K elements.
constexpr int lane_vectors(int K) { return (K / 8 + 31) / 32; }

// Most vectors per lane per row in one batch of a row pair: 7B's rows (14
// vectors per lane) and 14B's (20) take two DRAM round trips per unit,
// where batches of 4 take four and five, with the same register count and
// spills.
constexpr int kPairBatchMost = (int)QMK_PAIR_BATCH_MOST;

// The size of the fewest equal batches of at most `most` that cover n.
constexpr int even_batch(int n, int most) {
    const int batches = (n + most - 1) / most;
    return (n + batches - 1) / batches;
}

// Vectors per lane per row in flight in warp_dot_rows (one batch): a
// one-row unit whose row takes at most 20 per lane loads it all at once
// (one DRAM round trip); else 8. A row pair goes in equal batches of at
// most kPairBatchMost (0.5B's short pair, 4 per lane, in one). The order
// of the sums is ascending for every batch size, so it changes no bit.
template <int K, int NR>
constexpr int batch_vectors() {
    return NR == 1 ? (lane_vectors(K) <= 20 ? lane_vectors(K) : 8) : even_batch(lane_vectors(K), kPairBatchMost);
}

// Shared memory one CTA's warps need to stage the first batch of their
// first unit ([QMK_WARPS][NR][U][32] 16-byte vectors), floats.
template <int K, int NR>
constexpr u32 stage_floats() {
    return (u32)QMK_WARPS * NR * batch_vectors<K, NR>() * 32u * 4u;
}

// Where a phase's stage starts after its activation vector of n floats:
// 128-byte aligned.
constexpr u32 stage_offset(u32 n) { return (n + 31u) / 32u * 32u; }

// Whether a phase of NR-row units [K] stages its first rows after `front`
// floats of shared memory (its activation vector, and a norm weight):
// only short rows (a unit is one batch of at most kStageVectors per lane
// per row), whose phases wait on latency rather than bytes; longer rows
// ran slower staged (their copies go through cp.async), and only where
// the stage fits QMK_SMEM_FLOATS, which the host sizes by the same rule.
constexpr int kStageVectors = (int)QMK_STAGE_VECTORS;
template <int K, int NR>
constexpr bool stages_after(u32 front) {
    return lane_vectors(K) <= kStageVectors && stage_offset(front) + stage_floats<K, NR>() <= QMK_SMEM_FLOATS;
}

// The order of an activation vector [K] in shared memory. Split (kXsSplit):
// the first four floats of every 16-byte weight vector's eight, then the
// last four ([2][K / 8][4]), so lane l's two 16-byte reads for its weight
// vector l sit next to lane l + 1's; in plain order they sit 32 bytes
// apart, a two-way bank conflict on every read of the dot product. Split
// order made the 0.5B step 1.5-2 % faster but 7B and 32B 0.8 % slower
// (its writers cost more instructions behind every barrier), so only a
// hidden size of at most 1,024 (0.5B) takes it.
constexpr bool kXsSplit = QMK_HIDDEN <= 1024;
// The slot of element i (plain order: i itself, in its own type).
// SPLIT: the order to use (the multi-token step always splits).
template <int K, bool SPLIT = kXsSplit, class I>
__device__ __forceinline__ auto xs_slot(I i) {
    if constexpr (SPLIT) {
        static_assert(K % 8 == 0, "split order needs whole 16-byte weight vectors");
        const u32 j = (u32)i;
        return ((j >> 2) & 1u) * (u32)(K / 2) + (j >> 3) * 4u + (j & 3u);
    } else {
        return i;
    }
}

// rows[NR] . xs for one warp, xs [K] in xs_slot order. STAGED: the first
// batch comes from `staged`, this warp's slot of a stage that
// stage_first_unit filled from the same rows; a lane reads only the vectors
// it copied itself, after waiting for its own copies.
template <int K, int NR, bool STAGED = false>
__device__ __forceinline__ void warp_dot_rows(const char* const (&rows)[NR],
                                              const float* __restrict__ xs, float (&out)[NR],
                                              const uint4* staged = nullptr) {
    static_assert(K % 8 == 0, "rows must be whole 16-byte vectors");
    constexpr int NV = K / 8;              // 16-byte vectors per row
    constexpr int U = batch_vectors<K, NR>();
    const int lane = threadIdx.x & 31;
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = 0.0f;
    constexpr int first = STAGED ? 32 * U : 0;
    if constexpr (STAGED) {
        // Shared memory is close: the batch is read where it is summed, not
        // loaded into registers ahead of the FMAs like the DRAM batches.
        cp_async_wait<0>();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = u * 32 + lane;
            if (i < NV) {
                const float4 a = xs4[kXsSplit ? i : 2 * i], b = xs4[kXsSplit ? NV + i : 2 * i + 1];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r] = dot8(staged[(r * U + u) * 32 + lane], a, b, acc[r]);
            }
        }
    }
#pragma unroll 1
    for (int base = first; base < NV; base += 32 * U) {
        uint4 w[NR][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                if (i < NV) w[r][u] = ld_weight16<kWeightL2>(rows[r] + (size_t)i * 16);
                else w[r][u] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + u * 32 + lane;
            if (i < NV) {
                const float4 a = xs4[kXsSplit ? i : 2 * i], b = xs4[kXsSplit ? NV + i : 2 * i + 1];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[r] = dot8(w[r][u], a, b, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// The k-th work unit (k = 0, 1, ...) of this warp in a weight phase of
// `units` units; >= units once the warp is done. Units go in rounds of
// gridDim.x * WARPS. Full rounds are CTA-major (a CTA's warps stream
// consecutive rows); the last, partial round is warp-major, so it is spread
// over every SM instead of filling whole CTAs while the rest of the grid
// idles (0.5B's down / o_proj / qkv are one partial round). On the H200 at
// 14B, warp-major in every round cost 218 us/step and CTA-major in every
// round 270 us/step more than this mix. Both maps are bijections of a round,
// so every unit is done exactly once, and a unit's arithmetic does not
// depend on which warp runs it.
__device__ __forceinline__ u32 unit_at(u32 units, u32 k) {
    const u32 warp = threadIdx.x >> 5;
    const u32 nwt = gridDim.x * QMK_WARPS;
    const bool tail = k >= units / nwt;
    return k * nwt + (tail ? warp * gridDim.x + blockIdx.x : blockIdx.x * QMK_WARPS + warp);
}

// Where this warp's slot starts in a stage, in 16-byte vectors: a slot is
// [NR, U, 32] vectors, the first batch of the warp's first unit.
template <int K, int NR>
__device__ __forceinline__ u32 stage_slot() {
    return (threadIdx.x >> 5) * (u32)(NR * batch_vectors<K, NR>() * 32);
}

// The first batch of this warp's first unit, copied into its slot of
// `stage` by cp.async before the phase's prologue: the rows do not depend
// on the prologue, so their DRAM round trip runs beside it instead of after
// it, and the copies hold no registers across it. One commit group.
template <int K, int NR, class RowsOf>
__device__ __forceinline__ void stage_first_unit(u32 units, RowsOf rows_of, float* stage) {
    constexpr int NV = K / 8, U = batch_vectors<K, NR>();
    const u32 u = unit_at(units, 0);
    if (u < units) {
        const char* rows[NR];
        rows_of(u, rows);
        const int lane = threadIdx.x & 31;
        const u32 slot = smem_u32(stage) + stage_slot<K, NR>() * 16u;
#pragma unroll
        for (int v = 0; v < U; ++v)
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                const int i = v * 32 + lane;
                if (i < NV)
                    cp_async16<kWeightL2>(slot + (u32)(((r * U + v) * 32 + lane) * 16),
                                          rows[r] + (size_t)i * 16, 16);
            }
    }
    cp_async_commit();  // also when empty: callers count groups
}

// Unit u of a weight phase: rows_of(u, rows), then e = early(u), the dot
// products with xs, and epilogue(u, out, e).
template <int K, int NR, class RowsOf, class Early, class Epilogue>
__device__ __forceinline__ void weight_unit(u32 u, const float* __restrict__ xs, RowsOf rows_of, Early early,
                                            Epilogue epilogue) {
    const char* rows[NR];
    rows_of(u, rows);
    const auto e = early(u);
    float o[NR];
    warp_dot_rows<K, NR>(rows, xs, o);
    epilogue(u, o, e);
}

// A weight phase of `units` units of NR rows [K] each, after its prologue
// has filled xs: this warp runs weight_unit on each of its units. early
// loads what the epilogue adds (a residual, a bias) before the weight rows,
// so its round trip overlaps theirs instead of following the warp's sum.
// STAGED: stage_first_unit has filled `stage` with this phase's units and
// rows_of before the prologue. The staged first unit is its own copy of the
// loop body: a runtime "first batch from the stage" flag inside the one loop
// costs registers, and at 0.5B that spilled at the 128-register cap.
template <int K, int NR, bool STAGED = false, class RowsOf, class Early, class Epilogue>
__device__ __forceinline__ void weight_phase(u32 units, const float* __restrict__ xs,
                                             RowsOf rows_of, Early early, Epilogue epilogue,
                                             float* stage = nullptr) {
    u32 k0 = 0;
    if constexpr (STAGED) {
        const u32 u = unit_at(units, 0);
        if (u < units) {
            const char* rows[NR];
            rows_of(u, rows);
            const auto e = early(u);
            float o[NR];
            const uint4* slot = reinterpret_cast<const uint4*>(stage) + stage_slot<K, NR>();
            warp_dot_rows<K, NR, true>(rows, xs, o, slot);
            epilogue(u, o, e);
        }
        k0 = 1;
    }
    for (u32 k = k0, u; (u = unit_at(units, k)) < units; ++k) weight_unit<K, NR>(u, xs, rows_of, early, epilogue);
}

// A weight phase of `pairs` row-pair units, then `singles` one-row units,
// all [K], dealt in one sequence (unit_at over pairs + singles); each kind
// takes its rows, early loads and epilogue as in weight_phase. A phase
// whose pairs overflow the grid by a little (7B's q/k/v: 2,304 pairs for
// 2,112 warps) otherwise gives some warps a second pair; with the rows that
// need no partner as singles (v's 512), the busiest warps take a pair and
// one row.
template <int K, class PairRows, class PairEarly, class PairEpilogue, class Rows, class Early, class Epilogue>
__device__ __forceinline__ void weight_phase_pairs_then_rows(u32 pairs, u32 singles, const float* __restrict__ xs,
                                                             PairRows pair_rows, PairEarly pair_early,
                                                             PairEpilogue pair_epilogue, Rows rows_of, Early early,
                                                             Epilogue epilogue) {
    const u32 units = pairs + singles;
    for (u32 k = 0, u; (u = unit_at(units, k)) < units; ++k) {
        if (u < pairs) weight_unit<K, 2>(u, xs, pair_rows, pair_early, pair_epilogue);
        else weight_unit<K, 1>(u - pairs, xs, rows_of, early, epilogue);
    }
}

// 16-byte loads each thread has in flight in load_vec_to_smem. At 7B's down
// that is 5 round trips per thread where 4-byte loads took about 10. Batches
// of 4 took registers the rest of the step needed (7B and 14B ran slower).
constexpr int kVecCopyBatch = 2;

// Copy N f32 values (global, written earlier in this launch: coherent loads)
// to shared memory in xs_slot order; both 16-byte aligned. The stores may
// alias the loads as far as the compiler knows, so each thread loads a
// batch of kVecCopyBatch 16-byte vectors before it stores any, instead of
// one element per memory round trip. Caller synchronises.
template <int N>
__device__ __forceinline__ void load_vec_to_smem(const float* __restrict__ src, float* dst) {
    constexpr int NV = N / 4;                                  // whole 16-byte vectors
    constexpr int PER = (NV + QMK_THREADS - 1) / QMK_THREADS;  // vectors per thread
    constexpr int B = kVecCopyBatch;
    const int t = (int)threadIdx.x;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(dst);
#pragma unroll
    for (int j0 = 0; j0 < PER; j0 += B) {
        float4 v[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = t + (j0 + j) * QMK_THREADS;
            if (j0 + j < PER && i < NV) v[j] = s4[i];
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int i = t + (j0 + j) * QMK_THREADS;
            if (j0 + j < PER && i < NV) d4[kXsSplit ? (i & 1) * (N / 8) + (i >> 1) : i] = v[j];
        }
    }
    for (int i = 4 * NV + t; i < N; i += QMK_THREADS) dst[xs_slot<N>(i)] = src[i];
}

// The prologue of a weight phase whose input is a vector [N] f32 written
// earlier in the launch (o_proj, down): where it stages (STAGE =
// copied_stages<N>()), this warp's first unit of rows_of goes out first,
// then the copy of src into xs. Returns the stage for weight_phase:
// [WARPS, U, 32] 16-byte vectors.
template <int N>
constexpr bool copied_stages() {
    return stages_after<N, 1>(N);
}
template <int N, bool STAGE, class RowsOf>
__device__ __forceinline__ float* copied_prologue(const float* __restrict__ src, u32 units, RowsOf rows_of,
                                                  float* xs) {
    float* ws = xs + stage_offset(N);  // [WARPS, U, 32] 16-byte vectors
    if constexpr (STAGE) stage_first_unit<N, 1>(units, rows_of, ws);
    load_vec_to_smem<N>(src, xs);
    __syncthreads();
    return ws;
}

}  // namespace qmk
