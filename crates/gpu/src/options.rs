//! How a GPU backend is set up, what it reports while uploading, and the
//! device it runs on.

use std::path::PathBuf;
use std::time::Duration;

use qmk_kernels::Arch;

/// How a GPU backend is set up (the same for every driver).
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
    /// Compile the kernel with this split plan instead of the planner's
    /// (tests force a plan made for another offset model to show the
    /// 32-bit trap in a real decode).
    pub plan: Option<qmk_layout::ModelPlan>,
    /// Prompt positions per launch of the tensor-core prefill kernel
    /// (`qmk_prefill_chunk`); clamped to `capacity`. Default
    /// [`DEFAULT_PREFILL_CHUNK`]. `None` keeps `Backend::prefill` on decode
    /// steps (and allocates no prefill scratch).
    pub prefill_chunk: Option<u32>,
    /// Prompts shorter than this many tokens are fed as decode steps (queued
    /// back to back, one wait) even when the prefill kernel is enabled: for
    /// a handful of tokens a decode step can beat one chunk launch that
    /// streams every weight with few rows per tile. Default
    /// [`DEFAULT_PREFILL_MIN_TOKENS`]; 1 sends every prompt to the kernel.
    pub prefill_min_tokens: usize,
    /// Pick the KV capacity: the largest up to `capacity` whose memory plan
    /// fits the device's free memory, less [`crate::plan::FIT_RESERVE_BYTES`]
    /// ([`Backend::capacity`](qmk_engine::Backend::capacity) reports it).
    /// Off: exactly `capacity`, refused with the numbers when it does not
    /// fit.
    pub fit_capacity: bool,
    /// The pinned staging ring of the weight upload.
    pub upload: crate::upload::UploadOptions,
    /// Run the decode steps' weight phases on tensor cores from 7B up on sm_90
    /// ([`qmk_kernels::KernelBuild::with_tensor_cores`]): a multi-token
    /// step then costs about what a one-token step costs. Off by default:
    /// built and checked on the host, not yet validated on a GPU. Refused
    /// by tensor-parallel ranks.
    pub tensor_cores: bool,
}

/// Default [`Options::prefill_chunk`]: positions per prefill launch.
/// Larger chunks stream the weights fewer times and give the attention
/// phase more (query block, head) units to spread over the SMs; the scratch
/// grows linearly (7B at 2,048: 174 MB). On an H200 a 2,048-token prompt
/// takes 12.8 ms at chunk 2,048 vs 27.6 ms at 512 (0.5B), 133 vs 151 ms
/// (7B); `docs/performance.md` has the method.
pub const DEFAULT_PREFILL_CHUNK: u32 = 2048;

/// Default [`Options::prefill_min_tokens`]: the shortest prompt that goes
/// through the prefill kernel. On an H200 a launch costs ~1.9 ms at 0.5B
/// and ~7.1 ms at 7B for 1-16 tokens, a decode step 0.70 / 3.97 ms per
/// token, so the kernel wins from 3 tokens at 0.5B and from 2 at 7B; 3
/// serves both (the GPU tests' threshold table measures it).
pub const DEFAULT_PREFILL_MIN_TOKENS: usize = 3;

impl Default for Options {
    fn default() -> Self {
        Options {
            device: 0,
            capacity: 4096,
            cubin: None,
            spin_timeout: Duration::from_secs(2),
            step_deadline: Duration::from_secs(30),
            ctas_per_sm: None,
            plan: None,
            prefill_chunk: Some(DEFAULT_PREFILL_CHUNK),
            prefill_min_tokens: DEFAULT_PREFILL_MIN_TOKENS,
            fit_capacity: false,
            upload: crate::upload::UploadOptions::default(),
            tensor_cores: false,
        }
    }
}

/// Grace period after the abort flag before a hung kernel is declared
/// unrecoverable.
pub const ABORT_GRACE: Duration = Duration::from_secs(10);

/// Upload progress (weights can be tens of GB).
pub trait Progress {
    /// `total_bytes` of `what` are about to be copied.
    fn begin(&mut self, _what: &str, _total_bytes: u64) {}
    /// `bytes` more have landed.
    fn advance(&mut self, _bytes: u64) {}
    /// Everything has landed.
    fn finish(&mut self) {}
    /// A step of unknown length is under way (e.g. the kernel compile that
    /// the upload did not hide); shown until the next `begin` or `finish`.
    fn step(&mut self, _what: &str) {}
}

/// No progress reporting.
impl Progress for () {}

/// One CUDA device as a backend sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// The driver's name for it (`NVIDIA H200`).
    pub name: String,
    /// Its SM architecture.
    pub arch: Arch,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Device memory, bytes.
    pub total_mem: u64,
    /// Free device memory, bytes; filled in by the backend once a context
    /// exists (0 before).
    pub free_mem: u64,
    /// Largest dynamic shared memory a CTA may opt into, bytes.
    pub max_smem_optin: u32,
    /// Whether the device supports cooperative launch.
    pub cooperative: bool,
}

/// The environment variable that moves the status block from device memory
/// (the default: the host reads it with a copy after the step and raises
/// `abort` with an async copy on a second stream) to pinned host memory
/// mapped into the device (no copies; needs working zero-copy access).
pub const STATUS_MAPPED_ENV: &str = "QMK_STATUS_MAPPED";

/// `true` when [`STATUS_MAPPED_ENV`] is `1`.
pub(crate) fn status_in_mapped_memory() -> bool {
    std::env::var(STATUS_MAPPED_ENV).as_deref() == Ok("1")
}
