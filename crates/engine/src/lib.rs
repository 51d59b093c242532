//! Backend-agnostic runtime: the [`Backend`] trait every decoder implements
//! (the CPU reference, the cudarc and cust CUDA backends), sampling, the
//! decode loop written once above them, and text on top of it (stop strings,
//! streamed deltas: [`text`]). [`speculative`] decoding, a mode of
//! [`Engine::generate`], checks guesses from [`draft`] (prompt lookup, a
//! draft model) in multi-token steps ([`Backend::step_many`]): the same
//! greedy output, or the same sampling distribution, in fewer steps.
//!
//! ```
//! use std::{ops::ControlFlow, sync::Arc};
//! use qmk_engine::{CpuBackend, Engine, GenerateOptions};
//!
//! // A tiny random model; `qmk_model::load_weights(dir)` reads a real one.
//! let mut config = qmk_model::Config::preset("0.5b")?;
//! (config.hidden_size, config.intermediate_size, config.num_hidden_layers) = (32, 64, 2);
//! (config.num_attention_heads, config.num_key_value_heads, config.head_dim) = (4, Some(2), Some(8));
//! config.vocab_size = 64;
//! let weights = Arc::new(qmk_model::synthetic_weights(&config, 0));
//!
//! let backend = CpuBackend::new(weights.clone(), 256)?;
//! let mut engine = Engine::new(backend, weights.config.vocab_size);
//! let opts = GenerateOptions { max_new_tokens: 4, ..GenerateOptions::default() };
//! let out = engine.generate(&[1, 2, 3], &opts, |_| ControlFlow::Continue(()))?;
//! assert_eq!(out.output_ids.len(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod backend;
mod cpu;
pub mod draft;
mod engine;
mod error;
pub mod sampling;
pub mod speculative;
#[cfg(test)]
mod test_models;
pub mod text;

pub use backend::{
    Backend, BackendKind, MultiStep, MultiStepOutput, RunningMean, StepOutput, MAX_STEP_TOKENS,
};
pub use cpu::{CpuBackend, CpuTpBackend};
pub use engine::{Engine, GenerateOptions, Generation, StopReason};
pub use error::{error_chain, EngineError};
pub use sampling::{Sampling, SamplingDefaults, SamplingRequest};
pub use speculative::{SpeculateMode, SpeculativeOptions, SpeculativeStats};
pub use text::{StopMatcher, TextDelta, TextStream};
