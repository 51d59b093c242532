//! The offset model: the width and unit of the arithmetic the kernel uses to
//! turn a coordinate into an address.
//!
//! The base pointer is 64-bit and always right; what can wrap is the offset
//! `sum ci*di` added to it. The kernel computes that offset in `bits`-bit
//! unsigned arithmetic, counted in a `unit`: bytes, elements of the tensor's
//! dtype, or vector accesses of N bytes. A tensor (or chunk of one) is safe
//! when its largest offset in that unit is at most `2^bits - 1`, that is when
//! its cosize in that unit is at most `2^bits`:
//!
//! | unit | cosize in the unit |
//! |---|---|
//! | bytes | `cosize_elems * dtype_bytes` (the byte span) |
//! | elements | `cosize_elems` |
//! | vector of N bytes | `ceil(byte span / N)` |
//!
//! A signed 32-bit offset is modelled as `bits: 31`.
//!
//! [`KERNEL_OFFSET_MODEL`] is the one model the megakernel is compiled with:
//! the planner takes its limit from it and the rendered header carries it to
//! the kernel, so the two cannot disagree.
//!
//! ```
//! use qmk_layout::{DType, Layout, KERNEL_OFFSET_MODEL};
//!
//! // 30 layers of 14B's gate_proj fit 32-bit byte offsets, 31 do not
//! // (2^32 / 141_557_760 = 30.34):
//! let gate = Layout::row_major(&[48, 13824, 5120])?;
//! assert!(KERNEL_OFFSET_MODEL.fits(&gate.with_outer_extent(30)?, DType::BF16)?);
//! assert!(!KERNEL_OFFSET_MODEL.fits(&gate.with_outer_extent(31)?, DType::BF16)?);
//! # Ok::<(), qmk_layout::LayoutError>(())
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{DType, Layout, LayoutError};

/// What one step of a kernel offset counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffsetUnit {
    /// Offsets count bytes (`char*` arithmetic, or an element offset scaled
    /// by the element size before the 64-bit add).
    Bytes,
    /// Offsets count elements of the tensor's dtype (`T*` arithmetic).
    Elements,
    /// Offsets count aligned vector accesses of `bytes` bytes (e.g. 16 for
    /// `uint4` loads).
    Vector {
        /// Bytes per vector access; a power of two.
        bytes: u32,
    },
}

/// The width and unit of the kernel's offset arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OffsetModel {
    /// Width of the unsigned offset arithmetic, 1..=64.
    pub bits: u32,
    /// What one step of the offset counts.
    pub unit: OffsetUnit,
}

/// The offset model the megakernel is compiled with: 32-bit byte offsets.
///
/// The planner and [`render_header`](crate::render_header) both read it
/// (through the plan), so the kernel's `kOffsetBits` and the split points
/// come from this one constant.
pub const KERNEL_OFFSET_MODEL: OffsetModel = OffsetModel {
    bits: 32,
    unit: OffsetUnit::Bytes,
};

impl OffsetModel {
    /// A model of `bits`-bit offsets in `unit`.
    #[must_use]
    pub const fn new(bits: u32, unit: OffsetUnit) -> OffsetModel {
        OffsetModel { bits, unit }
    }

