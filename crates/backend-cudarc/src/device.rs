//! Device and architecture discovery.

use cudarc::driver::{result, sys};
pub use qmk_kernels::host::DeviceInfo;
use qmk_kernels::Arch;

use crate::error::{Error, Result};

/// Loads libcuda and initialises the driver; [`Error::NoDriver`] where there
/// is none (checked before any cudarc call, which would panic instead).
pub fn init_driver() -> Result<()> {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDriver);
    }
    result::init().map_err(|source| match source.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => Error::NoDevice,
        _ => Error::Driver {
            call: "cuInit",
            source,
        },
    })
}

/// Number of CUDA devices ([`Error::NoDriver`] / [`Error::NoDevice`] when none).
pub fn device_count() -> Result<usize> {
    init_driver()?;
    let n = result::device::get_count().map_err(|source| Error::Driver {
        call: "cuDeviceGetCount",
        source,
    })?;
    if n <= 0 {
        return Err(Error::NoDevice);
    }
    Ok(n as usize)
}

fn attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: dev is a valid device handle.
    unsafe { result::device::get_attribute(dev, a) }.map_err(|source| Error::Driver {
        call: "cuDeviceGetAttribute",
        source,
    })
}

/// Describes device `ordinal` (free memory needs a current context; it is
/// filled in by the backend once one exists, 0 here).
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::DeviceIndex {
            index: ordinal,
            count,
        });
    }
    let dev = result::device::get(ordinal as i32).map_err(|source| Error::Driver {
        call: "cuDeviceGet",
        source,
    })?;
    use sys::CUdevice_attribute::*;
    let major = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
    // SAFETY: valid device handle.
    let total_mem = unsafe { result::device::total_mem(dev) }.map_err(|source| Error::Driver {
        call: "cuDeviceTotalMem",
        source,
    })? as u64;
    Ok(DeviceInfo {
        ordinal,
        name,
        arch: Arch::from_cc(major, minor)?,
        sms: attr(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        total_mem,
        free_mem: 0,
        max_smem_optin: attr(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32,
        cooperative: attr(dev, CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
    })
}

/// Every device.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    (0..device_count()?).map(device_info).collect()
}
