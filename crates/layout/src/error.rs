//! The crate's one error type.

/// Everything that can go wrong in this crate.
///
/// Messages name the tensor (or, below the planner, the layout in CuTe
/// notation) so that a failure points at the weight that caused it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Size or offset arithmetic left the range of its integer type.
    #[error("arithmetic overflow: {what}")]
    Overflow {
        /// What was being computed, with its operands.
        what: String,
    },

    /// A layout's shape and stride have different ranks.
    #[error("layout shape {shape:?} has rank {} but stride {stride:?} has rank {}", shape.len(), stride.len())]
    RankMismatch {
        /// The shape given.
        shape: Vec<u64>,
        /// The stride given.
        stride: Vec<u64>,
    },

    /// A coordinate has the wrong number of modes for its layout.
    #[error("coordinate {coord:?} has rank {} but layout {layout} has rank {rank}", coord.len())]
    CoordRank {
        /// The layout, in CuTe notation.
        layout: String,
        /// The layout's rank.
        rank: usize,
        /// The coordinate given.
        coord: Vec<u64>,
    },

    /// A coordinate lies outside its layout's shape.
    #[error("coordinate {coord:?} is out of bounds for layout {layout}: mode {mode} is {value}, extent {extent}")]
    CoordOutOfBounds {
        /// The layout, in CuTe notation.
        layout: String,
        /// The coordinate given.
        coord: Vec<u64>,
        /// The first offending mode.
        mode: usize,
        /// That mode's coordinate.
        value: u64,
        /// That mode's extent.
        extent: u64,
    },

    /// A linear index lies outside a layout's domain `[0, size)`.
    #[error("index {index} is out of bounds for layout {layout} of size {size}")]
    IndexOutOfBounds {
        /// The layout, in CuTe notation.
        layout: String,
        /// The index given.
        index: u64,
        /// The layout's size.
        size: u64,
    },

    /// An offset model the kernel could not be compiled with.
    #[error("invalid offset model {bits} bits / {unit}: {reason}")]
    InvalidOffsetModel {
        /// The width given.
        bits: u32,
        /// The unit given, in words.
        unit: String,
        /// Why it is invalid.
        reason: &'static str,
    },

    /// A rank-0 tensor has no outer axis to stack (and split) along.
    #[error("tensor `{tensor}` has rank 0: there is no stacked axis to split along")]
    NoStackedAxis {
        /// The tensor's name.
        tensor: String,
    },

    /// A tensor with a zero extent has nothing to plan.
    #[error("tensor `{tensor}` with layout {layout} is empty")]
    EmptyTensor {
        /// The tensor's name.
        tensor: String,
        /// Its layout, in CuTe notation.
        layout: String,
    },

    /// One slice along the stacked axis is already too large for the offset
    /// model, so no split along that axis can help.
    #[error(
        "tensor `{tensor}`: one slice {slice} {dtype} alone spans {slice_bytes} bytes; \
         its largest offset, {max_offset} in the model's unit, does not fit {model} \
         (largest representable {limit}); no split along axis 0 can fix this"
    )]
    SliceTooLarge {
        /// The tensor's name.
        tensor: String,
        /// The layout of one slice, in CuTe notation.
        slice: String,
        /// The tensor's element type.
        dtype: crate::DType,
        /// The byte span of that one slice (`u128`: it may exceed a `u64`).
        slice_bytes: u128,
        /// The largest offset inside the slice, in the model's unit.
        max_offset: u128,
        /// The offset model, in words.
        model: String,
        /// The largest offset the model can represent.
        limit: u128,
    },

    /// A layer (outer-axis index) outside the tensor.
    #[error("layer {layer} is out of range for tensor `{tensor}` with {layers} layers")]
    LayerOutOfRange {
        /// The tensor's name.
        tensor: String,
        /// The index given.
        layer: u64,
        /// The extent of the outer axis.
        layers: u64,
    },

    /// Two tensors of one model plan share a name.
    #[error("tensor `{tensor}` appears more than once in the model plan")]
    DuplicateTensor {
        /// The repeated name.
        tensor: String,
    },

    /// A name that cannot become a C++ identifier in the rendered header.
    #[error("`{name}` cannot be used in the kernel header: {reason}")]
    InvalidName {
        /// The name given.
        name: String,
        /// Why it is rejected.
        reason: &'static str,
    },

    /// A value the rendered header stores in a narrower C++ type.
    #[error("tensor `{tensor}`: {what} = {value} does not fit the header's `unsigned int`")]
    HeaderRange {
        /// The tensor's name.
        tensor: String,
        /// Which value.
        what: &'static str,
        /// The value.
        value: u64,
    },

    /// A weight phase cannot run on tensor cores as planned (its shape,
    /// the machine it is planned for, or a buffer of tile-order bytes).
    #[error("tensor-core plan of `{tensor}`: {reason}")]
    TensorCore {
        /// The tensor (or phase) at fault.
        tensor: String,
        /// Why.
        reason: String,
    },

    /// A tensor cannot be divided among tensor-parallel ranks as asked.
    #[error("tensor `{tensor}` cannot be sharded: {reason}")]
    Shard {
        /// The tensor's name.
        tensor: String,
        /// Why.
        reason: String,
    },
}

impl LayoutError {
    /// The same error, with the tensor's name put in front of an
    /// [`Overflow`](LayoutError::Overflow) description (other variants
    /// already carry their tensor or layout).
    #[must_use]
    pub fn for_tensor(self, tensor: &str) -> Self {
        match self {
            LayoutError::Overflow { what } => LayoutError::Overflow {
                what: format!("tensor `{tensor}`: {what}"),
            },
            other => other,
        }
    }

    /// Shorthand for an [`Overflow`](LayoutError::Overflow).
    pub(crate) fn overflow(what: impl Into<String>) -> Self {
        LayoutError::Overflow { what: what.into() }
    }
}
