// prefill/wgmma.cuh: the prefill GEMM on Hopper's warpgroup tensor cores
// (wgmma, sm_90a only; other archs and kFlagPfMmaSync use gemm_tile in
// prefill/gemm.cuh). Same product, Y[T, N] = X[T, K] . W[N, K]^T, computed
// transposed: Y^T = W . X^T, so that the weight rows fill wgmma's fixed
// 64-row M side and the tokens its variable N side (8..256). A 17-token
// prompt then wastes nothing on padding rows of the weight stream, and a
// 2,048-token one uses the same tiles as any other shape.
//
// CTA tile: 256 weight rows (4 warpgroups x 64, each its own rows) x NT
// tokens (NT = 128 or 64, chosen per phase), K step 64 = one 128-byte row,
// which is exactly one 128-byte swizzle atom: both operands are stored
// K-major in shared memory, 16-byte chunk c of row r at chunk c ^ (r % 8)
// (the SWIZZLE_128B pattern wgmma reads; no bank conflicts for the cp.async
// writes either). kWgStages shared-memory stages; loads run kWgStages - 2
// stages ahead, so one batch of wgmma stays in flight (wait_group 1) while
// the next is issued, and a stage is refilled only after every warpgroup's
// reads of it have retired. Every thread loads (16-byte cp.async.cg,
// zero-fill past the valid rows); cp.async writes through the generic proxy,
// so each thread fences to the async proxy before the barrier that hands
// the stage to the tensor cores.
//
// NB = 2 (gate and up): A rows alternate in blocks of 8, gate rows n..n+7
// then up rows n..n+7, so a thread's two accumulator rows (g and g + 8) are
// gate and up of the same output column. A tile then covers 128 columns.
//
// Accumulator layout (PTX ISA, wgmma .m64nNk16 f32): warp q of the
// warpgroup owns rows 16q..16q+15; lane (g = lane / 4, c = lane % 4) holds
// d[4j + 0..1] = rows 16q + g, columns 8j + 2c + 0..1 and d[4j + 2..3] =
// row 16q + g + 8, same columns.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMK_WGMMA 1
#else
#define QMK_WGMMA 0
#endif

namespace qmk {

constexpr u32 kWgBK = 64;         // K per stage (bf16): one 128-byte row
constexpr u32 kWgRows = 256;      // weight rows per CTA tile (4 warpgroups x 64)
constexpr u32 kWgTokMax = 128;    // tokens per CTA tile, largest NT
constexpr u32 kWgStages = 4;
constexpr u32 kWgStageBytes = (kWgRows + kWgTokMax) * 128u;  // 48 KB
// Dynamic shared memory of the wgmma mainloop: its stages plus 1 KB to align
// the base to the 1,024-byte swizzle period. Host twin:
// qmk_kernels::prefill_smem_bytes_wgmma.
constexpr u32 wg_smem_bytes() { return kWgStages * kWgStageBytes + 1024u; }

// The K of every prefill GEMM must be whole stages for this path.
constexpr bool kWgShapesOk = QMK_HIDDEN % kWgBK == 0 && QMK_Q_DIM % kWgBK == 0 && QMK_INTER % kWgBK == 0;

// Stream-K scratch (PrefillParams::sk, host twin stream_k_bytes): one f32
// partial tile per CTA ([G][kWgRows x kWgTokMax], each thread's
// accumulators at [i x 512 + tid]: coalesced, and read back by the thread
// of the same index), then a u64 launch nonce and one u64 flag per CTA.
// A flag holds (nonce << 32 | phase sequence number) once its CTA's partial
// of that phase is written: no flag needs clearing, a value left by an
// earlier or aborted launch never matches (CTA 0 bumps the nonce after the
// launch's first grid barrier, when every CTA has read it).
static_assert(kWgRows * kWgTokMax == QMK_STREAM_K_TILE_ELEMS,
              "host and kernel disagree on the stream-K partial tile (host::stream_k_bytes)");
struct WgStreamK {
    float* part;
    u64* flags;
    u32 nonce;
    u32 seq;  // GEMM phases run so far in this launch
};

__device__ __forceinline__ u64* wg_sk_nonce(const PrefillParams& pp) {
    return reinterpret_cast<u64*>(pp.sk + (u64)gridDim.x * (kWgRows * kWgTokMax * 4u));
}

#if QMK_WGMMA

// Shared-memory matrix descriptor, K-major, SWIZZLE_128B: start address
// >> 4 (bits 0-13), leading offset unused for this layout (1), stride
// offset 1,024 B between 8-row groups (bits 32-45), layout 1 (bits 62-63).
__device__ __forceinline__ u64 wg_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the
// asynchronous wgmma window (CUTLASS's warpgroup_fence_operand).
template <int R>
__device__ __forceinline__ void wg_fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D[64 x 128] += A[64 x 16] . B[16 x 128] (f32 += bf16 . bf16), A and B
// K-major in shared memory (descriptors da, db).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

// D[64 x 64] += A[64 x 16] . B[16 x 64], as above.
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1));
}

