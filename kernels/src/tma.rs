//! TMA tensor maps and the 2-CTA cluster launch of the prefill kernel
//! (`qmk_prefill_chunk`, the wgmma GEMM on sm_90a), shared by both CUDA
//! backends.
//!
//! - [`tensor_map_specs`]: which bytes each tensor map describes, in the
//!   order the kernel indexes [`PrefillParams::tmaps`]
//!   ([`weight_map_index`], [`act_map_index`]); pure, no driver;
//! - [`ClusterDriver`]: `cuTensorMapEncodeTiled`, `cuLaunchKernelEx` and
//!   `cuOccupancyMaxActiveClusters`, resolved from `libcuda.so.1` at run
//!   time (cust's bindings predate CUDA 12, and one loader for both
//!   backends keeps them from drifting);
//! - [`TensorMapSet`]: every map encoded, as the bytes a backend uploads;
//! - [`PrefillTma`]: the setup both backends run (load, encode, cluster
//!   size), and [`prefill_cluster_size`], the cluster rule.

// `KernelsError` is the kernels crate's one error type; its size is its call.
#![allow(clippy::result_large_err)]

use std::ffi::{c_int, c_void};
use std::mem::size_of;
use std::path::Path;

use qmk_layout::DType;

use crate::error::{KernelsError, Result};
use crate::header::{KernelBuild, PREFILL_WGMMA_TILE};
use crate::host::{cuda_error_name, LaunchInfo};
use crate::params::{KernelParams, PrefillParams};
use crate::Arch;

/// Weight tensors with one tensor map per layer, in the kernel's kind
/// order: map `layer * KINDS + kind` ([`weight_map_index`]). Each is
/// `[L, N, K]` bf16; its map covers one layer's `[N, K]`.
pub const WEIGHT_KINDS: [&str; KINDS] = [
    "q_proj",    // [L, Q, H]
    "k_proj",    // [L, KV, H]
    "v_proj",    // [L, KV, H]
    "o_proj",    // [L, H, Q]
    "gate_proj", // [L, I, H]
    "up_proj",   // [L, I, H]
    "down_proj", // [L, H, I]
];

/// Weight maps per layer ([`WEIGHT_KINDS`]).
pub const KINDS: usize = 7;

/// Activation maps after the `KINDS * L` weight maps, at index
/// `KINDS * L + ACT_*` ([`act_map_index`]): `xa` `[T, max(H, Q)]` bf16 and
/// `hb` `[T, I]` bf16, each with a 64-token and a 128-token box (the
/// kernel's two token tiles).
pub const ACT_XA_64: usize = 0;
/// `xa` with a 128-token box.
pub const ACT_XA_128: usize = 1;
/// `hb` with a 64-token box.
pub const ACT_HB_64: usize = 2;
/// `hb` with a 128-token box.
pub const ACT_HB_128: usize = 3;
/// Activation maps in all.
pub const ACT_MAPS: usize = 4;

/// Columns (K elements) of every box: one 128-byte swizzle row of bf16,
/// the wgmma GEMM's K step.
pub const BOX_K: u32 = PREFILL_WGMMA_TILE.2 as u32;

/// Rows of a weight box: the kernel loads its 256-row weight tile as two
/// 128-row boxes (TMA boxes hold at most 256 rows).
pub const WEIGHT_BOX_ROWS: u32 = 128;

/// Index of the map of `WEIGHT_KINDS[kind]`, layer `layer`.
pub const fn weight_map_index(layer: usize, kind: usize) -> usize {
    layer * KINDS + kind
}

/// Index of activation map `act` (`ACT_*`) of a model with `layers` layers.
pub const fn act_map_index(layers: usize, act: usize) -> usize {
    layers * KINDS + act
}

/// Maps of a model with `layers` layers: `KINDS * layers + ACT_MAPS`.
pub const fn map_count(layers: usize) -> usize {
    layers * KINDS + ACT_MAPS
}

/// One 2-D bf16 tensor map: `dims[1]` rows of `dims[0]` elements,
/// `row_bytes` apart, read in boxes of `box_dims`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMapSpec {
    /// Names the map in errors: `"gate_proj layer 3"`, `"prefill xa (box 64x128)"`.
    pub what: String,
    /// Device address of element (row 0, column 0).
    pub addr: u64,
    /// `{cols (K), rows}`, elements (TMA's dimension 0 is the contiguous one).
    pub dims: [u64; 2],
    /// Bytes from one row to the next (TMA's `globalStrides[0]`).
    pub row_bytes: u64,
    /// `{cols, rows}` of one box, elements.
    pub box_dims: [u32; 2],
}

/// Largest row pitch a tensor map takes (`globalStrides[i] < 2^40`).
pub const MAX_ROW_BYTES: u64 = 1 << 40;

/// Largest extent of one dimension (`globalDim[i] <= 2^32`).
pub const MAX_DIM: u64 = 1 << 32;

