// decode/tp.cuh: the exchanges of a tensor-parallel rank's decode step
// (rank builds only, QMK_TP_RANKS > 1). A rank holds whole KV groups, a
// slice of the MLP and a slice of the vocabulary; its o_proj and down give
// partial [H] sums, and its LM head the best logit of its rows. Per step:
//   all-reduce (after o_proj and after down, each layer): every CTA writes
//     its rows of the partial into this rank's region; grid barrier; CTA 0
//     publishes the exchange's epoch into every rank's flag slot for this
//     rank (st.release.sys: the barrier's acquire makes the whole grid's
//     partial writes part of what the release orders); every CTA waits for
//     every rank's flag, then sums its slice of [H] over ranks 0, 1, ...
//     in that order (pull: peers' partials are read over their mappings),
//     so every rank gets bit-identical sums; grid barrier.
//   argmax: CTA 0 writes its (value, global index) into every rank's pick
//     slot for this rank, publishes, waits, and folds the picks in rank
//     order with the one-GPU tie rule (lowest index).
// The region (rendered offsets, qmk_kernels::TpRegion):
//   +0                 f32 [2, H]     partial, by epoch parity (this rank writes)
//   +QMK_TP_FLAGS_OFF  u32 [R]        last epoch rank k published (rank k writes)
//   +QMK_TP_FAILED_OFF u32 [R]        nonzero once rank k failed (rank k writes)
//   +QMK_TP_PICKS_OFF  u32 [2, R, 2]  rank k's (logit bits, index), by parity
// Parity buffers suffice: a rank publishes epoch e + 1 only after its wait
// for e, and every peer publishes e only after it finished reading the
// buffers of e - 1.
#pragma once

namespace qmk {

#if QMK_TP_RANKS > 1

__device__ __forceinline__ char* tp_region(const Params& p, u32 k) {
    return reinterpret_cast<char*>(p.tp_peer[k]);
}

// Rank k's partial of the exchange with epoch `epoch`, [H] f32.
__device__ __forceinline__ float* tp_partial(const Params& p, u32 k, u32 epoch) {
    return reinterpret_cast<float*>(tp_region(p, k)) + (epoch & 1u) * QMK_HIDDEN;
}

// Epoch of exchange `k` of this step (0 ..= 2L: o_proj and down of each
// layer, then the argmax).
__device__ __forceinline__ u32 tp_epoch(const Params& p, u32 k) { return p.tp_epoch + k + 1u; }

// Thread 0: waits until every rank published `epoch` (wrapping compare: a
// peer can be at most one exchange ahead). Bounded like every spin-wait; a
// peer's failure mark ends it with kErrTpPeerFailed.
__device__ __forceinline__ bool tp_wait(const Params& p, u32 epoch, u32 phase, u32 layer) {
    const u32* flags = reinterpret_cast<const u32*>(tp_region(p, p.tp_rank) + QMK_TP_FLAGS_OFF);
    const u32* failed = reinterpret_cast<const u32*>(tp_region(p, p.tp_rank) + QMK_TP_FAILED_OFF);
    bool peer_failed = false;
    const bool ok = bounded_wait(
        p,
        [&] {
            bool all = true;
#pragma unroll
            for (u32 k = 0; k < QMK_TP_RANKS; ++k) {
                if (ld_acquire_sys_u32(failed + k) != 0u) {
                    peer_failed = true;
                    return true;
                }
                if ((int)(ld_acquire_sys_u32(flags + k) - epoch) < 0) all = false;
            }
            return all;
        },
        kErrTpTimeout, phase, layer);
    if (ok && peer_failed) {
        record_error(p, kErrTpPeerFailed, phase, layer);
        return false;
    }
    return ok;
}

// Thread 0 of CTA 0: tells every rank that this one reached `epoch`.
__device__ __forceinline__ void tp_publish(const Params& p, u32 epoch) {
#pragma unroll
    for (u32 k = 0; k < QMK_TP_RANKS; ++k)
        st_release_sys_u32(reinterpret_cast<u32*>(tp_region(p, k) + QMK_TP_FLAGS_OFF) + p.tp_rank, epoch);
}

// The all-reduce of exchange `k` (after the barrier that ends the partial
// phase): x[i] = res(i) + (partial_0[i] + ... + partial_{R-1}[i]) over this
// CTA's share of [H]. False (uniform over the CTA) when a wait failed; the
// caller returns. The caller's next grid barrier publishes x to the grid.
template <typename Res>
__device__ __forceinline__ bool tp_all_reduce(const Params& p, u32 k, Res res, u32 phase, u32 layer) {
    __shared__ int s_ok;
    const u32 epoch = tp_epoch(p, k);
    if (threadIdx.x == 0) {
        if (p.flags & kFlagDebugTpStop) {
            s_ok = 0;  // a dead rank: no publish, no error
        } else {
            if (blockIdx.x == 0) tp_publish(p, epoch);
            s_ok = tp_wait(p, epoch, phase, layer);
        }
    }
    __syncthreads();
    if (!s_ok) return false;
    float* x = reinterpret_cast<float*>(p.x);  // [H] f32
    for (u32 i = blockIdx.x * QMK_THREADS + threadIdx.x; i < QMK_HIDDEN; i += gridDim.x * QMK_THREADS) {
        float s = __ldcg(tp_partial(p, 0, epoch) + i);
#pragma unroll
        for (u32 r = 1; r < QMK_TP_RANKS; ++r) s += __ldcg(tp_partial(p, r, epoch) + i);
        x[i] = res(i) + s;
    }
    return true;
}

// CTA 0, thread 0, after the rank's own argmax (bv at local index `pick`):
// replaces `pick` with the pick across the ranks' vocabulary shards; false
// when a wait failed (error recorded).
__device__ __forceinline__ bool tp_argmax(const Params& p, float bv, u32& pick) {
    const u32 bi = pick;
    const u32 epoch = tp_epoch(p, 2u * QMK_LAYERS);
    const u32 slot = ((epoch & 1u) * QMK_TP_RANKS + p.tp_rank) * 2u;
    const u32 gi = bi == 0xffffffffu ? bi : bi + p.tp_rank * (u32)QMK_VOCAB;
#pragma unroll
    for (u32 k = 0; k < QMK_TP_RANKS; ++k) {
        u32* picks = reinterpret_cast<u32*>(tp_region(p, k) + QMK_TP_PICKS_OFF);
        picks[slot] = __float_as_uint(bv);
        picks[slot + 1] = gi;
    }
    tp_publish(p, epoch);  // its release orders the pick stores before it
    if (!tp_wait(p, epoch, kPhaseTpArgmax, QMK_LAYERS)) return false;
    const volatile u32* mine = reinterpret_cast<const volatile u32*>(tp_region(p, p.tp_rank) + QMK_TP_PICKS_OFF) +
                               (epoch & 1u) * QMK_TP_RANKS * 2u;
    float best = -QMK_INF;
    u32 besti = 0xffffffffu;
#pragma unroll
    for (u32 k = 0; k < QMK_TP_RANKS; ++k) {
        const float v = __uint_as_float(mine[2u * k]);
        const u32 i = mine[2u * k + 1u];
        if (better(v, i, best, besti)) {
            best = v;
            besti = i;
        }
    }
    pick = besti;
    return true;
}

#endif  // QMK_TP_RANKS > 1

}  // namespace qmk
