// prefill/chunk.cuh: qmk_prefill_chunk, one cooperative launch per prompt chunk:
// positions start .. start + n of tokens[0..n), every layer, the KV cache
// written for every position, and for the LAST position the final norm,
// the LM head, logits and the greedy pick (the decode kernel's lm_head and
// argmax, reading the last row of the chunk's residual stream through
// base.x, which the host points there).
//
// Phases per layer, a grid barrier after each (bounded waits, abort and
// error reporting exactly as in the decode kernel, same SyncState counter):
//   norm1 (layer 0: + embedding) -> qkv GEMM -> rotary + KV write ->
//   attention -> o_proj GEMM + residual -> norm2 -> gate/up GEMM + SiLU ->
//   down GEMM + residual
// On the wgmma path (sm_90a) the rotary + KV write runs in the qkv GEMM's
// epilogue and its phase is empty; its barrier stays, so every path has
// 8 L + 1 barriers per chunk (the +1 after the LM head), as the host
// counts. Skip bits (kSkipShift + 0..5: qkv, attention, o_proj, gate_up,
// down, lm_head) drop phases for profiling, as in the decode kernel.
//
// What it uses (all included by megakernel.cu before this file):
//   core/*                 params, weight addressing, rotary, KV cache, barrier
//   decode/lm_head.cuh,
//   decode/argmax.cuh      the final norm, LM head and greedy pick
//   decode/mlp.cuh         silu (the mma.sync gate/up epilogue)
//   prefill/norm.cuh       prefill_rms_norm (norm1, norm2)
//   prefill/gemm_phases.cuh prefill_qkv, prefill_residual_gemm, prefill_gate_up,
//                          prefill_rope_fused (over prefill/gemm.cuh, prefill/wgmma.cuh)
//   prefill/rope.cuh       prefill_rope_kv (the mma.sync path's rope phase)
//   prefill/attention.cuh  prefill_attention, kPfSmemAvail
//   prefill/wgmma.cuh      WgStreamK, wg_sk_nonce (the stream-K scratch)
#pragma once

namespace qmk {

// Dynamic shared memory: the GEMM stages (the wgmma ones where that path is
// compiled in: it also runs the mma.sync path under kFlagPfMmaSync, inside
// the same bytes) or the final norm's activation vector, whichever is larger.
// kPfSmemAvail (prefill/attention.cuh) is the GEMM stages' size.
constexpr u32 kPrefillSmemBytes =
    kPfSmemAvail > (u32)(QMK_HIDDEN * 4) ? kPfSmemAvail : (u32)(QMK_HIDDEN * 4);
static_assert(kPrefillSmemBytes == ((QMK_WGMMA && kWgShapesOk) ? QMK_PREFILL_SMEM_BYTES_WGMMA
                                                               : QMK_PREFILL_SMEM_BYTES),
              "host and kernel disagree on the prefill kernel's shared memory");
static_assert(QMK_PREFILL_BARRIERS == 8 * QMK_LAYERS + 1, "prefill barrier count drifted");

}  // namespace qmk

