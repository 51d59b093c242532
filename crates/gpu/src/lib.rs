//! The megakernel's GPU backend, written once: [`GpuBackend`] holds every
//! piece of host logic (memory plan, weight upload, decode steps, prefill,
//! bounded waits, sticky errors, reset, benchmarks, the 32-bit trap probe)
//! over a small [`Driver`] trait that the CUDA bindings implement
//! (`qmk-backend-cudarc`, `qmk-backend-cust`). The two bindings differ only
//! in how each driver call is spelled, so they cannot drift apart.
//!
//! ```no_run
//! # fn demo<D: qmk_gpu::Driver>() -> Result<(), qmk_gpu::Error> {
//! use qmk_engine::Backend;
//! let config = qmk_model::Config::preset("0.5b")?;
//! let weights = qmk_model::synthetic_weights(&config, 1);
//! let mut gpu = qmk_gpu::GpuBackend::<D>::new(&weights, qmk_gpu::Options::default(), &mut ())?;
//! let next = gpu.step(9707, 0)?.argmax;
//! # let _ = next;
//! # Ok(())
//! # }
//! ```
//!
//! Binding-independent helpers live here too: the [`MemoryPlan`] (every
//! device allocation, sized with checked arithmetic before the first one),
//! the weight staging interface ([`WeightSource`]), the launch shape
//! ([`LaunchInfo`]) and the benchmark statistics ([`stats`]).
#![deny(missing_docs)]

mod backend;
mod bench;
mod cuda;
mod driver;
mod error;
mod options;
pub mod plan;
mod probe;
pub mod staging;
pub mod stats;
mod status;

pub use backend::GpuBackend;
pub use cuda::{cuda_error_name, describe_cubin, is_sticky, CudaCode};
pub use driver::{
    device_count, device_info, devices, DeviceAttr, DeviceMemory, Driver, MappedHost,
};
pub use error::{Error, Result};
pub use options::{
    DeviceInfo, Options, Progress, ABORT_GRACE, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_MIN_TOKENS,
    STATUS_MAPPED_ENV,
};
pub use plan::{LaunchInfo, MemoryPlan, MAX_KV_LAYER_BYTES};
pub use probe::{ProbeReport, ProbeRun};
pub use staging::{PlannedChunk, WeightSource};
pub use stats::{BenchOptions, BenchReport, LaunchOverhead, PrefillReport};
