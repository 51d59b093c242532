//! The Qwen2.5 megakernels (CUDA C++ under `cuda/`: `core/` shared by every
//! kernel, `decode/` the ops of one decode step, `prefill/` the tensor-core
//! prompt kernel, `probes/` the bandwidth floor and the 32-bit trap probe;
//! `megakernel.cu` includes them all) and the code that turns a model's
//! split plan into a cubin.
//!
//! ```no_run
//! use qmk_kernels::{Arch, Compiler, KernelBuild};
//! let config = qmk_model::Config::preset("0.5b")?;
//! let build = KernelBuild::new(&config)?;        // plan + rendered headers
//! let cubin = Compiler::new()?.compile(&build, Arch::SM90)?; // NVRTC, cached
//! for r in cubin.resources() { println!("{r}"); }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The parameter block ([`KernelParams`]) is `#[repr(C)]` with a C++ twin in
//! `cuda/core/params.cuh`; the build renders `static_assert`s of its size and of
//! every field offset from the Rust side.

#![deny(missing_docs)]

mod compile;
mod error;
mod header;
pub mod nvrtc;
pub mod params;
pub mod source;
mod tp;

pub use compile::{
    default_cache_dir, include_dirs, parse_ptxas_log, Arch, Compiler, Cubin, Resources,
};
pub use error::{KernelsError, Result};
pub use header::{
    attn_ring, batch_vectors, decode_stage_floats, prefill_smem_bytes, prefill_smem_bytes_wgmma,
    tc_plans, KernelBuild, TcPhases, ATTN_TILE, MULTI_STATIC_SMEM, MULTI_WIDE_FROM,
    PAIR_BATCH_MOST, PREFILL_GEMM_TILE, PREFILL_WGMMA_TILE, STAGE_VECTORS, STREAM_K_TILE_ELEMS,
    TC_MIN_HIDDEN, WARPS_PER_CTA,
};
pub use nvrtc::Nvrtc;
pub use params::{
    HostStatus, KernelParams, MultiParams, PrefillParams, ProbeFillParams, ProbeParams,
    StreamParams, SyncState, FLAG_ATTN_FORCE_SPLIT, FLAG_ATTN_NO_SPLIT, FLAG_DEBUG_HANG,
    FLAG_DEBUG_OOB, FLAG_DEBUG_TP_STOP, FLAG_PF_MMA_SYNC, FLAG_PF_NO_STREAM_K,
    FLAG_TOKEN_FROM_ARGMAX, MAX_CHUNKS, MULTI_MAX_TOKENS, SKIP_SHIFT, THREADS_PER_CTA,
    TP_MAX_RANKS,
};
pub use tp::TpRegion;
