//! The split planner: where to cut a stacked tensor so that every offset the
//! kernel computes inside each piece fits its offset model.
//!
//! A *stacked* tensor has the layer index as its outer mode (axis 0), as
//! `torch.stack` makes it: `[L, N, K]` with layout `(L,N,K):(N*K,K,1)`. The
//! kernel addresses a *chunk*, the slices `[start, end)` along axis 0, from
//! its own base pointer, so a chunk of `n` slices has the layout of the
//! tensor with its outer extent set to `n`
//! ([`Layout::with_outer_extent`]), whatever `start` is.
//!
//! # The plan
//!
//! Because strides are unsigned, a chunk's cosize never decreases as it gains
//! slices, so the chunk lengths that fit are exactly `1..=m` for some largest
//! `m` (found by [`max_slices`]). Then:
//!
//! 1. if one slice does not fit (`m` would be 0), no split along axis 0 can
//!    help: [`LayoutError::SliceTooLarge`];
//! 2. the fewest chunks is `k = ceil(L / m)`: any `k - 1` chunks would leave
//!    one with at least `ceil(L / (k-1)) > m` slices;
//! 3. the chunks are balanced: the first `L mod k` hold `floor(L/k) + 1`
//!    slices and the rest `floor(L/k)`, so lengths differ by at most one, and
//!    the longest, `ceil(L/k)`, is at most `m`, so every chunk fits;
//! 4. the chunks cover `0..L` contiguously, in order, none empty.
//!
//! # Worked example: Qwen2.5-14B `gate_proj` under 32-bit byte offsets
//!
//! One layer is `13824 * 5120 * 2 = 141_557_760` bytes; `2^32 / 141_557_760 =
//! 30.34`, so `m = 30` and the 48 layers need `ceil(48/30) = 2` chunks of 24.
//!
//! ```
//! use qmk_layout::{plan_split, Bytes, DType, TensorSpec, KERNEL_OFFSET_MODEL};
//!
//! let gate = TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?;
//! let plan = plan_split(&gate, &KERNEL_OFFSET_MODEL)?;
//! assert_eq!(plan.chunks.len(), 2);
//! assert_eq!((plan.chunks[0].start, plan.chunks[0].end), (0, 24));
//! assert_eq!((plan.chunks[1].start, plan.chunks[1].end), (24, 48));
//! assert_eq!(plan.chunks[1].byte_span, Bytes(3_397_386_240));
//! // Layer 31 is layer 7 of the second chunk:
//! assert_eq!(plan.chunk_of(31), (1, 7));
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```

use std::collections::BTreeSet;

use serde::ser::{Error as _, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

use crate::header::check_identifier;
use crate::{Bytes, DType, KernelOffset, Layout, LayoutError, OffsetModel};

/// A tensor to plan: its name (as in the checkpoint, e.g. `gate_proj`), its
/// layout in elements, and its dtype. Axis 0 is the stacked (layer) axis.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct TensorSpec {
    /// The tensor's name; it becomes a C++ namespace in the header.
    pub name: String,
    /// The stacked tensor's layout, axis 0 = layers.
    #[serde(flatten)]
    pub layout: Layout,
    /// The element type the kernel reads.
    pub dtype: DType,
}

impl TensorSpec {
    /// A spec from its parts.
    #[must_use]
    pub fn new(name: impl Into<String>, layout: Layout, dtype: DType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            layout,
            dtype,
        }
    }

    /// A contiguous row-major tensor, as `torch.stack` of per-layer matrices
    /// produces.
    pub fn row_major(
        name: impl Into<String>,
        shape: &[u64],
        dtype: DType,
    ) -> Result<TensorSpec, LayoutError> {
        let name = name.into();
        let layout = Layout::row_major(shape).map_err(|e| e.for_tensor(&name))?;
        Ok(TensorSpec::new(name, layout, dtype))
    }

    /// The extent of the stacked axis, `None` at rank 0.
    #[must_use]
    pub fn layers(&self) -> Option<u64> {
        self.layout.shape().first().copied()
    }

    /// The whole tensor's byte span.
    pub fn byte_span(&self) -> Result<Bytes, LayoutError> {
        self.layout
            .byte_span(self.dtype)
            .map_err(|e| e.for_tensor(&self.name))
    }

    /// The outer extent, or the error for a tensor that cannot be stacked.
    fn checked_layers(&self) -> Result<u64, LayoutError> {
        let layers = self.layers().ok_or_else(|| LayoutError::NoStackedAxis {
            tensor: self.name.clone(),
        })?;
        if self.layout.is_empty() {
            return Err(LayoutError::EmptyTensor {
                tensor: self.name.clone(),
                layout: self.layout.to_string(),
            });
        }
        Ok(layers)
    }

    /// The layout of `n` consecutive slices, errors naming this tensor.
    fn slices(&self, n: u64) -> Result<Layout, LayoutError> {
        self.layout
            .with_outer_extent(n)
            .map_err(|e| e.for_tensor(&self.name))
    }
}

/// One piece of a split tensor: slices `start..end` of axis 0 (end
/// exclusive), and the bytes that piece spans from its own base pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// First slice (layer) in the chunk.
    pub start: u64,
    /// One past the last slice.
    pub end: u64,
    /// Byte span of the chunk's layout.
    pub byte_span: Bytes,
}

impl Chunk {
    /// The number of slices in the chunk.
    #[must_use]
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the chunk holds no slice (never so in a plan).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `layer` is in the chunk.
    #[must_use]
    pub fn contains(&self, layer: u64) -> bool {
        (self.start..self.end).contains(&layer)
    }
}

/// A tensor and the chunks it is split into (one chunk when it fits whole).
///
/// Serializes flat, as the CLI's `plan --json` prints it:
/// `{"name", "shape", "stride", "dtype", "byte_span", "chunks": [{"start", "end", "byte_span"}]}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorPlan {
    /// The tensor planned.
    pub spec: TensorSpec,
    /// Its chunks, covering axis 0 in order.
    pub chunks: Vec<Chunk>,
}

