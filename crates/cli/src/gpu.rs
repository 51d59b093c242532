//! GPU discovery and the GPU backends, behind one function each.
//!
//! [`probe`] asks the CUDA driver (loaded at run time, so this works on
//! machines without CUDA) whether a device exists. [`check_fits`] sizes the
//! run with the backend's own memory plan before anything is loaded.
//! [`open`] builds a GPU backend, streaming the weights from any source; it
//! is the single place where the cudarc and cust drivers are wired into the
//! CLI.

use std::path::Path;

use qmk_engine::BackendKind;
use qmk_gpu::{Driver, GpuBackend, MemoryPlan, Options, WeightSource};

use crate::backend::AnyBackend;
use crate::ui::Ui;

/// The device a GPU backend would run on.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub name: String,
    pub total_mem: u64,
    /// Streaming multiprocessors (the grid the memory plan is sized for).
    pub sms: u32,
}

/// Why no GPU backend can run here. The message is shown to the user.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU: {0}")]
    NoGpu(String),
    #[error("this qwen-mk was built without the cust backend (rebuild with `--features cust`)")]
    NoCustFeature,
    #[error(
        "out of device memory on {device}: {what} need about {need_gib:.2} GiB, {have_gib:.2} GiB available"
    )]
    OutOfMemory {
        device: String,
        what: String,
        need_gib: f64,
        have_gib: f64,
    },
    #[error(
        "the model does not fit on {device}: {what} need {need} bytes ({:.2} GiB) of {place}, {have} bytes ({:.2} GiB) available",
        *need as f64 / GIB, *have as f64 / GIB
    )]
    DoesNotFit {
        device: String,
        what: String,
        need: u128,
        have: u128,
        place: &'static str,
    },
    #[error("{0}")]
    Other(String),
}

/// Finds CUDA device 0, or says why there is none.
pub fn probe() -> Result<GpuInfo, GpuError> {
    match qmk_backend_cudarc::device_info(0) {
        Ok(d) => Ok(GpuInfo {
            name: d.name,
            total_mem: d.total_mem,
            sms: d.sms,
        }),
        Err(e) => Err(GpuError::NoGpu(qmk_engine::error_chain(&e))),
    }
}

/// Builds the GPU backend `kind` over the weights of `source` (streamed to
/// the device) with a KV cache of `capacity` positions, or with `fit` the
/// largest context up to `capacity` that the device's free memory holds
/// (loading `cubin` instead of compiling when given), showing the weight
/// upload (a byte bar) and the kernel compile (alongside it, then a
/// spinner) through `ui`. The backend refuses, before its first
/// allocation, a memory plan the device cannot hold. `prefill_chunk`:
/// positions per launch of the tensor-core prefill kernel (`None`: decode
/// steps for the prompt). `tp`: a tensor-parallel group instead of one GPU,
/// every rank's upload and the compile shown the same way; a group has no
/// prefill kernel (a rank feeds its prompt as decode steps), so it ignores
/// `prefill_chunk`.
#[allow(clippy::too_many_arguments)]
pub fn open(
    kind: BackendKind,
    gpu: &GpuInfo,
    source: &dyn WeightSource,
    capacity: usize,
    fit: bool,
    cubin: Option<&Path>,
    prefill_chunk: Option<u32>,
    tp: Option<&qmk_gpu::TpOptions>,
    ui: &Ui,
) -> Result<AnyBackend, GpuError> {
    let opts = Options {
        capacity,
        fit_capacity: fit,
        cubin: cubin.map(Path::to_path_buf),
        prefill_chunk: prefill_chunk.filter(|_| tp.is_none()),
        ..Default::default()
    };
    match kind {
        BackendKind::Cudarc => {
            open_with::<qmk_backend_cudarc::CudarcDriver>(gpu, source, opts, tp, ui)
        }
        #[cfg(feature = "cust")]
        BackendKind::Cust => open_with::<qmk_backend_cust::CustDriver>(gpu, source, opts, tp, ui),
        #[cfg(not(feature = "cust"))]
        BackendKind::Cust => Err(GpuError::NoCustFeature),
        BackendKind::Cpu => Err(GpuError::Other(
            "the CPU backend is not a GPU backend".into(),
        )),
    }
}

fn open_with<D: Driver + 'static>(
    gpu: &GpuInfo,
    source: &dyn WeightSource,
    opts: Options,
    tp: Option<&qmk_gpu::TpOptions>,
    ui: &Ui,
) -> Result<AnyBackend, GpuError> {
    let mut bars = Bars::new(ui);
    let made = match tp {
        None => GpuBackend::<D>::from_source(source, opts, &mut bars).map(AnyBackend::new),
        Some(tp) => qmk_gpu::TpBackend::<D>::new(source, opts, tp, &mut bars).map(AnyBackend::new),
    };
    bars.done();
    made.map_err(|e| memory_or_other(gpu, e))
}

