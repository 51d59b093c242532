//! Where the kernel's [`HostStatus`] lives.
//!
//! Default: device memory. The host reads it with a 32-byte copy after the
//! step and raises `abort` with an async copy on a separate stream (a copy
//! engine runs it while the megakernel holds every SM). With
//! `QMK_STATUS_MAPPED=1`: pinned host memory mapped into the device (no
//! copies; needs working zero-copy access from the GPU).

use std::mem::{offset_of, size_of};

use qmk_kernels::HostStatus;

use crate::driver::{DeviceMemory, Driver, MappedHost};
use crate::error::{Error, Result};

/// Word (u32) index of the abort flag in the block.
const ABORT: usize = offset_of!(HostStatus, abort) / 4;
/// Words in the block.
const WORDS: usize = size_of::<HostStatus>() / 4;

pub(crate) enum StatusBlock<D: Driver> {
    Mapped(MappedHost),
    Device {
        buf: D::Memory,
        staging: MappedHost,
        ctrl: D::Stream,
    },
}

fn word(m: &MappedHost, index: usize) -> *mut u32 {
    assert!((index + 1) * 4 <= m.bytes());
    // SAFETY: in bounds (asserted); pinned allocations are page aligned.
    unsafe { m.host_ptr().cast::<u32>().add(index) }
}

impl<D: Driver> StatusBlock<D> {
    pub fn new(d: &D) -> Result<StatusBlock<D>> {
        let bytes = WORDS * 4;
        if crate::options::status_in_mapped_memory() {
            let m = d
                .alloc_mapped(bytes)
                .map_err(Error::at("cuMemHostAlloc (status)"))?;
            return Ok(StatusBlock::Mapped(m));
        }
        let buf = d.alloc(bytes).map_err(Error::at("cuMemAlloc (status)"))?;
        // SAFETY: buf holds `bytes` bytes; synchronise, since the
        // legacy-stream memset is not ordered before our streams.
        unsafe { d.memset_d8(buf.addr(), 0, bytes) }
            .and_then(|()| d.synchronize())
            .map_err(Error::at("cuMemsetD8 (status)"))?;
        Ok(StatusBlock::Device {
            buf,
            staging: d
                .alloc_mapped(16)
                .map_err(Error::at("cuMemHostAlloc (abort flag)"))?,
            ctrl: d.stream().map_err(Error::at("cuStreamCreate"))?,
        })
    }

    /// The address the kernel writes to (`KernelParams::status`).
    pub fn device_ptr(&self) -> u64 {
        match self {
            StatusBlock::Mapped(m) => m.device_addr(),
            StatusBlock::Device { buf, .. } => buf.addr(),
        }
    }

    /// The block as the kernel left it (call once the kernel has finished).
    pub fn read(&self, d: &D) -> Result<HostStatus> {
        let mut words = [0u32; WORDS];
        match self {
            StatusBlock::Mapped(m) => {
                for (i, w) in words.iter_mut().enumerate() {
                    // SAFETY: a live mapped word; the device may write it.
                    *w = unsafe { std::ptr::read_volatile(word(m, i)) };
                }
            }
            StatusBlock::Device { buf, .. } => {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                // SAFETY: buf holds the whole block.
                unsafe { d.dtoh(bytes, buf.addr()) }.map_err(Error::at("cuMemcpyDtoH (status)"))?;
            }
        }
        Ok(bytemuck::cast(words))
    }

    /// Sets the abort flag while the kernel may be running.
    pub fn set_abort(&self, d: &D, v: u32) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                // SAFETY: a live mapped word.
                unsafe { std::ptr::write_volatile(word(m, ABORT), v) };
                Ok(())
            }
            StatusBlock::Device { buf, staging, ctrl } => {
                // SAFETY: a live mapped word.
                unsafe { std::ptr::write_volatile(word(staging, 0), v) };
                let dst = buf.addr() + (ABORT * 4) as u64;
                // SAFETY: 4 pinned bytes to the abort word of buf.
                unsafe { d.htod_async(dst, staging, 4, ctrl) }
                    .and_then(|()| d.stream_synchronize(ctrl))
                    .map_err(Error::at("cuMemcpyHtoDAsync (abort flag)"))
            }
        }
    }

    /// Zeroes the block (the kernel is not running).
    pub fn clear(&self, d: &D) -> Result<()> {
        match self {
            StatusBlock::Mapped(m) => {
                for i in 0..WORDS {
                    // SAFETY: a live mapped word.
                    unsafe { std::ptr::write_volatile(word(m, i), 0) };
                }
                Ok(())
            }
            StatusBlock::Device { buf, .. } => {
                // SAFETY: buf holds the whole block; synchronise as in new().
                unsafe { d.memset_d8(buf.addr(), 0, WORDS * 4) }
                    .and_then(|()| d.synchronize())
                    .map_err(Error::at("cuMemsetD8 (status)"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_match_the_struct() {
        assert_eq!((ABORT, WORDS), (0, 8));
        assert_eq!(offset_of!(HostStatus, argmax) / 4, 6);
        assert_eq!(crate::STATUS_MAPPED_ENV, "QMK_STATUS_MAPPED");
    }
}
