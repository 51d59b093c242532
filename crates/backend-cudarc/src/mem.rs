//! RAII device and mapped-host allocations (raw driver pointers: the kernel
//! takes addresses in its parameter block, not cudarc slices).

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

/// `bytes` of device memory.
#[derive(Debug)]
pub struct DeviceBuffer {
    pub ptr: u64,
    pub bytes: u64,
}

impl DeviceBuffer {
    pub fn alloc(bytes: u64, what: &str) -> Result<DeviceBuffer> {
        let n = usize::try_from(bytes.max(16)).map_err(|_| Error::Overflow(what.to_string()))?;
        // SAFETY: plain allocation; the memory is initialised by the caller.
        let ptr = unsafe { result::malloc_sync(n) }.map_err(|source| match source.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                what: what.to_string(),
                needed: bytes,
                available: result::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0),
            },
            _ => Error::Driver {
                call: "cuMemAlloc",
                source,
            },
        })?;
        Ok(DeviceBuffer { ptr, bytes })
    }

    pub fn zeroed(bytes: u64, what: &str) -> Result<DeviceBuffer> {
        let b = Self::alloc(bytes, what)?;
        // SAFETY: b.ptr holds b.bytes bytes.
        unsafe { result::memset_d8_sync(b.ptr, 0, b.bytes.max(16) as usize) }.map_err(|source| {
            Error::Driver {
                call: "cuMemsetD8",
                source,
            }
        })?;
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc and is freed once. Errors (a dead
        // context) cannot be reported from drop.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Pinned host memory mapped into the device address space: the kernel
/// writes status here and reads the host's abort flag, with no copy.
#[derive(Debug)]
pub struct MappedHost {
    pub host: *mut c_void,
    pub device: u64,
    pub bytes: usize,
}

impl MappedHost {
    pub fn alloc(bytes: usize) -> Result<MappedHost> {
        // SAFETY: pinned allocation, zeroed below before any use.
        let host = unsafe {
            result::malloc_host(
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|source| Error::Driver {
            call: "cuMemHostAlloc",
            source,
        })?;
        // SAFETY: host points at `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
            .result()
            .map_err(|source| Error::Driver {
                call: "cuMemHostGetDevicePointer",
                source,
            })?;
        Ok(MappedHost {
            host,
            device,
            bytes,
        })
    }

    /// Volatile read of the u32 at `index` (the device may write it).
    pub fn read_u32(&self, index: usize) -> u32 {
        assert!((index + 1) * 4 <= self.bytes);
        // SAFETY: in bounds, aligned (pinned allocations are page aligned).
        unsafe { std::ptr::read_volatile(self.host.cast::<u32>().add(index)) }
    }

    pub fn write_u32(&self, index: usize, v: u32) {
        assert!((index + 1) * 4 <= self.bytes);
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(self.host.cast::<u32>().add(index), v) }
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        let _ = unsafe { result::free_host(self.host) };
    }
}

// The raw pointer is only touched through volatile u32 accesses.
unsafe impl Send for MappedHost {}