// The 1,024-byte-aligned start of the wgmma stages inside the dynamic smem.
__device__ __forceinline__ u32 wg_smem_base(const void* dyn) {
    const u32 s = smem_u32(dyn);
    return (s + 1023u) & ~1023u;
}

// Weight-row slot r (0..255) of a tile -> (tensor, column): NB = 1 rows in
// order; NB = 2 blocks of 8 gate rows then the same 8 columns of up.
template <int NB>
__device__ __forceinline__ u32 wg_col(u32 n0, u32 r) {
    return NB == 1 ? n0 + r : n0 + (r >> 4) * 8u + (r & 7u);
}

// One CTA tile's description: token rows m0.., weight columns n0.. (n <
// n_end valid) of the phase's tensors, and which tensor group (q / k / v)
// for the qkv epilogue.
struct WgTile {
    u32 m0, n0, n_end, which;
};

// Mainloop of one tile over K steps [kb, ke) (K steps of kWgBK): acc (zeroed
// here) = W[n0.., kb..ke] . X[m0.., kb..ke]^T. a: X [T, K] bf16, row pitch
// lda_bytes; rows >= t_end and columns >= n_end read as zero; smem:
// wg_smem_base.
template <int NT, int NB, int K>
__device__ __forceinline__ void wg_mainloop(const char* a, u32 lda_bytes, u32 t_end, u32 m0,
                                            const WRows (&w)[NB], u32 n0, u32 n_end, u32 smem,
                                            u32 kb, u32 ke, float (&acc)[NT / 2]) {
    static_assert(NT == 64 || NT == 128, "NT is 64 or 128");
    static_assert(NB == 1 || NB == 2, "one or two weight tensors");
    static_assert(K % kWgBK == 0, "K must be whole stages");
    static_assert(QMK_THREADS == 512, "the wgmma tile assumes 4 warpgroups");
    constexpr u32 AHEAD = kWgStages - 2;          // stages loaded ahead
    constexpr u32 BPT = NT * 8u / QMK_THREADS;    // B chunks per thread: 2 or 1
    constexpr int R = NT / 2;                     // accumulators per thread

    const u32 tid = threadIdx.x, warp = tid >> 5, wg = warp >> 2;
    // Loader: thread tid copies 16-byte chunk c = tid % 8 of rows tid / 8 +
    // 64 i (A: i < 4, B: i < BPT); the swizzled chunk is the same for all of
    // them (row % 8 = (tid / 8) % 8).
    const u32 c = tid & 7u, r0 = tid >> 3;
    const u32 swz = ((c ^ (r0 & 7u)) * 16u) + r0 * 128u;
    const char* asrc[4];
    u32 aok[4], akmul[4];
#pragma unroll
    for (u32 i = 0; i < 4; ++i) {
        const u32 r = r0 + 64u * i;
        const u32 wt = NB == 1 ? 0u : ((r >> 3) & 1u);
        const u32 n = wg_col<NB>(n0, r);
        aok[i] = n < n_end ? 16u : 0u;
        const WRows& wr = w[NB == 1 ? 0 : (wt ? NB - 1 : 0)];
        asrc[i] = wr.piece(aok[i] ? n : n0, c * 16u);
        akmul[i] = wr.kmul;
    }
    const char* bsrc[BPT];
    u32 bok[BPT];
#pragma unroll
    for (u32 i = 0; i < BPT; ++i) {
        const u32 t = m0 + r0 + 64u * i;
        bok[i] = t < t_end ? 16u : 0u;
        bsrc[i] = a + (size_t)(bok[i] ? t : m0) * lda_bytes + c * 16u;
    }
    auto load_stage = [&](u32 kt, u32 s) {
        const u32 st = smem + s * kWgStageBytes + swz;
        const u32 ko = kt * kWgBK * 2u;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) cp_async16(st + i * 64u * 128u, asrc[i] + (size_t)ko * akmul[i], aok[i]);
#pragma unroll
        for (u32 i = 0; i < BPT; ++i)
            cp_async16(st + kWgRows * 128u + i * 64u * 128u, bsrc[i] + ko, bok[i]);
    };

