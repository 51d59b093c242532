// prefill/gemm_phases.cuh: the GEMM phases of one layer of the prefill kernel, each
// a strided loop over (BM-row, 128 / NB-column) output tiles of gemm_tile
// with its epilogue (BM = 64 or 128, chosen per phase from the tile count and
// the grid: gemm_use_bm64):
//   qkv     qkv[T, Q+2KV] f32 = xa . [Wq; Wk; Wv]^T + bias (rotary next phase)
//   o_proj  act[T, H] += attn . Wo^T                 (residual add)
//   gate_up hb[T, I] bf16 = silu(xa . Wg^T) * (xa . Wu^T)
//   down    act[T, H] += hb . Wd^T                   (residual add)
// Every output element is written by exactly one thread.
//
// On sm_90a (unless kFlagPfMmaSync) the same four phases run on wgmma
// (prefill/wgmma.cuh): NT-token x 256-weight-row tiles (wg_use_nt64); a
// phase of fewer tiles than half the grid, and a last wave of fewer than
// half, run stream-K (wg_dp_tiles, wg_phase). There the qkv epilogue also
// rotates q / k and writes qb [T, Q] bf16 and the K / V cache (WgQkvOut),
// gate/up stages its tile through shared memory into 16-byte stores, and
// o_proj / down add the residual with red.global.add.
//
// Tile order is column-major (tile = n_tile * mt + m_tile): the CTAs of a
// wave share few weight tiles, each read from HBM once and by the other
// row tiles from L2 (7B gate/up is 271 MB a layer: row-major order re-read
// it once per 128-row tile, 16 times at 2,048 tokens); the activations
// (7B x: 14.7 MB at 2,048 rows) stay in L2.
#pragma once

