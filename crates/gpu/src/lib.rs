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
mod tp;
pub mod trace;
pub mod upload;

pub use backend::{GpuBackend, DEFAULT_POSITION_COST};
pub use bench::MIN_STREAM_BYTES;
pub use cuda::{cuda_error_name, describe_cubin, is_sticky, CudaCode};
pub use driver::{
    device_count, device_info, devices, tensor_map_bytes, DeviceAttr, DeviceMemory, Driver,
    LaunchShape, MappedHost, TensorMap2d, TENSOR_MAP_BYTES,
};
pub use error::{Error, Result};
pub use options::{
    DeviceInfo, Options, Progress, ABORT_GRACE, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_MIN_TOKENS,
    STATUS_MAPPED_ENV,
};
pub use plan::{largest_context, LaunchInfo, MemoryPlan, FIT_RESERVE_BYTES, MAX_KV_LAYER_BYTES};
pub use probe::{ProbeReport, ProbeRun};
pub use staging::{PlannedChunk, WeightSource};
pub use stats::{BenchOptions, BenchReport, LaunchOverhead, PrefillReport};
pub use tp::{RankSource, TpBackend, TpOptions};
pub use trace::{AttentionParts, StepTrace, Timeline, TimelineRow};
pub use upload::{UploadOptions, UploadStats};

/// The public API of a driver crate, written once: re-exports of the
/// backend's types, `$backend` (the backend over `$driver`), and the device
/// queries through `$driver`. A driver crate calls it once at its root.
#[macro_export]
macro_rules! driver_api {
    ($driver:ident, $backend:ident, $binding:literal) => {
        pub use $crate::{
            AttentionParts, BenchOptions, BenchReport, CudaCode, DeviceInfo, Error, LaunchInfo,
            LaunchOverhead, MemoryPlan, Options, PrefillReport, ProbeReport, ProbeRun, Progress,
            Result, StepTrace, Timeline, TimelineRow, TpOptions, UploadOptions, UploadStats,
        };

        #[doc = concat!("The megakernel engine on one GPU through ", $binding, ".")]
        pub type $backend = $crate::GpuBackend<$driver>;

        #[doc = concat!("The megakernel engine over a tensor-parallel group of GPUs through ", $binding, ".")]
        pub type TpBackend = $crate::TpBackend<$driver>;

        /// Number of CUDA devices ([`Error::NoDriver`] without a CUDA
        /// driver, [`Error::NoDevice`] without a device).
        pub fn device_count() -> Result<usize> {
            $crate::device_count::<$driver>()
        }

        /// Describes device `ordinal`.
        pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
            $crate::device_info::<$driver>(ordinal)
        }

        /// Every device.
        pub fn devices() -> Result<Vec<DeviceInfo>> {
            $crate::devices::<$driver>()
        }
    };
}
