//! Exhaustive checks over every small layout: each postcondition is tested
//! over the whole domain, CuTe style.

use qmk_layout::{plan_split, DType, Layout, LayoutError, OffsetModel, OffsetUnit, TensorSpec};

/// Every coordinate of `shape`, first mode fastest (an odometer, written
/// independently of `Layout::idx2crd`).
fn coords(shape: &[u64]) -> Vec<Vec<u64>> {
    if shape.contains(&0) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut c = vec![0u64; shape.len()];
    loop {
        out.push(c.clone());
        let mut i = 0;
        loop {
            if i == shape.len() {
                return out;
            }
            c[i] += 1;
            if c[i] < shape[i] {
                break;
            }
            c[i] = 0;
            i += 1;
        }
    }
}

/// Every tuple of `rank` values drawn from `values`.
fn tuples(values: &[u64], rank: usize) -> Vec<Vec<u64>> {
    (0..rank).fold(vec![Vec::new()], |acc, _| {
        acc.into_iter()
            .flat_map(|t| {
                values.iter().map(move |&v| {
                    let mut t = t.clone();
                    t.push(v);
                    t
                })
            })
            .collect()
    })
}

const EXTENTS: [u64; 5] = [0, 1, 2, 3, 4];
const STRIDES: [u64; 7] = [0, 1, 2, 3, 5, 8, 13];

#[test]
fn every_small_layout_obeys_the_formulas() {
    let mut layouts = 0u64;
    for rank in 0..=3 {
        for shape in tuples(&EXTENTS, rank) {
            let all = coords(&shape);
            for stride in tuples(&STRIDES, rank) {
                layouts += 1;
                let l = Layout::new(shape.clone(), stride.clone()).unwrap();
                assert_eq!(l.rank(), rank);
                assert_eq!(l.size().unwrap(), shape.iter().product::<u64>(), "{l}");
                assert_eq!(l.size().unwrap(), all.len() as u64, "{l}");
                let mut max = None;
                for (i, c) in all.iter().enumerate() {
                    let formula: u64 = c.iter().zip(&stride).map(|(c, d)| c * d).sum();
                    let off = l.crd2idx(c).unwrap();
                    assert_eq!(off, formula, "{l} at {c:?}");
                    // Colexicographic order, as CuTe's layout(i).
                    assert_eq!(&l.idx2crd(i as u64).unwrap(), c, "{l} idx {i}");
                    assert_eq!(l.apply(i as u64).unwrap(), off);
                    max = max.max(Some(off));
                }
                // cosize is the largest offset + 1 (0 when empty).
                assert_eq!(l.cosize().unwrap(), max.map_or(0, |m| m + 1), "{l}");
                for d in DType::ALL {
                    assert_eq!(
                        l.byte_span(d).unwrap().0,
                        l.cosize().unwrap() * d.size_bytes()
                    );
                }
                // Out-of-domain coordinates and indices are errors.
                assert!(l.idx2crd(all.len() as u64).is_err());
                for mode in 0..rank {
                    let mut c = vec![0; rank];
                    c[mode] = shape[mode];
                    assert!(
                        matches!(l.crd2idx(&c), Err(LayoutError::CoordOutOfBounds { .. })),
                        "{l} {c:?}"
                    );
                }
                assert!(matches!(
                    l.crd2idx(&vec![0; rank + 1]),
                    Err(LayoutError::CoordRank { .. })
                ));
                // A chunk's cosize never shrinks as it gains slices: the
                // monotonicity the planner's search relies on.
                if rank > 0 {
                    let mut prev = 0;
                    for n in 0..=6 {
                        let c = l.with_outer_extent(n).unwrap().cosize().unwrap();
                        assert!(c >= prev, "{l} outer {n}");
                        prev = c;
                    }
                }
            }
        }
    }
    assert_eq!(layouts, 1 + 5 * 7 + 25 * 49 + 125 * 343);
}

