//! [`GpuBackend`]: the megakernel engine on one GPU, over any [`Driver`].

use std::ffi::c_void;
use std::time::{Duration, Instant};

use qmk_engine::{Backend, BackendKind, MultiStep, MultiStepOutput, RunningMean, StepOutput};
use qmk_kernels::params::{err, phase_name, FLAG_DEBUG_HANG, FLAG_DEBUG_OOB};
use qmk_kernels::{
    source::entry, Arch, Compiler, Cubin, KernelBuild, KernelParams, MultiParams, PrefillParams,
    Resources, TcPhases, ATTN_TILE, THREADS_PER_CTA,
};
use qmk_layout::TileOrder;
use qmk_model::{Config, WeightKind, Weights};

use crate::cuda::{describe_cubin, CudaCode};
use crate::driver::{device_info, DeviceMemory, Driver, LaunchShape, TensorMap2d};
use crate::error::{Error, Result};
use crate::options::{DeviceInfo, Options, Progress, ABORT_GRACE};
use crate::plan::{
    base_params, clamp_prefill_chunk, duration_ns, multi_part_words, prefill_chunks,
    prefill_launch_params, set_buffer, set_multi_buffer, set_prefill_buffer, Buffer, LaunchInfo,
    MemoryPlan, KV_MAPS_BYTES,
};
use crate::staging::{
    planned_chunks, tie_embeddings, tile_chunks, WeightSource, UPLOAD_PIECE_BYTES,
};
use crate::status::StatusBlock;
use crate::upload::{upload_weights, UploadStats};

/// The cubin's kernels (valid as long as the module is).
pub(crate) struct Functions<D: Driver> {
    pub step: D::Function,
    pub stream_read: D::Function,
    pub probe: D::Function,
    pub probe_fill: D::Function,
}

/// The tensor-core prefill path ([`Options::prefill_chunk`]): its kernel,
/// launch shape and a parameter block with its scratch buffers set.
pub(crate) struct Prefill<D: Driver> {
    pub func: D::Function,
    pub launch: LaunchInfo,
    pub scratch: PrefillParams,
    pub chunk: u32,
}

/// The multi-token step ([`Backend::step_many`]): its kernels for T = 2 ..=
/// `max_tokens`, their dynamic shared memory, and a parameter block with
/// its buffers set. Launched on the decode step's grid (the split
/// attention's blocks per head follow the grid, and must be the one-token
/// step's for the same bits).
pub(crate) struct Multi<D: Driver> {
    /// `funcs[T - 2]` is `qmk_decode_multi_T`.
    pub funcs: Vec<D::Function>,
    pub smem: u32,
    pub scratch: MultiParams,
    pub max_tokens: u32,
}

/// Running means of what one launch of each kind cost, wall time from the
/// launch to the end of its wait: what [`Backend::step_many_position_cost`]
/// and [`Backend::step_many_cost`] report.
#[derive(Debug, Clone)]
pub(crate) struct StepCosts {
    /// One-token steps.
    single: RunningMean,
    /// Multi-token steps, by T (index T).
    multi: Vec<RunningMean>,
}

impl Default for StepCosts {
    fn default() -> Self {
        Self {
            single: Self::mean(),
            multi: Vec::new(),
        }
    }
}

impl StepCosts {
    /// The first launch of each kind is not timed: it may load its kernel,
    /// and a size priced too high by one slow launch would never run again.
    /// Past 64 samples a mean is exponential, so it follows a changing
    /// context length.
    const fn mean() -> RunningMean {
        RunningMean::new(1, 64)
    }

    fn single(&mut self, secs: f64) {
        self.single.add(secs);
    }

    fn multi(&mut self, t: usize, secs: f64) {
        if self.multi.len() <= t {
            self.multi.resize(t + 1, Self::mean());
        }
        self.multi[t].add(secs);
    }

    /// Cost of each position after the first as a fraction of a one-token
    /// step, weighted by how often each T was timed; `None` before both
    /// kinds have been timed.
    fn position_cost(&self) -> Option<f64> {
        let single = self.single.mean(1)?;
        let (mut w, mut sum) = (0.0, 0.0);
        for (t, slot) in self.multi.iter().enumerate() {
            if let (true, Some(secs)) = (t >= 2, slot.mean(1)) {
                let c = (secs / single - 1.0) / (t - 1) as f64;
                let timed = slot.samples() as f64;
                sum += timed * c.max(0.0);
                w += timed;
            }
        }
        (w > 0.0).then(|| sum / w)
    }

    /// What one launch of `t` positions cost in one-token steps; `None`
    /// before both kinds have been timed.
    fn launch_cost(&self, t: usize) -> Option<f64> {
        Some(self.multi.get(t)?.mean(1)? / self.single.mean(1)?)
    }
}

/// [`Backend::step_many_position_cost`] before the backend has timed both
/// kinds of step: the multi-token step's cost per extra position measured
/// on an H200 at 0.5B (`docs/performance.md`, the multi-token cost table).
pub const DEFAULT_POSITION_COST: f64 = 0.25;

/// The megakernel engine on one GPU: weights, KV cache, scratch and the
/// loaded cubin, driven through the binding `D`. Implements
/// [`qmk_engine::Backend`]; every wait is bounded (the kernel's spin budget
/// and a host deadline), a kernel error asks for [`Backend::reset`], and a
/// sticky CUDA error makes the engine refuse all further work.
pub struct GpuBackend<D: Driver> {
    pub(crate) info: DeviceInfo,
    pub(crate) config: Config,
    pub(crate) build: KernelBuild,
    cubin_log: String,
    pub(crate) funcs: Functions<D>,
    pub(crate) params: KernelParams,
    pub(crate) launch: LaunchInfo,
    pub(crate) memory: MemoryPlan,
    pub(crate) capacity: usize,
    pub(crate) next_pos: usize,
    dead: Option<String>,
    needs_reset: Option<String>,
    debug_flags: u32,
    pub(crate) last_argmax: u32,
    pub(crate) opts: Options,
    /// What the streamed weight upload did.
    upload: UploadStats,
    /// How long the cubin took to compile (or load), on its own thread
    /// while the weights uploaded.
    compile_time: Duration,
    pub(crate) prefill: Option<Prefill<D>>,
    pub(crate) multi: Option<Multi<D>>,
    /// Launch cooperatively (the default); co-resident tensor-parallel
    /// ranks share one GPU and launch plainly, each grid sized to its share
    /// of the SMs.
    cooperative: bool,
    costs: StepCosts,
    /// Device address of the last step's logits `[V]` f32 (the one-token
    /// buffer, or a row of the multi-token step's).
    last_logits: u64,
    // Field order is drop order: the stream first, the context last.
    pub(crate) stream: D::Stream,
    pub(crate) status: StatusBlock<D>,
    sync: D::Memory,
    logits: D::Memory,
    _buffers: Vec<D::Memory>,
    _weights: Vec<D::Memory>,
    _module: D::Module,
    pub(crate) driver: D,
}

