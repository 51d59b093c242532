//! Backend-agnostic host code of the megakernel: everything a CUDA backend
//! does around the driver calls, written once so the `cudarc` and `cust`
//! backends cannot drift apart.
//!
//! - [`MemoryPlan`]: every device allocation (weights, KV cache, rope
//!   tables, scratch), sized with checked arithmetic before the first
//!   allocation, so "not enough GPU memory" is reported up front;
//! - [`weight_chunks`]: the weight staging order (plan order, one device
//!   allocation per planned chunk) and the host bytes of each chunk;
//! - [`Buffer`] / [`set_buffer`] / [`base_params`]: filling [`KernelParams`];
//! - [`LaunchInfo::from_occupancy`]: the cooperative grid;
//! - [`status`], [`status_in_mapped_memory`]: word indices of the
//!   [`HostStatus`] block and where it lives (device memory by default,
//!   mapped pinned host memory with `QMK_STATUS_MAPPED=1`);
//! - [`DeviceInfo`]: one CUDA device as a backend sees it;
//! - [`Progress`], [`BenchOptions`], [`BenchReport`], [`median`],
//!   [`percentile`], [`bench_bytes_per_step`]: upload progress and the
//!   decode benchmark's statistics;
//! - [`cuda_error_name`], [`is_sticky`]: driver result codes in words, and
//!   which of them corrupt the context.

// `KernelsError` is the kernels crate's one error type; its size is its call.
#![allow(clippy::result_large_err)]

use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::time::Duration;

use qmk_model::{Config, WeightKind, Weights};

use crate::error::{KernelsError, Result};
use crate::header::KernelBuild;
use crate::params::{HostStatus, KernelParams, SyncState, THREADS_PER_CTA};

/// How a CUDA backend is set up (the same for every binding).
#[derive(Debug, Clone)]
pub struct GpuOptions {
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
    /// Compile the kernel with this split plan instead of the planner's
    /// (tests force a plan made for another offset model to show the
    /// 32-bit trap in a real decode; see crates/backend-cust/tests/scale.rs).
    pub plan: Option<qmk_layout::ModelPlan>,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            device: 0,
            capacity: 4096,
            cubin: None,
            spin_timeout: Duration::from_secs(2),
            step_deadline: Duration::from_secs(30),
            ctas_per_sm: None,
            plan: None,
        }
    }
}

/// Grace period after the abort flag before a hung kernel is declared
/// unrecoverable.
pub const ABORT_GRACE: Duration = Duration::from_secs(10);

/// Upload progress (weights can be tens of GB).
pub trait Progress {
    fn begin(&mut self, _what: &str, _total_bytes: u64) {}
    fn advance(&mut self, _bytes: u64) {}
    fn finish(&mut self) {}
}

/// No progress reporting.
impl Progress for () {}

/// One CUDA device as a backend sees it (each backend fills it through its
/// own driver binding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: crate::Arch,
    pub sms: u32,
    pub total_mem: u64,
    /// Filled in by the backend once a context exists (0 before).
    pub free_mem: u64,
    /// Largest dynamic shared memory a CTA may opt into, bytes.
    pub max_smem_optin: u32,
    pub cooperative: bool,
}

/// The environment variable that moves the status block from device memory
/// (the default: the host reads it with a copy after the step and raises
/// `abort` with an async copy on a second stream) to pinned host memory
/// mapped into the device (no copies; needs working zero-copy access).
pub const STATUS_MAPPED_ENV: &str = "QMK_STATUS_MAPPED";

/// `true` when [`STATUS_MAPPED_ENV`] is `1`: the backend allocates the
/// status block in mapped host memory instead of device memory.
pub fn status_in_mapped_memory() -> bool {
    std::env::var(STATUS_MAPPED_ENV).as_deref() == Ok("1")
}

/// Word (u32) indices of the [`HostStatus`] fields in the status block
/// (device memory or mapped host memory, see [`status_in_mapped_memory`]).
pub mod status {
    use super::*;
    pub const ABORT: usize = offset_of!(HostStatus, abort) / 4;
    pub const ERROR: usize = offset_of!(HostStatus, error) / 4;
    pub const PHASE: usize = offset_of!(HostStatus, phase) / 4;
    pub const LAYER: usize = offset_of!(HostStatus, layer) / 4;
    pub const CTA: usize = offset_of!(HostStatus, cta) / 4;
    pub const BARRIERS: usize = offset_of!(HostStatus, barriers) / 4;
    pub const ARGMAX: usize = offset_of!(HostStatus, argmax) / 4;
    pub const DONE: usize = offset_of!(HostStatus, done) / 4;
    /// Words in the block.
    pub const WORDS: usize = size_of::<HostStatus>() / 4;
}

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

