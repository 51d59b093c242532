//! Device allocations (cust's `DeviceBuffer`, addressed by raw pointer: the
//! kernel takes addresses in its parameter block) and mapped host memory
//! (`cust::sys`: cust has no wrapper for `cuMemHostAlloc` with
//! `CU_MEMHOSTALLOC_DEVICEMAP`).

use std::ffi::c_void;

use cust::context::CurrentContext;
use cust::error::CudaError;
use cust::memory::{mem_get_info, CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};
use cust::sys;
use qmk_kernels::HostStatus;

use crate::error::{check, cu, Error, Result};

/// `bytes` of device memory (at least 16), uninitialised or zeroed.
pub(crate) fn alloc(bytes: u64, what: &str, zeroed: bool) -> Result<DeviceBuffer<u8>> {
    let n = usize::try_from(bytes.max(16)).map_err(|_| Error::Overflow(what.to_string()))?;
    // cuMemsetD8 (inside `zeroed`) is asynchronous on the legacy stream,
    // which the backend's non-blocking streams do not wait for: synchronise
    // before anyone launches.
    let r = if zeroed {
        DeviceBuffer::zeroed(n).and_then(|b| CurrentContext::synchronize().map(|()| b))
    } else {
        // SAFETY: device memory; every byte is written before the kernel
        // reads it (weights, rope tables).
        unsafe { DeviceBuffer::uninitialized(n) }
    };
    r.map_err(|e| match e {
        CudaError::OutOfMemory => Error::OutOfMemory {
            what: what.to_string(),
            needed: bytes,
            available: mem_get_info().map(|(f, _)| f as u64).unwrap_or(0),
        },
        e => cu(if zeroed {
            "cuMemAlloc/cuMemsetD8"
        } else {
            "cuMemAlloc"
        })(e),
    })
}

/// Zeroes `buf` and waits for it (see [`alloc`]).
pub(crate) fn zero(buf: &DeviceBuffer<u8>, what: &'static str) -> Result<()> {
    // SAFETY: buf holds buf.len() bytes.
    check(what, unsafe { sys::cuMemsetD8_v2(addr(buf), 0, buf.len()) })?;
    CurrentContext::synchronize().map_err(cu(what))
}

/// Device address of a buffer, for [`qmk_kernels::KernelParams`].
pub(crate) fn addr(b: &DeviceBuffer<u8>) -> u64 {
    b.as_device_ptr().as_raw()
}

/// Pinned host memory mapped into the device address space: the kernel
/// writes status here and reads the host's abort flag, with no copy.
#[derive(Debug)]
pub(crate) struct MappedHost {
    host: *mut c_void,
    pub device: u64,
    bytes: usize,
}

impl MappedHost {
    pub fn alloc(bytes: usize) -> Result<MappedHost> {
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: pinned allocation, zeroed below before any use.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        let mut m = MappedHost {
            host,
            device: 0,
            bytes,
        };
        // SAFETY: host points at `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated with DEVICEMAP.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
        })?;
        m.device = device;
        Ok(m)
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
        // SAFETY: allocated by cuMemHostAlloc, freed once; errors (a dead
        // context) cannot be reported from drop.
        let _ = unsafe { sys::cuMemFreeHost(self.host) };
    }
}

// The raw pointer is only touched through volatile u32 accesses.
unsafe impl Send for MappedHost {}

/// Where the kernel's [`HostStatus`] lives (the same two modes as the cudarc
/// backend).
///
/// Default: device memory. The host reads it with a 32-byte copy after the
/// step and raises `abort` with an async copy on a separate stream (a copy
/// engine runs it while the megakernel holds every SM). With
/// `QMK_STATUS_MAPPED=1`: pinned host memory mapped into the device (no
/// copies; needs working zero-copy access from the GPU).
pub(crate) enum StatusBlock {
    Mapped(MappedHost),
    Device {
        buf: DeviceBuffer<u8>,
        staging: MappedHost,
        ctrl: Stream,
    },
}

impl StatusBlock {
    pub fn new() -> Result<StatusBlock> {
        let bytes = std::mem::size_of::<HostStatus>();
        if std::env::var("QMK_STATUS_MAPPED").as_deref() == Ok("1") {
            return Ok(StatusBlock::Mapped(MappedHost::alloc(bytes)?));
        }
        Ok(StatusBlock::Device {
            buf: alloc(bytes as u64, "status block", true)?,
            staging: MappedHost::alloc(16)?,
            ctrl: Stream::new(StreamFlags::NON_BLOCKING, None).map_err(cu("cuStreamCreate"))?,
        })
    }

    pub fn device_ptr(&self) -> u64 {
        match self {
            StatusBlock::Mapped(m) => m.device,
            StatusBlock::Device { buf, .. } => addr(buf),
        }
    }

    /// The block as the kernel left it (call once the kernel has finished).
    pub fn read(&self) -> Result<HostStatus> {
        let mut words = [0u32; 8];
        match self {
            StatusBlock::Mapped(m) => {
                for (i, w) in words.iter_mut().enumerate() {
                    *w = m.read_u32(i);
                }
            }
            StatusBlock::Device { buf, .. } => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                buf.copy_to(bytes).map_err(cu("cuMemcpyDtoH (status)"))?;
            }
        }
        Ok(bytemuck::cast(words))
    }

    /// Sets the abort flag while the kernel may be running.
    pub fn set_abort(&self, v: u32) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                m.write_u32(0, v);
                Ok(())
            }
            StatusBlock::Device { buf, staging, ctrl } => {
                staging.write_u32(0, v);
                // SAFETY: 4 pinned bytes to the abort word (offset 0) of buf.
                check("cuMemcpyHtoDAsync (abort flag)", unsafe {
                    sys::cuMemcpyHtoDAsync_v2(addr(buf), staging.host, 4, ctrl.as_inner())
                })?;
                ctrl.synchronize()
                    .map_err(cu("cuStreamSynchronize (abort flag)"))
            }
        }
    }

    /// Zeroes the block (the kernel is not running).
    pub fn clear(&self) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                for i in 0..8 {
                    m.write_u32(i, 0);
                }
                Ok(())
            }
            StatusBlock::Device { buf, .. } => zero(buf, "cuMemsetD8 (status)"),
        }
    }
}
