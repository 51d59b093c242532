//! The empty step on cudarc, for the launch-overhead bench.
//!
//! `CudarcBackend` refuses a position past its KV capacity before launching,
//! and keeps its launch path crate-private, so this loads the same cubin
//! bytes (from the NVRTC cache the backend filled) into the same primary
//! context and launches `qmk_decode_step` exactly as the backend does:
//! same [`KernelParams`] block, same grid, same dynamic shared memory,
//! `cuLaunchCooperativeKernel` on a non-blocking stream. The cust backend's
//! `CustBackend::empty_launches` does the same through cust.
//!
//! LEAD: once `CudarcBackend` has an `empty_launches(n)` of its own, this
//! module can go.

use std::ffi::{c_void, CString};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, DriverError};
use qmk_backend_cudarc::CudarcBackend;
use qmk_engine::Backend;
use qmk_kernels::host::{base_params, set_buffer, Buffer};
use qmk_kernels::{source::entry, Compiler, HostStatus, KernelParams, SyncState, THREADS_PER_CTA};

type R<T> = Result<T, String>;

fn drv(call: &'static str) -> impl Fn(DriverError) -> String {
    move |e| format!("CUDA {call} failed: {e}")
}

struct Raw {
    module: sys::CUmodule,
    stream: sys::CUstream,
    bufs: Vec<u64>,
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: created below, destroyed once; errors ignored in drop.
        unsafe {
            if !self.stream.is_null() {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
            for &b in &self.bufs {
                let _ = result::free_sync(b);
            }
            if !self.module.is_null() {
                let _ = result::module::unload(self.module);
            }
        }
    }
}

/// Host time of `n` empty steps queued back to back on cudarc, closed by
/// a stream synchronisation.
pub fn empty_launches(b: &mut CudarcBackend, n: usize) -> R<Duration> {
    // Binds the backend's (primary) context to this thread.
    b.reset().map_err(|e| e.to_string())?;
    let build = b.kernel_build().clone();
    let cubin = Compiler::new()
        .and_then(|c| c.compile(&build, b.arch()))
        .map_err(|e| e.to_string())?;
    let launch = b.launch_info();
    let mut raw = Raw {
        module: std::ptr::null_mut(),
        stream: std::ptr::null_mut(),
        bufs: Vec::new(),
    };
    // SAFETY: a complete cubin image; the driver validates it.
    raw.module = unsafe { result::module::load_data(cubin.bytes.as_ptr().cast()) }
        .map_err(drv("cuModuleLoadData"))?;
    let name = CString::new(entry::DECODE_STEP).expect("no NUL");
    // SAFETY: the module is loaded.
    let f = unsafe { result::module::get_function(raw.module, name) }
        .map_err(drv("cuModuleGetFunction"))?;
    // SAFETY: valid function handle.
    unsafe {
        result::function::set_function_attribute(
            f,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            launch.smem_bytes as i32,
        )
    }
    .map_err(drv("cuFuncSetAttribute"))?;
    raw.stream = result::stream::create(result::stream::StreamKind::NonBlocking)
        .map_err(drv("cuStreamCreate"))?;

    // The parameter block: only sync and status are touched by an empty step.
    let capacity = b.capacity() as u32;
    let mut p: KernelParams = base_params(b.config(), capacity, Duration::from_secs(2));
    for bytes in [
        std::mem::size_of::<SyncState>(),
        std::mem::size_of::<HostStatus>(),
    ] {
        // SAFETY: plain allocation, zeroed and synchronised below.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(drv("cuMemAlloc"))?;
        raw.bufs.push(ptr);
        // SAFETY: ptr holds `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(drv("cuMemsetD8"))?;
    }
    result::ctx::synchronize().map_err(drv("cuCtxSynchronize"))?;
    set_buffer(&mut p, Buffer::Sync, raw.bufs[0]);
    p.status = raw.bufs[1];
    p.pos = capacity; // past the KV cache: every CTA returns at once
    p.token = 0;

    let once = |p: &mut KernelParams| -> R<()> {
        let mut args = [(p as *mut KernelParams).cast::<c_void>()];
        // SAFETY: one Params by value; sync and status are live; an empty
        // step touches nothing else.
        unsafe {
            sys::cuLaunchCooperativeKernel(
                f,
                launch.grid,
                1,
                1,
                THREADS_PER_CTA,
                1,
                1,
                launch.smem_bytes,
                raw.stream,
                args.as_mut_ptr(),
            )
        }
        .result()
        .map_err(drv("cuLaunchCooperativeKernel"))
    };
    let t0 = Instant::now();
    let r = (0..n).try_for_each(|_| once(&mut p));
    // SAFETY: live stream.
    let s = unsafe { result::stream::synchronize(raw.stream) }.map_err(drv("cuStreamSynchronize"));
    let t = t0.elapsed();
    r.and(s).map(|()| t)
}
