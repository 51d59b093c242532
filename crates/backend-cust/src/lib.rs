//! The Qwen2.5 decode megakernel on the `cust` driver bindings: the second
//! CUDA backend, interchangeable with `qmk-backend-cudarc`.
//!
//! [`CustBackend`] loads the same cubin bytes (NVRTC at run time, cached, or
//! a file), builds the same [`qmk_kernels::KernelParams`] through the
//! backend-agnostic [`qmk_kernels::host`] code, sizes the grid from the
//! occupancy API x SMs and launches one cooperative kernel per decode step.
//! Every spin-wait in the kernel is bounded and the host has a deadline, so
//! a hang becomes an [`Error`]; a sticky CUDA error marks the engine
//! unusable. It implements [`qmk_engine::Backend`].
//!
//! cust 0.3.2 lacks cooperative launch, `cuFuncSetAttribute`, mapped host
//! memory and the newer device attributes; those calls go through
//! `cust::sys`. cust links `libcuda.so.1` at build time: on machines with no
//! CUDA, build and test against the stub from `.ci/stub-libcuda.sh`, where
//! every call returns CUDA_ERROR_NO_DEVICE and [`device_count`] reports
//! [`Error::NoDevice`].
//!
//! ```no_run
//! use qmk_backend_cust::{CustBackend, Options};
//! use qmk_engine::Backend;
//! let config = qmk_model::Config::preset("0.5b")?;
//! let weights = qmk_model::synthetic_weights(&config, 1);
//! let mut gpu = CustBackend::new(&weights, Options::default(), &mut ())?;
//! let next = gpu.step(9707, 0)?.argmax;
//! # let _ = next;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backend;
mod bench;
mod device;
mod error;
mod mem;

pub use backend::{CustBackend, Options};
pub use bench::LaunchOverhead;
pub use device::{device_count, device_info, devices, init_driver, DeviceInfo};
pub use error::{CudaCode, Error, Result};
pub use qmk_kernels::host::{BenchOptions, BenchReport, LaunchInfo, Progress};
