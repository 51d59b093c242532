//! The Qwen2.5 decode megakernel on the `cudarc` driver bindings:
//! [`CudarcDriver`] implements [`qmk_gpu::Driver`], and [`CudarcBackend`]
//! is [`qmk_gpu::GpuBackend`] over it (construction, weight upload, decode
//! steps, prefill, bounded waits, sticky errors, benchmarks and the trap
//! probe are written once there, shared with `qmk-backend-cust`).
//!
//! cudarc loads libcuda at run time: this crate builds everywhere, and
//! [`device_count`] reports [`Error::NoDriver`] on a machine without one.
//!
//! ```no_run
//! use qmk_backend_cudarc::{CudarcBackend, Options};
//! use qmk_engine::Backend;
//! let config = qmk_model::Config::preset("0.5b")?;
//! let weights = qmk_model::synthetic_weights(&config, 1);
//! let mut gpu = CudarcBackend::new(&weights, Options::default(), &mut ())?;
//! let next = gpu.step(9707, 0)?.argmax;
//! # let _ = next;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod driver;

pub use driver::CudarcDriver;
pub use qmk_gpu::{
    BenchOptions, BenchReport, CudaCode, DeviceInfo, Error, LaunchInfo, LaunchOverhead, MemoryPlan,
    Options, PrefillReport, ProbeReport, ProbeRun, Progress, Result,
};

/// The megakernel engine on one GPU through cudarc.
pub type CudarcBackend = qmk_gpu::GpuBackend<CudarcDriver>;

/// Number of CUDA devices ([`Error::NoDriver`] / [`Error::NoDevice`] when
/// none).
pub fn device_count() -> Result<usize> {
    qmk_gpu::device_count::<CudarcDriver>()
}

/// Describes device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    qmk_gpu::device_info::<CudarcDriver>(ordinal)
}

/// Every device.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    qmk_gpu::devices::<CudarcDriver>()
}
