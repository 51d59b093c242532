//! Backend-agnostic runtime: the [`Backend`] trait every decoder implements
//! (the CPU reference, the cudarc and cust CUDA backends), sampling, and the
//! decode loop written once above them.
//!
//! ```ignore
//! let weights = qmk_model::checkpoint::load_weights(dir)?;
//! let backend = qmk_engine::CpuBackend::new(&weights, 4096)?;
//! let mut engine = qmk_engine::Engine::new(backend, weights.config.vocab_size);
//! let out = engine.generate(&prompt_ids, &GenerateOptions::default(), |_| ControlFlow::Continue(()))?;
//! ```

mod backend;
mod cpu;
mod engine;
mod error;
pub mod sampling;

pub use backend::{Backend, BackendKind, StepOutput};
pub use cpu::CpuBackend;
pub use engine::{Engine, GenerateOptions, Generation, StopReason};
pub use error::EngineError;
pub use sampling::Sampling;
