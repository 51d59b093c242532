//! GPU tests on the real Qwen2.5-Coder-0.5B-Instruct weights (directory in
//! `QMK_REAL_QWEN`; skipped with a printed reason when it or the device is
//! missing). Every check is one generic function run on both drivers.
//!
//! - `goldens_plain`: the 8 golden prompts of Hugging Face transformers
//!   (file in `QMK_GOLDENS`), 48 greedy ids each from the kernel's picks,
//!   compared by vLLM's `check_logprobs_close` rule (ids equal up to the
//!   first divergence, and there each side's token in the other's top 5);
//!   prints how many prompts match all 48 ids.
//! - `goldens_yarn`: the same with the config's rotary scaling set to
//!   Qwen2.5's documented YaRN setting (factor 4 over 32,768 positions),
//!   against transformers' goldens with that config (file in
//!   `QMK_GOLDENS_YARN`).
//! - `yarn_long_vs_reference`: with that YaRN config, a prompt of
//!   `QMK_YARN_POSITIONS` (default 40,000) synthetic ids prefilled on the
//!   GPU, past the model's 32,768 trained positions; the KV cache is read
//!   back into the CPU reference, then a few greedy steps run on both: the
//!   logits agree within the long-context tolerance and the ids are equal.
//!   The same cache under the plain rotary table must be further off (the
//!   check sees the scaling).
//!
//! `scripts/gpu/run.sh real` runs these on the GPU machine.

use qmk_gpu_tests::*;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use qmk_engine::Backend;
use qmk_gpu::{Driver, Options};
use qmk_model::reference::{log_softmax, top_k, Reference, ReferenceOptions};
use qmk_model::Weights;

/// Logits tolerance of the long-context tests (relative L2 error).
const TOL: f64 = 1e-2;
/// Decode steps after the long prompt.
const LONG_STEPS: usize = 4;

fn yarn_scaling() -> serde_json::Value {
    serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
}

/// The real weights, with `rope_scaling` replaced when given; `None` after
/// printing why the test is skipped.
fn real_weights(test: &str, rope_scaling: Option<serde_json::Value>) -> Option<Arc<Weights>> {
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        println!("SKIPPED {test}: QMK_REAL_QWEN is not set (the real-weights directory)");
        return None;
    };
    let mut w = qmk_model::load_weights(&dir)
        .unwrap_or_else(|e| panic!("{test}: loading {}: {e}", dir.display()));
    if let Some(s) = rope_scaling {
        w.config.rope_scaling = Some(s);
        w.config.validate().unwrap();
    }
    Some(Arc::new(w))
}

