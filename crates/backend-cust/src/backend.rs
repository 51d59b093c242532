//! The megakernel on the cust driver bindings.
//!
//! Mirrors `qmk-backend-cudarc` step for step (same cubin, same
//! [`KernelParams`], same grid, same waits); the binding-independent parts
//! come from [`qmk_kernels::host`]. cust has no wrapper for cooperative
//! launch, `cuFuncSetAttribute`, device-mapped host memory or the newer
//! device attributes: those go through `cust::sys`.

use std::ffi::{c_void, CString};
use std::os::raw::c_int;
use std::time::{Duration, Instant};

use cust::context::{Context, CurrentContext};
use cust::device::Device;
use cust::error::CudaError;
use cust::event::{Event, EventFlags, EventStatus};
use cust::memory::{mem_get_info, CopyDestination, DeviceBuffer};
use cust::module::Module;
use cust::stream::{Stream, StreamFlags};
use cust::sys;
use qmk_engine::{Backend, BackendKind, StepOutput};
use qmk_kernels::host::{
    base_params, duration_ns, prefill_chunks, prefill_launch_params, set_buffer,
    set_prefill_buffer, tie_embeddings, weight_chunks, Buffer, GpuOptions, LaunchInfo, MemoryPlan,
    Progress, ABORT_GRACE, UPLOAD_PIECE_BYTES,
};
use qmk_kernels::params::{err, phase_name, FLAG_DEBUG_HANG, FLAG_DEBUG_OOB};
use qmk_kernels::{
    source::entry, Arch, Compiler, Cubin, KernelBuild, KernelParams, PrefillParams, Resources,
};
use qmk_model::{Config, Weights};

use crate::device::{device_info, DeviceInfo};
use crate::error::{check, cu, driver, CudaCode, Error, Result};
use crate::mem::{addr, alloc, zero, StatusBlock};

/// How a [`CustBackend`] is set up (shared with the cudarc backend).
pub type Options = GpuOptions;

/// Raw handles of the cubin's kernels (they live as long as the module).
pub(crate) struct Functions {
    pub step: sys::CUfunction,
    pub stream_read: sys::CUfunction,
}

/// The tensor-core prefill path (`GpuOptions::prefill_chunk`): its kernel,
/// launch shape and a parameter block with its scratch buffers set.
pub(crate) struct Prefill {
    pub func: sys::CUfunction,
    pub launch: LaunchInfo,
    pub scratch: PrefillParams,
    pub chunk: u32,
}

/// The megakernel engine on one GPU: weights, KV cache, scratch and the
/// loaded cubin.
pub struct CustBackend {
    pub(crate) info: DeviceInfo,
    pub(crate) config: Config,
    pub(crate) build: KernelBuild,
    pub(crate) cubin_log: String,
    pub(crate) funcs: Functions,
    pub(crate) params: KernelParams,
    pub(crate) launch: LaunchInfo,
    pub(crate) memory: MemoryPlan,
    pub(crate) capacity: usize,
    pub(crate) next_pos: usize,
    pub(crate) dead: Option<String>,
    pub(crate) needs_reset: Option<String>,
    pub(crate) debug_flags: u32,
    pub(crate) last_argmax: u32,
    pub(crate) opts: Options,
    /// Seconds the weight upload took (host clock around synchronous
    /// copies, closed by a context synchronisation).
    pub(crate) upload_time: Duration,
    // Field order is drop order: the stream first, the context last.
    pub(crate) stream: Stream,
    pub(crate) status: StatusBlock,
    pub(crate) sync: DeviceBuffer<u8>,
    pub(crate) logits: DeviceBuffer<u8>,
    pub(crate) prefill: Option<Prefill>,
    _weights: Vec<DeviceBuffer<u8>>,
    _buffers: Vec<DeviceBuffer<u8>>,
    _module: Module,
    pub(crate) ctx: Context,
}

/// `cuFuncSetAttribute` / `cuFuncGetAttribute` through `cust::sys` (cust's
/// `Function` can only read attributes).
fn set_func_attr(f: sys::CUfunction, a: sys::CUfunction_attribute, v: i32) -> Result<()> {
    // SAFETY: valid function handle of a loaded module.
    check("cuFuncSetAttribute", unsafe {
        sys::cuFuncSetAttribute(f, a, v)
    })
}

