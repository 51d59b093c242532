//! Tensor-parallel sharding: how every stacked tensor is divided among the
//! ranks (GPUs of one host) of a tensor-parallel group, and each rank's own
//! split plan under the offset model.
//!
//! A tensor is either replicated (every rank holds all of it) or split along
//! one axis into equal, contiguous ranges, one per rank, in rank order; the
//! range boundaries fall on multiples of a unit (a head's rows, say), so a
//! rank never holds part of a head. Every rank stores its shard as its own
//! contiguous row-major tensor, and the shards are planned like whole
//! tensors: a rank's shard may still need chunks for the 32-bit offsets.
//!
//! ```
//! use qmk_layout::{plan_tensor_parallel, DType, ShardRule, TensorSpec, KERNEL_OFFSET_MODEL};
//!
//! // 14B's gate_proj [48, 13824, 5120] split by rows over 2 ranks: each rank
//! // holds [48, 6912, 5120] = 3.40 GB, which fits one chunk.
//! let gate = TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?;
//! let tp = plan_tensor_parallel(&[(gate, ShardRule::split(1, 1))], 2, &KERNEL_OFFSET_MODEL)?;
//! let rank1 = tp.rank_plans[1].tensor("gate_proj").unwrap();
//! assert_eq!(rank1.spec.layout.shape(), &[48, 6912, 5120]);
//! assert_eq!(rank1.chunks.len(), 1);
//! assert_eq!(tp.tensors[0].shards[1].range, 6912..13824);
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```

use std::ops::Range;

use serde::Serialize;

use crate::{plan_model, ModelPlan, OffsetModel, TensorSpec};
use crate::{Layout, LayoutError};

/// How one tensor is divided among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ShardRule {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Axis `axis` is cut into one contiguous range per rank, all the same
    /// size, on multiples of `unit` indices.
    Split {
        /// The axis cut (0 = the stacked axis of a layer-stacked tensor).
        axis: usize,
        /// Range boundaries are multiples of this many indices.
        unit: u64,
    },
}

impl ShardRule {
    /// [`ShardRule::Split`] along `axis` on multiples of `unit`.
    #[must_use]
    pub const fn split(axis: usize, unit: u64) -> ShardRule {
        ShardRule::Split { axis, unit }
    }
}

/// One rank's piece of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Shard {
    /// The rank holding it.
    pub rank: u64,
    /// The indices of the cut axis it holds (the whole axis 0 when
    /// replicated).
    pub range: Range<u64>,
    /// The shard as the rank stores it: contiguous, row-major, same name.
    pub spec: TensorSpec,
}

/// A tensor, its rule and its shards in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ShardedTensor {
    /// The whole tensor.
    pub spec: TensorSpec,
    /// How it is divided.
    pub rule: ShardRule,
    /// One shard per rank, in rank order.
    pub shards: Vec<Shard>,
}

impl ShardedTensor {
    /// Every (rank, coordinate in that rank's shard) holding the element at
    /// `coord` of the whole tensor: one for a split tensor, every rank for a
    /// replicated one.
    pub fn locate(&self, coord: &[u64]) -> Result<Vec<(u64, Vec<u64>)>, LayoutError> {
        // Validates rank and bounds against the whole tensor.
        self.spec
            .layout
            .crd2idx(coord)
            .map_err(|e| e.for_tensor(&self.spec.name))?;
        Ok(match self.rule {
            ShardRule::Replicated => self
                .shards
                .iter()
                .map(|s| (s.rank, coord.to_vec()))
                .collect(),
            ShardRule::Split { axis, .. } => self
                .shards
                .iter()
                .filter(|s| s.range.contains(&coord[axis]))
                .map(|s| {
                    let mut c = coord.to_vec();
                    c[axis] -= s.range.start;
                    (s.rank, c)
                })
                .collect(),
        })
    }
}

fn shard_error(spec: &TensorSpec, reason: String) -> LayoutError {
    LayoutError::Shard {
        tensor: spec.name.clone(),
        reason,
    }
}

/// Divides `spec` among `ranks` ranks under `rule`.
///
/// Errors ([`LayoutError::Shard`], naming the tensor): no ranks, an axis
/// the tensor does not have, a zero unit, an extent that is not a whole
/// number of units, or units that do not divide evenly among the ranks.
/// A split tensor must be row-major (as checkpoints and `stacked_specs`
/// make them), so that every shard is a plain sub-block.
pub fn shard_tensor(
    spec: &TensorSpec,
    rule: ShardRule,
    ranks: u64,
) -> Result<ShardedTensor, LayoutError> {
    if ranks == 0 {
        return Err(shard_error(
            spec,
            "a tensor-parallel group needs at least one rank".into(),
        ));
    }
    let shape = spec.layout.shape();
    let shards = match rule {
        ShardRule::Replicated => (0..ranks)
            .map(|rank| Shard {
                rank,
                range: 0..shape.first().copied().unwrap_or(1),
                spec: spec.clone(),
            })
            .collect(),
        ShardRule::Split { axis, unit } => {
            let Some(&extent) = shape.get(axis) else {
                return Err(shard_error(
                    spec,
                    format!(
                        "axis {axis} does not exist in a rank-{} tensor",
                        shape.len()
                    ),
                ));
            };
            if unit == 0 {
                return Err(shard_error(spec, "the split unit is 0".into()));
            }
            if Layout::row_major(shape)? != spec.layout {
                return Err(shard_error(
                    spec,
                    format!(
                        "only a row-major tensor can be split; {} is not",
                        spec.layout
                    ),
                ));
            }
            if extent % unit != 0 {
                return Err(shard_error(
                    spec,
                    format!("axis {axis} has {extent} indices, not a whole number of {unit}-index units"),
                ));
            }
            let units = extent / unit;
            if units % ranks != 0 {
                return Err(shard_error(
                    spec,
                    format!(
                        "axis {axis} holds {units} units of {unit}, which do not divide among {ranks} ranks"
                    ),
                ));
            }
            let per_rank = units / ranks * unit;
            let mut shard_shape = shape.to_vec();
            shard_shape[axis] = per_rank;
            let shard_spec = TensorSpec::row_major(spec.name.clone(), &shard_shape, spec.dtype)?;
            (0..ranks)
                .map(|rank| Shard {
                    rank,
                    range: rank * per_rank..(rank + 1) * per_rank,
                    spec: shard_spec.clone(),
                })
                .collect()
        }
    };
    Ok(ShardedTensor {
        spec: spec.clone(),
        rule,
        shards,
    })
}

/// A model's tensors divided among `ranks` ranks, and each rank's split plan.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct TpPlan {
    /// Ranks in the group.
    pub ranks: u64,
    /// Every tensor with its shards, in the order given.
    pub tensors: Vec<ShardedTensor>,
    /// Rank r's shards planned under the offset model, in the same order.
    pub rank_plans: Vec<ModelPlan>,
}

impl TpPlan {
    /// Bytes rank `rank` holds (every chunk of every shard).
    pub fn rank_bytes(&self, rank: usize) -> Result<u64, LayoutError> {
        let plan = self
            .rank_plans
            .get(rank)
            .ok_or_else(|| LayoutError::Shard {
                tensor: "(tensor-parallel plan)".into(),
                reason: format!("rank {rank} of {}", self.ranks),
            })?;
        plan.tensors
            .iter()
            .flat_map(|t| t.chunks.iter())
            .try_fold(0u64, |acc, c| {
                acc.checked_add(c.byte_span.0)
                    .ok_or_else(|| LayoutError::Overflow {
                        what: format!("rank {rank}'s bytes"),
                    })
            })
    }
}

/// Divides every `(tensor, rule)` among `ranks` ranks and plans each rank's
/// shards under `model` (a rank's shard may still be split into chunks).
pub fn plan_tensor_parallel(
    tensors: &[(TensorSpec, ShardRule)],
    ranks: u64,
    model: &OffsetModel,
) -> Result<TpPlan, LayoutError> {
    let sharded = tensors
        .iter()
        .map(|(spec, rule)| shard_tensor(spec, *rule, ranks))
        .collect::<Result<Vec<_>, _>>()?;
    let rank_plans = (0..ranks)
        .map(|r| {
            let specs: Vec<TensorSpec> = sharded
                .iter()
                .map(|t| t.shards[r as usize].spec.clone())
                .collect();
            plan_model(&specs, model)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TpPlan {
        ranks,
        tensors: sharded,
        rank_plans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, KERNEL_OFFSET_MODEL};

    fn spec(name: &str, shape: &[u64]) -> TensorSpec {
        TensorSpec::row_major(name, shape, DType::BF16).unwrap()
    }

    /// Every element of the whole tensor, located: a split tensor's element
    /// is in exactly one shard, a replicated one in every rank, and no two
    /// elements land on the same shard coordinate.
    fn assert_tiles(t: &ShardedTensor) {
        let shape = t.spec.layout.shape().to_vec();
        let size: u64 = shape.iter().product();
        let mut seen = std::collections::HashSet::new();
        for idx in 0..size {
            let coord = t.spec.layout.idx2crd(idx).unwrap();
            let at = t.locate(&coord).unwrap();
            match t.rule {
                ShardRule::Replicated => assert_eq!(at.len() as u64, t.shards.len() as u64),
                ShardRule::Split { .. } => assert_eq!(at.len(), 1, "{coord:?}"),
            }
            for (rank, c) in at {
                let shard = &t.shards[rank as usize];
                let local = shard.spec.layout.crd2idx(&c).unwrap();
                assert!(
                    seen.insert((rank, local)),
                    "{coord:?} collides at rank {rank}"
                );
            }
        }
        // And every shard element is covered.
        let covered: u64 = t
            .shards
            .iter()
            .map(|s| s.spec.layout.shape().iter().product::<u64>())
            .sum();
        assert_eq!(seen.len() as u64, covered);
    }

    #[test]
    fn splits_and_replicas_tile_every_element() {
        let w = spec("w", &[3, 8, 6]);
        let mut tiled = 0;
        for ranks in [1, 2, 4] {
            for rule in [
                ShardRule::Replicated,
                ShardRule::split(1, 2),
                ShardRule::split(1, 1),
                ShardRule::split(2, 3),
                ShardRule::split(0, 1),
            ] {
                // Some pairs do not divide (6 columns among 4 ranks).
                if let Ok(t) = shard_tensor(&w, rule, ranks) {
                    assert_tiles(&t);
                    tiled += 1;
                }
            }
        }
        assert_eq!(tiled, 12);
        let t = shard_tensor(&w, ShardRule::split(2, 3), 2).unwrap();
        assert_eq!(t.shards[1].range, 3..6);
        assert_eq!(t.shards[1].spec.layout.shape(), &[3, 8, 3]);
        assert_tiles(&t);
        // Axis 0 of a rank-2 table (an LM head split by vocabulary rows).
        let lm = spec("lm_head", &[12, 4]);
        let t = shard_tensor(&lm, ShardRule::split(0, 3), 4).unwrap();
        assert_eq!(t.shards[3].range, 9..12);
        assert_tiles(&t);
    }

    #[test]
    fn a_split_keeps_units_whole_and_ranks_equal() {
        // 4 heads of 16 rows over 2 ranks: 2 heads each.
        let q = spec("q_proj", &[2, 64, 32]);
        let t = shard_tensor(&q, ShardRule::split(1, 16), 2).unwrap();
        assert_eq!(t.shards[0].range, 0..32);
        assert_eq!(t.shards[1].range, 32..64);
        let local = t.locate(&[1, 40, 7]).unwrap();
        assert_eq!(local, vec![(1, vec![1, 8, 7])]);
        // 4 heads do not divide among 3 ranks; 64 rows are not whole 24-row units.
        let e = shard_tensor(&q, ShardRule::split(1, 16), 3).unwrap_err();
        assert!(
            e.to_string().contains("q_proj") && e.to_string().contains("3 ranks"),
            "{e}"
        );
        let e = shard_tensor(&q, ShardRule::split(1, 24), 2).unwrap_err();
        assert!(e.to_string().contains("24-index units"), "{e}");
        let e = shard_tensor(&q, ShardRule::split(3, 1), 2).unwrap_err();
        assert!(e.to_string().contains("axis 3"), "{e}");
        let e = shard_tensor(&q, ShardRule::split(1, 0), 2).unwrap_err();
        assert!(e.to_string().contains("unit is 0"), "{e}");
        let e = shard_tensor(&q, ShardRule::Replicated, 0).unwrap_err();
        assert!(e.to_string().contains("at least one rank"), "{e}");
        let strided = TensorSpec::new(
            "t",
            Layout::new(vec![4, 4], vec![1, 4]).unwrap(),
            DType::BF16,
        );
        let e = shard_tensor(&strided, ShardRule::split(0, 1), 2).unwrap_err();
        assert!(e.to_string().contains("row-major"), "{e}");
    }

    #[test]
    fn each_rank_is_planned_for_the_32_bit_offsets() {
        // 72B's down_proj [80, 8192, 29568] is 38.8 GB: 10 chunks whole.
        // Split by its 29568 input columns over 8 ranks, a shard is 4.85 GB:
        // still over 4 GiB, so each rank needs 2 chunks.
        let down = spec("down_proj", &[80, 8192, 29568]);
        let whole = plan_model(std::slice::from_ref(&down), &KERNEL_OFFSET_MODEL).unwrap();
        assert!(whole.tensors[0].chunks.len() > 2);
        for (ranks, chunks) in [(8u64, 2usize), (2, 5)] {
            let tp = plan_tensor_parallel(
                &[(down.clone(), ShardRule::split(2, 8))],
                ranks,
                &KERNEL_OFFSET_MODEL,
            )
            .unwrap();
            assert_eq!(tp.rank_plans.len() as u64, ranks);
            for plan in &tp.rank_plans {
                let t = plan.tensor("down_proj").unwrap();
                assert_eq!(t.spec.layout.shape(), &[80, 8192, 29568 / ranks]);
                assert_eq!(t.chunks.len(), chunks, "tp {ranks}");
                // Every chunk's offsets fit 32 bits.
                for c in &t.chunks {
                    assert!(c.byte_span.0 <= 1 << 32);
                }
            }
            let total: u64 = (0..ranks as usize).map(|r| tp.rank_bytes(r).unwrap()).sum();
            assert_eq!(total, down.byte_span().unwrap().0);
        }
    }
}
