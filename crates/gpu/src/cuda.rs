//! CUDA driver result codes in words, which of them corrupt the context,
//! and what a cubin was built for: none of it asks the driver (a stub
//! libcuda cannot describe its own errors).

use std::fmt;

/// A CUDA driver result code (`CUresult`): the error every [`crate::Driver`]
/// call reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaCode(pub u32);

impl CudaCode {
    /// `CUDA_ERROR_NO_DEVICE`: what the stub libcuda answers to every call.
    pub const NO_DEVICE: CudaCode = CudaCode(100);
    /// `CUDA_ERROR_NOT_FOUND`: a symbol the module does not have.
    pub const NOT_FOUND: CudaCode = CudaCode(500);
    /// `CUDA_ERROR_NOT_READY`: an event or stream still running.
    pub const NOT_READY: CudaCode = CudaCode(600);
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    pub const OUT_OF_MEMORY: CudaCode = CudaCode(2);
    /// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`.
    pub const COOPERATIVE_LAUNCH_TOO_LARGE: CudaCode = CudaCode(720);

    /// After this error the context cannot be used again ([`is_sticky`]).
    pub fn is_sticky(self) -> bool {
        is_sticky(self.0)
    }

    /// The driver refused a module image as built for another GPU
    /// (invalid image, no binary for this GPU, bad PTX, PTX too new).
    pub fn is_foreign_image(self) -> bool {
        matches!(self.0, 200 | 209 | 218 | 222)
    }
}

impl fmt::Display for CudaCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, what) = cuda_error_name(self.0);
        write!(f, "{name} ({}): {what}", self.0)
    }
}

/// What a cubin is, for an error when the driver refuses it: the SM
/// architecture recorded in its ELF header (`e_flags`: the low byte for
/// CUDA ELF ABI version 7, bits 8..16 from version 8 on) and the file it came
/// from, if any.
pub fn describe_cubin(bytes: &[u8], file: Option<&std::path::Path>) -> String {
    // ELF64: EI_ABIVERSION at byte 8, e_flags at byte 48.
    let arch = match (bytes.get(..4), bytes.get(8), bytes.get(48..52)) {
        (Some(b"\x7fELF"), Some(&abi), Some(f)) => {
            let flags = u32::from_le_bytes([f[0], f[1], f[2], f[3]]);
            let sm = if abi >= 8 {
                (flags >> 8) & 0xff
            } else {
                flags & 0xff
            };
            if (30..=200).contains(&sm) {
                format!("sm_{sm}")
            } else {
                format!("an unknown arch (ELF ABI {abi}, e_flags {flags:#x})")
            }
        }
        _ => "an unknown arch (not an ELF cubin)".to_string(),
    };
    match file {
        Some(p) => format!("{arch} (cubin file {})", p.display()),
        None => arch,
    }
}

/// CUDA driver errors after which the context cannot be used again.
pub fn is_sticky(code: u32) -> bool {
    matches!(
        code,
        214 | 700 | 702 | 714 | 715 | 716 | 717 | 718 | 719 | 999
    )
}

/// The `CUresult` enumerator name and the driver's description of `code`,
/// for error messages that must not depend on a working driver (a stub
/// libcuda cannot describe its own errors).
pub fn cuda_error_name(code: u32) -> (&'static str, &'static str) {
    match code {
        0 => ("CUDA_SUCCESS", "no error"),
        1 => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        4 => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
        34 => ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
        46 => (
            "CUDA_ERROR_DEVICE_UNAVAILABLE",
            "CUDA-capable device(s) is/are busy or unavailable",
        ),
        100 => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        200 => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        201 => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        209 => (
            "CUDA_ERROR_NO_BINARY_FOR_GPU",
            "no kernel image is available for execution on the device",
        ),
        214 => (
            "CUDA_ERROR_ECC_UNCORRECTABLE",
            "uncorrectable ECC error encountered",
        ),
        218 => ("CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
        222 => (
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            "the provided PTX was compiled with an unsupported toolchain",
        ),
        300 => (
            "CUDA_ERROR_INVALID_SOURCE",
            "device kernel image is invalid",
        ),
        400 => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        500 => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        600 => ("CUDA_ERROR_NOT_READY", "device not ready"),
        700 => (
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "an illegal memory access was encountered",
        ),
        701 => (
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            "too many resources requested for launch",
        ),
        702 => (
            "CUDA_ERROR_LAUNCH_TIMEOUT",
            "the launch timed out and was terminated",
        ),
        714 => ("CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"),
        715 => (
            "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            "an illegal instruction was encountered",
        ),
        716 => ("CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
        717 => (
            "CUDA_ERROR_INVALID_ADDRESS_SPACE",
            "operation not supported on global/shared address space",
        ),
        718 => ("CUDA_ERROR_INVALID_PC", "invalid program counter"),
        719 => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
        720 => (
            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
            "too many blocks in cooperative launch",
        ),
        800 => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
        801 => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        999 => ("CUDA_ERROR_UNKNOWN", "unknown error"),
        _ => ("CUDA_ERROR_(unlisted)", "see cuda.h for this result code"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_described_without_the_driver() {
        assert_eq!(
            CudaCode(700).to_string(),
            "CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered"
        );
        assert!(CudaCode(12345).to_string().contains("(12345)"));
        assert_eq!(cuda_error_name(700).0, "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(is_sticky(700) && !is_sticky(2));
        assert!(CudaCode(209).is_foreign_image() && !CudaCode(2).is_foreign_image());
    }

    #[test]
    fn describe_cubin_reads_the_elf_arch() {
        // ELF64 headers as NVRTC 12.9 writes them (ABI 7: e_flags 0x500550
        // for sm_80), and the ABI 8 layout (SM in bits 8..16).
        let header = |abi: u8, flags: u32| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(b"\x7fELF");
            h[8] = abi;
            h[48..52].copy_from_slice(&flags.to_le_bytes());
            h
        };
        assert_eq!(describe_cubin(&header(7, 0x500550), None), "sm_80");
        assert_eq!(describe_cubin(&header(7, 0x5a055a), None), "sm_90");
        assert_eq!(describe_cubin(&header(8, 0x5a00), None), "sm_90");
        let f = std::path::Path::new("/tmp/x.cubin");
        assert_eq!(
            describe_cubin(&header(7, 0x500550), Some(f)),
            "sm_80 (cubin file /tmp/x.cubin)"
        );
        assert!(describe_cubin(b"PTX", Some(f)).contains("not an ELF cubin"));
        assert!(describe_cubin(&header(7, 0), None).contains("unknown arch"));
    }
}
