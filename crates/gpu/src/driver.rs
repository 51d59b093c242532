//! The CUDA driver calls a [`crate::GpuBackend`] makes, as one trait: each
//! binding (cudarc, cust) implements it in a few hundred lines, and every
//! piece of host logic above it is written once.
//!
//! Every call reports the driver's result code ([`CudaCode`]); the backend
//! names the call in its error and decides what is sticky. Handles that
//! own driver resources (modules, streams, events, allocations) free them
//! on drop, with the context current (the backend binds it first).

use std::ffi::c_void;

use qmk_engine::BackendKind;
use qmk_kernels::Arch;

use crate::cuda::CudaCode;
use crate::error::{Error, Result};
use crate::options::DeviceInfo;

/// A device attribute the backend reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceAttr {
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
    ComputeMajor,
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
    ComputeMinor,
    /// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
    MultiprocessorCount,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`.
    MaxSharedMemoryPerBlockOptin,
    /// `CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH`.
    CooperativeLaunch,
}

/// The shape of one launch: a 1-D grid of 1-D CTAs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// CTAs.
    pub grid: u32,
    /// Threads per CTA.
    pub block: u32,
    /// Dynamic shared memory per CTA, bytes.
    pub smem: u32,
    /// `cuLaunchCooperativeKernel`: every CTA co-resident (grid barriers).
    pub cooperative: bool,
}

impl LaunchShape {
    /// `grid` CTAs of the cubin's block size, no dynamic shared memory, a
    /// plain launch (the probes and the bandwidth kernel).
    pub fn plain(grid: u32) -> LaunchShape {
        LaunchShape {
            grid,
            block: qmk_kernels::THREADS_PER_CTA,
            smem: 0,
            cooperative: false,
        }
    }
}

/// A device allocation (freed on drop).
pub trait DeviceMemory {
    /// Its device address.
    fn addr(&self) -> u64;
    /// Its size in bytes.
    fn bytes(&self) -> usize;
}

/// Pinned host memory mapped into the device's address space: the kernel's
/// status block when it lives on the host, and the staging word of the
/// abort flag. Zeroed when adopted, freed on drop.
#[derive(Debug)]
pub struct MappedHost {
    host: *mut c_void,
    device: u64,
    bytes: usize,
    free: unsafe fn(*mut c_void),
}

impl MappedHost {
    /// Adopts `bytes` of pinned host memory at `host`: zeroes it, asks
    /// `device_ptr` for the address the device sees, and releases it with
    /// `free` on failure and on drop.
    ///
    /// # Safety
    /// `host` points at `bytes` writable bytes of pinned memory allocated
    /// with `CU_MEMHOSTALLOC_DEVICEMAP`, which `free` releases.
    pub unsafe fn adopt(
        host: *mut c_void,
        bytes: usize,
        free: unsafe fn(*mut c_void),
        device_ptr: impl FnOnce(*mut c_void) -> Result<u64, CudaCode>,
    ) -> Result<MappedHost, CudaCode> {
        let mut m = MappedHost {
            host,
            device: 0,
            bytes,
            free,
        };
        // SAFETY: per the caller, host points at `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, bytes) };
        m.device = device_ptr(host)?;
        Ok(m)
    }
    /// The host address (page aligned).
    pub fn host_ptr(&self) -> *mut u8 {
        self.host.cast()
    }
    /// The whole buffer as a byte slice (a staging buffer being filled).
    ///
    /// # Safety
    /// No device work reads or writes the buffer while the slice lives (the
    /// copy from it has landed, no kernel addresses it).
    pub unsafe fn host_slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes at `host` are ours (adopted); per the
        // caller, nothing else touches them meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.host.cast::<u8>(), self.bytes) }
    }
    /// The address the device sees.
    pub fn device_addr(&self) -> u64 {
        self.device
    }
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        // SAFETY: adopted once, freed once with its own release function.
        unsafe { (self.free)(self.host) }
    }
}

