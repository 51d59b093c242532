//! Tensor parallelism (`TpBackend`): a model split over the ranks of a
//! group, one megakernel launch per rank per step, the partial sums and the
//! argmax exchanged inside the step.
//!
//! On a one-GPU machine the ranks run co-resident (each grid on its share
//! of the SMs); with `QMK_TP_DEVICES=N` (N GPUs with peer access) the same
//! tests run one rank per GPU. Checked: greedy ids equal to the CPU
//! reference split the same way (`ShardedReference`, whose own tests tie it
//! to the whole reference) and to the one-GPU engine, logits within the
//! one-GPU tolerance, at the 0.5B shape and (cudarc) the 32B shape, the
//! real 0.5B checkpoint's goldens exact, a rank that stops signalling
//! turned into an error within the spin budget (no hang) and the group
//! usable again after a reset. Without a device: the refusals. Skips with
//! a printed reason where there is nothing to run on.

use qmk_gpu_tests::*;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use qmk_engine::Backend;
use qmk_gpu::{Driver, Error, GpuBackend, TpBackend, TpOptions, WeightSource};
use qmk_kernels::params::err;
use qmk_kernels::FLAG_DEBUG_TP_STOP;
use qmk_model::synthetic::SyntheticSource;
use qmk_model::{Config, ShardedReference};

const TOL: f64 = 1e-2;

/// The group's placement: one rank per GPU with `QMK_TP_DEVICES` set (to
/// the number of GPUs to use), else co-resident on GPU 0.
fn placement(ranks: usize) -> TpOptions {
    let gpus = std::env::var("QMK_TP_DEVICES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1);
    TpOptions {
        co_resident: gpus < ranks,
        ..TpOptions::new(ranks)
    }
}

fn open_tp<D: Driver>(source: &dyn WeightSource, cap: usize, tp: &TpOptions) -> TpBackend<D> {
    let t = Instant::now();
    let b = TpBackend::<D>::new(source, with_capacity(cap), tp, &mut ())
        .unwrap_or_else(|e| panic!("{}: opening the TP {} group: {e}", D::NAME, tp.ranks));
    for r in b.ranks() {
        println!("  rank {}", describe(r));
    }
    println!(
        "{}: TP {} ({}) open in {:.1} s",
        D::NAME,
        tp.ranks,
        if tp.co_resident {
            "co-resident"
        } else {
            "one rank per GPU"
        },
        t.elapsed().as_secs_f64()
    );
    b
}

/// Prefill `prompt`, then `n` greedy picks, each fed back; every step's
/// logits with them.
fn greedy<B: Backend>(b: &mut B, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>)
where
    B::Error: std::fmt::Display,
{
    b.reset().unwrap_or_else(|e| panic!("reset: {e}"));
    let mut out = b
        .prefill(prompt, 0)
        .unwrap_or_else(|e| panic!("prefill: {e}"));
    let (mut ids, mut logits) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        logits.push(b.logits().unwrap_or_else(|e| panic!("logits: {e}")));
        ids.push(out.argmax);
        if i + 1 < n {
            out = b
                .step(out.argmax, prompt.len() + i)
                .unwrap_or_else(|e| panic!("step {i}: {e}"));
        }
    }
    (ids, logits)
}

