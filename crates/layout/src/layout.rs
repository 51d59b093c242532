//! [`Layout`]: a function from coordinates to offsets, as in CuTe.
//!
//! A layout is a pair of tuples, a *shape* `(s0, s1, ..)` and a *stride*
//! `(d0, d1, ..)`, written `(s0,s1,..):(d0,d1,..)`. It maps the coordinate
//! `(c0, c1, ..)`, with `0 <= ci < si`, to the offset
//!
//! ```text
//! crd2idx(c) = c0*d0 + c1*d1 + ..
//! ```
//!
//! counted in elements from the tensor's base pointer. Two numbers describe
//! it, and telling them apart is the point of this crate:
//!
//! 1. **size**, the domain: how many coordinates there are, `s0*s1*..`;
//! 2. **cosize**, the codomain: one past the largest offset,
//!    `1 + (s0-1)*d0 + (s1-1)*d1 + ..` (zero for an empty layout). This is
//!    what memory and offset arithmetic must cover; it is the size only for a
//!    compact layout.
//!
//! Strides are unsigned, so offsets grow with every coordinate and the
//! largest offset is the one of the last coordinate `(s0-1, s1-1, ..)`.
//!
//! # Worked example: Qwen2.5-14B's stacked `gate_proj`
//!
//! 48 layers of a `[13824, 5120]` matrix, row-major:
//!
//! ```
//! use qmk_layout::{Bytes, DType, Layout};
//!
//! let gate = Layout::row_major(&[48, 13824, 5120])?;
//! assert_eq!(gate.to_string(), "(48,13824,5120):(70778880,5120,1)");
//! assert_eq!(gate.size()?, 3_397_386_240);
//! // Compact, so the codomain is the domain:
//! assert_eq!(gate.cosize()?, gate.size()?);
//! // Layer 31's first element, in elements and in bytes:
//! assert_eq!(gate.crd2idx(&[31, 0, 0])?, 2_194_145_280);
//! assert_eq!(gate.crd2idx(&[31, 0, 0])? * 2, 4_388_290_560); // > 2^32: wraps a u32
//! assert_eq!(gate.byte_span(DType::BF16)?, Bytes(6_794_772_480));
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```
//!
//! A strided view has a cosize larger than its size, e.g. the first 64 of
//! every 128 columns of that matrix:
//!
//! ```
//! # use qmk_layout::Layout;
//! let view = Layout::new(vec![4, 64], vec![128, 1])?;
//! assert_eq!(view.size()?, 256);
//! assert_eq!(view.cosize()?, 3 * 128 + 63 + 1);
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{Bytes, DType, Elems, LayoutError};

/// A CuTe layout: `shape` and `stride`, both of rank [`rank`](Layout::rank).
///
/// Invariants, checked by every constructor:
///
/// 1. `shape` and `stride` have the same rank;
/// 2. the cosize, `1 + sum (si-1)*di` for a non-empty layout, fits a `u64`,
///    so [`cosize`](Layout::cosize) never fails and
///    [`crd2idx`](Layout::crd2idx) of an in-bounds coordinate cannot
///    overflow.
///
/// The size (a product of extents) may still overflow a `u64` where strides
/// are 0 (broadcast); [`size`](Layout::size) reports that as an error.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawLayout")]
pub struct Layout {
    shape: Vec<u64>,
    stride: Vec<u64>,
}

/// The unchecked serde form of [`Layout`].
#[derive(Deserialize)]
struct RawLayout {
    shape: Vec<u64>,
    stride: Vec<u64>,
}

impl TryFrom<RawLayout> for Layout {
    type Error = LayoutError;

    fn try_from(raw: RawLayout) -> Result<Self, Self::Error> {
        Layout::new(raw.shape, raw.stride)
    }
}

impl Layout {
    /// A layout from its shape and stride (in elements).
    ///
    /// Errors: [`LayoutError::RankMismatch`] when the ranks differ,
    /// [`LayoutError::Overflow`] when the cosize does not fit a `u64`.
    ///
    /// ```
    /// use qmk_layout::{Layout, LayoutError};
    /// // Column-major 2x3, CuTe's default:
    /// let l = Layout::new(vec![2, 3], vec![1, 2])?;
    /// assert_eq!(l.crd2idx(&[1, 2])?, 5);
    /// assert!(matches!(
    ///     Layout::new(vec![2, 3], vec![1]),
    ///     Err(LayoutError::RankMismatch { .. })
    /// ));
    /// assert!(matches!(
    ///     Layout::new(vec![3], vec![u64::MAX]),
    ///     Err(LayoutError::Overflow { .. })
    /// ));
    /// # Ok::<(), LayoutError>(())
    /// ```
    pub fn new(shape: Vec<u64>, stride: Vec<u64>) -> Result<Layout, LayoutError> {
        if shape.len() != stride.len() {
            return Err(LayoutError::RankMismatch { shape, stride });
        }
        let layout = Layout { shape, stride };
        // Invariant 2: computing the cosize checks the largest offset.
        layout.cosize()?;
        Ok(layout)
    }

