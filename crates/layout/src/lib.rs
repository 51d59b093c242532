//! CuTe-style layouts, byte spans, the kernel's offset model, the split
//! planner, and the rendering of the kernel's `constexpr` plan header.
//!
//! A Qwen2.5 megakernel stacks each weight across layers into one tensor
//! (`[L, N, K]`, the layer as the outer mode) and indexes it with offsets
//! computed in 32-bit arithmetic. Once a stacked tensor spans more than 2^32
//! bytes (14B's `gate_proj` is 6.79 GB) those offsets wrap and the kernel
//! reads through a wild pointer, at a layer this crate can predict. The
//! crate models that arithmetic and chooses split points along the layer
//! axis so that every offset inside every chunk fits, and the kernel keeps
//! its fast 32-bit offsets.
//!
//! The pieces, in the order the data flows:
//!
//! 1. [`Layout`]: shape and stride with CuTe's meanings, [`size`](Layout::size)
//!    (the domain) versus [`cosize`](Layout::cosize) (the codomain, the
//!    largest offset + 1), [`crd2idx`](Layout::crd2idx), and the byte span,
//!    printed as `(48,13824,5120):(70778880,5120,1)`;
//! 2. [`OffsetModel`]: the width and unit of the kernel's offset arithmetic;
//!    [`KERNEL_OFFSET_MODEL`] is the one the kernel is compiled with;
//! 3. [`plan_split`] / [`plan_model`]: the fewest balanced chunks per tensor;
//! 4. [`render_header`]: the plan as C++ `constexpr` constants with
//!    `static_assert`s;
//! 5. [`plan_tensor_parallel`]: every tensor divided among the ranks of a
//!    tensor-parallel group ([`ShardRule`]), each rank's shards planned like
//!    whole tensors.
//!
//! Element counts ([`Elems`]), byte counts ([`Bytes`]) and in-kernel offsets
//! ([`KernelOffset`]) are separate types, and every size or offset is
//! computed with checked arithmetic that reports [`LayoutError::Overflow`].
//!
//! # Worked example: Qwen2.5-14B
//!
//! ```
//! use qmk_layout::{plan_model, render_header, DType, TensorSpec, KERNEL_OFFSET_MODEL};
//!
//! let specs = [
//!     // [L, heads*head_dim, hidden] = 48 x 5120 x 5120 bf16 = 2.52 GB: fits.
//!     TensorSpec::row_major("q_proj", &[48, 5120, 5120], DType::BF16)?,
//!     // [L, inter, hidden] = 48 x 13824 x 5120 bf16 = 6.79 GB: does not.
//!     TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?,
//! ];
//! let plan = plan_model(&specs, &KERNEL_OFFSET_MODEL)?;
//! assert_eq!(plan.tensor("q_proj").unwrap().chunks.len(), 1);
//! let gate = plan.tensor("gate_proj").unwrap();
//! assert_eq!(gate.chunks.len(), 2); // 24 + 24 layers, each 3.40 GB
//! assert_eq!(gate.chunk_of(30), (1, 6));
//!
//! let header = render_header(&plan, &[("kNumLayers", 48)]);
//! assert!(header.contains("namespace gate_proj {"));
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```

#![deny(missing_docs)]

mod error;
mod header;
mod layout;
mod offset;
mod plan;
mod shard;
pub mod tensor_core;
mod units;

pub use error::LayoutError;
pub use header::{check_identifier, render_header, try_render_header, validate_header_inputs};
pub use layout::Layout;
pub use offset::{OffsetModel, OffsetUnit, KERNEL_OFFSET_MODEL};
pub use plan::{
    first_wrapping_slice, max_slices, plan_model, plan_split, Chunk, ModelPlan, TensorPlan,
    TensorSpec,
};
pub use shard::{plan_tensor_parallel, shard_tensor, Shard, ShardRule, ShardedTensor, TpPlan};
pub use tensor_core::{
    TcMachine, TcPlan, TcScratch, TileOrder, TC_MACHINE_SM90, TILE_K, TILE_ROWS,
};
pub use units::{Bytes, DType, Elems, KernelOffset};