impl TensorMapSpec {
    /// Checks what `cuTensorMapEncodeTiled` and the kernel need:
    ///
    /// 1. `addr` is set (non-zero) and a multiple of 16;
    /// 2. `row_bytes` is a multiple of 16 and below [`MAX_ROW_BYTES`];
    /// 3. both `dims` are in `1..=`[`MAX_DIM`];
    /// 4. `dims[0]` (K) is a multiple of [`BOX_K`] (whole K steps);
    /// 5. a row fits its pitch: `dims[0] * 2 <= row_bytes`;
    /// 6. `box_dims[0] * 2` bytes is a multiple of 16 and at most 128 (the
    ///    128-byte swizzle span), `box_dims[1]` is in `1..=256`.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(KernelsError::TensorMap {
                what: self.what.clone(),
                reason,
            })
        };
        if self.addr == 0 || self.addr % 16 != 0 {
            return bad(format!(
                "address {:#x} is not a non-zero multiple of 16",
                self.addr
            ));
        }
        if self.row_bytes % 16 != 0 || self.row_bytes >= MAX_ROW_BYTES {
            return bad(format!(
                "row pitch {} B is not a multiple of 16 below 2^40",
                self.row_bytes
            ));
        }
        for (i, &d) in self.dims.iter().enumerate() {
            if !(1..=MAX_DIM).contains(&d) {
                return bad(format!("dimension {i} = {d} is outside 1..=2^32"));
            }
        }
        if self.dims[0] % u64::from(BOX_K) != 0 {
            return bad(format!(
                "K = {} is not a multiple of {BOX_K} (the wgmma K step)",
                self.dims[0]
            ));
        }
        // dims[0] <= 2^32, so this cannot overflow.
        if self.dims[0] * 2 > self.row_bytes {
            return bad(format!(
                "a row of {} bf16 does not fit its {} B pitch",
                self.dims[0], self.row_bytes
            ));
        }
        let box_bytes = u64::from(self.box_dims[0]) * 2;
        if box_bytes == 0 || box_bytes % 16 != 0 || box_bytes > 128 {
            return bad(format!(
                "box of {} columns is not 16..=128 bytes in steps of 16",
                self.box_dims[0]
            ));
        }
        if !(1..=256).contains(&self.box_dims[1]) {
            return bad(format!(
                "box of {} rows is outside 1..=256",
                self.box_dims[1]
            ));
        }
        Ok(())
    }
}

/// One weight tensor's per-layer addressing, read from the plan and the
/// chunk bases.
struct WeightMaps<'a> {
    name: &'static str,
    plan: &'a qmk_layout::TensorPlan,
    bases: [u64; crate::params::MAX_CHUNKS],
    layer_bytes: u64,
    row_bytes: u64,
    dims: [u64; 2],
}

impl<'a> WeightMaps<'a> {
    fn new(build: &'a KernelBuild, params: &KernelParams, name: &'static str) -> Result<Self> {
        let bad = |reason: String| KernelsError::Plan {
            tensor: name.to_string(),
            reason,
        };
        let plan = build.plan.tensor(name).ok_or_else(|| {
            bad("missing from the model plan (needed for its tensor maps)".into())
        })?;
        let (shape, stride) = (plan.spec.layout.shape(), plan.spec.layout.stride());
        if shape.len() != 3 || stride.len() != 3 {
            return Err(bad(format!(
                "layout {} is not [L, N, K] (tensor maps need rank 3)",
                plan.spec.layout
            )));
        }
        if stride[2] != 1 {
            return Err(bad(format!(
                "layout {} has K stride {}, tensor maps need 1",
                plan.spec.layout, stride[2]
            )));
        }
        if plan.spec.dtype != DType::BF16 {
            return Err(bad(format!(
                "dtype {}, the tensor maps are bf16",
                plan.spec.dtype
            )));
        }
        let layers = build.config.num_hidden_layers as u64;
        if shape[0] != layers {
            return Err(bad(format!("{} layers, the model has {layers}", shape[0])));
        }
        let elem = DType::BF16.size_bytes();
        let overflow = |what: &str| bad(format!("the {what} in bytes overflows 64 bits"));
        let layer_bytes = stride[0]
            .checked_mul(elem)
            .ok_or_else(|| overflow("layer stride"))?;
        let row_bytes = stride[1]
            .checked_mul(elem)
            .ok_or_else(|| overflow("row stride"))?;
        let mut p = *params;
        let bases = *p
            .chunks_mut(name)
            .ok_or_else(|| bad("the parameter block has no chunk slots for it".into()))?;
        Ok(WeightMaps {
            name,
            plan,
            bases,
            layer_bytes,
            row_bytes,
            dims: [shape[2], shape[1]],
        })
    }