    /// The compact row-major layout of `shape` (CuTe's `LayoutRight`): the
    /// last mode has stride 1 and each stride is the product of the extents
    /// after it. This is how `torch.stack` lays out per-layer matrices.
    ///
    /// ```
    /// use qmk_layout::Layout;
    /// let l = Layout::row_major(&[2, 3, 4])?;
    /// assert_eq!(l.stride(), &[12, 4, 1]);
    /// assert_eq!(l.to_string(), "(2,3,4):(12,4,1)");
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn row_major(shape: &[u64]) -> Result<Layout, LayoutError> {
        let mut stride = vec![0; shape.len()];
        let mut running: u64 = 1;
        for (i, &extent) in shape.iter().enumerate().rev() {
            stride[i] = running;
            // Checked: the product of trailing extents is the tensor's size.
            running = running.checked_mul(extent).ok_or_else(|| {
                LayoutError::overflow(format!("row-major strides of shape {shape:?}"))
            })?;
        }
        Layout::new(shape.to_vec(), stride)
    }

    /// The compact column-major layout of `shape` (CuTe's default,
    /// `LayoutLeft`): the first mode has stride 1.
    ///
    /// ```
    /// use qmk_layout::Layout;
    /// assert_eq!(Layout::column_major(&[2, 3, 4])?.stride(), &[1, 2, 6]);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn column_major(shape: &[u64]) -> Result<Layout, LayoutError> {
        let mut stride = Vec::with_capacity(shape.len());
        let mut running: u64 = 1;
        for &extent in shape {
            stride.push(running);
            // Checked: the product of leading extents is the tensor's size.
            running = running.checked_mul(extent).ok_or_else(|| {
                LayoutError::overflow(format!("column-major strides of shape {shape:?}"))
            })?;
        }
        Layout::new(shape.to_vec(), stride)
    }

    /// The number of modes.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The extents, outermost (the stacked axis) first.
    #[must_use]
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The strides, in elements, one per mode.
    #[must_use]
    pub fn stride(&self) -> &[u64] {
        &self.stride
    }

    /// Whether some extent is zero (size 0, cosize 0).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }

    /// The size of the domain: the product of the extents (1 at rank 0).
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// assert_eq!(Layout::row_major(&[48, 13824, 5120])?.size()?, 3_397_386_240);
    /// assert_eq!(Layout::row_major(&[])?.size()?, 1);
    /// // Broadcast (stride 0) layouts can have more coordinates than a u64 counts:
    /// assert!(Layout::new(vec![1 << 40, 1 << 40], vec![0, 0])?.size().is_err());
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn size(&self) -> Result<u64, LayoutError> {
        self.shape.iter().try_fold(1u64, |acc, &extent| {
            // Checked: extents of broadcast layouts are not bounded by memory.
            acc.checked_mul(extent)
                .ok_or_else(|| LayoutError::overflow(format!("size of layout {self}")))
        })
    }

    /// The size of the codomain: the largest offset plus one, or 0 for an
    /// empty layout. This is the number of elements memory must hold, and
    /// what the kernel's offset arithmetic must be wide enough for.
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// // Broadcast along the first mode: 3*4 coordinates, 4 distinct offsets.
    /// let l = Layout::new(vec![3, 4], vec![0, 1])?;
    /// assert_eq!((l.size()?, l.cosize()?), (12, 4));
    /// assert_eq!(Layout::new(vec![3, 0], vec![1, 3])?.cosize()?, 0);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn cosize(&self) -> Result<u64, LayoutError> {
        if self.is_empty() {
            return Ok(0);
        }
        let last: Vec<u64> = self.shape.iter().map(|&s| s - 1).collect();
        let max = self.offset_unchecked_bounds(&last)?;
        // Checked: an offset of u64::MAX would make the cosize 2^64.
        max.checked_add(1)
            .ok_or_else(|| LayoutError::overflow(format!("cosize of layout {self}")))
    }

    /// The offset, in elements, of coordinate `crd`: `sum ci*di`.
    ///
    /// Errors: [`LayoutError::CoordRank`] for a coordinate of the wrong rank,
    /// [`LayoutError::CoordOutOfBounds`] for `ci >= si`.
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// let l = Layout::row_major(&[48, 13824, 5120])?;
    /// assert_eq!(l.crd2idx(&[47, 13823, 5119])?, l.cosize()? - 1);
    /// assert!(l.crd2idx(&[48, 0, 0]).is_err());
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn crd2idx(&self, crd: &[u64]) -> Result<u64, LayoutError> {
        if crd.len() != self.rank() {
            return Err(LayoutError::CoordRank {
                layout: self.to_string(),
                rank: self.rank(),
                coord: crd.to_vec(),
            });
        }
        if let Some((mode, (&value, &extent))) = crd
            .iter()
            .zip(&self.shape)
            .enumerate()
            .find(|(_, (&c, &s))| c >= s)
        {
            return Err(LayoutError::CoordOutOfBounds {
                layout: self.to_string(),
                coord: crd.to_vec(),
                mode,
                value,
                extent,
            });
        }
        self.offset_unchecked_bounds(crd)
    }

    /// `sum ci*di` with checked arithmetic, for a coordinate of the right
    /// rank (bounds are the caller's business).
    fn offset_unchecked_bounds(&self, crd: &[u64]) -> Result<u64, LayoutError> {
        crd.iter()
            .zip(&self.stride)
            .try_fold(0u64, |acc, (&c, &d)| {
                // Checked: this is exactly the sum that wraps in a 32-bit kernel.
                c.checked_mul(d).and_then(|t| acc.checked_add(t))
            })
            .ok_or_else(|| LayoutError::overflow(format!("offset of {crd:?} in layout {self}")))
    }

    /// The coordinate of linear index `idx` in CuTe's colexicographic order
    /// (the first mode varies fastest), the inverse of the compact
    /// column-major layout of this shape.
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// let l = Layout::row_major(&[2, 3])?;
    /// assert_eq!(l.idx2crd(0)?, vec![0, 0]);
    /// assert_eq!(l.idx2crd(1)?, vec![1, 0]);
    /// assert_eq!(l.idx2crd(5)?, vec![1, 2]);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn idx2crd(&self, idx: u64) -> Result<Vec<u64>, LayoutError> {
        let size = self.size()?;
        if idx >= size {
            return Err(LayoutError::IndexOutOfBounds {
                layout: self.to_string(),
                index: idx,
                size,
            });
        }
        // idx < size, so every extent is non-zero and the divisions are safe.
        let mut rest = idx;
        Ok(self
            .shape
            .iter()
            .map(|&s| {
                let c = rest % s;
                rest /= s;
                c
            })
            .collect())
    }

    /// CuTe's `layout(i)`: the offset of the `idx`-th coordinate in
    /// colexicographic order, `crd2idx(idx2crd(idx))`.
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// // Row-major 2x3 visited column by column:
    /// let l = Layout::row_major(&[2, 3])?;
    /// let offsets: Vec<u64> = (0..6).map(|i| l.apply(i)).collect::<Result<_, _>>()?;
    /// assert_eq!(offsets, [0, 3, 1, 4, 2, 5]);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn apply(&self, idx: u64) -> Result<u64, LayoutError> {
        self.crd2idx(&self.idx2crd(idx)?)
    }

    /// The bytes the layout addresses as `dtype`: cosize x element size.
    ///
    /// ```
    /// use qmk_layout::{Bytes, DType, Layout};
    /// let q72 = Layout::row_major(&[80, 8192, 8192])?;
    /// assert_eq!(q72.byte_span(DType::BF16)?, Bytes(10_737_418_240));
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn byte_span(&self, dtype: DType) -> Result<Bytes, LayoutError> {
        Elems(self.cosize()?)
            .to_bytes(dtype)
            .map_err(|_| LayoutError::overflow(format!("byte span of layout {self} as {dtype}")))
    }

    /// The same layout with the outer mode's extent replaced by `extent`:
    /// the layout of `extent` consecutive slices along axis 0, with offsets
    /// relative to the first of them. This is how a chunk of a stacked
    /// tensor is addressed.
    ///
    /// ```
    /// # use qmk_layout::Layout;
    /// let gate = Layout::row_major(&[48, 13824, 5120])?;
    /// assert_eq!(gate.with_outer_extent(24)?.to_string(), "(24,13824,5120):(70778880,5120,1)");
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    ///
    /// Errors: [`LayoutError::CoordRank`] at rank 0, [`LayoutError::Overflow`]
    /// when the new largest offset does not fit a `u64`.
    pub fn with_outer_extent(&self, extent: u64) -> Result<Layout, LayoutError> {
        if self.rank() == 0 {
            return Err(LayoutError::CoordRank {
                layout: self.to_string(),
                rank: 0,
                coord: vec![extent],
            });
        }
        let mut shape = self.shape.clone();
        shape[0] = extent;
        Layout::new(shape, self.stride.clone())
    }
}

