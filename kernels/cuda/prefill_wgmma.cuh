// prefill_wgmma.cuh: the prefill GEMM on Hopper's warpgroup tensor cores
// (wgmma, sm_90a only; other archs, kFlagPfMmaSync and a launch without
// tensor maps use gemm_tile in prefill_gemm.cuh). Same product, Y[T, N] =
// X[T, K] . W[N, K]^T, computed transposed: Y^T = W . X^T, so that the
// weight rows fill wgmma's fixed 64-row M side and the tokens its variable
// N side (8..256). A 17-token prompt then wastes nothing on padding rows of
// the weight stream, and a 2,048-token one uses the same tiles as any other
// shape.
//
// CTA tile: 256 weight rows (4 warpgroups x 64, each its own rows) x NT
// tokens (NT = 128 or 64, chosen per phase), K step 64 = one 128-byte row,
// which is exactly one 128-byte swizzle atom: both operands are stored
// K-major in shared memory, 16-byte chunk c of row r at chunk c ^ (r % 8)
// (the SWIZZLE_128B pattern that wgmma reads and TMA writes).
//
// Loads (v4): the tensor memory accelerator. Thread 0 issues, per K step,
// one TMA box of NT token rows and two of 128 weight rows (tensor maps
// built by the host, PrefillParams::tmaps; rows past a tensor's end read
// as zero), completing on the stage's `full` mbarrier; each warp releases
// a stage on its `empty` mbarrier once its wgmma reads have retired, and
// thread 0 waits for that before refilling it. kWgStages stages, loads
// kWgStages - 2 steps ahead (one wgmma batch stays in flight). No thread
// computes a load address: the v3 cp.async loaders spilled.
//
// Multicast (launch with 2-CTA clusters): the two CTAs of a cluster take
// token tiles 2u and 2u + 1 of the same weight tile; each loads one
// 128-row half of the weights and multicasts it into both CTAs' shared
// memory, so each CTA reads 2/3 of the bytes per K step from L2 (16 KB of
// weights + 16 KB of tokens instead of 32 + 16). The GEMM phases behave as
// bound by L2 -> SM bandwidth (NOTES, prefill v3.1). A CTA's `empty`
// barrier then also counts its partner's warps: a half is rewritten only
// when both CTAs are done with it.
//
// NB = 2 (gate and up): weight rows 0..127 of the tile are gate columns
// n0.., rows 128..255 up columns n0..: warpgroup w (gate) and w + 2 (up)
// hold gate and up of the same elements, and trade half of their
// accumulators through shared memory (gate of the second half of the
// tokens one way, up of the first half the other), so each computes half
// of the outputs. The exchange uses the stages of the tile's last two K
// steps, released only after it (the cluster partner may already be
// refilling the others).
//
// Pipeline state lives in shared memory, not registers: it persists
// through every phase of the launch, and the attention and the
// accumulators need the registers.
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
constexpr u32 kWgHalfRows = 128;  // weight rows per TMA box (one per cluster rank)
constexpr u32 kWgTokMax = 128;    // tokens per CTA tile, largest NT
constexpr u32 kWgStages = 4;
constexpr u32 kWgStageBytes = (kWgRows + kWgTokMax) * 128u;  // 48 KB
// Dynamic shared memory of the wgmma GEMM: its stages plus 1 KB to align
// the base to the 1,024-byte swizzle period. Host twin:
// qmk_kernels::prefill_smem_bytes_wgmma.
constexpr u32 wg_smem_bytes() { return kWgStages * kWgStageBytes + 1024u; }
// One warpgroup pair's gate/up exchange: half of each one's accumulators.
static_assert(2u * (kWgTokMax / 4u) * 128u * 4u <= kWgStageBytes, "a pair's exchange fits a stage");