impl TensorPlan {
    /// The chunk holding `layer` and the layer's index inside that chunk.
    ///
    /// # Panics
    ///
    /// When `layer` is not below the tensor's layer count, like slice
    /// indexing; [`try_chunk_of`](TensorPlan::try_chunk_of) returns an error
    /// instead.
    #[must_use]
    pub fn chunk_of(&self, layer: u64) -> (usize, u64) {
        match self.try_chunk_of(layer) {
            Ok(found) => found,
            Err(e) => panic!("{e}"),
        }
    }

    /// The chunk holding `layer` and the layer's index inside that chunk, or
    /// [`LayoutError::LayerOutOfRange`].
    pub fn try_chunk_of(&self, layer: u64) -> Result<(usize, u64), LayoutError> {
        // Chunks are sorted and contiguous: the first whose end is past
        // `layer` holds it.
        let c = self.chunks.partition_point(|c| c.end <= layer);
        match self.chunks.get(c) {
            Some(chunk) if chunk.contains(layer) => Ok((c, layer - chunk.start)),
            _ => Err(LayoutError::LayerOutOfRange {
                tensor: self.spec.name.clone(),
                layer,
                layers: self.spec.layers().unwrap_or(0),
            }),
        }
    }

    /// Whether the tensor is split into more than one chunk.
    #[must_use]
    pub fn is_split(&self) -> bool {
        self.chunks.len() > 1
    }

    /// The layout chunk `c` is addressed with from its own base pointer.
    ///
    /// # Panics
    ///
    /// When `c` is not a chunk index.
    pub fn chunk_layout(&self, c: usize) -> Result<Layout, LayoutError> {
        self.spec.slices(self.chunks[c].len())
    }

