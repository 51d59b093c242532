//! The crate's one error type.

use crate::cuda::CudaCode;

/// Everything a GPU backend can report, whichever driver binding runs it.
/// Driver failures carry the driver's result code and the call that
/// returned it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver: libcuda.so.1 could not be loaded (is an NVIDIA GPU and driver installed?)"
    )]
    NoDriver,
    /// The driver reports no device (on a machine without a GPU, or with
    /// the CI's stub libcuda).
    #[error("no CUDA device: the driver reports {0} (is an NVIDIA GPU and driver installed?)")]
    NoDevice(CudaCode),
    /// A device index past the device count.
    #[error("CUDA device {index} does not exist ({count} device(s))")]
    DeviceIndex {
        /// The ordinal asked for.
        index: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A driver call failed (not a sticky error).
    #[error("CUDA {call} failed: {code}")]
    Driver {
        /// The driver call, with what it was for.
        call: &'static str,
        /// Its result code.
        code: CudaCode,
    },
    /// A sticky CUDA error: the context is corrupt; this engine is unusable.
    #[error(
        "the engine is unusable after a sticky CUDA error ({reason}); create a new process/engine"
    )]
    Unusable {
        /// The call and code that made it unusable, or the hang that did.
        reason: String,
    },
    /// Not enough free device memory.
    #[error("not enough GPU memory for {what}: need {needed} bytes, {available} bytes free")]
    OutOfMemory {
        /// The allocation (a weight chunk, a buffer, the whole plan).
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// Bytes free on the device.
        available: u64,
    },
    /// The cubin is for another GPU architecture.
    #[error("the cubin was built for {cubin} but the device is {device}: {code}")]
    CubinArch {
        /// What the cubin's ELF header says ([`crate::describe_cubin`]).
        cubin: String,
        /// The device and its architecture.
        device: String,
        /// The driver's answer to loading it.
        code: CudaCode,
    },
    /// The cubin was compiled for a different model, plan or kernel source.
    #[error("the cubin was built for another model or kernel version (fingerprint {found:#x}, expected {expected:#x}); recompile it for this config")]
    Fingerprint {
        /// This build's fingerprint.
        expected: u64,
        /// The cubin's.
        found: u64,
    },
    /// A kernel needs more shared memory than the device allows.
    #[error(
        "the {kernel} needs {needed} bytes of shared memory per CTA; {device} allows {available}"
    )]
    SharedMemory {
        /// Which kernel (decode megakernel, prefill kernel).
        kernel: &'static str,
        /// Bytes per CTA it needs.
        needed: u32,
        /// The device's opt-in limit.
        available: u32,
        /// The device and its architecture.
        device: String,
    },
    /// Cooperative launch unsupported, or no CTA fits on an SM.
    #[error("cannot launch the megakernel cooperatively on {device}: {reason}")]
    Launch {
        /// The device.
        device: String,
        /// Why.
        reason: String,
    },
    /// The kernel reported an error (barrier timeout, abort, bad input).
    #[error("megakernel error: {what} (phase {phase}, layer {layer}, CTA {cta}); call reset() before the next step")]
    Kernel {
        /// The kernel's error code (`qmk_kernels::params::err`).
        code: u32,
        /// The code in words.
        what: &'static str,
        /// The phase it happened in.
        phase: &'static str,
        /// The layer.
        layer: u32,
        /// The CTA that reported it.
        cta: u32,
    },
    /// The host deadline passed.
    #[error("decode step did not finish within {deadline_ms} ms; {detail}")]
    Timeout {
        /// The deadline.
        deadline_ms: u128,
        /// What happened after the abort flag was raised.
        detail: String,
    },
    /// A kernel error left the cache inconsistent.
    #[error("the engine needs reset() after an earlier error: {0}")]
    NeedsReset(String),
    /// Input token outside the vocabulary.
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    Token {
        /// The token.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Position beyond the KV capacity or out of order.
    #[error("position {pos} is invalid: {reason}")]
    Position {
        /// The position.
        pos: usize,
        /// Why it is refused.
        reason: String,
    },
    /// Bad options (capacity, prefill chunk, bench steps...).
    #[error("invalid option {field}: {reason}")]
    Option {
        /// The option.
        field: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// A weight tensor missing, of the wrong length, or not in the plan.
    #[error("weight tensor {tensor}: {reason}")]
    Weights {
        /// The tensor.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Fewer CUDA devices than a tensor-parallel group's ranks.
    #[error("tensor parallelism over {wanted} GPUs needs {wanted} CUDA devices; this machine has {found} (co-resident ranks run on one)")]
    Devices {
        /// Ranks asked for.
        wanted: usize,
        /// Devices the driver reports.
        found: usize,
    },
    /// A tensor-parallel rank's failure (the group needs a reset).
    #[error("tensor-parallel rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// Its error.
        source: Box<Error>,
    },
    /// Size arithmetic overflowed.
    #[error("size of {0} overflows")]
    Overflow(String),
    /// Compiling or loading the kernel (NVRTC missing, compile error, ...).
    #[error(transparent)]
    Kernels(Box<qmk_kernels::KernelsError>),
    /// The model crate refused the config or weights.
    #[error(transparent)]
    Model(Box<qmk_model::ModelError>),
    /// The layout crate refused a plan.
    #[error(transparent)]
    Layout(Box<qmk_layout::LayoutError>),
}

impl From<qmk_kernels::KernelsError> for Error {
    fn from(e: qmk_kernels::KernelsError) -> Self {
        Error::Kernels(Box::new(e))
    }
}

impl From<qmk_model::ModelError> for Error {
    fn from(e: qmk_model::ModelError) -> Self {
        Error::Model(Box::new(e))
    }
}

impl From<qmk_layout::LayoutError> for Error {
    fn from(e: qmk_layout::LayoutError) -> Self {
        Error::Layout(Box::new(e))
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A failed driver `call`: a sticky code makes [`Error::Unusable`].
    pub fn driver(call: &'static str, code: CudaCode) -> Error {
        if code.is_sticky() {
            Error::Unusable {
                reason: format!("{call}: {code}"),
            }
        } else {
            Error::Driver { call, code }
        }
    }

    /// `map_err` adapter: `driver_call().map_err(Error::at("cuXxx"))`.
    pub fn at(call: &'static str) -> impl FnOnce(CudaCode) -> Error {
        move |code| Error::driver(call, code)
    }

    /// `true` for the errors after which the engine is gone for good.
    pub fn is_unusable(&self) -> bool {
        match self {
            Error::Unusable { .. } => true,
            Error::Rank { source, .. } => source.is_unusable(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_make_the_engine_unusable() {
        let e = Error::driver("cuEventQuery (kernel execution)", CudaCode(700));
        assert!(e.is_unusable(), "{e:?}");
        assert!(
            e.to_string()
                .contains("cuEventQuery (kernel execution): CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{e}"
        );
        let e = Error::at("cuMemAlloc")(CudaCode(1));
        assert_eq!(
            e.to_string(),
            "CUDA cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
        );
        assert!(Error::NoDevice(CudaCode::NO_DEVICE)
            .to_string()
            .contains("no CUDA device"));
    }
}