    fn spec(&self, layer: u64) -> Result<TensorMapSpec> {
        let bad = |reason: String| KernelsError::Plan {
            tensor: self.name.to_string(),
            reason,
        };
        let (c, local) = self.plan.try_chunk_of(layer)?;
        let base = self.bases.get(c).copied().unwrap_or(0);
        if base == 0 {
            return Err(bad(format!(
                "chunk {c} (layer {layer}) has no device address in the parameter block"
            )));
        }
        let addr = local
            .checked_mul(self.layer_bytes)
            .and_then(|off| base.checked_add(off))
            .ok_or_else(|| bad(format!("the address of layer {layer} overflows 64 bits")))?;
        let spec = TensorMapSpec {
            what: format!("{} layer {layer}", self.name),
            addr,
            dims: self.dims,
            row_bytes: self.row_bytes,
            box_dims: [BOX_K, WEIGHT_BOX_ROWS],
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// Every tensor map of the prefill kernel, in the order it indexes them:
/// for each layer `l`, [`WEIGHT_KINDS`] at `l * KINDS + kind`, each box
/// `{BOX_K, WEIGHT_BOX_ROWS}`; then the activations at `KINDS * L + ACT_*`:
/// `xa` `[T, max(H, Q)]` with boxes `{64, 64}` and `{64, 128}`, `hb`
/// `[T, I]` likewise (T = `scratch.max_tokens`).
///
/// `params` holds the weights' chunk bases (layer `l` of a tensor starts
/// `local_layer * stride[0] * 2` bytes into chunk `try_chunk_of(l)`),
/// `scratch` the prefill buffers. Every spec is validated
/// ([`TensorMapSpec::validate`]).
pub fn tensor_map_specs(
    build: &KernelBuild,
    params: &KernelParams,
    scratch: &PrefillParams,
) -> Result<Vec<TensorMapSpec>> {
    let config = &build.config;
    let layers = config.num_hidden_layers;
    let weights = WEIGHT_KINDS
        .iter()
        .map(|&name| WeightMaps::new(build, params, name))
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(map_count(layers));
    for layer in 0..layers as u64 {
        for w in &weights {
            out.push(w.spec(layer)?);
        }
    }

    let t = u64::from(scratch.max_tokens);
    // xa's pitch is QMK_PF_XA_COLS = max(H, Q) (kernels/cuda/prefill_mma.cuh),
    // as MemoryPlan sizes it.
    let xa_cols = config.hidden_size.max(config.q_dim()) as u64;
    let inter = config.intermediate_size as u64;
    let act = |name: &str, addr: u64, cols: u64, rows: u32| -> Result<TensorMapSpec> {
        let what = format!("prefill {name} (box {BOX_K}x{rows})");
        let row_bytes =
            cols.checked_mul(DType::BF16.size_bytes())
                .ok_or_else(|| KernelsError::TensorMap {
                    what: what.clone(),
                    reason: "the row pitch overflows 64 bits".into(),
                })?;
        let spec = TensorMapSpec {
            what,
            addr,
            dims: [cols, t],
            row_bytes,
            box_dims: [BOX_K, rows],
        };
        spec.validate()?;
        Ok(spec)
    };
    out.push(act("xa", scratch.xa, xa_cols, 64)?);
    out.push(act("xa", scratch.xa, xa_cols, 128)?);
    out.push(act("hb", scratch.hb, inter, 64)?);
    out.push(act("hb", scratch.hb, inter, 128)?);
    debug_assert_eq!(out.len(), map_count(layers));
    Ok(out)
}

/// `CUtensorMap`: 128 opaque bytes. Aligned to 128 (CUDA 13's header; 12's
/// asks 64, which 128 also meets), so a `Vec` of them is a valid array for
/// the device (the kernel indexes it with a 128-byte stride).
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TensorMap(pub [u64; 16]);

/// Bytes of one [`TensorMap`].
pub const TENSOR_MAP_BYTES: usize = size_of::<TensorMap>();

/// A raw `CUfunction`.
pub type CuFunction = *mut c_void;
/// A raw `CUstream` (null: the legacy default stream).
pub type CuStream = *mut c_void;

/// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE`.
pub const CU_LAUNCH_ATTRIBUTE_COOPERATIVE: u32 = 2;
/// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`.
pub const CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: u32 = 4;
/// `CU_TENSOR_MAP_DATA_TYPE_BFLOAT16`.
pub const CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: u32 = 9;
/// `CU_TENSOR_MAP_INTERLEAVE_NONE`.
pub const CU_TENSOR_MAP_INTERLEAVE_NONE: u32 = 0;
/// `CU_TENSOR_MAP_SWIZZLE_128B`: the layout wgmma reads bf16 K-major tiles in.
pub const CU_TENSOR_MAP_SWIZZLE_128B: u32 = 3;
/// `CU_TENSOR_MAP_L2_PROMOTION_L2_256B`.
pub const CU_TENSOR_MAP_L2_PROMOTION_L2_256B: u32 = 3;
/// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`: out-of-bounds elements read as zeros.
pub const CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: u32 = 0;
/// `CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`.
pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: u32 = 720;

/// The value of a [`CuLaunchAttribute`] (`CUlaunchAttributeValue`, a
/// 64-byte union, 8-byte aligned): `cooperative` is word 0, `clusterDim`
/// words 0..3.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuLaunchAttributeValue(pub [u32; 16]);

/// `CUlaunchAttribute`: an id, 4 bytes of padding, the value (72 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CuLaunchAttribute {
    pub id: u32,
    pub pad: [u8; 4],
    pub value: CuLaunchAttributeValue,
}

impl CuLaunchAttribute {
    /// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 1`: every CTA co-resident, grid
    /// sync allowed.
    pub fn cooperative() -> Self {
        let mut value = [0u32; 16];
        value[0] = 1;
        CuLaunchAttribute {
            id: CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
            pad: [0; 4],
            value: CuLaunchAttributeValue(value),
        }
    }

    /// `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = {x, 1, 1}`.
    pub fn cluster(x: u32) -> Self {
        let mut value = [0u32; 16];
        value[..3].copy_from_slice(&[x, 1, 1]);
        CuLaunchAttribute {
            id: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
            pad: [0; 4],
            value: CuLaunchAttributeValue(value),
        }
    }
}

/// `CUlaunchConfig` (56 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuLaunchConfig {
    pub grid_dim_x: u32,
    pub grid_dim_y: u32,
    pub grid_dim_z: u32,
    pub block_dim_x: u32,
    pub block_dim_y: u32,
    pub block_dim_z: u32,
    pub shared_mem_bytes: u32,
    pub h_stream: CuStream,
    pub attrs: *mut CuLaunchAttribute,
    pub num_attrs: u32,
}

impl CuLaunchConfig {
    /// A 1-D launch of `grid` CTAs of `block` threads with `attrs`.
    fn new(
        grid: u32,
        block: u32,
        smem: u32,
        stream: CuStream,
        attrs: &mut [CuLaunchAttribute],
    ) -> Self {
        CuLaunchConfig {
            grid_dim_x: grid,
            grid_dim_y: 1,
            grid_dim_z: 1,
            block_dim_x: block,
            block_dim_y: 1,
            block_dim_z: 1,
            shared_mem_bytes: smem,
            h_stream: stream,
            attrs: attrs.as_mut_ptr(),
            // At most 2 attributes.
            num_attrs: attrs.len() as u32,
        }
    }
}

/// The launch attributes of a launch: cooperative, then the cluster
/// dimension when `cluster > 1`.
fn launch_attrs(cluster: u32, cooperative: bool) -> Vec<CuLaunchAttribute> {
    let mut attrs = Vec::with_capacity(2);
    if cooperative {
        attrs.push(CuLaunchAttribute::cooperative());
    }
    if cluster > 1 {
        attrs.push(CuLaunchAttribute::cluster(cluster));
    }
    attrs
}

type FnEncodeTiled = unsafe extern "C" fn(
    *mut TensorMap,
    u32,         // CUtensorMapDataType
    u32,         // rank
    *mut c_void, // globalAddress
    *const u64,  // globalDim[rank]
    *const u64,  // globalStrides[rank - 1]
    *const u32,  // boxDim[rank]
    *const u32,  // elementStrides[rank]
    u32,         // interleave
    u32,         // swizzle
    u32,         // l2Promotion
    u32,         // oobFill
) -> u32;
type FnLaunchKernelEx = unsafe extern "C" fn(
    *const CuLaunchConfig,
    CuFunction,
    *mut *mut c_void, // kernelParams
    *mut *mut c_void, // extra
) -> u32;
type FnMaxActiveClusters =
    unsafe extern "C" fn(*mut c_int, CuFunction, *const CuLaunchConfig) -> u32;

/// The CUDA 12 driver entry points of TMA and cluster launches, loaded at
/// run time from `libcuda.so.1` (the library cudarc and cust use too: the
/// loader shares one copy per process, so contexts and handles are the
/// backends' own).
pub struct ClusterDriver {
    encode: FnEncodeTiled,
    launch_ex: FnLaunchKernelEx,
    max_clusters: FnMaxActiveClusters,
    // Keeps the function pointers above valid.
    _lib: libloading::Library,
}

impl std::fmt::Debug for ClusterDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterDriver").finish_non_exhaustive()
    }
}

