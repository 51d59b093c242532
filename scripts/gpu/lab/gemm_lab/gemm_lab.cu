// gemm_lab.cu: measures ws_gemm.cuh (warp-specialised TMA + wgmma, with and
// without 2-CTA multicast) against cuBLAS on the 7B prefill GEMMs that bound
// time to first token at 2,048 tokens (gate/up and down, 28 layers with
// their own weights, as the prefill kernel runs them), after checking both
// against a naive f32 reference on layer 0.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a gemm_lab.cu -lcuda -lcublas -o gemm_lab
//   ./gemm_lab [T ...]            (default: 2048 512)
//
// Prints one line per (T, phase, variant): median ms of REPS timed 28-layer
// loops (device events, variants interleaved per rep), and TFLOP/s.
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ws_gemm.cuh"

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)
#define CU(x)                                                                       \
    do {                                                                            \
        CUresult r_ = (x);                                                          \
        if (r_ != CUDA_SUCCESS) {                                                   \
            const char* s_ = nullptr;                                               \
            cuGetErrorString(r_, &s_);                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?"); \
            exit(1);                                                                \
        }                                                                           \
    } while (0)
#define CB(x)                                                                             \
    do {                                                                                  \
        cublasStatus_t s_ = (x);                                                          \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
            fprintf(stderr, "%s:%d %s: cublas %d\n", __FILE__, __LINE__, #x, (int)s_);    \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

constexpr int H = 3584, I = 18944, L = 28, REPS = 7;

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float amp) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 16;
        x *= 0x7feb352du;
        x ^= x >> 15;
        x *= 0x846ca68bu;
        x ^= x >> 16;
        p[i] = __float2bfloat16(amp * ((float)(x & 0xFFFFFF) / 8388608.0f - 1.0f));
    }
}

template <bool MC, int EPI>
__global__ void __launch_bounds__(ws::kThreads, 1)
    ws_kernel(const __grid_constant__ ws::TensorMap a0, const __grid_constant__ ws::TensorMap a1,
              const __grid_constant__ ws::TensorMap b, ws::Job job) {
    extern __shared__ __align__(1024) char dyn[];
    ws::gemm<MC, EPI>(&a0, &a1, &b, job, dyn);
}

template <int EPI>
__global__ void __launch_bounds__(ws::kThreads, 1)
    ws2_kernel(const __grid_constant__ ws::TensorMap a, const __grid_constant__ ws::TensorMap b, ws::Job2 job) {
    extern __shared__ __align__(1024) char dyn[];
    ws::gemm2<EPI>(&a, &b, job, dyn);
}

static_assert(sizeof(CUtensorMap) == sizeof(ws::TensorMap), "tensor map size");
static ws::TensorMap tmap(const void* base, uint64_t cols, uint64_t rows, uint32_t box_rows = 128) {
    CUtensorMap m;
    cuuint64_t dims[2] = {cols, rows};
    cuuint64_t strides[1] = {cols * 2};
    cuuint32_t box[2] = {64, box_rows};
    cuuint32_t es[2] = {1, 1};
    CU(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                              strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    ws::TensorMap t;
    memcpy(&t, &m, sizeof t);
    return t;
}

// gate [I, H] and up (= gate + I * H elements) as (K, 8 rows, gate / up,
// 8-row blocks): one 64 x 8 x 2 x 8 box = 8 gate rows, the same 8 up rows,
// ... (64 columns of each).
static ws::TensorMap tmap_gu(const void* gate) {
    CUtensorMap m;
    cuuint64_t dims[4] = {(cuuint64_t)H, 8, 2, (cuuint64_t)I / 8};
    cuuint64_t strides[3] = {(cuuint64_t)H * 2, (cuuint64_t)I * H * 2, (cuuint64_t)8 * H * 2};
    cuuint32_t box[4] = {64, 8, 2, 8};
    cuuint32_t es[4] = {1, 1, 1, 1};
    CU(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(gate), dims,
                              strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    ws::TensorMap t;
    memcpy(&t, &m, sizeof t);
    return t;
}

template <int EPI>
static void launch2(const ws::TensorMap& a, const ws::TensorMap& b, const ws::Job2& job, int grid,
                    cudaStream_t st) {
    static bool init = false;
    if (!init) {
        CK(cudaFuncSetAttribute(ws2_kernel<EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)ws::kSmemBytes));
        init = true;
    }
    ws2_kernel<EPI><<<grid, ws::kThreads, ws::kSmemBytes, st>>>(a, b, job);
    CK(cudaGetLastError());
}

template <bool MC, int EPI>
static void launch(const ws::TensorMap& a0, const ws::TensorMap& a1, const ws::TensorMap& b, const ws::Job& job,
                   int grid, cudaStream_t st) {
    static bool init = false;
    if (!init) {
        CK(cudaFuncSetAttribute(ws_kernel<MC, EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)ws::kSmemBytes));
        init = true;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(ws::kThreads);
    cfg.dynamicSmemBytes = ws::kSmemBytes;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = MC ? 2 : 1;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, ws_kernel<MC, EPI>, a0, a1, b, job));
}

