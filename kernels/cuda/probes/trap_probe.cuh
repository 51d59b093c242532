// probes/trap_probe.cuh: the 32-bit offset trap, demonstrated: why weights
// are addressed through the split plan's chunks.
//
// qmk_probe_fill writes bf16(l + 1) into every element of layer l of a
// stacked [layers, rows, cols] tensor (64-bit addressing: the fill is not
// under test). qmk_trap_probe then reads element [l, rows-1, cols-1] of every
// layer through offset3() in koff_t -- the megakernel's own arithmetic --
// relative to the chunk base holding l. With the planner's chunks every read
// is right; with one chunk the offset wraps mod 2^32 for every layer whose
// last element lies at or past 2^32 bytes, and the read lands (inside the
// buffer) on an earlier layer's value.
#pragma once

extern "C" __global__ void __launch_bounds__(QMK_THREADS)
    qmk_probe_fill(const __grid_constant__ qmk::ProbeFillParams p) {
    using namespace qmk;
    uint4* dst = reinterpret_cast<uint4*>(p.base);  // [n_vec16] 16-byte vectors
    const u64 stride = (u64)gridDim.x * QMK_THREADS;
    for (u64 i = (u64)blockIdx.x * QMK_THREADS + threadIdx.x; i < p.n_vec16; i += stride) {
        const u32 l = (u32)(i / p.layer_vecs);
        const u32 b = (u32)f32_to_bf16_rne((float)(l + 1));
        const u32 w = b | (b << 16);
        dst[i] = make_uint4(w, w, w, w);
    }
}

extern "C" __global__ void __launch_bounds__(QMK_THREADS)
    qmk_trap_probe(const __grid_constant__ qmk::ProbeParams p) {
    using namespace qmk;
    const u32 l = blockIdx.x * QMK_THREADS + threadIdx.x;
    if (l >= p.layers) return;
    u32 c = 0;
    while (c + 1 < p.num_chunks && l >= p.chunk_start[c + 1]) ++c;
    const koff_t off = offset3((koff_t)(l - p.chunk_start[c]), (koff_t)(p.rows - 1),
                               (koff_t)(p.cols - 1), (koff_t)p.stride0 * 2u,
                               (koff_t)p.stride1 * 2u, (koff_t)p.stride2 * 2u);
    const char* base = reinterpret_cast<const char*>(p.chunk_base[c]);
    reinterpret_cast<u32*>(p.out)[l] = *reinterpret_cast<const u16*>(base + off);
}