// The tensor maps (PrefillParams::tmaps, host: qmk_kernels::tma): per layer
// q, k, v, o, gate, up, down (box 64 x 128 rows), then the activations.
constexpr u32 kTmKinds = 7;
constexpr u32 kTmQ = 0, kTmO = 3, kTmGate = 4, kTmUp = 5, kTmDown = 6;
constexpr u32 kTmXa64 = 0, kTmXa128 = 1, kTmHb64 = 2, kTmHb128 = 3;  // + 7 L
constexpr u32 kTmBytes = 128;

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


// --- mbarriers, TMA, clusters (PTX ISA 8.0, sm_90) ---
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0u;
}
// Waits for the phase of parity `parity` of `bar`, bounded like the grid
// barrier (timeout, host abort, another CTA's error: it then returns and
// the phase computes garbage that the failed launch never reports).
__device__ __forceinline__ void mbar_wait(const Params& p, u32 bar, u32 parity) {
    u32 it = 0;
    u64 t0 = 0;
    while (!mbar_try_wait(bar, parity)) {
        if ((++it & 15u) == 0u) {
            const u64 now = globaltimer_ns();
            if (t0 == 0) t0 = now;
            const volatile HostStatus* st = reinterpret_cast<const volatile HostStatus*>(p.status);
            SyncState* s = reinterpret_cast<SyncState*>(p.sync);
            if (st->abort != 0u || *reinterpret_cast<volatile u32*>(&s->error_claim) != 0u ||
                now - t0 > p.spin_timeout_ns) {
                if (now - t0 > p.spin_timeout_ns) record_error(p, kErrBarrierTimeout, kPhaseStart, 0);
                return;
            }
        }
    }
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar, u32 count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on the barrier at the same offset in cluster CTA `peer`.
__device__ __forceinline__ void mbar_arrive_peer(u32 bar, u32 peer) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(peer)
        : "memory");
}
// Box {x (K element), y (row)} of tensor map `tm` into this CTA's shared
// memory at `dst`, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load(u32 dst, const char* tm, u32 bar, u32 x, u32 y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(tm), "r"(bar), "r"(x), "r"(y)
        : "memory");
}
// The same box into both CTAs of the cluster (same shared offsets, each
// completing on its own `bar`).
__device__ __forceinline__ void tma_load_pair(u32 dst, const char* tm, u32 bar, u32 x, u32 y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
        "l"(tm), "r"(bar), "r"(x), "r"(y), "h"((unsigned short)3)
        : "memory");
}
__device__ __forceinline__ u32 cluster_nctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of both CTAs; orders their earlier memory accesses
// (shared::cluster included) before the other's later ones.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}

// The pipeline's state (see the header): full[kWgStages] then
// empty[kWgStages] mbarriers; bit s of qmk_wg_fpar: parity of the next
// full[s] phase (saved between phases); of qmk_wg_epar: the parity thread 0
// waits for on empty[s] before refilling it (thread 0 only).
__shared__ __align__(8) u64 qmk_wg_bars[2 * kWgStages];
__shared__ u32 qmk_wg_fpar, qmk_wg_epar;
// Thread 0's producer: the tile it is loading (maps, rows, K steps k..kend)
// and its own copy of the phase's work iterator, which runs ahead of the
// consumers' by up to one tile, so a tile's first stages load during the
// previous tile's last steps and epilogue (thread 0 alone writes and reads
// this: kept out of every thread's registers).
struct WgProd {
    const char* tm0;
    const char* tm1;
    u32 r0, r1, m0, k, kend;
    u32 dp, it;  // work iterator (WgWork)
    u32 count;   // K steps issued in this phase
};
__shared__ WgProd qmk_wg_prod;

__device__ __forceinline__ u32 wg_full(u32 s) { return smem_u32(&qmk_wg_bars[s]); }
__device__ __forceinline__ u32 wg_empty(u32 s) { return smem_u32(&qmk_wg_bars[kWgStages + s]); }

