//! The crate's one error type.

use std::fmt;

use cust::error::CudaError;
use cust::sys;
use qmk_kernels::host::{cuda_error_name, is_sticky};

/// A CUDA driver result code, described without asking the driver (a stub
/// libcuda cannot describe its own errors, and cust's `Display` for
/// [`CudaError`] panics when `cuGetErrorString` fails).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaCode(pub u32);

impl CudaCode {
    pub fn from_raw(r: sys::CUresult) -> CudaCode {
        CudaCode(r as u32)
    }
    /// cust folds codes it does not know into `UnknownError` (999).
    pub fn from_cust(e: CudaError) -> CudaCode {
        CudaCode(e as u32)
    }
    pub fn is_sticky(self) -> bool {
        is_sticky(self.0)
    }
}

impl fmt::Display for CudaCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, what) = cuda_error_name(self.0);
        write!(f, "{name} ({}): {what}", self.0)
    }
}

/// Everything the cust backend can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The driver reports no device (on a machine without a GPU, or with
    /// the CI's stub libcuda).
    #[error("no CUDA device: cuInit reports {0} (is an NVIDIA GPU and driver installed?)")]
    NoDevice(CudaCode),
    /// A device index past the device count.
    #[error("CUDA device {index} does not exist ({count} device(s))")]
    DeviceIndex { index: usize, count: usize },
    /// A driver call failed (not a sticky error).
    #[error("CUDA {call} failed: {code}")]
    Driver { call: &'static str, code: CudaCode },
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
    #[error("the cubin was built for {cubin} but the device is {device}: {code}")]
    CubinArch {
        cubin: String,
        device: String,
        code: CudaCode,
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
    /// Size arithmetic overflowed.
    #[error("size of {0} overflows")]
    Overflow(String),
    #[error(transparent)]
    Kernels(#[from] qmk_kernels::KernelsError),
    #[error(transparent)]
    Model(Box<qmk_model::ModelError>),
    #[error(transparent)]
    Layout(Box<qmk_layout::LayoutError>),
}

// Boxed: both are large, and every `Result` of the crate carries this enum.
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

/// Maps a failed driver call: a sticky code makes [`Error::Unusable`].
pub(crate) fn driver(call: &'static str, code: CudaCode) -> Error {
    if code.is_sticky() {
        Error::Unusable {
            reason: format!("{call}: {code}"),
        }
    } else {
        Error::Driver { call, code }
    }
}

/// `?`-friendly: `cust_call().map_err(cu("cuXxx"))`.
pub(crate) fn cu(call: &'static str) -> impl FnOnce(CudaError) -> Error {
    move |e| driver(call, CudaCode::from_cust(e))
}

/// Checks a raw `cust::sys` result.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(driver(call, CudaCode::from_raw(e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_described_without_the_driver() {
        let c = CudaCode::from_raw(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(
            c.to_string(),
            "CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered"
        );
        assert_eq!(CudaCode::from_cust(CudaError::NoDevice), CudaCode(100));
        assert!(CudaCode(12345).to_string().contains("(12345)"));
    }

    #[test]
    fn sticky_errors_make_the_engine_unusable() {
        let e = check(
            "cuEventQuery (kernel execution)",
            sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unusable { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("cuEventQuery (kernel execution): CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{e}"
        );
        let e = check("cuMemAlloc", sys::CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(
            e.to_string(),
            "CUDA cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
        );
        assert!(check("x", sys::CUresult::CUDA_SUCCESS).is_ok());
    }
}
