//! GPU discovery and the GPU backends, behind one function each.
//!
//! [`probe`] asks the CUDA driver (through cudarc's dynamic loading, so it
//! works on machines without CUDA) whether a device exists. [`open`] builds a
//! GPU backend; it is the single place where the cudarc and cust backends are
//! wired into the CLI.

use std::sync::Arc;

use qmk_engine::BackendKind;
use qmk_model::Weights;

use crate::backend::AnyBackend;
use crate::ui::Ui;

/// The device a GPU backend would run on.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub name: String,
    pub total_mem: usize,
}

/// Why no GPU backend can run here. The message is shown to the user.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU: {0}")]
    NoGpu(String),
    #[error("the {0} backend is not built into this qwen-mk yet")]
    NotBuilt(&'static str),
    #[error("this qwen-mk was built without the cust backend (rebuild with `--features cust`)")]
    NoCustFeature,
    #[error(
        "out of device memory on {device}: the model needs about {need_gib:.2} GiB, the GPU has {have_gib:.2} GiB"
    )]
    OutOfMemory {
        device: String,
        need_gib: f64,
        have_gib: f64,
    },
    #[error("{0}")]
    Other(String),
}

/// Finds CUDA device 0, or says why there is none.
pub fn probe() -> Result<GpuInfo, GpuError> {
    use cudarc::driver::result;
    // SAFETY: only tries to dlopen the driver library; no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoGpu(
            "the NVIDIA driver library (libcuda.so) was not found".to_string(),
        ));
    }
    result::init().map_err(|e| GpuError::NoGpu(format!("CUDA driver init failed: {e}")))?;
    let n = result::device::get_count()
        .map_err(|e| GpuError::NoGpu(format!("cannot count CUDA devices: {e}")))?;
    if n < 1 {
        return Err(GpuError::NoGpu(
            "the CUDA driver reports no device".to_string(),
        ));
    }
    let dev = result::device::get(0)
        .map_err(|e| GpuError::NoGpu(format!("cannot open CUDA device 0: {e}")))?;
    let name = result::device::get_name(dev).unwrap_or_else(|_| "CUDA device 0".to_string());
    // SAFETY: `dev` came from `device::get`.
    let total_mem = unsafe { result::device::total_mem(dev) }.unwrap_or(0);
    Ok(GpuInfo { name, total_mem })
}

/// Builds the GPU backend `kind` over `weights` with a KV cache of
/// `capacity` positions, showing progress for kernel compilation and weight
/// upload through `ui`.
///
/// LEAD: wire `qmk_backend_cudarc` (and, under `#[cfg(feature = "cust")]`,
/// `qmk_backend_cust`) here once their constructors exist: compile/load the
/// cubin under `ui.spinner("compiling the megakernel")`, upload under
/// `ui.bytes_bar(bytes, "uploading weights")`, wrap with
/// `AnyBackend::new(backend)`, and map a CUDA_ERROR_OUT_OF_MEMORY to
/// [`GpuError::OutOfMemory`]. Until then this refuses with a typed error;
/// it never pretends a GPU ran.
pub fn open(
    kind: BackendKind,
    gpu: &GpuInfo,
    weights: &Arc<Weights>,
    capacity: usize,
    ui: &Ui,
) -> Result<AnyBackend, GpuError> {
    let _ = (weights, capacity, ui);
    let need = weights_bytes(weights);
    if gpu.total_mem > 0 && need > gpu.total_mem as u64 {
        return Err(GpuError::OutOfMemory {
            device: gpu.name.clone(),
            need_gib: need as f64 / GIB,
            have_gib: gpu.total_mem as f64 / GIB,
        });
    }
    match kind {
        BackendKind::Cudarc => Err(GpuError::NotBuilt("cudarc")),
        BackendKind::Cust if cfg!(feature = "cust") => Err(GpuError::NotBuilt("cust")),
        BackendKind::Cust => Err(GpuError::NoCustFeature),
        BackendKind::Cpu => Err(GpuError::Other(
            "the CPU backend is not a GPU backend".into(),
        )),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

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