/// Bytes of a bulk tensor copy descriptor (`CUtensorMap`).
pub const TENSOR_MAP_BYTES: usize = 128;

/// A descriptor's bytes from the 16 words the driver API writes it as.
pub fn tensor_map_bytes(words: &[u64; TENSOR_MAP_BYTES / 8]) -> [u8; TENSOR_MAP_BYTES] {
    let mut out = [0u8; TENSOR_MAP_BYTES];
    for (o, w) in out.chunks_exact_mut(8).zip(words) {
        o.copy_from_slice(&w.to_ne_bytes());
    }
    out
}

/// A 2-D bf16 tensor in device memory that the kernel reads with bulk
/// tensor copies ([`Driver::tensor_map`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMap2d {
    /// Device address of element (0, 0); 16-byte aligned.
    pub base: u64,
    /// Elements per row.
    pub cols: u64,
    /// Rows.
    pub rows: u64,
    /// Bytes from one row to the next; a multiple of 16.
    pub row_bytes: u64,
    /// Elements per row of one copy's box (at most 256).
    pub box_cols: u32,
    /// Rows of one copy's box (at most 256).
    pub box_rows: u32,
}

impl TensorMap2d {
    /// The array arguments of `cuTensorMapEncodeTiled`, innermost dimension
    /// first: global dims, the row stride in bytes, box dims, element
    /// strides (every element).
    pub fn encode_arrays(&self) -> ([u64; 2], [u64; 1], [u32; 2], [u32; 2]) {
        (
            [self.cols, self.rows],
            [self.row_bytes],
            [self.box_cols, self.box_rows],
            [1, 1],
        )
    }
}

/// One CUDA context on one device, through one driver binding. A value of
/// this type is the context (the device's primary context, retained); it is
/// released on drop, after everything the backend allocated in it.
///
/// The `unsafe` calls take raw device addresses: the caller guarantees they
/// lie inside live allocations of this context, and that parameter blocks
/// match the kernel's signature.
pub trait Driver: Sized {
    /// The binding's name (`cudarc`, `cust`), for messages and test names.
    const NAME: &'static str;
    /// What `qmk_engine::Backend::kind` reports.
    const KIND: BackendKind;
    /// A loaded module (unloaded on drop).
    type Module;
    /// A kernel of a loaded module (valid while the module is).
    type Function: Copy;
    /// A non-blocking stream (destroyed on drop).
    type Stream;
    /// An event (destroyed on drop).
    type Event;
    /// A device allocation.
    type Memory: DeviceMemory;

    /// Loads and initialises the driver: [`Error::NoDriver`] where there is
    /// no libcuda, [`Error::NoDevice`] where it reports no device (the CI's
    /// stub answers CUDA_ERROR_NO_DEVICE to every call).
    fn init() -> Result<()>;
    /// Devices the driver reports (after [`Driver::init`]).
    fn count() -> Result<usize, CudaCode>;
    /// The driver's name of device `ordinal`.
    fn name(ordinal: usize) -> Result<String, CudaCode>;
    /// Device memory of device `ordinal`, bytes.
    fn total_mem(ordinal: usize) -> Result<u64, CudaCode>;
    /// An attribute of device `ordinal`.
    fn attribute(ordinal: usize, attr: DeviceAttr) -> Result<i32, CudaCode>;

    /// Retains device `ordinal`'s primary context and makes it current.
    fn open(ordinal: usize) -> Result<Self, CudaCode>;
    /// Makes the context current on the calling thread.
    fn bind(&self) -> Result<(), CudaCode>;
    /// Whether device `ordinal` can map device `peer`'s memory
    /// (`cuDeviceCanAccessPeer`; a device and itself: true).
    fn can_access_peer(ordinal: usize, peer: usize) -> Result<bool, CudaCode>;
    /// Maps `peer`'s allocations into this context (`cuCtxEnablePeerAccess`,
    /// with this context current); a mapping that already exists is not
    /// an error. Both contexts are primary contexts of different devices.
    fn enable_peer_access(&self, peer: &Self) -> Result<(), CudaCode>;
    /// (free, total) device memory, bytes.
    fn mem_info(&self) -> Result<(u64, u64), CudaCode>;
    /// Waits for all work of the context (legacy-stream copies and memsets
    /// included).
    fn synchronize(&self) -> Result<(), CudaCode>;