fn memory_or_other(gpu: &GpuInfo, e: qmk_gpu::Error) -> GpuError {
    match e {
        qmk_gpu::Error::OutOfMemory {
            what,
            needed,
            available,
        } => GpuError::OutOfMemory {
            device: gpu.name.clone(),
            what,
            need_gib: needed as f64 / GIB,
            have_gib: available as f64 / GIB,
        },
        e => GpuError::Other(qmk_engine::error_chain(&e)),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Refuses, before any weight is read, generated or uploaded, a model
/// whose memory plan (weights, a KV cache of `capacity` positions, the
/// scratch, the prefill kernel's scratch for `prefill_chunk`) cannot fit the
/// device (`gpu.total_mem`, an upper bound of what a context can allocate).
/// The plan is the backend's own ([`MemoryPlan::new`]) for a grid of one
/// CTA per SM (the grid-sized scratch is a few MB, so the occupancy barely
/// moves the total). The message gives the bytes needed and available. The
/// weights stream to the device through a few pinned buffers, so host
/// memory is no limit.
pub fn check_fits(
    config: &qmk_model::Config,
    capacity: usize,
    prefill_chunk: Option<u32>,
    gpu: &GpuInfo,
) -> Result<(), GpuError> {
    let cap = u32::try_from(capacity)
        .map_err(|_| GpuError::Other(format!("a context of {capacity} positions is too long")))?;
    let chunk = qmk_gpu::plan::clamp_prefill_chunk(prefill_chunk, cap);
    let plan = MemoryPlan::new(config, cap, gpu.sms.max(1), chunk)
        .map_err(|e| GpuError::Other(e.to_string()))?;
    let weights = plan.weight_bytes as u128;
    let need = plan.total_bytes as u128;
    if gpu.total_mem > 0 && need > gpu.total_mem as u128 {
        return Err(GpuError::DoesNotFit {
            device: gpu.name.clone(),
            what: format!(
                "the weights ({weights} bytes), a KV cache of {capacity} positions ({} bytes) and \
                 scratch",
                2 * plan.kv_cache_bytes
            ),
            need,
            have: gpu.total_mem as u128,
            place: "device memory",
        });
    }
    Ok(())
}

/// [`check_fits`] for one rank of a `ranks`-way group (its shards and its
/// share of the KV cache), times the ranks when they share the GPU: the
/// split is refused here, naming the field, when the model cannot take it.
pub fn check_fits_tp(
    config: &qmk_model::Config,
    capacity: usize,
    ranks: usize,
    co_resident: bool,
    gpu: &GpuInfo,
) -> Result<(), GpuError> {
    qmk_model::tensor_parallel::check_ranks(config, ranks)
        .map_err(|e| GpuError::Other(e.to_string()))?;
    let rank = qmk_model::tensor_parallel::rank_config(config, ranks);
    // The rank's plan counts its LM-head shard; the whole embedding table
    // every rank holds is added on top.
    let cap = u32::try_from(capacity)
        .map_err(|_| GpuError::Other(format!("a context of {capacity} positions is too long")))?;
    let plan = MemoryPlan::new(&rank, cap, gpu.sms.max(1), None)
        .map_err(|e| GpuError::Other(e.to_string()))?;
    let embed = (config.vocab_size as u128) * (config.hidden_size as u128) * 2;
    let per_rank = plan.total_bytes as u128 + embed;
    let need = if co_resident {
        per_rank * ranks as u128
    } else {
        per_rank
    };
    if gpu.total_mem > 0 && need > gpu.total_mem as u128 {
        return Err(GpuError::DoesNotFit {
            device: gpu.name.clone(),
            what: format!(
                "{} rank(s) of {ranks} (each {per_rank} bytes: its shards, the whole embedding table                  and a KV cache of {capacity} positions)",
                if co_resident { ranks } else { 1 }
            ),
            need,
            have: gpu.total_mem as u128,
            place: "device memory",
        });
    }
    Ok(())
}

/// The weight upload (a byte bar; the kernel compiles alongside), then the
/// rest of the compile if the upload did not hide it (a spinner).
struct Bars {
    ui: Ui,
    bar: indicatif::ProgressBar,
}

impl Bars {
    fn new(ui: &Ui) -> Self {
        Bars {
            ui: *ui,
            bar: ui.spinner("preparing the megakernel"),
        }
    }
    fn done(&self) {
        self.bar.finish_and_clear();
    }
}

impl qmk_gpu::Progress for Bars {
    fn begin(&mut self, what: &str, total_bytes: u64) {
        self.bar.finish_and_clear();
        self.bar = self.ui.bytes_bar(total_bytes, what.to_string());
    }
    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
    fn step(&mut self, what: &str) {
        self.bar.finish_and_clear();
        self.bar = self.ui.spinner(what.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H200 here: 150,109,880,320 bytes of device memory.
    fn h200() -> GpuInfo {
        GpuInfo {
            name: "NVIDIA H200".into(),
            total_mem: 150_109_880_320,
            sms: 132,
        }
    }

    #[test]
    fn qwen_72b_fits_at_4096_and_a_long_context_is_refused_with_the_bytes() {
        let c = qmk_model::Config::preset("72b").unwrap();
        // The weights (145.41 GB) stream through pinned buffers: host memory
        // no longer limits them, and 4,096 positions fit the device.
        check_fits(&c, 4096, Some(2048), &h200()).unwrap();
        let e = check_fits(&c, 40_000, Some(2048), &h200()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, GpuError::DoesNotFit { .. }), "{msg}");
        assert!(
            msg.contains("device memory") && msg.contains("150109880320 bytes"),
            "{msg}"
        );
        assert!(msg.contains("145412407296 bytes"), "{msg}");
    }

    #[test]
    fn models_that_fit_pass() {
        for p in ["0.5b", "7b", "14b", "32b", "72b"] {
            let c = qmk_model::Config::preset(p).unwrap();
            check_fits(&c, 4096, Some(2048), &h200()).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
    }
}
