//! The megakernel on the cudarc driver bindings.

use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};
use half::bf16;
use qmk_engine::{Backend, BackendKind, StepOutput};
use qmk_kernels::params::{err, phase_name};
use qmk_kernels::{
    source::entry, Arch, Compiler, Cubin, KernelBuild, KernelParams, Resources, SyncState,
    THREADS_PER_CTA,
};
use qmk_model::{Config, WeightKind, Weights};

use crate::device::{device_info, DeviceInfo};
use crate::error::{is_sticky, Error, Result};
use crate::mem::{DeviceBuffer, StatusBlock};

/// How a [`CudarcBackend`] is set up.
#[derive(Debug, Clone)]
pub struct Options {
    /// CUDA device ordinal.
    pub device: usize,
    /// KV cache positions (the context length).
    pub capacity: usize,
    /// Load this cubin (written by `qwen-mk compile`) instead of running
    /// NVRTC.
    pub cubin: Option<PathBuf>,
    /// Budget of every spin-wait inside the kernel.
    pub spin_timeout: Duration,
    /// Host-side deadline of one decode step; past it the host raises the
    /// kernel's abort flag and reports a timeout.
    pub step_deadline: Duration,
    /// Cap on CTAs per SM (default: what the occupancy API allows).
    pub ctas_per_sm: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            device: 0,
            capacity: 4096,
            cubin: None,
            spin_timeout: Duration::from_secs(2),
            step_deadline: Duration::from_secs(30),
            ctas_per_sm: None,
        }
    }
}

/// Upload progress (weights can be tens of GB).
pub trait Progress {
    fn begin(&mut self, _what: &str, _total_bytes: u64) {}
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self) {}
}

/// No progress reporting.
impl Progress for () {}

/// The cooperative launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchInfo {
    pub grid: u32,
    pub block: u32,
    pub ctas_per_sm: u32,
    /// What the occupancy API allows.
    pub max_ctas_per_sm: u32,
    pub smem_bytes: u32,
    pub registers: u32,
}

pub(crate) struct Functions {
    pub step: sys::CUfunction,
    pub stream_read: sys::CUfunction,
    pub probe: sys::CUfunction,
    pub probe_fill: sys::CUfunction,
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
    pub(crate) status: StatusBlock,
    pub(crate) sync: DeviceBuffer,
    pub(crate) logits: DeviceBuffer,
    pub(crate) weight_bytes: u64,
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

fn checked_mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b)
        .ok_or_else(|| Error::Overflow(what.to_string()))
}

