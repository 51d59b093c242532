//! The Qwen2.5 decode megakernel on the `cudarc` driver bindings.
//!
//! [`CudarcBackend`] loads the cubin (NVRTC at run time, cached, or a file),
//! uploads the weights split per the kernel's plan, sizes the KV cache, and
//! launches one cooperative kernel per decode step (grid = occupancy x SMs).
//! Every spin-wait in the kernel is bounded and the host has a deadline, so
//! a hang becomes an [`Error`]; a sticky CUDA error marks the engine
//! unusable. It implements [`qmk_engine::Backend`].
//!
//! The binding-independent host logic (options, launch shape, memory plan,
//! weight staging, parameter block, statistics) is
//! [`qmk_kernels::host`], shared with `qmk-backend-cust`.
//!
//! Also here: the bandwidth floor ([`CudarcBackend::stream_bandwidth`]), the
//! benchmark ([`CudarcBackend::bench`]) and the 32-bit trap probe
//! ([`CudarcBackend::trap_probe`]).

mod backend;
mod bench;
mod device;
mod error;
mod mem;
mod probe;

pub use backend::{CudarcBackend, Options};
pub use device::{device_count, device_info, devices, init_driver};
pub use error::{Error, Result};
pub use probe::{ProbeReport, ProbeRun};
pub use qmk_kernels::host::{
    BenchOptions, BenchReport, DeviceInfo, LaunchInfo, MemoryPlan, PrefillReport, Progress,
};
