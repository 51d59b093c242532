//! The engine's one error type.

/// Errors of the decode loop; backend failures are carried inside, boxed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The prompt has no tokens.
    #[error("empty prompt: at least one token is needed to start decoding")]
    EmptyPrompt,
    /// A prompt token id is not below the model's `vocab_size`.
    #[error("prompt token {index} has id {id}, outside the vocabulary (vocab_size = {vocab})")]
    TokenOutOfVocab {
        /// Position of the token in the prompt.
        index: usize,
        /// The token id.
        id: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// The request needs more KV-cache positions than the backend holds.
    #[error(
        "prompt of {prompt} tokens + {new} new tokens = {needed} positions exceeds the KV-cache capacity of {capacity} positions"
    )]
    ContextFull {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens asked for (`max_new_tokens`).
        new: usize,
        /// Positions the request writes: `prompt + new - 1`.
        needed: usize,
        /// Positions the backend's KV cache holds.
        capacity: usize,
    },
    /// A sampling setting is out of range.
    #[error("invalid sampling value for {field}: {reason}")]
    InvalidSampling {
        /// The [`crate::Sampling`] field at fault.
        field: &'static str,
        /// The value and what it must be.
        reason: String,
    },
    /// A multi-token step's input is out of range.
    #[error("invalid multi-token step: {field}: {reason}")]
    InvalidStep {
        /// The field at fault (`tokens`, `start`).
        field: &'static str,
        /// The value and what it must be.
        reason: String,
    },
    /// A speculative decoding setting is out of range.
    #[error("invalid speculative decoding option {field}: {reason}")]
    InvalidSpeculation {
        /// The [`crate::speculative::SpeculativeOptions`] field (or other
        /// speculation setting) at fault.
        field: &'static str,
        /// The value and what it must be.
        reason: String,
    },
    /// A draft model cannot draft for the target model: their vocabularies
    /// differ on an id the draft can produce.
    #[error("draft model {draft} cannot draft for {target}: {reason}")]
    DraftVocabulary {
        /// The draft model's name.
        draft: String,
        /// The target model's name.
        target: String,
        /// The first difference found.
        reason: String,
    },
    /// The generated ids could not be turned into text.
    #[error("cannot decode the generated tokens: {source}")]
    Detokenize {
        /// The tokenizer's error (it names the tokenizer file).
        #[source]
        source: qmk_model::ModelError,
    },
    /// The backend failed; its error is the source.
    #[error("{backend} backend: {source}")]
    Backend {
        /// The backend's name ([`crate::BackendKind::name`]).
        backend: &'static str,
        /// The backend's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl EngineError {
    /// A tokenizer error met while decoding the output.
    pub fn detokenize(source: qmk_model::ModelError) -> Self {
        EngineError::Detokenize { source }
    }
}

/// `e` and its sources as one line, `a: b: c`, skipping a source whose text
/// the line already holds (as [`EngineError::Backend`]'s message holds its
/// source's): the form the CLI and the server report an error chain in.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let t = s.to_string();
        if !line.contains(&t) {
            line.push_str(": ");
            line.push_str(&t);
        }
        cur = s.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a message and an optional source.
    #[derive(Debug)]
    struct Link(&'static str, Option<Box<Link>>);

    impl std::fmt::Display for Link {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Link {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn error_chain_joins_the_sources_it_does_not_already_hold() {
        let lone = Link("no GPU", None);
        assert_eq!(error_chain(&lone), "no GPU");
        let chain = Link(
            "cannot open the device",
            Some(Box::new(Link(
                "driver refused",
                Some(Box::new(Link("CUDA_ERROR_NO_DEVICE", None))),
            ))),
        );
        assert_eq!(
            error_chain(&chain),
            "cannot open the device: driver refused: CUDA_ERROR_NO_DEVICE"
        );
        // The backend variant's message already holds its source's text.
        let e = EngineError::Backend {
            backend: "cudarc",
            source: Box::new(Link(
                "launch failed",
                Some(Box::new(Link("out of memory", None))),
            )),
        };
        assert_eq!(
            error_chain(&e),
            "cudarc backend: launch failed: out of memory"
        );
    }
}