// The dynamic shared memory (the kernel's qmk_dyn_smem: every extern
// shared array starts there), named here so that its address folds to a
// constant instead of living in a register through the mainloop.
extern __shared__ __align__(16) unsigned char qmk_wg_dyn[];
// The 1,024-byte-aligned start of the wgmma stages inside the dynamic smem
// (the swizzle period; TMA's SWIZZLE_128B boxes need it).
__device__ __forceinline__ char* wg_smem_base(void*) {
    const u32 s = smem_u32(qmk_wg_dyn);
    return reinterpret_cast<char*>(qmk_wg_dyn) + (((s + 1023u) & ~1023u) - s);
}

// Kernel start, every CTA (before its first grid barrier): the mbarriers
// (full: thread 0's arrival + the bytes; empty: 16 warps x 2, one arrival
// from each warp of both CTAs of a pair, or two from each local warp).
__device__ __forceinline__ void wg_pipe_init() {
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < kWgStages; ++s) {
            mbar_init(wg_full(s), 1u);
            mbar_init(wg_empty(s), 2u * QMK_WARPS);
        }
        qmk_wg_fpar = 0;
        qmk_wg_epar = (1u << kWgStages) - 1u;  // a fresh barrier passes parity 1
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if (cluster_nctarank() > 1) cluster_sync();
    else __syncthreads();
}

// One phase's view of the pipeline: the stage of the next K step (0 at
// each phase start), the full parities, and whether this CTA shares its
// weight loads with its cluster partner (mc, rank).
struct WgPipe {
    u32 stage, cons, fpar, rank;  // cons: K steps consumed in this phase
    bool mc;
};

// One tile: token rows m0.., weight columns n0.. (n < n_end valid), which
// tensor group (q / k / v) for the qkv epilogue, and its weights as two
// 128-row boxes (map tm0 at row r0, map tm1 at row r1; NB = 1: the same
// map at n0 and n0 + 128; NB = 2: gate and up at n0).
struct WgTile {
    u32 m0, n0, n_end, which;
    const char* tm0;
    const char* tm1;
    u32 r0, r1;
};

// This warp is done with stage s (its wgmma reads have retired): one
// arrival on empty[s] here and one in the partner (multicast: the
// partner's producer writes this stage too), or two here.
__device__ __forceinline__ void wg_release(const WgPipe& pp, u32 s) {
    if ((threadIdx.x & 31u) == 0u) {
        if (pp.mc) {
            mbar_arrive(wg_empty(s), 1u);
            mbar_arrive_peer(wg_empty(s), pp.rank ^ 1u);
        } else {
            mbar_arrive(wg_empty(s), 2u);
        }
    }
}

// Releases the stages a DEFER mainloop kept (its last one or two K steps),
// after this thread's generic accesses of them (the exchange): the TMA
// refills them through the async proxy.
__device__ __forceinline__ void wg_release_kept(const WgPipe& pp, u32 n) {
    fence_proxy_async();
    __syncwarp();
    wg_release(pp, (pp.stage + kWgStages - 1u) % kWgStages);
    if (n >= 2u) wg_release(pp, (pp.stage + kWgStages - 2u) % kWgStages);
}

