//! Device and architecture discovery.

use std::os::raw::c_int;

use cust::device::{Device, DeviceAttribute};
use cust::sys;
use cust::CudaFlags;
use qmk_kernels::Arch;

use crate::error::{check, cu, CudaCode, Error, Result};

/// One CUDA device as the backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: Arch,
    pub sms: u32,
    pub total_mem: u64,
    /// Filled in by the backend once a context exists (0 here).
    pub free_mem: u64,
    /// Largest dynamic shared memory a CTA may opt into, bytes.
    pub max_smem_optin: u32,
    pub cooperative: bool,
}

/// Initialises the driver; [`Error::NoDevice`] where there is no GPU (or
/// only the CI's stub libcuda, whose every entry point returns
/// CUDA_ERROR_NO_DEVICE).
///
/// cust links libcuda.so.1 at build time: a binary of this crate does not
/// start at all on a machine with no libcuda (real or stub).
pub fn init_driver() -> Result<()> {
    cust::init(CudaFlags::empty()).map_err(|e| match CudaCode::from_cust(e) {
        c @ CudaCode(100) => Error::NoDevice(c),
        c => crate::error::driver("cuInit", c),
    })
}

/// Number of CUDA devices ([`Error::NoDevice`] when none).
pub fn device_count() -> Result<usize> {
    init_driver()?;
    let n = Device::num_devices().map_err(cu("cuDeviceGetCount"))?;
    if n == 0 {
        return Err(Error::NoDevice(CudaCode(100)));
    }
    Ok(n as usize)
}

/// cust's `DeviceAttribute` (CUDA 11.2 era) lacks the cooperative-launch and
/// opt-in shared-memory attributes: ask `cust::sys`.
fn raw_attr(dev: Device, a: sys::CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: `dev` is a valid device handle, `v` a valid out pointer.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, a, dev.as_raw())
    })?;
    Ok(v)
}

/// Describes device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::DeviceIndex {
            index: ordinal,
            count,
        });
    }
    let dev = Device::get_device(ordinal as u32).map_err(cu("cuDeviceGet"))?;
    let attr = |a: DeviceAttribute| dev.get_attribute(a).map_err(cu("cuDeviceGetAttribute"));
    let major = attr(DeviceAttribute::ComputeCapabilityMajor)?;
    let minor = attr(DeviceAttribute::ComputeCapabilityMinor)?;
    use sys::CUdevice_attribute::*;
    Ok(DeviceInfo {
        ordinal,
        name: dev.name().unwrap_or_else(|_| "unknown GPU".into()),
        arch: Arch::from_cc(major, minor)?,
        sms: attr(DeviceAttribute::MultiprocessorCount)? as u32,
        total_mem: dev.total_memory().map_err(cu("cuDeviceTotalMem"))? as u64,
        free_mem: 0,
        max_smem_optin: raw_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as u32,
        cooperative: raw_attr(dev, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
    })
}

/// Every device.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    (0..device_count()?).map(device_info).collect()
}
