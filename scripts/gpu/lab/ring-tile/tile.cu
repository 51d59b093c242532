// Which weight-ring layout lets the decode warps keep up with the stream?
//
// One weight phase in steady state: a matrix W [L][R][K] bf16 (L layers,
// each its own memory) times an f32 vector x [K] in shared memory, y = W x,
// each CTA owning a contiguous balanced share of the R rows of every layer,
// 16 warps per CTA: warp 15's lane(s) issue bulk copies into a ring in
// dynamic shared memory after x, warps 0-14 read it. Three ways to cut the
// stream into ring batches:
//
//   unit  whole rows per batch (as many as fit in 32 KB, at least one), row
//         j of the CTA's stream to warp j % 15: the layout the product's ring
//         used. A batch holds work for only a few warps.
//   tma   a tile of G rows x KT columns per batch (G <= 15: every warp has a
//         row of every batch), one 3-D tensor copy (cp.async.bulk.tensor)
//         per 256 columns; each warp keeps its row's accumulator across the
//         KT tiles of its row group.
//   rows  the same tiles, one plain bulk copy per row of the tile (G copies
//         of KT x 2 bytes, from G lanes).
//
// Every mode sums in the product's order (lane l takes 16-byte vectors l,
// l + 32, ... ascending; then the xor tree), so y must equal a direct
// global-load reference bit for bit. GB/s is W's bytes over the best of 4
// launches; "of read" is against a plain streaming read of the same bytes
// in the same run.
#include "ring.cuh"

constexpr int kWarps = 16, kReaders = 15, kSlots = 64;
enum Mode { kUnit = 0, kTma = 1, kRows = 2 };

struct Cfg {
    int mode;
    unsigned K, R, L;
    unsigned x_bytes;     // dynamic smem before the ring (x, padded to 128)
    unsigned ring_bytes;  // the ring
    unsigned kt;          // tile columns (tma, rows)
    unsigned G;           // rows per tile (tma, rows)
};

