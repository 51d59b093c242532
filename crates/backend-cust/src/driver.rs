//! [`qmk_gpu::Driver`] through cust: its safe wrappers where it has them
//! (context, module, stream, event, device buffer), `cust::sys` for the
//! rest (cooperative launch, function attributes, occupancy, mapped host
//! memory, memsets, newer device attributes).

use std::ffi::{c_void, CString};
use std::os::raw::c_int;
use std::sync::OnceLock;

use cust::context::{Context, CurrentContext};
use cust::device::{Device, DeviceAttribute};
use cust::error::CudaError;
use cust::event::{Event, EventFlags, EventStatus};
use cust::memory::{mem_get_info, CopyDestination, DeviceBuffer};
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use cust::sys;
use cust::CudaFlags;
use qmk_engine::BackendKind;
use qmk_gpu::{
    tensor_map_bytes, CudaCode, DeviceAttr, DeviceMemory, Driver, Error, LaunchShape, MappedHost,
    Result, TensorMap2d, TENSOR_MAP_BYTES,
};

/// cust folds codes it does not know into `UnknownError` (999).
fn code(e: CudaError) -> CudaCode {
    CudaCode(e as u32)
}

fn check(r: sys::CUresult) -> Result<(), CudaCode> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(CudaCode(e as u32)),
    }
}

fn device(ordinal: usize) -> Result<Device, CudaCode> {
    let i = u32::try_from(ordinal).map_err(|_| CudaCode(101))?;
    Device::get_device(i).map_err(code)
}

// cust's bindings (CUDA 11 era) stop before the bulk tensor copy
// descriptors. The entry point (CUDA 12 and later) is looked up in the
// loaded libcuda at run time, not linked: a linked symbol would be bound
// when the program starts (full RELRO), so a CUDA 11 driver would refuse
// to start it at all, though only sm_90 and later (CUDA 12 drivers) use
// the descriptors. Enum arguments as the driver API's values: bf16 = 9, no
// interleave = 0, no swizzle = 0, 256-byte L2 promotion = 3, no NaN
// fill = 0.
type EncodeTiled = unsafe extern "C" fn(
    tensor_map: *mut [u64; TENSOR_MAP_BYTES / 8],
    data_type: c_int,
    rank: u32,
    global_address: *mut c_void,
    global_dim: *const u64,
    global_strides: *const u64,
    box_dim: *const u32,
    element_strides: *const u32,
    interleave: c_int,
    swizzle: c_int,
    l2_promotion: c_int,
    oob_fill: c_int,
) -> c_int;

/// `cuTensorMapEncodeTiled` of the libcuda this process loaded, found once;
/// `None` where the driver predates it.
fn encode_tiled() -> Option<EncodeTiled> {
    static F: OnceLock<Option<EncodeTiled>> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: NUL-terminated names. cust links libcuda.so.1, so dlopen
        // returns that loaded copy (also where this code itself was loaded
        // with RTLD_LOCAL, which a global lookup would miss); the handle is
        // kept for the life of the process. A non-null address of that
        // name in libcuda is the function with the signature above.
        unsafe {
            let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return None;
            }
            let f = libc::dlsym(lib, c"cuTensorMapEncodeTiled".as_ptr());
            (!f.is_null()).then(|| std::mem::transmute::<*mut c_void, EncodeTiled>(f))
        }
    })
}

/// The device's primary context, through cust.
#[derive(Debug)]
pub struct CustDriver {
    ctx: Context,
}

/// A kernel of a loaded module (valid while the module is).
#[derive(Debug, Clone, Copy)]
pub struct Function(sys::CUfunction);

/// A device allocation (cust frees it on drop).
#[derive(Debug)]
pub struct Memory(DeviceBuffer<u8>);