#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;

    // The previous tile's wgmma reads are retired (wait_group 0 below) in
    // every warpgroup before the prologue overwrites its stages.
    __syncthreads();
#pragma unroll
    for (u32 s = 0; s < AHEAD; ++s) {
        if (kb + s < ke) load_stage(kb + s, s);
        cp_async_commit();
    }
    const u32 a_off = wg * 64u * 128u, b_off = kWgRows * 128u;
#pragma unroll 1
    for (u32 i = 0; kb + i < ke; ++i) {
        cp_async_wait<(int)AHEAD - 1>();
        fence_proxy_async();
        // Stage i is in every thread's view; the wgmma batches of i - 2 and
        // before have retired in every warpgroup (wait_group 1 at the end of
        // iteration i - 1), so their stage can be refilled.
        __syncthreads();
        if (kb + i + AHEAD < ke) load_stage(kb + i + AHEAD, (i + AHEAD) % kWgStages);
        cp_async_commit();
        const u32 st = smem + (i % kWgStages) * kWgStageBytes;
        const u64 da = wg_desc(st + a_off), db = wg_desc(st + b_off);
        wg_fence_acc(acc);
        wg_fence();
#pragma unroll
        for (u32 kk = 0; kk < kWgBK / 16; ++kk) {
            // +32 bytes per 16-element K step inside the swizzle atom (>> 4).
            if constexpr (NT == 128)
                wgmma_m64n128k16(acc, da + kk * 2u, db + kk * 2u);
            else
                wgmma_m64n64k16(acc, da + kk * 2u, db + kk * 2u);
        }
        wg_commit();
        wg_wait<1>();
        wg_fence_acc(acc);
    }
    wg_wait<0>();
    wg_fence_acc(acc);
    cp_async_wait<0>();
}

// Hands a tile's accumulators to a per-element epilogue functor (NB = 1),
// every valid (t, n) exactly once: epi.col(tile, n) once per column, then
// epi(tile, t, n, col, v) per element.
template <int NT, int NB, class Epi>
__device__ __forceinline__ void wg_epilogue(const float (&acc)[NT / 2], u32 t_end, const WgTile& d,
                                            Epi& epi) {
    static_assert(NB == 1, "the per-element epilogue serves one weight tensor");
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const u32 q = warp & 3u, g = lane >> 2, cc = lane & 3u;
    const u32 row = wg * 64u + q * 16u + g;  // A row of acc[4j], acc[4j + 1]
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 n = d.n0 + row + 8u * h;
        if (n >= d.n_end) continue;
        const float cv = epi.col(d, n);
#pragma unroll
        for (u32 j = 0; j < (u32)NT / 8; ++j) {
#pragma unroll
            for (u32 e = 0; e < 2; ++e) {
                const u32 t = d.m0 + j * 8u + 2u * cc + e;
                if (t < t_end) epi(d, t, n, cv, acc[4 * j + 2 * h + e]);
            }
        }
    }
}

// SiLU for the staged gate/up epilogue: fast exp and division (a few ulp;
// the IEEE division and expf are ~25 instructions per value, 32 values per
// thread per tile, while the tensor cores wait).
__device__ __forceinline__ float silu_fast(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// gate/up's output (NB = 2): hb[t, n] = silu(gate) * up, bf16. The epilogue
// stages the tile through the stage memory, free once every warpgroup's
// wgmma reads have retired: NT tokens x 128 columns, 256 B per token,
// 16-byte chunk c of token t at chunk c ^ (t % 16) (conflict-free: a warp's
// writes cover 4 tokens of one chunk), then each token's 256 bytes leave as
// 16 whole 16-byte stores. One 2-byte store per value (4 tokens per warp
// instruction) kept the tensor cores idle for most of the difference between
// the mainloop and the phase: 7B at 2,048 tokens took 62.3 ms with it and
// with a load-add-store residual, 59.4 ms with this and red.global.add.
template <int NT>
__device__ __forceinline__ void wg_epilogue_gate_up(const float (&acc)[NT / 2], u32 t_end,
                                                    const WgTile& d, u32 smem, u16* hb) {
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 g = lane >> 2, cc = lane & 3u;
    // Warp w (warpgroup w / 4, quarter w % 4) holds columns n0 + 8w + g
    // (wg_col<2>): chunk w of every token row.
    __syncthreads();  // every warpgroup's reads of the stages have retired
#pragma unroll
    for (u32 j = 0; j < (u32)NT / 8; ++j) {
#pragma unroll
        for (u32 e = 0; e < 2; ++e) {
            const u32 tok = j * 8u + 2u * cc + e;
            const u32 addr = smem + tok * 256u + ((warp ^ (tok & 15u)) << 4) + g * 2u;
            const u16 v = f32_to_bf16_rne(silu_fast(acc[4 * j + e]) * acc[4 * j + 2 + e]);
            asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
        }
    }
    __syncthreads();
#pragma unroll
    for (u32 k = 0; k < (u32)NT * 16u / QMK_THREADS; ++k) {
        const u32 idx = tid + k * QMK_THREADS, tok = idx >> 4, ch = idx & 15u;
        const u32 t = d.m0 + tok, n = d.n0 + ch * 8u;
        u32 x, y, z, w;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x), "=r"(y), "=r"(z), "=r"(w)
                     : "r"(smem + tok * 256u + ((ch ^ (tok & 15u)) << 4))
                     : "memory");
        if (t < t_end && n < d.n_end)
            *reinterpret_cast<uint4*>(hb + (size_t)t * QMK_INTER + n) = make_uint4(x, y, z, w);
    }
    // The next tile's mainloop starts with a __syncthreads before its loads
    // overwrite the stages; a phase's end is a grid barrier.
}