// SAFETY: the driver handles (context, module, functions, streams, events,
// pinned pointers) belong to the context, not to a thread; every entry point
// (and Drop) makes the context current on the calling thread first
// (`usable()` / `bind()`), and `&mut self` serialises all use.
unsafe impl<D: Driver> Send for GpuBackend<D> {}

/// `bytes` of device memory (at least 16), uninitialised or zeroed; an
/// out-of-memory answer names `what`.
pub(crate) fn alloc<D: Driver>(d: &D, bytes: u64, what: &str, zeroed: bool) -> Result<D::Memory> {
    let n = usize::try_from(bytes.max(16)).map_err(|_| Error::Overflow(what.to_string()))?;
    let buf = d.alloc(n).map_err(|code| match code {
        CudaCode::OUT_OF_MEMORY => Error::OutOfMemory {
            what: what.to_string(),
            needed: bytes,
            available: d.mem_info().map(|(f, _)| f).unwrap_or(0),
        },
        code => Error::driver("cuMemAlloc", code),
    })?;
    if zeroed {
        // SAFETY: buf holds n bytes. The memset runs on the legacy stream,
        // which the backend's non-blocking streams do not wait for:
        // synchronise before anyone launches.
        unsafe { d.memset_d8(buf.addr(), 0, n) }
            .and_then(|()| d.synchronize())
            .map_err(Error::at("cuMemsetD8"))?;
    }
    Ok(buf)
}

/// Copies `src` to device address `dst` in [`UPLOAD_PIECE_BYTES`] pieces
/// (host tables; the weights stream through [`upload_weights`]).
///
/// # Safety
/// `dst..dst + src.len()` lies in a live allocation.
unsafe fn upload<D: Driver>(
    d: &D,
    dst: u64,
    src: &[u8],
    progress: &mut dyn Progress,
) -> Result<()> {
    for (i, piece) in src.chunks(UPLOAD_PIECE_BYTES).enumerate() {
        let at = dst + (i * UPLOAD_PIECE_BYTES) as u64;
        // SAFETY: per the caller.
        unsafe { d.htod(at, piece) }.map_err(Error::at("cuMemcpyHtoD"))?;
        progress.advance(piece.len() as u64);
    }
    Ok(())
}

/// Refuses a memory plan the device's free memory cannot hold, naming the
/// bytes of weights, KV cache and the total needed and free.
fn check_free(config: &Config, capacity: u32, plan: &MemoryPlan, free: u64) -> Result<()> {
    if plan.total_bytes <= free {
        return Ok(());
    }
    Err(Error::OutOfMemory {
        what: format!(
            "{} weights + a {}-position KV cache ({} B weights, {} B KV, {} B scratch)",
            config.model_type,
            capacity,
            plan.weight_bytes,
            2 * plan.kv_cache_bytes,
            plan.total_bytes - plan.weight_bytes - 2 * plan.kv_cache_bytes
        ),
        needed: plan.total_bytes,
        available: free,
    })
}

/// The scratch buffers of one memory plan: the sync and logits buffers,
/// which the backend keeps apart, and the rest.
struct ScratchBuffers<D: Driver> {
    rest: Vec<D::Memory>,
    sync: D::Memory,
    logits: D::Memory,
}

/// The scratch buffers of `memory` ([`MemoryPlan::buffers`]), allocated in
/// plan order with their addresses set in `params`: the rope tables and,
/// where `arch` has bulk tensor copies, the KV descriptors uploaded; every
/// other buffer zeroed (the kernel relies on zeroed counters, the caches
/// and the tensor-core scratch among them).
fn alloc_buffers<D: Driver>(
    d: &D,
    config: &Config,
    capacity: u32,
    arch: Arch,
    memory: &MemoryPlan,
    rope: &qmk_model::reference::Rope,
    params: &mut KernelParams,
) -> Result<ScratchBuffers<D>> {
    let mut buffers = Vec::with_capacity(memory.buffers.len() + memory.prefill.len());
    let (mut sync, mut logits) = (None, None);
    for &(b, bytes) in &memory.buffers {
        // The caches come first in the plan: their addresses are set
        // when the descriptors are encoded.
        let maps;
        let table: Option<&[u8]> = match b {
            Buffer::RopeCos => Some(bytemuck::cast_slice(&rope.cos)),
            Buffer::RopeSin => Some(bytemuck::cast_slice(&rope.sin)),
            Buffer::KvMaps if arch.has_bulk_tensor_copies() => {
                maps = kv_maps(d, config, capacity, params)?;
                Some(&maps)
            }
            _ => None,
        };
        let buf = alloc(d, bytes, b.name(), table.is_none())?;
        if let Some(src) = table {
            if src.len() as u64 != bytes {
                return Err(Error::Overflow(format!(
                    "{}: the host table has {} bytes, the plan {bytes}",
                    b.name(),
                    src.len()
                )));
            }
            // SAFETY: buf holds `bytes` = src.len() bytes.
            unsafe { upload(d, buf.addr(), src, &mut ()) }?;
        }
        set_buffer(params, b, buf.addr());
        match b {
            Buffer::Sync => sync = Some(buf),
            Buffer::Logits => logits = Some(buf),
            _ => buffers.push(buf),
        }
    }
    Ok(ScratchBuffers {
        rest: buffers,
        sync: sync.expect("the memory plan has a sync buffer"),
        logits: logits.expect("the memory plan has a logits buffer"),
    })
}

/// The split attention's bulk tensor copy descriptors
/// ([`KernelParams::kv_maps`]): the K and V caches at `params`' addresses
/// as 2-D bf16 tensors of L x `capacity` rows (positions of every layer) by
/// KV columns, in boxes of one tile's positions x one kv head.
fn kv_maps<D: Driver>(
    d: &D,
    config: &Config,
    capacity: u32,
    params: &KernelParams,
) -> Result<Vec<u8>> {
    let kv = config.kv_dim() as u64;
    let rows = (config.num_hidden_layers as u64)
        .checked_mul(u64::from(capacity))
        // The copies' row coordinates are signed 32-bit.
        .filter(|&r| r <= i32::MAX as u64)
        .ok_or_else(|| {
            Error::Overflow(format!(
                "kv_maps: {} layers x {capacity} positions exceed the bulk copies' 2^31 rows",
                config.num_hidden_layers
            ))
        })?;
    let head = u32::try_from(config.head_dim())
        .map_err(|_| Error::Overflow("kv_maps: head_dim".into()))?;
    let mut out = Vec::with_capacity(KV_MAPS_BYTES as usize);
    for (call, base) in [
        ("cuTensorMapEncodeTiled (k_cache)", params.k_cache),
        ("cuTensorMapEncodeTiled (v_cache)", params.v_cache),
    ] {
        let t = TensorMap2d {
            base,
            cols: kv,
            rows,
            row_bytes: kv * 2,
            box_cols: head,
            box_rows: ATTN_TILE as u32,
        };
        out.extend_from_slice(&d.tensor_map(&t).map_err(Error::at(call))?);
    }
    Ok(out)
}

