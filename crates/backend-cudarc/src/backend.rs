//! The megakernel on the cudarc driver bindings.
//!
//! The binding-independent parts (options, launch shape, memory plan,
//! weight staging order, parameter block) come from [`qmk_kernels::host`],
//! shared with `qmk-backend-cust`.

use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};
use qmk_engine::{Backend, BackendKind, StepOutput};
use qmk_kernels::host::{
    base_params, duration_ns, prefill_chunks, prefill_launch_params, set_buffer,
    set_prefill_buffer, tie_embeddings, weight_chunks, Buffer, GpuOptions, LaunchInfo, MemoryPlan,
    Progress, ABORT_GRACE, MAX_KV_LAYER_BYTES, UPLOAD_PIECE_BYTES,
};
use qmk_kernels::params::{err, phase_name, FLAG_DEBUG_HANG, FLAG_DEBUG_OOB};
use qmk_kernels::{
    source::entry, Arch, Compiler, Cubin, KernelBuild, KernelParams, KernelsError, PrefillParams,
    Resources, THREADS_PER_CTA,
};
use qmk_model::{Config, Weights};

use crate::device::{device_info, DeviceInfo};
use crate::error::{is_sticky, Error, Result};
use crate::mem::{DeviceBuffer, StatusBlock};

/// How a [`CudarcBackend`] is set up (shared with the cust backend).
pub type Options = GpuOptions;

pub(crate) struct Functions {
    pub step: sys::CUfunction,
    pub stream_read: sys::CUfunction,
    pub probe: sys::CUfunction,
    pub probe_fill: sys::CUfunction,
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
pub struct CudarcBackend {
    pub(crate) info: DeviceInfo,
    pub(crate) config: Config,
    pub(crate) build: KernelBuild,
    pub(crate) cubin_log: String,
    pub(crate) funcs: Functions,
    pub(crate) stream: sys::CUstream,
    pub(crate) params: KernelParams,
    pub(crate) launch: LaunchInfo,
    pub(crate) capacity: usize,
    pub(crate) next_pos: usize,
    pub(crate) dead: Option<String>,
    pub(crate) needs_reset: Option<String>,
    pub(crate) debug_flags: u32,
    pub(crate) last_argmax: u32,
    pub(crate) opts: Options,
    pub(crate) memory: MemoryPlan,
    pub(crate) status: StatusBlock,
    pub(crate) sync: DeviceBuffer,
    pub(crate) logits: DeviceBuffer,
    pub(crate) prefill: Option<Prefill>,
    _buffers: Vec<DeviceBuffer>,
    module: sys::CUmodule,
    // Last: everything above is freed while the context is alive.
    pub(crate) ctx: Arc<CudaContext>,
}

fn drv(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |source| {
        if is_sticky(&source) {
            Error::Unusable {
                reason: format!("{call}: {source}"),
            }
        } else {
            Error::Driver { call, source }
        }
    }
}

/// A weight tensor the shared staging code refuses, reported as this crate
/// always has ([`Error::Weights`]; a layout failure as [`Error::Layout`]).
fn weights_error(e: KernelsError) -> Error {
    match e {
        KernelsError::Plan { tensor, reason } => Error::Weights { tensor, reason },
        KernelsError::Layout(l) => Error::Layout(l),
        e => e.into(),
    }
}

/// What an allocation of `b` is called in an out-of-memory error.
fn buffer_what(b: Buffer) -> &'static str {
    match b {
        Buffer::KCache => "K cache",
        Buffer::VCache => "V cache",
        Buffer::RopeCos => "rope cos",
        Buffer::RopeSin => "rope sin",
        Buffer::ArgmaxOut => "argmax",
        b => b.name(),
    }
}

