//! The Qwen2.5 decode megakernel (CUDA C++, one file per fused op under
//! `cuda/`) and the code that turns a model's split plan into a cubin.
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
//! `cuda/params.cuh`; the build renders `static_assert`s of its size and of
//! every field offset from the Rust side.

mod compile;
mod error;
mod header;
pub mod nvrtc;
pub mod params;
pub mod source;

pub use compile::{
    default_cache_dir, include_dirs, parse_ptxas_log, Arch, Compiler, Cubin, Resources,
};
pub use error::{KernelsError, Result};
pub use header::{
    prefill_smem_bytes, prefill_smem_bytes_wgmma, KernelBuild, PREFILL_GEMM_TILE,
    PREFILL_WGMMA_TILE, STREAM_K_TILE_ELEMS, WARPS_PER_CTA,
};
pub use nvrtc::Nvrtc;
pub use params::{
    HostStatus, KernelParams, PrefillParams, ProbeFillParams, ProbeParams, StreamParams, SyncState,
    FLAG_DEBUG_HANG, FLAG_TOKEN_FROM_ARGMAX, MAX_CHUNKS, THREADS_PER_CTA,
};
