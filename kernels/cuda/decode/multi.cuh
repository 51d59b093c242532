// decode/multi.cuh: the multi-token step (qmk_decode_multi_T): T = 2 ..
// QMK_MT_MAX_TOKENS consecutive positions of one sequence in one launch, the
// verify step of speculative decoding. Every weight row is read once and
// dotted with all T activation vectors; K/V are appended for all T in the
// q/k/v phase, so token t's attention over positions 0 ..= start + t sees
// the run's earlier positions; each token gets its logits and greedy pick.
//
// Each token's logits are bit-identical to a one-token step at its
// position: every sum keeps the one-token kernel's order. A lane takes a
// row's 16-byte weight vectors lane, lane + 32, ... in ascending order into
// one f32 accumulator per (token, row) with the same dot8, then the same
// shuffle tree; the norms sum per thread and across the CTA as rms_norm and
// block_sum do; attention runs the same code per token (its path chosen by
// the token's position, as the one-token step chooses); the argmax keeps the
// same total order. Batch sizes, units and which warp takes a row change no
// sum.
//
// Shared memory holds the T activation vectors of a phase, each in split
// order ([2][K / 8][4]: lane l's two 16-byte reads of its vector l sit next
// to lane l + 1's, no bank conflicts; each token adds two such reads per
// weight vector). Where T vectors [K] do not fit (the MLP's down at large
// T), the phase runs over column chunks of a multiple of 256 elements, each
// warp holding its units' sums across chunks, which keeps every lane's
// ascending order.
#pragma once

namespace qmk {

#if !defined(QMK_MT_SMEM_FLOATS) || !defined(QMK_MT_MAX_TOKENS)
#error "QMK_MT_SMEM_FLOATS and QMK_MT_MAX_TOKENS come from KernelBuild::arch_options"
#endif

// Floats between two tokens' vectors [K] in shared memory (128-byte rounded).
constexpr u32 mt_stride(u32 k) { return (k + 31u) / 32u * 32u; }

static_assert(QMK_MT_MAX_TOKENS <= kMultiMaxTokens, "more tokens than the parameter block holds");
static_assert(QMK_MT_MAX_TOKENS < 2 || QMK_MT_MAX_TOKENS * mt_stride(QMK_HIDDEN) <= QMK_MT_SMEM_FLOATS,
              "the multi-token step's normed vectors do not fit its shared memory");
static_assert(QMK_MT_SMEM_FLOATS >= QMK_SMEM_FLOATS, "the multi-token step runs the one-token attention");

// Vectors per lane per row in flight: 8 16-byte loads per lane per unit
// (one row of 8, or a pair of 4), fewer for short rows.
template <int K, int NR>
constexpr int mt_batch() {
    return lane_vectors(K) < 8 / NR ? lane_vectors(K) : 8 / NR;
}

// Units of twice the rows in the phases after the norms (o_proj, down, the
// LM head: 2 rows instead of 1; gate/up: 2 row pairs instead of 1), so each
// shared read of a token's activations feeds twice the rows: from
// QMK_MT_WIDE_FROM tokens, where the shared reads and FMAs per weight byte
// outweigh the fewer, longer units, and from a hidden size over 1,024
// (0.5B's short phases wait on latency, where wider units cost more).
template <int T>
constexpr int mt_wide() {
    return QMK_HIDDEN > 1024 && (u64)T >= QMK_MT_WIDE_FROM ? 2 : 1;
}

// acc[t][r] += row r . token t's vector over this chunk's weight vectors
// [v0, v0 + cv) of each row (v0 a multiple of 32, so lane l takes vectors
// = l mod 32 as in the one-token step). xs: token t's chunk at xs + t XS,
// [2][cv][4] f32.
template <int NR, int T, int U>
__device__ __forceinline__ void mt_dot(const char* const (&rows)[NR], const float* __restrict__ xs, u32 XS, u32 v0,
                                       u32 cv, float (&acc)[T][NR]) {
    const u32 lane = threadIdx.x & 31u;
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const u32 s4 = XS / 4u;
#pragma unroll 1
    for (u32 base = 0; base < cv; base += 32u * U) {
        uint4 w[NR][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 j = base + (u32)u * 32u + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                if (j < cv) w[r][u] = ld_weight16<kWeightL2>(rows[r] + (size_t)(v0 + j) * 16);
                else w[r][u] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 j = base + (u32)u * 32u + lane;
            if (j < cv) {
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const float4 a = xs4[t * s4 + j], b = xs4[t * s4 + cv + j];
#pragma unroll
                    for (int r = 0; r < NR; ++r) acc[t][r] = dot8(w[r][u], a, b, acc[t][r]);
                }
            }
        }
    }
}