fn check_goldens<D: Driver>(name: &str, var: &str, rope_scaling: Option<serde_json::Value>) {
    let test = format!("real 0.5b {} {name} goldens", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let Some(w) = real_weights(&test, rope_scaling) else {
        return;
    };
    let Some(gs) = goldens(&test, var) else {
        return;
    };
    let steps = gs[0].output_ids.len();
    // The model's whole context, as `generate` allocates it by default.
    let cap = w.config.max_context();
    assert!(cap >= gs.iter().map(|g| g.input_ids.len()).max().unwrap() + steps);
    let mut gpu = open::<D>(&w, with_capacity(cap));
    let (mut exact, mut report) = (0, String::new());
    for g in &gs {
        gpu.reset().unwrap();
        let mut ours = Vec::with_capacity(steps);
        let mut our_top5 = Vec::with_capacity(steps);
        let mut out = gpu.prefill(&g.input_ids, 0).unwrap();
        for i in 0..steps {
            let lg = gpu.logits().unwrap();
            our_top5.push(
                top_k(&lg, 5)
                    .into_iter()
                    .map(|(t, _)| t)
                    .collect::<Vec<_>>(),
            );
            ours.push(out.argmax);
            if i + 1 < steps {
                out = gpu.step(out.argmax, g.input_ids.len() + i).unwrap();
            }
        }
        match (0..steps).find(|&i| ours[i] != g.output_ids[i]) {
            None => exact += 1,
            Some(i) => {
                let ok = g.top5[i].contains(&ours[i]) && our_top5[i].contains(&g.output_ids[i]);
                report += &format!(
                    "\n  {}: diverges at step {i}: ours {} (golden top5 {:?}), golden {} (our top5 {:?})",
                    g.id, ours[i], g.top5[i], g.output_ids[i], our_top5[i]
                );
                assert!(ok, "{test}: prompt `{}` fails the rule:{report}", g.id);
            }
        }
    }
    println!(
        "{test}: PASS: {exact} of {} prompts equal over all {steps} ids{report}",
        gs.len()
    );
}

fn goldens_plain_check<D: Driver>() {
    check_goldens::<D>("plain", "QMK_GOLDENS", None);
}

fn goldens_yarn_check<D: Driver>() {
    check_goldens::<D>("YaRN", "QMK_GOLDENS_YARN", Some(yarn_scaling()));
}

fn bf16(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// `n` synthetic prompt ids below the special tokens (deterministic).
fn prompt(n: usize) -> Vec<u32> {
    synthetic_prompt(n, 0x9E37_79B9_7F4A_7C15)
}

fn yarn_long_vs_reference<D: Driver>() {
    let n: usize = std::env::var("QMK_YARN_POSITIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40_000);
    let test = format!(
        "real 0.5b {} YaRN at {n} positions vs CPU reference",
        D::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let Some(w) = real_weights(&test, Some(yarn_scaling())) else {
        return;
    };
    let cap = n + LONG_STEPS;
    assert!(
        cap <= w.config.max_context(),
        "{test}: {cap} > the YaRN context"
    );
    let mut gpu = open::<D>(
        &w,
        Options {
            capacity: cap,
            step_deadline: Duration::from_secs(300),
            ..Default::default()
        },
    );
    let t = Instant::now();
    let mut out = gpu.prefill(&prompt(n), 0).unwrap();
    let prefill_s = t.elapsed().as_secs_f64();

    // The GPU's cache, [L, C, KV] bf16, into the CPU reference's f32 cache.
    let (k, v) = gpu.read_kv_cache().unwrap();
    let (layers, kv) = (w.config.num_hidden_layers, w.config.kv_dim());
    let gpu_cap = k.len() / (layers * kv);
    assert!(gpu_cap >= cap, "{test}: GPU cache of {gpu_cap} positions");
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(cap).kv_bf16(true)).unwrap();
    let mut plain_w = (*w).clone();
    plain_w.config.rope_scaling = None;
    let mut plain =
        Reference::new(Arc::new(plain_w), ReferenceOptions::new(cap).kv_bf16(true)).unwrap();
    for r in [&mut cpu, &mut plain] {
        let c = r.cache_mut(0);
        for l in 0..layers {
            for p in 0..n {
                let (src, dst) = ((l * gpu_cap + p) * kv, (l * cap + p) * kv);
                for i in 0..kv {
                    c.k[dst + i] = bf16(k[src + i]);
                    c.v[dst + i] = bf16(v[src + i]);
                }
            }
        }
    }

    let (mut max_err, mut plain_err) = (0f64, f64::INFINITY);
    for i in 0..LONG_STEPS {
        let pos = n + i;
        let token = out.argmax;
        out = gpu.step(token, pos).unwrap();
        let lg = gpu.logits().unwrap();
        let want = cpu.step(token, pos).unwrap();
        let e = rel_err(&lg, &want);
        max_err = max_err.max(e);
        assert!(e <= TOL, "{test}: pos {pos}: rel err {e:.3e} > {TOL}");
        let (ours, theirs) = (out.argmax, argmax(&want));
        if ours != theirs {
            // A near-tie may flip; then both must be in each other's top 2.
            let lp = log_softmax(&want);
            let gap = lp[theirs as usize] - lp[ours as usize];
            assert!(
                gap < 0.05,
                "{test}: pos {pos}: greedy ids differ: GPU {ours}, CPU {theirs} (logprob gap {gap:.3})"
            );
        }
        if i == 0 {
            plain_err = rel_err(&lg, &plain.step(token, pos).unwrap());
        }
    }
    assert!(
        plain_err > 2.0 * max_err,
        "{test}: the plain rotary table is as close ({plain_err:.3e}) as YaRN's ({max_err:.3e}): the check does not see the scaling"
    );
    println!(
        "{test}: PASS: {LONG_STEPS} steps, max rel err {max_err:.3e} (plain rotary on the same cache: {plain_err:.3e}); GPU prefill {prefill_s:.1} s"
    );
}

both!(goldens_plain, goldens_plain_check);
both!(goldens_yarn, goldens_yarn_check);
both!(yarn_long, yarn_long_vs_reference);