namespace qmk {

static_assert(QMK_HIDDEN % 2 == 0 && QMK_INTER % 2 == 0, "epilogues write column pairs");

// The q / k / v projections of one layer, shared by both GEMM paths: the
// weights (which = 0 q, 1 k, 2 v) and the biases.
// Selected by value, not by indexing an array (a runtime index would put
// the array in local memory).
struct QkvLayer {
    WRows wq, wk, wv;
    LayerView<q_bias_t> bq;
    LayerView<k_bias_t> bk;
    LayerView<v_bias_t> bv;
    __device__ __forceinline__ QkvLayer(const Params& p, u32 layer)
        : wq(wrows<q_proj_t>(p.q_proj, layer)),
          wk(wrows<k_proj_t>(p.k_proj, layer)),
          wv(wrows<v_proj_t>(p.v_proj, layer)),
          bq(p.q_bias, layer),
          bk(p.k_bias, layer),
          bv(p.v_bias, layer) {}
    __device__ __forceinline__ WRows w(u32 which) const {
        return which == 0 ? wq : (which == 1 ? wk : wv);
    }
    __device__ __forceinline__ float bias(u32 which, u32 n) const {
        return which == 0 ? bq.elem(n) : (which == 1 ? bk.elem(n) : bv.elem(n));
    }
};

// First column of q / k / v (which = 0, 1, 2) in the qkv scratch [T, Q + 2 KV].
constexpr u32 qkv_col0(u32 which) {
    return which == 0 ? 0u : (which == 1 ? (u32)QMK_Q_DIM : (u32)(QMK_Q_DIM + QMK_KV_DIM));
}

// Weight tile nt of q / k / v in tiles of BN rows. Tiles never straddle two
// tensors (Q and KV each end in a partial tile when not a multiple of BN):
// the tensor, its first row, the tensor's rows, and qkv_col0.
struct QkvTile {
    u32 which, n0, n_end, col0;
};
template <u32 BN>
struct QkvTiling {
    static constexpr u32 QT = (QMK_Q_DIM + BN - 1) / BN, KT = (QMK_KV_DIM + BN - 1) / BN;
    static constexpr u32 TILES = QT + 2 * KT;
    static constexpr QkvTile tile(u32 nt) {
        const u32 which = nt < QT ? 0u : (nt < QT + KT ? 1u : 2u);
        return {which, (which == 0 ? nt : (which == 1 ? nt - QT : nt - QT - KT)) * BN,
                which == 0 ? (u32)QMK_Q_DIM : (u32)QMK_KV_DIM, qkv_col0(which)};
    }
    // The last tile of each tensor starts inside it and the next tensor's
    // first tile at row 0.
    static_assert(tile(QT - 1).which == 0 && tile(QT - 1).n0 < QMK_Q_DIM && tile(QT).which == 1 &&
                      tile(QT).n0 == 0 && tile(QT + KT - 1).n0 < QMK_KV_DIM &&
                      tile(QT + KT).which == 2 && tile(QT + KT).n0 == 0 &&
                      tile(TILES - 1).which == 2 && tile(TILES - 1).n0 < QMK_KV_DIM,
                  "q / k / v tiling");
};

// Whether the q/k/v GEMM's epilogue applies the rotary embedding and writes
// the K / V cache (the wgmma path), so the rope phase is skipped.
__device__ __forceinline__ bool prefill_rope_fused(const PrefillParams& pp) {
#if QMK_WGMMA
    if constexpr (kWgShapesOk) return (pp.base.flags & kFlagPfMmaSync) == 0;
#endif
    return false;
}

#if QMK_WGMMA
// Epilogue functors of the wgmma phases (wg_phase): whole_tile ones get the
// tile's accumulators at once (tile()), the others one call per element
// through wg_epilogue.
// q / k / v: the tile's q / k / v + bias go through shared memory and leave
// rotated (q, k) as bf16 into qb and the K / V cache: the rope phase's work,
// without a round trip through an f32 [T, Q + 2 KV] scratch (37.7 MB written
// and read a layer at 7B, 2,048 tokens). Same arithmetic and rounding as
// prefill_rope_kv, so the same bits as the mma.sync path's rope phase.
struct WgQkvOut {
    QkvLayer L;
    const PrefillParams* pp;
    u32 layer;
    static constexpr bool whole_tile = true;
    template <int NT>
    __device__ __forceinline__ void tile(const float (&acc)[NT / 2], u32 t_end, const WgTile& d,
                                         u32 smem) const;
};

// Shared-memory staging of a q / k / v tile: f32 [NT tokens][256 rows], 1 KB
// per token, 32-byte granule r / 8 at granule (r / 8) ^ ((tok / 2) % 4): a
// warp's writes (8 rows x 4 tokens 2cc + e) hit distinct banks.
__device__ __forceinline__ u32 wg_qkv_stage_addr(u32 smem, u32 tok, u32 r) {
    return smem + tok * 1024u + (((r >> 3) ^ ((tok >> 1) & 3u)) << 5) + (r & 7u) * 4u;
}

template <int NT>
__device__ __forceinline__ void WgQkvOut::tile(const float (&acc)[NT / 2], u32 t_end, const WgTile& d,
                                               u32 smem) const {
    static_assert(kWgRows == 256 && kWgRows % QMK_HEAD_DIM == 0, "heads lie whole in a tile");
    constexpr u32 D = QMK_HEAD_DIM, HALF = D / 2, QH = HALF / 2;  // QH: pairs of pairs per head
    const Params& p = pp->base;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const u32 q = warp & 3u, g = lane >> 2, cc = lane & 3u;
    const u32 row = wg * 64u + q * 16u + g;  // A row of acc[4j], acc[4j + 1]
    __syncthreads();  // every warpgroup's reads of the stages have retired
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = row + 8u * h, n = d.n0 + r;
        const float b = n < d.n_end ? L.bias(d.which, n) : 0.0f;
#pragma unroll
        for (u32 j = 0; j < (u32)NT / 8; ++j) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                const u32 tok = j * 8u + 2u * cc + e;
                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(wg_qkv_stage_addr(smem, tok, r)),
                             "f"(acc[4 * j + 2 * h + e] + b)
                             : "memory");
            }
        }
    }
    __syncthreads();
    // Thread: rotary pairs (i, i + HALF) and (i + 1, i + 1 + HALF) of head
    // hd of the tile, for tokens grp, grp + 8, ... (64 pairs of pairs = the
    // tile's 256 rows). Same arithmetic and rounding as prefill_rope_kv.
    const u32 p2 = tid & 63u, grp = tid >> 6;
    const u32 hd = p2 / QH, i = 2u * (p2 % QH);
    const u32 r0 = hd * D + i, n0 = d.n0 + r0;
    if (n0 >= d.n_end) return;
    char* qb = reinterpret_cast<char*>(pp->qb);  // [T, Q] bf16
    // [C, KV] bf16: this layer's K or V cache.
    char* cache = d.which == 1 ? kv_layer(p.k_cache, layer, p.kv_capacity)
                               : kv_layer(p.v_cache, layer, p.kv_capacity);
    for (u32 tok = grp; tok < (u32)NT; tok += QMK_THREADS / 64u) {
        const u32 t = d.m0 + tok;
        if (t >= t_end) break;
        float2 lo, hi;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                     : "=f"(lo.x), "=f"(lo.y)
                     : "r"(wg_qkv_stage_addr(smem, tok, r0))
                     : "memory");
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                     : "=f"(hi.x), "=f"(hi.y)
                     : "r"(wg_qkv_stage_addr(smem, tok, r0 + HALF))
                     : "memory");
        const u32 pos = pp->start + t;
        if (d.which < 2) {
            rotary(p, pos, i, lo.x, hi.x);
            rotary(p, pos, i + 1u, lo.y, hi.y);
        }
        const u32 plo = pack_bf16x2(lo.x, lo.y), phi = pack_bf16x2(hi.x, hi.y);
        if (d.which == 0) {
            char* o = qb + ((size_t)t * QMK_Q_DIM + n0) * 2u;
            *reinterpret_cast<u32*>(o) = plo;
            *reinterpret_cast<u32*>(o + HALF * 2u) = phi;
        } else {
            *reinterpret_cast<u32*>(cache + kv_off(pos, n0)) = plo;
            *reinterpret_cast<u32*>(cache + kv_off(pos, n0 + HALF)) = phi;
        }
    }
    // The next tile's mainloop starts with a __syncthreads before its loads
    // overwrite the stages.
}

