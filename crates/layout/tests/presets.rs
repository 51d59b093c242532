//! Every Qwen2.5 preset under 32-bit byte offsets (the kernel's model): how
//! many chunks each stacked tensor needs, checked against the hand-computed
//! table, an independent closed form, and the extreme coordinates of every
//! chunk.

mod common;

use common::{preset, stacked_specs, PRESETS};
use qmk_layout::{
    first_wrapping_slice, plan_model, plan_split, DType, LayoutError, TensorSpec,
    KERNEL_OFFSET_MODEL,
};

/// Expected chunk count, by hand: 0.5B to 7B never split; 14B's gate/up/down
/// (6.79 GB) split in 2; 32B's (13.59 GB, 15 layers per 2^32) in 5; 72B's
/// (38.76 GB, 8 layers per 2^32) in 10 and q/o (10.74 GB, 32 layers exactly
/// fill 2^32) in 3.
fn expected_chunks(preset: &str, tensor: &str) -> usize {
    match (preset, tensor) {
        ("14B", "gate_proj" | "up_proj" | "down_proj") => 2,
        ("32B", "gate_proj" | "up_proj" | "down_proj") => 5,
        ("72B", "gate_proj" | "up_proj" | "down_proj") => 10,
        ("72B", "q_proj" | "o_proj") => 3,
        _ => 1,
    }
}

/// The closed form, computed independently of the planner: `m = floor(2^32 /
/// slice bytes)` layers fit, so `ceil(L / m)` chunks are needed.
fn closed_form_chunks(spec: &TensorSpec) -> u64 {
    let shape = spec.layout.shape();
    let slice_bytes: u128 = shape[1..].iter().map(|&x| u128::from(x)).product::<u128>() * 2;
    let per_chunk = (1u128 << 32) / slice_bytes;
    let layers = u128::from(shape[0]);
    u64::try_from(layers.div_ceil(per_chunk)).unwrap()
}

#[test]
fn every_preset_matches_the_table() {
    let mut report = String::new();
    for p in &PRESETS {
        let plan = plan_model(&stacked_specs(p), &KERNEL_OFFSET_MODEL).unwrap();
        assert_eq!(plan.tensors.len(), 12);
        for t in &plan.tensors {
            let name = t.spec.name.as_str();
            let n = t.chunks.len();
            assert_eq!(n, expected_chunks(p.name, name), "{} {name}", p.name);
            assert_eq!(n as u64, closed_form_chunks(&t.spec), "{} {name}", p.name);
            report.push_str(&format!(
                "{:>4} {:<24} {:>36} {:>9} {} chunk(s) {:?}\n",
                p.name,
                name,
                t.spec.layout.to_string(),
                t.spec.byte_span().unwrap().gb(),
                n,
                t.chunks.iter().map(|c| c.len()).collect::<Vec<_>>(),
            ));
        }
    }
    println!("{report}");
}

#[test]
fn small_presets_need_no_split() {
    for name in ["0.5B", "1.5B", "3B", "7B"] {
        let plan = plan_model(&stacked_specs(&preset(name)), &KERNEL_OFFSET_MODEL).unwrap();
        assert_eq!(plan.split_tensors().count(), 0, "{name}");
    }
    // 7B's gate_proj is the largest that still fits: 3.80 GB.
    let gate7 = TensorSpec::row_major("gate_proj", &[28, 18944, 3584], DType::BF16).unwrap();
    assert_eq!(gate7.byte_span().unwrap().0, 3_802_136_576);
}

#[test]
fn fourteen_b_mlp_splits_at_most_30_layers_per_chunk() {
    let plan = plan_model(&stacked_specs(&preset("14B")), &KERNEL_OFFSET_MODEL).unwrap();
    for name in ["gate_proj", "up_proj", "down_proj"] {
        let t = plan.tensor(name).unwrap();
        assert_eq!(t.spec.byte_span().unwrap().0, 6_794_772_480, "{name}");
        let lens: Vec<u64> = t.chunks.iter().map(|c| c.len()).collect();
        assert_eq!(lens, [24, 24], "{name}");
        assert!(lens.iter().all(|&n| n <= 30));
        // The seed's boundary: layer 30 (0-based) is the first to wrap unsplit.
        assert_eq!(
            first_wrapping_slice(&t.spec, &KERNEL_OFFSET_MODEL).unwrap(),
            Some(30)
        );
    }
    for name in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        let t = plan.tensor(name).unwrap();
        assert!(!t.is_split(), "{name}");
        assert_eq!(
            first_wrapping_slice(&t.spec, &KERNEL_OFFSET_MODEL).unwrap(),
            None
        );
    }
}

