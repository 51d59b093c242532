//! Element types and the three kinds of quantity this crate keeps apart:
//! element counts ([`Elems`]), byte counts ([`Bytes`]) and the offsets the
//! kernel really computes ([`KernelOffset`]).
//!
//! The trap this crate exists for is a unit confusion as much as a width one
//! (an int8 repro tested an element boundary while the real boundary was in
//! bytes), so the three never convert implicitly: element counts become
//! bytes only through a [`DType`], and a kernel offset only through a checked
//! narrowing.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::LayoutError;

/// The element type of a tensor as the kernel stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// bfloat16, 2 bytes.
    BF16,
    /// IEEE half, 2 bytes.
    F16,
    /// IEEE single, 4 bytes.
    F32,
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

    /// Bytes per element.
    ///
    /// ```
    /// use qmk_layout::DType;
    /// assert_eq!(DType::BF16.size_bytes(), 2);
    /// assert_eq!(DType::F32.size_bytes(), 4);
    /// ```
    #[must_use]
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Lower-case name: `"bf16"`, `"f16"`, `"f32"` (also the serde form).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    /// Parses `bf16`, `f16`, `f32` in any case (so safetensors' `BF16` too).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown dtype `{s}` (expected bf16, f16 or f32)"))
    }
}

/// A number of elements (of some dtype not recorded here).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Elems(pub u64);

/// A number of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

/// An offset as the kernel computes it: 32 bits wide, in the unit of
/// [`KERNEL_OFFSET_MODEL`](crate::KERNEL_OFFSET_MODEL). Its arithmetic is
/// checked, so where a `u32` in the kernel would silently wrap, this reports
/// [`LayoutError::Overflow`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct KernelOffset(pub u32);

impl Elems {
    /// `self + rhs`, or [`LayoutError::Overflow`].
    pub fn checked_add(self, rhs: Elems) -> Result<Elems, LayoutError> {
        self.0
            .checked_add(rhs.0)
            .map(Elems)
            .ok_or_else(|| LayoutError::overflow(format!("{self} + {rhs}")))
    }

    /// `self * rhs`, or [`LayoutError::Overflow`].
    pub fn checked_mul(self, rhs: u64) -> Result<Elems, LayoutError> {
        self.0
            .checked_mul(rhs)
            .map(Elems)
            .ok_or_else(|| LayoutError::overflow(format!("{self} * {rhs}")))
    }

    /// The bytes these elements occupy as `dtype`.
    ///
    /// ```
    /// use qmk_layout::{Bytes, DType, Elems};
    /// assert_eq!(Elems(13824 * 5120).to_bytes(DType::BF16)?, Bytes(141_557_760));
    /// # Ok::<(), qmk_layout::LayoutError>(())
    /// ```
    pub fn to_bytes(self, dtype: DType) -> Result<Bytes, LayoutError> {
        self.0
            .checked_mul(dtype.size_bytes())
            .map(Bytes)
            .ok_or_else(|| LayoutError::overflow(format!("{self} of {dtype} in bytes")))
    }
}

impl Bytes {
    /// `self + rhs`, or [`LayoutError::Overflow`].
    pub fn checked_add(self, rhs: Bytes) -> Result<Bytes, LayoutError> {
        self.0
            .checked_add(rhs.0)
            .map(Bytes)
            .ok_or_else(|| LayoutError::overflow(format!("{self} + {rhs}")))
    }

    /// `self * rhs`, or [`LayoutError::Overflow`].
    pub fn checked_mul(self, rhs: u64) -> Result<Bytes, LayoutError> {
        self.0
            .checked_mul(rhs)
            .map(Bytes)
            .ok_or_else(|| LayoutError::overflow(format!("{self} * {rhs}")))
    }

    /// Decimal gigabytes with two decimals, as the design notes write them:
    /// `Bytes(6_794_772_480).gb()` is `"6.79 GB"`.
    ///
    /// ```
    /// assert_eq!(qmk_layout::Bytes(6_794_772_480).gb(), "6.79 GB");
    /// ```
    #[must_use]
    pub fn gb(self) -> String {
        // Integer rounding to hundredths; u128 so the `+ 5e6` cannot overflow.
        let hundredths = (u128::from(self.0) + 5_000_000) / 10_000_000;
        format!("{}.{:02} GB", hundredths / 100, hundredths % 100)
    }
}