// o_proj / down: act[t, n] += v by red.global.add. Every element gets
// exactly one add, so the same bits as load-add-store, without a load round
// trip per element.
struct WgResidualOut {
    float* act;  // [T, QMK_HIDDEN] f32 residual stream
    static constexpr bool whole_tile = false;
    __device__ __forceinline__ float col(const WgTile&, u32) const { return 0.0f; }
    __device__ __forceinline__ void operator()(const WgTile&, u32 t, u32 n, float, float v) const {
        atomicAdd(act + (size_t)t * QMK_HIDDEN + n, v);
    }
};

// The wgmma versions of the three tile loops (wg_phase in prefill/wgmma.cuh:
// full waves, then stream-K): NT-token x 256-weight-row tiles (128 columns
// of gate and of up), the same column-major tile order.
template <int NT>
__device__ __forceinline__ void wg_qkv_tiles(const PrefillParams& pp, u32 layer, u32 smem,
                                             WgStreamK& sk) {
    const QkvLayer L(pp.base, layer);
    using Tiling = QkvTiling<kWgRows>;
    const u32 mt = (pp.n_tokens + NT - 1) / NT;
    auto desc = [&](u32 tile, WgTile& d, WRows (&w)[1]) {
        const QkvTile q = Tiling::tile(tile / mt);
        d.m0 = (tile % mt) * NT;
        d.which = q.which;
        d.n0 = q.n0;
        d.n_end = q.n_end;
        w[0] = L.w(q.which);
    };
    const WgQkvOut epi{L, &pp, layer};
    wg_phase<NT, 1, (int)QMK_HIDDEN>(pp, sk, kPhasePfQkv, layer,
                                     reinterpret_cast<const char*>(pp.xa), QMK_PF_XA_COLS * 2u,
                                     mt * Tiling::TILES, smem, desc, epi);
}

template <int NT, class T, int K>
__device__ __forceinline__ void wg_residual_tiles(const PrefillParams& pp,
                                                  const u64 (&chunks)[QMK_MAX_CHUNKS], u32 layer,
                                                  u64 a, u32 a_cols, u32 smem, WgStreamK& sk,
                                                  u32 phase) {
    const WRows wt = wrows<T>(chunks, layer);
    float* act = reinterpret_cast<float*>(pp.act);  // [T, H] f32
    constexpr u32 WT = (QMK_HIDDEN + kWgRows - 1) / kWgRows;
    const u32 mt = (pp.n_tokens + NT - 1) / NT;
    auto desc = [&](u32 tile, WgTile& d, WRows (&w)[1]) {
        d.m0 = (tile % mt) * NT;
        d.n0 = (tile / mt) * kWgRows;
        d.n_end = QMK_HIDDEN;
        d.which = 0;
        w[0] = wt;
    };
    const WgResidualOut epi{act};
    wg_phase<NT, 1, K>(pp, sk, phase, layer, reinterpret_cast<const char*>(a), a_cols * 2u,
                       mt * WT, smem, desc, epi);
}