/// The driver library [`ClusterDriver::load`] opens.
pub const LIBCUDA: &str = "libcuda.so.1";

impl ClusterDriver {
    /// Loads [`LIBCUDA`] and resolves the three entry points.
    pub fn load() -> Result<ClusterDriver> {
        Self::load_from(Path::new(LIBCUDA))
    }

    /// Loads the driver from one file or loader name; an error names the
    /// library and the missing entry point.
    pub fn load_from(path: &Path) -> Result<ClusterDriver> {
        let lib_name = path.display().to_string();
        // SAFETY: loading libcuda runs its initialisers, which have no
        // preconditions (the backends load the same library).
        let lib = unsafe { libloading::Library::new(path.as_os_str()) }.map_err(|e| {
            KernelsError::DriverUnavailable {
                lib: lib_name.clone(),
                reason: format!("cannot be loaded: {e}"),
            }
        })?;
        fn sym<T: Copy>(
            lib: &libloading::Library,
            lib_name: &str,
            name: &'static str,
        ) -> Result<T> {
            // SAFETY: T is the documented signature of the driver symbol.
            unsafe { lib.get::<T>(name.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| KernelsError::DriverUnavailable {
                    lib: lib_name.to_string(),
                    reason: format!(
                        "no entry point `{name}` (a driver older than CUDA 12.0?): {e}"
                    ),
                })
        }
        Ok(ClusterDriver {
            encode: sym(&lib, &lib_name, "cuTensorMapEncodeTiled")?,
            launch_ex: sym(&lib, &lib_name, "cuLaunchKernelEx")?,
            max_clusters: sym(&lib, &lib_name, "cuOccupancyMaxActiveClusters")?,
            _lib: lib,
        })
    }

    /// Encodes one validated spec: bf16, rank 2, element strides 1, no
    /// interleave, 128-byte swizzle, 256-byte L2 promotion, zeros out of
    /// bounds. Errors name the map.
    pub fn encode_tiled(&self, spec: &TensorMapSpec) -> Result<TensorMap> {
        spec.validate()?;
        let mut map = TensorMap([0; 16]);
        let strides = [spec.row_bytes];
        let element_strides = [1u32, 1];
        // SAFETY: every pointer is valid for the rank-2 counts the call
        // reads; the global address is only encoded, not dereferenced.
        let code = unsafe {
            (self.encode)(
                &mut map,
                CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                spec.addr as *mut c_void,
                spec.dims.as_ptr(),
                strides.as_ptr(),
                spec.box_dims.as_ptr(),
                element_strides.as_ptr(),
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if code != 0 {
            let (name, desc) = cuda_error_name(code);
            return Err(KernelsError::TensorMap {
                what: spec.what.clone(),
                reason: format!("cuTensorMapEncodeTiled failed: {name} ({code}): {desc}"),
            });
        }
        Ok(map)
    }

    /// Clusters of `cluster` CTAs (`grid` CTAs of `block` threads, `smem`
    /// bytes of dynamic shared memory, cooperative) that can be co-resident.
    ///
    /// # Safety
    /// `func` is a live function of the current context whose dynamic
    /// shared memory attribute allows `smem`.
    pub unsafe fn max_active_clusters(
        &self,
        func: CuFunction,
        grid: u32,
        block: u32,
        smem: u32,
        cluster: u32,
    ) -> Result<u32> {
        let mut attrs = vec![CuLaunchAttribute::cooperative()];
        attrs.push(CuLaunchAttribute::cluster(cluster.max(1)));
        let config = CuLaunchConfig::new(grid, block, smem, std::ptr::null_mut(), &mut attrs);
        let mut n: c_int = 0;
        // SAFETY: per the caller; config and its attributes outlive the call.
        let code = unsafe { (self.max_clusters)(&mut n, func, &config) };
        if code != 0 {
            return Err(KernelsError::DriverCall {
                call: "cuOccupancyMaxActiveClusters",
                code,
            });
        }
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// Launches `func` (`grid` x `block`, `smem` bytes) on `stream` with
    /// one by-value parameter block, cooperatively when `cooperative`, in
    /// clusters of `cluster` CTAs when `cluster > 1`. `Err` is the raw
    /// `CUresult` (e.g. [`CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`]): each
    /// backend maps it to its own error type.
    ///
    /// # Safety
    /// `func` and `stream` are live handles of the current context;
    /// `params` points at the kernel's parameter block (the driver copies
    /// it at launch), every address in it live until the kernel completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        func: CuFunction,
        grid: u32,
        block: u32,
        smem: u32,
        stream: CuStream,
        cluster: u32,
        cooperative: bool,
        params: *mut c_void,
    ) -> std::result::Result<(), u32> {
        let mut attrs = launch_attrs(cluster, cooperative);
        let config = CuLaunchConfig::new(grid, block, smem, stream, &mut attrs);
        let mut args = [params];
        // SAFETY: per the caller; config, attrs and args outlive the call.
        let code =
            unsafe { (self.launch_ex)(&config, func, args.as_mut_ptr(), std::ptr::null_mut()) };
        match code {
            0 => Ok(()),
            e => Err(e),
        }
    }
}

/// Every tensor map of [`tensor_map_specs`], encoded, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMapSet {
    maps: Vec<TensorMap>,
}

impl TensorMapSet {
    /// Encodes `specs` in order; an error names the map at fault.
    pub fn encode(driver: &ClusterDriver, specs: &[TensorMapSpec]) -> Result<TensorMapSet> {
        let maps = specs
            .iter()
            .map(|s| driver.encode_tiled(s))
            .collect::<Result<Vec<_>>>()?;
        Ok(TensorMapSet { maps })
    }

    pub fn maps(&self) -> &[TensorMap] {
        &self.maps
    }

    pub fn len(&self) -> usize {
        self.maps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }

    /// The bytes to upload: `[len, 128]`, map `i` at byte `128 i`.
    pub fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.maps)
    }
}