fn get_func_attr(f: sys::CUfunction, a: sys::CUfunction_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: valid function handle, valid out pointer.
    check("cuFuncGetAttribute", unsafe {
        sys::cuFuncGetAttribute(&mut v, a, f)
    })?;
    Ok(v)
}

/// CTAs of `THREADS_PER_CTA` threads with `smem` dynamic shared memory that
/// fit on one SM.
pub(crate) fn occupancy(f: sys::CUfunction, smem: u32) -> Result<i32> {
    let mut n: c_int = 0;
    // SAFETY: valid function handle, valid out pointer.
    check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut n,
            f,
            qmk_kernels::THREADS_PER_CTA as c_int,
            smem as usize,
        )
    })?;
    Ok(n)
}

/// Copies `src` to device address `dst` in [`UPLOAD_PIECE_BYTES`] pieces.
fn upload(dst: u64, src: &[u8], progress: &mut dyn Progress) -> Result<()> {
    for (i, piece) in src.chunks(UPLOAD_PIECE_BYTES).enumerate() {
        let at = dst + (i * UPLOAD_PIECE_BYTES) as u64;
        // SAFETY: the caller's allocation at dst holds src.len() bytes.
        unsafe { cust::memory::memcpy_htod(at, piece.as_ptr().cast(), piece.len()) }
            .map_err(cu("cuMemcpyHtoD"))?;
        progress.advance(piece.len() as u64);
    }
    Ok(())
}

impl CustBackend {
    /// Uploads `weights` (split per the kernel's plan), compiles or loads the
    /// cubin for this device, and sizes the KV cache for `opts.capacity`.
    pub fn new(weights: &Weights, opts: Options, progress: &mut dyn Progress) -> Result<Self> {
        let mut info = device_info(opts.device)?;
        let ctx = Context::new(Device::get_device(opts.device as u32).map_err(cu("cuDeviceGet"))?)
            .map_err(cu("cuDevicePrimaryCtxRetain"))?;
        CurrentContext::set_current(&ctx).map_err(cu("cuCtxSetCurrent"))?;
        info.free_mem = mem_get_info().map_err(cu("cuMemGetInfo"))?.0 as u64;
        let config = weights.config.clone();
        let capacity = u32::try_from(opts.capacity)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::Option {
                field: "capacity",
                reason: format!("{} is outside 1..=2^32-1", opts.capacity),
            })?;
        let prefill_chunk = qmk_kernels::host::clamp_prefill_chunk(opts.prefill_chunk, capacity);
        let build = match &opts.plan {
            Some(plan) => KernelBuild::with_plan(&config, plan.clone())?,
            None => KernelBuild::new(&config)?,
        };
        let cubin = match &opts.cubin {
            Some(path) => Cubin::from_file(path, info.arch)?,
            None => Compiler::new()?.compile(&build, info.arch)?,
        };
        let device_name = format!("{} ({})", info.name, info.arch);
        if build.smem_bytes > info.max_smem_optin {
            return Err(Error::SharedMemory {
                needed: build.smem_bytes,
                available: info.max_smem_optin,
                device: device_name,
            });
        }
        if !info.cooperative {
            return Err(Error::Launch {
                device: device_name,
                reason: "the device does not support cooperative launch".into(),
            });
        }

        // Module (the same cubin bytes as cudarc), fingerprint, functions.
        let module =
            Module::from_cubin(&cubin.bytes, &[]).map_err(|e| match CudaCode::from_cust(e) {
                code @ CudaCode(200 | 209 | 218 | 222) => Error::CubinArch {
                    cubin: qmk_kernels::host::describe_cubin(&cubin.bytes, opts.cubin.as_deref()),
                    device: device_name.clone(),
                    code,
                },
                code => driver("cuModuleLoadDataEx", code),
            })?;
        let get = |name: &str| -> Result<sys::CUfunction> {
            Ok(module
                .get_function(name)
                .map_err(cu("cuModuleGetFunction"))?
                .to_raw())
        };
        let funcs = Functions {
            step: get(entry::DECODE_STEP)?,
            stream_read: get(entry::STREAM_READ)?,
        };
        {
            let name = CString::new(entry::FINGERPRINT).expect("no NUL");
            let mut found = 0u64;
            match module.get_global::<u64>(&name) {
                Ok(sym) => sym
                    .copy_to(&mut found)
                    .map_err(cu("cuMemcpyDtoH (fingerprint)"))?,
                Err(CudaError::NotFound) => {}
                Err(e) => return Err(cu("cuModuleGetGlobal")(e)),
            }
            if found != build.fingerprint {
                return Err(Error::Fingerprint {
                    expected: build.fingerprint,
                    found,
                });
            }
        }

