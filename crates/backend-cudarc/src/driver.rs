//! [`qmk_gpu::Driver`] through cudarc's raw driver API (`cudarc::driver::
//! result` and `sys`): the kernel takes device addresses in its parameter
//! block, so allocations are raw pointers, not cudarc slices.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};
use qmk_engine::BackendKind;
use qmk_gpu::{
    tensor_map_bytes, CudaCode, DeviceAttr, DeviceMemory, Driver, Error, LaunchShape, MappedHost,
    Result, TensorMap2d, TENSOR_MAP_BYTES,
};

fn code(e: DriverError) -> CudaCode {
    CudaCode(e.0 as u32)
}

fn check(r: sys::CUresult) -> Result<(), CudaCode> {
    r.result().map_err(code)
}

/// A name for the driver: no NUL inside (the kernel's entry names).
fn c_name(name: &str) -> Result<CString, CudaCode> {
    CString::new(name).map_err(|_| CudaCode::NOT_FOUND)
}

/// The device's primary context, through cudarc.
#[derive(Debug)]
pub struct CudarcDriver {
    ctx: Arc<CudaContext>,
}

/// A loaded module (unloaded on drop).
#[derive(Debug)]
pub struct Module(sys::CUmodule);

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded once, unloaded once; errors cannot be reported
        // from drop.
        let _ = unsafe { result::module::unload(self.0) };
    }
}

/// A non-blocking stream (destroyed on drop).
#[derive(Debug)]
pub struct Stream(sys::CUstream);

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// An event (destroyed on drop).
#[derive(Debug)]
pub struct Event(sys::CUevent);

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// A kernel of a loaded module (valid while the module is).
#[derive(Debug, Clone, Copy)]
pub struct Function(sys::CUfunction);

/// A device allocation (freed on drop).
#[derive(Debug)]
pub struct Memory {
    ptr: u64,
    bytes: usize,
}

impl DeviceMemory for Memory {
    fn addr(&self) -> u64 {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: from cuMemAlloc, freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}
fn attribute(a: DeviceAttr) -> sys::CUdevice_attribute {
    use sys::CUdevice_attribute::*;
    match a {
        DeviceAttr::ComputeMajor => CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        DeviceAttr::ComputeMinor => CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        DeviceAttr::MultiprocessorCount => CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        DeviceAttr::MaxSharedMemoryPerBlockOptin => {
            CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        }
        DeviceAttr::CooperativeLaunch => CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH,
    }
}

fn device(ordinal: usize) -> Result<sys::CUdevice, CudaCode> {
    let i = i32::try_from(ordinal).map_err(|_| CudaCode(101))?;
    result::device::get(i).map_err(code)
}

impl Driver for CudarcDriver {
    const NAME: &'static str = "cudarc";
    const KIND: BackendKind = BackendKind::Cudarc;
    type Module = Module;
    type Function = Function;
    type Stream = Stream;
    type Event = Event;
    type Memory = Memory;