    /// Where chunk `c` begins inside the stacked tensor, in bytes: the host
    /// forms its base pointer as `base + this` in 64-bit arithmetic.
    ///
    /// # Panics
    ///
    /// When `c` is not a chunk index.
    pub fn chunk_byte_offset(&self, c: usize) -> Result<Bytes, LayoutError> {
        let start = self.chunks[c].start;
        let stride0 = self.spec.layout.stride()[0];
        // Checked: this is the very offset that wraps when computed in 32 bits.
        let elems = start.checked_mul(stride0).ok_or_else(|| {
            LayoutError::overflow(format!(
                "tensor `{}`: element offset of chunk {c} ({start} * {stride0})",
                self.spec.name
            ))
        })?;
        crate::Elems(elems)
            .to_bytes(self.spec.dtype)
            .map_err(|e| e.for_tensor(&self.spec.name))
    }

    /// The offset the kernel computes for coordinate `crd` of the stacked
    /// tensor: the chunk holding `crd[0]` and the offset, in `model`'s unit,
    /// from that chunk's base pointer. `model` should be the one the plan
    /// was made with; the offset then always fits.
    ///
    /// ```
    /// use qmk_layout::{plan_split, DType, KernelOffset, TensorSpec, KERNEL_OFFSET_MODEL};
    /// let gate = TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?;
    /// let plan = plan_split(&gate, &KERNEL_OFFSET_MODEL)?;
    /// // Layer 31, unsplit, sits at byte 4_388_290_560 (> 2^32); split, at
    /// // byte 7 * 141_557_760 of chunk 1.
    /// assert_eq!(
    ///     plan.kernel_offset(&KERNEL_OFFSET_MODEL, &[31, 0, 0])?,
    ///     (1, KernelOffset(990_904_320))
    /// );
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn kernel_offset(
        &self,
        model: &OffsetModel,
        crd: &[u64],
    ) -> Result<(usize, KernelOffset), LayoutError> {
        let name = &self.spec.name;
        let layer = *crd.first().ok_or_else(|| LayoutError::CoordRank {
            layout: self.spec.layout.to_string(),
            rank: self.spec.layout.rank(),
            coord: crd.to_vec(),
        })?;
        let (c, local) = self.try_chunk_of(layer)?;
        let mut local_crd = crd.to_vec();
        local_crd[0] = local;
        let offset = model
            .offset_of(&self.chunk_layout(c)?, self.spec.dtype, &local_crd)
            .map_err(|e| e.for_tensor(name))?;
        let what = format!("tensor `{name}` chunk {c} coordinate {crd:?}");
        let offset = u64::try_from(offset).map_err(|_| {
            LayoutError::overflow(format!("{what}: offset {offset} does not fit 64 bits"))
        })?;
        Ok((c, KernelOffset::new(offset, &what)?))
    }
}

impl Serialize for TensorPlan {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let byte_span = self.spec.byte_span().map_err(S::Error::custom)?;
        let mut s = serializer.serialize_struct("TensorPlan", 6)?;
        s.serialize_field("name", &self.spec.name)?;
        s.serialize_field("shape", self.spec.layout.shape())?;
        s.serialize_field("stride", self.spec.layout.stride())?;
        s.serialize_field("dtype", &self.spec.dtype)?;
        s.serialize_field("byte_span", &byte_span)?;
        s.serialize_field("chunks", &self.chunks)?;
        s.end()
    }
}