#[test]
fn seventy_two_b_chunk_lengths() {
    let plan = plan_model(&stacked_specs(&preset("72B")), &KERNEL_OFFSET_MODEL).unwrap();
    let lens = |name| -> Vec<u64> {
        plan.tensor(name)
            .unwrap()
            .chunks
            .iter()
            .map(|c| c.len())
            .collect()
    };
    assert_eq!(lens("gate_proj"), [8; 10]);
    assert_eq!(lens("down_proj"), [8; 10]);
    // 32 layers of q_proj are exactly 2^32 bytes; 80 layers need 3 chunks.
    assert_eq!(lens("q_proj"), [27, 27, 26]);
    assert_eq!(lens("o_proj"), [27, 27, 26]);
    let plan32 = plan_model(&stacked_specs(&preset("32B")), &KERNEL_OFFSET_MODEL).unwrap();
    let lens32: Vec<u64> = plan32
        .tensor("up_proj")
        .unwrap()
        .chunks
        .iter()
        .map(|c| c.len())
        .collect();
    assert_eq!(lens32, [13, 13, 13, 13, 12]);
}

/// For every chunk of every preset: the last byte of the chunk's last
/// element, computed from the stacked tensor's own layout relative to the
/// chunk's first element, is below 2^32; and it is the chunk's byte span
/// minus one.
#[test]
fn every_chunks_extreme_coordinates_fit() {
    for p in &PRESETS {
        for spec in stacked_specs(p) {
            let t = plan_split(&spec, &KERNEL_OFFSET_MODEL).unwrap();
            let shape = spec.layout.shape();
            for (c, chunk) in t.chunks.iter().enumerate() {
                let mut first = vec![0; shape.len()];
                first[0] = chunk.start;
                let mut last: Vec<u64> = shape.iter().map(|&s| s - 1).collect();
                last[0] = chunk.end - 1;
                let base = spec.layout.crd2idx(&first).unwrap();
                let end = spec.layout.crd2idx(&last).unwrap();
                let last_byte = (end - base + 1) * 2 - 1;
                assert!(last_byte < 1 << 32, "{} {} chunk {c}", p.name, spec.name);
                assert_eq!(last_byte + 1, chunk.byte_span.0);
                assert_eq!(t.chunk_byte_offset(c).unwrap().0, base * 2);
                // The kernel-side view of the same two coordinates.
                let (kc, first_off) = t.kernel_offset(&KERNEL_OFFSET_MODEL, &first).unwrap();
                let (lc, last_off) = t.kernel_offset(&KERNEL_OFFSET_MODEL, &last).unwrap();
                assert_eq!((kc, lc, first_off.0), (c, c, 0));
                assert_eq!(u64::from(last_off.0), last_byte - 1);
            }
        }
    }
}

/// The trap itself, walked layer by layer: without the split, the byte
/// offset of each layer's last byte wraps exactly from the layer the planner
/// predicts; with it, no offset wraps.
#[test]
fn unsplit_offsets_wrap_where_predicted() {
    for p in &PRESETS {
        for spec in stacked_specs(p) {
            let shape = spec.layout.shape().to_vec();
            let predicted = first_wrapping_slice(&spec, &KERNEL_OFFSET_MODEL).unwrap();
            let mut first_wrap = None;
            for layer in 0..shape[0] {
                let mut last: Vec<u64> = shape.iter().map(|&s| s - 1).collect();
                last[0] = layer;
                let true_byte = u128::from(spec.layout.crd2idx(&last).unwrap()) * 2 + 1;
                let wrapped = KERNEL_OFFSET_MODEL.wrap(true_byte).unwrap();
                if u128::from(wrapped) != true_byte && first_wrap.is_none() {
                    first_wrap = Some(layer);
                }
            }
            assert_eq!(first_wrap, predicted, "{} {}", p.name, spec.name);
        }
    }
}

#[test]
fn embedding_sized_slices_are_reported_not_split() {
    // A made-up tensor whose single slice is 5 GB: no split helps.
    let spec = TensorSpec::row_major("lm_head_x2", &[2, 2 * 152_064, 8192], DType::BF16).unwrap();
    let e = plan_split(&spec, &KERNEL_OFFSET_MODEL).unwrap_err();
    assert!(matches!(e, LayoutError::SliceTooLarge { .. }), "{e}");
    assert!(e.to_string().contains("`lm_head_x2`"), "{e}");
}