impl LaunchInfo {
    /// Grid = CTAs per SM (the occupancy API's answer `occupancy`, capped by
    /// `cap`) x SMs, so every CTA is co-resident. `None` when no CTA fits.
    pub fn from_occupancy(
        occupancy: i32,
        sms: u32,
        cap: Option<u32>,
        smem_bytes: u32,
        registers: u32,
    ) -> Option<LaunchInfo> {
        let occ = u32::try_from(occupancy).ok().filter(|&o| o > 0)?;
        let per_sm = cap.map_or(occ, |c| c.clamp(1, occ));
        Some(LaunchInfo {
            grid: per_sm.checked_mul(sms)?,
            block: THREADS_PER_CTA,
            ctas_per_sm: per_sm,
            max_ctas_per_sm: occ,
            smem_bytes,
            registers,
        })
    }
}

/// A scratch allocation the kernel addresses through [`KernelParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    KCache,
    VCache,
    RopeCos,
    RopeSin,
    X,
    Q,
    Attn,
    MlpH,
    Logits,
    PartialVal,
    PartialIdx,
    ArgmaxOut,
    Sync,
}

impl Buffer {
    /// The field name in [`KernelParams`] (for error messages).
    pub fn name(self) -> &'static str {
        match self {
            Buffer::KCache => "k_cache",
            Buffer::VCache => "v_cache",
            Buffer::RopeCos => "rope_cos",
            Buffer::RopeSin => "rope_sin",
            Buffer::X => "x",
            Buffer::Q => "q",
            Buffer::Attn => "attn",
            Buffer::MlpH => "mlp_h",
            Buffer::Logits => "logits",
            Buffer::PartialVal => "partial_val",
            Buffer::PartialIdx => "partial_idx",
            Buffer::ArgmaxOut => "argmax_out",
            Buffer::Sync => "sync",
        }
    }
}

/// Points `buffer`'s field of `params` at device address `addr`.
pub fn set_buffer(params: &mut KernelParams, buffer: Buffer, addr: u64) {
    let field = match buffer {
        Buffer::KCache => &mut params.k_cache,
        Buffer::VCache => &mut params.v_cache,
        Buffer::RopeCos => &mut params.rope_cos,
        Buffer::RopeSin => &mut params.rope_sin,
        Buffer::X => &mut params.x,
        Buffer::Q => &mut params.q,
        Buffer::Attn => &mut params.attn,
        Buffer::MlpH => &mut params.mlp_h,
        Buffer::Logits => &mut params.logits,
        Buffer::PartialVal => &mut params.partial_val,
        Buffer::PartialIdx => &mut params.partial_idx,
        Buffer::ArgmaxOut => &mut params.argmax_out,
        Buffer::Sync => &mut params.sync,
    };
    *field = addr;
}

/// A parameter block with every address zero and the scalars set: the
/// backend then fills weight chunks ([`WeightChunk::set`]), buffers
/// ([`set_buffer`]) and `status`.
pub fn base_params(config: &Config, capacity: u32, spin_timeout: Duration) -> KernelParams {
    let mut p: KernelParams = bytemuck::Zeroable::zeroed();
    p.spin_timeout_ns = duration_ns(spin_timeout);
    p.kv_capacity = capacity;
    p.rms_norm_eps = config.rms_norm_eps as f32;
    p
}

/// A duration in nanoseconds, saturating (the kernel's spin budget).
pub fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn overflow(what: &str) -> KernelsError {
    KernelsError::Config {
        field: "kv_capacity",
        reason: format!("the size of {what} overflows 64 bits"),
    }
}

fn mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| overflow(what))
}