        // Launch shape: occupancy x SMs, every CTA co-resident.
        use sys::CUfunction_attribute::*;
        set_func_attr(
            funcs.step,
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            build.smem_bytes as i32,
        )?;
        let occ = occupancy(funcs.step, build.smem_bytes)?;
        let registers = get_func_attr(funcs.step, CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(0) as u32;
        let launch = LaunchInfo::from_occupancy(
            occ,
            info.sms,
            opts.ctas_per_sm,
            build.smem_bytes,
            registers,
        )
        .ok_or_else(|| Error::Launch {
            device: device_name.clone(),
            reason: format!(
                "no CTA of {} threads with {} B shared memory fits on an SM (occupancy {occ})",
                qmk_kernels::THREADS_PER_CTA,
                build.smem_bytes
            ),
        })?;

        // The prefill kernel, when enabled: same CTA size, its own shared
        // memory; never more CTAs than the decode grid (the LM head's
        // partials are sized for that grid).
        let prefill_fn = match prefill_chunk {
            None => None,
            Some(_) => {
                let f = get(entry::PREFILL_CHUNK)?;
                let pf_smem = build.prefill_smem_for(info.arch);
                if pf_smem > info.max_smem_optin {
                    return Err(Error::SharedMemory {
                        needed: pf_smem,
                        available: info.max_smem_optin,
                        device: device_name,
                    });
                }
                set_func_attr(
                    f,
                    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    pf_smem as i32,
                )?;
                let occ = occupancy(f, pf_smem)?;
                let regs = get_func_attr(f, CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(0) as u32;
                let l = LaunchInfo::from_occupancy(
                    occ,
                    info.sms,
                    Some(launch.ctas_per_sm),
                    pf_smem,
                    regs,
                )
                .ok_or_else(|| Error::Launch {
                    device: device_name.clone(),
                    reason: format!(
                        "no prefill CTA of {} threads with {} B shared memory fits on an SM (occupancy {occ})",
                        qmk_kernels::THREADS_PER_CTA,
                        pf_smem
                    ),
                })?;
                Some((f, l))
            }
        };

        // Memory plan, checked before the first allocation.
        let memory = MemoryPlan::new_with_prefill(&config, capacity, launch.grid, prefill_chunk)?;
        if memory.total_bytes > info.free_mem {
            return Err(Error::OutOfMemory {
                what: format!(
                    "{} weights + a {}-position KV cache ({} B weights, {} B KV)",
                    config.model_type,
                    capacity,
                    memory.weight_bytes,
                    2 * memory.kv_cache_bytes
                ),
                needed: memory.total_bytes,
                available: info.free_mem,
            });
        }

        let mut params = base_params(&config, capacity, opts.spin_timeout);

        // Weights: one allocation per planned chunk, in plan order.
        let chunks = weight_chunks(&build, weights)?;
        let t0 = Instant::now();
        progress.begin("uploading weights", memory.weight_bytes);
        let mut wbufs = Vec::with_capacity(chunks.len());
        for c in &chunks {
            let what = format!("{} chunk {}", c.tensor, c.chunk);
            let buf = alloc(c.host.len() as u64, &what, false)?;
            upload(addr(&buf), c.host, progress)?;
            c.set(&mut params, addr(&buf));
            wbufs.push(buf);
        }
        CurrentContext::synchronize().map_err(cu("cuCtxSynchronize (weight upload)"))?;
        let upload_time = t0.elapsed();
        progress.finish();
        tie_embeddings(&config, &mut params);

        // KV cache, rope tables, scratch.
        let rope =
            qmk_model::reference::Rope::new(config.head_dim(), config.rope_theta, opts.capacity);
        let mut buffers = Vec::with_capacity(memory.buffers.len());
        let (mut sync, mut logits) = (None, None);
        for &(b, bytes) in &memory.buffers {
            let table = match b {
                Buffer::RopeCos => Some(&rope.cos),
                Buffer::RopeSin => Some(&rope.sin),
                _ => None,
            };
            let buf = alloc(bytes, b.name(), table.is_none())?;
            if let Some(t) = table {
                let src: &[u8] = bytemuck::cast_slice(t);
                if src.len() as u64 != bytes {
                    return Err(Error::Overflow(format!(
                        "{}: the host table has {} bytes, the plan {bytes}",
                        b.name(),
                        src.len()
                    )));
                }
                upload(addr(&buf), src, &mut ())?;
            }
            set_buffer(&mut params, b, addr(&buf));
            match b {
                Buffer::Sync => sync = Some(buf),
                Buffer::Logits => logits = Some(buf),
                _ => buffers.push(buf),
            }
        }
        let sync = sync.expect("the memory plan has a sync buffer");
        let logits = logits.expect("the memory plan has a logits buffer");
        let status = StatusBlock::new()?;
        params.status = status.device_ptr();
        let prefill = match (prefill_fn, prefill_chunk) {
            (Some((func, launch)), Some(chunk)) => {
                let mut scratch: PrefillParams = bytemuck::Zeroable::zeroed();
                for &(b, bytes) in &memory.prefill {
                    let buf = alloc(bytes, b.name(), true)?;
                    set_prefill_buffer(&mut scratch, b, addr(&buf));
                    buffers.push(buf);
                }
                scratch.max_tokens = chunk;
                Some(Prefill {
                    func,
                    launch,
                    scratch,
                    chunk,
                })
            }
            _ => None,
        };
        // Pageable uploads may return before their last DMA lands.
        CurrentContext::synchronize().map_err(cu("cuCtxSynchronize"))?;

        let stream = Stream::new(StreamFlags::NON_BLOCKING, None).map_err(cu("cuStreamCreate"))?;
        Ok(CustBackend {
            info,
            config,
            build,
            cubin_log: cubin.log,
            funcs,
            params,
            launch,
            memory,
            capacity: opts.capacity,
            next_pos: 0,
            dead: None,
            needs_reset: None,
            debug_flags: 0,
            last_argmax: 0,
            opts,
            upload_time,
            stream,
            status,
            sync,
            logits,
            prefill,
            _weights: wbufs,
            _buffers: buffers,
            _module: module,
            ctx,
        })
    }

    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn launch_info(&self) -> LaunchInfo {
        self.launch
    }
    pub fn kernel_build(&self) -> &KernelBuild {
        &self.build
    }
    /// Every device allocation's size.
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.memory
    }
    /// Registers, spills and static smem per kernel (empty for a cubin
    /// loaded from a file).
    pub fn resources(&self) -> Vec<Resources> {
        qmk_kernels::parse_ptxas_log(&self.cubin_log)
    }
    pub fn arch(&self) -> Arch {
        self.info.arch
    }
    /// How long the weight upload took (synchronous copies, closed by a
    /// context synchronisation), and its bytes.
    pub fn upload_stats(&self) -> (Duration, u64) {
        (self.upload_time, self.memory.weight_bytes)
    }
    /// Grid barriers the last completed step passed (reported by the kernel).
    pub fn barriers_last_step(&mut self) -> Result<u32> {
        self.usable()?;
        Ok(self.status.read()?.barriers)
    }
    /// Changes the kernel's spin-wait budget (tests use a tiny one to force
    /// a barrier timeout).
    pub fn set_spin_timeout(&mut self, t: Duration) {
        self.params.spin_timeout_ns = duration_ns(t);
    }
    /// Test hook: `true` makes the next steps hang at their first grid
    /// barrier (one CTA never arrives), to exercise the bounded waits.
    #[doc(hidden)]
    pub fn set_debug_hang(&mut self, on: bool) {
        self.set_kernel_flags(FLAG_DEBUG_HANG, on);
    }
    /// A/B and test hook: sets (`on`) or clears the kernel flag bits `mask`
    /// (`qmk_kernels::params::FLAG_*`, e.g. `FLAG_ATTN_NO_SPLIT`,
    /// `FLAG_PF_NO_STREAM_K`) for every following step.
    #[doc(hidden)]
    pub fn set_kernel_flags(&mut self, mask: u32, on: bool) {
        self.debug_flags = if on {
            self.debug_flags | mask
        } else {
            self.debug_flags & !mask
        };
    }
    /// Test hook: `true` makes the next steps read out of bounds (one word
    /// past the logits buffer, then an address with no mapping), a real
    /// CUDA_ERROR_ILLEGAL_ADDRESS: the engine must become unusable.
    #[doc(hidden)]
    pub fn set_debug_oob(&mut self, on: bool) {
        self.set_kernel_flags(FLAG_DEBUG_OOB, on);
    }
    /// Changes the host deadline of one step.
    pub fn set_step_deadline(&mut self, t: Duration) {
        self.opts.step_deadline = t;
    }
    /// Changes the shortest prompt that `Backend::prefill` sends to the
    /// prefill kernel (`GpuOptions::prefill_min_tokens`; tests and the
    /// threshold measurement time both paths on one backend).
    pub fn set_prefill_min_tokens(&mut self, n: usize) {
        self.opts.prefill_min_tokens = n;
    }