// warp_sum of each of N values at once, every lane getting all N sums with
// warp_sum's bits: the same xor tree per value (level 16's pairs, then 8's,
// ...), but while a lane holds more than one value it keeps half and sends
// its partner the other half, so N values take about N + 5 shuffles
// instead of 5 N. A lane's own value is the left operand of every add, as
// in warp_sum (and a + b == b + a, so both lanes of a pair agree).
template <int N>
__device__ __forceinline__ void warp_sums(float (&v)[N]) {
    static_assert(N >= 1 && N <= 32, "1 .. 32 values");
    constexpr int P = N <= 1 ? 1 : N <= 2 ? 2 : N <= 4 ? 4 : N <= 8 ? 8 : N <= 16 ? 16 : 32;
    constexpr int K = P == 1 ? 0 : P == 2 ? 1 : P == 4 ? 2 : P == 8 ? 3 : P == 16 ? 4 : 5;
    const u32 lane = threadIdx.x & 31u;
    float w[P];
#pragma unroll
    for (int j = 0; j < P; ++j) w[j] = j < N ? v[j] : 0.0f;
#pragma unroll
    for (int i = 0; i < 5; ++i) {
        const int o = 16 >> i, c = P >> i;  // c values per lane before this level
        if (c > 1) {
            const bool up = (lane & (u32)o) != 0u;
#pragma unroll
            for (int j = 0; j < c / 2; ++j) {
                const float keep = up ? w[j + c / 2] : w[j], send = up ? w[j] : w[j + c / 2];
                w[j] = keep + __shfl_xor_sync(QMK_FULL_MASK, send, o);
            }
        } else {
            w[0] += __shfl_xor_sync(QMK_FULL_MASK, w[0], o);
        }
    }
    // Lane l now holds value sum_i bit(l, 16 >> i) (P >> (i + 1)), i < K.
#pragma unroll
    for (int n = 0; n < N; ++n) {
        int src = 0;
#pragma unroll
        for (int i = 0; i < K; ++i) src |= ((n >> (K - 1 - i)) & 1) << (4 - i);
        v[n] = __shfl_sync(QMK_FULL_MASK, w[0], src);
    }
}

// out[t][r] = warp_sum(acc[t][r]) for every (t, r), by warp_sums.
template <int T, int NR>
__device__ __forceinline__ void mt_sums(const float (&acc)[T][NR], float (&out)[T][NR]) {
    float v[T * NR];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < NR; ++r) v[t * NR + r] = acc[t][r];
    warp_sums(v);
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < NR; ++r) out[t][r] = v[t * NR + r];
}

template <int T, int NR>
__device__ __forceinline__ void mt_zero(float (&acc)[T][NR]) {
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[t][r] = 0.0f;
}

// A warp's weight ring: a phase whose activations take FRONT floats of
// shared memory streams its units' rows through S segments per warp after
// them, each U 16-byte vectors per lane of each of a unit's NR rows
// ([NR][U][32] vectors). A lane copies (cp.async) and later reads only its
// own vectors, so cp.async.wait_group is the whole synchronisation, and
// S - 1 segments stay in flight while the warp does a segment's T-token
// arithmetic; loaded into registers, a warp's loads wait behind its own
// arithmetic. On where 3 or more segments fit (QMK_MT_RING_MOST at most).
template <int K, int NR, u32 FRONT>
struct MtRing {
    static constexpr u32 PER_WARP = FRONT < QMK_MT_SMEM_FLOATS ? (QMK_MT_SMEM_FLOATS - FRONT) / QMK_WARPS : 0u;
    // Whole register batches per segment where 3 fit (QMK_MT_RING_BIG),
    // else half.
    static constexpr int UB = mt_batch<K, NR>();
    static constexpr bool BIG = QMK_MT_RING_BIG != 0 && PER_WARP / ((u32)NR * (u32)UB * 128u) >= 3u;
    static constexpr int U = BIG ? UB : (UB / 2 > 0 ? UB / 2 : 1);
    static constexpr u32 SEG = (u32)NR * (u32)U * 32u * 4u;  // floats per segment
    static constexpr u32 FIT = PER_WARP / SEG;
    static constexpr int S = (int)(FIT < (u32)QMK_MT_RING_MOST ? FIT : (u32)QMK_MT_RING_MOST);
    static constexpr bool on = S >= 3;
};

// Copies one segment of rows[NR] into the ring slot at shared address
// `slot`: the lane's vectors j0 + v 32 + lane (v < U) of the chunk of cv
// vectors at vector v0 of each row; none past cv. No commit.
// FULL: every segment is whole (cv a multiple of 32 U), no bounds checks.
template <int NR, int U, bool FULL = false>
__device__ __forceinline__ void mt_ring_issue(u32 slot, const char* const (&rows)[NR], u32 v0, u32 j0, u32 cv) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (int v = 0; v < U; ++v) {
        const u32 j = j0 + (u32)v * 32u + lane;
        if (FULL || j < cv) {
#pragma unroll
            for (int r = 0; r < NR; ++r)
                cp_async16<kWeightL2>(slot + (u32)((r * U + v) * 32) * 16u + lane * 16u, rows[r] + (size_t)(v0 + j) * 16,
                                      16);
        }
    }
}

// acc[t][r] += this lane's vectors j0 + v 32 + lane (< cv) of the segment
// `seg` ([NR][U][32] 16-byte vectors) . token t's chunk at xs + t XS
// ([2][cv][4] f32): mt_dot's sums, in its order.
template <int T, int NR, int U, bool FULL = false>
__device__ __forceinline__ void mt_ring_dot(const uint4* seg, const float* __restrict__ xs, u32 XS, u32 j0, u32 cv,
                                            float (&acc)[T][NR]) {
    const u32 lane = threadIdx.x & 31u;
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    const u32 s4 = XS / 4u;
#pragma unroll
    for (int v = 0; v < U; ++v) {
        const u32 j = j0 + (u32)v * 32u + lane;
        if (FULL || j < cv) {
            uint4 w[NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) w[r] = seg[(r * U + v) * 32 + (int)lane];
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const float4 a = xs4[t * s4 + j], b = xs4[t * s4 + cv + j];
#pragma unroll
                for (int r = 0; r < NR; ++r) acc[t][r] = dot8(w[r], a, b, acc[t][r]);
            }
        }
    }
}

// Nothing loaded early (phases whose epilogue adds nothing read ahead).
struct MtNone {};