/// CTAs per cluster of the prefill launch when the TMA path is on: the
/// pair shares (multicasts) its weight tiles.
pub const PREFILL_CLUSTER: u32 = 2;

/// The cluster size of every prefill launch of a `grid`-CTA grid, given
/// the driver's count of co-resident clusters of [`PREFILL_CLUSTER`]:
/// [`PREFILL_CLUSTER`] when (1) the grid is a multiple of it and (2) that
/// many clusters cover the grid (a cooperative launch needs every CTA
/// resident at once); else 1.
pub fn prefill_cluster_size(grid: u32, max_clusters: u32) -> u32 {
    let covered = u64::from(max_clusters) * u64::from(PREFILL_CLUSTER) >= u64::from(grid);
    if grid % PREFILL_CLUSTER == 0 && covered {
        PREFILL_CLUSTER
    } else {
        1
    }
}

/// The prefill kernel's TMA and cluster setup, the same for both backends:
///
/// 1. [`PrefillTma::prepare`] (weights' chunk bases and the prefill scratch
///    set): loads the [`ClusterDriver`] and, on an arch with the wgmma GEMM
///    and a model that fits it, encodes every map;
/// 2. the backend uploads [`PrefillTma::maps`] and sets
///    [`PrefillParams::tmaps`];
/// 3. [`PrefillTma::choose_cluster`]: the cluster size.
///
/// A driver without the entry points is no error: the prefill then runs
/// the mma.sync GEMM through `cuLaunchCooperativeKernel`, and
/// [`PrefillTma::note`] says why.
#[derive(Debug)]
pub struct PrefillTma {
    /// `None`: the driver lacks the entry points.
    pub driver: Option<ClusterDriver>,
    /// The maps to upload; `None`: `tmaps` stays 0 (mma.sync GEMM).
    pub maps: Option<TensorMapSet>,
    /// Why the TMA path or the cluster launch is off, for `bench`.
    pub note: Option<String>,
}

