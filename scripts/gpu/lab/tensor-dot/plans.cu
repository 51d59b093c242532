// plans.cu: tc_phase.cuh's plan of every weight phase of every Qwen2.5 size
// (one GPU, and the tensor-parallel ranks' shards), on a 132-SM machine with
// the lab's shared memory, printed without a GPU. A shape the plan cannot
// take fails to compile (Plan's static_asserts), so a clean build is the
// check that the port's plan holds everywhere.
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/tc-plans plans.cu && /tmp/tc-plans
#include <cstdio>

#include "tc_phase.cuh"

// The lab's machine (td.cu): 132 CTAs of 16 warps, 8 tokens, 164 KB of
// input planes and 62 KB of local partials a CTA.
template <bool STAGED>
struct H100 {
    static constexpr int grid = 132, warps = 16, tmax = 8, input_bytes = 164 * 1024, part_bytes = 62 * 1024;
    static constexpr bool tile8 = false, relacq = true, staged = STAGED;
};

template <int K, int ROWS, class M>
void row(const char* model, const char* phase) {
    using P = tcp::Plan<K, ROWS, M>;
    std::printf("| %s | %s | %d x %d | %d | %d | %d | %s | %d | %d | %d |\n", model, phase, ROWS, K, P::NKB, P::KB,
                P::KS, P::SPARSE ? "one k-step or none" : "balanced", P::SLOTS, P::MAXLT,
                (P::MAXLT + (M::staged ? 2 : 0)) * P::SLOTS * 512 / 1024);
}

// A model (or a rank's shard): hidden H, q rows Q, kv rows KV, MLP width I.
template <int H, int Q, int KV, int I, class M>
void model(const char* name) {
    row<H, Q + 2 * KV, M>(name, "q/k/v");
    row<Q, H, M>(name, "o_proj");
    row<H, 2 * I, M>(name, "gate/up");
    row<I, H, M>(name, "down");
}

int main() {
    std::printf("| model | phase | rows x K | column blocks | block columns | block k-steps | shares | slots a tile "
                "| local tiles a CTA | local partials, KB |\n|---|---|---|---|---|---|---|---|---|---|\n");
    using M = H100<false>;
    using MS = H100<true>;
    model<896, 896, 128, 4864, M>("0.5B");
    model<1536, 1536, 256, 8960, MS>("1.5B");
    model<2048, 2048, 256, 11008, MS>("3B");
    model<3584, 3584, 512, 18944, MS>("7B");
    model<5120, 5120, 1024, 13824, MS>("14B");
    model<5120, 5120, 1024, 27648, MS>("32B");
    model<8192, 8192, 1024, 29568, MS>("72B");
    // Tensor-parallel shards (heads, kv heads and the MLP split by ranks).
    model<5120, 2560, 512, 13824, MS>("32B, 2 ranks");
    model<8192, 4096, 512, 14784, MS>("72B, 2 ranks");
    model<8192, 2048, 256, 7392, MS>("72B, 4 ranks");
    return 0;
}