    /// Checks the conditions the rest of the crate relies on:
    ///
    /// 1. `1 <= bits <= 64` (offsets are computed in at most 64 bits);
    /// 2. a vector unit is a power of two bytes.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let invalid = |reason| LayoutError::InvalidOffsetModel {
            bits: self.bits,
            unit: self.unit_name(),
            reason,
        };
        if !(1..=64).contains(&self.bits) {
            return Err(invalid("bits must be between 1 and 64"));
        }
        if let OffsetUnit::Vector { bytes } = self.unit {
            if !bytes.is_power_of_two() {
                return Err(invalid("vector bytes must be a power of two"));
            }
        }
        Ok(())
    }

    /// How many distinct offsets the model represents, `2^bits`: the largest
    /// cosize (in the model's unit) that fits. A `u128` because `2^64` is a
    /// valid limit.
    ///
    /// ```
    /// # use qmk_layout::KERNEL_OFFSET_MODEL;
    /// assert_eq!(KERNEL_OFFSET_MODEL.limit()?, 1 << 32);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn limit(&self) -> Result<u128, LayoutError> {
        self.validate()?;
        Ok(1u128 << self.bits)
    }

    /// The largest offset the model represents, `2^bits - 1`.
    pub fn max_offset(&self) -> Result<u64, LayoutError> {
        self.validate()?;
        // bits is in 1..=64, so the shift amount is in 0..=63.
        Ok(u64::MAX >> (64 - self.bits))
    }

    /// The unit as the header encodes it (`kOffsetUnitBytes`): 1 for bytes,
    /// N for vectors of N bytes, and 0 for elements (whose byte size differs
    /// per tensor; the header gives each tensor's `kElemBytes`).
    #[must_use]
    pub fn unit_bytes(&self) -> u32 {
        match self.unit {
            OffsetUnit::Bytes => 1,
            OffsetUnit::Elements => 0,
            OffsetUnit::Vector { bytes } => bytes,
        }
    }

    /// Converts an element offset or count of `dtype` into the model's unit,
    /// rounding up for vectors (so a count covers a partial last vector).
    fn elems_to_units_ceil(&self, elems: u64, dtype: DType) -> u128 {
        // u128: elems < 2^64 and dtype bytes <= 4, so nothing below overflows.
        let bytes = u128::from(elems) * u128::from(dtype.size_bytes());
        match self.unit {
            OffsetUnit::Bytes => bytes,
            OffsetUnit::Elements => u128::from(elems),
            OffsetUnit::Vector { bytes: n } => bytes.div_ceil(u128::from(n)),
        }
    }

    /// The cosize of `layout` as `dtype`, in the model's unit: the number of
    /// offsets the kernel must be able to form (0 for an empty layout).
    ///
    /// ```
    /// use qmk_layout::{DType, Layout, OffsetModel, OffsetUnit};
    /// let l = Layout::row_major(&[3, 5])?; // 15 elements
    /// let units = |unit| OffsetModel::new(32, unit).units(&l, DType::BF16);
    /// assert_eq!(units(OffsetUnit::Bytes)?, 30);
    /// assert_eq!(units(OffsetUnit::Elements)?, 15);
    /// assert_eq!(units(OffsetUnit::Vector { bytes: 16 })?, 2);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn units(&self, layout: &Layout, dtype: DType) -> Result<u128, LayoutError> {
        self.validate()?;
        Ok(self.elems_to_units_ceil(layout.cosize()?, dtype))
    }

    /// Whether every offset of `layout` as `dtype` fits the model: its cosize
    /// in the model's unit is at most `2^bits` (its largest offset at most
    /// `2^bits - 1`).
    pub fn fits(&self, layout: &Layout, dtype: DType) -> Result<bool, LayoutError> {
        Ok(self.units(layout, dtype)? <= self.limit()?)
    }

    /// The exact offset of coordinate `crd` in the model's unit (for a
    /// vector unit, the vector holding the element's first byte), as
    /// infinite-precision arithmetic would compute it.
    ///
    /// ```
    /// use qmk_layout::{DType, Layout, KERNEL_OFFSET_MODEL};
    /// let gate = Layout::row_major(&[48, 13824, 5120])?;
    /// let off = KERNEL_OFFSET_MODEL.offset_of(&gate, DType::BF16, &[31, 0, 0])?;
    /// assert_eq!(off, 4_388_290_560);
    /// // What a 32-bit kernel computes instead: a wild read 93 MB into layer 0.
    /// assert_eq!(KERNEL_OFFSET_MODEL.wrap(off)?, 93_323_264);
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn offset_of(
        &self,
        layout: &Layout,
        dtype: DType,
        crd: &[u64],
    ) -> Result<u128, LayoutError> {
        self.validate()?;
        let elems = layout.crd2idx(crd)?;
        // u128: elems < 2^64 and dtype bytes <= 4.
        let bytes = u128::from(elems) * u128::from(dtype.size_bytes());
        Ok(match self.unit {
            OffsetUnit::Bytes => bytes,
            OffsetUnit::Elements => u128::from(elems),
            OffsetUnit::Vector { bytes: n } => bytes / u128::from(n),
        })
    }

    /// What `bits`-bit unsigned arithmetic makes of `offset`: `offset mod
    /// 2^bits`. The trap, as a function.
    pub fn wrap(&self, offset: u128) -> Result<u64, LayoutError> {
        let max = self.max_offset()?;
        // max = 2^bits - 1 is a mask; the result fits a u64 by construction.
        Ok((offset & u128::from(max)) as u64)
    }

    /// The unit in words, for messages and the header's comments.
    #[must_use]
    pub fn unit_name(&self) -> String {
        match self.unit {
            OffsetUnit::Bytes => "bytes".to_owned(),
            OffsetUnit::Elements => "elements".to_owned(),
            OffsetUnit::Vector { bytes } => format!("{bytes}-byte vectors"),
        }
    }
}

