// How fast can one warp feed a shared-memory ring with cp.async.bulk?
// Each CTA streams its own contiguous block of `per_cta` bytes through a
// ring of `slots` stages of `stage` bytes; a stage is `pieces` bulk copies
// issued by lanes 0..pieces-1 of warp 0 (lane 0 first arms the stage's
// mbarrier with the whole stage's bytes). Nobody consumes: the warp reuses
// a stage once its copies landed. Prints GB/s over the grid.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ bool try_wait(uint64_t* b, unsigned par) {
  unsigned ok; asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p; }" : "=r"(ok) : "r"(sa(b)), "r"(par) : "memory"); return ok; }
__global__ void __launch_bounds__(32, 1) feed(const char* src, unsigned long long per_cta, unsigned stage, unsigned slots, unsigned pieces, unsigned long long* out) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ uint64_t full[64];
  const unsigned lane = threadIdx.x;
  if (lane == 0) { for (unsigned s = 0; s < slots; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncwarp();
  const char* base = src + (unsigned long long)blockIdx.x * per_cta;
  const unsigned long long n = per_cta / stage;
  const unsigned piece = stage / pieces;
  long long t0 = clock64();
  for (unsigned long long k = 0; k < n; ++k) {
    const unsigned s = (unsigned)(k % slots);
    if (k >= slots) while (!try_wait(&full[s], (unsigned)((k / slots - 1) & 1))) {}
    if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(&full[s])), "r"(stage) : "memory");
    __syncwarp();
    if (lane < pieces)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(sa(ring + (size_t)s * stage + lane * piece)), "l"(base + k * stage + lane * piece), "r"(piece), "r"(sa(&full[s])) : "memory");
  }
  for (unsigned long long k = n > slots ? n - slots : 0; k < n; ++k) { const unsigned s = (unsigned)(k % slots); while (!try_wait(&full[s], (unsigned)((k / slots) & 1))) {} }
  if (lane == 0) out[blockIdx.x] = clock64() - t0;
}
int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned long long per_cta = 32ull << 20, total = per_cta * sms;
  char* src; CK(cudaMalloc(&src, total)); CK(cudaMemset(src, 1, total));
  unsigned long long* out; CK(cudaMalloc(&out, sms * 8));
  CK(cudaFuncSetAttribute(feed, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  struct Case { unsigned stage, slots, pieces; };
  std::vector<Case> cases;
  for (unsigned st : {4096u, 8192u, 16384u, 32768u, 65536u}) cases.push_back({st, std::min(64u, (160u * 1024) / st), 1});
  for (unsigned p : {2u, 4u, 8u, 16u, 32u}) cases.push_back({16384u, 10, p});
  for (unsigned p : {2u, 4u, 8u}) cases.push_back({32768u, 5, p});
  for (unsigned p : {4u, 8u, 16u}) cases.push_back({65536u, 2, p});
  for (auto c : cases) {
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
      cudaEventRecord(a);
      feed<<<sms, 32, 200 * 1024>>>(src, per_cta, c.stage, c.slots, c.pieces, out);
      cudaEventRecord(b); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b); if (r) best = std::min(best, ms);
    }
    CK(cudaGetLastError());
    printf("stage %6u B x %2u slots, %2u pieces of %6u B: %7.1f GB/s (%.2f GB/s per SM)\n", c.stage, c.slots, c.pieces, c.stage / c.pieces,
           total / best / 1e6, total / best / 1e6 / sms);
  }
  return 0;
}