struct WgGateUpOut {
    u16* hb;  // [T, QMK_INTER] bf16 silu(gate) * up
    static constexpr bool whole_tile = true;
    template <int NT>
    __device__ __forceinline__ void tile(const float (&acc)[NT / 2], u32 t_end, const WgTile& d,
                                         u32 smem) const {
        wg_epilogue_gate_up<NT>(acc, t_end, d, smem, hb);
    }
};
static_assert(QMK_INTER % 8 == 0, "gate/up rows leave in 16-byte chunks");

// Thread 0 of a CTA: waits until `flag` holds `want` (bounded exactly like
// the grid barrier: timeout, host abort, or another CTA's error).
__device__ __forceinline__ void wg_wait_flag(const Params& p, const u64* flag, u64 want, u32 phase,
                                             u32 layer) {
    const volatile HostStatus* st = reinterpret_cast<const volatile HostStatus*>(p.status);
    SyncState* s = reinterpret_cast<SyncState*>(p.sync);
    u32 it = 0;
    u64 t0 = 0;
    while (ld_acquire_u64(flag) != want) {
        if ((++it & 127u) == 0u) {
            const u64 now = globaltimer_ns();
            if (t0 == 0) t0 = now;
            if (st->abort != 0u) {
                record_error(p, kErrAborted, phase, layer);
                return;
            }
            if (*reinterpret_cast<volatile u32*>(&s->error_claim) != 0u) return;
            if (now - t0 > p.spin_timeout_ns) {
                record_error(p, kErrBarrierTimeout, phase, layer);
                return;
            }
        }
    }
}

// Fewest K steps a stream-K range takes of one tile: below this the owner's
// reduction (a 128 KB partial per extra range) costs more than the split
// saves (0.5B q/k/v has 14 K steps: no split).
constexpr u32 kWgMinSplitSteps = 16;

// How many of a phase's `tiles` run data-parallel (the rest run stream-K):
//  - fewer tiles than half the grid: none (7B at 64 tokens: 14 down tiles
//    would leave 118 SMs idle);
//  - else every full wave, and a last wave of fewer than G / 2 tiles runs
//    stream-K (7B q/k/v at 512 tokens: 144 tiles = 1 wave + 12);
//  - a last wave of G / 2 tiles or more stays data-parallel.
// Measured on the H200 (the bound is inferred from these experiments): the
// GEMM phases behave as bound by L2 -> SM bandwidth, so a short last wave
// runs faster per tile and costs less than its tile count suggests, and
// every split adds partial traffic. Spreading the last two waves of 7B down
// and o_proj over the grid (stream-K ranges start at different K steps, so
// CTAs sharing a tile's rows no longer read them together) lost 5.3-6.6 ms;
// cutting a last wave of 92 tiles into K-aligned quarters (3 rounds instead
// of one wave) gained nothing; splitting the tail of every phase lost ~1 ms;
// keeping short last waves data-parallel (only the first case split) was
// 0.3 ms slower at 7B 512 tokens and 0.7 ms at 2,048
// (docs/decisions/0016-kernel-flags-removed.md).
// kFlagPfNoStreamK: all data-parallel (the stream-K test's oracle).
__device__ __forceinline__ u32 wg_dp_tiles(u32 tiles, u32 G, u32 flags) {
    if (flags & kFlagPfNoStreamK) return tiles;
    if (2 * tiles < G) return 0;
    const u32 tail = tiles % G;
    if (2 * tail >= G) return tiles;
    return tiles - tail;
}