template <int NT>
__device__ __forceinline__ void wg_gate_up_tiles(const PrefillParams& pp, u32 layer, u32 smem,
                                                 WgStreamK& sk) {
    const Params& p = pp.base;
    const WRows wg = wrows<gate_proj_t>(p.gate_proj, layer), wu = wrows<up_proj_t>(p.up_proj, layer);
    const WgGateUpOut epi{reinterpret_cast<u16*>(pp.hb)};
    constexpr u32 BNT = kWgRows / 2;
    constexpr u32 WT = (QMK_INTER + BNT - 1) / BNT;
    const u32 mt = (pp.n_tokens + NT - 1) / NT;
    auto desc = [&](u32 tile, WgTile& d, WRows (&w)[2]) {
        d.m0 = (tile % mt) * NT;
        d.n0 = (tile / mt) * BNT;
        d.n_end = QMK_INTER;
        d.which = 0;
        w[0] = wg;
        w[1] = wu;
    };
    wg_phase<NT, 2, (int)QMK_HIDDEN>(pp, sk, kPhasePfGateUp, layer,
                                     reinterpret_cast<const char*>(pp.xa), QMK_PF_XA_COLS * 2u,
                                     mt * WT, smem, desc, epi);
}

// Token-tile width of a wgmma phase with wt weight tiles over t tokens: 64
// for chunks that fit it, else 64 when its waves finish sooner
// (gemm_use_bm64's wave model; measured better at 512 tokens than 128-token
// tiles with a stream-K split).
__device__ __forceinline__ bool wg_use_nt64(u32 t, u32 wt) {
    return t <= 64 || gemm_use_bm64(t, wt, gridDim.x);
}
#endif  // QMK_WGMMA

template <int BM>
__device__ __forceinline__ void prefill_qkv_tiles(const PrefillParams& pp, u32 layer, u16* smem) {
    const QkvLayer L(pp.base, layer);
    float* qkv = reinterpret_cast<float*>(pp.qkv);  // [T, Q + 2 KV] f32
    using Tiling = QkvTiling<kGemmBN>;
    const u32 mt = (pp.n_tokens + BM - 1) / BM;
    for (u32 tile = blockIdx.x; tile < mt * Tiling::TILES; tile += gridDim.x) {
        const u32 m0 = (tile % mt) * BM;
        const QkvTile q = Tiling::tile(tile / mt);
        const WRows w[1] = {L.w(q.which)};
        gemm_tile<BM, 1, (int)QMK_HIDDEN>(
            reinterpret_cast<const char*>(pp.xa), QMK_PF_XA_COLS * 2u, pp.n_tokens, m0, w, q.n0,
            q.n_end, smem, [&](u32 t, u32 n, const float (&v0)[1], const float (&v1)[1]) {
                float* dst = qkv + (size_t)t * QMK_PF_QKV_COLS + q.col0 + n;
                dst[0] = v0[0] + L.bias(q.which, n);
                dst[1] = v1[0] + L.bias(q.which, n + 1);
            });
    }
}

__device__ __forceinline__ void prefill_qkv(const PrefillParams& pp, u32 layer, u16* smem,
                                            WgStreamK& sk) {
#if QMK_WGMMA
    if constexpr (kWgShapesOk) {
        if (!(pp.base.flags & kFlagPfMmaSync)) {
            if (wg_use_nt64(pp.n_tokens, QkvTiling<kWgRows>::TILES))
                wg_qkv_tiles<64>(pp, layer, wg_smem_base(smem), sk);
            else
                wg_qkv_tiles<128>(pp, layer, wg_smem_base(smem), sk);
            return;
        }
    }
#endif
    if (gemm_use_bm64(pp.n_tokens, QkvTiling<kGemmBN>::TILES, gridDim.x))
        prefill_qkv_tiles<64>(pp, layer, smem);
    else
        prefill_qkv_tiles<128>(pp, layer, smem);
}

// act += a . W^T for a [T, K] bf16 (pitch a_cols) and W [H, K].
template <int BM, class T, int K>
__device__ __forceinline__ void prefill_residual_tiles(const PrefillParams& pp,
                                                       const u64 (&chunks)[QMK_MAX_CHUNKS],
                                                       u32 layer, u64 a, u32 a_cols, u16* smem) {
    const WRows w[1] = {wrows<T>(chunks, layer)};
    float* act = reinterpret_cast<float*>(pp.act);  // [T, H] f32
    constexpr u32 NT = (QMK_HIDDEN + kGemmBN - 1) / kGemmBN;
    const u32 mt = (pp.n_tokens + BM - 1) / BM;
    for (u32 tile = blockIdx.x; tile < mt * NT; tile += gridDim.x) {
        const u32 m0 = (tile % mt) * BM, n0 = (tile / mt) * kGemmBN;
        gemm_tile<BM, 1, K>(reinterpret_cast<const char*>(a), a_cols * 2u, pp.n_tokens, m0, w, n0,
                            QMK_HIDDEN, smem,
                            [&](u32 t, u32 n, const float (&v0)[1], const float (&v1)[1]) {
                                float* dst = act + (size_t)t * QMK_HIDDEN + n;
                                dst[0] = dst[0] + v0[0];
                                dst[1] = dst[1] + v1[0];
                            });
    }
}

