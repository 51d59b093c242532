//! The crate's one error type.

use cudarc::driver::DriverError;

/// Everything the cudarc backend can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver: libcuda.so.1 could not be loaded (is an NVIDIA GPU and driver installed?)"
    )]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("no CUDA device: the driver reports zero GPUs")]
    NoDevice,
    /// A device index past the device count.
    #[error("CUDA device {index} does not exist ({count} device(s))")]
    DeviceIndex { index: usize, count: usize },
    /// A driver call failed (not a sticky error).
    #[error("CUDA {call} failed: {source}")]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    /// A sticky CUDA error: the context is corrupt; this engine is unusable.
    #[error(
        "the engine is unusable after a sticky CUDA error ({reason}); create a new process/engine"
    )]
    Unusable { reason: String },
    /// Not enough free device memory.
    #[error("not enough GPU memory for {what}: need {needed} bytes, {available} bytes free")]
    OutOfMemory {
        what: String,
        needed: u64,
        available: u64,
    },
    /// The cubin is for another GPU architecture.
    #[error("the cubin was built for {cubin} but the device is {device}: {source}")]
    CubinArch {
        cubin: String,
        device: String,
        #[source]
        source: DriverError,
    },
    /// The cubin was compiled for a different model, plan or kernel source.
    #[error("the cubin was built for another model or kernel version (fingerprint {found:#x}, expected {expected:#x}); recompile it for this config")]
    Fingerprint { expected: u64, found: u64 },
    /// The kernel needs more shared memory than the device allows.
    #[error(
        "the megakernel needs {needed} bytes of shared memory per CTA; {device} allows {available}"
    )]
    SharedMemory {
        needed: u32,
        available: u32,
        device: String,
    },
    /// Cooperative launch unsupported, or no CTA fits on an SM.
    #[error("cannot launch the megakernel cooperatively on {device}: {reason}")]
    Launch { device: String, reason: String },
    /// The kernel reported an error (barrier timeout, abort, bad input).
    #[error("megakernel error: {what} (phase {phase}, layer {layer}, CTA {cta}); call reset() before the next step")]
    Kernel {
        code: u32,
        what: &'static str,
        phase: &'static str,
        layer: u32,
        cta: u32,
    },
    /// The host deadline passed.
    #[error("decode step did not finish within {deadline_ms} ms; {detail}")]
    Timeout { deadline_ms: u128, detail: String },
    /// A kernel error left the cache inconsistent.
    #[error("the engine needs reset() after an earlier error: {0}")]
    NeedsReset(String),
    /// Input token outside the vocabulary.
    #[error("token id {token} is outside the vocabulary (size {vocab})")]
    Token { token: u32, vocab: usize },
    /// Position beyond the KV capacity or out of order.
    #[error("position {pos} is invalid: {reason}")]
    Position { pos: usize, reason: String },
    /// Bad options (capacity etc.).
    #[error("invalid option {field}: {reason}")]
    Option { field: &'static str, reason: String },
    /// A weight tensor missing or of the wrong length.
    #[error("weight tensor {tensor}: {reason}")]
    Weights { tensor: String, reason: String },
    /// Size arithmetic overflowed.
    #[error("size of {0} overflows")]
    Overflow(String),
    /// Compiling or loading the kernel (NVRTC missing, compile error, ...).
    #[error(transparent)]
    Kernels(Box<qmk_kernels::KernelsError>),
    #[error(transparent)]
    Model(Box<qmk_model::ModelError>),
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

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// CUDA errors after which the context cannot be used again (the list is
/// [`qmk_kernels::host::is_sticky`], shared with the cust backend).
pub fn is_sticky(e: &DriverError) -> bool {
    qmk_kernels::host::is_sticky(e.0 as u32)
}