struct Bufs {
    std::vector<__nv_bfloat16*> wg, wu, wd;
    __nv_bfloat16 *x, *hb;
    float* act;
    std::vector<ws::TensorMap> mg, mu, md, mgu;
    ws::TensorMap mx, mhb, mx2, mhb2;
};

static std::vector<int> csv_ints(const char* s, std::vector<int> dflt) {
    if (!s || !*s) return dflt;
    std::vector<int> v;
    for (const char* p = s; *p;) {
        v.push_back(atoi(p));
        while (*p && *p != ',') ++p;
        if (*p == ',') ++p;
    }
    return v;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    std::vector<int> Ts;
    for (int i = 1; i < argc; ++i) Ts.push_back(atoi(argv[i]));
    if (Ts.empty()) Ts = {2048, 512};
    const int Tmax = *std::max_element(Ts.begin(), Ts.end());
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int G = prop.multiProcessorCount;
    printf("device %s, %d SMs\n", prop.name, G);

    Bufs B;
    const size_t wsz = (size_t)H * I;
    for (int l = 0; l < L; ++l) {
        __nv_bfloat16 *g, *u, *d;
        CK(cudaMalloc(&g, wsz * 4));  // gate then up, one allocation (tmap_gu)
        u = g + wsz;
        CK(cudaMalloc(&d, wsz * 2));
        fill_bf16<<<1024, 256>>>(g, wsz, 11 + 3 * l, 0.03f);
        fill_bf16<<<1024, 256>>>(u, wsz, 12 + 3 * l, 0.03f);
        fill_bf16<<<1024, 256>>>(d, wsz, 13 + 3 * l, 0.02f);
        B.wg.push_back(g);
        B.wu.push_back(u);
        B.wd.push_back(d);
        B.mg.push_back(tmap(g, H, I));
        B.mu.push_back(tmap(u, H, I));
        B.md.push_back(tmap(d, I, H));
        B.mgu.push_back(tmap_gu(g));
    }
    CK(cudaMalloc(&B.x, (size_t)Tmax * H * 2));
    CK(cudaMalloc(&B.hb, (size_t)Tmax * I * 2));
    CK(cudaMalloc(&B.act, (size_t)Tmax * H * 4));
    fill_bf16<<<1024, 256>>>(B.x, (size_t)Tmax * H, 7, 1.0f);
    CK(cudaDeviceSynchronize());

    cublasHandle_t cb;
    CB(cublasCreate(&cb));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    CB(cublasSetStream(cb, st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    for (int T : Ts) {
        B.mx = tmap(B.x, H, T);
        B.mhb = tmap(B.hb, I, T);
        B.mx2 = tmap(B.x, H, T, 256);
        B.mhb2 = tmap(B.hb, I, T, 256);
        const uint32_t tt2 = (T + 255) / 256;
        // cuBLAS: out[T, n] (row-major, type ot) = beta * out + a[T, k] . w[n, k]^T.
        auto cublas = [&](const void* w, int n, int k, const void* a, void* out, cudaDataType ot, float beta) {
            const float one = 1.0f;
            CB(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, n, T, k, &one, w, CUDA_R_16BF, k, a, CUDA_R_16BF, k,
                            &beta, out, ot, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        };
        const uint32_t tt = (T + 127) / 128;
        auto job_gu = [&]() {
            ws::Job j{148, tt, H / 64, 128, 0, (uint32_t)T, (uint32_t)I, (uint32_t)I, B.hb};
            return j;
        };
        auto job_dn = [&]() {
            ws::Job j{14, tt, I / 64, 256, 128, (uint32_t)T, (uint32_t)H, (uint32_t)H, B.act};
            return j;
        };
        // variant: 0 ws (256 x 128), 1 ws2 (128 x 256), 2 cuBLAS, 3 ws + multicast; what: 1 gate/up, 2 down, 3 both
        auto run_layer = [&](int v, int l, int what) {
            if (what & 1) {
                if (v == 0) launch<false, ws::kGateUp>(B.mg[l], B.mu[l], B.mx, job_gu(), G, st);
                if (v == 1) {
                    ws::Job2 j{I / 64, tt2, H / 64, (uint32_t)T, (uint32_t)I, (uint32_t)I, B.hb};
                    launch2<ws::kGateUp>(B.mgu[l], B.mx2, j, G, st);
                }
                if (v == 3) launch<true, ws::kGateUp>(B.mg[l], B.mu[l], B.mx, job_gu(), G, st);
                if (v == 4) launch<false, ws::kProbe>(B.mg[l], B.mu[l], B.mx, job_gu(), G, st);
                if (v == 5) launch<false, ws::kGateUpStaged>(B.mg[l], B.mu[l], B.mx, job_gu(), G, st);
                if (v == 2) {
                    // hb-shaped bf16 outputs of gate and up (no SiLU: cuBLAS's
                    // share of the work, as torch_gemm_ref.py times it).
                    cublas(B.wg[l], I, H, B.x, B.hb, CUDA_R_16BF, 0.0f);
                    cublas(B.wu[l], I, H, B.x, B.hb, CUDA_R_16BF, 0.0f);
                }
            }
            if (what & 2) {
                if (v == 0) launch<false, ws::kResidual>(B.md[l], B.md[l], B.mhb, job_dn(), G, st);
                if (v == 1) {
                    ws::Job2 j{H / 128, tt2, I / 64, (uint32_t)T, (uint32_t)H, (uint32_t)H, B.act};
                    launch2<ws::kResidual>(B.md[l], B.mhb2, j, G, st);
                }
                if (v == 3) launch<true, ws::kResidual>(B.md[l], B.md[l], B.mhb, job_dn(), G, st);
                if (v == 4) launch<false, ws::kProbe>(B.md[l], B.md[l], B.mhb, job_dn(), G, st);
                if (v == 5) launch<false, ws::kResidualRed>(B.md[l], B.md[l], B.mhb, job_dn(), G, st);
                if (v == 2) {
                    cublas(B.wd[l], H, I, B.hb, B.act, CUDA_R_32F, 1.0f);
                }
            }
        };

        // Correctness, layer 0, ws and ws2 (not under LAB_NCU).
        if (!getenv("LAB_NCU")) {
            const size_t ngu = (size_t)T * I, ndn = (size_t)T * H;
            float *rgu, *rdn, *act0;
            CK(cudaMalloc(&rgu, ngu * 4));
            CK(cudaMalloc(&rdn, ndn * 4));
            CK(cudaMalloc(&act0, ndn * 4));
            std::vector<float> hact(ndn);
            for (size_t i = 0; i < ndn; ++i) hact[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
            CK(cudaMemcpy(act0, hact.data(), ndn * 4, cudaMemcpyHostToDevice));
            // References from cuBLAS with f32 outputs: gate and up (SiLU on
            // the host), then act0 + hb . Wd^T on the hb under test.
            float* rup;
            CK(cudaMalloc(&rup, ngu * 4));
            {
                cublas(B.wg[0], I, H, B.x, rgu, CUDA_R_32F, 0.0f);
                cublas(B.wu[0], I, H, B.x, rup, CUDA_R_32F, 0.0f);
                CK(cudaStreamSynchronize(st));
            }
            std::vector<float> ref(ngu), refd(ndn), gotd(ndn);
            std::vector<__nv_bfloat16> got(ngu);
            {
                std::vector<float> up(ngu);
                CK(cudaMemcpy(ref.data(), rgu, ngu * 4, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(up.data(), rup, ngu * 4, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < ngu; ++i) ref[i] = ref[i] / (1.0f + expf(-ref[i])) * up[i];
            }
            for (int v : {0, 1, 5}) {
                CK(cudaMemset(B.hb, 0xFF, ngu * 2));
                run_layer(v, 0, 1);
                CK(cudaStreamSynchronize(st));
                CK(cudaGetLastError());
                CK(cudaMemcpy(got.data(), B.hb, ngu * 2, cudaMemcpyDeviceToHost));
                double maxe = 0, maxr = 0;
                for (size_t i = 0; i < ngu; ++i) {
                    {
                        const double err = fabsf(__bfloat162float(got[i]) - ref[i]);
                        maxe = err == err ? std::max(maxe, err) : INFINITY;  // unwritten: NaN
                    }
                    maxr = std::max(maxr, (double)fabsf(ref[i]));
                }
                printf("check T=%d gate_up ws%s: max abs err %.3e (max |ref| %.3e) %s\n", T, v == 1 ? "2" : (v == 5 ? "-fastepi" : ""),
                       maxe, maxr, maxe <= 1e-2 * maxr ? "OK" : "FAIL");
                // down on the hb just written
                {
                    CK(cudaMemcpy(rdn, act0, ndn * 4, cudaMemcpyDeviceToDevice));
                    cublas(B.wd[0], H, I, B.hb, rdn, CUDA_R_32F, 1.0f);
                }
                CK(cudaMemcpy(B.act, act0, ndn * 4, cudaMemcpyDeviceToDevice));
                run_layer(v, 0, 2);
                CK(cudaStreamSynchronize(st));
                CK(cudaGetLastError());
                CK(cudaMemcpy(refd.data(), rdn, ndn * 4, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(gotd.data(), B.act, ndn * 4, cudaMemcpyDeviceToHost));
                maxe = 0;
                maxr = 0;
                for (size_t i = 0; i < ndn; ++i) {
                    {
                        const double err = fabsf(gotd[i] - refd[i]);
                        maxe = err == err ? std::max(maxe, err) : INFINITY;
                    }
                    maxr = std::max(maxr, (double)fabsf(refd[i]));
                }
                printf("check T=%d down ws%s: max abs err %.3e (max |ref| %.3e) %s\n", T, v == 1 ? "2" : (v == 5 ? "-fastepi" : ""), maxe,
                       maxr, maxe <= 2e-3 * maxr ? "OK" : "FAIL");
            }
            CK(cudaFree(rgu));
            CK(cudaFree(rup));
            CK(cudaFree(rdn));
            CK(cudaFree(act0));
        }

        const char* vname[6] = {"ws", "ws2", "cublas", "ws+mc", "ws-noepi", "ws-fastepi"};
        const char* wname[4] = {"", "gate_up", "down", "both"};
        const double flop_gu = 2.0 * T * H * 2.0 * I * L, flop_dn = 2.0 * T * I * H * L;
        // LAB_VARIANTS: which variants (default all), LAB_WHAT: phases
        // (1 gate/up, 2 down, 3 both; default "1,2"), LAB_NCU=1: one layer of
        // each variant once, untimed (for Nsight Compute), then exit.
        std::vector<int> vs = csv_ints(getenv("LAB_VARIANTS"), {0, 2, 4, 5});
        std::vector<int> whats = csv_ints(getenv("LAB_WHAT"), {1, 2});
        if (getenv("LAB_NCU")) {
            for (int what : whats)
                for (int v : vs) run_layer(v, 1, what);
            CK(cudaStreamSynchronize(st));
            return 0;
        }
        const int nv = (int)vs.size();
        for (int what : whats) {
            std::vector<std::vector<double>> ms(nv);
            for (int rep = -1; rep < REPS; ++rep) {
                for (int k = 0; k < nv; ++k) {
                    const int vi = (k + (rep < 0 ? 0 : rep)) % nv;
                    CK(cudaEventRecord(e0, st));
                    for (int l = 0; l < L; ++l) run_layer(vs[vi], l, what);
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float t;
                    CK(cudaEventElapsedTime(&t, e0, e1));
                    if (rep >= 0) ms[vi].push_back(t);
                }
            }
            const double fl = (what & 1 ? flop_gu : 0) + (what & 2 ? flop_dn : 0);
            for (int vi = 0; vi < nv; ++vi) {
                const double m = median(ms[vi]);
                printf("T=%d %-8s %-8s median %.3f ms (min %.3f) %.1f TFLOP/s\n", T, wname[whats.empty() ? 0 : what],
                       vname[vs[vi]], m, *std::min_element(ms[vi].begin(), ms[vi].end()), fl / m / 1e9);
            }
        }
    }
    return 0;
}
