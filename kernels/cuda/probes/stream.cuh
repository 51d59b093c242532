// probes/stream.cuh: the bandwidth floor. Reads a multi-GB buffer with the same
// 16-byte non-coherent loads the megakernel uses for weights, 8 in flight per
// thread, and xors every word into a per-CTA checksum so no load is dead.
#pragma once

extern "C" __global__ void __launch_bounds__(QMK_THREADS)
    qmk_stream_read(const __grid_constant__ qmk::StreamParams p) {
    using namespace qmk;
    const uint4* src = reinterpret_cast<const uint4*>(p.src);  // [n_vec16]
    const u64 stride = (u64)gridDim.x * QMK_THREADS;
    u32 acc = 0;
    u64 i = (u64)blockIdx.x * QMK_THREADS + threadIdx.x;
    constexpr int U = 8;
    for (; i + (U - 1) * stride < p.n_vec16; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = ld_weight16(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < p.n_vec16; i += stride) {
        const uint4 v = ld_weight16(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(QMK_FULL_MASK, acc, o);
    __shared__ u32 s[QMK_WARPS];
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 t = 0;
        for (int w = 0; w < QMK_WARPS; ++w) t ^= s[w];
        reinterpret_cast<u32*>(p.out)[blockIdx.x] = t;
    }
}