// A weight phase of NR-row units [K] over T activation vectors xs (token t
// at xs + t mt_stride(K), split order) that prologue() fills (and
// synchronises): this warp's k-th unit is unit_of(k) (>= units once done),
// row j of unit u is row_of(u, j); e = early(u) is loaded before the unit's
// rows are summed and epilogue(u, o[T][NR], e) gets its sums. Through the
// warp's ring where it fits (the rings start after the T vectors; its first
// copies go out before the prologue, whose round trips they overlap), else
// batches in registers (mt_dot).
template <int T, int K, int NR, class Prologue, class UnitOf, class RowOf, class Early, class Epilogue>
__device__ __forceinline__ void mt_units(Prologue prologue, u32 units, UnitOf unit_of, RowOf row_of, Early early,
                                         Epilogue epilogue, float* xs) {
    constexpr u32 XS = mt_stride(K);
    constexpr u32 CV = (u32)K / 8u;
    using R = MtRing<K, NR, (u32)T * XS>;
    if constexpr (R::on && QMK_MT_RING_MOST >= 3) {
        constexpr int U = R::U, S = R::S;
        constexpr u32 NB = ((u32)lane_vectors(K) + (u32)U - 1u) / (u32)U;  // segments per unit
        constexpr bool FULL = CV % (32u * (u32)U) == 0u;
        float* ring = xs + (u32)T * XS + (threadIdx.x >> 5) * (u32)S * R::SEG;  // this warp's [S, SEG]
        const u32 ring_s = smem_u32(ring);
        // The copies run up to S - 1 segments ahead of the sums, across units.
        u32 pk = 0, pb = 0, pu = unit_of(0u);
        int ps = 0;
        const char* prow[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) prow[j] = pu < units ? row_of(pu, j) : nullptr;
        auto issue = [&]() {
            if (pu < units) {
                mt_ring_issue<NR, U, FULL>(ring_s + (u32)ps * R::SEG * 4u, prow, 0u, pb * 32u * (u32)U, CV);
                if (++pb == NB) {
                    pb = 0;
                    pu = unit_of(++pk);
#pragma unroll
                    for (int j = 0; j < NR; ++j) prow[j] = pu < units ? row_of(pu, j) : nullptr;
                }
            }
            cp_async_commit();  // also when empty: the sums count groups
            ps = ps + 1 == S ? 0 : ps + 1;
        };
#pragma unroll
        for (int s = 0; s < S - 1; ++s) issue();
        prologue();
        int cs = 0;
        for (u32 k = 0, u; (u = unit_of(k)) < units; ++k) {
            const auto e = early(u);
            float acc[T][NR];
            mt_zero(acc);
#pragma unroll 1
            for (u32 b = 0; b < NB; ++b) {
                cp_async_wait<S - 2>();  // this segment's copies are done
                issue();                 // into the slot summed last
                mt_ring_dot<T, NR, U, FULL>(reinterpret_cast<const uint4*>(ring + (u32)cs * R::SEG), xs, XS,
                                      b * 32u * (u32)U, CV, acc);
                cs = cs + 1 == S ? 0 : cs + 1;
            }
            float o[T][NR];
            mt_sums(acc, o);
            epilogue(u, o, e);
        }
        cp_async_wait<0>();
    } else {
        constexpr int U = mt_batch<K, NR>();
        prologue();
        for (u32 k = 0, u; (u = unit_of(k)) < units; ++k) {
            const char* rows[NR];
#pragma unroll
            for (int j = 0; j < NR; ++j) rows[j] = row_of(u, j);
            const auto e = early(u);
            float acc[T][NR];
            mt_zero(acc);
            mt_dot<NR, T, U>(rows, xs, XS, 0u, CV, acc);
            float o[T][NR];
            mt_sums(acc, o);
            epilogue(u, o, e);
        }
    }
}