impl DeviceMemory for Memory {
    fn addr(&self) -> u64 {
        self.0.as_device_ptr().as_raw()
    }
    fn bytes(&self) -> usize {
        self.0.len()
    }
}
/// cust's `DeviceAttribute` (CUDA 11.2 era) lacks the opt-in shared memory
/// and cooperative-launch attributes: those are read through `cust::sys`.
enum Attr {
    Cust(DeviceAttribute),
    Raw(sys::CUdevice_attribute),
}

fn attr(a: DeviceAttr) -> Attr {
    use sys::CUdevice_attribute as Raw;
    match a {
        DeviceAttr::ComputeMajor => Attr::Cust(DeviceAttribute::ComputeCapabilityMajor),
        DeviceAttr::ComputeMinor => Attr::Cust(DeviceAttribute::ComputeCapabilityMinor),
        DeviceAttr::MultiprocessorCount => Attr::Cust(DeviceAttribute::MultiprocessorCount),
        DeviceAttr::MaxSharedMemoryPerBlockOptin => {
            Attr::Raw(Raw::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        }
        DeviceAttr::CooperativeLaunch => Attr::Raw(Raw::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH),
    }
}

impl Driver for CustDriver {
    const NAME: &'static str = "cust";
    const KIND: BackendKind = BackendKind::Cust;
    type Module = Module;
    type Function = Function;
    type Stream = Stream;
    type Event = Event;
    type Memory = Memory;

    /// cust links libcuda.so.1 at build time: a binary of this crate does
    /// not start at all on a machine with no libcuda (real or stub), so
    /// there is no [`Error::NoDriver`] here.
    fn init() -> Result<()> {
        cust::init(CudaFlags::empty()).map_err(|e| match code(e) {
            c @ CudaCode::NO_DEVICE => Error::NoDevice(c),
            c => Error::driver("cuInit", c),
        })
    }

    fn count() -> Result<usize, CudaCode> {
        Ok(Device::num_devices().map_err(code)? as usize)
    }

    fn name(ordinal: usize) -> Result<String, CudaCode> {
        device(ordinal)?.name().map_err(code)
    }

    fn total_mem(ordinal: usize) -> Result<u64, CudaCode> {
        Ok(device(ordinal)?.total_memory().map_err(code)? as u64)
    }

    fn attribute(ordinal: usize, a: DeviceAttr) -> Result<i32, CudaCode> {
        let dev = device(ordinal)?;
        match attr(a) {
            Attr::Cust(a) => dev.get_attribute(a).map_err(code),
            Attr::Raw(a) => {
                let mut v: c_int = 0;
                // SAFETY: a valid device handle and out pointer.
                check(unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev.as_raw()) })?;
                Ok(v)
            }
        }
    }

    fn open(ordinal: usize) -> Result<Self, CudaCode> {
        let ctx = Context::new(device(ordinal)?).map_err(code)?;
        CurrentContext::set_current(&ctx).map_err(code)?;
        Ok(CustDriver { ctx })
    }

    fn bind(&self) -> Result<(), CudaCode> {
        CurrentContext::set_current(&self.ctx).map_err(code)
    }

    fn can_access_peer(ordinal: usize, peer: usize) -> Result<bool, CudaCode> {
        if ordinal == peer {
            return Ok(true);
        }
        let (a, b) = (device(ordinal)?, device(peer)?);
        let mut can: c_int = 0;
        // SAFETY: valid device handles and out pointer.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.as_raw(), b.as_raw()) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(can != 0),
            e => Err(CudaCode(e as u32)),
        }
    }

    fn enable_peer_access(&self, peer: &Self) -> Result<(), CudaCode> {
        self.bind()?;
        // SAFETY: the peer's context is a live primary context.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.as_raw(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(CudaCode(e as u32)),
        }
    }

    fn mem_info(&self) -> Result<(u64, u64), CudaCode> {
        let (free, total) = mem_get_info().map_err(code)?;
        Ok((free as u64, total as u64))
    }

    fn synchronize(&self) -> Result<(), CudaCode> {
        CurrentContext::synchronize().map_err(code)
    }

    fn load_module(&self, image: &[u8]) -> Result<Module, CudaCode> {
        Module::from_cubin(image, &[]).map_err(code)
    }

    fn function(&self, module: &Module, name: &str) -> Result<Function, CudaCode> {
        Ok(Function(module.get_function(name).map_err(code)?.to_raw()))
    }

    fn global_u64(&self, module: &Module, name: &str) -> Result<Option<u64>, CudaCode> {
        let name = CString::new(name).map_err(|_| CudaCode::NOT_FOUND)?;
        match module.get_global::<u64>(&name) {
            Ok(sym) => {
                let mut v = 0u64;
                sym.copy_to(&mut v).map_err(code)?;
                Ok(Some(v))
            }
            Err(CudaError::NotFound) => Ok(None),
            Err(e) => Err(code(e)),
        }
    }

    fn set_max_dynamic_smem(&self, f: Function, bytes: u32) -> Result<(), CudaCode> {
        let v = i32::try_from(bytes).map_err(|_| CudaCode(1))?;
        let a = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: a valid function handle of a loaded module.
        check(unsafe { sys::cuFuncSetAttribute(f.0, a, v) })
    }

    fn registers(&self, f: Function) -> Result<i32, CudaCode> {
        let mut v: c_int = 0;
        let a = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS;
        // SAFETY: a valid function handle and out pointer.
        check(unsafe { sys::cuFuncGetAttribute(&mut v, a, f.0) })?;
        Ok(v)
    }

    fn occupancy(&self, f: Function, block: u32, smem: u32) -> Result<i32, CudaCode> {
        let mut n: c_int = 0;
        // SAFETY: a valid function handle and out pointer.
        check(unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                f.0,
                block as c_int,
                smem as usize,
            )
        })?;
        Ok(n)
    }

    fn alloc(&self, bytes: usize) -> Result<Memory, CudaCode> {
        // SAFETY: device memory; the caller initialises it.
        unsafe { DeviceBuffer::uninitialized(bytes) }
            .map(Memory)
            .map_err(code)
    }

    fn host_alloc_mapped(&self, bytes: usize) -> Result<*mut c_void, CudaCode> {
        // cust has no wrapper for CU_MEMHOSTALLOC_DEVICEMAP.
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a pinned allocation; `MappedHost` zeroes it before use.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) })?;
        Ok(host)
    }

    unsafe fn host_device_addr(&self, host: *mut c_void) -> Result<u64, CudaCode> {
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: per the caller, `host` is live mapped memory.
        check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) })?;
        Ok(device)
    }

    unsafe fn host_free(host: *mut c_void) {
        // SAFETY: per the caller.
        let _ = unsafe { sys::cuMemFreeHost(host) };
    }

    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        unsafe { cust::memory::memcpy_htod(dst, src.as_ptr().cast(), src.len()) }.map_err(code)
    }

    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) })
    }

    unsafe fn htod_async(
        &self,
        dst: u64,
        src: &MappedHost,
        bytes: usize,
        stream: &Stream,
    ) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.host_ptr().cast(), bytes, stream.as_inner())
        })
    }

    unsafe fn memset_d8(&self, dst: u64, value: u8, n: usize) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe { sys::cuMemsetD8_v2(dst, value, n) })
    }

    unsafe fn memset_d16(&self, dst: u64, value: u16, n: usize) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe { sys::cuMemsetD16_v2(dst, value, n) })
    }

    fn tensor_map(&self, t: &TensorMap2d) -> Result<[u8; TENSOR_MAP_BYTES], CudaCode> {
        let mut m = [0u64; TENSOR_MAP_BYTES / 8];
        let (dims, strides, boxes, elem_strides) = t.encode_arrays();
        let encode = encode_tiled().ok_or(CudaCode::NOT_FOUND)?;
        // SAFETY: every pointer is to a live local of the rank's length; the
        // call only writes the 128-byte descriptor.
        let r = unsafe {
            encode(
                &mut m,
                9,
                2,
                t.base as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                0,
                0,
                3,
                0,
            )
        };
        match r {
            0 => Ok(tensor_map_bytes(&m)),
            e => Err(CudaCode(e as u32)),
        }
    }

    fn stream(&self) -> Result<Stream, CudaCode> {
        Stream::new(StreamFlags::NON_BLOCKING, None).map_err(code)
    }

    fn stream_synchronize(&self, stream: &Stream) -> Result<(), CudaCode> {
        stream.synchronize().map_err(code)
    }

    unsafe fn launch(
        &self,
        f: Function,
        shape: LaunchShape,
        stream: &Stream,
        params: *mut c_void,
    ) -> Result<(), CudaCode> {
        let mut args = [params];
        // SAFETY: per the trait's contract; the driver copies the block.
        check(unsafe {
            if shape.cooperative {
                sys::cuLaunchCooperativeKernel(
                    f.0,
                    shape.grid,
                    1,
                    1,
                    shape.block,
                    1,
                    1,
                    shape.smem,
                    stream.as_inner(),
                    args.as_mut_ptr(),
                )
            } else {
                sys::cuLaunchKernel(
                    f.0,
                    shape.grid,
                    1,
                    1,
                    shape.block,
                    1,
                    1,
                    shape.smem,
                    stream.as_inner(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        })
    }

    fn event(&self) -> Result<Event, CudaCode> {
        Event::new(EventFlags::DEFAULT).map_err(code)
    }

    fn record(&self, event: &Event, stream: &Stream) -> Result<(), CudaCode> {
        event.record(stream).map_err(code)
    }

    fn query(&self, event: &Event) -> Result<bool, CudaCode> {
        match event.query().map_err(code)? {
            EventStatus::Ready => Ok(true),
            EventStatus::NotReady => Ok(false),
        }
    }

    fn event_synchronize(&self, event: &Event) -> Result<(), CudaCode> {
        event.synchronize().map_err(code)
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32, CudaCode> {
        end.elapsed_time_f32(start).map_err(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptor call is found in the libcuda the program loaded: the
    /// stub's here (it has every entry point), the driver's on a GPU
    /// machine (where the split attention's bulk copies use it).
    #[test]
    fn the_descriptor_entry_point_is_found_in_the_loaded_libcuda() {
        if std::env::var_os("QMK_STUB_LIBCUDA").is_none() {
            println!(
                "SKIPPED the_descriptor_entry_point_is_found_in_the_loaded_libcuda: \
                 runs against the stub libcuda (.ci/stub-libcuda.sh); GPU tests cover real drivers"
            );
            return;
        }
        assert!(encode_tiled().is_some());
    }

    /// A program built with this backend starts on any driver: entry
    /// points newer than cust's bindings are looked up at run time, never
    /// linked (a linked one that the driver lacks stops the program before
    /// `main`).
    #[test]
    fn newer_driver_entry_points_are_not_linked() {
        // Keeps the descriptor code in this test program.
        let keep: fn(&CustDriver, &TensorMap2d) -> Result<[u8; TENSOR_MAP_BYTES], CudaCode> =
            <CustDriver as Driver>::tensor_map;
        std::hint::black_box(keep);
        let exe = std::env::current_exe().expect("the test program's path");
        let out = match std::process::Command::new("nm")
            .args(["-D", "--undefined-only"])
            .arg(&exe)
            .output()
        {
            Ok(o) if o.status.success() => o,
            _ => {
                println!("SKIPPED newer_driver_entry_points_are_not_linked: no working `nm`");
                return;
            }
        };
        let undefined = String::from_utf8_lossy(&out.stdout);
        assert!(
            undefined.contains("dlsym"),
            "nm lists the program's undefined dynamic symbols:\n{undefined}"
        );
        assert!(
            !undefined.contains("cuTensorMapEncodeTiled"),
            "cuTensorMapEncodeTiled is linked: a CUDA 11 driver could not start the program"
        );
    }
}