// One-GPU builds only: a tensor-parallel rank has no prefill kernel (its
// prompt runs as decode steps, which exchange partial sums).
#if QMK_TP_RANKS == 1
extern "C" __global__ void __launch_bounds__(QMK_THREADS, 1)
    qmk_prefill_chunk(const qmk::PrefillParams pp) {
    using namespace qmk;
    extern __shared__ float4 qmk_dyn_smem[];
    u16* smem = reinterpret_cast<u16*>(qmk_dyn_smem);
    float* xs = reinterpret_cast<float*>(qmk_dyn_smem);  // [H] f32 (final norm)
    __shared__ float red[QMK_WARPS];
    const Params& p = pp.base;

    // Input checks, uniform over the grid (every CTA reads the same words)
    // and before any barrier.
    const u32 n = pp.n_tokens;
    u32 bad = (n == 0 || n > pp.max_tokens || pp.start >= p.kv_capacity ||
               n > p.kv_capacity - pp.start)
                  ? kErrBadPos
                  : kErrNone;
    if (bad == kErrNone) {
        const u32* tokens = reinterpret_cast<const u32*>(pp.tokens);  // [n] u32
        int any = 0;
        for (u32 t = threadIdx.x; t < n; t += QMK_THREADS) any |= tokens[t] >= QMK_VOCAB;
        if (__syncthreads_or(any)) bad = kErrBadToken;
    }
    if (bad != kErrNone) {
        if (blockIdx.x == 0 && threadIdx.x == 0) record_error(p, bad, kPhaseStart, 0);
        return;
    }

    // Profiling (as in the decode kernel): skip bits drop phases, every
    // barrier stays; time(full) - time(skip X) is what X costs.
    const u32 skip = (p.flags >> kSkipShift) & 0x3Fu;
    GridBarrier bar;
    bar.init(p);
    // Stream-K scratch of the wgmma GEMM phases (prefill/wgmma.cuh): this
    // launch's nonce, read by every CTA before its first barrier arrival.
    __shared__ u32 s_nonce;
    if (threadIdx.x == 0) s_nonce = (u32)*reinterpret_cast<volatile u64*>(wg_sk_nonce(pp));
    __syncthreads();
    WgStreamK sk;
    sk.part = reinterpret_cast<float*>(pp.sk);  // [G, kWgRows x kWgTokMax] f32
    sk.flags = wg_sk_nonce(pp) + 1;
    sk.nonce = s_nonce;
    sk.seq = 0;
    for (u32 layer = 0; layer < QMK_LAYERS; ++layer) {
        const LayerView<input_layernorm_t> ln1(p.input_layernorm, layer);
        prefill_rms_norm(pp, layer == 0, [&](u32 i) { return ln1.elem(i); });
        if (!bar.sync(p, kPhasePfNorm, layer)) return;
        // Every CTA has read the nonce: the next launch gets a new one.
        if (layer == 0 && blockIdx.x == 0 && threadIdx.x == 0)
            *reinterpret_cast<volatile u64*>(wg_sk_nonce(pp)) = (u64)(sk.nonce + 1u);
        if (!(skip & 1u)) prefill_qkv(pp, layer, smem, sk);
        if (!bar.sync(p, kPhasePfQkv, layer)) return;
        // The wgmma path does this in the q/k/v epilogue; the barrier stays
        // (the host counts 8 per layer).
        if (!prefill_rope_fused(pp)) prefill_rope_kv(pp, layer);
        if (!bar.sync(p, kPhasePfRope, layer)) return;
        if (!(skip & 2u)) prefill_attention(pp, layer, smem);
        if (!bar.sync(p, kPhasePfAttention, layer)) return;
        if (!(skip & 4u))
            prefill_residual_gemm<o_proj_t, (int)QMK_Q_DIM>(pp, p.o_proj, layer, pp.xa,
                                                             QMK_PF_XA_COLS, smem, sk,
                                                             kPhasePfOProj);
        if (!bar.sync(p, kPhasePfOProj, layer)) return;
        const LayerView<post_attention_layernorm_t> ln2(p.post_attention_layernorm, layer);
        // act already holds the residual (layer 0 wrote it in norm1).
        prefill_rms_norm(pp, false, [&](u32 i) { return ln2.elem(i); });
        if (!bar.sync(p, kPhasePfNorm2, layer)) return;
        if (!(skip & 8u)) prefill_gate_up(pp, layer, smem, sk);
        if (!bar.sync(p, kPhasePfGateUp, layer)) return;
        if (!(skip & 16u))
            prefill_residual_gemm<down_proj_t, (int)QMK_INTER>(pp, p.down_proj, layer, pp.hb,
                                                               QMK_INTER, smem, sk,
                                                               kPhasePfDown);
        if (!bar.sync(p, kPhasePfDown, layer)) return;
    }
    if (!(skip & 32u)) lm_head<1, false>(p, xs, red);
    if (!bar.sync(p, kPhaseLmHead, QMK_LAYERS)) return;
    if (blockIdx.x == 0) {
        const u32 pick = argmax(p);
        if (threadIdx.x == 0) {
            *reinterpret_cast<u32*>(p.argmax_out) = pick;
            volatile HostStatus* st = reinterpret_cast<volatile HostStatus*>(p.status);
            st->argmax = pick;
            st->barriers = bar.count;
            st->done = st->done + 1u;
            bar.finish(p);
            __threadfence_system();
        }
    }
}
#endif  // QMK_TP_RANKS == 1