impl PrefillTma {
    /// Step 1 (see the type's docs). Errors: a spec that fails validation
    /// or a map the driver refuses (both name the map or tensor).
    pub fn prepare(
        arch: Arch,
        build: &KernelBuild,
        params: &KernelParams,
        scratch: &PrefillParams,
    ) -> Result<PrefillTma> {
        let driver = match ClusterDriver::load() {
            Ok(d) => d,
            Err(e) => {
                return Ok(PrefillTma {
                    driver: None,
                    maps: None,
                    note: Some(format!(
                        "no TMA, no clusters (cuLaunchCooperativeKernel): {e}"
                    )),
                })
            }
        };
        let why_not = if !arch.has_wgmma() {
            Some(format!("no TMA: {arch} has no wgmma GEMM"))
        } else if build.prefill_smem_bytes_wgmma.is_none() {
            Some(format!(
                "no TMA: the model's K dims are not multiples of {BOX_K} (mma.sync GEMM)"
            ))
        } else {
            None
        };
        let maps = match why_not {
            Some(_) => None,
            None => {
                let specs = tensor_map_specs(build, params, scratch)?;
                Some(TensorMapSet::encode(&driver, &specs)?)
            }
        };
        Ok(PrefillTma {
            driver: Some(driver),
            maps,
            note: why_not,
        })
    }