fn kind_of(name: &str) -> Option<WeightKind> {
    WeightKind::ALL.iter().copied().find(|k| k.name() == name)
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
        if opts.capacity == 0 || opts.capacity > u32::MAX as usize {
            return Err(Error::Option {
                field: "capacity",
                reason: format!("{} is outside 1..=2^32-1", opts.capacity),
            });
        }
        let build = KernelBuild::new(&config)?;
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
                    cubin: cubin.arch.to_string(),
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
        if occ <= 0 {
            return Err(Error::Launch {
                device: info.name.clone(),
                reason: format!(
                    "no CTA of {THREADS_PER_CTA} threads with {} B shared memory fits on an SM",
                    build.smem_bytes
                ),
            });
        }
        let per_sm = opts
            .ctas_per_sm
            .map_or(occ as u32, |c| c.clamp(1, occ as u32));
        // SAFETY: valid function handle.
        let registers = unsafe {
            result::function::get_function_attribute(
                funcs.step,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
            )
        }
        .unwrap_or(0) as u32;
        let launch = LaunchInfo {
            grid: per_sm * info.sms,
            block: THREADS_PER_CTA,
            ctas_per_sm: per_sm,
            max_ctas_per_sm: occ as u32,
            smem_bytes: build.smem_bytes,
            registers,
        };

        // Memory plan, checked before the first allocation.
        let h = config.hidden_size as u64;
        let cap = opts.capacity as u64;
        let kv_dim = config.kv_dim() as u64;
        let layers = config.num_hidden_layers as u64;
        let kv_layer = checked_mul(checked_mul(cap, kv_dim, "KV cache")?, 2, "KV cache")?;
        if kv_layer > 1 << 32 {
            return Err(Error::Option {
                field: "capacity",
                reason: format!(
                    "one layer of the KV cache ({kv_layer} bytes) exceeds the kernel's 32-bit in-layer offsets"
                ),
            });
        }
        let kv_bytes = checked_mul(kv_layer, layers, "KV cache")?;
        let half = config.head_dim() as u64 / 2;
        let rope_bytes = checked_mul(checked_mul(cap, half, "rope table")?, 4, "rope table")?;
        let wb = qmk_model::weight_bytes(&config)?;
        let scratch = 4
            * (h + 2 * config.q_dim() as u64
                + config.intermediate_size as u64
                + config.vocab_size as u64
                + 2 * launch.grid as u64
                + 64);
        let needed = [wb.total.0, 2 * kv_bytes, 2 * rope_bytes, scratch]
            .iter()
            .try_fold(0u64, |a, &b| a.checked_add(b))
            .ok_or_else(|| Error::Overflow("device memory plan".into()))?;
        if needed > info.free_mem {
            return Err(Error::OutOfMemory {
                what: format!(
                    "{} weights + a {}-position KV cache ({} B weights, {} B KV)",
                    config.model_type,
                    cap,
                    wb.total.0,
                    2 * kv_bytes
                ),
                needed,
                available: info.free_mem,
            });
        }

        let mut params: KernelParams = bytemuck::Zeroable::zeroed();
        let mut buffers = Vec::new();

        // Weights: one allocation per planned chunk.
        progress.begin("uploading weights", wb.total.0);
        for t in &build.plan.tensors {
            let name = t.spec.name.as_str();
            let kind = kind_of(name).ok_or_else(|| Error::Weights {
                tensor: name.into(),
                reason: "the plan names a tensor the model does not have".into(),
            })?;
            let host = weights.get(kind).ok_or_else(|| Error::Weights {
                tensor: name.into(),
                reason: "missing from the weights".into(),
            })?;
            let elems = t.spec.layout.size()?;
            if host.len() as u64 != elems {
                return Err(Error::Weights {
                    tensor: name.into(),
                    reason: format!(
                        "{} elements, the layout {} needs {elems}",
                        host.len(),
                        t.spec.layout
                    ),
                });
            }
            let Some(slots) = params.chunks_mut(name) else {
                continue; // a tensor the kernel does not address
            };
            for (c, chunk) in t.chunks.iter().enumerate() {
                let off = t.chunk_byte_offset(c)?.0 / 2;
                let len = chunk.byte_span.0 / 2;
                let end = off
                    .checked_add(len)
                    .filter(|&e| e <= elems)
                    .ok_or_else(|| Error::Weights {
                        tensor: name.into(),
                        reason: format!("chunk {c} runs past the tensor"),
                    })?;
                let src: &[bf16] = &host[off as usize..end as usize];
                let buf = DeviceBuffer::alloc(chunk.byte_span.0, &format!("{name} chunk {c}"))?;
                const PIECE: usize = 64 << 20; // elements per copy, for progress
                for (i, piece) in src.chunks(PIECE).enumerate() {
                    let dst = buf.ptr + (i * PIECE * 2) as u64;
                    // SAFETY: dst..dst+piece bytes lies inside buf.
                    unsafe { result::memcpy_htod_sync(dst, piece) }.map_err(drv("cuMemcpyHtoD"))?;
                    progress.advance(piece.len() as u64 * 2);
                }
                slots[c] = buf.ptr;
                buffers.push(buf);
            }
        }
        progress.finish();
        if config.tie_word_embeddings {
            params.lm_head = params.embed_tokens;
        }

        // KV cache, rope table, scratch.
        let k_cache = DeviceBuffer::zeroed(kv_bytes, "K cache")?;
        let v_cache = DeviceBuffer::zeroed(kv_bytes, "V cache")?;
        let rope =
            qmk_model::reference::Rope::new(config.head_dim(), config.rope_theta, opts.capacity);
        let cos = DeviceBuffer::alloc(rope_bytes, "rope cos")?;
        let sin = DeviceBuffer::alloc(rope_bytes, "rope sin")?;
        // SAFETY: each buffer holds rope_bytes = cap * half * 4 bytes.
        unsafe { result::memcpy_htod_sync(cos.ptr, &rope.cos) }.map_err(drv("cuMemcpyHtoD"))?;
        unsafe { result::memcpy_htod_sync(sin.ptr, &rope.sin) }.map_err(drv("cuMemcpyHtoD"))?;
        let f32s = |n: usize, what: &str| DeviceBuffer::zeroed(n as u64 * 4, what);
        let x = f32s(config.hidden_size, "x")?;
        let q = f32s(config.q_dim(), "q")?;
        let attn = f32s(config.q_dim(), "attn")?;
        let mlp_h = f32s(config.intermediate_size, "mlp_h")?;
        let logits = f32s(config.vocab_size, "logits")?;
        let pval = f32s(launch.grid as usize, "partial_val")?;
        let pidx = f32s(launch.grid as usize, "partial_idx")?;
        let argmax = DeviceBuffer::zeroed(16, "argmax")?;
        let sync = DeviceBuffer::zeroed(std::mem::size_of::<SyncState>() as u64, "sync")?;
        let status = StatusBlock::new()?;

        params.k_cache = k_cache.ptr;
        params.v_cache = v_cache.ptr;
        params.rope_cos = cos.ptr;
        params.rope_sin = sin.ptr;
        params.x = x.ptr;
        params.q = q.ptr;
        params.attn = attn.ptr;
        params.mlp_h = mlp_h.ptr;
        params.logits = logits.ptr;
        params.partial_val = pval.ptr;
        params.partial_idx = pidx.ptr;
        params.argmax_out = argmax.ptr;
        params.sync = sync.ptr;
        params.status = status.device_ptr();
        params.spin_timeout_ns = opts.spin_timeout.as_nanos().min(u64::MAX as u128) as u64;
        params.kv_capacity = opts.capacity as u32;
        params.rms_norm_eps = config.rms_norm_eps as f32;
        buffers.extend([
            k_cache, v_cache, cos, sin, x, q, attn, mlp_h, pval, pidx, argmax,
        ]);

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
            status,
            sync,
            logits,
            weight_bytes: wb.per_decode_step.0,
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
        self.params.spin_timeout_ns = t.as_nanos().min(u64::MAX as u128) as u64;
    }
    /// Test hook: `true` makes the next steps hang at their first grid
    /// barrier (one CTA never arrives), to exercise the bounded waits.
    #[doc(hidden)]
    pub fn set_debug_hang(&mut self, on: bool) {
        self.debug_flags = if on {
            qmk_kernels::params::FLAG_DEBUG_HANG
        } else {
            0
        };
    }
    /// Changes the host deadline of one step.
    pub fn set_step_deadline(&mut self, t: Duration) {
        self.opts.step_deadline = t;
    }

    pub(crate) fn usable(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
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
            if aborted && el > deadline + Duration::from_secs(10) {
                let reason = format!(
                    "the kernel did not stop within 10 s of the abort flag (deadline {} ms)",
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

    /// Launches one decode step per prompt token back to back and waits
    /// once at the end (no host round trip between positions). A kernel
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
        let ev = self.new_event()?;
        let n = tokens.len();
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
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        if let Some(r) = &self.dead {
            return Err(Error::Unusable { reason: r.clone() });
        }
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