    fn init() -> Result<()> {
        // Checked before any cudarc call, which would panic without libcuda.
        // SAFETY: only tries to dlopen libcuda.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        result::init().map_err(|e| match code(e) {
            c @ CudaCode::NO_DEVICE => Error::NoDevice(c),
            c => Error::driver("cuInit", c),
        })
    }

    fn count() -> Result<usize, CudaCode> {
        let n = result::device::get_count().map_err(code)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    fn name(ordinal: usize) -> Result<String, CudaCode> {
        result::device::get_name(device(ordinal)?).map_err(code)
    }

    fn total_mem(ordinal: usize) -> Result<u64, CudaCode> {
        // SAFETY: a valid device handle.
        let n = unsafe { result::device::total_mem(device(ordinal)?) }.map_err(code)?;
        Ok(n as u64)
    }

    fn attribute(ordinal: usize, attr: DeviceAttr) -> Result<i32, CudaCode> {
        // SAFETY: a valid device handle.
        unsafe { result::device::get_attribute(device(ordinal)?, attribute(attr)) }.map_err(code)
    }

    fn open(ordinal: usize) -> Result<Self, CudaCode> {
        let ctx = CudaContext::new(ordinal).map_err(code)?;
        Ok(CudarcDriver { ctx })
    }

    fn bind(&self) -> Result<(), CudaCode> {
        self.ctx.bind_to_thread().map_err(code)
    }

    fn can_access_peer(ordinal: usize, peer: usize) -> Result<bool, CudaCode> {
        if ordinal == peer {
            return Ok(true);
        }
        let mut can: std::ffi::c_int = 0;
        // SAFETY: valid device handles and out pointer.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, device(ordinal)?, device(peer)?) }
            .result()
            .map_err(code)?;
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: &Self) -> Result<(), CudaCode> {
        self.bind()?;
        // SAFETY: the peer's context is a live primary context.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(CudaCode(e as u32)),
        }
    }

    fn mem_info(&self) -> Result<(u64, u64), CudaCode> {
        let (free, total) = result::mem_get_info().map_err(code)?;
        Ok((free as u64, total as u64))
    }

    fn synchronize(&self) -> Result<(), CudaCode> {
        result::ctx::synchronize().map_err(code)
    }

    fn load_module(&self, image: &[u8]) -> Result<Module, CudaCode> {
        // SAFETY: a complete cubin image; the driver validates it.
        let m = unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(code)?;
        Ok(Module(m))
    }

    fn function(&self, module: &Module, name: &str) -> Result<Function, CudaCode> {
        // SAFETY: the module is loaded.
        unsafe { result::module::get_function(module.0, c_name(name)?) }
            .map(Function)
            .map_err(code)
    }

    fn global_u64(&self, module: &Module, name: &str) -> Result<Option<u64>, CudaCode> {
        // SAFETY: the module is loaded.
        let (ptr, size) = match unsafe { result::module::get_global(module.0, c_name(name)?) } {
            Ok(g) => g,
            Err(e) if code(e) == CudaCode::NOT_FOUND => return Ok(None),
            Err(e) => return Err(code(e)),
        };
        if size != 8 {
            return Ok(None);
        }
        let mut v = [0u64];
        // SAFETY: the global holds 8 bytes at ptr.
        unsafe { result::memcpy_dtoh_sync(&mut v, ptr) }.map_err(code)?;
        Ok(Some(v[0]))
    }

    fn set_max_dynamic_smem(&self, f: Function, bytes: u32) -> Result<(), CudaCode> {
        let v = i32::try_from(bytes).map_err(|_| CudaCode(1))?;
        // SAFETY: a valid function handle.
        unsafe {
            result::function::set_function_attribute(
                f.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                v,
            )
        }
        .map_err(code)
    }

    fn registers(&self, f: Function) -> Result<i32, CudaCode> {
        // SAFETY: a valid function handle.
        unsafe {
            result::function::get_function_attribute(
                f.0,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
            )
        }
        .map_err(code)
    }

    fn occupancy(&self, f: Function, block: u32, smem: u32) -> Result<i32, CudaCode> {
        // SAFETY: a valid function handle.
        unsafe {
            result::occupancy::max_active_block_per_multiprocessor(f.0, block as i32, smem as usize)
        }
        .map_err(code)
    }

    fn alloc(&self, bytes: usize) -> Result<Memory, CudaCode> {
        // SAFETY: a plain allocation; the caller initialises it.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(code)?;
        Ok(Memory { ptr, bytes })
    }

    fn host_alloc_mapped(&self, bytes: usize) -> Result<*mut c_void, CudaCode> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a pinned allocation; `MappedHost` zeroes it before use.
        unsafe { result::malloc_host(bytes, flags) }.map_err(code)
    }

    unsafe fn host_device_addr(&self, host: *mut c_void) -> Result<u64, CudaCode> {
        let mut device = 0;
        // SAFETY: per the caller, `host` is live mapped memory.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) }
            .result()
            .map_err(code)?;
        Ok(device)
    }

    unsafe fn host_free(host: *mut c_void) {
        // SAFETY: per the caller.
        let _ = unsafe { result::free_host(host) };
    }

    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        unsafe { result::memcpy_htod_sync(dst, src) }.map_err(code)
    }

    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.map_err(code)
    }

    unsafe fn htod_async(
        &self,
        dst: u64,
        src: &MappedHost,
        bytes: usize,
        stream: &Stream,
    ) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.host_ptr().cast(), bytes, stream.0) })
    }

    unsafe fn memset_d8(&self, dst: u64, value: u8, n: usize) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        unsafe { result::memset_d8_sync(dst, value, n) }.map_err(code)
    }

    unsafe fn memset_d16(&self, dst: u64, value: u16, n: usize) -> Result<(), CudaCode> {
        // SAFETY: per the trait's contract.
        check(unsafe { sys::cuMemsetD16_v2(dst, value, n) })
    }

    fn tensor_map(&self, t: &TensorMap2d) -> Result<[u8; TENSOR_MAP_BYTES], CudaCode> {
        use sys::{
            CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
            CUtensorMapL2promotion, CUtensorMapSwizzle,
        };
        let mut m = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        let (dims, strides, boxes, elem_strides) = t.encode_arrays();
        // SAFETY: every pointer is to a live local of the rank's length; the
        // call only writes the descriptor.
        check(unsafe {
            sys::cuTensorMapEncodeTiled(
                m.as_mut_ptr(),
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                t.base as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        })?;
        // SAFETY: zero-initialised, then written by the driver; plain bytes.
        let m = unsafe { m.assume_init() };
        Ok(tensor_map_bytes(&m.opaque))
    }

    fn stream(&self) -> Result<Stream, CudaCode> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(code)
    }

    fn stream_synchronize(&self, stream: &Stream) -> Result<(), CudaCode> {
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(stream.0) }.map_err(code)
    }

    unsafe fn launch(
        &self,
        f: Function,
        shape: LaunchShape,
        stream: &Stream,
        params: *mut c_void,
    ) -> Result<(), CudaCode> {
        let launch = if shape.cooperative {
            result::launch_cooperative_kernel
        } else {
            result::launch_kernel
        };
        // SAFETY: per the trait's contract; the driver copies the block.
        unsafe {
            launch(
                f.0,
                (shape.grid, 1, 1),
                (shape.block, 1, 1),
                shape.smem,
                stream.0,
                &mut [params],
            )
        }
        .map_err(code)
    }

    fn event(&self) -> Result<Event, CudaCode> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(code)
    }

    fn record(&self, event: &Event, stream: &Stream) -> Result<(), CudaCode> {
        // SAFETY: a live event and stream.
        unsafe { result::event::record(event.0, stream.0) }.map_err(code)
    }

    fn query(&self, event: &Event) -> Result<bool, CudaCode> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(event.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(CudaCode(e as u32)),
        }
    }

    fn event_synchronize(&self, event: &Event) -> Result<(), CudaCode> {
        // SAFETY: a live event.
        check(unsafe { sys::cuEventSynchronize(event.0) })
    }

    fn elapsed_ms(&self, start: &Event, end: &Event) -> Result<f32, CudaCode> {
        // SAFETY: both events recorded and complete.
        unsafe { result::event::elapsed(start.0, end.0) }.map_err(code)
    }
}