// Mainloop of one tile: its n K steps, the phase's steps pp.stage.. in
// pipeline order; acc (zeroed here) = W[n0.., kb..ke] . X[m0.., kb..ke]^T.
// produce(upto): thread 0 issues the phase's loads up to step `upto`
// (exclusive), kWgStages - 2 steps ahead of the one consumed, across tile
// boundaries. pp.mc: this CTA and its cluster partner run the same steps
// of tiles that share the weights, each loading one half for both. DEFER:
// the stages of the last two steps stay held (wg_release_kept).
template <int NT, bool DEFER, class Produce>
__device__ __forceinline__ void wg_mainloop(const Params& p, WgPipe& pp, u32 smem, u32 n,
                                            float (&acc)[NT / 2], Produce& produce) {
    static_assert(NT == 64 || NT == 128, "NT is 64 or 128");
    static_assert(QMK_THREADS == 512, "the wgmma tile assumes 4 warpgroups");
    constexpr u32 AHEAD = kWgStages - 2;  // steps loaded ahead
    constexpr int R = NT / 2;             // accumulators per thread
    const u32 stage0 = pp.stage;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    constexpr u32 b_off = kWgRows * 128u;
#pragma unroll 1
    for (u32 i = 0; i < n; ++i) {
        // The stage of step i + AHEAD last held step i - 2, released in
        // iteration i - 1: this wait rarely stalls.
        if (threadIdx.x == 0) produce(pp.cons + i + AHEAD + 1u);
        const u32 s = (stage0 + i) % kWgStages;
        mbar_wait(p, wg_full(s), (pp.fpar >> s) & 1u);
        pp.fpar ^= 1u << s;
        const u32 st = smem + s * kWgStageBytes;
        // The warpgroup's A rows, recomputed each step from %tid (volatile:
        // not hoisted), else ptxas keeps smem + a_off in a spilled register
        // whose reload sits between the full wait and the wgmma issue.
        u32 tx;
        asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tx));
        const u64 da = wg_desc(st + (tx >> 7) * 64u * 128u), db = wg_desc(st + b_off);
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
        // Step i - 1's batch has retired: its stage may be refilled.
        if (i > 0 && (!DEFER || i + 1u < n)) wg_release(pp, (s + kWgStages - 1u) % kWgStages);
    }
    wg_wait<0>();
    wg_fence_acc(acc);
    pp.stage = (stage0 + n) % kWgStages;
    pp.cons += n;
    if (!DEFER && n > 0) wg_release(pp, (pp.stage + kWgStages - 1u) % kWgStages);
}

// Hands a tile's accumulators to epi(tile, t, n, v[1]): one output element,
// every valid (t, n) exactly once.
template <int NT, class Epi>
__device__ __forceinline__ void wg_epilogue(const float (&acc)[NT / 2], u32 t_end, const WgTile& d,
                                            Epi& epi) {
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const u32 q = warp & 3u, g = lane >> 2, cc = lane & 3u;
    const u32 row = wg * 64u + q * 16u + g;  // A row of acc[4j], acc[4j + 1]
#pragma unroll
    for (u32 j = 0; j < (u32)NT / 8; ++j) {
#pragma unroll
        for (u32 e = 0; e < 2; ++e) {
            const u32 t = d.m0 + j * 8u + 2u * cc + e;
            if (t >= t_end) continue;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 n = d.n0 + row + 8u * h;
                if (n < d.n_end) {
                    const float v[1] = {acc[4 * j + 2 * h + e]};
                    epi(d, t, n, v);
                }
            }
        }
    }
}