impl fmt::Display for Layout {
    /// CuTe notation, `(s0,s1,..):(d0,d1,..)`; rank 0 prints `():()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn tuple(f: &mut fmt::Formatter<'_>, v: &[u64]) -> fmt::Result {
            f.write_str("(")?;
            for (i, x) in v.iter().enumerate() {
                if i > 0 {
                    f.write_str(",")?;
                }
                write!(f, "{x}")?;
            }
            f.write_str(")")
        }
        tuple(f, &self.shape)?;
        f.write_str(":")?;
        tuple(f, &self.stride)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_cute_notation() {
        let l = Layout::row_major(&[48, 13824, 5120]).unwrap();
        assert_eq!(l.to_string(), "(48,13824,5120):(70778880,5120,1)");
        assert_eq!(Layout::row_major(&[7]).unwrap().to_string(), "(7):(1)");
        assert_eq!(Layout::row_major(&[]).unwrap().to_string(), "():()");
    }

    #[test]
    fn rank_zero_is_a_single_point() {
        let l = Layout::row_major(&[]).unwrap();
        assert_eq!(l.rank(), 0);
        assert_eq!(l.size().unwrap(), 1);
        assert_eq!(l.cosize().unwrap(), 1);
        assert_eq!(l.crd2idx(&[]).unwrap(), 0);
        assert_eq!(l.idx2crd(0).unwrap(), Vec::<u64>::new());
        assert!(l.with_outer_extent(1).is_err());
    }

    #[test]
    fn errors_name_the_layout() {
        let l = Layout::row_major(&[2, 3]).unwrap();
        let e = l.crd2idx(&[0, 3]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "coordinate [0, 3] is out of bounds for layout (2,3):(3,1): mode 1 is 3, extent 3"
        );
        let e = l.crd2idx(&[0]).unwrap_err();
        assert!(matches!(e, LayoutError::CoordRank { rank: 2, .. }), "{e}");
        let e = l.idx2crd(6).unwrap_err();
        assert!(e.to_string().contains("(2,3):(3,1)"), "{e}");
    }

    #[test]
    fn overflow_is_typed() {
        // A largest offset of u64::MAX would make the cosize 2^64.
        assert!(matches!(
            Layout::new(vec![2], vec![u64::MAX]),
            Err(LayoutError::Overflow { .. })
        ));
        let l = Layout::new(vec![2], vec![u64::MAX - 1]).unwrap();
        assert_eq!(l.cosize().unwrap(), u64::MAX);
        assert!(Layout::new(vec![3], vec![u64::MAX / 2 + 1]).is_err());
        assert!(Layout::row_major(&[1 << 32, 1 << 32, 2]).is_err());
        assert!(Layout::column_major(&[1 << 32, 1 << 32, 2]).is_err());
        let big = Layout::row_major(&[1 << 62]).unwrap();
        assert!(matches!(
            big.byte_span(DType::F32),
            Err(LayoutError::Overflow { .. })
        ));
        assert!(big.with_outer_extent(1 << 62).is_ok());
        let strided = Layout::new(vec![2, 2], vec![1 << 62, 1]).unwrap();
        assert!(strided.with_outer_extent(5).is_err());
    }

    #[test]
    fn serde_round_trip_validates() {
        let l = Layout::row_major(&[2, 3]).unwrap();
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(json, r#"{"shape":[2,3],"stride":[3,1]}"#);
        assert_eq!(serde_json::from_str::<Layout>(&json).unwrap(), l);
        assert!(serde_json::from_str::<Layout>(r#"{"shape":[2,3],"stride":[1]}"#).is_err());
    }
}
