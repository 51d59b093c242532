//! GPU discovery and the GPU backends, behind one function each.
//!
//! [`probe`] asks the CUDA driver (loaded at run time, so this works on
//! machines without CUDA) whether a device exists. [`open`] builds a GPU
//! backend; it is the single place where the cudarc and cust backends are
//! wired into the CLI.

use std::path::Path;
use std::sync::Arc;

use qmk_engine::BackendKind;
use qmk_model::Weights;

use crate::backend::AnyBackend;
use crate::ui::Ui;

/// The device a GPU backend would run on.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub name: String,
    pub total_mem: u64,
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
        }),
        Err(e) => Err(GpuError::NoGpu(crate::common::flatten(&e))),
    }
}

/// Builds the GPU backend `kind` over `weights` with a KV cache of
/// `capacity` positions (loading `cubin` instead of compiling when given),
/// showing kernel compilation (a spinner) and the weight upload (a byte
/// bar) through `ui`. A request that cannot fit in the device's memory is
/// refused before anything is allocated. `prefill_chunk`: positions per
/// launch of the tensor-core prefill kernel (`None`: one decode step per
/// prompt token).
pub fn open(
    kind: BackendKind,
    gpu: &GpuInfo,
    weights: &Arc<Weights>,
    capacity: usize,
    cubin: Option<&Path>,
    prefill_chunk: Option<u32>,
    ui: &Ui,
) -> Result<AnyBackend, GpuError> {
    let need = weights_bytes(weights) as u128 + kv_bytes(&weights.config, capacity);
    if gpu.total_mem > 0 && need > gpu.total_mem as u128 {
        return Err(GpuError::OutOfMemory {
            device: gpu.name.clone(),
            what: format!("the weights and a KV cache of {capacity} positions"),
            need_gib: need as f64 / GIB,
            have_gib: gpu.total_mem as f64 / GIB,
        });
    }
    match kind {
        BackendKind::Cudarc => {
            let opts = qmk_backend_cudarc::Options {
                capacity,
                cubin: cubin.map(Path::to_path_buf),
                prefill_chunk,
                ..Default::default()
            };
            let mut bars = Bars::new(ui);
            let made = qmk_backend_cudarc::CudarcBackend::new(weights, opts, &mut bars);
            bars.done();
            match made {
                Ok(b) => Ok(AnyBackend::new(b)),
                Err(qmk_backend_cudarc::Error::OutOfMemory {
                    what,
                    needed,
                    available,
                }) => Err(GpuError::OutOfMemory {
                    device: gpu.name.clone(),
                    what,
                    need_gib: needed as f64 / GIB,
                    have_gib: available as f64 / GIB,
                }),
                Err(e) => Err(GpuError::Other(crate::common::flatten(&e))),
            }
        }
        #[cfg(feature = "cust")]
        BackendKind::Cust => {
            let opts = qmk_backend_cust::Options {
                capacity,
                cubin: cubin.map(Path::to_path_buf),
                prefill_chunk,
                ..Default::default()
            };
            let mut bars = CustBars(Bars::new(ui));
            let made = qmk_backend_cust::CustBackend::new(weights, opts, &mut bars);
            bars.0.done();
            match made {
                Ok(b) => Ok(AnyBackend::new(b)),
                Err(qmk_backend_cust::Error::OutOfMemory {
                    what,
                    needed,
                    available,
                }) => Err(GpuError::OutOfMemory {
                    device: gpu.name.clone(),
                    what,
                    need_gib: needed as f64 / GIB,
                    have_gib: available as f64 / GIB,
                }),
                Err(e) => Err(GpuError::Other(crate::common::flatten(&e))),
            }
        }
        #[cfg(not(feature = "cust"))]
        BackendKind::Cust => Err(GpuError::NoCustFeature),
        BackendKind::Cpu => Err(GpuError::Other(
            "the CPU backend is not a GPU backend".into(),
        )),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Refuses, before any weight is loaded, generated or uploaded, a model
/// whose weights + KV cache of `capacity` positions cannot fit the device
/// (`gpu.total_mem`, an upper bound of what a context can allocate), or
/// whose weights cannot be staged in host memory (`host_available`).
/// The message gives the bytes needed and available.
pub fn check_fits(
    config: &qmk_model::Config,
    capacity: usize,
    gpu: &GpuInfo,
    host_available: Option<u128>,
) -> Result<(), GpuError> {
    let weights = qmk_model::weight_bytes(config)
        .map_err(|e| GpuError::Other(e.to_string()))?
        .total
        .0 as u128;
    let kv = kv_bytes(config, capacity);
    let need = weights + kv;
    if gpu.total_mem > 0 && need > gpu.total_mem as u128 {
        return Err(GpuError::DoesNotFit {
            device: gpu.name.clone(),
            what: format!(
                "the weights ({weights} bytes) and a KV cache of {capacity} positions ({kv} bytes)"
            ),
            need,
            have: gpu.total_mem as u128,
            place: "device memory",
        });
    }
    if let Some(avail) = host_available {
        if weights > avail {
            return Err(GpuError::DoesNotFit {
                device: gpu.name.clone(),
                what: "staging the weights in host memory before the upload".into(),
                need: weights,
                have: avail,
                place: "host memory (MemAvailable)",
            });
        }
    }
    Ok(())
}

/// Bytes of a bf16 KV cache: layers x (K + V) x kv_dim x capacity.
fn kv_bytes(c: &qmk_model::Config, capacity: usize) -> u128 {
    c.num_hidden_layers as u128 * 2 * c.kv_dim() as u128 * 2 * capacity as u128
}

/// Kernel compilation (a spinner until the upload starts), then the weight
/// upload (a byte bar).
struct Bars {
    ui: Ui,
    bar: indicatif::ProgressBar,
}

impl Bars {
    fn new(ui: &Ui) -> Self {
        Bars {
            ui: *ui,
            bar: ui.spinner("compiling the megakernel (cached after the first run)"),
        }
    }
    fn begin(&mut self, what: &str, total: u64) {
        self.bar.finish_and_clear();
        self.bar = self.ui.bytes_bar(total, what.to_string());
    }
    fn done(&self) {
        self.bar.finish_and_clear();
    }
}

impl qmk_backend_cudarc::Progress for Bars {
    fn begin(&mut self, what: &str, total_bytes: u64) {
        Bars::begin(self, what, total_bytes);
    }
    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The same bars behind the cust backend's progress trait.
#[cfg(feature = "cust")]
struct CustBars(Bars);

#[cfg(feature = "cust")]
impl qmk_backend_cust::Progress for CustBars {
    fn begin(&mut self, what: &str, total_bytes: u64) {
        self.0.begin(what, total_bytes);
    }
    fn advance(&mut self, bytes: u64) {
        self.0.bar.inc(bytes);
    }
    fn finish(&mut self) {
        self.0.bar.finish_and_clear();
    }
}

fn weights_bytes(w: &Weights) -> u64 {
    let n = w.embed_tokens.len()
        + w.lm_head.as_ref().map_or(0, Vec::len)
        + w.input_layernorm.len()
        + w.q_proj.len()
        + w.q_bias.len()
        + w.k_proj.len()
        + w.k_bias.len()
        + w.v_proj.len()
        + w.v_bias.len()
        + w.o_proj.len()
        + w.post_attention_layernorm.len()
        + w.gate_proj.len()
        + w.up_proj.len()
        + w.down_proj.len()
        + w.norm.len();
    n as u64 * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H200 here: 150,109,880,320 bytes of device memory, and what its
    /// 128 GiB host had available (MemAvailable) in the 2026-11-29 run.
    fn h200() -> GpuInfo {
        GpuInfo {
            name: "NVIDIA H200".into(),
            total_mem: 150_109_880_320,
        }
    }
    const HOST_AVAILABLE: u128 = 134_555_975_680;

    #[test]
    fn qwen_72b_is_refused_before_any_upload_with_bytes_needed_and_available() {
        let c = qmk_model::Config::preset("72b").unwrap();
        // Short context: the weights (145.41 GB) fit the device but cannot be
        // staged in this host's memory.
        let e = check_fits(&c, 4096, &h200(), Some(HOST_AVAILABLE)).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, GpuError::DoesNotFit { .. }), "{msg}");
        assert!(msg.contains("145412407296 bytes"), "{msg}");
        assert!(msg.contains("134555975680 bytes"), "{msg}");
        assert!(msg.contains("host memory"), "{msg}");
        // A long context no longer fits the device itself.
        let e = check_fits(&c, 40_000, &h200(), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("device memory") && e.contains("150109880320 bytes"),
            "{e}"
        );
    }

    #[test]
    fn models_that_fit_pass() {
        for p in ["0.5b", "7b", "14b", "32b"] {
            let c = qmk_model::Config::preset(p).unwrap();
            check_fits(&c, 4096, &h200(), Some(HOST_AVAILABLE))
                .unwrap_or_else(|e| panic!("{p}: {e}"));
        }
    }
}