    /// Loads a cubin image.
    fn load_module(&self, image: &[u8]) -> Result<Self::Module, CudaCode>;
    /// Looks up kernel `name` in `module`.
    fn function(&self, module: &Self::Module, name: &str) -> Result<Self::Function, CudaCode>;
    /// The value of the 8-byte global `name` of `module`; `None` when the
    /// module has no such symbol.
    fn global_u64(&self, module: &Self::Module, name: &str) -> Result<Option<u64>, CudaCode>;
    /// Lets `f` use `bytes` of dynamic shared memory per CTA.
    fn set_max_dynamic_smem(&self, f: Self::Function, bytes: u32) -> Result<(), CudaCode>;
    /// Registers per thread of `f`.
    fn registers(&self, f: Self::Function) -> Result<i32, CudaCode>;
    /// CTAs of `block` threads with `smem` bytes of dynamic shared memory
    /// that fit on one SM.
    fn occupancy(&self, f: Self::Function, block: u32, smem: u32) -> Result<i32, CudaCode>;

    /// `bytes` of uninitialised device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Memory, CudaCode>;
    /// `bytes` of pinned host memory mapped into the device
    /// (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`), not initialised.
    fn host_alloc_mapped(&self, bytes: usize) -> Result<*mut c_void, CudaCode>;
    /// The address the device sees for mapped host memory `host`
    /// (`cuMemHostGetDevicePointer`).
    ///
    /// # Safety
    /// `host` came from [`Driver::host_alloc_mapped`] and is live.
    unsafe fn host_device_addr(&self, host: *mut c_void) -> Result<u64, CudaCode>;
    /// Releases pinned host memory (`cuMemFreeHost`). Errors (a dead
    /// context) cannot be reported: it runs from drop.
    ///
    /// # Safety
    /// `host` came from [`Driver::host_alloc_mapped`] and is freed once.
    unsafe fn host_free(host: *mut c_void);
    /// `bytes` of zeroed pinned host memory mapped into the device, freed
    /// on drop.
    fn alloc_mapped(&self, bytes: usize) -> Result<MappedHost, CudaCode> {
        let host = self.host_alloc_mapped(bytes)?;
        // SAFETY: `bytes` pinned bytes with DEVICEMAP, released by
        // `host_free`; the device address is asked of the same context.
        unsafe { MappedHost::adopt(host, bytes, Self::host_free, |h| self.host_device_addr(h)) }
    }
    /// Synchronous copy of `src` to device address `dst`.
    ///
    /// # Safety
    /// `dst..dst + src.len()` lies in a live allocation.
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaCode>;
    /// Synchronous copy of device address `src` to `dst`.
    ///
    /// # Safety
    /// `src..src + dst.len()` lies in a live allocation.
    unsafe fn dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaCode>;
    /// Asynchronous copy of `bytes` bytes from the start of pinned `src` to
    /// device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst + bytes` lies in a live allocation; `bytes <= src.bytes()`.
    unsafe fn htod_async(
        &self,
        dst: u64,
        src: &MappedHost,
        bytes: usize,
        stream: &Self::Stream,
    ) -> Result<(), CudaCode>;
    /// Sets `n` bytes at `dst` to `value` (on the legacy stream: call
    /// [`Driver::synchronize`] before work on other streams relies on it).
    ///
    /// # Safety
    /// `dst..dst + n` lies in a live allocation.
    unsafe fn memset_d8(&self, dst: u64, value: u8, n: usize) -> Result<(), CudaCode>;
    /// Sets `n` 16-bit words at `dst` to `value` (legacy stream, as
    /// [`Driver::memset_d8`]).
    ///
    /// # Safety
    /// `dst..dst + 2 n` lies in a live allocation.
    unsafe fn memset_d16(&self, dst: u64, value: u16, n: usize) -> Result<(), CudaCode>;