/// The most consecutive slices of `spec` along axis 0 that one chunk can
/// hold under `model`, capped at the layer count: the `m` of the module
/// docs.
///
/// Errors: [`LayoutError::NoStackedAxis`] at rank 0,
/// [`LayoutError::EmptyTensor`] for a zero extent,
/// [`LayoutError::SliceTooLarge`] when not even one slice fits,
/// [`LayoutError::InvalidOffsetModel`].
///
/// ```
/// use qmk_layout::{max_slices, DType, TensorSpec, KERNEL_OFFSET_MODEL};
/// let down = TensorSpec::row_major("down_proj", &[80, 8192, 29568], DType::BF16)?;
/// assert_eq!(max_slices(&down, &KERNEL_OFFSET_MODEL)?, 8); // 2^32 / 484_442_112 = 8.87
/// # Ok::<(), qmk_layout::LayoutError>(())
/// ```
pub fn max_slices(spec: &TensorSpec, model: &OffsetModel) -> Result<u64, LayoutError> {
    model.validate()?;
    let layers = spec.checked_layers()?;
    let fits = |n: u64| -> Result<bool, LayoutError> {
        // n <= layers, so the chunk's cosize is at most the tensor's, which
        // the Layout invariant already bounds.
        model
            .fits(&spec.slices(n)?, spec.dtype)
            .map_err(|e| e.for_tensor(&spec.name))
    };
    if !fits(1)? {
        let slice = spec.slices(1)?;
        let units = model.units(&slice, spec.dtype)?;
        return Err(LayoutError::SliceTooLarge {
            tensor: spec.name.clone(),
            slice: slice.to_string(),
            dtype: spec.dtype,
            // u128: cosize < 2^64 and dtype bytes <= 4, so this is exact.
            slice_bytes: u128::from(slice.cosize()?) * u128::from(spec.dtype.size_bytes()),
            // units >= 1: the slice is non-empty.
            max_offset: units - 1,
            model: model.to_string(),
            limit: u128::from(model.max_offset()?),
        });
    }
    if fits(layers)? {
        return Ok(layers);
    }
    // Binary search on the monotone predicate: fits(lo) && !fits(hi).
    let (mut lo, mut hi) = (1u64, layers);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// In the *unsplit* tensor, the first slice along axis 0 that holds an
/// offset `model` cannot represent, i.e. the first layer a kernel reads
/// through a wrapped offset; `None` when the whole tensor fits.
///
/// ```
/// use qmk_layout::{first_wrapping_slice, DType, TensorSpec, KERNEL_OFFSET_MODEL};
/// let gate = TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?;
/// // Layers 0..=29 are safe; layer 30 (the 31st) crosses 2^32 bytes.
/// assert_eq!(first_wrapping_slice(&gate, &KERNEL_OFFSET_MODEL)?, Some(30));
/// # Ok::<(), qmk_layout::LayoutError>(())
/// ```
pub fn first_wrapping_slice(
    spec: &TensorSpec,
    model: &OffsetModel,
) -> Result<Option<u64>, LayoutError> {
    match max_slices(spec, model) {
        Ok(m) if Some(m) == spec.layers() => Ok(None),
        Ok(m) => Ok(Some(m)),
        Err(LayoutError::SliceTooLarge { .. }) => Ok(Some(0)),
        Err(e) => Err(e),
    }
}

/// Splits `spec` along axis 0 into the fewest chunks, balanced to within one
/// slice, such that every offset inside every chunk fits `model` (see the
/// module docs for the argument).
///
/// Errors: those of [`max_slices`], and [`LayoutError::Overflow`] naming the
/// tensor where a chunk's byte span does not fit a `u64`.
pub fn plan_split(spec: &TensorSpec, model: &OffsetModel) -> Result<TensorPlan, LayoutError> {
    let layers = spec.checked_layers()?;
    let m = max_slices(spec, model)?;
    // m >= 1, so k >= 1 and the divisions below are safe; k <= layers.
    let k = layers.div_ceil(m);
    let (base, extra) = (layers / k, layers % k);
    let mut chunks = Vec::new();
    let mut start = 0u64;
    for i in 0..k {
        let len = base + u64::from(i < extra);
        // start + len <= layers: the lengths sum to exactly `layers`.
        let end = start + len;
        let byte_span = spec
            .slices(len)?
            .byte_span(spec.dtype)
            .map_err(|e| e.for_tensor(&spec.name))?;
        chunks.push(Chunk {
            start,
            end,
            byte_span,
        });
        start = end;
    }
    debug_assert_eq!(start, layers);
    Ok(TensorPlan {
        spec: spec.clone(),
        chunks,
    })
}

/// Every stacked tensor of a model, planned under one offset model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ModelPlan {
    /// The model every tensor was planned (and the kernel is compiled) with.
    pub offset_model: OffsetModel,
    /// One plan per tensor, in the order given.
    pub tensors: Vec<TensorPlan>,
}