/// Every device allocation of one engine, in bytes, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Every weight chunk together.
    pub weight_bytes: u64,
    /// Weight bytes one decode step reads.
    pub weight_bytes_per_step: u64,
    /// One of the K and V caches `[L, C, KV]` bf16.
    pub kv_cache_bytes: u64,
    /// One layer of one cache (must fit the kernel's 32-bit in-layer offsets).
    pub kv_layer_bytes: u64,
    /// One of the rope cos/sin tables `[C, D/2]` f32.
    pub rope_table_bytes: u64,
    /// Scratch buffers and their sizes, in allocation order (after the
    /// weights). The rope tables are uploaded; the rest start zeroed.
    pub buffers: Vec<(Buffer, u64)>,
    /// Everything together: what must be free on the device.
    pub total_bytes: u64,
}

/// Largest layer of one KV cache the kernel's 32-bit in-layer offsets
/// address, in bytes.
pub const MAX_KV_LAYER_BYTES: u64 = 1 << 32;

impl MemoryPlan {
    /// Sizes every allocation for `config` with a `capacity`-position KV
    /// cache and a grid of `grid` CTAs, and refuses a KV layer past
    /// [`MAX_KV_LAYER_BYTES`].
    pub fn new(config: &Config, capacity: u32, grid: u32) -> Result<MemoryPlan> {
        let plan = MemoryPlan::sizes(config, capacity, grid)?;
        let kv_layer = plan.kv_layer_bytes;
        if kv_layer > MAX_KV_LAYER_BYTES {
            return Err(KernelsError::Config {
                field: "kv_capacity",
                reason: format!(
                    "one layer of the KV cache ({kv_layer} bytes for {capacity} positions) exceeds \
                     the kernel's 32-bit in-layer offsets"
                ),
            });
        }
        Ok(plan)
    }

    /// The sizes alone (every one checked for overflow), without the limit
    /// [`MemoryPlan::new`] puts on `kv_layer_bytes`: for a backend that
    /// reports that limit in its own words.
    pub fn sizes(config: &Config, capacity: u32, grid: u32) -> Result<MemoryPlan> {
        let wb = qmk_model::weight_bytes(config)?;
        let cap = u64::from(capacity);
        let kv_dim = config.kv_dim() as u64;
        let layers = config.num_hidden_layers as u64;
        let kv_layer = mul(mul(cap, kv_dim, "a KV-cache layer")?, 2, "a KV-cache layer")?;
        let kv = mul(kv_layer, layers, "the KV cache")?;
        let half = config.head_dim() as u64 / 2;
        let rope = mul(mul(cap, half, "the rope table")?, 4, "the rope table")?;
        let f32s = |n: usize| mul(n as u64, 4, "a scratch buffer");
        let buffers = vec![
            (Buffer::KCache, kv),
            (Buffer::VCache, kv),
            (Buffer::RopeCos, rope),
            (Buffer::RopeSin, rope),
            (Buffer::X, f32s(config.hidden_size)?),
            (Buffer::Q, f32s(config.q_dim())?),
            (Buffer::Attn, f32s(config.q_dim())?),
            (Buffer::MlpH, f32s(config.intermediate_size)?),
            (Buffer::Logits, f32s(config.vocab_size)?),
            (Buffer::PartialVal, f32s(grid as usize)?),
            (Buffer::PartialIdx, f32s(grid as usize)?),
            (Buffer::ArgmaxOut, 16),
            (Buffer::Sync, size_of::<SyncState>() as u64),
        ];
        let total = buffers
            .iter()
            .try_fold(wb.total.0, |a, &(_, b)| a.checked_add(b))
            .ok_or_else(|| overflow("the device memory plan"))?;
        Ok(MemoryPlan {
            weight_bytes: wb.total.0,
            weight_bytes_per_step: wb.per_decode_step.0,
            kv_cache_bytes: kv,
            kv_layer_bytes: kv_layer,
            rope_table_bytes: rope,
            buffers,
            total_bytes: total,
        })
    }
}

/// One planned chunk of one weight tensor: its bytes on the host and the
/// [`KernelParams`] slot its device address goes to.
#[derive(Debug, Clone, Copy)]
pub struct WeightChunk<'w> {
    /// Plan name (`gate_proj`, ...).
    pub tensor: &'w str,
    /// Chunk index inside the tensor.
    pub chunk: usize,
    /// The chunk's bf16 elements as bytes (one device allocation each).
    pub host: &'w [u8],
}