// RMSNorm of T residual streams into xs (token t at xs + t XS, split
// order): src(t, i) gives element i of token t, w(i) the norm weight. Each
// token's sums are rms_norm's (a thread's elements in ascending order, then
// block_sum's tree), so each gives a one-token step's bits; the T
// reductions share one CTA barrier. red: [T, WARPS] floats.
template <int T, class Src, class W>
__device__ __forceinline__ void mt_rms_norm(Src src, W w, float eps, float* xs, u32 XS, float* red) {
    constexpr int PER = (QMK_HIDDEN + QMK_THREADS - 1) / QMK_THREADS;  // elements per thread
    // Tokens whose loads go out together (about 32 values per thread):
    // the stores may alias the loads as far as the compiler knows, so a
    // group's loads all issue before its first store, one round trip per
    // group instead of per token.
    constexpr int TG = PER >= 32 ? 1 : (32 / PER < T ? 32 / PER : T);
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss[T];
#pragma unroll
    for (int t0 = 0; t0 < T; t0 += TG) {
        float v[TG][PER];
#pragma unroll
        for (int g = 0; g < TG; ++g)
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = tid + j * QMK_THREADS;
                if (t0 + g < T && i < QMK_HIDDEN) v[g][j] = src(t0 + g, (u32)i);
            }
#pragma unroll
        for (int g = 0; g < TG; ++g) {
            const int t = t0 + g;
            if (t < T) {
                ss[t] = 0.0f;
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    const int i = tid + j * QMK_THREADS;
                    if (i < QMK_HIDDEN) {
                        xs[t * XS + xs_slot<(int)QMK_HIDDEN, true>((u32)i)] = v[g][j];
                        ss[t] = fmaf(v[g][j], v[g][j], ss[t]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
        const float s = warp_sum(ss[t]);
        if (lane == 0) red[t * QMK_WARPS + warp] = s;
    }
    __syncthreads();
    float inv[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        float s = lane < QMK_WARPS ? red[t * QMK_WARPS + lane] : 0.0f;
        s = warp_sum(s);
        inv[t] = 1.0f / sqrtf(s / (float)QMK_HIDDEN + eps);
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = tid + j * QMK_THREADS;
        if (i < QMK_HIDDEN) {
            const float wv = w((u32)i);
            const u32 k = xs_slot<(int)QMK_HIDDEN, true>((u32)i);
#pragma unroll
            for (int t = 0; t < T; ++t) xs[t * XS + k] = xs[t * XS + k] * inv[t] * wv;
        }
    }
    __syncthreads();  // xs complete; red is reused by the next norm
}

// Copies elements [c0, c0 + C) of T vectors src [T, K] f32 (global, written
// earlier in this launch: L2 loads) to xs, token t at xs + t XS in split
// order [2][C / 8][4]. C and c0 multiples of 8. Caller synchronises.
template <int T, int K>
__device__ __forceinline__ void mt_load_chunk(const float* __restrict__ src, u32 c0, u32 C, float* xs, u32 XS) {
    static_assert(K % 8 == 0, "rows must be whole 16-byte vectors");
    constexpr int B = 4;  // 16-byte loads in flight per thread
    const u32 nv = C / 4u, total = (u32)T * nv;
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(xs);
    for (u32 f0 = threadIdx.x; f0 < total; f0 += B * QMK_THREADS) {
        float4 v[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const u32 f = f0 + (u32)j * QMK_THREADS;
            if (f < total) v[j] = __ldcg(s4 + (size_t)(f / nv) * (K / 4) + c0 / 4u + f % nv);
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const u32 f = f0 + (u32)j * QMK_THREADS;
            if (f < total) {
                const u32 t = f / nv, l = f % nv;
                d4[t * (XS / 4u) + (l & 1u) * (C / 8u) + (l >> 1)] = v[j];
            }
        }
    }
}

// Whether any warp of this CTA has a k-th unit (warp 0 has the lowest in
// every round of unit_at).
__device__ __forceinline__ bool cta_has_unit(u32 units, u32 k) {
    const u32 nwt = gridDim.x * QMK_WARPS;
    const bool tail = k >= units / nwt;
    return k * nwt + (tail ? blockIdx.x : blockIdx.x * QMK_WARPS) < units;
}

// A weight phase of `units` NR-row units [K] whose T inputs src [T, K] f32
// were written earlier in the launch (o_proj, down): row_of(u, j) is row j
// of unit u; e = early(u) loads what the epilogue adds (the residuals)
// before the weight rows, so its round trip overlaps theirs;
// epilogue(u, o, e) gets the sums o[T][NR].
template <int T, int K, int NR, class RowOf, class Early, class Epilogue>
__device__ __forceinline__ void mt_copied_phase(const float* __restrict__ src, u32 units, RowOf row_of,
                                                Early early, Epilogue epilogue, float* xs) {
    constexpr u32 XS = mt_stride(K);
    if constexpr ((u32)T * XS <= QMK_MT_SMEM_FLOATS) {
        mt_units<T, K, NR>(
            [&] {
                mt_load_chunk<T, K>(src, 0u, (u32)K, xs, XS);
                __syncthreads();
            },
            units, [&](u32 k) { return unit_at(units, k); }, row_of, early, epilogue, xs);
    } else {
        // Chunks of CH elements; G units per warp hold their sums across
        // them. With a ring (3 segments per warp after the chunks), the
        // rows stream on across the chunks' copies and barriers.
        constexpr int G = T * NR <= 4 ? 4 : 2;
        // Half-batch segments: the chunks need the room.
        constexpr int U = mt_batch<K, NR>() / 2 > 0 ? mt_batch<K, NR>() / 2 : 1, S = 3;
        constexpr u32 SEG = (u32)NR * (u32)U * 32u * 4u;  // floats per segment
        constexpr u32 RING = (u32)QMK_WARPS * (u32)S * SEG;
        constexpr u32 CHR = RING < QMK_MT_SMEM_FLOATS ? (QMK_MT_SMEM_FLOATS - RING) / (u32)T / 256u * 256u : 0u;
        constexpr bool ring_on = QMK_MT_RING_MOST >= 3 && CHR >= 1024u;
        constexpr u32 CH = ring_on ? CHR : QMK_MT_SMEM_FLOATS / (u32)T / 256u * 256u;
        constexpr u32 NCH = ((u32)K + CH - 1u) / CH;
        static_assert(CH >= 256u && NCH >= 2u, "chunked phase");
        // Segments per unit per chunk (the last chunk's may be partly empty).
        constexpr u32 NBC = (CH / 256u + (u32)U - 1u) / (u32)U;
        float* ring = xs + (u32)T * CH + (threadIdx.x >> 5) * (u32)S * SEG;  // this warp's [S, SEG]
        const u32 ring_s = smem_u32(ring);
        // The copies' cursor: group k0, chunk c, unit g of the group, segment b.
        u32 pk0 = 0, pc = 0, pg = 0, pb = 0, pu = unit_at(units, 0u);
        int ps = 0;
        const char* prow[NR];
        auto issue = [&]() {
            if (pu < units) {
                const u32 c0 = pc * CH;
                mt_ring_issue<NR, U>(ring_s + (u32)ps * SEG * 4u, prow, c0 / 8u, pb * 32u * (u32)U,
                                     min(CH, (u32)K - c0) / 8u);
            }
            cp_async_commit();  // also when empty: the sums count groups
            ps = ps + 1 == S ? 0 : ps + 1;
            if (++pb == NBC) {
                pb = 0;
                if (++pg == (u32)G) {
                    pg = 0;
                    if (++pc == NCH) {
                        pc = 0;
                        pk0 += (u32)G;
                    }
                }
                pu = unit_at(units, pk0 + pg);
#pragma unroll
                for (int j = 0; j < NR; ++j) prow[j] = pu < units ? row_of(pu, j) : nullptr;
            }
        };
        if constexpr (ring_on) {
#pragma unroll
            for (int j = 0; j < NR; ++j) prow[j] = pu < units ? row_of(pu, j) : nullptr;
#pragma unroll
            for (int s = 0; s < S - 1; ++s) issue();
        }
        int cs = 0;
        for (u32 k0 = 0; cta_has_unit(units, k0); k0 += G) {
            float acc[G][T][NR];
#pragma unroll
            for (int g = 0; g < G; ++g) mt_zero(acc[g]);
#pragma unroll 1
            for (u32 c = 0; c < NCH; ++c) {
                const u32 c0 = c * CH, C = min(CH, (u32)K - c0);
                __syncthreads();  // every warp is done with the previous chunk
                mt_load_chunk<T, K>(src, c0, C, xs, CH);
                __syncthreads();
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const u32 u = unit_at(units, k0 + (u32)g);
                    if constexpr (ring_on) {
#pragma unroll 1
                        for (u32 b = 0; b < NBC; ++b) {
                            cp_async_wait<S - 2>();
                            issue();
                            if (u < units)
                                mt_ring_dot<T, NR, U>(reinterpret_cast<const uint4*>(ring + (u32)cs * SEG), xs,
                                                      CH, b * 32u * (u32)U, C / 8u, acc[g]);
                            cs = cs + 1 == S ? 0 : cs + 1;
                        }
                    } else if (u < units) {
                        const char* rows[NR];
#pragma unroll
                        for (int j = 0; j < NR; ++j) rows[j] = row_of(u, j);
                        mt_dot<NR, T, mt_batch<K, NR>()>(rows, xs, CH, c0 / 8u, C / 8u, acc[g]);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const u32 u = unit_at(units, k0 + (u32)g);
                if (u < units) {
                    const auto e = early(u);
                    float o[T][NR];
                    mt_sums(acc[g], o);
                    epilogue(u, o, e);
                }
            }
        }
        if constexpr (ring_on) cp_async_wait<0>();
        __syncthreads();  // xs is rewritten by the next phase's prologue
    }
}

// T floats by value (an early load's results).
template <int T>
struct MtVals {
    float v[T];
};

// The T input tokens, in registers (constant indices into the parameter
// block after unrolling).
template <int T>
struct MtTokens {
    u32 id[T];
};

// T row addresses.
template <int T>
struct MtRows {
    const char* row[T];
};

// Residual element i of token t before this layer: its embedding row in
// layer 0, else x[t].
template <int T>
__device__ __forceinline__ float mt_residual(const MultiParams& m, const MtTokens<T>& tk, u32 layer, int t, u32 i) {
    return layer == 0 ? embed(m.base, tk.id[t], i)
                      : __ldcg(reinterpret_cast<const float*>(m.x) + (size_t)t * QMK_HIDDEN + i);
}

// input_layernorm + q/k/v + bias + rotary + K/V append for T tokens; units
// are the one-token step's row pairs (h D + i, h D + i + D / 2) of q, k, v.
template <int T>
__device__ __forceinline__ void mt_qkv(const MultiParams& m, const MtTokens<T>& tk, u32 layer, float* xs,
                                       float* red) {
#if QMK_TC_PHASES
    // The one-token step's tensor-core phase at T tokens: the same bits.
    const char* emb[T];  // [T] rows [H] bf16 (layer 0)
#pragma unroll
    for (int t = 0; t < T; ++t) emb[t] = layer == 0 ? table_row(m.base.embed_tokens[0], tk.id[t]) : nullptr;
    tc::qkv<T>(m.base, layer, reinterpret_cast<const float*>(m.x), emb, m.start, reinterpret_cast<float*>(m.q), xs);
    return;
#endif
    const Params& p = m.base;
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2;
    constexpr u32 QP = QMK_Q_DIM / 2, KP = QMK_KV_DIM / 2;
    constexpr u32 XS = mt_stride(QMK_HIDDEN);
    const LayerView<input_layernorm_t> ln(p.input_layernorm, layer);
    const LayerView<q_proj_t> wq(p.q_proj, layer);
    const LayerView<k_proj_t> wk(p.k_proj, layer);
    const LayerView<v_proj_t> wv(p.v_proj, layer);
    const LayerView<q_bias_t> bq(p.q_bias, layer);
    const LayerView<k_bias_t> bk(p.k_bias, layer);
    const LayerView<v_bias_t> bv(p.v_bias, layer);
    char* kl = kv_layer(p.k_cache, layer, p.kv_capacity);  // [C, KV] bf16
    char* vl = kv_layer(p.v_cache, layer, p.kv_capacity);  // [C, KV] bf16
    float* q = reinterpret_cast<float*>(m.q);              // [T, Q] f32
    constexpr u32 units = QP + 2 * KP;
    // Unit u: which tensor (0 q, 1 k, 2 v), its row pair's first row r0 and
    // the rotary index i.
    auto unit = [](u32 u, u32& which, u32& i, u32& r0) {
        which = u < QP ? 0u : (u < QP + KP ? 1u : 2u);
        const u32 uu = which == 0 ? u : (which == 1 ? u - QP : u - QP - KP);
        i = uu % HALF;
        r0 = (uu / HALF) * D + i;
    };
    mt_units<T, (int)QMK_HIDDEN, 2>(
        [&] {
            mt_rms_norm<T>([&](int t, u32 i) { return mt_residual(m, tk, layer, t, i); },
                           [&](u32 i) { return ln.elem(i); }, p.rms_norm_eps, xs, XS, red);
        },
        units, [&](u32 k) { return unit_at(units, k); },
        [&](u32 u, int j) {
            u32 which, i, r0;
            unit(u, which, i, r0);
            const u32 r = r0 + (j ? HALF : 0u);
            return which == 0 ? wq.row(r) : (which == 1 ? wk.row(r) : wv.row(r));
        },
        [](u32) { return MtNone{}; },
        [&](u32 u, const float (&o)[T][2], MtNone) {
            if ((threadIdx.x & 31) != 0) return;
            u32 which, i, r0;
            unit(u, which, i, r0);
            const u32 r1 = r0 + HALF;
            const float b0 = which == 0 ? bq.elem(r0) : (which == 1 ? bk.elem(r0) : bv.elem(r0));
            const float b1 = which == 0 ? bq.elem(r1) : (which == 1 ? bk.elem(r1) : bv.elem(r1));
#pragma unroll
            for (int t = 0; t < T; ++t) {
                const u32 pos = m.start + (u32)t;
                float lo = o[t][0] + b0, hi = o[t][1] + b1;
                if (which == 2) {
                    kv_append(vl, pos, r0, lo);
                    kv_append(vl, pos, r1, hi);
                    continue;
                }
                rotate(rotary_cs(p, pos, i), lo, hi);
                if (which == 0) {
                    q[t * QMK_Q_DIM + r0] = lo;
                    q[t * QMK_Q_DIM + r1] = hi;
                } else {
                    kv_append(kl, pos, r0, lo);
                    kv_append(kl, pos, r1, hi);
                }
            }
        },
        xs);
}

// A residual phase for T tokens (o_proj, down): x[t, r] = res(t, r) + w[r]
// . src[t] over rows r < H, src [T, K] f32, in units of NR consecutive
// rows; lane 0 loads the residuals before the rows.
template <int T, int K, class Tensor, class Res>
__device__ __forceinline__ void mt_residual_phase(const MultiParams& m, const LayerView<Tensor>& w,
                                                  const float* __restrict__ src, Res res, float* xs) {
    constexpr int NR = mt_wide<T>();
    static_assert(QMK_HIDDEN % NR == 0, "whole units");
    float* x = reinterpret_cast<float*>(m.x);  // [T, H] f32
    const bool lane0 = (threadIdx.x & 31) == 0;
    mt_copied_phase<T, K, NR>(
        src, QMK_HIDDEN / NR, [&](u32 u, int j) { return w.row(u * NR + (u32)j); },
        [&](u32 u) {
            MtVals<T * NR> e;
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int j = 0; j < NR; ++j) e.v[t * NR + j] = lane0 ? res(t, u * NR + (u32)j) : 0.0f;
            return e;
        },
        [&](u32 u, const float (&o)[T][NR], const MtVals<T * NR>& e) {
            if (!lane0) return;
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int j = 0; j < NR; ++j) x[t * QMK_HIDDEN + u * NR + j] = e.v[t * NR + j] + o[t][j];
        },
        xs);
}

// o_proj + residual for T tokens: x[t, r] = residual[t, r] + o_proj[r] . attn[t].
template <int T>
__device__ __forceinline__ void mt_o_proj(const MultiParams& m, const MtTokens<T>& tk, u32 layer, float* xs) {
#if QMK_TC_PHASES
    // The one-token step's tensor-core phase at T tokens: the same bits.
    // The epilogue holds the residuals' addresses (layer 0: each token's
    // embedding row), not the parameter block.
    float* xr = reinterpret_cast<float*>(m.x);  // [T, H] f32
    MtRows<T> emb;                              // [T] rows [H] bf16
#pragma unroll
    for (int t = 0; t < T; ++t) emb.row[t] = layer == 0 ? table_row(m.base.embed_tokens[0], tk.id[t]) : nullptr;
    tc::o_proj<T>(m.base, layer, reinterpret_cast<const float*>(m.attn), xs, [xr, emb](int r, int t, float v) {
        float* x = xr + t * QMK_HIDDEN + r;
        *x = (emb.row[t] ? ld_bf16(emb.row[t] + (size_t)r * 2) : __ldcg(x)) + v;
    });
    return;
#endif
    mt_residual_phase<T, (int)QMK_Q_DIM>(m, LayerView<o_proj_t>(m.base.o_proj, layer),
                                         reinterpret_cast<const float*>(m.attn),
                                         [&](int t, u32 r) { return mt_residual(m, tk, layer, t, r); }, xs);
}

// post_attention_layernorm + gate/up + SiLU for T tokens: h[t, r] =
// silu(gate[r] . n[t]) * (up[r] . n[t]), one warp per row r of both.
template <int T>
__device__ __forceinline__ void mt_gate_up(const MultiParams& m, u32 layer, float* xs, float* red) {
#if QMK_TC_PHASES
    // The one-token step's tensor-core phase at T tokens: the same bits.
    float* hr = reinterpret_cast<float*>(m.mlp_h);  // [T, I] f32
    tc::gate_up<T>(m.base, layer, reinterpret_cast<const float*>(m.x), xs,
                   [hr](int r, int t, float gate, float up) { hr[t * QMK_INTER + r] = silu(gate) * up; });
    return;
#endif
    const Params& p = m.base;
    constexpr u32 XS = mt_stride(QMK_HIDDEN);
    const LayerView<post_attention_layernorm_t> ln(p.post_attention_layernorm, layer);
    const LayerView<gate_proj_t> wg(p.gate_proj, layer);
    const LayerView<up_proj_t> wu(p.up_proj, layer);
    const float* x = reinterpret_cast<const float*>(m.x);  // [T, H] f32
    float* h = reinterpret_cast<float*>(m.mlp_h);          // [T, I] f32
    constexpr int P = mt_wide<T>();  // rows r of gate and up per unit
    static_assert(QMK_INTER % P == 0, "whole units");
    constexpr u32 units = QMK_INTER / P;
    mt_units<T, (int)QMK_HIDDEN, 2 * P>(
        [&] {
            mt_rms_norm<T>([&](int t, u32 i) { return __ldcg(x + (size_t)t * QMK_HIDDEN + i); },
                           [&](u32 i) { return ln.elem(i); }, p.rms_norm_eps, xs, XS, red);
        },
        units, [&](u32 k) { return unit_at(units, k); },
        [&](u32 u, int j) { return (j & 1) ? wu.row(u * P + (u32)(j >> 1)) : wg.row(u * P + (u32)(j >> 1)); },
        [](u32) { return MtNone{}; },
        [&](u32 u, const float (&o)[T][2 * P], MtNone) {
            if ((threadIdx.x & 31) != 0) return;
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int j = 0; j < P; ++j) h[t * QMK_INTER + u * P + j] = silu(o[t][2 * j]) * o[t][2 * j + 1];
        },
        xs);
}

// down + residual for T tokens: x[t, r] += down[r] . h[t].
template <int T>
__device__ __forceinline__ void mt_down(const MultiParams& m, u32 layer, float* xs) {
#if QMK_TC_PHASES
    // The one-token step's tensor-core phase at T tokens: the same bits.
    float* xr = reinterpret_cast<float*>(m.x);  // [T, H] f32
    tc::down<T>(m.base, layer, reinterpret_cast<const float*>(m.mlp_h), xs, [xr](int r, int t, float v) {
        xr[t * QMK_HIDDEN + r] = __ldcg(xr + t * QMK_HIDDEN + r) + v;
    });
    return;
#endif
    const float* x = reinterpret_cast<const float*>(m.x);  // [T, H] f32
    mt_residual_phase<T, (int)QMK_INTER>(m, LayerView<down_proj_t>(m.base.down_proj, layer),
                                         reinterpret_cast<const float*>(m.mlp_h),
                                         [&](int t, u32 r) { return __ldcg(x + (size_t)t * QMK_HIDDEN + r); }, xs);
}

// Final norm + LM head for T tokens: logits [T, V], and each CTA's best
// (value, index) per token in partial_val / partial_idx [T, grid].
template <int T>
__device__ __forceinline__ void mt_lm_head(const MultiParams& m, float* xs, float* red) {
    const Params& p = m.base;
    constexpr u32 XS = mt_stride(QMK_HIDDEN);
    const float* x = reinterpret_cast<const float*>(m.x);       // [T, H] f32
    const char* nw = reinterpret_cast<const char*>(p.norm[0]);  // [H] bf16
    float* logits = reinterpret_cast<float*>(m.logits);  // [T, V] f32
    const u32 nwt = gridDim.x * QMK_WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best[T];
    u32 besti[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
        best[t] = -QMK_INF;
        besti[t] = 0xffffffffu;
    }
    constexpr int NR = mt_wide<T>();  // consecutive rows per unit
    static_assert(QMK_VOCAB % NR == 0, "whole units");
    constexpr u32 units = QMK_VOCAB / NR;
    mt_units<T, (int)QMK_HIDDEN, NR>(
        [&] {
            mt_rms_norm<T>([&](int t, u32 i) { return __ldcg(x + (size_t)t * QMK_HIDDEN + i); },
                           [&](u32 i) { return ld_bf16(nw + (koff_t)i * 2u); }, p.rms_norm_eps, xs, XS, red);
        },
        units, [&](u32 k) { return blockIdx.x * QMK_WARPS + (u32)warp + k * nwt; },
        [&](u32 u, int j) { return table_row(p.lm_head[0], u * NR + (u32)j); }, [](u32) { return MtNone{}; },
        [&](u32 u, const float (&os)[T][NR], MtNone) {
#pragma unroll
            for (int j = 0; j < NR; ++j) {
                const u32 r = u * NR + (u32)j;
#pragma unroll
                for (int t = 0; t < T; ++t) {
                    const float o = os[t][j];
                    if (lane == 0) logits[(size_t)t * QMK_VOCAB + r] = o;
                    // Rows ascend within a warp: a strict '>' keeps the lowest index.
                    if (o > best[t]) {
                        best[t] = o;
                        besti[t] = r;
                    }
                }
            }
        },
        xs);
    __shared__ float s_val[QMK_MT_MAX_TOKENS][QMK_WARPS];
    __shared__ u32 s_idx[QMK_MT_MAX_TOKENS][QMK_WARPS];
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < T; ++t) {
            s_val[t][warp] = best[t];
            s_idx[t][warp] = besti[t];
        }
    }
    __syncthreads();
    if (threadIdx.x < (u32)T) {
        const u32 t = threadIdx.x;
        float bv = s_val[t][0];
        u32 bi = s_idx[t][0];
        for (int w = 1; w < QMK_WARPS; ++w)
            if (better(s_val[t][w], s_idx[t][w], bv, bi)) {
                bv = s_val[t][w];
                bi = s_idx[t][w];
            }
        reinterpret_cast<float*>(m.partial_val)[t * gridDim.x + blockIdx.x] = bv;
        reinterpret_cast<u32*>(m.partial_idx)[t * gridDim.x + blockIdx.x] = bi;
    }
}