impl ModelPlan {
    /// The plan of the tensor called `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<&TensorPlan> {
        self.tensors.iter().find(|t| t.spec.name == name)
    }

    /// The tensors split into more than one chunk.
    pub fn split_tensors(&self) -> impl Iterator<Item = &TensorPlan> {
        self.tensors.iter().filter(|t| t.is_split())
    }
}

/// Plans every tensor of `specs` under `model`, in order.
///
/// Besides [`plan_split`]'s errors: [`LayoutError::DuplicateTensor`] for a
/// repeated name and [`LayoutError::InvalidName`] for a name that cannot be
/// a C++ identifier in the rendered header.
///
/// ```
/// use qmk_layout::{plan_model, DType, TensorSpec, KERNEL_OFFSET_MODEL};
/// let specs = [
///     TensorSpec::row_major("q_proj", &[48, 5120, 5120], DType::BF16)?,
///     TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?,
/// ];
/// let plan = plan_model(&specs, &KERNEL_OFFSET_MODEL)?;
/// let chunks: Vec<usize> = plan.tensors.iter().map(|t| t.chunks.len()).collect();
/// assert_eq!(chunks, [1, 2]);
/// # Ok::<(), qmk_layout::LayoutError>(())
/// ```
pub fn plan_model(specs: &[TensorSpec], model: &OffsetModel) -> Result<ModelPlan, LayoutError> {
    model.validate()?;
    let mut seen = BTreeSet::new();
    let mut tensors = Vec::with_capacity(specs.len());
    for spec in specs {
        check_identifier(&spec.name)?;
        if !seen.insert(spec.name.as_str()) {
            return Err(LayoutError::DuplicateTensor {
                tensor: spec.name.clone(),
            });
        }
        tensors.push(plan_split(spec, model)?);
    }
    Ok(ModelPlan {
        offset_model: *model,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{OffsetUnit, KERNEL_OFFSET_MODEL};

    fn gate14() -> TensorSpec {
        TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16).unwrap()
    }

    #[test]
    fn fourteen_b_gate_splits_in_two() {
        let plan = plan_split(&gate14(), &KERNEL_OFFSET_MODEL).unwrap();
        assert_eq!(
            plan.chunks,
            vec![
                Chunk {
                    start: 0,
                    end: 24,
                    byte_span: Bytes(3_397_386_240)
                },
                Chunk {
                    start: 24,
                    end: 48,
                    byte_span: Bytes(3_397_386_240)
                },
            ]
        );
        assert_eq!(max_slices(&gate14(), &KERNEL_OFFSET_MODEL).unwrap(), 30);
        assert_eq!(plan.chunk_of(0), (0, 0));
        assert_eq!(plan.chunk_of(23), (0, 23));
        assert_eq!(plan.chunk_of(24), (1, 0));
        assert_eq!(plan.chunk_of(47), (1, 23));
        assert!(matches!(
            plan.try_chunk_of(48),
            Err(LayoutError::LayerOutOfRange {
                layer: 48,
                layers: 48,
                ..
            })
        ));
        assert_eq!(plan.chunk_byte_offset(1).unwrap(), Bytes(3_397_386_240));
        let last = plan
            .kernel_offset(&KERNEL_OFFSET_MODEL, &[47, 13823, 5119])
            .unwrap();
        assert_eq!(last, (1, KernelOffset(3_397_386_238)));
    }

    #[test]
    #[should_panic(expected = "layer 48 is out of range for tensor `gate_proj` with 48 layers")]
    fn chunk_of_panics_past_the_end() {
        let _ = plan_split(&gate14(), &KERNEL_OFFSET_MODEL)
            .unwrap()
            .chunk_of(48);
    }

    #[test]
    fn json_is_flat() {
        let plan = plan_split(&gate14(), &KERNEL_OFFSET_MODEL).unwrap();
        let json = serde_json::to_string(&plan).unwrap();
        assert_eq!(
            json,
            r#"{"name":"gate_proj","shape":[48,13824,5120],"stride":[70778880,5120,1],"dtype":"bf16","byte_span":6794772480,"chunks":[{"start":0,"end":24,"byte_span":3397386240},{"start":24,"end":48,"byte_span":3397386240}]}"#
        );
        let model = ModelPlan {
            offset_model: KERNEL_OFFSET_MODEL,
            tensors: vec![plan],
        };
        let v: serde_json::Value = serde_json::to_value(&model).unwrap();
        assert_eq!(v["offset_model"]["bits"], 32);
        assert_eq!(v["offset_model"]["unit"], "bytes");
        assert_eq!(v["tensors"][0]["chunks"][1]["start"], 24);
    }

    #[test]
    fn errors_name_the_tensor() {
        let rank0 = TensorSpec::row_major("scale", &[], DType::F32).unwrap();
        let e = plan_split(&rank0, &KERNEL_OFFSET_MODEL).unwrap_err();
        assert!(matches!(e, LayoutError::NoStackedAxis { .. }));
        assert!(e.to_string().contains("`scale`"), "{e}");

        let empty = TensorSpec::row_major("k_proj", &[4, 0, 8], DType::BF16).unwrap();
        let e = plan_split(&empty, &KERNEL_OFFSET_MODEL).unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `k_proj` with layout (4,0,8):(0,8,1) is empty"
        );

        // 152064 x 8192 bf16 = 2.49 GB per slice: fits 32-bit bytes but
        // not signed 31-bit bytes.
        let embed = TensorSpec::row_major("embed", &[1, 152064, 8192], DType::BF16).unwrap();
        assert_eq!(
            plan_split(&embed, &KERNEL_OFFSET_MODEL)
                .unwrap()
                .chunks
                .len(),
            1
        );
        let signed = OffsetModel::new(31, OffsetUnit::Bytes);
        let e = plan_split(&embed, &signed).unwrap_err();
        assert!(matches!(e, LayoutError::SliceTooLarge { .. }));
        assert_eq!(
            e.to_string(),
            "tensor `embed`: one slice (1,152064,8192):(1245708288,8192,1) bf16 alone spans \
             2491416576 bytes; its largest offset, 2491416575 in the model's unit, does not fit \
             31-bit offsets in bytes (largest representable 2147483647); no split along axis 0 \
             can fix this"
        );
        assert_eq!(first_wrapping_slice(&embed, &signed).unwrap(), Some(0));

        let bad = OffsetModel::new(0, OffsetUnit::Bytes);
        assert!(matches!(
            plan_split(&gate14(), &bad),
            Err(LayoutError::InvalidOffsetModel { .. })
        ));
    }

    #[test]
    fn chunk_byte_span_overflow_is_typed_and_named() {
        // 2^62 f32 elements per slice: fits 64-bit element offsets, but its
        // byte span (2^64) does not fit a u64.
        let huge = TensorSpec::row_major("huge", &[2, 1 << 61], DType::F32).unwrap();
        let m = OffsetModel::new(64, OffsetUnit::Elements);
        let e = plan_split(&huge, &m).unwrap_err();
        assert!(matches!(e, LayoutError::Overflow { .. }), "{e}");
        assert!(e.to_string().contains("tensor `huge`"), "{e}");
    }

    #[test]
    fn model_plan_rejects_bad_names() {
        let a = TensorSpec::row_major("q_proj", &[2, 4], DType::BF16).unwrap();
        let e = plan_model(&[a.clone(), a.clone()], &KERNEL_OFFSET_MODEL).unwrap_err();
        assert!(matches!(e, LayoutError::DuplicateTensor { .. }));
        for bad in [
            "model.layers.q_proj",
            "",
            "1x",
            "int",
            "kOffsetBits",
            "__x",
            "_X",
        ] {
            let mut s = a.clone();
            s.name = bad.to_owned();
            assert!(
                matches!(
                    plan_model(&[s], &KERNEL_OFFSET_MODEL),
                    Err(LayoutError::InvalidName { .. })
                ),
                "{bad}"
            );
        }
    }
}