    /// Encodes the bulk tensor copy descriptor (`CUtensorMap`, 128 bytes)
    /// of the 2-D bf16 tensor `t`: no swizzle, no interleave, 256-byte L2
    /// promotion, elements past the tensor read as zero. The kernel copies
    /// boxes of it into shared memory with `cp.async.bulk.tensor` (sm_90 and
    /// later).
    fn tensor_map(&self, t: &TensorMap2d) -> Result<[u8; TENSOR_MAP_BYTES], CudaCode>;

    /// A stream that does not synchronise with the legacy stream.
    fn stream(&self) -> Result<Self::Stream, CudaCode>;
    /// Waits for all work queued on `stream`.
    fn stream_synchronize(&self, stream: &Self::Stream) -> Result<(), CudaCode>;
    /// Launches `f` with the 1-D shape `shape` and one parameter block
    /// passed by value (`params` points at it; the driver copies it at
    /// launch).
    ///
    /// # Safety
    /// `params` points at the kernel's parameter type, and every address in
    /// it stays a live allocation until the launch completes.
    unsafe fn launch(
        &self,
        f: Self::Function,
        shape: LaunchShape,
        stream: &Self::Stream,
        params: *mut c_void,
    ) -> Result<(), CudaCode>;

    /// A timing event.
    fn event(&self) -> Result<Self::Event, CudaCode>;
    /// Records `event` on `stream`.
    fn record(&self, event: &Self::Event, stream: &Self::Stream) -> Result<(), CudaCode>;
    /// `true` once the work before `event` has completed; an error of that
    /// work (a sticky one included) is reported here.
    fn query(&self, event: &Self::Event) -> Result<bool, CudaCode>;
    /// Blocks until the work before `event` has completed (an upload waits
    /// for a staging buffer's copy before refilling it); errors as
    /// [`Driver::query`].
    fn event_synchronize(&self, event: &Self::Event) -> Result<(), CudaCode>;
    /// Milliseconds between two completed events.
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32, CudaCode>;
}

/// Number of CUDA devices ([`Error::NoDriver`] / [`Error::NoDevice`] when
/// none).
pub fn device_count<D: Driver>() -> Result<usize> {
    D::init()?;
    let n = D::count().map_err(Error::at("cuDeviceGetCount"))?;
    if n == 0 {
        return Err(Error::NoDevice(CudaCode::NO_DEVICE));
    }
    Ok(n)
}

/// Describes device `ordinal` (free memory needs a context: 0 here, filled
/// in by the backend).
pub fn device_info<D: Driver>(ordinal: usize) -> Result<DeviceInfo> {
    let count = device_count::<D>()?;
    if ordinal >= count {
        return Err(Error::DeviceIndex {
            index: ordinal,
            count,
        });
    }
    let attr = |a| D::attribute(ordinal, a).map_err(Error::at("cuDeviceGetAttribute"));
    let major = attr(DeviceAttr::ComputeMajor)?;
    let minor = attr(DeviceAttr::ComputeMinor)?;
    Ok(DeviceInfo {
        ordinal,
        name: D::name(ordinal).unwrap_or_else(|_| "unknown GPU".into()),
        arch: Arch::from_cc(major, minor)?,
        sms: attr(DeviceAttr::MultiprocessorCount)? as u32,
        total_mem: D::total_mem(ordinal).map_err(Error::at("cuDeviceTotalMem"))?,
        free_mem: 0,
        max_smem_optin: attr(DeviceAttr::MaxSharedMemoryPerBlockOptin)? as u32,
        cooperative: attr(DeviceAttr::CooperativeLaunch)? != 0,
    })
}

/// Every device.
pub fn devices<D: Driver>() -> Result<Vec<DeviceInfo>> {
    (0..device_count::<D>()?).map(device_info::<D>).collect()
}
