//! RAII device and mapped-host allocations (raw driver pointers: the kernel
//! takes addresses in its parameter block, not cudarc slices).

use std::ffi::c_void;

use cudarc::driver::{result, sys};
use qmk_kernels::host::{status, status_in_mapped_memory};
use qmk_kernels::HostStatus;

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
        // SAFETY: b.ptr holds b.bytes bytes. cuMemsetD8 is asynchronous on
        // the legacy stream, which our non-blocking streams do not wait for:
        // synchronise before anyone launches.
        unsafe { result::memset_d8_sync(b.ptr, 0, b.bytes.max(16) as usize) }
            .and_then(|_| result::ctx::synchronize())
            .map_err(|source| Error::Driver {
                call: "cuMemsetD8",
                source,
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

/// Where the kernel's [`HostStatus`] lives ([`status_in_mapped_memory`]).
///
/// Default: device memory. The host reads it with a 32-byte copy after the
/// step and raises `abort` with an async copy on a separate stream (a copy
/// engine runs it while the megakernel holds every SM). With
/// `QMK_STATUS_MAPPED=1`: pinned host memory mapped into the device (no
/// copies; needs working zero-copy access from the GPU).
pub enum StatusBlock {
    Mapped(MappedHost),
    Device {
        buf: DeviceBuffer,
        staging: MappedHost,
        ctrl: sys::CUstream,
    },
}

impl StatusBlock {
    pub fn new() -> Result<StatusBlock> {
        let bytes = std::mem::size_of::<HostStatus>();
        if status_in_mapped_memory() {
            return Ok(StatusBlock::Mapped(MappedHost::alloc(bytes)?));
        }
        let buf = DeviceBuffer::zeroed(bytes as u64, "status block")?;
        let staging = MappedHost::alloc(16)?;
        let ctrl =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|source| {
                Error::Driver {
                    call: "cuStreamCreate",
                    source,
                }
            })?;
        Ok(StatusBlock::Device { buf, staging, ctrl })
    }

    pub fn device_ptr(&self) -> u64 {
        match self {
            StatusBlock::Mapped(m) => m.device,
            StatusBlock::Device { buf, .. } => buf.ptr,
        }
    }

    /// The block as the kernel left it (call once the kernel has finished).
    pub fn read(&self) -> Result<HostStatus> {
        let mut words = [0u32; status::WORDS];
        match self {
            StatusBlock::Mapped(m) => {
                for (i, w) in words.iter_mut().enumerate() {
                    *w = m.read_u32(i);
                }
            }
            // SAFETY: buf holds the whole block.
            StatusBlock::Device { buf, .. } => unsafe {
                result::memcpy_dtoh_sync(&mut words, buf.ptr)
            }
            .map_err(|source| Error::Driver {
                call: "cuMemcpyDtoH (status)",
                source,
            })?,
        }
        Ok(bytemuck::cast(words))
    }

    /// Sets the abort flag while the kernel may be running.
    pub fn set_abort(&self, v: u32) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                m.write_u32(status::ABORT, v);
                Ok(())
            }
            StatusBlock::Device { buf, staging, ctrl } => {
                staging.write_u32(0, v);
                // SAFETY: 4 pinned bytes to the abort word of buf.
                let dst = buf.ptr + (status::ABORT * 4) as u64;
                unsafe { sys::cuMemcpyHtoDAsync_v2(dst, staging.host, 4, *ctrl) }
                    .result()
                    .and_then(|_| unsafe { result::stream::synchronize(*ctrl) })
                    .map_err(|source| Error::Driver {
                        call: "cuMemcpyHtoDAsync (abort flag)",
                        source,
                    })
            }
        }
    }

    /// Zeroes the block (the kernel is not running).
    pub fn clear(&self) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                for i in 0..status::WORDS {
                    m.write_u32(i, 0);
                }
                Ok(())
            }
            // SAFETY: buf holds the whole block.
            StatusBlock::Device { buf, .. } => {
                unsafe { result::memset_d8_sync(buf.ptr, 0, status::WORDS * 4) }
                    .and_then(|_| result::ctx::synchronize())
                    .map_err(|source| Error::Driver {
                        call: "cuMemsetD8 (status)",
                        source,
                    })
            }
        }
    }
}

impl Drop for StatusBlock {
    fn drop(&mut self) {
        if let StatusBlock::Device { ctrl, .. } = self {
            // SAFETY: created in new(), destroyed once.
            let _ = unsafe { result::stream::destroy(*ctrl) };
        }
    }
}