impl CudarcBackend {
    /// Uploads `weights` (split per the kernel's plan), compiles or loads the
    /// cubin for this device, and sizes the KV cache for `opts.capacity`.
    pub fn new(weights: &Weights, opts: Options, progress: &mut dyn Progress) -> Result<Self> {
        let mut info = device_info(opts.device)?;
        let ctx = CudaContext::new(opts.device).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let (free, _) = result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
        info.free_mem = free as u64;
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
        if build.smem_bytes > info.max_smem_optin {
            return Err(Error::SharedMemory {
                needed: build.smem_bytes,
                available: info.max_smem_optin,
                device: format!("{} ({})", info.name, info.arch),
            });
        }
        if !info.cooperative {
            return Err(Error::Launch {
                device: info.name.clone(),
                reason: "the device does not support cooperative launch".into(),
            });
        }

        // Module, fingerprint, functions.
        // SAFETY: cubin bytes are a complete image; the driver validates it.
        let module = unsafe { result::module::load_data(cubin.bytes.as_ptr().cast()) }.map_err(
            |source| match source.0 as i32 {
                200 | 209 | 218 | 222 => Error::CubinArch {
                    cubin: qmk_kernels::host::describe_cubin(&cubin.bytes, opts.cubin.as_deref()),
                    device: format!("{} ({})", info.name, info.arch),
                    source,
                },
                _ => drv("cuModuleLoadData")(source),
            },
        )?;
        let get = |name: &str| -> Result<sys::CUfunction> {
            let c = CString::new(name).expect("entry names have no NUL");
            // SAFETY: module is loaded.
            unsafe { result::module::get_function(module, c) }.map_err(drv("cuModuleGetFunction"))
        };
        let funcs = Functions {
            step: get(entry::DECODE_STEP)?,
            stream_read: get(entry::STREAM_READ)?,
            probe: get(entry::TRAP_PROBE)?,
            probe_fill: get(entry::PROBE_FILL)?,
        };
        {
            let c = CString::new(entry::FINGERPRINT).expect("no NUL");
            // SAFETY: module is loaded; the global is 8 bytes.
            let (ptr, size) = unsafe { result::module::get_global(module, c) }
                .map_err(drv("cuModuleGetGlobal"))?;
            let mut found = [0u64];
            if size == 8 {
                // SAFETY: 8 bytes at ptr.
                unsafe { result::memcpy_dtoh_sync(&mut found, ptr) }
                    .map_err(drv("cuMemcpyDtoH"))?;
            }
            if found[0] != build.fingerprint {
                return Err(Error::Fingerprint {
                    expected: build.fingerprint,
                    found: found[0],
                });
            }
        }

        // Launch shape: occupancy x SMs, every CTA co-resident.
        // SAFETY: valid function handle.
        unsafe {
            result::function::set_function_attribute(
                funcs.step,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                build.smem_bytes as i32,
            )
        }
        .map_err(drv("cuFuncSetAttribute"))?;
        // SAFETY: valid function handle.
        let occ = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                funcs.step,
                THREADS_PER_CTA as i32,
                build.smem_bytes as usize,
            )
        }
        .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        // SAFETY: valid function handle.
        let registers = unsafe {
            result::function::get_function_attribute(
                funcs.step,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
            )
        }
        .unwrap_or(0) as u32;
        let launch = LaunchInfo::from_occupancy(
            occ,
            info.sms,
            opts.ctas_per_sm,
            build.smem_bytes,
            registers,
        )
        .ok_or_else(|| Error::Launch {
            device: info.name.clone(),
            reason: format!(
                "no CTA of {THREADS_PER_CTA} threads with {} B shared memory fits on an SM",
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
                        device: format!("{} ({})", info.name, info.arch),
                    });
                }
                // SAFETY: valid function handle.
                unsafe {
                    result::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        pf_smem as i32,
                    )
                }
                .map_err(drv("cuFuncSetAttribute"))?;
                // SAFETY: valid function handle.
                let occ = unsafe {
                    result::occupancy::max_active_block_per_multiprocessor(
                        f,
                        THREADS_PER_CTA as i32,
                        pf_smem as usize,
                    )
                }
                .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
                // SAFETY: valid function handle.
                let regs = unsafe {
                    result::function::get_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
                    )
                }
                .unwrap_or(0) as u32;
                let l = LaunchInfo::from_occupancy(
                    occ,
                    info.sms,
                    Some(launch.ctas_per_sm),
                    pf_smem,
                    regs,
                )
                .ok_or_else(|| Error::Launch {
                    device: info.name.clone(),
                    reason: format!(
                        "no prefill CTA of {THREADS_PER_CTA} threads with {} B shared memory fits on an SM",
                        pf_smem
                    ),
                })?;
                Some((f, l))
            }
        };

        // Memory plan, checked before the first allocation.
        let memory = MemoryPlan::sizes_with_prefill(&config, capacity, launch.grid, prefill_chunk)?;
        if memory.kv_layer_bytes > MAX_KV_LAYER_BYTES {
            return Err(Error::Option {
                field: "capacity",
                reason: format!(
                    "one layer of the KV cache ({} bytes) exceeds the kernel's 32-bit in-layer offsets",
                    memory.kv_layer_bytes
                ),
            });
        }
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
        let mut buffers = Vec::new();

        // Weights: one allocation per planned chunk, in plan order.
        progress.begin("uploading weights", memory.weight_bytes);
        for c in weight_chunks(&build, weights).map_err(weights_error)? {
            let buf = DeviceBuffer::alloc(
                c.host.len() as u64,
                &format!("{} chunk {}", c.tensor, c.chunk),
            )?;
            for (i, piece) in c.host.chunks(UPLOAD_PIECE_BYTES).enumerate() {
                let dst = buf.ptr + (i * UPLOAD_PIECE_BYTES) as u64;
                // SAFETY: dst..dst+piece bytes lies inside buf.
                unsafe { result::memcpy_htod_sync(dst, piece) }.map_err(drv("cuMemcpyHtoD"))?;
                progress.advance(piece.len() as u64);
            }
            c.set(&mut params, buf.ptr);
            buffers.push(buf);
        }
        progress.finish();
        tie_embeddings(&config, &mut params);

        // KV cache, rope tables, scratch: zeroed but for the rope tables.
        let rope =
            qmk_model::reference::Rope::new(config.head_dim(), config.rope_theta, opts.capacity);
        let (mut sync, mut logits) = (None, None);
        for &(b, bytes) in &memory.buffers {
            let table = match b {
                Buffer::RopeCos => Some(&rope.cos),
                Buffer::RopeSin => Some(&rope.sin),
                _ => None,
            };
            let buf = match table {
                None => DeviceBuffer::zeroed(bytes, buffer_what(b))?,
                Some(t) => {
                    if std::mem::size_of_val(t.as_slice()) as u64 != bytes {
                        return Err(Error::Overflow(format!(
                            "{}: the host table has {} bytes, the plan {bytes}",
                            b.name(),
                            std::mem::size_of_val(t.as_slice())
                        )));
                    }
                    let buf = DeviceBuffer::alloc(bytes, buffer_what(b))?;
                    // SAFETY: buf holds the table's bytes (checked above).
                    unsafe { result::memcpy_htod_sync(buf.ptr, t) }.map_err(drv("cuMemcpyHtoD"))?;
                    buf
                }
            };
            set_buffer(&mut params, b, buf.ptr);
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
                    let buf = DeviceBuffer::zeroed(bytes, b.name())?;
                    set_prefill_buffer(&mut scratch, b, buf.ptr);
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

        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv("cuStreamCreate"))?;

        Ok(CudarcBackend {
            info,
            config,
            build,
            cubin_log: cubin.log,
            funcs,
            stream,
            params,
            launch,
            capacity: opts.capacity,
            next_pos: 0,
            dead: None,
            needs_reset: None,
            debug_flags: 0,
            last_argmax: 0,
            opts,
            memory,
            status,
            sync,
            logits,
            prefill,
            _buffers: buffers,
            module,
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
    /// `n` decode steps back to back from position `start` (the kernel feeds
    /// its own pick to the next step on the device, no host round trip);
    /// returns the device time between events around the batch. The twin of
    /// the cust backend's `timed_steps` (endurance tests).
    pub fn timed_steps(&mut self, first_token: u32, start: usize, n: usize) -> Result<Duration> {
        self.usable()?;
        let end = start
            .checked_add(n)
            .filter(|&e| e <= self.capacity && start <= self.next_pos);
        if n == 0 || end.is_none() {
            return Err(Error::Option {
                field: "steps",
                reason: format!(
                    "{n} steps from position {start} must be >= 1, start at or before {} and fit the {}-position KV cache",
                    self.next_pos, self.capacity
                ),
            });
        }
        let (a, b) = (self.new_event()?, self.new_event()?);
        let run = (|| -> Result<Duration> {
            self.record(a)?;
            for pos in start..start + n {
                let flags = if pos == start {
                    0
                } else {
                    qmk_kernels::FLAG_TOKEN_FROM_ARGMAX
                };
                self.launch_step(first_token, pos, flags)?;
            }
            self.record(b)?;
            let deadline = self
                .opts
                .step_deadline
                .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX));
            self.wait(b, deadline)?;
            self.next_pos = start + n;
            // SAFETY: both events recorded and complete.
            let ms = unsafe { result::event::elapsed(a, b) }
                .map_err(|e| self.fail("cuEventElapsedTime", e))?;
            Ok(Duration::from_secs_f64(f64::from(ms) * 1e-3))
        })();
        for ev in [a, b] {
            // SAFETY: live events, no longer used.
            let _ = unsafe { result::event::destroy(ev) };
        }
        run
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
        // SAFETY: each cache holds kv_cache_bytes; no step is running.
        unsafe {
            result::memcpy_dtoh_sync(&mut k, self.params.k_cache)
                .and_then(|_| result::memcpy_dtoh_sync(&mut v, self.params.v_cache))
        }
        .map_err(|e| self.fail("cuMemcpyDtoH (KV cache)", e))?;
        Ok((k, v))
    }

    /// Launches one prefill chunk (positions `start..start + len`).
    pub(crate) fn launch_prefill(&mut self, start: u32, len: u32) -> Result<()> {
        let Some(pf) = self.prefill.as_ref() else {
            return Err(Error::Option {
                field: "prefill_chunk",
                reason: "the prefill kernel is not enabled".into(),
            });
        };
        let (func, launch) = (pf.func, pf.launch);
        let mut p = prefill_launch_params(
            &self.config,
            &self.params,
            &pf.scratch,
            start,
            len,
            self.debug_flags,
        );
        let mut args = [(&mut p as *mut PrefillParams).cast::<c_void>()];
        // SAFETY: the kernel takes one PrefillParams by value; every pointer
        // in it is a live allocation of self.
        let r = unsafe {
            sys::cuLaunchCooperativeKernel(
                func,
                launch.grid,
                1,
                1,
                launch.block,
                1,
                1,
                launch.smem_bytes,
                self.stream,
                args.as_mut_ptr(),
            )
        };
        r.result()
            .map_err(|e| self.fail("cuLaunchCooperativeKernel (prefill)", e))
    }

    /// The tensor-core prefill: the prompt's ids uploaded once (by
    /// position), then one launch per chunk back to back, one wait.
    pub(crate) fn prefill_chunked(&mut self, tokens: &[u32], start: usize) -> Result<()> {
        let (tok_buf, chunk) = match self.prefill.as_ref() {
            Some(p) => (p.scratch.tokens, p.chunk),
            None => unreachable!("prefill_chunked without the prefill kernel"),
        };
        // SAFETY: the tokens buffer holds `capacity` u32 (positions); start
        // + len <= capacity was checked; nothing is running.
        // A pageable copy may return before its DMA lands, and the legacy
        // stream it runs on does not order our non-blocking stream: wait.
        unsafe { result::memcpy_htod_sync(tok_buf + start as u64 * 4, tokens) }
            .and_then(|_| result::ctx::synchronize())
            .map_err(|e| self.fail("cuMemcpyHtoD (prompt)", e))?;
        let chunks = prefill_chunks(start, tokens.len(), chunk);
        let ev = self.new_event()?;
        let r = (|| {
            for &(s, len) in &chunks {
                self.launch_prefill(s, len)?;
            }
            self.record(ev)?;
            let deadline = self
                .opts
                .step_deadline
                .saturating_mul(chunks.len().min(u32::MAX as usize) as u32);
            self.wait(ev, deadline)
        })();
        // SAFETY: ev is live and no longer used.
        let _ = unsafe { result::event::destroy(ev) };
        r
    }

    pub(crate) fn usable(&self) -> Result<()> {
        // A dead engine is refused before any driver call (binding a
        // context that holds a sticky error could report a new error).
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        if let Some(r) = &self.needs_reset {
            return Err(Error::NeedsReset(r.clone()));
        }
        Ok(())
    }

    /// Marks the engine unusable if `e` is a sticky CUDA error.
    pub(crate) fn mark(&mut self, e: Error) -> Error {
        let e = match e {
            Error::Driver { call, source } => drv(call)(source),
            e => e,
        };
        if let Error::Unusable { reason } = &e {
            self.dead = Some(reason.clone());
        }
        e
    }

    /// Maps a driver failure; a sticky one marks the engine unusable.
    pub(crate) fn fail(&mut self, call: &'static str, e: DriverError) -> Error {
        let err = drv(call)(e);
        if let Error::Unusable { reason } = &err {
            self.dead = Some(reason.clone());
        }
        err
    }

    pub(crate) fn launch_step(&mut self, token: u32, pos: usize, flags: u32) -> Result<()> {
        self.params.token = token;
        self.params.pos = pos as u32;
        self.params.flags = flags | self.debug_flags;
        let mut p = self.params;
        let mut args = [(&mut p as *mut KernelParams).cast::<c_void>()];
        // SAFETY: the function takes one Params by value; the driver copies
        // it at launch. Every pointer in it is a live allocation of self.
        let r = unsafe {
            sys::cuLaunchCooperativeKernel(
                self.funcs.step,
                self.launch.grid,
                1,
                1,
                self.launch.block,
                1,
                1,
                self.launch.smem_bytes,
                self.stream,
                args.as_mut_ptr(),
            )
        };
        r.result().map_err(|e| {
            if e.0 as i32 == 720 {
                Error::Launch {
                    device: self.info.name.clone(),
                    reason: format!(
                        "grid of {} CTAs is too large for a cooperative launch",
                        self.launch.grid
                    ),
                }
            } else {
                self.fail("cuLaunchCooperativeKernel", e)
            }
        })
    }

    pub(crate) fn new_event(&mut self) -> Result<sys::CUevent> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| self.fail("cuEventCreate", e))
    }

    pub(crate) fn record(&mut self, ev: sys::CUevent) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(ev, self.stream) }.map_err(|e| self.fail("cuEventRecord", e))
    }

    /// Waits for `ev` with the host deadline; past it, raises the kernel's
    /// abort flag, waits a grace period, and reports a timeout. Then checks
    /// the kernel's own error report.
    pub(crate) fn wait(&mut self, ev: sys::CUevent, deadline: Duration) -> Result<()> {
        let t0 = Instant::now();
        let mut aborted = false;
        loop {
            // SAFETY: live event.
            let r = unsafe { sys::cuEventQuery(ev) };
            match r {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(self.fail("cuEventQuery (kernel execution)", DriverError(e))),
            }
            let el = t0.elapsed();
            if !aborted && el > deadline {
                self.status.set_abort(1)?;
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
            self.status.set_abort(0)?;
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
        let st = self.status.read().map_err(|e| self.mark(e))?;
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

    fn clear_kernel_state(&mut self) -> Result<()> {
        // SAFETY: sync holds a SyncState; the kernel is not running.
        // Then synchronise: the legacy-stream memset is not ordered before
        // launches on our non-blocking stream.
        unsafe { result::memset_d8_sync(self.sync.ptr, 0, self.sync.bytes as usize) }
            .and_then(|_| result::ctx::synchronize())
            .map_err(|e| self.fail("cuMemsetD8", e))?;
        self.status.clear().map_err(|e| self.mark(e))
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

impl Backend for CudarcBackend {
    type Error = Error;

    fn kind(&self) -> BackendKind {
        BackendKind::Cudarc
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput> {
        self.usable()?;
        self.check_inputs(token, pos)?;
        let ev = self.new_event()?;
        let r = (|| {
            self.launch_step(token, pos, 0)?;
            self.record(ev)?;
            self.wait(ev, self.opts.step_deadline)
        })();
        // SAFETY: ev is live and no longer used.
        let _ = unsafe { result::event::destroy(ev) };
        r?;
        self.next_pos = pos + 1;
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    /// With `GpuOptions::prefill_chunk` set and at least
    /// `GpuOptions::prefill_min_tokens` tokens: the tensor-core prefill
    /// kernel, one launch per chunk. Otherwise one decode step per prompt token,
    /// launched back to back, one wait at the end (no host round trip
    /// between positions). A kernel
    /// error in any step is the first one reported: later steps see the
    /// claimed error at their first barrier and stop.
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput> {
        self.usable()?;
        if tokens.is_empty() {
            return Err(Error::Position {
                pos: start,
                reason: "prefill of an empty prompt".into(),
            });
        }
        for (i, &t) in tokens.iter().enumerate() {
            // Positions after the first are in order by construction.
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
        let n = tokens.len();
        if self.prefill.is_some() && n >= self.opts.prefill_min_tokens {
            self.prefill_chunked(tokens, start)?;
            self.next_pos = start + n;
            return Ok(StepOutput {
                argmax: self.last_argmax,
            });
        }
        let ev = self.new_event()?;
        let r = (|| {
            for (i, &t) in tokens.iter().enumerate() {
                self.launch_step(t, start + i, 0)?;
            }
            self.record(ev)?;
            let deadline = self
                .opts
                .step_deadline
                .saturating_mul(n.min(u32::MAX as usize) as u32);
            self.wait(ev, deadline)
        })();
        // SAFETY: ev is live and no longer used.
        let _ = unsafe { result::event::destroy(ev) };
        r?;
        self.next_pos = start + n;
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    fn logits(&mut self) -> Result<Vec<f32>> {
        self.usable()?;
        let mut v = vec![0f32; self.config.vocab_size];
        // SAFETY: logits holds vocab f32; the last step has completed.
        unsafe { result::memcpy_dtoh_sync(&mut v, self.logits.ptr) }
            .map_err(|e| self.fail("cuMemcpyDtoH (logits)", e))?;
        Ok(v)
    }

    fn reset(&mut self) -> Result<()> {
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        self.clear_kernel_state()?;
        self.needs_reset = None;
        self.next_pos = 0;
        Ok(())
    }
}

// SAFETY: the raw driver handles (stream, module, functions, pinned host
// pointers) belong to the context, not to a thread; every entry point (and
// Drop) makes the context current on the calling thread first
// (`usable()` / `bind_to_thread`). `&mut self` serialises all use.
unsafe impl Send for CudarcBackend {}

impl Drop for CudarcBackend {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in new(), destroyed once; errors are ignored in drop.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
            let _ = result::module::unload(self.module);
        }
    }
}

impl std::fmt::Debug for CudarcBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudarcBackend")
            .field("device", &self.info)
            .field("launch", &self.launch)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_host_errors_keep_this_crates_words() {
        let e = weights_error(KernelsError::Plan {
            tensor: "q_proj".into(),
            reason: "missing from the weights".into(),
        });
        assert!(matches!(e, Error::Weights { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "weight tensor q_proj: missing from the weights"
        );
        let e = weights_error(KernelsError::BadArch("sm_1".into()));
        assert!(matches!(e, Error::Kernels(_)), "{e:?}");
        assert_eq!(buffer_what(Buffer::KCache), "K cache");
        assert_eq!(buffer_what(Buffer::PartialIdx), "partial_idx");
    }
}