// The gate/up epilogue (NB = 2): epi(tile, t, n, {gate, up}) for every
// valid element. Warpgroups w (gate) and w + 2 (up) trade half of their
// accumulators through `xp` (the pair's [2][R / 2][128] f32 area: gate of
// the second token half, up of the first): the gate warpgroup then finishes
// the first half of the tokens, the up one the second. serial: both pairs
// share one area, one pair at a time. Every thread of the CTA calls this.
template <int NT, class Epi>
__device__ __forceinline__ void wg_epilogue_gate_up(const float (&acc)[NT / 2], u32 t_end,
                                                    const WgTile& d, float* xp, bool serial,
                                                    Epi& epi) {
    constexpr u32 R = (u32)NT / 2, H = R / 2, J = (u32)NT / 16;  // J: 8-token blocks per half
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const u32 q = warp & 3u, g = lane >> 2, cc = lane & 3u, lt = tid & 127u;
    const u32 pair = wg & 1u;
    const bool up = wg >= 2u;
    const u32 row = pair * 64u + q * 16u + g;  // gate / up column of acc[4j]
    float* xg = xp;            // [H][128] gate, tokens of blocks J..2J-1
    float* xu = xp + H * 128u;  // [H][128] up, tokens of blocks 0..J-1
#pragma unroll 1
    for (u32 r = 0; r < (serial ? 2u : 1u); ++r) {
        const bool mine = !serial || pair == r;
        if (mine) {
            if (!up) {
#pragma unroll
                for (u32 i = 0; i < H; ++i) xg[i * 128u + lt] = acc[H + i];
            } else {
#pragma unroll
                for (u32 i = 0; i < H; ++i) xu[i * 128u + lt] = acc[i];
            }
        }
        __syncthreads();
        if (mine) {
            if (!up) {
#pragma unroll
                for (u32 j = 0; j < J; ++j) {
#pragma unroll
                    for (u32 e = 0; e < 2; ++e) {
                        const u32 t = d.m0 + j * 8u + 2u * cc + e;
                        if (t >= t_end) continue;
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 n = d.n0 + row + 8u * h, i = 4u * j + 2u * h + e;
                            if (n < d.n_end) {
                                const float v[2] = {acc[i], xu[i * 128u + lt]};
                                epi(d, t, n, v);
                            }
                        }
                    }
                }
            } else {
#pragma unroll
                for (u32 j = J; j < 2u * J; ++j) {
#pragma unroll
                    for (u32 e = 0; e < 2; ++e) {
                        const u32 t = d.m0 + j * 8u + 2u * cc + e;
                        if (t >= t_end) continue;
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 n = d.n0 + row + 8u * h, i = 4u * j + 2u * h + e;
                            if (n < d.n_end) {
                                const float v[2] = {xg[(i - H) * 128u + lt], acc[i]};
                                epi(d, t, n, v);
                            }
                        }
                    }
                }
            }
        }
        if (serial) __syncthreads();
    }
}

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
// Measured on the H200 (NOTES, prefill v3.1; the bound is inferred from
// these experiments): the GEMM phases behave as bound by L2 -> SM
// bandwidth, so a short last wave runs faster per tile and costs less than
// its tile count suggests, and every split adds partial traffic.
// Spreading the last two waves of 7B down and o_proj over the grid
// (stream-K ranges start at different K steps, so CTAs sharing a tile's
// rows no longer read them together) lost 5.3-6.6 ms; cutting a last wave of
// 92 tiles into K-aligned quarters (3 rounds instead of one wave) gained
// nothing; the v3 tail split of every phase lost ~1 ms.
// kFlagPfNoStreamK: all data-parallel; kFlagPfSkSmallOnly: only the first
// case splits (the v3 policy).
__device__ __forceinline__ u32 wg_dp_tiles(u32 tiles, u32 G, u32 flags) {
    if (flags & kFlagPfNoStreamK) return tiles;
    if (2 * tiles < G) return 0;
    const u32 tail = tiles % G;
    if ((flags & kFlagPfSkSmallOnly) || 2 * tail >= G) return tiles;
    return tiles - tail;
}

