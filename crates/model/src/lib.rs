//! Qwen2.5 model description, checkpoint reading, tokenizer and chat
//! template, and the CPU reference forward pass (the oracle for every GPU
//! test and the no-GPU backend).

#![deny(missing_docs)]

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod inventory;
pub mod reference;
pub mod rope;
pub mod small_file;
pub mod synthetic;
pub mod tensor_parallel;
pub mod tokenizer;
pub mod weights;

pub use checkpoint::{load_weights, write_synthetic_checkpoint, Checkpoint, CheckpointSource};
pub use config::{Config, GenerationConfig};
pub use error::ModelError;
pub use inventory::{model_plan, stacked_specs, weight_bytes, WeightBytes, WeightKind};
pub use small_file::{read_small_file, SMALL_FILE_CAP};
pub use synthetic::{synthetic_weights, SyntheticSource};
pub use tensor_parallel::{tp_plan, ShardedReference};
pub use weights::Weights;