// CTA 0: warp t reduces token t's partials as argmax() does; returns the
// picks in s_pick[T].
template <int T>
__device__ __forceinline__ void mt_argmax(const MultiParams& m, u32* s_pick) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    if (warp < (u32)T) {
        const float* pv = reinterpret_cast<const float*>(m.partial_val) + warp * gridDim.x;  // [grid] f32
        const u32* pi = reinterpret_cast<const u32*>(m.partial_idx) + warp * gridDim.x;      // [grid] u32
        float bv = -QMK_INF;
        u32 bi = 0xffffffffu;
        for (u32 c = lane; c < gridDim.x; c += 32) {
            const float v = __ldcg(pv + c);
            const u32 i = __ldcg(pi + c);
            if (better(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(QMK_FULL_MASK, bv, o);
            const u32 oi = __shfl_xor_sync(QMK_FULL_MASK, bi, o);
            if (better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) s_pick[warp] = bi;
    }
    __syncthreads();
}

// The multi-token step for T tokens (m.n_tokens == T, checked).
template <int T>
__device__ __forceinline__ void decode_multi(const MultiParams& m) {
    static_assert(T >= 2 && T <= (int)QMK_MT_MAX_TOKENS, "multi-token step: 2 .. QMK_MT_MAX_TOKENS tokens");
    const Params& p = m.base;
    extern __shared__ __align__(128) float4 qmk_dyn_smem[];
    float* xs = reinterpret_cast<float*>(qmk_dyn_smem);  // [QMK_MT_SMEM_FLOATS] f32
    __shared__ float red[QMK_MT_MAX_TOKENS * QMK_WARPS];
    __shared__ u32 s_pick[QMK_MT_MAX_TOKENS];

    MtTokens<T> tk;
    bool bad_token = false;
#pragma unroll
    for (int t = 0; t < T; ++t) {
        tk.id[t] = m.tokens[t];
        bad_token |= tk.id[t] >= QMK_VOCAB;
    }
    const u32 pos0 = m.start;
    // Uniform across the grid: every CTA returns before any barrier.
    if (bad_token || m.n_tokens != (u32)T || pos0 >= p.kv_capacity || p.kv_capacity - pos0 < (u32)T) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            record_error(p, bad_token ? kErrBadToken : kErrBadPos, kPhaseStart, 0);
        return;
    }
    // Token t takes the split attention where a one-token step at pos0 + t
    // would: tokens [t_split, T).
    u32 t_split;
    if (p.flags & kFlagAttnNoSplit) t_split = (u32)T;
    else if ((p.flags & kFlagAttnForceSplit) || pos0 + 1u >= kAttnSplitMinContext) t_split = 0u;
    else t_split = min((u32)T, kAttnSplitMinContext - 1u - pos0);
    u32* part = reinterpret_cast<u32*>(m.attn_part);  // [T, part_words] u32
    if (t_split < (u32)T && blockIdx.x == 0) {
        for (u32 t = t_split; t < (u32)T; ++t)
            for (u32 i = threadIdx.x; i < kAttnTicketWords; i += QMK_THREADS) part[t * m.part_words + i] = 0u;
        __threadfence();
    }
#if QMK_TC_PHASES
    if (blockIdx.x == 0) tc::zero_counters(p);
#endif
    GridBarrierT<true> bar;  // traced with kFlagTrace, as the one-token step
    bar.init(p);
    for (u32 layer = 0; layer < QMK_LAYERS; ++layer) {
        mt_qkv<T>(m, tk, layer, xs, red);
        if (!bar.sync(p, kPhaseQkv, layer)) return;
        AttnIo io{reinterpret_cast<const float*>(m.q), reinterpret_cast<float*>(m.attn), part, m.part_words, pos0,
                  0u, t_split};
        if (t_split > 0u) attention<true>(p, layer, io, xs);
        if (t_split < (u32)T) {
            io.t0 = t_split;
            io.t1 = (u32)T;
            if (!attention_split<true>(p, layer, io, xs)) return;
        }
        if (!bar.sync(p, kPhaseAttention, layer)) return;
        mt_o_proj<T>(m, tk, layer, xs);
        if (!bar.sync(p, kPhaseOProj, layer)) return;
        mt_gate_up<T>(m, layer, xs, red);
        if (!bar.sync(p, kPhaseGateUp, layer)) return;
        mt_down<T>(m, layer, xs);
        if (!bar.sync(p, kPhaseDown, layer)) return;
    }
    mt_lm_head<T>(m, xs, red);
    if (!bar.sync(p, kPhaseLmHead, QMK_LAYERS)) return;
    if (blockIdx.x == 0) {
        mt_argmax<T>(m, s_pick);
        if (threadIdx.x < (u32)T) reinterpret_cast<u32*>(m.picks)[threadIdx.x] = s_pick[threadIdx.x];
        if (threadIdx.x == 0) {
            const u32 last = s_pick[T - 1];
            *reinterpret_cast<u32*>(p.argmax_out) = last;
            volatile HostStatus* st = reinterpret_cast<volatile HostStatus*>(p.status);
            st->argmax = last;
            st->barriers = bar.count;
            st->done = st->done + 1u;
            bar.finish(p);
            if (p.flags & kFlagTrace) trace_slot(p, 0)[1] = globaltimer_ns();
            __threadfence_system();
        }
    }
}

}  // namespace qmk
