// core/barrier.cuh: the grid barrier and error reporting.
//
// A monotonically increasing arrival counter (never reset between launches):
// barrier k of a launch waits until arrived >= base + (k + 1) * gridDim.x,
// where `base` is what the previous launch left in SyncState::base. Every
// wait is bounded: it gives up when Params::spin_timeout_ns passes, when the
// host raises HostStatus::abort, or when another CTA has claimed an error.
//
// The decode step's barrier is traceable (kTraced): with kFlagTrace, thread
// 0 stamps the CTA's start, each arrival and each release into
// Params::trace (trace_slot). The prefill's is not, and compiles as if the
// trace did not exist.
//
// Thread 0 arrives with red.release.gpu after bar.sync and polls with
// ld.acquire.gpu (release/acquire through the CTA barrier are cumulative in
// the PTX memory model). A __threadfence before the arrival and after the
// poll orders the same writes and measured ~0.13 us slower per barrier on
// the H200 (docs/decisions/0016-kernel-flags-removed.md).
#pragma once

namespace qmk {

// First error wins; its details go to the host-visible status block. A
// tensor-parallel rank also marks itself failed in every peer's region, so
// the peers' exchange waits end at once instead of timing out.
__device__ __forceinline__ void record_error(const Params& p, u32 code, u32 phase, u32 layer) {
    SyncState* s = reinterpret_cast<SyncState*>(p.sync);
    if (atomicCAS(&s->error_claim, 0u, code) == 0u) {
        volatile HostStatus* st = reinterpret_cast<volatile HostStatus*>(p.status);
        st->phase = phase;
        st->layer = layer;
        st->cta = blockIdx.x;
        st->error = code;
#if QMK_TP_RANKS > 1
#pragma unroll
        for (u32 k = 0; k < QMK_TP_RANKS; ++k)
            st_release_sys_u32(reinterpret_cast<u32*>(p.tp_peer[k] + QMK_TP_FAILED_OFF) + p.tp_rank, code);
#endif
        __threadfence_system();
    }
}

// Slot `k` of this CTA's timeline ([B + 1][2] u64, Params::trace).
__device__ __forceinline__ u64* trace_slot(const Params& p, u32 k) {
    return reinterpret_cast<u64*>(p.trace) + ((u64)blockIdx.x * (QMK_BARRIERS_PER_STEP + 1u) + k) * 2u;
}

// This CTA's split-attention marks of `layer` (kAttnMarks u64 after the
// barrier slots of every CTA).
__device__ __forceinline__ u64* attn_marks(const Params& p, u32 layer) {
    return reinterpret_cast<u64*>(p.trace) + (u64)gridDim.x * (QMK_BARRIERS_PER_STEP + 1u) * 2u +
           ((u64)blockIdx.x * QMK_LAYERS + layer) * kAttnMarks;
}

// One thread waits until `ready()` holds, bounded as every spin-wait is:
// gives up (false) when Params::spin_timeout_ns passes (recording `timeout`
// at `phase`, `layer`), when the host raises abort, or when another CTA has
// claimed an error.
template <typename Ready>
__device__ __forceinline__ bool bounded_wait(const Params& p, Ready ready, u32 timeout, u32 phase, u32 layer) {
    const SyncState* s = reinterpret_cast<const SyncState*>(p.sync);
    const volatile HostStatus* st = reinterpret_cast<const volatile HostStatus*>(p.status);
    u32 it = 0;
    u64 t0 = 0;
    while (!ready()) {
        if ((++it & 127u) == 0u) {
            const u64 now = globaltimer_ns();
            if (t0 == 0) t0 = now;
            if (st->abort != 0u) {
                record_error(p, kErrAborted, phase, layer);
                return false;
            }
            if (*reinterpret_cast<const volatile u32*>(&s->error_claim) != 0u) return false;
            if (now - t0 > p.spin_timeout_ns) {
                record_error(p, timeout, phase, layer);
                return false;
            }
        }
    }
    return true;
}

template <bool kTraced>
struct GridBarrierT {
    u64 base;  // arrivals before this launch (thread 0 only)
    u32 count; // barriers passed in this launch

    __device__ __forceinline__ void init(const Params& p) {
        count = 0;
        base = 0;
        if (threadIdx.x == 0) {
            base = ld_acquire_u64(&reinterpret_cast<SyncState*>(p.sync)->base);
            if (kTraced && (p.flags & kFlagTrace)) {
                u64* t = trace_slot(p, 0);
                t[0] = globaltimer_ns();
                t[1] = 0;
                u64* a = attn_marks(p, 0);  // this CTA's [L, kAttnMarks]
                for (u32 i = 0; i < QMK_LAYERS * kAttnMarks; ++i) a[i] = 0;
            }
        }
    }

    // Returns false when the wait was abandoned (error recorded); the caller
    // returns from the kernel (uniformly for the whole CTA).
    __device__ __forceinline__ bool sync(const Params& p, u32 phase, u32 layer) {
        __shared__ int s_ok;
        __syncthreads();
        count += 1;
        if (threadIdx.x == 0) {
            SyncState* s = reinterpret_cast<SyncState*>(p.sync);
            const u64 target = base + (u64)count * (u64)gridDim.x;
            const bool hang = (p.flags & kFlagDebugHang) && count == 1 && blockIdx.x + 1 == gridDim.x;
            const bool trace = kTraced && (p.flags & kFlagTrace) && count <= QMK_BARRIERS_PER_STEP;
            if (trace) trace_slot(p, count)[0] = globaltimer_ns();
            // Release at gpu scope orders this CTA's writes (made visible to
            // thread 0 by bar.sync) before the arrival.
            if (!hang) red_release_add_u64(&s->arrived, 1ull);
            const int ok = bounded_wait(
                p, [&] { return ld_acquire_u64(&s->arrived) >= target; }, kErrBarrierTimeout, phase, layer);
            if (trace) trace_slot(p, count)[1] = globaltimer_ns();
            s_ok = ok;
        }
        __syncthreads();
        return s_ok != 0;
    }

    // Called by CTA 0 thread 0 after the last barrier: the next launch starts
    // counting from here.
    __device__ __forceinline__ void finish(const Params& p) {
        SyncState* s = reinterpret_cast<SyncState*>(p.sync);
        s->base = base + (u64)count * (u64)gridDim.x;
    }
};

// The prefill chunk's barrier (untraced).
using GridBarrier = GridBarrierT<false>;

}  // namespace qmk