    /// Step 3: the cluster size of every prefill launch with `launch`'s
    /// shape. Clusters only pay with the TMA path (its multicast), so
    /// without maps, and whenever the driver cannot place the clusters,
    /// it is 1 (and [`PrefillTma::note`] says why).
    ///
    /// # Safety
    /// `func` is the live prefill function, its dynamic shared memory
    /// attribute set to `launch.smem_bytes`.
    pub unsafe fn choose_cluster(&mut self, func: CuFunction, launch: &LaunchInfo) -> u32 {
        let (Some(driver), Some(_)) = (&self.driver, &self.maps) else {
            return 1;
        };
        if launch.grid % PREFILL_CLUSTER != 0 {
            self.note = Some(format!(
                "cluster 1: the grid of {} CTAs is not a multiple of {PREFILL_CLUSTER}",
                launch.grid
            ));
            return 1;
        }
        // SAFETY: per the caller.
        let found = unsafe {
            driver.max_active_clusters(
                func,
                launch.grid,
                launch.block,
                launch.smem_bytes,
                PREFILL_CLUSTER,
            )
        };
        match found {
            Ok(n) => {
                let c = prefill_cluster_size(launch.grid, n);
                if c == 1 {
                    self.note = Some(format!(
                        "cluster 1: {n} clusters of {PREFILL_CLUSTER} fit, the grid of {} CTAs needs {}",
                        launch.grid,
                        launch.grid / PREFILL_CLUSTER
                    ));
                }
                c
            }
            Err(e) => {
                self.note = Some(format!("cluster 1: {e}"));
                1
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use qmk_model::Config;
    use std::mem::{align_of, offset_of};

    /// A parameter block with fake, 4 KiB-aligned chunk bases for every
    /// planned tensor (tensor `i`, chunk `c` at `(i + 1) << 36 | c << 32`)
    /// and a scratch block with `xa`, `hb` set.
    fn fake(build: &KernelBuild, tokens: u32) -> (KernelParams, PrefillParams) {
        let mut params: KernelParams = bytemuck::Zeroable::zeroed();
        for (i, t) in build.plan.tensors.iter().enumerate() {
            if let Some(slots) = params.chunks_mut(&t.spec.name) {
                for (c, slot) in slots.iter_mut().take(t.chunks.len()).enumerate() {
                    *slot = ((i as u64 + 1) << 36) | ((c as u64) << 32);
                }
            }
        }
        let mut scratch: PrefillParams = bytemuck::Zeroable::zeroed();
        scratch.xa = 0x7000_0000;
        scratch.hb = 0x7800_0000;
        scratch.max_tokens = tokens;
        (params, scratch)
    }

    #[test]
    fn specs_follow_the_plan_for_split_tensors() {
        let config = Config::preset("72b").unwrap();
        let build = KernelBuild::new(&config).unwrap();
        let split: Vec<&str> = build
            .plan
            .split_tensors()
            .map(|t| t.spec.name.as_str())
            .collect();
        assert!(split.contains(&"gate_proj"), "{split:?}");
        let (params, scratch) = fake(&build, 2048);
        let specs = tensor_map_specs(&build, &params, &scratch).unwrap();
        let l = config.num_hidden_layers;
        assert_eq!(specs.len(), 7 * l + 4);
        assert_eq!(specs.len(), map_count(l));
        let (h, i, q) = (8192u64, 29568u64, 8192u64);
        // Every layer of every kind: base of its chunk + local layer x the
        // layer stride; dims {K, N}; pitch K x 2.
        for (kind, name) in WEIGHT_KINDS.iter().enumerate() {
            let t = build.plan.tensor(name).unwrap();
            let (n, k) = match *name {
                "q_proj" => (q, h),
                "k_proj" | "v_proj" => (1024, h),
                "o_proj" => (h, q),
                "gate_proj" | "up_proj" => (i, h),
                _ => (h, i),
            };
            let mut p = params;
            let bases = *p.chunks_mut(name).unwrap();
            for layer in 0..l {
                let s = &specs[weight_map_index(layer, kind)];
                let (c, local) = t.chunk_of(layer as u64);
                assert_eq!(s.addr, bases[c] + local * n * k * 2, "{name} {layer}");
                assert_eq!(s.dims, [k, n], "{name}");
                assert_eq!(s.row_bytes, k * 2);
                assert_eq!(s.box_dims, [64, 128]);
                assert_eq!(s.what, format!("{name} layer {layer}"));
            }
        }
        // gate_proj in 10 chunks of 8 layers: layer 8 starts chunk 1,
        // layer 79 is the last of chunk 9.
        let g = build.plan.tensor("gate_proj").unwrap();
        assert_eq!(g.chunks.len(), 10);
        let at = build
            .plan
            .tensors
            .iter()
            .position(|t| t.spec.name == "gate_proj")
            .unwrap() as u64;
        let gate = |layer| &specs[weight_map_index(layer, 4)];
        assert_eq!(gate(7).addr, ((at + 1) << 36) + 7 * i * h * 2);
        assert_eq!(gate(8).addr, ((at + 1) << 36) | 1 << 32);
        assert_eq!(gate(79).addr, (((at + 1) << 36) | 9 << 32) + 7 * i * h * 2);
        // Activations: xa [T, max(H, Q)], hb [T, I].
        let xa = &specs[act_map_index(l, ACT_XA_64)];
        assert_eq!(
            (xa.addr, xa.dims, xa.row_bytes, xa.box_dims),
            (0x7000_0000, [8192, 2048], 8192 * 2, [64, 64])
        );
        assert_eq!(specs[act_map_index(l, ACT_XA_128)].box_dims, [64, 128]);
        let hb = &specs[act_map_index(l, ACT_HB_128)];
        assert_eq!(
            (hb.addr, hb.dims, hb.row_bytes, hb.box_dims),
            (0x7800_0000, [i, 2048], i * 2, [64, 128])
        );
        assert_eq!(specs[act_map_index(l, ACT_HB_64)].box_dims, [64, 64]);
        assert_eq!(
            specs[act_map_index(l, ACT_HB_64)].what,
            "prefill hb (box 64x64)"
        );
    }

    #[test]
    fn small_model_pitch_is_max_of_hidden_and_q() {
        // 0.5B: H = 896, Q = 14 x 64 = 896; 3B: H = 2048, Q = 2048. A
        // config with Q > H shows the max.
        let mut config = Config::preset("0.5b").unwrap();
        config.head_dim = Some(128); // Q = 14 x 128 = 1792 > H
        let build = KernelBuild::new(&config).unwrap();
        let (params, scratch) = fake(&build, 7);
        let specs = tensor_map_specs(&build, &params, &scratch).unwrap();
        let xa = &specs[act_map_index(config.num_hidden_layers, ACT_XA_64)];
        assert_eq!((xa.dims, xa.row_bytes), ([1792, 7], 1792 * 2));
    }

    #[test]
    fn bad_addresses_and_shapes_are_named() {
        let build = KernelBuild::new(&Config::preset("0.5b").unwrap()).unwrap();
        let (mut params, mut scratch) = fake(&build, 64);
        // A misaligned chunk base: the first map of o_proj names it.
        params.o_proj[0] += 8;
        let e = tensor_map_specs(&build, &params, &scratch).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("tensor map o_proj layer 0: address"),
            "{e}"
        );
        params.o_proj[0] -= 8;
        // A chunk with no address.
        params.down_proj[0] = 0;
        let e = tensor_map_specs(&build, &params, &scratch).unwrap_err();
        assert!(e.to_string().contains("down_proj"), "{e}");
        assert!(e.to_string().contains("chunk 0"), "{e}");
        let (params, _) = fake(&build, 64);
        scratch.hb = 0x7800_0004;
        let e = tensor_map_specs(&build, &params, &scratch).unwrap_err();
        assert!(e.to_string().contains("prefill hb (box 64x64)"), "{e}");
        scratch.hb = 0;
        assert!(tensor_map_specs(&build, &params, &scratch).is_err());
        scratch.hb = 0x7800_0000;
        scratch.max_tokens = 0;
        let e = tensor_map_specs(&build, &params, &scratch).unwrap_err();
        assert!(e.to_string().contains("dimension 1 = 0"), "{e}");

        let ok = TensorMapSpec {
            what: "t".into(),
            addr: 0x1000,
            dims: [128, 3],
            row_bytes: 256,
            box_dims: [64, 128],
        };
        ok.validate().unwrap();
        let with = |f: &dyn Fn(&mut TensorMapSpec)| {
            let mut s = ok.clone();
            f(&mut s);
            s.validate().unwrap_err().to_string()
        };
        assert!(with(&|s| s.dims[0] = 96).contains("K = 96"));
        assert!(with(&|s| s.row_bytes = 264).contains("pitch"));
        assert!(with(&|s| s.row_bytes = 1 << 40).contains("pitch"));
        assert!(with(&|s| s.row_bytes = 128).contains("does not fit"));
        assert!(with(&|s| s.dims[1] = (1 << 32) + 1).contains("dimension 1"));
        assert!(with(&|s| s.box_dims = [128, 64]).contains("box"));
        assert!(with(&|s| s.box_dims = [64, 257]).contains("box"));
        assert!(with(&|s| s.addr = 0x1001).contains("address"));
    }

    #[test]
    fn launch_structs_match_cuda_h() {
        assert_eq!(size_of::<TensorMap>(), 128);
        assert_eq!(TENSOR_MAP_BYTES, 128);
        assert_eq!(align_of::<TensorMap>() % 64, 0);
        assert_eq!(size_of::<CuLaunchAttribute>(), 72);
        assert_eq!(align_of::<CuLaunchAttribute>(), 8);
        assert_eq!(offset_of!(CuLaunchAttribute, value), 8);
        assert_eq!(size_of::<CuLaunchConfig>(), 56);
        assert_eq!(offset_of!(CuLaunchConfig, shared_mem_bytes), 24);
        assert_eq!(offset_of!(CuLaunchConfig, h_stream), 32);
        assert_eq!(offset_of!(CuLaunchConfig, attrs), 40);
        assert_eq!(offset_of!(CuLaunchConfig, num_attrs), 48);
        let a = launch_attrs(2, true);
        assert_eq!(a.len(), 2);
        assert_eq!((a[0].id, a[0].value.0[0]), (2, 1));
        assert_eq!((a[1].id, &a[1].value.0[..4]), (4, &[2, 1, 1, 0][..]));
        assert_eq!(launch_attrs(1, true).len(), 1);
        assert!(launch_attrs(0, false).is_empty());
        let set = TensorMapSet {
            maps: vec![TensorMap([1; 16]), TensorMap([2; 16])],
        };
        assert_eq!(set.as_bytes().len(), 256);
        assert_eq!(set.as_bytes()[128..136], 2u64.to_ne_bytes());
    }

    #[test]
    fn cluster_rule() {
        assert_eq!(prefill_cluster_size(132, 66), 2);
        assert_eq!(prefill_cluster_size(132, 70), 2);
        assert_eq!(prefill_cluster_size(132, 65), 1);
        assert_eq!(prefill_cluster_size(131, 100), 1);
        assert_eq!(prefill_cluster_size(264, 132), 2);
        assert_eq!(prefill_cluster_size(2, u32::MAX), 2);
        assert_eq!(prefill_cluster_size(132, 0), 1);
    }

    #[test]
    fn a_library_without_the_entry_points_is_named() {
        let e = ClusterDriver::load_from(Path::new("/nonexistent/libcuda.so.1")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("CUDA driver /nonexistent/libcuda.so.1: cannot be loaded"),
            "{e}"
        );
        // libc loads but has no driver symbols.
        if let Err(e) = ClusterDriver::load_from(Path::new("libc.so.6")) {
            assert!(e.to_string().contains("`cuTensorMapEncodeTiled`"), "{e}");
        }
        // Whatever this machine has, loading never panics.
        let _ = ClusterDriver::load();
    }
}
