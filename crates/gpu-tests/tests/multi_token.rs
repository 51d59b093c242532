//! The multi-token step (`Backend::step_many` on the GPU): each position's
//! logits and greedy pick are bit-identical to one-token steps at the same
//! positions over the same cache, for every T the device takes (2 ..= its
//! most, in turn), at short context (the one-CTA-per-head attention), across
//! the split attention's threshold (a run's first tokens on one path, its
//! last on the other) and past it; at the 0.5B, 7B and 32B shapes (7B from
//! T = 4 and 32B from T = 3 run the MLP's down in column chunks); and its
//! timeline (`bench --multi-tokens --profile`) is whole for every T; the
//! same with the tensor-core weight phases at 7B and 32B. Skips with a
//! printed reason when there is no device.

use qmk_gpu_tests::*;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use qmk_engine::{Backend, MultiStep};
use qmk_gpu::{Driver, GpuBackend, WeightSource};
use qmk_model::synthetic::SyntheticSource;
use qmk_model::Config;

/// Identifies a logits row by its bits.
fn bits_hash(row: &[f32]) -> u64 {
    let mut h = DefaultHasher::new();
    for x in row {
        x.to_bits().hash(&mut h);
    }
    h.finish()
}

/// Positions `start..start + len` of a synthetic sequence: first one-token
/// steps (after a prefill of the positions before `start`), then the same
/// positions again in multi-token runs, compared position by position.
fn multi_equals_single<D: Driver + 'static>(preset: &str, start: usize, len: usize) {
    multi_equals_single_with::<D>(preset, start, len, false);
}

/// [`multi_equals_single`] with the tensor-core weight phases
/// (`Options::tensor_cores`), which must really run on the device: their
/// sums come from the same MMAs at every T.
fn tensor_cores_multi_equals_single<D: Driver + 'static>(preset: &str, start: usize, len: usize) {
    multi_equals_single_with::<D>(preset, start, len, true);
}

fn multi_equals_single_with<D: Driver + 'static>(
    preset: &str,
    start: usize,
    len: usize,
    tensor_cores: bool,
) {
    let test = format!(
        "multi-token == one-token steps, {preset}{} at {start}..+{len} ({})",
        if tensor_cores { " on tensor cores" } else { "" },
        D::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let cap = start + len;
    // 32B's weights stream from the generator (its host copy would be 64 GB).
    let (held, streamed);
    let source: &dyn WeightSource = if preset == "32b" {
        streamed = SyntheticSource::new(&Config::preset(preset).unwrap(), SEED).unwrap();
        &streamed
    } else {
        held = weights(preset);
        &*held
    };
    let v = source.config().vocab_size;
    let opts = qmk_gpu::Options {
        tensor_cores,
        ..with_capacity(cap)
    };
    let mut gpu = GpuBackend::<D>::from_source(source, opts, &mut ())
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    if tensor_cores {
        assert!(
            gpu.kernel_build().tensor_core_phases(gpu.arch()).is_some(),
            "{test}: the tensor-core phases do not run on {}",
            describe(&gpu)
        );
    }
    let max = gpu.multi_max_tokens();
    assert!(
        max >= 2,
        "{test}: no multi-token step on {}",
        describe(&gpu)
    );
    let tokens = synthetic_prompt(cap, SEED);
    if start > 0 {
        gpu.prefill(&tokens[..start], 0).unwrap();
    }
    let want: Vec<(u32, u64)> = (start..cap)
        .map(|pos| {
            let pick = gpu.step(tokens[pos], pos).unwrap().argmax;
            (pick, bits_hash(&gpu.logits().unwrap()))
        })
        .collect();
    let (mut pos, mut t, mut runs) = (start, 2, 0);
    while pos < cap {
        let n = t.min(cap - pos);
        let run = MultiStep::new(&tokens[pos..pos + n], pos, cap)
            .unwrap()
            .with_logits(true);
        let out = gpu
            .step_many(run)
            .unwrap_or_else(|e| panic!("{test}: T = {n} at {pos}: {e}"));
        assert_eq!(out.argmax.len(), n, "{test}");
        assert_eq!(out.logits.len(), n * v, "{test}");
        for i in 0..n {
            let got = (out.argmax[i], bits_hash(&out.logits[i * v..(i + 1) * v]));
            assert_eq!(
                got,
                want[pos + i - start],
                "{test}: T = {n} at {pos}, token {i}"
            );
        }
        // Backend::logits is the run's last position's.
        assert_eq!(
            bits_hash(&gpu.logits().unwrap()),
            want[pos + n - 1 - start].1,
            "{test}"
        );
        pos += n;
        t = if t >= max { 2 } else { t + 1 };
        runs += 1;
    }
    println!(
        "{test}: {len} positions bit-identical in {runs} runs of T = 2..={max} (the step's position \
         cost as timed: {:.3})",
        gpu.step_many_position_cost()
    );
}

both!(multi_0_5b_short, multi_equals_single, "0.5b", 0, 80);
both!(
    multi_0_5b_split_threshold,
    multi_equals_single,
    "0.5b",
    480,
    64
);
both!(multi_7b_short, multi_equals_single, "7b", 0, 64);
both!(multi_7b_split_threshold, multi_equals_single, "7b", 490, 40);

/// The 32B shape on one driver (its synthetic weights take a minute to
/// stream): 64 positions across the split threshold.
#[test]
fn multi_32b_split_threshold() {
    multi_equals_single::<CudarcDriver>("32b", 470, 64);
}

both!(
    multi_7b_tensor_cores_short,
    tensor_cores_multi_equals_single,
    "7b",
    0,
    64
);

/// The tensor-core phases at 32B (six column blocks in down), one driver.
#[test]
fn multi_32b_tensor_cores_split_threshold() {
    tensor_cores_multi_equals_single::<CudarcDriver>("32b", 470, 64);
}

/// `bench --multi-tokens --profile`: every T's launches stamp a whole
/// timeline (the one-token step's barriers), each op takes time, and the
/// parts add up to the launch.
fn multi_timeline<D: Driver + 'static>() {
    let test = format!("multi-token timeline, 0.5b ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let mut gpu: GpuBackend<D> = open(&w, with_capacity(64));
    let max = gpu.multi_max_tokens();
    let timelines = gpu
        .bench_multi_timeline(&qmk_gpu::BenchOptions {
            warmup: 2,
            steps: 8,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    assert_eq!(
        timelines.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        (1..=max).collect::<Vec<_>>(),
        "{test}"
    );
    for (t, tl) in &timelines {
        let parts = tl.parts_us();
        println!(
            "{test}: T = {t}: {:.1} us traced (parts {parts:.1}), barriers {:.1} us",
            tl.total_us,
            tl.barrier_us()
        );
        for r in &tl.rows {
            assert!(
                r.critical_us > 0.0,
                "{test}: T = {t}: {} took no time",
                r.name
            );
        }
        // Medians of sums need not add up exactly; within 5 %.
        assert!(
            (parts - tl.total_us).abs() <= 0.05 * tl.total_us,
            "{test}: T = {t}: parts {parts:.1} us vs launch {:.1} us",
            tl.total_us
        );
    }
}

both!(multi_timeline_0_5b, multi_timeline);
