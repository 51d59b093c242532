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
qmk_gpu::driver_api!(CudarcDriver, CudarcBackend, "cudarc");