impl WeightChunk<'_> {
    /// Writes `addr` into this chunk's slot of `params`.
    pub fn set(&self, params: &mut KernelParams, addr: u64) {
        if let Some(slots) = params.chunks_mut(self.tensor) {
            slots[self.chunk] = addr;
        }
    }
}

/// The weight staging order: every chunk of every tensor the kernel
/// addresses, in plan order, each checked against the tensor's layout.
/// After uploading them, call [`tie_embeddings`].
pub fn weight_chunks<'w>(
    build: &'w KernelBuild,
    weights: &'w Weights,
) -> Result<Vec<WeightChunk<'w>>> {
    let bad = |tensor: &str, reason: String| KernelsError::Plan {
        tensor: tensor.to_string(),
        reason,
    };
    if weights.config != build.config {
        return Err(bad(
            "(all)",
            "the weights were made for another config than the kernel build".into(),
        ));
    }
    let mut probe: KernelParams = bytemuck::Zeroable::zeroed();
    let mut out = Vec::new();
    for t in &build.plan.tensors {
        let name = t.spec.name.as_str();
        let kind = WeightKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                bad(
                    name,
                    "the plan names a tensor the model does not have".into(),
                )
            })?;
        let host = weights
            .get(kind)
            .ok_or_else(|| bad(name, "missing from the weights".into()))?;
        let elems = t.spec.layout.size()?;
        if host.len() as u64 != elems {
            return Err(bad(
                name,
                format!(
                    "{} elements, the layout {} needs {elems}",
                    host.len(),
                    t.spec.layout
                ),
            ));
        }
        if probe.chunks_mut(name).is_none() {
            continue; // a tensor the kernel does not address
        }
        let bytes: &[u8] = bytemuck::cast_slice(host);
        for (c, chunk) in t.chunks.iter().enumerate() {
            let off = t.chunk_byte_offset(c)?.0;
            let end = off
                .checked_add(chunk.byte_span.0)
                .filter(|&e| e <= bytes.len() as u64)
                .ok_or_else(|| bad(name, format!("chunk {c} runs past the tensor")))?;
            out.push(WeightChunk {
                tensor: name,
                chunk: c,
                host: &bytes[off as usize..end as usize],
            });
        }
    }
    Ok(out)
}

/// A tied model's LM head is its embedding table.
pub fn tie_embeddings(config: &Config, params: &mut KernelParams) {
    if config.tie_word_embeddings {
        params.lm_head = params.embed_tokens;
    }
}

/// Bytes per host-to-device copy: large enough for full PCIe speed, small
/// enough for a smooth progress bar.
pub const UPLOAD_PIECE_BYTES: usize = 128 << 20;

/// What a backend's `bench` runs.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is reported).
    pub steps: usize,
    /// Token of position 0; later tokens are the kernel's own greedy picks
    /// (read on the device, no host round trip).
    pub first_token: u32,
    /// Size of the streaming-read buffer for the floor.
    pub stream_bytes: u64,
    pub stream_reps: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            warmup: 16,
            steps: 128,
            first_token: 9707,
            stream_bytes: 4 << 30,
            stream_reps: 10,
        }
    }
}

/// Decode benchmark results, with the floor measured in the same run.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    pub device: String,
    pub tok_per_s: f64,
    /// Median over the timed steps, device events.
    pub us_per_step: f64,
    pub us_p10: f64,
    pub us_p90: f64,
    /// Mean bytes one timed step must move.
    pub bytes_per_step: u64,
    /// bytes_per_step / us_per_step.
    pub gbps: f64,
    /// Streaming-read bandwidth, same cubin, same run.
    pub floor_gbps: f64,
    /// floor time / measured time, in percent.
    pub pct_of_floor: f64,
    /// Floor tok/s: floor_gbps / bytes_per_step.
    pub floor_tok_per_s: f64,
    pub barriers_per_step: u32,
    pub grid: u32,
    pub ctas_per_sm: u32,
    pub registers: u32,
    pub warmup: usize,
    pub steps: usize,
    /// Positions decoded, 0..context.
    pub context: usize,
}

/// Median (upper median for even lengths); sorts `v`. NaN for empty input.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Nearest-rank percentile `p` in 0..=1 of a sorted slice. NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p.clamp(0.0, 1.0)).round() as usize]
}

