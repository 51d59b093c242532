//! The megakernel at 14B, 32B and 72B shapes (29.5, 65.5 and 145.4 GB of
//! synthetic bf16 weights, split per the plan), on both drivers, against
//! the CPU reference on the same weights (at 72B the weights are streamed
//! to the GPU and regenerated layer by layer for the CPU reference: they do
//! not fit in host memory); and the 32-bit trap bisected in a real decode
//! (first N layers of 14B, N across the layout crate's predicted boundary,
//! with the planner's split and with a plan made for the wrong offset
//! model; at 72B per tensor group, `bisect_72b`).
//!
//! Every test skips with a printed reason without a CUDA device or without
//! the host memory its weights need. Run each test in its own process on the
//! GPU machine: `scale-<hash> --test-threads=1 --nocapture --exact scale_14b`.
//!
//! Environment: `QMK_SCALE_CUBINS=DIR` loads `DIR/<fingerprint>.cubin` when
//! present instead of running NVRTC (written here by the ignored
//! `precompile_cubins` with `QMK_SCALE_PRECOMPILE=DIR`);
//! `QMK_BISECT_LAYERS=30,31` overrides the layer counts of the bisection.

use qmk_gpu_tests::*;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use qmk_engine::Backend;
use qmk_gpu::{BenchOptions, Driver, GpuBackend, Options, WeightSource};
use qmk_kernels::KernelBuild;
use qmk_layout::KERNEL_OFFSET_MODEL;
use qmk_layout::{first_wrapping_slice, plan_model, ModelPlan, OffsetModel, OffsetUnit};
use qmk_model::reference::{Logits, Reference, ReferenceOptions, StreamedReference};
use qmk_model::synthetic::SyntheticSource;
use qmk_model::{synthetic_weights, Config, Weights};

/// Two prompt tokens, then greedy picks.
const PROMPT: [u32; 2] = [9707, 11];
/// Greedy steps after the prompt.
const GREEDY: usize = 8;
const TOL: f64 = 1e-2;

/// The plan made for 32-bit *element* offsets: what a planner that models
/// the wrong arithmetic would produce for this kernel (which computes 32-bit
/// *byte* offsets). For 14B it splits nothing (3.4 G elements < 2^32), so
/// gate/up/down of layer 30 and later wrap inside the kernel.
const WRONG_MODEL: OffsetModel = OffsetModel {
    bits: 32,
    unit: OffsetUnit::Elements,
};

fn device_or_skip(test: &str) -> bool {
    match no_device() {
        None => true,
        Some(reason) => {
            println!("SKIPPED {test}: {reason}");
            false
        }
    }
}