impl fmt::Display for OffsetModel {
    /// `32-bit offsets in bytes`, `31-bit offsets in elements`,
    /// `32-bit offsets in 16-byte vectors`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-bit offsets in {}", self.bits, self.unit_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_model_is_32_bit_bytes() {
        assert_eq!(KERNEL_OFFSET_MODEL.bits, 32);
        assert_eq!(KERNEL_OFFSET_MODEL.unit, OffsetUnit::Bytes);
        assert_eq!(
            KERNEL_OFFSET_MODEL.max_offset().unwrap(),
            u64::from(u32::MAX)
        );
        assert_eq!(KERNEL_OFFSET_MODEL.unit_bytes(), 1);
        assert_eq!(KERNEL_OFFSET_MODEL.to_string(), "32-bit offsets in bytes");
        assert_eq!(
            serde_json::to_string(&KERNEL_OFFSET_MODEL).unwrap(),
            r#"{"bits":32,"unit":"bytes"}"#
        );
        let v = OffsetModel::new(32, OffsetUnit::Vector { bytes: 16 });
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"bits":32,"unit":{"vector":{"bytes":16}}}"#
        );
        assert_eq!(
            serde_json::from_str::<OffsetModel>(r#"{"bits":32,"unit":{"vector":{"bytes":16}}}"#)
                .unwrap(),
            v
        );
    }

    #[test]
    fn invalid_models_are_rejected() {
        for bad in [
            OffsetModel::new(0, OffsetUnit::Bytes),
            OffsetModel::new(65, OffsetUnit::Bytes),
            OffsetModel::new(u32::MAX, OffsetUnit::Elements),
            OffsetModel::new(32, OffsetUnit::Vector { bytes: 0 }),
            OffsetModel::new(32, OffsetUnit::Vector { bytes: 12 }),
        ] {
            assert!(matches!(
                bad.validate(),
                Err(LayoutError::InvalidOffsetModel { .. })
            ));
            assert!(bad.limit().is_err());
            assert!(bad.max_offset().is_err());
        }
    }

    #[test]
    fn limits_at_the_edges() {
        let m1 = OffsetModel::new(1, OffsetUnit::Elements);
        assert_eq!((m1.limit().unwrap(), m1.max_offset().unwrap()), (2, 1));
        let m64 = OffsetModel::new(64, OffsetUnit::Elements);
        assert_eq!(m64.limit().unwrap(), 1u128 << 64);
        assert_eq!(m64.max_offset().unwrap(), u64::MAX);
        assert_eq!(m64.wrap(1u128 << 64).unwrap(), 0);
        // 2^63 f32 elements: fits 64-bit element offsets, not 64-bit byte
        // offsets (2^65 bytes).
        let l = Layout::row_major(&[1 << 32, 1 << 31]).unwrap();
        assert!(m64.fits(&l, DType::F32).unwrap());
        let bytes64 = OffsetModel::new(64, OffsetUnit::Bytes);
        assert!(!bytes64.fits(&l, DType::F32).unwrap());
    }

    #[test]
    fn exactly_two_to_the_bits_fits() {
        // 72B q_proj: 32 layers of 8192x8192 bf16 are exactly 2^32 bytes.
        let q = Layout::row_major(&[32, 8192, 8192]).unwrap();
        assert_eq!(KERNEL_OFFSET_MODEL.units(&q, DType::BF16).unwrap(), 1 << 32);
        assert!(KERNEL_OFFSET_MODEL.fits(&q, DType::BF16).unwrap());
        let q33 = q.with_outer_extent(33).unwrap();
        assert!(!KERNEL_OFFSET_MODEL.fits(&q33, DType::BF16).unwrap());
        // The last byte of the 32 layers is offset 2^32 - 1:
        let last = KERNEL_OFFSET_MODEL
            .offset_of(&q, DType::BF16, &[31, 8191, 8191])
            .unwrap();
        assert_eq!(last + 1, (1 << 32) - 1); // first byte of the last element
    }
}