// One GEMM phase of `tiles` tiles (desc(tile, d, w) describes tile i): the
// data-parallel head (wg_dp_tiles; CTA b takes tiles b, b + G, ...), then
// stream-K: the other tiles' K steps laid end to end and cut into equal
// ranges, one per CTA (at most G ranges, each at least kWgMinSplitSteps of
// a tile's K steps), so a phase of few tiles, or a last wave of few, still
// uses every SM. A range covers the tail of at most one tile (a partial,
// computed first and published through the scratch), then heads of tiles:
// the CTA that computes a tile's K step 0 adds the later ranges' partials
// in CTA order (deterministic: the same bits every run, both backends) and
// runs the epilogue. No CTA waits for work its waited-on CTA does after its
// own wait, so there is no cycle.
// One mainloop and one epilogue call site (NVRTC compile time).
template <int NT, int NB, int K, class Desc, class Epi>
__device__ __forceinline__ void wg_phase(const PrefillParams& pp, WgStreamK& sk, u32 phase,
                                         u32 layer, const char* a, u32 lda_bytes, u32 tiles,
                                         u32 smem, Desc desc, Epi epi) {
    constexpr u32 KT = (u32)K / kWgBK;
    constexpr int R = NT / 2;
    constexpr u32 TILE = kWgRows * kWgTokMax;  // floats per partial slot
    const u32 G = gridDim.x, t_end = pp.n_tokens, tid = threadIdx.x;
    sk.seq += 1;
    const u64 epoch = ((u64)sk.nonce << 32) | sk.seq;
    const u32 full = wg_dp_tiles(tiles, G, pp.base.flags);
    const u32 rem = tiles - full;
    constexpr u32 max_split = KT / kWgMinSplitSteps > 1 ? KT / kWgMinSplitSteps : 1;
    const u32 gsk = min(G, rem * max_split);  // CTAs sharing the stream-K tiles
    const u32 iters = rem * KT;
    auto range_start = [&](u32 b) { return (u32)((u64)iters * b / gsk); };
    u32 it = 0, e = 0;
    if (blockIdx.x < gsk) {
        it = range_start(blockIdx.x);
        e = range_start(blockIdx.x + 1);
    }
    u32 dp = blockIdx.x;  // next data-parallel tile
    float acc[R];
    for (;;) {
        u32 tile, kb, ke;
        if (dp < full) {
            tile = dp;
            kb = 0;
            ke = KT;
            dp += G;
        } else if (it < e) {
            const u32 r = it / KT;
            tile = full + r;
            kb = it % KT;
            ke = min(KT, kb + (e - it));
            it += ke - kb;
        } else {
            break;
        }
        WgTile d;
        WRows w[NB];
        desc(tile, d, w);
        wg_mainloop<NT, NB, K>(a, lda_bytes, t_end, d.m0, w, d.n0, d.n_end, smem, kb, ke, acc);
        if (kb != 0) {
            // The tail of a tile: publish the partial for its owner.
            float* mine = sk.part + (size_t)blockIdx.x * TILE;  // [R, 512] f32
#pragma unroll
            for (int i = 0; i < R; ++i) mine[(u32)i * QMK_THREADS + tid] = acc[i];
            __syncthreads();
            if (tid == 0) st_release_u64(&sk.flags[blockIdx.x], epoch);
            continue;
        }
        if (ke < KT) {
            // The owner of a split tile: the later ranges' partials, in CTA
            // order (an empty range has none).
            const u32 tile_end = (tile - full + 1) * KT;
            for (u32 b = blockIdx.x + 1; b < gsk; ++b) {
                const u32 bs = range_start(b);
                if (bs >= tile_end) break;
                if (range_start(b + 1) == bs) continue;
                if (tid == 0) wg_wait_flag(pp.base, &sk.flags[b], epoch, phase, layer);
                __syncthreads();
                const float* theirs = sk.part + (size_t)b * TILE;  // [R, 512] f32
#pragma unroll
                for (int i = 0; i < R; ++i) acc[i] += __ldcg(theirs + (u32)i * QMK_THREADS + tid);
            }
        }
        // Whole-tile epilogues (gate/up staged stores, q/k/v with the
        // rotary fused), else per element (the residual adds).
        if constexpr (Epi::whole_tile)
            epi.template tile<NT>(acc, t_end, d, smem);
        else
            wg_epilogue<NT, NB>(acc, t_end, d, epi);
    }
}

#endif  // QMK_WGMMA

}  // namespace qmk