/// MemAvailable from /proc/meminfo, bytes.
fn host_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The weights of `config`, or `None` (printed) when the host cannot hold
/// them with 8 GB to spare.
fn weights_or_skip(test: &str, config: &Config) -> Option<Weights> {
    let need = qmk_model::weight_bytes(config).unwrap().total.0;
    if let Some(avail) = host_available() {
        if need + (8 << 30) > avail {
            println!(
                "SKIPPED {test}: the weights need {need} B of host memory, {avail} B available"
            );
            return None;
        }
    }
    let t = Instant::now();
    let w = synthetic_weights(config, SEED);
    println!(
        "{test}: {:.2} GB of synthetic weights in {:.1} s",
        need as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Some(w)
}

/// The first `n` layers of `w` (synthetic layer l does not depend on the
/// layer count, so this is exactly the `n`-layer model), without a copy.
fn truncate_layers(w: &mut Weights, n: usize) {
    let l = w.config.num_hidden_layers;
    assert!(n <= l);
    let cut = |v: &mut Vec<half::bf16>| {
        let per = v.len() / l;
        v.truncate(per * n);
    };
    cut(&mut w.input_layernorm);
    cut(&mut w.q_proj);
    cut(&mut w.q_bias);
    cut(&mut w.k_proj);
    cut(&mut w.k_bias);
    cut(&mut w.v_proj);
    cut(&mut w.v_bias);
    cut(&mut w.o_proj);
    cut(&mut w.post_attention_layernorm);
    cut(&mut w.gate_proj);
    cut(&mut w.up_proj);
    cut(&mut w.down_proj);
    w.config.num_hidden_layers = n;
    w.check_sizes().unwrap();
}

/// Tokens fed and logits of a greedy run: PROMPT, then GREEDY picks.
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn steps() -> usize {
    PROMPT.len() + GREEDY
}

/// The CPU reference's greedy run (it shares `w`, no copy).
fn reference_run(label: &str, w: &Arc<Weights>, steps: usize) -> Run {
    let t = Instant::now();
    let mut cpu =
        Reference::new(w.clone(), ReferenceOptions::new(steps + 1).kv_bf16(true)).unwrap();
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let mut token = PROMPT[0];
    for pos in 0..steps {
        if let Some(&t) = PROMPT.get(pos) {
            token = t;
        }
        let l = cpu.step(token, pos).unwrap();
        tokens.push(token);
        token = argmax(&l);
        logits.push(l);
    }
    println!(
        "{label}: CPU reference, {steps} steps in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Run { tokens, logits }
}

/// A prebuilt cubin for `build`, if `QMK_SCALE_CUBINS` holds one.
fn cubin_for(build: &KernelBuild) -> Option<PathBuf> {
    let dir = std::env::var_os("QMK_SCALE_CUBINS")?;
    let p = PathBuf::from(dir).join(format!("{:016x}.cubin", build.fingerprint));
    p.is_file().then_some(p)
}

/// What one GPU run gives: the picks, the logits, gate_proj's chunk count
/// and (when benched) the decode speed.
type GpuRun = (Vec<u32>, Vec<Vec<f32>>, usize, Option<f64>);

/// The GPU run through `D`: feeds the reference's tokens, returns the
/// picks and logits, and (with `bench`) the decode speed.
fn gpu_run<D: Driver>(
    w: &Weights,
    plan: Option<ModelPlan>,
    tokens: &[u32],
    bench: bool,
    label: &str,
) -> GpuRun {
    let (mut b, gate_chunks) = open_planned::<D>(w, plan, label);
    let (mut ids, mut logits) = (Vec::new(), Vec::new());
    for (pos, &tok) in tokens.iter().enumerate() {
        let out = b
            .step(tok, pos)
            .unwrap_or_else(|e| panic!("{label}: step {pos}: {e}"));
        ids.push(out.argmax);
        logits.push(b.logits().unwrap());
    }
    let bench = bench.then(|| {
        b.reset().unwrap();
        let r = b
            .bench(&BenchOptions {
                warmup: 8,
                steps: 48,
                ..Default::default()
            })
            .unwrap();
        println!(
            "{label}: BENCH {:.1} tok/s, {:.0} us/step (p10 {:.0}, p90 {:.0}), {:.2} GB/step, {:.0} GB/s, floor {:.0} GB/s, {:.1} % of floor, floor {:.1} tok/s, {} barriers",
            r.tok_per_s,
            r.us_per_step,
            r.us_p10,
            r.us_p90,
            r.bytes_per_step as f64 / 1e9,
            r.gbps,
            r.floor_gbps,
            r.pct_of_floor,
            r.floor_tok_per_s,
            r.barriers_per_step
        );
        r.tok_per_s
    });
    (ids, logits, gate_chunks, bench)
}

/// The backend through `D` on `source`'s weights, with `plan` (the
/// planner's when `None`) and a prebuilt cubin when `QMK_SCALE_CUBINS` has
/// one; prints the split, the open and upload times and the peak RSS.
/// Returns it and gate_proj's chunk count.
fn open_planned<D: Driver>(
    source: &dyn WeightSource,
    plan: Option<ModelPlan>,
    label: &str,
) -> (GpuBackend<D>, usize) {
    let config = source.config();
    let build = match &plan {
        Some(p) => KernelBuild::with_plan(config, p.clone()).unwrap(),
        None => KernelBuild::new(config).unwrap(),
    };
    let chunks: Vec<String> = build
        .plan
        .split_tensors()
        .map(|t| format!("{} x{}", t.spec.name, t.chunks.len()))
        .collect();
    let gate_chunks = build.plan.tensor("gate_proj").unwrap().chunks.len();
    let cubin = cubin_for(&build);
    let opts = Options {
        capacity: 64,
        plan,
        cubin: cubin.clone(),
        step_deadline: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let t = Instant::now();
    let b = GpuBackend::<D>::from_source(source, opts, &mut ())
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let (up, bytes) = b.upload_stats();
    let l = b.launch_info();
    println!(
        "{label}: {} layers, split {chunks:?}, cubin {}, open + upload {:.1} s ({:.1} GB/s upload), grid {} x {}, peak RSS {}",
        config.num_hidden_layers,
        if cubin.is_some() { "prebuilt" } else { "NVRTC" },
        t.elapsed().as_secs_f64(),
        bytes as f64 / up.as_secs_f64().max(1e-9) / 1e9,
        l.grid,
        l.block,
        peak_rss()
    );
    (b, gate_chunks)
}

/// Checks a GPU run against the reference; returns the largest error.
fn compare(label: &str, r: &Run, ids: &[u32], logits: &[Vec<f32>]) -> (f64, bool) {
    let mut worst = 0f64;
    let mut ids_equal = true;
    for pos in 0..r.tokens.len() {
        let e = rel_err(&logits[pos], &r.logits[pos]);
        let want = argmax(&r.logits[pos]);
        worst = worst.max(e);
        ids_equal &= ids[pos] == want;
        println!(
            "{label}: pos {pos} token {} -> gpu {} cpu {} rel err {e:.3e}",
            r.tokens[pos], ids[pos], want
        );
    }
    (worst, ids_equal)
}

/// Full decode at `preset`'s shapes on both drivers vs the CPU reference.
fn full_scale(preset: &str) -> Option<Weights> {
    let test = format!("scale_{preset}");
    if !device_or_skip(&test) {
        return None;
    }
    let config = Config::preset(preset).unwrap();
    let w = Arc::new(weights_or_skip(&test, &config)?);
    let r = reference_run(&test, &w, steps());
    let (ids_a, logits_a, chunks, _) =
        gpu_run::<CudarcDriver>(&w, None, &r.tokens, true, &format!("{test} cudarc"));
    let (err_a, ok_a) = compare(&format!("{test} cudarc"), &r, &ids_a, &logits_a);
    let (ids_b, logits_b, _, _) =
        gpu_run::<CustDriver>(&w, None, &r.tokens, true, &format!("{test} cust"));
    let (err_b, ok_b) = compare(&format!("{test} cust"), &r, &ids_b, &logits_b);
    let identical = ids_a == ids_b && logits_a == logits_b;
    println!(
        "{test}: RESULT gate_proj chunks {chunks}; cudarc ids equal {ok_a} max rel err {err_a:.3e}; \
         cust ids equal {ok_b} max rel err {err_b:.3e}; cudarc == cust bit-identical {identical}"
    );
    assert!(
        ok_a && ok_b,
        "{test}: greedy ids differ from the CPU reference"
    );
    assert!(
        err_a <= TOL && err_b <= TOL,
        "{test}: logits error over {TOL}"
    );
    assert!(identical, "{test}: cudarc and cust differ");
    drop(r);
    Arc::try_unwrap(w).ok()
}

#[test]
fn scale_14b() {
    let Some(mut w) = full_scale("14b") else {
        return;
    };
    if std::env::var_os("QMK_SKIP_BISECT").is_none() {
        bisect(&mut w);
    }
}

#[test]
fn scale_32b() {
    full_scale("32b");
}

/// The 32-bit trap bisected in a real decode, on the 14B weights truncated in
/// place to N layers: with the planner's split every N is right; with a plan
/// made for the wrong offset model the first wrong layer is the predicted one.
fn bisect(w: &mut Weights) {
    let full = w.config.clone();
    let gate = qmk_model::stacked_specs(&full)
        .unwrap()
        .into_iter()
        .find(|s| s.name == "gate_proj")
        .unwrap();
    let p = first_wrapping_slice(&gate, &KERNEL_OFFSET_MODEL)
        .unwrap()
        .expect("14B gate_proj wraps") as usize;
    println!("bisect: layout crate predicts layer {p} (0-based) is the first whose 32-bit byte offsets wrap: N <= {p} layers are safe unsplit, N >= {} are not", p + 1);
    let ns: Vec<usize> = match std::env::var("QMK_BISECT_LAYERS") {
        Ok(s) => s.split(',').map(|x| x.trim().parse().unwrap()).collect(),
        Err(_) => vec![p, p + 1],
    };
    let mut ns = ns;
    ns.sort_unstable();
    ns.reverse(); // truncation only shrinks
    let mut rows = Vec::new();
    for n in ns {
        truncate_layers(w, n);
        let shared = Arc::new(std::mem::replace(w, placeholder()));
        let r = reference_run(&format!("bisect N={n}"), &shared, PROMPT.len() + 1);
        let wrong = plan_model(
            &qmk_model::stacked_specs(&shared.config).unwrap(),
            &WRONG_MODEL,
        )
        .unwrap();
        let mut out = Vec::new();
        for (name, plan) in [("split", None), ("unsplit", Some(wrong))] {
            let label = format!("bisect N={n} {name}");
            let (ids, logits, chunks, _) =
                gpu_run::<CudarcDriver>(&shared, plan, &r.tokens, false, &label);
            let (err, ok) = compare(&label, &r, &ids, &logits);
            let clean = ok && err <= TOL;
            println!("{label}: RESULT gate_proj chunks {chunks}, ids equal {ok}, max rel err {err:.3e} -> {}", if clean { "clean" } else { "WRONG" });
            out.push(clean);
        }
        rows.push((n, out[0], out[1]));
        *w = Arc::try_unwrap(shared).unwrap_or_else(|_| panic!("no other owner"));
    }
    rows.sort_unstable();
    println!("bisect: N | split | unsplit (expected: split clean everywhere; unsplit wrong exactly from N = {})", p + 1);
    for &(n, s, u) in &rows {
        println!(
            "bisect: {n} | {} | {}",
            if s { "clean" } else { "WRONG" },
            if u { "clean" } else { "WRONG" }
        );
    }
    for &(n, s, u) in &rows {
        assert!(s, "N = {n}: the planner's split gave wrong output");
        assert_eq!(
            u,
            n <= p,
            "N = {n}: unsplit is {} but the layout crate predicts {}",
            if u { "clean" } else { "wrong" },
            if n <= p { "clean" } else { "wrong" }
        );
    }
}

/// Greedy picks after a prompt of one token at 72B-scale shapes (the
/// prompt's second token is the first pick's input).
const GREEDY_72B: usize = 8;

/// One GPU run on synthetic weights streamed from `source` (never whole in
/// host memory): feeds `prompt`, then `greedy` of its own picks; returns the
/// tokens fed, the picks and the logits after each token.
fn gpu_run_streamed<D: Driver>(
    source: &SyntheticSource,
    plan: Option<ModelPlan>,
    prompt: &[u32],
    greedy: usize,
    label: &str,
) -> (Vec<u32>, Vec<u32>, Vec<Vec<f32>>) {
    let (mut b, _) = open_planned::<D>(source, plan, label);
    let (mut fed, mut picks, mut logits) = (Vec::new(), Vec::new(), Vec::new());
    let mut token = prompt[0];
    for pos in 0..prompt.len() + greedy {
        if let Some(&t) = prompt.get(pos) {
            token = t;
        }
        let out = b
            .step(token, pos)
            .unwrap_or_else(|e| panic!("{label}: step {pos}: {e}"));
        fed.push(token);
        picks.push(out.argmax);
        logits.push(b.logits().unwrap());
        token = out.argmax;
    }
    (fed, picks, logits)
}

/// The streamed CPU reference on the tokens a GPU run fed, in one pass:
/// every row's logits against the GPU's, every row's argmax against the
/// GPU's pick (equal picks on equal inputs: the greedy runs are the same).
///
/// `memo` keeps the last pass (tokens fed and logits `[T, V]`): a run of
/// the same model that fed the same first tokens is compared on those rows
/// without a second pass (a row's logits depend only on the tokens up to
/// it); a wrong pick ends the comparison there anyway.
fn check_streamed(
    label: &str,
    source: &SyntheticSource,
    fed: &[u32],
    picks: &[u32],
    logits: &[Vec<f32>],
    memo: &mut Option<(Vec<u32>, Vec<f32>)>,
) -> (f64, bool) {
    let v = source.config().vocab_size;
    let reuse = memo
        .as_ref()
        .is_some_and(|(f, _)| f.len() == fed.len() && f[0] == fed[0]);
    if !reuse {
        let t = Instant::now();
        let mut cpu = StreamedReference::new(
            source.config(),
            source.seed(),
            ReferenceOptions::new(fed.len()).kv_bf16(true),
        )
        .unwrap();
        let all = cpu.forward(fed, 0, Logits::All).unwrap(); // [T, V]
        println!(
            "{label}: streamed CPU reference, {} rows in {:.1} s, {:.2} GB of weights held at most, peak RSS {}",
            fed.len(),
            t.elapsed().as_secs_f64(),
            cpu.peak_weight_bytes() as f64 / 1e9,
            peak_rss()
        );
        *memo = Some((fed.to_vec(), all));
    }
    let (memo_fed, all) = memo.as_ref().unwrap();
    // Rows whose inputs the reference pass saw.
    let rows = fed.iter().zip(memo_fed).take_while(|(a, b)| a == b).count();
    let (mut worst, mut equal) = (0f64, true);
    for (pos, row) in all.chunks(v).take(rows).enumerate() {
        let e = rel_err(&logits[pos], row);
        let want = argmax(row);
        worst = worst.max(e);
        equal &= picks[pos] == want;
        println!(
            "{label}: pos {pos} token {} -> gpu {} cpu {want} rel err {e:.3e}",
            fed[pos], picks[pos]
        );
    }
    (worst, equal)
}

/// VmHWM of this process, for the log.
fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "unknown".into())
}

/// 72B (145 GB of bf16, more than the GPU machine's host memory) on one
/// GPU: weights streamed from the synthetic source, 8 greedy steps on both
/// drivers against the streamed CPU reference.
#[test]
fn scale_72b() {
    let test = "scale_72b";
    if !device_or_skip(test) {
        return;
    }
    let config = Config::preset("72b").unwrap();
    let source = SyntheticSource::new(&config, SEED).unwrap();
    let mut runs = Vec::new();
    for name in ["cudarc", "cust"] {
        let label = format!("{test} {name}");
        let (fed, picks, logits) = if name == "cudarc" {
            gpu_run_streamed::<CudarcDriver>(&source, None, &PROMPT[..1], GREEDY_72B, &label)
        } else {
            gpu_run_streamed::<CustDriver>(&source, None, &PROMPT[..1], GREEDY_72B, &label)
        };
        runs.push((label, fed, picks, logits));
    }
    let identical = runs[0].2 == runs[1].2 && runs[0].3 == runs[1].3;
    // Bit-identical runs share one CPU pass (72B of weights regenerated).
    let checked = if identical { &runs[..1] } else { &runs[..] };
    for (label, fed, picks, logits) in checked {
        let (err, ok) = check_streamed(label, &source, fed, picks, logits, &mut None);
        println!("{label}: RESULT {GREEDY_72B} greedy steps, ids equal {ok}, max rel err {err:.3e}, cudarc == cust bit-identical {identical}");
        assert!(ok, "{label}: greedy ids differ from the CPU reference");
        assert!(err <= TOL, "{label}: logits error {err:.3e} over {TOL}");
    }
    assert!(identical, "{test}: cudarc and cust differ");
}

/// The 32-bit trap bisected at 72B shapes, one tensor group at a time: with
/// the plan's split turned off for gate/up/down only (10 chunks each in the
/// plan) and for q/o only (3 chunks), the first N-layer model that decodes
/// wrong is the one the layout crate predicts for that group; with the plan
/// on, the same N is right. Turning the split off for one group at a time
/// matters: gate/up/down wrap from layer 8 and would hide q/o's wrap at
/// layer 32.
#[test]
fn bisect_72b() {
    let test = "bisect_72b";
    if !device_or_skip(test) {
        return;
    }
    let full = Config::preset("72b").unwrap();
    let mut rows = Vec::new();
    for group in [
        &["gate_proj", "up_proj", "down_proj"][..],
        &["q_proj", "o_proj"][..],
    ] {
        let specs = qmk_model::stacked_specs(&full).unwrap();
        let planned = plan_model(&specs, &KERNEL_OFFSET_MODEL).unwrap();
        let mut predicted = Vec::new();
        for name in group {
            let spec = specs.iter().find(|s| s.name == *name).unwrap();
            let chunks = planned.tensor(name).unwrap().chunks.len();
            let p = first_wrapping_slice(spec, &KERNEL_OFFSET_MODEL)
                .unwrap()
                .unwrap();
            println!("{test}: {name}: {chunks} chunks in the plan; the layout crate predicts layer {p} is the first whose 32-bit byte offsets wrap unsplit");
            predicted.push(p as usize);
        }
        let p = *predicted.iter().min().unwrap();
        for n in [p, p + 1] {
            let mut c = full.clone();
            c.num_hidden_layers = n;
            let source = SyntheticSource::new(&c, SEED).unwrap();
            let plan = unsplit(&c, group);
            let mut memo = None;
            for (name, plan) in [("split", None), ("unsplit", Some(plan))] {
                let label = format!("{test} {} N={n} {name}", group.join("/"));
                let (fed, picks, logits) =
                    gpu_run_streamed::<CudarcDriver>(&source, plan, &PROMPT, 1, &label);
                let (err, ok) = check_streamed(&label, &source, &fed, &picks, &logits, &mut memo);
                let clean = ok && err <= TOL;
                println!(
                    "{label}: RESULT ids equal {ok}, max rel err {err:.3e} -> {}",
                    if clean { "clean" } else { "WRONG" }
                );
                rows.push((group.join("/"), p, n, name, clean));
            }
        }
    }
    for (group, p, n, name, clean) in &rows {
        let want = *name == "split" || *n <= *p;
        println!(
            "{test}: {group} | N={n} | {name} | {} (expected {})",
            if *clean { "clean" } else { "WRONG" },
            if want { "clean" } else { "WRONG" }
        );
    }
    for (group, p, n, name, clean) in rows {
        let want = name == "split" || n <= p;
        assert_eq!(
            clean, want,
            "{group} N={n} {name}: the layout crate predicts the first wrong layer is {p}"
        );
    }
}

/// The kernel's plan for `config` with the tensors in `names` in one chunk
/// each (their split turned off; everything else as planned). The plan
/// claims the wrong offset model (32-bit element offsets), as a planner
/// that models the wrong arithmetic would: the kernel's compile-time check
/// that every chunk fits its offsets then passes for an N-layer model
/// whose unsplit tensors hold fewer than 2^32 elements, while the kernel,
/// which computes 32-bit byte offsets, wraps.
fn unsplit(config: &Config, names: &[&str]) -> ModelPlan {
    let specs = qmk_model::stacked_specs(config).unwrap();
    let mut plan = plan_model(&specs, &KERNEL_OFFSET_MODEL).unwrap();
    let whole = plan_model(&specs, &NO_SPLIT).unwrap();
    for t in plan.tensors.iter_mut() {
        if names.contains(&t.spec.name.as_str()) {
            *t = whole.tensor(&t.spec.name).unwrap().clone();
        }
    }
    plan.offset_model = WRONG_MODEL;
    plan
}

/// 64-bit offsets: a plan made with it splits nothing.
const NO_SPLIT: OffsetModel = OffsetModel {
    bits: 64,
    unit: OffsetUnit::Bytes,
};

/// A zero-layer stand-in while the real weights are shared.
fn placeholder() -> Weights {
    let mut c = Config::preset("0.5b").unwrap();
    c.vocab_size = 8;
    c.hidden_size = 64;
    c.intermediate_size = 64;
    c.num_attention_heads = 1;
    c.num_key_value_heads = Some(1);
    c.head_dim = Some(64);
    c.num_hidden_layers = 1;
    Weights::zeroed(&c).unwrap()
}

/// One 14B decode step (for compute-sanitizer: `compute-sanitizer --tool
/// memcheck scale-tests --exact one_step_14b`).
#[test]
fn one_step_14b() {
    let test = "one_step_14b";
    if !device_or_skip(test) {
        return;
    }
    let config = Config::preset("14b").unwrap();
    let Some(w) = weights_or_skip(test, &config) else {
        return;
    };
    let (ids, _, chunks, _) = gpu_run::<CudarcDriver>(&w, None, &PROMPT[..1], false, test);
    println!("{test}: RESULT gate_proj chunks {chunks}, pick {}", ids[0]);
}

/// Writes the cubins the scale tests need (sm_90) into
/// `QMK_SCALE_PRECOMPILE`, named by fingerprint, so the GPU machine runs
/// no NVRTC.
#[test]
#[ignore = "writes cubins; run by hand before a GPU run"]
fn precompile_cubins() {
    let dir = PathBuf::from(
        std::env::var_os("QMK_SCALE_PRECOMPILE").expect("set QMK_SCALE_PRECOMPILE=DIR"),
    );
    std::fs::create_dir_all(&dir).unwrap();
    let compiler = qmk_kernels::Compiler::new().unwrap();
    let arch = qmk_kernels::Arch::parse("sm_90").unwrap();
    let mut builds = vec![
        KernelBuild::new(&Config::preset("14b").unwrap()).unwrap(),
        KernelBuild::new(&Config::preset("32b").unwrap()).unwrap(),
    ];
    let ns: Vec<usize> = std::env::var("QMK_BISECT_LAYERS")
        .map(|s| s.split(',').map(|x| x.trim().parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![30, 31]);
    for n in ns {
        let mut c = Config::preset("14b").unwrap();
        c.num_hidden_layers = n;
        builds.push(KernelBuild::new(&c).unwrap());
        let wrong = plan_model(&qmk_model::stacked_specs(&c).unwrap(), &WRONG_MODEL).unwrap();
        builds.push(KernelBuild::with_plan(&c, wrong).unwrap());
    }
    // 72B: the whole model, and the bisection's N-layer models with the
    // plan and with one group's split turned off.
    let full = Config::preset("72b").unwrap();
    builds.push(KernelBuild::new(&full).unwrap());
    for (group, p) in [
        (&["gate_proj", "up_proj", "down_proj"][..], 8),
        (&["q_proj", "o_proj"][..], 32),
    ] {
        for n in [p, p + 1] {
            let mut c = full.clone();
            c.num_hidden_layers = n;
            builds.push(KernelBuild::new(&c).unwrap());
            builds.push(KernelBuild::with_plan(&c, unsplit(&c, group)).unwrap());
        }
    }
    for b in builds {
        let t = Instant::now();
        let p = dir.join(format!("{:016x}.cubin", b.fingerprint));
        if p.is_file() {
            continue;
        }
        let cubin = compiler.compile(&b, arch).unwrap();
        cubin.write(&p).unwrap();
        println!(
            "{} ({} layers): {:.1} s",
            p.display(),
            b.config.num_hidden_layers,
            t.elapsed().as_secs_f64()
        );
    }
}