/// TP = 2 at the 0.5B shape (synthetic weights): the sharded CPU reference
/// and the one-GPU engine give the same 40 ids after an 8-token prompt,
/// and every step's logits are within the tolerance of the reference's.
fn tp2_0_5b_vs_reference<D: Driver>() {
    let test = format!("TP 2 == sharded reference == one GPU, 0.5b ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let prompt = synthetic_prompt(8, SEED);
    let n = 40;
    let cap = prompt.len() + n;
    let mut cpu = ShardedReference::new(Arc::clone(&w), 2, cap).unwrap();
    let mut want = Vec::with_capacity(n);
    let mut want_logits = Vec::with_capacity(n);
    let mut lg = Vec::new();
    for (pos, &t) in prompt.iter().enumerate() {
        lg = cpu.step(t, pos).unwrap();
    }
    for i in 0..n {
        let pick = argmax(&lg);
        want.push(pick);
        want_logits.push(lg.clone());
        if i + 1 < n {
            lg = cpu.step(pick, prompt.len() + i).unwrap();
        }
    }
    let one = {
        let mut g = open::<D>(&w, with_capacity(cap));
        greedy(&mut g, &prompt, n).0
    };
    let mut tp = open_tp::<D>(&*w, cap, &placement(2));
    let (ids, logits) = greedy(&mut tp, &prompt, n);
    let worst = logits
        .iter()
        .zip(&want_logits)
        .map(|(g, c)| rel_err(g, c))
        .fold(0f64, f64::max);
    assert_eq!(ids, want, "{test}: ids differ from the sharded reference");
    assert_eq!(ids, one, "{test}: ids differ from the one-GPU engine");
    assert!(worst < TOL, "{test}: logits rel err {worst:.2e}");
    // Run twice: the epochs and parity buffers carry on across steps and
    // resets, the results do not change.
    let again = greedy(&mut tp, &prompt, n).0;
    assert_eq!(again, ids, "{test}: a second run differs");
    // The bench's path: steps queued back to back, each rank reading the
    // group's pick of the step before on the device. Its last logits are
    // those of the same greedy run fed from the host.
    let (fed, fed_logits) = greedy(&mut tp, &prompt[..1], 16);
    tp.reset().unwrap();
    tp.timed_steps(prompt[0], 0, 16)
        .unwrap_or_else(|e| panic!("{test}: timed steps: {e}"));
    let last = tp.logits().unwrap();
    assert_eq!(argmax(&last), fed[15], "{test}: device-fed steps");
    assert_eq!(
        last.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        fed_logits[15]
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>(),
        "{test}: device-fed steps' logits"
    );
    println!("{test}: PASS ({n} ids equal, worst logits rel err {worst:.2e})");
}

/// TP = 2 at the 32B shape (weights streamed from the generator): the same
/// 40 ids as the one-GPU engine (itself checked against the CPU reference
/// at this shape by the scale tests), logits within the tolerance of its
/// logits.
fn tp2_32b_vs_one_gpu<D: Driver>() {
    let test = format!("TP 2 == one GPU, 32b ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let src = SyntheticSource::new(&Config::preset("32b").unwrap(), SEED).unwrap();
    let prompt = synthetic_prompt(4, SEED);
    let n = 40;
    let cap = prompt.len() + n;
    let (one, one_logits) = {
        let mut g = GpuBackend::<D>::from_source(&src, with_capacity(cap), &mut ())
            .unwrap_or_else(|e| panic!("{test}: {e}"));
        greedy(&mut g, &prompt, n)
    };
    let mut tp = open_tp::<D>(&src, cap, &placement(2));
    let (ids, logits) = greedy(&mut tp, &prompt, n);
    let worst = logits
        .iter()
        .zip(&one_logits)
        .map(|(g, c)| rel_err(g, c))
        .fold(0f64, f64::max);
    assert_eq!(ids, one, "{test}: ids differ");
    assert!(worst < TOL, "{test}: logits rel err {worst:.2e}");
    println!("{test}: PASS ({n} ids equal, worst logits rel err {worst:.2e})");
}

/// The real 0.5B checkpoint at TP = 2 (its 14 heads and 2 KV heads split in
/// two): every golden prompt's 48 ids exactly transformers'.
fn tp2_real_goldens<D: Driver>() {
    let test = format!("TP 2 real 0.5b goldens ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        println!("SKIPPED {test}: QMK_REAL_QWEN is not set (the real-weights directory)");
        return;
    };
    let Some(gs) = goldens(&test, "QMK_GOLDENS") else {
        return;
    };
    let w = qmk_model::load_weights(&dir).unwrap_or_else(|e| panic!("{test}: {e}"));
    let cap = gs
        .iter()
        .map(|g| g.input_ids.len() + g.output_ids.len())
        .max()
        .unwrap();
    let mut tp = open_tp::<D>(&w, cap, &placement(2));
    for g in &gs {
        let (ours, _) = greedy(&mut tp, &g.input_ids, g.output_ids.len());
        assert_eq!(ours, g.output_ids, "{test}: prompt `{}`", g.id);
    }
    println!("{test}: PASS: {} of {} prompts exact", gs.len(), gs.len());
}

/// A rank that stops signalling (returns at its first exchange, as a dead
/// process's rank would) ends the step with an error on the others within
/// the spin budget, not a hang; after a reset the group decodes as before.
fn tp_stopped_rank<D: Driver>() {
    let test = format!("TP 2 stopped rank ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let prompt = synthetic_prompt(4, SEED);
    let mut tp = open_tp::<D>(&*w, 16, &placement(2));
    let (want, _) = greedy(&mut tp, &prompt, 4);
    let budget = Duration::from_millis(500);
    tp.set_spin_timeout(budget);
    tp.reset().unwrap();
    tp.set_rank_flags(1, FLAG_DEBUG_TP_STOP, true);
    let t = Instant::now();
    let e = tp
        .step(prompt[0], 0)
        .expect_err("a stopped rank must fail the step");
    let took = t.elapsed();
    println!("{test}: {e} (after {:.2} s)", took.as_secs_f64());
    match &e {
        Error::Rank { rank: 0, source } => match **source {
            Error::Kernel { code, .. } => assert_eq!(code, err::TP_TIMEOUT, "{test}: {e}"),
            _ => panic!("{test}: {e}"),
        },
        _ => panic!("{test}: expected rank 0's exchange timeout, got {e}"),
    }
    assert!(took < budget * 10, "{test}: took {took:?}");
    assert!(
        tp.step(prompt[0], 0).is_err(),
        "{test}: works before a reset"
    );
    tp.set_rank_flags(1, FLAG_DEBUG_TP_STOP, false);
    tp.set_spin_timeout(Duration::from_secs(2));
    let (again, _) = greedy(&mut tp, &prompt, 4);
    assert_eq!(again, want, "{test}: after the reset");
    println!("{test}: PASS");
}

/// Asking for more GPUs than there are is refused before anything is
/// uploaded, naming the count (no device at all: the driver's answer).
fn tp_refuses_missing_gpus<D: Driver>() {
    let config = Config::preset("72b").unwrap();
    let src = SyntheticSource::new(&config, SEED).unwrap();
    let count = qmk_gpu::device_count::<D>().unwrap_or(0);
    let Some(ranks) = [2, 4, 8].into_iter().find(|&n| n > count) else {
        println!(
            "SKIPPED TP refusal ({}): {count} GPUs cover every group",
            D::NAME
        );
        return;
    };
    let e = TpBackend::<D>::new(&src, with_capacity(16), &TpOptions::new(ranks), &mut ())
        .expect_err("more ranks than GPUs");
    match (&e, count) {
        (Error::NoDevice(_) | Error::NoDriver, 0) => {}
        (Error::Devices { wanted, found }, _) => assert_eq!((*wanted, *found), (ranks, count)),
        _ => panic!("TP {ranks} on {count} GPUs: {e}"),
    }
    println!("TP {ranks} on {count} GPUs ({}): refused: {e}", D::NAME);
    // Groups the model or the kernel cannot take, named before any device
    // is touched.
    for (n, field) in [(3, "num_key_value_heads"), (1, "tp"), (16, "tp")] {
        let e = TpBackend::<D>::new(&src, with_capacity(16), &TpOptions::new(n), &mut ())
            .expect_err("a group the model cannot be split into")
            .to_string();
        assert!(e.contains(field), "TP {n}: {e}");
    }
}

both!(tp2_0_5b, tp2_0_5b_vs_reference);
both!(tp2_real, tp2_real_goldens);
both!(tp_stop, tp_stopped_rank);
both!(tp_refusal, tp_refuses_missing_gpus);

#[test]
fn tp2_32b_cudarc() {
    tp2_32b_vs_one_gpu::<CudarcDriver>();
}