/// Sets `f`'s dynamic shared memory and sizes its cooperative grid.
fn launch_shape<D: Driver>(
    d: &D,
    f: D::Function,
    smem: u32,
    sms: u32,
    cap: Option<u32>,
    device: &str,
    kernel: &str,
) -> Result<LaunchInfo> {
    d.set_max_dynamic_smem(f, smem)
        .map_err(Error::at("cuFuncSetAttribute"))?;
    let occ = d
        .occupancy(f, THREADS_PER_CTA, smem)
        .map_err(Error::at("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
    let registers = d.registers(f).unwrap_or(0) as u32;
    LaunchInfo::from_occupancy(occ, sms, cap, smem, registers).ok_or_else(|| Error::Launch {
        device: device.to_string(),
        reason: format!(
            "no {kernel} CTA of {THREADS_PER_CTA} threads with {smem} B shared memory fits on an SM \
             (occupancy {occ})"
        ),
    })
}

/// What makes a GPU backend one rank of a tensor-parallel group
/// ([`crate::TpBackend`]).
#[derive(Debug, Clone)]
pub(crate) struct RankSetup {
    /// The rank build every rank of the group shares.
    pub build: KernelBuild,
    /// This rank's index.
    pub rank: usize,
    /// SMs the rank's grid spans: `Some` for ranks co-resident on one GPU
    /// (each its share), `None` for one rank per GPU (all of them).
    pub sms: Option<u32>,
    /// Most device memory the rank may plan for, bytes: co-resident ranks
    /// divide one GPU's free memory (a fitted KV cache must leave room for
    /// the ranks after it).
    pub free_share: Option<u64>,
}

impl<D: Driver> GpuBackend<D> {
    /// Uploads `weights` (split per the kernel's plan), compiles or loads the
    /// cubin for this device, and sizes the KV cache for `opts.capacity`.
    pub fn new(weights: &Weights, opts: Options, progress: &mut dyn Progress) -> Result<Self> {
        GpuBackend::from_source(weights, opts, progress)
    }

    /// [`GpuBackend::new`] with the weights' bytes from any
    /// [`WeightSource`] (a checkpoint read from disk, synthetic weights
    /// generated on the fly), streamed to the device through a few pinned
    /// buffers ([`Options::upload`]) while the kernel compiles on another
    /// thread. The device memory the run needs is checked before the first
    /// allocation.
    pub fn from_source(
        source: &dyn WeightSource,
        opts: Options,
        progress: &mut dyn Progress,
    ) -> Result<Self> {
        GpuBackend::open(source, opts, progress, None)
    }

    /// [`GpuBackend::from_source`], or with `rank` one rank of a
    /// tensor-parallel group: `source` serves the rank's shards, the build
    /// is the group's, and there is no prefill kernel and no multi-token
    /// step.
    pub(crate) fn open(
        source: &dyn WeightSource,
        mut opts: Options,
        progress: &mut dyn Progress,
        rank: Option<RankSetup>,
    ) -> Result<Self> {
        let mut info = device_info::<D>(opts.device)?;
        let driver = D::open(opts.device).map_err(Error::at("cuDevicePrimaryCtxRetain"))?;
        info.free_mem = driver.mem_info().map_err(Error::at("cuMemGetInfo"))?.0;
        if let Some(r) = &rank {
            if let Some(share) = r.free_share {
                info.free_mem = info.free_mem.min(share);
            }
            // The memory plan below is the rank model's, whose embedding
            // has its V / N rows; the rank holds the whole table.
            let cfg = source.config();
            let row = cfg.hidden_size as u64 * 2;
            let more = (cfg.vocab_size as u64)
                .checked_mul(u64::from(r.build.tp_ranks().saturating_sub(1)))
                .and_then(|rows| rows.checked_mul(row))
                .ok_or_else(|| Error::Overflow("a rank's embedding table".into()))?;
            info.free_mem = info.free_mem.saturating_sub(more);
        }
        let config = source.config().clone();
        let limit = u32::try_from(opts.capacity)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::Option {
                field: "capacity",
                reason: format!("{} is outside 1..=2^32-1", opts.capacity),
            })?;
        let build = match (&rank, &opts.plan) {
            (Some(r), _) => r.build.clone(),
            (None, Some(plan)) => KernelBuild::with_plan(&config, plan.clone())?,
            (None, None) => KernelBuild::new(&config)?,
        }
        .with_tensor_cores(opts.tensor_cores)?;
        if rank.is_some() {
            opts.prefill_chunk = None;
        }
        // The SMs the grid spans: a co-resident rank's share, else all.
        let sms = rank.as_ref().and_then(|r| r.sms).unwrap_or(info.sms);
        let device_name = format!("{} ({})", info.name, info.arch);
        if build.smem_for(info.arch) > info.max_smem_optin {
            return Err(Error::SharedMemory {
                kernel: "megakernel",
                needed: build.smem_for(info.arch),
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
        let pf_smem = build.prefill_smem_for(info.arch);
        if opts.prefill_chunk.is_some() && pf_smem > info.max_smem_optin {
            return Err(Error::SharedMemory {
                kernel: "prefill kernel",
                needed: pf_smem,
                available: info.max_smem_optin,
                device: device_name,
            });
        }

        // Device memory, before anything is compiled or uploaded: the plan
        // for one CTA per SM (the grid is known once the cubin is loaded;
        // only a few MB of scratch depend on it).
        let grid = sms.max(1);
        let capacity = if opts.fit_capacity {
            let room = info.free_mem.saturating_sub(crate::plan::FIT_RESERVE_BYTES);
            crate::plan::largest_context(&config, room, grid, opts.prefill_chunk, limit)
                .ok_or_else(|| {
                    let one = MemoryPlan::new(
                        &config,
                        1,
                        grid,
                        clamp_prefill_chunk(opts.prefill_chunk, 1),
                    );
                    Error::OutOfMemory {
                        what: format!(
                            "the {} B of weights, a KV cache of one position and scratch (with a \
                             reserve of {} B)",
                            one.as_ref().map_or(0, |p| p.weight_bytes),
                            crate::plan::FIT_RESERVE_BYTES
                        ),
                        needed: one
                            .map_or(u64::MAX, |p| p.total_bytes)
                            .saturating_add(crate::plan::FIT_RESERVE_BYTES),
                        available: info.free_mem,
                    }
                })?
        } else {
            limit
        };
        opts.capacity = capacity as usize;
        let prefill_chunk = clamp_prefill_chunk(opts.prefill_chunk, capacity);
        let need = MemoryPlan::new(&config, capacity, grid, prefill_chunk)?;
        check_free(&config, capacity, &need, info.free_mem)?;

        // The cubin compiles (or loads) on its own thread while the weights
        // upload: NVRTC is loaded here first, so a missing one fails at once.
        let compiler = match &opts.cubin {
            Some(path) => Err(path.as_path()),
            None => Ok(Compiler::new()?),
        };
        let mut params = base_params(&config, capacity, opts.spin_timeout);
        let mut chunks = planned_chunks(&build)?;
        if let Some(tc) = build.tensor_core_phases(info.arch) {
            // The tensor-core phases load their weights in tile order:
            // o_proj and down in 16-row bands; q, k, v, gate and up in 8-row
            // ones (a q/k/v tile takes two bands of a head, a gate/up tile the
            // same band of each).
            let (h, i) = (config.hidden_size as u64, config.intermediate_size as u64);
            let q = config.q_dim() as u64;
            let kv = config.kv_dim() as u64;
            let qkv_rows = kv
                .checked_mul(2)
                .and_then(|v| v.checked_add(q))
                .ok_or_else(|| Error::Overflow("q_dim + 2 x kv_dim".into()))?;
            let two_i = i
                .checked_mul(2)
                .ok_or_else(|| Error::Overflow("2 x intermediate_size".into()))?;
            let gate_up_name = format!(
                "{}/{}",
                WeightKind::GateProj.name(),
                WeightKind::UpProj.name()
            );
            let qkv_name = format!(
                "{}/{}/{}",
                WeightKind::QProj.name(),
                WeightKind::KProj.name(),
                WeightKind::VProj.name()
            );
            for (name, plan, want) in [
                (qkv_name.as_str(), &tc.qkv, (qkv_rows, h)),
                (WeightKind::OProj.name(), &tc.o_proj, (h, q)),
                (WeightKind::DownProj.name(), &tc.down, (h, i)),
                (gate_up_name.as_str(), &tc.gate_up, (two_i, h)),
            ] {
                if (plan.rows, plan.k) != want {
                    return Err(Error::Weights {
                        tensor: name.into(),
                        reason: format!(
                            "the tensor-core plan is for [{}, {}], the model's is [{}, {}]",
                            plan.rows, plan.k, want.0, want.1
                        ),
                    });
                }
            }
            let qkv = TileOrder::new(h, TcPhases::QKV_BAND)?;
            let o_proj = TileOrder::new(q, TcPhases::O_PROJ_BAND)?;
            let down = TileOrder::new(i, TcPhases::DOWN_BAND)?;
            let gate_up = TileOrder::new(h, TcPhases::GATE_UP_BAND)?;
            for (kind, rows, order) in [
                (WeightKind::QProj, q, qkv),
                (WeightKind::KProj, kv, qkv),
                (WeightKind::VProj, kv, qkv),
                (WeightKind::OProj, h, o_proj),
                (WeightKind::DownProj, h, down),
                (WeightKind::GateProj, i, gate_up),
                (WeightKind::UpProj, i, gate_up),
            ] {
                tile_chunks(&build, &mut chunks, kind.name(), rows, order)?;
            }
        }
        let arch = info.arch;
        let (cubin, compile_time, uploaded) = std::thread::scope(|s| {
            let build = &build;
            let compile = s.spawn(move || {
                let t = Instant::now();
                let cubin = match &compiler {
                    Ok(c) => c.compile(build, arch),
                    Err(path) => Cubin::from_file(path, arch),
                };
                (cubin, t.elapsed())
            });
            let what = match &opts.cubin {
                Some(_) => "uploading weights",
                None => "uploading weights (compiling the megakernel alongside)",
            };
            let uploaded = upload_weights(&driver, source, &chunks, &opts.upload, what, progress);
            if uploaded.is_ok() && !compile.is_finished() {
                progress.step("compiling the megakernel (cached after the first run)");
            }
            let (cubin, took) = compile
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (cubin, took, uploaded)
        });
        let (weights, uploaded) = uploaded?;
        let cubin = cubin?;
        progress.finish();
        for (c, buf) in chunks.iter().zip(&weights) {
            c.set(&mut params, buf.addr());
        }
        tie_embeddings(&config, &mut params);
        if let Some(r) = &rank {
            params.tp_rank = u32::try_from(r.rank)
                .map_err(|_| Error::Overflow("tensor-parallel rank".into()))?;
            if config.tie_word_embeddings {
                // A tied rank's LM head is its rows of the whole embedding
                // table, which every rank holds: rows rank x V/N onwards.
                let skip = (config.vocab_size as u64)
                    .checked_mul(config.hidden_size as u64 * 2)
                    .and_then(|b| b.checked_mul(r.rank as u64))
                    .and_then(|b| params.lm_head[0].checked_add(b))
                    .ok_or_else(|| Error::Overflow("a rank's LM head rows".into()))?;
                params.lm_head[0] = skip;
            }
        }

        // Module, fingerprint, functions.
        let module = driver.load_module(&cubin.bytes).map_err(|code| {
            if code.is_foreign_image() {
                Error::CubinArch {
                    cubin: describe_cubin(&cubin.bytes, opts.cubin.as_deref()),
                    device: device_name.clone(),
                    code,
                }
            } else {
                Error::driver("cuModuleLoadData", code)
            }
        })?;
        let get = |name: &str| {
            driver
                .function(&module, name)
                .map_err(Error::at("cuModuleGetFunction"))
        };
        let funcs = Functions::<D> {
            step: get(entry::DECODE_STEP)?,
            stream_read: get(entry::STREAM_READ)?,
            probe: get(entry::TRAP_PROBE)?,
            probe_fill: get(entry::PROBE_FILL)?,
        };
        let found = driver
            .global_u64(&module, entry::FINGERPRINT)
            .map_err(Error::at("cuModuleGetGlobal (fingerprint)"))?
            .unwrap_or(0);
        if found != build.fingerprint {
            return Err(Error::Fingerprint {
                expected: build.fingerprint,
                found,
            });
        }

        // Launch shape: occupancy x SMs, every CTA co-resident.
        let launch = launch_shape(
            &driver,
            funcs.step,
            build.smem_for(info.arch),
            sms,
            opts.ctas_per_sm,
            &device_name,
            "decode",
        )?;

        // The prefill kernel, when enabled: same CTA size, its own shared
        // memory; never more CTAs per SM than the decode grid (the LM head's
        // partials are sized for that grid).
        let prefill_fn = match prefill_chunk {
            None => None,
            Some(_) => {
                let f = get(entry::PREFILL_CHUNK)?;
                let l = launch_shape(
                    &driver,
                    f,
                    pf_smem,
                    info.sms,
                    Some(launch.ctas_per_sm),
                    &device_name,
                    "prefill",
                )?;
                Some((f, l))
            }
        };

        // The multi-token step, where the arch fits at least two tokens and
        // every T runs on the decode grid.
        let multi_fns = {
            let (max, smem) = (
                build.multi_max_tokens(info.arch),
                build.multi_smem_for(info.arch),
            );
            let mut fs = Vec::new();
            if max >= 2 && smem <= info.max_smem_optin {
                for t in 2..=max {
                    let f = get(&entry::decode_multi(t))?;
                    let l = launch_shape(
                        &driver,
                        f,
                        smem,
                        info.sms,
                        Some(launch.ctas_per_sm),
                        &device_name,
                        "multi-token",
                    )?;
                    if l.grid != launch.grid {
                        fs.clear();
                        break;
                    }
                    fs.push(f);
                }
            }
            (!fs.is_empty()).then_some((fs, smem))
        };

        // The exact plan for the grid the occupancy API gave.
        let memory = MemoryPlan::new(&config, capacity, launch.grid, prefill_chunk)?;
        check_free(&config, capacity, &memory, info.free_mem)?;

        // KV cache, rope tables, scratch: zeroed but for the rope tables.
        let rope = qmk_model::reference::Rope::from_spec(
            &config.rope()?,
            config.head_dim(),
            opts.capacity,
        );
        let ScratchBuffers {
            rest: mut buffers,
            sync,
            logits,
        } = alloc_buffers(
            &driver,
            &config,
            capacity,
            info.arch,
            &memory,
            &rope,
            &mut params,
        )?;
        let status = StatusBlock::new(&driver)?;
        params.status = status.device_ptr();
        let prefill = match (prefill_fn, prefill_chunk) {
            (Some((func, launch)), Some(chunk)) => {
                let mut scratch: PrefillParams = bytemuck::Zeroable::zeroed();
                for &(b, bytes) in &memory.prefill {
                    let buf = alloc(&driver, bytes, b.name(), true)?;
                    set_prefill_buffer(&mut scratch, b, buf.addr());
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
        let mut mscratch: MultiParams = bytemuck::Zeroable::zeroed();
        for &(b, bytes) in &memory.multi {
            let buf = alloc(&driver, bytes, b.name(), true)?;
            set_multi_buffer(&mut mscratch, b, buf.addr());
            buffers.push(buf);
        }
        mscratch.part_words = multi_part_words(&config, launch.grid)?;
        let multi = multi_fns.map(|(funcs, smem)| Multi {
            max_tokens: funcs.len() as u32 + 1,
            funcs,
            smem,
            scratch: mscratch,
        });
        // Pageable uploads may return before their last DMA lands.
        driver
            .synchronize()
            .map_err(Error::at("cuCtxSynchronize"))?;
        let stream = driver.stream().map_err(Error::at("cuStreamCreate"))?;
        Ok(GpuBackend {
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
            upload: uploaded,
            compile_time,
            prefill,
            multi,
            cooperative: rank.as_ref().is_none_or(|r| r.sms.is_none()),
            costs: StepCosts::default(),
            last_logits: logits.addr(),
            stream,
            status,
            sync,
            logits,
            _buffers: buffers,
            _weights: weights,
            _module: module,
            driver,
        })
    }

    /// The device this engine runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }
    /// The model.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The decode kernel's cooperative launch shape.
    pub fn launch_info(&self) -> LaunchInfo {
        self.launch
    }
    /// The plan and rendered headers the cubin was built from.
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
    /// The device's SM architecture.
    pub fn arch(&self) -> Arch {
        self.info.arch
    }
    /// How long the weight upload took (from the first allocation to the
    /// last copy landed), and its bytes.
    pub fn upload_stats(&self) -> (Duration, u64) {
        (self.upload.time, self.upload.bytes)
    }
    /// What the streamed weight upload did: bytes, time, where the host
    /// time went, the staging ring.
    pub fn upload_report(&self) -> UploadStats {
        self.upload
    }
    /// How long the cubin took to compile or load (on its own thread, while
    /// the weights uploaded).
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }
    /// Grid barriers the last completed step passed (reported by the kernel).
    pub fn barriers_last_step(&mut self) -> Result<u32> {
        self.usable()?;
        let st = self.status.read(&self.driver).map_err(|e| self.note(e))?;
        Ok(st.barriers)
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
    /// (`qmk_kernels::params::FLAG_*`, e.g. `FLAG_ATTN_NO_SPLIT`) for every
    /// following step and prefill launch.
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
    /// prefill kernel ([`Options::prefill_min_tokens`]; tests and the
    /// threshold measurement time both paths on one backend).
    pub fn set_prefill_min_tokens(&mut self, n: usize) {
        self.opts.prefill_min_tokens = n;
    }
    /// The most positions one multi-token step ([`Backend::step_many`])
    /// takes in one launch on this device; 0 where it is not available
    /// (every run then goes one step per position).
    pub fn multi_max_tokens(&self) -> usize {
        self.multi.as_ref().map_or(0, |m| m.max_tokens as usize)
    }

    /// The prefill kernel's launch shape and chunk size, when enabled
    /// ([`Options::prefill_chunk`]).
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
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(dst.as_mut_slice());
            // SAFETY: each cache holds kv_cache_bytes = 2 n bytes at src; no
            // step is running.
            let r = unsafe { self.driver.dtoh(bytes, src) };
            r.map_err(|c| self.fail("cuMemcpyDtoH (KV cache)", c))?;
        }
        Ok((k, v))
    }

    /// Synchronises the whole context (benches close host-clock timings
    /// with it).
    pub fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        let r = self.driver.synchronize();
        r.map_err(|c| self.fail("cuCtxSynchronize", c))
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.driver.bind().map_err(Error::at("cuCtxSetCurrent"))
    }

    /// Refuses work on a dead engine (before any driver call: binding a
    /// context that holds a sticky error could report a new error) or on
    /// one that needs a reset; binds the context.
    pub(crate) fn usable(&self) -> Result<()> {
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

    /// A failed driver `call` made on behalf of this engine.
    pub(crate) fn fail(&mut self, call: &'static str, code: CudaCode) -> Error {
        self.note(Error::driver(call, code))
    }

    /// Launches `f` cooperatively with one by-value parameter block.
    ///
    /// # Safety
    /// `P` must be the kernel's parameter type and every address in it a
    /// live allocation until the launch completes.
    pub(crate) unsafe fn launch_cooperative<P>(
        &mut self,
        f: D::Function,
        grid: u32,
        smem: u32,
        params: &mut P,
        what: &'static str,
    ) -> Result<()> {
        let p = (params as *mut P).cast::<c_void>();
        // SAFETY: per the caller; the driver copies the block at launch.
        let r = unsafe {
            let shape = LaunchShape {
                grid,
                block: THREADS_PER_CTA,
                smem,
                cooperative: self.cooperative,
            };
            self.driver.launch(f, shape, &self.stream, p)
        };
        match r {
            Ok(()) => Ok(()),
            Err(CudaCode::COOPERATIVE_LAUNCH_TOO_LARGE) => Err(Error::Launch {
                device: self.info.name.clone(),
                reason: format!("grid of {grid} CTAs is too large for a cooperative launch"),
            }),
            Err(code) => Err(self.fail(what, code)),
        }
    }

    /// Queues one decode step (no wait).
    pub(crate) fn launch_step(&mut self, token: u32, pos: usize, flags: u32) -> Result<()> {
        self.params.token = token;
        self.params.pos = u32::try_from(pos).map_err(|_| Error::Position {
            pos,
            reason: "does not fit the kernel's 32-bit position".into(),
        })?;
        self.params.flags = flags | self.debug_flags;
        self.last_logits = self.logits.addr();
        let mut p = self.params;
        let (f, grid, smem) = (self.funcs.step, self.launch.grid, self.launch.smem_bytes);
        // SAFETY: qmk_decode_step takes one KernelParams by value; every
        // address in it is a live allocation of self.
        unsafe { self.launch_cooperative(f, grid, smem, &mut p, "cuLaunchCooperativeKernel") }
    }

    /// Queues one prefill chunk (positions `start..start + len`; no wait).
    pub(crate) fn launch_prefill(&mut self, start: u32, len: u32) -> Result<()> {
        let Some(pf) = self.prefill.as_ref() else {
            return Err(Error::Option {
                field: "prefill_chunk",
                reason: "the prefill kernel is not enabled".into(),
            });
        };
        let (func, launch) = (pf.func, pf.launch);
        self.last_logits = self.logits.addr();
        let mut p = prefill_launch_params(
            &self.config,
            &self.params,
            &pf.scratch,
            start,
            len,
            self.debug_flags,
        );
        // SAFETY: qmk_prefill_chunk takes one PrefillParams by value; every
        // address in it is a live allocation of self.
        unsafe {
            self.launch_cooperative(
                func,
                launch.grid,
                launch.smem_bytes,
                &mut p,
                "cuLaunchCooperativeKernel (prefill)",
            )
        }
    }

    pub(crate) fn new_event(&mut self) -> Result<D::Event> {
        let r = self.driver.event();
        r.map_err(|c| self.fail("cuEventCreate", c))
    }

    pub(crate) fn record(&mut self, ev: &D::Event) -> Result<()> {
        let r = self.driver.record(ev, &self.stream);
        r.map_err(|c| self.fail("cuEventRecord", c))
    }

    pub(crate) fn elapsed_ms(&mut self, a: &D::Event, b: &D::Event) -> Result<f64> {
        let r = self.driver.elapsed_ms(a, b);
        r.map(f64::from)
            .map_err(|c| self.fail("cuEventElapsedTime", c))
    }

    /// The deadline of `n` queued launches.
    pub(crate) fn deadline_of(&self, n: usize) -> Duration {
        self.opts
            .step_deadline
            .saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Waits for `ev` with the host deadline; past it, raises the kernel's
    /// abort flag, waits a grace period, and reports a timeout. Then checks
    /// the kernel's own error report.
    pub(crate) fn wait(&mut self, ev: &D::Event, deadline: Duration) -> Result<()> {
        let t0 = Instant::now();
        let mut aborted = false;
        loop {
            match self.driver.query(ev) {
                Ok(true) => break,
                Ok(false) => {}
                Err(c) => return Err(self.fail("cuEventQuery (kernel execution)", c)),
            }
            let el = t0.elapsed();
            if !aborted && el > deadline {
                let r = self.status.set_abort(&self.driver, 1);
                r.map_err(|e| self.note(e))?;
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
            let r = self.status.set_abort(&self.driver, 0);
            r.map_err(|e| self.note(e))?;
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
        let st = self.status.read(&self.driver);
        let st = st.map_err(|e| self.note(e))?;
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

    /// Zeroes the barrier state and the status block (the kernel is not
    /// running).
    fn clear_kernel_state(&mut self) -> Result<()> {
        // SAFETY: sync holds a SyncState. Synchronise: the legacy-stream
        // memset is not ordered before launches on our stream.
        let r = unsafe {
            self.driver
                .memset_d8(self.sync.addr(), 0, self.sync.bytes())
        }
        .and_then(|()| self.driver.synchronize());
        r.map_err(|c| self.fail("cuMemsetD8", c))?;
        let r = self.status.clear(&self.driver);
        r.map_err(|e| self.note(e))
    }

    fn check_token(&self, token: u32) -> Result<()> {
        if token as usize >= self.config.vocab_size {
            return Err(Error::Token {
                token,
                vocab: self.config.vocab_size,
            });
        }
        Ok(())
    }

    pub(crate) fn check_inputs(&self, token: u32, pos: usize) -> Result<()> {
        self.check_token(token)?;
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

    /// Every token and position of a prompt at `start`, checked before
    /// anything is launched.
    fn check_prompt(&self, tokens: &[u32], start: usize) -> Result<()> {
        let Some((&first, rest)) = tokens.split_first() else {
            return Err(Error::Position {
                pos: start,
                reason: "prefill of an empty prompt".into(),
            });
        };
        self.check_inputs(first, start)?;
        let end = start.saturating_add(tokens.len());
        if end > self.capacity {
            return Err(Error::Position {
                pos: self.capacity.max(start),
                reason: format!("the KV cache holds {} positions", self.capacity),
            });
        }
        rest.iter().try_for_each(|&t| self.check_token(t))
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
        let (tok_buf, chunk) = (pf.scratch.tokens, pf.chunk);
        let bytes: &[u8] = bytemuck::cast_slice(tokens);
        // SAFETY: the tokens buffer holds `capacity` u32 (by position);
        // start + len <= capacity was checked; nothing is running. A
        // pageable copy may return before its DMA lands, and the legacy
        // stream it runs on does not order our non-blocking stream: wait.
        let r = unsafe { self.driver.htod(tok_buf + start as u64 * 4, bytes) }
            .and_then(|()| self.driver.synchronize());
        r.map_err(|c| self.fail("cuMemcpyHtoD (prompt)", c))?;
        let chunks = prefill_chunks(start, tokens.len(), chunk);
        let ev = self.new_event()?;
        for &(s, len) in &chunks {
            self.launch_prefill(s, len)?;
        }
        self.record(&ev)?;
        let deadline = self.deadline_of(chunks.len());
        self.wait(&ev, deadline)
    }

    /// Queues one multi-token launch (no wait): `tokens` (2 ..= max_tokens)
    /// at positions `start..`, checked by the caller against the cache;
    /// `flags` are added to the kernel flags (e.g. `FLAG_TRACE`).
    pub(crate) fn launch_multi(&mut self, tokens: &[u32], start: usize, flags: u32) -> Result<()> {
        let t = tokens.len();
        let Some(m) = self
            .multi
            .as_ref()
            .filter(|m| (2..=m.max_tokens as usize).contains(&t))
        else {
            return Err(Error::Option {
                field: "step_many",
                reason: format!(
                    "{t} positions in one multi-token launch; this device takes 2..={}",
                    self.multi_max_tokens()
                ),
            });
        };
        let func = m.funcs[t - 2];
        let (smem, grid) = (m.smem, self.launch.grid);
        let mut p = m.scratch;
        p.base = self.params;
        p.base.flags = flags | self.debug_flags;
        p.tokens[..t].copy_from_slice(tokens);
        p.n_tokens = t as u32;
        p.start = u32::try_from(start).map_err(|_| Error::Position {
            pos: start,
            reason: "does not fit the kernel's 32-bit position".into(),
        })?;
        // SAFETY: qmk_decode_multi_T takes one MultiParams by value with
        // n_tokens = T; every address in it is a live allocation of self.
        unsafe {
            self.launch_cooperative(
                func,
                grid,
                smem,
                &mut p,
                "cuLaunchCooperativeKernel (multi-token)",
            )
        }
    }

    /// One multi-token launch: `tokens` (2 ..= max_tokens, checked) at
    /// positions `start..`, then its picks (and logits) appended to `out`.
    fn multi_step(
        &mut self,
        tokens: &[u32],
        start: usize,
        logits: bool,
        out: &mut MultiStepOutput,
    ) -> Result<()> {
        let Some(m) = self.multi.as_ref() else {
            return Err(Error::Option {
                field: "step_many",
                reason: "the multi-token step is not available on this device".into(),
            });
        };
        let t = tokens.len();
        let v = self.config.vocab_size as u64;
        let (picks_at, logits_at) = (m.scratch.picks, m.scratch.logits);
        let ev = self.new_event()?;
        let t0 = Instant::now();
        self.launch_multi(tokens, start, 0)?;
        self.record(&ev)?;
        self.wait(&ev, self.deadline_of(t))?;
        self.costs.multi(t, t0.elapsed().as_secs_f64());
        self.next_pos = start + t;
        self.last_logits = logits_at + (t as u64 - 1) * v * 4;
        let mut picks = vec![0u32; t];
        // SAFETY: picks holds MULTI_MAX_TOKENS >= t u32; the launch is done.
        let r = unsafe {
            self.driver
                .dtoh(bytemuck::cast_slice_mut(&mut picks), picks_at)
        };
        r.map_err(|c| self.fail("cuMemcpyDtoH (multi-token picks)", c))?;
        out.argmax.extend_from_slice(&picks);
        if logits {
            let mut l = vec![0f32; t * v as usize];
            // SAFETY: the logits buffer holds MULTI_MAX_TOKENS >= t rows of
            // vocab f32; the launch is done.
            let r = unsafe {
                self.driver
                    .dtoh(bytemuck::cast_slice_mut(&mut l), logits_at)
            };
            r.map_err(|c| self.fail("cuMemcpyDtoH (multi-token logits)", c))?;
            out.logits.extend_from_slice(&l);
        }
        Ok(())
    }

    /// Decode steps for a whole prompt, launched back to back, one wait at
    /// the end (no host round trip between positions). A kernel error in
    /// any step is the first one reported: later steps see the claimed
    /// error at their first barrier and stop.
    fn queued_steps(&mut self, tokens: &[u32], start: usize) -> Result<()> {
        let ev = self.new_event()?;
        for (i, &t) in tokens.iter().enumerate() {
            self.launch_step(t, start + i, 0)?;
        }
        self.record(&ev)?;
        let deadline = self.deadline_of(tokens.len());
        self.wait(&ev, deadline)
    }
}

impl<D: Driver> Backend for GpuBackend<D> {
    type Error = Error;

    fn kind(&self) -> BackendKind {
        D::KIND
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput> {
        self.usable()?;
        self.check_inputs(token, pos)?;
        let ev = self.new_event()?;
        let t0 = Instant::now();
        self.launch_step(token, pos, 0)?;
        self.record(&ev)?;
        self.wait(&ev, self.opts.step_deadline)?;
        self.costs.single(t0.elapsed().as_secs_f64());
        self.next_pos = pos + 1;
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    /// With [`Options::prefill_chunk`] set and at least
    /// [`Options::prefill_min_tokens`] tokens: the tensor-core prefill
    /// kernel, one launch per chunk. Otherwise one decode step per prompt
    /// token, queued back to back with one wait. Every input is checked
    /// before the first launch.
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput> {
        self.usable()?;
        self.check_prompt(tokens, start)?;
        if self.prefill.is_some() && tokens.len() >= self.opts.prefill_min_tokens {
            self.prefill_chunked(tokens, start)?;
        } else {
            self.queued_steps(tokens, start)?;
        }
        self.next_pos = start + tokens.len();
        Ok(StepOutput {
            argmax: self.last_argmax,
        })
    }

    /// Runs of 2 ..= [`GpuBackend::multi_max_tokens`] positions go to the
    /// multi-token kernel in one launch (longer runs in consecutive
    /// launches of at most that many, a lone last position as a one-token
    /// step); every token and position is checked before the first launch.
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput> {
        self.usable()?;
        let (tokens, start) = (run.tokens(), run.start());
        self.check_prompt(tokens, start)?;
        let max = self.multi_max_tokens().max(1);
        let mut out = MultiStepOutput {
            argmax: Vec::with_capacity(tokens.len()),
            logits: Vec::new(),
        };
        for (i, part) in tokens.chunks(max).enumerate() {
            let at = start + i * max;
            if part.len() == 1 {
                out.argmax.push(self.step(part[0], at)?.argmax);
                if run.wants_logits() {
                    out.logits.extend(self.logits()?);
                }
            } else {
                self.multi_step(part, at, run.wants_logits(), &mut out)?;
            }
        }
        Ok(out)
    }

    /// Measured as the backend runs (wall time per launch, both kinds);
    /// [`DEFAULT_POSITION_COST`] until both have run.
    fn step_many_position_cost(&self) -> f64 {
        if self.multi.is_none() {
            return 1.0;
        }
        self.costs.position_cost().unwrap_or(DEFAULT_POSITION_COST)
    }

    /// A size timed as one launch reports its own mean; any other (not yet
    /// run, or more positions than one launch takes) the linear estimate.
    fn step_many_cost(&self, positions: usize) -> f64 {
        let one_launch = (2..=self.multi_max_tokens()).contains(&positions);
        match self.costs.launch_cost(positions) {
            Some(c) if one_launch => c,
            _ => 1.0 + positions.saturating_sub(1) as f64 * self.step_many_position_cost(),
        }
    }

    fn logits(&mut self) -> Result<Vec<f32>> {
        self.usable()?;
        let mut v = vec![0f32; self.config.vocab_size];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
        // SAFETY: last_logits is a logits row of vocab f32 (at least 16
        // bytes) in a live buffer; the last step has completed.
        let r = unsafe { self.driver.dtoh(bytes, self.last_logits) };
        r.map_err(|c| self.fail("cuMemcpyDtoH (logits)", c))?;
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

impl<D: Driver> Drop for GpuBackend<D> {
    fn drop(&mut self) {
        // Fields are freed next, in declaration order, with the context
        // current; errors (a dead context) cannot be reported from drop.
        let _ = self.bind();
        let _ = self.driver.stream_synchronize(&self.stream);
    }
}

impl<D: Driver> std::fmt::Debug for GpuBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("driver", &D::NAME)
            .field("device", &self.info)
            .field("launch", &self.launch)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upload::mock::{with, Mock};

    #[test]
    fn step_costs_are_running_means_per_size() {
        let mut c = StepCosts::default();
        assert_eq!(c.position_cost(), None);
        // The first launch of a kind is not timed.
        c.multi(3, 1.0);
        c.multi(3, 0.003);
        c.single(1.0);
        assert_eq!((c.position_cost(), c.launch_cost(3)), (None, None));
        c.single(0.002);
        // T = 3 at 1.5 steps: 0.25 per extra position.
        assert_eq!(c.launch_cost(3), Some(1.5));
        assert_eq!(c.position_cost(), Some(0.25));
        assert_eq!((c.launch_cost(2), c.launch_cost(9)), (None, None));
        // T = 5 at 3 steps (0.5 per position) twice: weighted 2 to 1.
        c.multi(5, 1.0);
        c.multi(5, 0.006);
        c.multi(5, 0.006);
        assert_eq!(c.launch_cost(5), Some(3.0));
        assert!((c.position_cost().unwrap() - 1.25 / 3.0).abs() < 1e-12);
        // A mean moves towards new samples.
        c.multi(3, 0.005);
        assert_eq!(c.launch_cost(3), Some(2.0));
    }

    #[test]
    fn kv_maps_describe_both_caches_in_tile_boxes() {
        let config = Config::preset("7b").unwrap();
        let mut params: KernelParams = bytemuck::Zeroable::zeroed();
        (params.k_cache, params.v_cache) = (0x10_0000, 0x20_0000);
        with(|s| s.maps.clear());
        let maps = kv_maps(&Mock, &config, 32_768, &params).unwrap();
        assert_eq!(maps.len() as u64, KV_MAPS_BYTES);
        // K's descriptor first, then V's.
        assert_eq!(maps[..8], 0x10_0000u64.to_ne_bytes());
        assert_eq!(maps[128..136], 0x20_0000u64.to_ne_bytes());
        let want = |base| TensorMap2d {
            base,
            cols: 512,
            rows: 28 * 32_768,
            row_bytes: 1024,
            box_cols: 128,
            box_rows: 16,
        };
        with(|s| assert_eq!(s.maps, [want(0x10_0000), want(0x20_0000)]));
    }

    #[test]
    fn kv_maps_refuse_rows_past_the_copies_coordinates() {
        // 28 layers x 2^27 positions = 3.8e9 rows: past the signed 32-bit
        // row coordinate of a bulk copy.
        let config = Config::preset("7b").unwrap();
        let params: KernelParams = bytemuck::Zeroable::zeroed();
        let err = kv_maps(&Mock, &config, 1 << 27, &params).unwrap_err();
        assert!(err.to_string().contains("kv_maps"), "{err}");
        assert!(kv_maps(&Mock, &config, (1 << 31) / 28, &params).is_ok());
    }

    /// Every scratch buffer but the uploaded tables starts zeroed (the mock
    /// fills new allocations with 0xA5), the tensor-core scratch at its
    /// planned size among them, and each address lands in its field.
    #[test]
    fn scratch_buffers_start_zeroed_with_their_addresses_set() {
        let config = Config::preset("7b").unwrap();
        let capacity = 16;
        let memory = MemoryPlan::new(&config, capacity, 132, None).unwrap();
        let rope = qmk_model::reference::Rope::from_spec(
            &config.rope().unwrap(),
            config.head_dim(),
            capacity as usize,
        );
        let mut params = base_params(&config, capacity, Duration::from_secs(1));
        let ScratchBuffers {
            rest: buffers,
            sync,
            logits,
        } = alloc_buffers(
            &Mock,
            &config,
            capacity,
            Arch::SM90,
            &memory,
            &rope,
            &mut params,
        )
        .unwrap();
        assert_eq!(buffers.len() + 2, memory.buffers.len());
        let tc_bytes = crate::plan::tc_scratch_bytes(&config);
        assert!(tc_bytes > 16);
        with(|s| {
            let at = |addr: u64| &s.mem[&addr];
            let tc = at(params.tc_scratch);
            assert_eq!(tc.len() as u64, tc_bytes);
            assert!(tc.iter().all(|&b| b == 0), "tc_scratch is not zeroed");
            for addr in [params.k_cache, params.attn_part, params.sync, params.x] {
                assert!(at(addr).iter().all(|&b| b == 0), "{addr:#x}");
            }
            let cos: &[u8] = bytemuck::cast_slice(&rope.cos);
            assert_eq!(at(params.rope_cos).as_slice(), cos);
        });
        assert_eq!((sync.addr(), logits.addr()), (params.sync, params.logits));
    }
}
