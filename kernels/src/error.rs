//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong turning a model plan into a cubin.
#[derive(Debug, thiserror::Error)]
pub enum KernelsError {
    /// No NVRTC library could be loaded.
    #[error(
        "NVRTC was not found (tried: {tried}); install it with `bash .ci/nvrtc.sh` \
         (pip wheels, no GPU needed) and set QMK_NVRTC_LIB, or load a prebuilt cubin"
    )]
    NvrtcNotFound {
        /// The library paths and loader names tried, comma-separated.
        tried: String,
    },
    /// The library loaded but lacks an entry point.
    #[error("NVRTC library {path}: missing symbol `{symbol}`: {source}")]
    NvrtcSymbol {
        /// The library file or loader name.
        path: PathBuf,
        /// The missing entry point.
        symbol: &'static str,
        /// The loader's error.
        #[source]
        source: libloading::Error,
    },
    /// An NVRTC call returned an error code.
    #[error("NVRTC {call} failed with code {code}: {message}")]
    NvrtcCall {
        /// The NVRTC function called.
        call: &'static str,
        /// Its `nvrtcResult` code.
        code: i32,
        /// NVRTC's description of the code.
        message: String,
    },
    /// The kernel did not compile; the log names the file and line.
    #[error("compiling the megakernel for {arch} failed:\n{log}")]
    Compile {
        /// The target architecture.
        arch: String,
        /// NVRTC's compilation log.
        log: String,
    },
    /// An architecture string that is not `sm_XY` / `XY`.
    #[error("unsupported GPU architecture `{0}` (expected sm_80, sm_86, sm_89, sm_90, ...)")]
    BadArch(String),
    /// The plan lacks a tensor the kernel addresses, or has too many chunks.
    #[error("tensor {tensor}: {reason}")]
    Plan {
        /// The plan name of the tensor.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A model dimension the kernel cannot take.
    #[error("model field {field}: {reason}")]
    Config {
        /// The config field.
        field: &'static str,
        /// Why the kernel cannot take its value.
        reason: String,
    },
    /// Reading or writing a cubin (cache or file).
    #[error("cubin file {path}: {source}")]
    Io {
        /// The cubin file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The model crate refused the config (validation, inventory, plan).
    #[error(transparent)]
    Model(Box<qmk_model::ModelError>),
    /// The layout crate refused the plan (header rendering).
    #[error(transparent)]
    Layout(Box<qmk_layout::LayoutError>),
}

impl From<qmk_model::ModelError> for KernelsError {
    fn from(e: qmk_model::ModelError) -> Self {
        KernelsError::Model(Box::new(e))
    }
}

impl From<qmk_layout::LayoutError> for KernelsError {
    fn from(e: qmk_layout::LayoutError) -> Self {
        KernelsError::Layout(Box::new(e))
    }
}

/// A result whose error is [`KernelsError`].
pub type Result<T, E = KernelsError> = std::result::Result<T, E>;