#[test]
fn compact_layouts_are_bijections_onto_their_cosize() {
    for rank in 0..=4 {
        for shape in tuples(&EXTENTS, rank) {
            let size: u64 = shape.iter().product();
            let row = Layout::row_major(&shape).unwrap();
            let col = Layout::column_major(&shape).unwrap();
            for l in [&row, &col] {
                let mut offs: Vec<u64> = coords(&shape)
                    .iter()
                    .map(|c| l.crd2idx(c).unwrap())
                    .collect();
                offs.sort_unstable();
                assert_eq!(offs, (0..size).collect::<Vec<_>>(), "{l}");
                assert_eq!(l.cosize().unwrap(), size);
            }
            // Column-major visited in colex order is the identity (CuTe's
            // default layout); row-major is the identity in lex order.
            for i in 0..size {
                assert_eq!(col.apply(i).unwrap(), i);
            }
            let mut rev: Vec<Vec<u64>> = coords(&shape.iter().rev().copied().collect::<Vec<_>>());
            for c in &mut rev {
                c.reverse();
            }
            for (i, c) in rev.iter().enumerate() {
                assert_eq!(row.crd2idx(c).unwrap(), i as u64, "{row} {c:?}");
            }
        }
    }
}

/// Every small stacked tensor under every small offset model: the plan is
/// checked against brute force over every coordinate of every chunk.
#[test]
fn every_small_plan_is_right_by_brute_force() {
    let units = [
        OffsetUnit::Bytes,
        OffsetUnit::Elements,
        OffsetUnit::Vector { bytes: 4 },
        OffsetUnit::Vector { bytes: 16 },
    ];
    let mut plans = 0;
    for rank in 1..=3 {
        for shape in tuples(&[1, 2, 3, 5, 7], rank) {
            for stride in tuples(&[0, 1, 3, 7], rank) {
                let layout = Layout::new(shape.clone(), stride).unwrap();
                for dtype in DType::ALL {
                    let spec = TensorSpec::new("t", layout.clone(), dtype);
                    for bits in 1..=8 {
                        for unit in units {
                            let model = OffsetModel::new(bits, unit);
                            check_plan_brute_force(&spec, &model);
                            plans += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(plans > 100_000, "{plans}");
}

/// The largest offset, in the model's unit, over every coordinate of
/// `layout` (brute force); `None` when empty.
fn brute_max_offset(layout: &Layout, dtype: DType, model: &OffsetModel) -> Option<u64> {
    coords(layout.shape())
        .iter()
        .map(|c| {
            let e = layout.crd2idx(c).unwrap();
            // The last byte of the element is the furthest the kernel reads.
            let last_byte = (e + 1) * dtype.size_bytes() - 1;
            match model.unit {
                OffsetUnit::Bytes => last_byte,
                OffsetUnit::Elements => e,
                OffsetUnit::Vector { bytes } => last_byte / u64::from(bytes),
            }
        })
        .max()
}

fn brute_fits(spec: &TensorSpec, n: u64, model: &OffsetModel) -> bool {
    let l = spec.layout.with_outer_extent(n).unwrap();
    brute_max_offset(&l, spec.dtype, model).unwrap() < 1u64 << model.bits
}

fn check_plan_brute_force(spec: &TensorSpec, model: &OffsetModel) {
    let layers = spec.layout.shape()[0];
    let ctx = format!("{} {} under {model}", spec.layout, spec.dtype);
    let plan = match plan_split(spec, model) {
        Ok(plan) => plan,
        Err(LayoutError::SliceTooLarge { .. }) => {
            assert!(!brute_fits(spec, 1, model), "{ctx}: one slice does fit");
            return;
        }
        Err(e) => panic!("{ctx}: {e}"),
    };
    let k = plan.chunks.len() as u64;
    let mut next = 0;
    for chunk in &plan.chunks {
        assert_eq!(chunk.start, next, "{ctx}: not contiguous");
        assert!(chunk.end > chunk.start, "{ctx}: empty chunk");
        next = chunk.end;
        // Every offset inside the chunk, from the chunk's base, fits.
        assert!(
            brute_fits(spec, chunk.len(), model),
            "{ctx}: chunk {chunk:?}"
        );
        let l = spec.layout.with_outer_extent(chunk.len()).unwrap();
        let bytes =
            brute_max_offset(&l, spec.dtype, &OffsetModel::new(64, OffsetUnit::Bytes)).unwrap() + 1;
        assert_eq!(chunk.byte_span.0, bytes, "{ctx}");
    }
    assert_eq!(next, layers, "{ctx}: does not cover");
    let lens: Vec<u64> = plan.chunks.iter().map(|c| c.len()).collect();
    assert!(
        lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1,
        "{ctx}: {lens:?}"
    );
    // One fewer chunk cannot fit: some chunk would hold ceil(L/(k-1)) slices.
    if k > 1 {
        let longest = layers.div_ceil(k - 1);
        assert!(
            !brute_fits(spec, longest, model),
            "{ctx}: {k} chunks, {} would do",
            k - 1
        );
    }
}