// One GEMM phase over `wt` weight tiles x the chunk's token tiles
// (desc(w, d) describes weight tile w; column-major order, token tile
// fastest). Work units: a CTA, or with multicast (a 2-CTA cluster launch,
// at least two token tiles, no kFlagPfNoMulticast) a cluster, whose rank-r
// CTA takes token tile 2u + r (a tile past the chunk computes zeros and
// writes nothing). Units run the data-parallel head (wg_dp_tiles; unit b
// takes tiles b, b + U, ...), then stream-K: the other tiles' K steps laid
// end to end and cut into equal ranges, one per unit (at most U ranges,
// each at least kWgMinSplitSteps of a tile's K steps), so a phase of few
// tiles, or a last wave of few, still uses every SM. A range covers the
// tail of at most one tile (a partial, computed first and published
// through the scratch, one per CTA), then heads of tiles: the unit that
// computes a tile's K step 0 adds the later ranges' partials in unit order
// (deterministic: the same bits every run, both backends) and runs the
// epilogue. No unit waits for work its waited-on unit does after its own
// wait, so there is no cycle.
// One mainloop and one epilogue call site (NVRTC compile time).
template <int NT, int NB, int K, class Desc, class Epi>
__device__ __forceinline__ void wg_phase(const PrefillParams& pp, WgStreamK& sk, u32 phase,
                                         u32 layer, const char* am, u32 wt, char* base, Desc desc,
                                         Epi epi) {
    static_assert(K % kWgBK == 0, "K must be whole stages");
    constexpr u32 KT = (u32)K / kWgBK;
    constexpr int R = NT / 2;
    constexpr u32 TILE = kWgRows * kWgTokMax;  // floats per partial slot
    constexpr u32 TX = kWgRows * 128u + (u32)NT * 128u;  // bytes per stage
    constexpr bool GU = NB == 2;
    const Params& p = pp.base;
    const u32 t_end = pp.n_tokens, tid = threadIdx.x;
    const u32 mt = (t_end + NT - 1) / NT;
    WgPipe pipe;
    pipe.stage = 0;
    pipe.cons = 0;
    pipe.fpar = qmk_wg_fpar;
    pipe.rank = cluster_ctarank();
    pipe.mc = cluster_nctarank() == 2u && mt >= 2u && !(p.flags & kFlagPfNoMulticast);
    const u32 per = pipe.mc ? 2u : 1u, sub = pipe.mc ? pipe.rank : 0u;
    const u32 U = gridDim.x / per, u = blockIdx.x / per;
    const u32 mu = (mt + per - 1) / per;  // token units per weight tile
    const u32 tiles = wt * mu;
    sk.seq += 1;
    const u64 epoch = ((u64)sk.nonce << 32) | sk.seq;
    const u32 full = wg_dp_tiles(tiles, U, p.flags);
    const u32 rem = tiles - full;
    constexpr u32 max_split = KT / kWgMinSplitSteps > 1 ? KT / kWgMinSplitSteps : 1;
    const u32 gsk = min(U, rem * max_split);  // units sharing the stream-K tiles
    const u32 iters = rem * KT;
    auto range_start = [&](u32 b) { return (u32)((u64)iters * b / gsk); };
    u32 it0 = 0, e = 0;
    if (u < gsk) {
        it0 = range_start(u);
        e = range_start(u + 1);
    }
    // The unit's work, in order: data-parallel tiles dp, dp + U, ..., then
    // stream-K pieces of [it, e). Walked by the consumers and, ahead of
    // them, by thread 0's producer.
    auto next = [&](u32& dp, u32& it, u32& tile, u32& kb, u32& ke) -> bool {
        if (dp < full) {
            tile = dp;
            kb = 0;
            ke = KT;
            dp += U;
            return true;
        }
        if (it < e) {
            tile = full + it / KT;
            kb = it % KT;
            ke = min(KT, kb + (e - it));
            it += ke - kb;
            return true;
        }
        return false;
    };
    auto describe = [&](u32 tile, WgTile& d) {
        desc(tile / mu, d);
        d.m0 = ((tile % mu) * per + sub) * NT;
    };
    const u32 smem = smem_u32(base);
    // Thread 0: issues the phase's K steps up to `upto` (exclusive), each
    // once every warp (of both CTAs) has released its stage's previous step.
    auto produce = [&](u32 upto) {
        volatile WgProd& w = qmk_wg_prod;
        while (w.count < upto) {
            if (w.k == w.kend) {
                u32 dp = w.dp, it = w.it, tile, kb, ke;
                if (!next(dp, it, tile, kb, ke)) return;
                WgTile d;
                describe(tile, d);
                w.dp = dp;
                w.it = it;
                w.tm0 = d.tm0;
                w.tm1 = d.tm1;
                w.r0 = d.r0;
                w.r1 = d.r1;
                w.m0 = d.m0;
                w.k = kb;
                w.kend = ke;
            }
            const u32 c = w.count, s = c % kWgStages;
            const u32 ep = qmk_wg_epar;
            mbar_wait(p, wg_empty(s), (ep >> s) & 1u);
            qmk_wg_epar = ep ^ (1u << s);
            mbar_arrive_expect_tx(wg_full(s), TX);
            const u32 st = smem + s * kWgStageBytes;
            const u32 x = w.k * kWgBK;
            tma_load(st + kWgRows * 128u, am, wg_full(s), x, w.m0);
            if (pipe.mc) {
                const bool hi = pipe.rank != 0u;
                tma_load_pair(st + (hi ? kWgHalfRows * 128u : 0u), hi ? w.tm1 : w.tm0, wg_full(s), x,
                              hi ? w.r1 : w.r0);
            } else {
                tma_load(st, w.tm0, wg_full(s), x, w.r0);
                tma_load(st + kWgHalfRows * 128u, w.tm1, wg_full(s), x, w.r1);
            }
            w.k = w.k + 1u;
            w.count = c + 1u;
        }
    };
    if (tid == 0) {
        volatile WgProd& w = qmk_wg_prod;
        w.dp = u;
        w.it = it0;
        w.k = w.kend = 0;
        w.count = 0;
    }
    // The last phase's generic shared-memory accesses (attention, norms, the
    // gate/up exchange) before this phase's TMA writes, in both CTAs of a
    // pair.
    fence_proxy_async();
    if (pipe.mc) cluster_sync();
    else __syncthreads();
    float acc[R];
    u32 dp = u, it = it0;
    for (;;) {
        u32 tile, kb, ke;
        if (!next(dp, it, tile, kb, ke)) break;
        WgTile d;
        describe(tile, d);
        const u32 n = ke - kb;
        wg_mainloop<NT, GU>(p, pipe, smem, n, acc, produce);
        if (kb != 0) {
            // The tail of a tile: publish the partial for its owner.
            if constexpr (GU) wg_release_kept(pipe, n);
            float* mine = sk.part + (size_t)blockIdx.x * TILE;
#pragma unroll
            for (int i = 0; i < R; ++i) mine[(u32)i * QMK_THREADS + tid] = acc[i];
            __syncthreads();
            if (tid == 0) st_release_u64(&sk.flags[blockIdx.x], epoch);
            continue;
        }
        if (ke < KT) {
            // The owner of a split tile: the later ranges' partials, in unit
            // order (an empty range has none), each from the CTA of the same
            // rank.
            const u32 tile_end = (tile - full + 1) * KT;
            for (u32 b = u + 1; b < gsk; ++b) {
                const u32 bs = range_start(b);
                if (bs >= tile_end) break;
                if (range_start(b + 1) == bs) continue;
                const u32 cta = b * per + sub;
                if (tid == 0) wg_wait_flag(p, &sk.flags[cta], epoch, phase, layer);
                __syncthreads();
                const float* theirs = sk.part + (size_t)cta * TILE;
#pragma unroll
                for (int i = 0; i < R; ++i) acc[i] += __ldcg(theirs + (u32)i * QMK_THREADS + tid);
            }
        }
        if constexpr (GU) {
            // The exchange in the stages of the last two K steps (one pair
            // each), or of the only one (both pairs in turn).
            const u32 wgp = (tid >> 7) & 1u;
            const u32 s = (pipe.stage + kWgStages - 1u - (n >= 2u ? wgp : 0u)) % kWgStages;
            wg_epilogue_gate_up<NT>(acc, t_end, d,
                                    reinterpret_cast<float*>(base + s * kWgStageBytes), n < 2u, epi);
            wg_release_kept(pipe, n);
        } else {
            wg_epilogue<NT>(acc, t_end, d, epi);
        }
    }
    if (tid == 0) qmk_wg_fpar = pipe.fpar;
    // The partner's last arrivals on this CTA's barriers have landed before
    // either CTA goes on (or exits).
    if (pipe.mc) cluster_sync();
}

#endif  // QMK_WGMMA

}  // namespace qmk