    /// The prefill kernel's launch shape and chunk size, when enabled
    /// (`GpuOptions::prefill_chunk`).
    pub fn prefill_launch(&self) -> Option<(LaunchInfo, u32)> {
        self.prefill.as_ref().map(|p| (p.launch, p.chunk))
    }

    /// The whole KV cache as bf16 bits, K then V, each `[L, C, KV]` (tests
    /// compare it with the CPU reference's cache).
    pub fn read_kv_cache(&mut self) -> Result<(Vec<u16>, Vec<u16>)> {
        self.usable()?;
        let n = (self.memory.kv_cache_bytes / 2) as usize;
        let (mut k, mut v) = (vec![0u16; n], vec![0u16; n]);
        for (dst, src) in [(&mut k, self.params.k_cache), (&mut v, self.params.v_cache)] {
            // SAFETY: each cache holds kv_cache_bytes = 2 n bytes at src; no
            // step is running.
            check("cuMemcpyDtoH (KV cache)", unsafe {
                sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, 2 * n)
            })
            .map_err(|e| self.note(e))?;
        }
        Ok((k, v))
    }

    /// The tensor-core prefill: the prompt's ids uploaded once (by
    /// position), then one launch per chunk back to back, one wait.
    fn prefill_chunked(&mut self, tokens: &[u32], start: usize) -> Result<()> {
        let Some(pf) = self.prefill.as_ref() else {
            return Err(Error::Option {
                field: "prefill_chunk",
                reason: "the prefill kernel is not enabled".into(),
            });
        };
        let (func, launch, scratch, chunk) = (pf.func, pf.launch, pf.scratch, pf.chunk);
        let bytes: &[u8] = bytemuck::cast_slice(tokens);
        // SAFETY: the tokens buffer holds `capacity` u32 (by position);
        // start + len <= capacity was checked; nothing is running.
        check("cuMemcpyHtoD (prompt)", unsafe {
            sys::cuMemcpyHtoD_v2(
                scratch.tokens + start as u64 * 4,
                bytes.as_ptr().cast(),
                bytes.len(),
            )
        })
        .map_err(|e| self.note(e))?;
        // A pageable copy may return before its DMA lands, and the legacy
        // stream it runs on does not order our non-blocking stream: wait.
        CurrentContext::synchronize().map_err(|e| self.fail("cuCtxSynchronize (prompt)", e))?;
        let chunks = prefill_chunks(start, tokens.len(), chunk);
        let ev = self.new_event()?;
        for &(s, len) in &chunks {
            let mut p = prefill_launch_params(
                &self.config,
                &self.params,
                &scratch,
                s,
                len,
                self.debug_flags,
            );
            // SAFETY: qmk_prefill_chunk takes one PrefillParams by value;
            // every pointer in it is a live allocation of self.
            unsafe {
                self.launch_cooperative(
                    func,
                    launch.grid,
                    launch.smem_bytes,
                    &mut p,
                    "cuLaunchCooperativeKernel (prefill)",
                )
            }?;
        }
        self.record(&ev)?;
        let deadline = self
            .opts
            .step_deadline
            .saturating_mul(chunks.len().min(u32::MAX as usize) as u32);
        self.wait(&ev, deadline)
    }

    pub(crate) fn bind(&self) -> Result<()> {
        CurrentContext::set_current(&self.ctx).map_err(cu("cuCtxSetCurrent"))
    }

    pub(crate) fn usable(&self) -> Result<()> {
        // A dead engine is refused before any driver call (binding a
        // context that holds a sticky error could report a new error).
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        self.bind()?;
        if let Some(r) = &self.needs_reset {
            return Err(Error::NeedsReset(r.clone()));
        }
        Ok(())
    }

    /// Records a failure; a sticky one marks the engine unusable.
    pub(crate) fn note(&mut self, e: Error) -> Error {
        if let Error::Unusable { reason } = &e {
            self.dead = Some(reason.clone());
        }
        e
    }

    /// `map_err` adapter for cust calls made on behalf of this engine.
    pub(crate) fn fail(&mut self, call: &'static str, e: CudaError) -> Error {
        self.note(cu(call)(e))
    }

    /// Launches `f` cooperatively with one by-value parameter block.
    ///
    /// # Safety
    /// `P` must be the kernel's parameter type and every address in it a live
    /// allocation until the launch completes.
    pub(crate) unsafe fn launch_cooperative<P>(
        &mut self,
        f: sys::CUfunction,
        grid: u32,
        smem: u32,
        params: &mut P,
        what: &'static str,
    ) -> Result<()> {
        let mut args = [(params as *mut P).cast::<c_void>()];
        // SAFETY: per the caller; the driver copies the block at launch.
        let r = unsafe {
            sys::cuLaunchCooperativeKernel(
                f,
                grid,
                1,
                1,
                qmk_kernels::THREADS_PER_CTA,
                1,
                1,
                smem,
                self.stream.as_inner(),
                args.as_mut_ptr(),
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            sys::CUresult::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE => Err(Error::Launch {
                device: self.info.name.clone(),
                reason: format!("grid of {grid} CTAs is too large for a cooperative launch"),
            }),
            e => Err(self.note(driver(what, CudaCode::from_raw(e)))),
        }
    }

    pub(crate) fn launch_step(&mut self, token: u32, pos: usize, flags: u32) -> Result<()> {
        self.params.token = token;
        self.params.pos = u32::try_from(pos).map_err(|_| Error::Position {
            pos,
            reason: "does not fit the kernel's 32-bit position".into(),
        })?;
        self.params.flags = flags | self.debug_flags;
        let mut p = self.params;
        let (f, grid, smem) = (self.funcs.step, self.launch.grid, self.launch.smem_bytes);
        // SAFETY: qmk_decode_step takes one Params by value; every pointer in
        // it is a live allocation of self.
        unsafe { self.launch_cooperative(f, grid, smem, &mut p, "cuLaunchCooperativeKernel") }
    }

    pub(crate) fn new_event(&mut self) -> Result<Event> {
        Event::new(EventFlags::DEFAULT).map_err(|e| self.fail("cuEventCreate", e))
    }

    pub(crate) fn record(&mut self, ev: &Event) -> Result<()> {
        ev.record(&self.stream)
            .map_err(|e| self.fail("cuEventRecord", e))
    }

    /// Waits for `ev` with the host deadline; past it, raises the kernel's
    /// abort flag, waits a grace period, and reports a timeout. Then checks
    /// the kernel's own error report.
    pub(crate) fn wait(&mut self, ev: &Event, deadline: Duration) -> Result<()> {
        let t0 = Instant::now();
        let mut aborted = false;
        loop {
            match ev.query() {
                Ok(EventStatus::Ready) => break,
                Ok(EventStatus::NotReady) => {}
                Err(e) => return Err(self.fail("cuEventQuery (kernel execution)", e)),
            }
            let el = t0.elapsed();
            if !aborted && el > deadline {
                self.status.set_abort(1).map_err(|e| self.note(e))?;
                aborted = true;
            }
            if aborted && el > deadline + ABORT_GRACE {
                let reason = format!(
                    "the kernel did not stop within {} s of the abort flag (deadline {} ms)",
                    ABORT_GRACE.as_secs(),
                    deadline.as_millis()
                );
                self.dead = Some(reason.clone());
                return Err(Error::Timeout {
                    deadline_ms: deadline.as_millis(),
                    detail: reason,
                });
            }
            if el > Duration::from_micros(500) {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
        if aborted {
            self.status.set_abort(0).map_err(|e| self.note(e))?;
            let detail = match self.kernel_status() {
                Err(e) => format!("the kernel stopped on the abort flag: {e}"),
                Ok(()) => "the kernel finished just after the deadline".to_string(),
            };
            self.needs_reset = Some("a step timed out".into());
            return Err(Error::Timeout {
                deadline_ms: deadline.as_millis(),
                detail,
            });
        }
        self.kernel_status()
    }

    /// Reads the kernel's error report; on an error, clears the barrier
    /// state and requires a reset.
    fn kernel_status(&mut self) -> Result<()> {
        let st = self.status.read().map_err(|e| self.note(e))?;
        if st.error == err::NONE {
            self.last_argmax = st.argmax;
            return Ok(());
        }
        let e = Error::Kernel {
            code: st.error,
            what: err::name(st.error),
            phase: phase_name(st.phase),
            layer: st.layer,
            cta: st.cta,
        };
        self.clear_kernel_state()?;
        self.needs_reset = Some(e.to_string());
        Err(e)
    }

    pub(crate) fn clear_kernel_state(&mut self) -> Result<()> {
        // The kernel is not running; zero() synchronises, since the
        // legacy-stream memset is not ordered before our stream's launches.
        zero(&self.sync, "cuMemsetD8").map_err(|e| self.note(e))?;
        self.status.clear().map_err(|e| self.note(e))
    }

    fn check_inputs(&self, token: u32, pos: usize) -> Result<()> {
        if token as usize >= self.config.vocab_size {
            return Err(Error::Token {
                token,
                vocab: self.config.vocab_size,
            });
        }
        if pos >= self.capacity {
            return Err(Error::Position {
                pos,
                reason: format!("the KV cache holds {} positions", self.capacity),
            });
        }
        if pos > self.next_pos {
            return Err(Error::Position {
                pos,
                reason: format!("positions must be fed in order; next is {}", self.next_pos),
            });
        }
        Ok(())
    }
}

impl Backend for CustBackend {
    type Error = Error;

    fn kind(&self) -> BackendKind {
        BackendKind::Cust
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput> {
        self.usable()?;
        self.check_inputs(token, pos)?;
        let ev = self.new_event()?;
        self.launch_step(token, pos, 0)?;
        self.record(&ev)?;
        self.wait(&ev, self.opts.step_deadline)?;
        self.next_pos = pos + 1;
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    /// With `GpuOptions::prefill_chunk` set and at least
    /// `GpuOptions::prefill_min_tokens` tokens: the tensor-core prefill
    /// kernel, one launch per chunk (inputs checked first, as a step would).
    /// Otherwise one decode step per prompt token (the trait's default).
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput> {
        // An empty prompt goes on to the kernel path's typed error.
        let short = !tokens.is_empty() && tokens.len() < self.opts.prefill_min_tokens;
        if self.prefill.is_none() || short {
            let mut out = StepOutput { argmax: 0 };
            for (i, &t) in tokens.iter().enumerate() {
                out = self.step(t, start + i)?;
            }
            return Ok(out);
        }
        self.usable()?;
        if tokens.is_empty() {
            return Err(Error::Position {
                pos: start,
                reason: "prefill of an empty prompt".into(),
            });
        }
        for (i, &t) in tokens.iter().enumerate() {
            let pos = start + i;
            if i == 0 {
                self.check_inputs(t, pos)?;
            } else if t as usize >= self.config.vocab_size {
                return Err(Error::Token {
                    token: t,
                    vocab: self.config.vocab_size,
                });
            } else if pos >= self.capacity {
                return Err(Error::Position {
                    pos,
                    reason: format!("the KV cache holds {} positions", self.capacity),
                });
            }
        }
        self.prefill_chunked(tokens, start)?;
        self.next_pos = start + tokens.len();
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    fn logits(&mut self) -> Result<Vec<f32>> {
        self.usable()?;
        let mut v = vec![0f32; self.config.vocab_size];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
        // The logits buffer holds exactly vocab f32 (vocab * 4 > 16 bytes).
        debug_assert_eq!(bytes.len(), self.logits.len());
        self.logits
            .copy_to(bytes)
            .map_err(|e| self.fail("cuMemcpyDtoH (logits)", e))?;
        Ok(v)
    }

    fn reset(&mut self) -> Result<()> {
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        self.bind()?;
        self.clear_kernel_state()?;
        self.needs_reset = None;
        self.next_pos = 0;
        Ok(())
    }
}

impl Drop for CustBackend {
    fn drop(&mut self) {
        // Fields are freed next, in declaration order, with the context
        // current; errors (a dead context) cannot be reported from drop.
        let _ = self.bind();
        let _ = self.stream.synchronize();
    }
}

impl std::fmt::Debug for CustBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustBackend")
            .field("device", &self.info)
            .field("launch", &self.launch)
            .field("capacity", &self.capacity)
            .finish()
    }
}
