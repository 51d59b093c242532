//! The engine's one error type.

/// Errors of the decode loop; backend failures are carried inside, boxed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("empty prompt: at least one token is needed to start decoding")]
    EmptyPrompt,
    #[error("prompt token {index} has id {id}, outside the vocabulary (vocab_size = {vocab})")]
    TokenOutOfVocab { index: usize, id: u32, vocab: usize },
    #[error(
        "prompt of {prompt} tokens + {new} new tokens = {needed} positions exceeds the KV-cache capacity of {capacity} positions"
    )]
    ContextFull {
        prompt: usize,
        new: usize,
        needed: usize,
        capacity: usize,
    },
    #[error("invalid sampling value for {field}: {reason}")]
    InvalidSampling { field: &'static str, reason: String },
    #[error("{backend} backend: {source}")]
    Backend {
        backend: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}