// Reference: one warp per row, 16-byte global loads, the same order.
__global__ void reference(const uint16_t* W, Cfg c, float* y) {
    const unsigned lane = threadIdx.x & 31;
    const uint64_t rows = (uint64_t)c.L * c.R;
    const unsigned nv = c.K / 8;
    for (uint64_t r = (uint64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows;
         r += (uint64_t)gridDim.x * (blockDim.x / 32)) {
        const uint4* w = reinterpret_cast<const uint4*>(W + r * c.K);
        float acc = 0.0f;
        for (unsigned i = lane; i < nv; i += 32) {
            const unsigned k = i * 8;
            acc = dot8(w[i], make_float4(xval(k), xval(k + 1), xval(k + 2), xval(k + 3)),
                       make_float4(xval(k + 4), xval(k + 5), xval(k + 6), xval(k + 7)), acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) y[r] = acc;
    }
}

__global__ void __launch_bounds__(kWarps * 32, 1)
    ring_matvec(const __grid_constant__ CUtensorMap tmap, const uint16_t* W, Cfg c, float* y) {
    extern __shared__ __align__(128) unsigned char dyn[];
    __shared__ uint64_t full[kSlots], empty[kSlots];
    float* xs = reinterpret_cast<float*>(dyn);
    const unsigned ring = (sa(dyn) + c.x_bytes + 127u) & ~127u;  // TMA wants 128-byte aligned boxes
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (unsigned i = threadIdx.x; i < c.K; i += blockDim.x) xs[i] = xval(i);
    unsigned lo_, hi_;
    share(c.R, lo_, hi_);
    // Slot size and count.
    unsigned slot_bytes, per_unit = 0;
    if (c.mode == kUnit) {
        per_unit = (32768u / (c.K * 2) > 1u ? 32768u / (c.K * 2) : 1u);
        slot_bytes = per_unit * c.K * 2;
    } else {
        slot_bytes = c.G * c.kt * 2;
    }
    const unsigned slots = min_u((unsigned)kSlots, c.ring_bytes / slot_bytes);
    if (threadIdx.x == 0) {
        for (unsigned s = 0; s < slots; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], kReaders);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const float4* xs4 = reinterpret_cast<const float4*>(xs);

    if (c.mode == kUnit) {
        if (warp == kWarps - 1) {
            unsigned b = 0;
            for (unsigned l = 0; l < c.L; ++l)
                for (unsigned r0 = lo_; r0 < hi_; r0 += per_unit, ++b) {
                    const unsigned n = min_u(per_unit, hi_ - r0), bytes = n * c.K * 2;
                    const unsigned s = b % slots;
                    if (b >= slots) mbar_wait(&empty[s], ((b / slots) - 1) & 1);
                    if (lane == 0) mbar_expect(&full[s], bytes);
                    __syncwarp();
                    const char* src = reinterpret_cast<const char*>(W + ((uint64_t)l * c.R + r0) * c.K);
                    for (unsigned o = lane * 8192; o < bytes; o += 32 * 8192)
                        bulk(ring + s * slot_bytes + o, src + o, min_u(8192u, bytes - o), &full[s]);
                }
            return;
        }
        unsigned b = 0, j = 0;
        for (unsigned l = 0; l < c.L; ++l)
            for (unsigned r0 = lo_; r0 < hi_; r0 += per_unit, ++b) {
                const unsigned n = min_u(per_unit, hi_ - r0), s = b % slots;
                mbar_wait(&full[s], (b / slots) & 1);
                for (unsigned u = 0; u < n; ++u, ++j) {
                    if (j % kReaders != warp) continue;
                    const unsigned row = ring + s * slot_bytes + u * c.K * 2;
                    float acc = 0.0f;
                    for (unsigned i = lane; i < c.K / 8; i += 32)
                        acc = dot8(lds16(row + i * 16), xs4[2 * i], xs4[2 * i + 1], acc);
                    acc = warp_sum(acc);
                    if (lane == 0) y[(uint64_t)l * c.R + r0 + u] = acc;
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);
            }
        return;
    }

    // Tiles: G rows x kt columns (the last tile of a row may be narrower).
    if (warp == kWarps - 1) {
        unsigned b = 0;
        for (unsigned l = 0; l < c.L; ++l)
            for (unsigned g0 = lo_; g0 < hi_; g0 += c.G) {
                const unsigned nrows = min_u(c.G, hi_ - g0);
                for (unsigned k0 = 0; k0 < c.K; k0 += c.kt, ++b) {
                    const unsigned kk = min_u(c.kt, c.K - k0), s = b % slots;
                    const unsigned dst = ring + s * slot_bytes;
                    if (b >= slots) mbar_wait(&empty[s], ((b / slots) - 1) & 1);
                    if (c.mode == kTma) {
                        // Whole boxes count, rows past the share included.
                        if (lane == 0) mbar_expect(&full[s], c.G * kk * 2);
                        __syncwarp();
                        if (lane < kk / 256)
                            tma3(dst + lane * c.G * 512, &tmap, (int)(k0 + lane * 256), (int)g0, (int)l, &full[s]);
                    } else {
                        if (lane == 0) mbar_expect(&full[s], nrows * kk * 2);
                        __syncwarp();
                        if (lane < nrows)
                            bulk(dst + lane * kk * 2, W + ((uint64_t)l * c.R + g0 + lane) * c.K + k0, kk * 2,
                                 &full[s]);
                    }
                }
            }
        return;
    }
    unsigned b = 0;
    for (unsigned l = 0; l < c.L; ++l)
        for (unsigned g0 = lo_; g0 < hi_; g0 += c.G) {
            const bool mine = warp < c.G && g0 + warp < hi_;
            float acc = 0.0f;
            for (unsigned k0 = 0; k0 < c.K; k0 += c.kt, ++b) {
                const unsigned kk = min_u(c.kt, c.K - k0), s = b % slots;
                mbar_wait(&full[s], (b / slots) & 1);
                if (mine) {
                    const unsigned base = ring + s * slot_bytes;
                    for (unsigned ch = 0; ch < kk / 256; ++ch) {
                        const unsigned i = k0 / 8 + ch * 32 + lane;
                        const unsigned a = c.mode == kTma ? base + ch * c.G * 512 + warp * 512 + lane * 16
                                                          : base + warp * kk * 2 + ch * 512 + lane * 16;
                        acc = dot8(lds16(a), xs4[2 * i], xs4[2 * i + 1], acc);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);
            }
            acc = warp_sum(acc);
            if (mine && lane == 0) y[(uint64_t)l * c.R + g0 + warp] = acc;
        }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(ring_matvec, cudaFuncAttributeMaxDynamicSharedMemorySize, 226 * 1024));
    unsigned* sink;
    CK(cudaMalloc(&sink, 4));

    struct Shape { const char* name; unsigned K, R, L; };
    // 7B: down [3584, 18944] and one of gate/up [18944, 3584], 8 layers of
    // their own memory (1.09 GB, well past the 60 MB L2).
    const Shape shapes[] = {{"7B down", 18944, 3584, 8}, {"7B gate", 3584, 18944, 8}, {"14B down", 13824, 5120, 8}};
    for (const Shape& sh : shapes) {
        const uint64_t elems = (uint64_t)sh.L * sh.R * sh.K, bytes = elems * 2;
        uint16_t* W;
        CK(cudaMalloc(&W, bytes));
        {
            std::vector<uint16_t> h(1 << 24);
            for (size_t i = 0; i < h.size(); ++i) {
                const float f = ((int)((i * 2654435761ull >> 7) % 2001) - 1000) / 4096.0f;
                unsigned u;
                memcpy(&u, &f, 4);
                h[i] = (uint16_t)(u >> 16);
            }
            for (uint64_t o = 0; o < elems; o += h.size())
                CK(cudaMemcpy(W + o, h.data(), std::min<uint64_t>(h.size(), elems - o) * 2, cudaMemcpyHostToDevice));
        }
        float *y, *yref;
        CK(cudaMalloc(&y, (uint64_t)sh.L * sh.R * 4));
        CK(cudaMalloc(&yref, (uint64_t)sh.L * sh.R * 4));
        Cfg rc{};
        rc.K = sh.K;
        rc.R = sh.R;
        rc.L = sh.L;
        reference<<<sms * 4, 512>>>(W, rc, yref);
        CK(cudaDeviceSynchronize());
        std::vector<float> href((uint64_t)sh.L * sh.R), hy(href.size());
        CK(cudaMemcpy(href.data(), yref, href.size() * 4, cudaMemcpyDeviceToHost));

        const float read_ms = plain_read_ms(W, bytes, sms, sink);
        const double read_gbs = bytes / read_ms / 1e6;
        printf("== %s: W [%u][%u][%u] bf16, %.2f GB; plain read %.0f GB/s\n", sh.name, sh.L, sh.R, sh.K, bytes / 1e9,
               read_gbs);

        const unsigned x_bytes = (sh.K * 4 + 127) / 128 * 128;
        const unsigned max_share = (sh.R + sms - 1) / sms;
        const unsigned G = (max_share + (max_share + kReaders - 1) / kReaders - 1) / ((max_share + kReaders - 1) / kReaders);
        std::vector<Cfg> cfgs;
        for (unsigned ring : {116u * 1024, 144u * 1024}) {
            if (x_bytes + ring + 128 > 226 * 1024) continue;
            cfgs.push_back({kUnit, sh.K, sh.R, sh.L, x_bytes, ring, 0, 0});
            for (unsigned kt : {512u, 1024u, 2048u}) cfgs.push_back({kTma, sh.K, sh.R, sh.L, x_bytes, ring, kt, G});
            for (unsigned kt : {1024u, 2048u}) cfgs.push_back({kRows, sh.K, sh.R, sh.L, x_bytes, ring, kt, G});
        }
        for (Cfg c : cfgs) {
            if (c.mode != kUnit && c.G * c.kt * 2 * 2 > c.ring_bytes) continue;
            CUtensorMap tmap;
            memset(&tmap, 0, sizeof tmap);
            if (c.mode == kTma) {
                const cuuint64_t dims[3] = {sh.K, sh.R, sh.L};
                const cuuint64_t strides[2] = {(cuuint64_t)sh.K * 2, (cuuint64_t)sh.R * sh.K * 2};
                const cuuint32_t box[3] = {256, c.G, 1}, estr[3] = {1, 1, 1};
                const CUresult r = cuTensorMapEncodeTiled(&tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, W, dims, strides, box, estr,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
                if (r != CUDA_SUCCESS) {
                    printf("encode failed %d\n", (int)r);
                    continue;
                }
            }
            CK(cudaMemset(y, 0xff, (uint64_t)sh.L * sh.R * 4));
            const float best = best_ms(
                [&] { ring_matvec<<<sms, kWarps * 32, c.x_bytes + c.ring_bytes + 128>>>(tmap, W, c, y); });
            CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
            const bool same = memcmp(hy.data(), href.data(), hy.size() * 4) == 0;
            const double gbs = bytes / best / 1e6;
            const char* mode = c.mode == kUnit ? "unit" : (c.mode == kTma ? "tma " : "rows");
            printf("%s ring %3u KB  G %2u  kt %4u: %7.1f GB/s  %5.1f %% of read  %s\n", mode, c.ring_bytes / 1024,
                   c.mode == kUnit ? 0 : c.G, c.kt, gbs, 100.0 * gbs / read_gbs, same ? "bit-identical" : "DIFFERS");
        }
        CK(cudaFree(W));
        CK(cudaFree(y));
        CK(cudaFree(yref));
    }
    return 0;
}