/// Mean bytes one timed step moves: the step's weights plus the KV cache
/// read (positions 0..=pos) and written (pos), averaged over positions
/// `warmup..warmup + steps`.
pub fn bench_bytes_per_step(
    config: &Config,
    weight_bytes_per_step: u64,
    warmup: usize,
    steps: usize,
) -> u64 {
    let kv_row = 2 * config.kv_dim() as u64 * config.num_hidden_layers as u64 * 2; // K and V, bf16
    let kv_total: u64 = (warmup..warmup + steps)
        .map(|p| kv_row * (p as u64 + 1) + kv_row)
        .sum();
    weight_bytes_per_step + kv_total / steps.max(1) as u64
}

impl BenchReport {
    /// Assembles the report from per-step device times (microseconds).
    #[allow(clippy::too_many_arguments)]
    pub fn from_times(
        device: String,
        config: &Config,
        weight_bytes_per_step: u64,
        opts: &BenchOptions,
        mut us: Vec<f64>,
        floor_gbps: f64,
        barriers_per_step: u32,
        launch: &LaunchInfo,
    ) -> BenchReport {
        let us_med = median(&mut us);
        let bytes_per_step =
            bench_bytes_per_step(config, weight_bytes_per_step, opts.warmup, opts.steps);
        let gbps = bytes_per_step as f64 / (us_med * 1e-6) / 1e9;
        BenchReport {
            device,
            tok_per_s: 1e6 / us_med,
            us_per_step: us_med,
            us_p10: percentile(&us, 0.1),
            us_p90: percentile(&us, 0.9),
            bytes_per_step,
            gbps,
            floor_gbps,
            pct_of_floor: 100.0 * gbps / floor_gbps,
            floor_tok_per_s: floor_gbps * 1e9 / bytes_per_step as f64,
            barriers_per_step,
            grid: launch.grid,
            ctas_per_sm: launch.ctas_per_sm,
            registers: launch.registers,
            warmup: opts.warmup,
            steps: opts.steps,
            context: opts.warmup + opts.steps,
        }
    }
}

/// CUDA driver errors after which the context cannot be used again.
pub fn is_sticky(code: u32) -> bool {
    matches!(
        code,
        214 | 700 | 702 | 714 | 715 | 716 | 717 | 718 | 719 | 999
    )
}