template <class T, int K>
__device__ __forceinline__ void prefill_residual_gemm(const PrefillParams& pp,
                                                      const u64 (&chunks)[QMK_MAX_CHUNKS],
                                                      u32 layer, u64 a, u32 a_cols, u16* smem,
                                                      WgStreamK& sk, u32 phase) {
#if QMK_WGMMA
    if constexpr (kWgShapesOk) {
        if (!(pp.base.flags & kFlagPfMmaSync)) {
            constexpr u32 WT = (QMK_HIDDEN + kWgRows - 1) / kWgRows;
            if (wg_use_nt64(pp.n_tokens, WT))
                wg_residual_tiles<64, T, K>(pp, chunks, layer, a, a_cols, wg_smem_base(smem), sk,
                                            phase);
            else
                wg_residual_tiles<128, T, K>(pp, chunks, layer, a, a_cols, wg_smem_base(smem), sk,
                                             phase);
            return;
        }
    }
#else
    (void)sk;
    (void)phase;
#endif
    constexpr u32 NT = (QMK_HIDDEN + kGemmBN - 1) / kGemmBN;
    if (gemm_use_bm64(pp.n_tokens, NT, gridDim.x))
        prefill_residual_tiles<64, T, K>(pp, chunks, layer, a, a_cols, smem);
    else
        prefill_residual_tiles<128, T, K>(pp, chunks, layer, a, a_cols, smem);
}

// Tiles of 64 columns of gate and the same 64 of up (one X tile, 128 B rows).
template <int BM>
__device__ __forceinline__ void prefill_gate_up_tiles(const PrefillParams& pp, u32 layer, u16* smem) {
    const Params& p = pp.base;
    const WRows w[2] = {wrows<gate_proj_t>(p.gate_proj, layer), wrows<up_proj_t>(p.up_proj, layer)};
    char* hb = reinterpret_cast<char*>(pp.hb);  // [T, I] bf16
    constexpr u32 BNT = kGemmBN / 2;
    constexpr u32 NT = (QMK_INTER + BNT - 1) / BNT;
    const u32 mt = (pp.n_tokens + BM - 1) / BM;
    for (u32 tile = blockIdx.x; tile < mt * NT; tile += gridDim.x) {
        const u32 m0 = (tile % mt) * BM, n0 = (tile / mt) * BNT;
        gemm_tile<BM, 2, (int)QMK_HIDDEN>(
            reinterpret_cast<const char*>(pp.xa), QMK_PF_XA_COLS * 2u, pp.n_tokens, m0, w, n0,
            QMK_INTER, smem, [&](u32 t, u32 n, const float (&v0)[2], const float (&v1)[2]) {
                *reinterpret_cast<u32*>(hb + ((size_t)t * QMK_INTER + n) * 2) =
                    pack_bf16x2(silu(v0[0]) * v0[1], silu(v1[0]) * v1[1]);
            });
    }
}

__device__ __forceinline__ void prefill_gate_up(const PrefillParams& pp, u32 layer, u16* smem,
                                                WgStreamK& sk) {
#if QMK_WGMMA
    if constexpr (kWgShapesOk) {
        if (!(pp.base.flags & kFlagPfMmaSync)) {
            constexpr u32 WT = (QMK_INTER + kWgRows / 2 - 1) / (kWgRows / 2);
            if (wg_use_nt64(pp.n_tokens, WT))
                wg_gate_up_tiles<64>(pp, layer, wg_smem_base(smem), sk);
            else
                wg_gate_up_tiles<128>(pp, layer, wg_smem_base(smem), sk);
            return;
        }
    }
#else
    (void)sk;
#endif
    constexpr u32 NT = (QMK_INTER + kGemmBN / 2 - 1) / (kGemmBN / 2);
    if (gemm_use_bm64(pp.n_tokens, NT, gridDim.x))
        prefill_gate_up_tiles<64>(pp, layer, smem);
    else
        prefill_gate_up_tiles<128>(pp, layer, smem);
}

}  // namespace qmk
