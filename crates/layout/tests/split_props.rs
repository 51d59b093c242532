//! Property tests of the split planner over random shapes, strides, dtypes
//! and offset models. Each property is checked with arithmetic written here,
//! from the extreme coordinates of each chunk, not with the planner's own
//! helpers.

use proptest::prelude::*;
use qmk_layout::{
    first_wrapping_slice, plan_split, DType, Layout, LayoutError, OffsetModel, OffsetUnit,
    TensorSpec,
};

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn model() -> impl Strategy<Value = OffsetModel> {
    let unit = prop_oneof![
        Just(OffsetUnit::Bytes),
        Just(OffsetUnit::Elements),
        (0u32..=6).prop_map(|p| OffsetUnit::Vector { bytes: 1 << p }),
    ];
    // Mostly widths where realistic shapes split, sometimes anything.
    let bits = prop_oneof![4 => 16u32..=40, 1 => 1u32..=64];
    (bits, unit).prop_map(|(bits, unit)| OffsetModel::new(bits, unit))
}

/// A stacked layout: row-major, row-major with padded strides, or arbitrary
/// strides.
fn layout() -> impl Strategy<Value = Layout> {
    let shape = (1u64..=200, prop::collection::vec(1u64..=5000, 0..=3))
        .prop_map(|(l, rest)| [vec![l], rest].concat());
    shape.prop_flat_map(|shape| {
        let rank = shape.len();
        let row = Just(Layout::row_major(&shape).unwrap());
        let shape2 = shape.clone();
        let padded = prop::collection::vec(0u64..=64, rank).prop_map(move |pad| {
            let mut stride = vec![0u64; rank];
            let mut run = 1u64;
            for i in (0..rank).rev() {
                stride[i] = run + if i + 1 < rank { pad[i] } else { 0 };
                run = stride[i] * shape2[i];
            }
            Layout::new(shape2.clone(), stride).unwrap()
        });
        let shape3 = shape.clone();
        let free = prop::collection::vec(0u64..=1 << 24, rank)
            .prop_map(move |stride| Layout::new(shape3.clone(), stride).unwrap());
        prop_oneof![row, padded, free]
    })
}

/// The largest offset, in `model`'s unit, of `n` slices of `layout` from
/// their first element: from the extreme coordinate (strides are unsigned,
/// so it is the last one), with the element's last byte counted.
fn extreme_offset(layout: &Layout, dtype: DType, n: u64, model: &OffsetModel) -> u128 {
    let shape = layout.shape();
    let stride = layout.stride();
    let last_elem: u128 = (n - 1) as u128 * stride[0] as u128
        + (1..shape.len())
            .map(|i| (shape[i] - 1) as u128 * stride[i] as u128)
            .sum::<u128>();
    let last_byte = (last_elem + 1) * dtype.size_bytes() as u128 - 1;
    match model.unit {
        OffsetUnit::Bytes => last_byte,
        OffsetUnit::Elements => last_elem,
        OffsetUnit::Vector { bytes } => last_byte / bytes as u128,
    }
}

fn fits(layout: &Layout, dtype: DType, n: u64, model: &OffsetModel) -> bool {
    extreme_offset(layout, dtype, n, model) < 1u128 << model.bits
}

/// The strategies reach every case: plans of one chunk, split plans, and
/// slices too large to split.
#[test]
fn strategies_cover_every_outcome() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut whole, mut split, mut too_large) = (0, 0, 0);
    for _ in 0..4096 {
        let (layout, dtype, model) = (layout(), dtype(), model())
            .new_tree(&mut runner)
            .unwrap()
            .current();
        match plan_split(&TensorSpec::new("w", layout, dtype), &model) {
            Ok(plan) if plan.chunks.len() == 1 => whole += 1,
            Ok(_) => split += 1,
            Err(LayoutError::SliceTooLarge { .. }) => too_large += 1,
            Err(e) => panic!("{e}"),
        }
    }
    println!("whole {whole}, split {split}, too large {too_large}");
    for n in [whole, split, too_large] {
        assert!(
            n > 4096 / 20,
            "whole {whole}, split {split}, too large {too_large}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn plans_are_minimal_balanced_and_fit(layout in layout(), dtype in dtype(), model in model()) {
        let layers = layout.shape()[0];
        let spec = TensorSpec::new("w", layout.clone(), dtype);
        let plan = match plan_split(&spec, &model) {
            Ok(plan) => plan,
            Err(LayoutError::SliceTooLarge { .. }) => {
                prop_assert!(!fits(&layout, dtype, 1, &model));
                prop_assert_eq!(first_wrapping_slice(&spec, &model).unwrap(), Some(0));
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        };
        let k = plan.chunks.len() as u64;
        prop_assert!(k >= 1);

        // The chunks cover 0..layers contiguously, in order, none empty.
        let mut next = 0;
        for c in &plan.chunks {
            prop_assert_eq!(c.start, next);
            prop_assert!(c.end > c.start);
            next = c.end;
        }
        prop_assert_eq!(next, layers);

        // Every chunk fits, and its byte span is its extreme byte + 1.
        let bytes64 = OffsetModel::new(64, OffsetUnit::Bytes);
        for c in &plan.chunks {
            prop_assert!(fits(&layout, dtype, c.len(), &model), "chunk {:?}", c);
            prop_assert_eq!(
                u128::from(c.byte_span.0),
                extreme_offset(&layout, dtype, c.len(), &bytes64) + 1
            );
        }

        // Sizes differ by at most one slice.
        let lens: Vec<u64> = plan.chunks.iter().map(|c| c.len()).collect();
        prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);

        // One fewer chunk could not fit: k-1 chunks leave one with
        // ceil(layers/(k-1)) slices, which does not fit.
        if k > 1 {
            prop_assert!(!fits(&layout, dtype, layers.div_ceil(k - 1), &model));
        }

        // The unsplit tensor first wraps at the first slice count that does
        // not fit.
        let wrap = first_wrapping_slice(&spec, &model).unwrap();
        match wrap {
            None => prop_assert_eq!(k, 1),
            Some(w) => {
                prop_assert!(fits(&layout, dtype, w, &model));
                prop_assert!(!fits(&layout, dtype, w + 1, &model));
            }
        }
    }

    #[test]
    fn chunk_of_agrees_with_the_chunks(layout in layout(), dtype in dtype(), model in model(), pick in any::<u64>()) {
        let spec = TensorSpec::new("w", layout.clone(), dtype);
        if let Ok(plan) = plan_split(&spec, &model) {
            let layers = layout.shape()[0];
            let layer = pick % layers;
            let (c, local) = plan.chunk_of(layer);
            prop_assert!(plan.chunks[c].contains(layer));
            prop_assert_eq!(plan.chunks[c].start + local, layer);
            prop_assert!(plan.try_chunk_of(layers).is_err());
            // The kernel offset of the chunk's last coordinate is its extreme
            // offset, less the element's trailing bytes.
            let mut last: Vec<u64> = layout.shape().iter().map(|&s| s - 1).collect();
            last[0] = plan.chunks[c].end - 1;
            let exact = model
                .offset_of(&plan.chunk_layout(c).unwrap(), dtype, &{
                    let mut l = last.clone();
                    l[0] -= plan.chunks[c].start;
                    l
                })
                .unwrap();
            prop_assert!(exact <= extreme_offset(&layout, dtype, plan.chunks[c].len(), &model));
            if model.bits <= 32 {
                let (kc, off) = plan.kernel_offset(&model, &last).unwrap();
                prop_assert_eq!(kc, c);
                prop_assert_eq!(u128::from(off.0), exact);
            }
        }
    }
}
