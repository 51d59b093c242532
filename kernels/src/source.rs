//! The CUDA sources, embedded at build time (one file per fused op).

/// The translation unit NVRTC compiles.
pub const MAIN: (&str, &str) = ("megakernel.cu", include_str!("../cuda/megakernel.cu"));

/// Headers it includes, by include name. `qmk_plan.h` and
/// `qmk_params_check.h` are rendered per model (see [`crate::KernelBuild`]).
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../cuda/common.cuh")),
    ("params.cuh", include_str!("../cuda/params.cuh")),
    ("tensors.cuh", include_str!("../cuda/tensors.cuh")),
    ("matvec.cuh", include_str!("../cuda/matvec.cuh")),
    ("embed.cuh", include_str!("../cuda/embed.cuh")),
    ("rms_norm.cuh", include_str!("../cuda/rms_norm.cuh")),
    ("rotary.cuh", include_str!("../cuda/rotary.cuh")),
    ("kv_append.cuh", include_str!("../cuda/kv_append.cuh")),
    ("barrier.cuh", include_str!("../cuda/barrier.cuh")),
    ("qkv_proj.cuh", include_str!("../cuda/qkv_proj.cuh")),
    ("attention.cuh", include_str!("../cuda/attention.cuh")),
    ("o_proj.cuh", include_str!("../cuda/o_proj.cuh")),
    ("mlp.cuh", include_str!("../cuda/mlp.cuh")),
    ("lm_head.cuh", include_str!("../cuda/lm_head.cuh")),
    ("argmax.cuh", include_str!("../cuda/argmax.cuh")),
    ("stream.cuh", include_str!("../cuda/stream.cuh")),
    ("trap_probe.cuh", include_str!("../cuda/trap_probe.cuh")),
    ("prefill_mma.cuh", include_str!("../cuda/prefill_mma.cuh")),
    ("prefill_gemm.cuh", include_str!("../cuda/prefill_gemm.cuh")),
    (
        "prefill_wgmma.cuh",
        include_str!("../cuda/prefill_wgmma.cuh"),
    ),
    ("prefill_norm.cuh", include_str!("../cuda/prefill_norm.cuh")),
    ("prefill_rope.cuh", include_str!("../cuda/prefill_rope.cuh")),
    (
        "prefill_attention.cuh",
        include_str!("../cuda/prefill_attention.cuh"),
    ),
    ("prefill_ops.cuh", include_str!("../cuda/prefill_ops.cuh")),
    ("prefill.cuh", include_str!("../cuda/prefill.cuh")),
];

/// Kernel entry points in the cubin.
pub mod entry {
    pub const DECODE_STEP: &str = "qmk_decode_step";
    /// One prompt chunk (`qmk::PrefillParams`), tensor cores.
    pub const PREFILL_CHUNK: &str = "qmk_prefill_chunk";
    pub const STREAM_READ: &str = "qmk_stream_read";
    pub const TRAP_PROBE: &str = "qmk_trap_probe";
    pub const PROBE_FILL: &str = "qmk_probe_fill";
    /// `__device__` u64 identifying the model/plan/sources the cubin was
    /// built from.
    pub const FINGERPRINT: &str = "qmk_fingerprint";
}