impl KernelOffset {
    /// Narrows a wide offset to the kernel's 32 bits, or reports
    /// [`LayoutError::Overflow`] naming `what` (this is the check the kernel
    /// itself never makes).
    pub fn new(value: u64, what: &str) -> Result<KernelOffset, LayoutError> {
        u32::try_from(value).map(KernelOffset).map_err(|_| {
            LayoutError::overflow(format!("{what}: offset {value} does not fit 32 bits"))
        })
    }

    /// `self + rhs`, or [`LayoutError::Overflow`] where the kernel's `u32`
    /// would wrap.
    pub fn checked_add(self, rhs: KernelOffset) -> Result<KernelOffset, LayoutError> {
        self.0
            .checked_add(rhs.0)
            .map(KernelOffset)
            .ok_or_else(|| LayoutError::overflow(format!("kernel offset {self} + {rhs}")))
    }

    /// `self * rhs`, or [`LayoutError::Overflow`] where the kernel's `u32`
    /// would wrap.
    pub fn checked_mul(self, rhs: u32) -> Result<KernelOffset, LayoutError> {
        self.0
            .checked_mul(rhs)
            .map(KernelOffset)
            .ok_or_else(|| LayoutError::overflow(format!("kernel offset {self} * {rhs}")))
    }
}

impl TryFrom<u64> for KernelOffset {
    type Error = LayoutError;

    fn try_from(value: u64) -> Result<Self, Self::Error> {
        KernelOffset::new(value, "kernel offset")
    }
}

impl fmt::Display for Elems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} elements", self.0)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes", self.0)
    }
}

impl fmt::Display for KernelOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(d.name().to_uppercase().parse::<DType>().unwrap(), d);
            assert_eq!(d.to_string(), d.name());
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
        }
        assert!("int8".parse::<DType>().is_err());
    }

    #[test]
    fn checked_newtypes_report_overflow() {
        assert_eq!(Bytes(1).checked_add(Bytes(2)), Ok(Bytes(3)));
        assert!(matches!(
            Bytes(u64::MAX).checked_add(Bytes(1)),
            Err(LayoutError::Overflow { .. })
        ));
        assert!(Bytes(u64::MAX / 2 + 1).checked_mul(2).is_err());
        assert_eq!(Elems(3).checked_mul(4), Ok(Elems(12)));
        assert!(Elems(u64::MAX).checked_add(Elems(1)).is_err());
        assert!(Elems(u64::MAX / 2 + 1).to_bytes(DType::BF16).is_err());
        assert_eq!(Elems(5).to_bytes(DType::F32), Ok(Bytes(20)));
        // The wrap the seed hit: layer 31 of 14B's gate_proj in bytes.
        let layer_bytes = KernelOffset(141_557_760);
        assert!(layer_bytes.checked_mul(30).is_ok());
        assert!(matches!(
            layer_bytes.checked_mul(31),
            Err(LayoutError::Overflow { .. })
        ));
        assert!(KernelOffset(u32::MAX).checked_add(KernelOffset(1)).is_err());
        assert_eq!(
            KernelOffset::try_from(u64::from(u32::MAX)),
            Ok(KernelOffset(u32::MAX))
        );
        let err = KernelOffset::new(1 << 32, "gate_proj layer 31").unwrap_err();
        assert!(err.to_string().contains("gate_proj layer 31"), "{err}");
    }

    #[test]
    fn gigabytes_round() {
        assert_eq!(Bytes(0).gb(), "0.00 GB");
        assert_eq!(Bytes(4_294_967_296).gb(), "4.29 GB");
        assert_eq!(Bytes(10_737_418_240).gb(), "10.74 GB");
        assert_eq!(Bytes(u64::MAX).gb(), "18446744073.71 GB");
    }
}