/// The `CUresult` enumerator name and the driver's description of `code`,
/// for error messages that must not depend on a working driver (a stub
/// libcuda cannot describe its own errors).
pub fn cuda_error_name(code: u32) -> (&'static str, &'static str) {
    match code {
        0 => ("CUDA_SUCCESS", "no error"),
        1 => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        2 => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        3 => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        4 => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
        34 => ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
        46 => (
            "CUDA_ERROR_DEVICE_UNAVAILABLE",
            "CUDA-capable device(s) is/are busy or unavailable",
        ),
        100 => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
        101 => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        200 => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
        201 => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        209 => (
            "CUDA_ERROR_NO_BINARY_FOR_GPU",
            "no kernel image is available for execution on the device",
        ),
        214 => (
            "CUDA_ERROR_ECC_UNCORRECTABLE",
            "uncorrectable ECC error encountered",
        ),
        218 => ("CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
        222 => (
            "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            "the provided PTX was compiled with an unsupported toolchain",
        ),
        300 => (
            "CUDA_ERROR_INVALID_SOURCE",
            "device kernel image is invalid",
        ),
        400 => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        500 => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        600 => ("CUDA_ERROR_NOT_READY", "device not ready"),
        700 => (
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "an illegal memory access was encountered",
        ),
        701 => (
            "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            "too many resources requested for launch",
        ),
        702 => (
            "CUDA_ERROR_LAUNCH_TIMEOUT",
            "the launch timed out and was terminated",
        ),
        714 => ("CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"),
        715 => (
            "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            "an illegal instruction was encountered",
        ),
        716 => ("CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
        717 => (
            "CUDA_ERROR_INVALID_ADDRESS_SPACE",
            "operation not supported on global/shared address space",
        ),
        718 => ("CUDA_ERROR_INVALID_PC", "invalid program counter"),
        719 => ("CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
        720 => (
            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
            "too many blocks in cooperative launch",
        ),
        800 => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
        801 => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        999 => ("CUDA_ERROR_UNKNOWN", "unknown error"),
        _ => ("CUDA_ERROR_(unlisted)", "see cuda.h for this result code"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_words_match_the_struct() {
        assert_eq!(
            (status::ABORT, status::ERROR, status::ARGMAX, status::DONE),
            (0, 1, 6, 7)
        );
        assert_eq!(status::WORDS, 8);
        assert_eq!(STATUS_MAPPED_ENV, "QMK_STATUS_MAPPED");
    }

    #[test]
    fn grid_is_occupancy_times_sms() {
        let l = LaunchInfo::from_occupancy(2, 132, None, 1024, 64).unwrap();
        assert_eq!((l.grid, l.ctas_per_sm, l.max_ctas_per_sm), (264, 2, 2));
        let l = LaunchInfo::from_occupancy(2, 132, Some(5), 1024, 64).unwrap();
        assert_eq!(l.grid, 264);
        let l = LaunchInfo::from_occupancy(3, 132, Some(1), 1024, 64).unwrap();
        assert_eq!(l.grid, 132);
        assert!(LaunchInfo::from_occupancy(0, 132, None, 1024, 64).is_none());
    }

    #[test]
    fn memory_plan_sizes() {
        let config = Config::preset("0.5b").unwrap();
        let plan = MemoryPlan::new(&config, 4096, 132).unwrap();
        // [24, 4096, 128] bf16 per cache.
        assert_eq!(plan.kv_cache_bytes, 24 * 4096 * 128 * 2);
        assert_eq!(plan.rope_table_bytes, 4096 * 32 * 4);
        assert!(plan.total_bytes > plan.weight_bytes + 2 * plan.kv_cache_bytes);
        // A KV layer past 4 GiB is refused, naming the capacity.
        let big = Config::preset("72b").unwrap();
        let e = MemoryPlan::new(&big, u32::MAX, 132).unwrap_err();
        assert!(e.to_string().contains("kv_capacity"), "{e}");
        // `sizes` leaves that limit to the caller.
        let sized = MemoryPlan::sizes(&big, u32::MAX, 132).unwrap();
        assert!(sized.kv_layer_bytes > MAX_KV_LAYER_BYTES);
        assert_eq!(MemoryPlan::sizes(&config, 4096, 132).unwrap(), plan);
    }

    fn tiny(tied: bool) -> Config {
        let mut c = Config::preset(if tied { "0.5b" } else { "7b" }).unwrap();
        c.hidden_size = 128;
        c.intermediate_size = 256;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(32);
        c.vocab_size = 512;
        c
    }

    #[test]
    fn weight_chunks_cover_every_kernel_tensor_once() {
        for tied in [true, false] {
            let config = tiny(tied);
            let build = KernelBuild::new(&config).unwrap();
            let w = qmk_model::synthetic_weights(&config, 7);
            let chunks = weight_chunks(&build, &w).unwrap();
            let total: u64 = chunks.iter().map(|c| c.host.len() as u64).sum();
            assert_eq!(total, qmk_model::weight_bytes(&config).unwrap().total.0);
            let mut p = base_params(&config, 16, Duration::from_secs(1));
            for (i, c) in chunks.iter().enumerate() {
                c.set(&mut p, 0x1000 * (i as u64 + 1));
            }
            tie_embeddings(&config, &mut p);
            for name in crate::params::KERNEL_TENSORS {
                let slot = p.chunks_mut(name).unwrap()[0];
                assert_ne!(slot, 0, "tied={tied}: {name} has no chunk 0");
            }
            assert_eq!(p.lm_head == p.embed_tokens, tied);
            // The first chunk of embed_tokens is the table's first bytes.
            let e: &[u8] = bytemuck::cast_slice(&w.embed_tokens);
            assert_eq!(chunks[0].tensor, "embed_tokens");
            assert_eq!(chunks[0].host, e);
        }
    }

    #[test]
    fn statistics() {
        let mut v = vec![3.0, 1.0, 2.0, 10.0];
        assert_eq!(median(&mut v), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 10.0);
        assert!(median(&mut []).is_nan());
        assert_eq!(cuda_error_name(700).0, "CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(is_sticky(700) && !is_sticky(2));
    }
}
