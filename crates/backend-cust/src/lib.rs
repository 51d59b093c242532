//! The Qwen2.5 decode megakernel on the `cust` driver bindings:
//! [`CustDriver`] implements [`qmk_gpu::Driver`], and [`CustBackend`] is
//! [`qmk_gpu::GpuBackend`] over it, interchangeable with
//! `qmk-backend-cudarc` (the same host code, cubin, parameter blocks and
//! grid; only the driver calls differ).
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
#![deny(missing_docs)]

mod driver;

pub use driver::CustDriver;
qmk_gpu::driver_api!(CustDriver, CustBackend, "cust");
