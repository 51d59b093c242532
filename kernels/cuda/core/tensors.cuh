// core/tensors.cuh: how the kernel addresses a weight tensor through the split
// plan's chunks, in the offset model's arithmetic (koff_t, 32-bit bytes).
//
// A stacked tensor [L, N, K] is cut along L into chunks; chunk c holds layers
// [kChunkStart[c], kChunkStart[c+1]) at its own base pointer (Params). The
// offset of (layer, n, k) is computed relative to its chunk base, in koff_t:
//     off = (layer - start_c) * stride0_bytes + n * stride1_bytes + k * elem
// The planner guarantees that off < 2^32 inside every chunk; with a plan
// forced to one chunk the same expression wraps (the trap probe shows it).
#pragma once

namespace qmk {

// The one offset expression shared by the megakernel and the trap probe.
// All operands and the result are koff_t: products wrap mod 2^32 exactly as
// the offset model says they do.
__device__ __forceinline__ koff_t offset3(koff_t i0, koff_t i1, koff_t i2, koff_t s0_bytes,
                                          koff_t s1_bytes, koff_t s2_bytes) {
    return i0 * s0_bytes + i1 * s1_bytes + i2 * s2_bytes;
}

// Compile-time description of one planned tensor (from qmk_plan::<name>).
#define QMK_TENSOR_TRAITS(NAME)                                                             \
    struct NAME##_t {                                                                        \
        static constexpr u32 kRank = (u32)qmk_plan::NAME::kRank;                            \
        static constexpr u32 kChunks = (u32)qmk_plan::NAME::kNumChunks;                     \
        static constexpr u64 kStride0 = (u64)qmk_plan::NAME::kStride[0];                    \
        static constexpr u64 kStride1 = kRank > 1 ? (u64)qmk_plan::NAME::kStride[kRank > 1 ? 1 : 0] : 0; \
        static constexpr u64 kShape0 = (u64)qmk_plan::NAME::kShape[0];                      \
        static constexpr u64 kShape1 = kRank > 1 ? (u64)qmk_plan::NAME::kShape[kRank > 1 ? 1 : 0] : 0; \
        static constexpr u64 kShape2 = kRank > 2 ? (u64)qmk_plan::NAME::kShape[kRank > 2 ? 2 : 0] : 0; \
        template <u32 C>                                                                     \
        struct start {                                                                       \
            static constexpr u32 v = (u32)qmk_plan::NAME::kChunkStart[C];                   \
        };                                                                                   \
        static_assert(kChunks >= 1 && kChunks <= QMK_MAX_CHUNKS,                            \
                      #NAME ": chunk count exceeds QMK_MAX_CHUNKS");                        \
    };

// Stacked tensors: outer axis = layer.
QMK_TENSOR_TRAITS(input_layernorm)
QMK_TENSOR_TRAITS(q_proj)
QMK_TENSOR_TRAITS(q_bias)
QMK_TENSOR_TRAITS(k_proj)
QMK_TENSOR_TRAITS(k_bias)
QMK_TENSOR_TRAITS(v_proj)
QMK_TENSOR_TRAITS(v_bias)
QMK_TENSOR_TRAITS(o_proj)
QMK_TENSOR_TRAITS(post_attention_layernorm)
QMK_TENSOR_TRAITS(gate_proj)
QMK_TENSOR_TRAITS(up_proj)
QMK_TENSOR_TRAITS(down_proj)

// Rows of a band where a tensor's layers are stored in tile order
// (qmk_layout::TileOrder), 0 in row-major order: the weights the decode
// step reads on tensor cores (decode/tc_phase.cuh), o_proj and down in
// 16-row bands, q, k, v, gate and up in 8-row ones; the weight upload
// permutes them.
template <class T>
struct TileOrder {
    static constexpr u32 rows = 0;
};
#define QMK_TILE_ORDER(NAME, ROWS)                                \
    template <>                                                   \
    struct TileOrder<NAME##_t> {                                  \
        static constexpr u32 rows = QMK_TC_PHASES ? (ROWS) : 0u;  \
    };
QMK_TILE_ORDER(q_proj, 8u)
QMK_TILE_ORDER(k_proj, 8u)
QMK_TILE_ORDER(v_proj, 8u)
QMK_TILE_ORDER(o_proj, 16u)
QMK_TILE_ORDER(gate_proj, 8u)
QMK_TILE_ORDER(up_proj, 8u)
QMK_TILE_ORDER(down_proj, 16u)
#undef QMK_TILE_ORDER

// Chunk holding `layer` (compile-time chunk table, runtime layer).
template <class T, u32 C = 0>
__device__ __forceinline__ u32 chunk_of(u32 layer) {
    if constexpr (C + 1 >= T::kChunks) {
        return C;
    } else {
        if (layer < T::template start<C + 1>::v) return C;
        return chunk_of<T, C + 1>(layer);
    }
}

template <class T, u32 C = 0>
__device__ __forceinline__ u32 chunk_first_layer(u32 c) {
    if constexpr (C + 1 >= T::kChunks) {
        return T::template start<C>::v;
    } else {
        if (c == C) return T::template start<C>::v;
        return chunk_first_layer<T, C + 1>(c);
    }
}

// chunks[c] with constant indices only: the parameter block is never
// indexed at run time (that would force a local copy of it, or generic
// addressing of the parameter space).
template <class T, u32 C = 0>
__device__ __forceinline__ u64 chunk_base(const u64 (&chunks)[QMK_MAX_CHUNKS], u32 c) {
    if constexpr (C + 1 >= T::kChunks) {
        return chunks[C];
    } else {
        return c == C ? chunks[C] : chunk_base<T, C + 1>(chunks, c);
    }
}

// A layer's slice of a stacked tensor: its chunk base and the layer's index
// inside the chunk. Rows are then addressed with row() in koff_t.
template <class T>
struct LayerView {
    const char* base;  // chunk base
    koff_t li;         // layer index inside its chunk

    __device__ __forceinline__ LayerView(const u64 (&chunks)[QMK_MAX_CHUNKS], u32 layer) {
        const u32 c = chunk_of<T>(layer);
        base = reinterpret_cast<const char*>(chunk_base<T>(chunks, c));
        li = (koff_t)(layer - chunk_first_layer<T>(c));
    }
    // Row n of a rank-3 tensor [L, N, K]: the whole offset in koff_t. The
    // matvec then walks the row (< K * 2 bytes) from this pointer.
    __device__ __forceinline__ const char* row(u32 n) const {
        return base + offset3(li, (koff_t)n, 0, (koff_t)(T::kStride0 * 2u),
                              (koff_t)(T::kStride1 * 2u), 2u);
    }
    // Address of element n of a rank-2 tensor [L, N] (norm weights, biases).
    __device__ __forceinline__ const char* at(u32 n) const {
        return base + offset3(li, 0, (koff_t)n, (koff_t)(T::kStride0 * 2u), 0, 2u);
    }
    // Element n of a rank-2 tensor [L, N].
    __device__ __forceinline__ float elem(u32 n) const { return ld_bf16(at(n)); }
};

// Non-stacked [V, H] tables (embedding, LM head) and the final norm [H]: one
// chunk, row offsets in koff_t.
__device__ __forceinline__ const char* table_row(u64 base, u32 row) {
    return reinterpret_cast<const char*>(base) + (koff_t)((koff_t)row * (koff_t)(QMK_HIDDEN * 2u));
}

}  // namespace qmk
