//! GPU tests of the backend on both drivers: every check is one generic
//! function over [`Driver`], instantiated for cudarc and cust by [`both!`];
//! plus the cross-driver check that both produce identical ids and
//! bit-identical logits. Each test skips with a printed reason when there
//! is no CUDA device (with the stub libcuda: CUDA_ERROR_NO_DEVICE).
//!
//! On the GPU machine, from the prebuilt binary:
//! `gpu-<hash> --test-threads=1 --nocapture`.

use qmk_gpu_tests::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use qmk_engine::Backend;
use qmk_gpu::{Driver, Error, GpuBackend, Options};
use qmk_kernels::params::FLAG_ATTN_FORCE_SPLIT;
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::{Config, Weights};

/// A fixed prompt (Qwen2.5 token ids), fed one step at a time.
const PROMPT: [u32; 8] = [9707, 11, 1879, 0, 3555, 374, 279, 6722];
const GREEDY_STEPS: usize = 32;
const STEPS: usize = PROMPT.len() + GREEDY_STEPS;
const CAPACITY: usize = STEPS + 1;
const TOL: f64 = 1e-2;

/// The CPU reference's greedy run over the prompt: the token fed at each
/// position and the logits, computed once per preset and shared by both
/// backends' tests.
struct RefRun {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn reference_run(preset: &str, w: &Arc<Weights>) -> Arc<RefRun> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<RefRun>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(r) = cache.lock().unwrap().get(preset) {
        return r.clone();
    }
    let t = Instant::now();
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(CAPACITY).kv_bf16(true)).unwrap();
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let mut token = PROMPT[0];
    for pos in 0..STEPS {
        if let Some(&t) = PROMPT.get(pos) {
            token = t;
        }
        let l = cpu.step(token, pos).unwrap();
        tokens.push(token);
        token = argmax(&l);
        logits.push(l);
    }
    println!(
        "{preset}: CPU reference, {STEPS} steps in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let r = Arc::new(RefRun { tokens, logits });
    cache.lock().unwrap().insert(preset.to_string(), r.clone());
    r
}

/// Prompt, then 32 greedy steps: at every step the backend's pick equals the
/// argmax of its own logits and the CPU reference's pick, and its logits are
/// within 1e-2 relative error of the reference's.
fn matches_reference<D: Driver>(preset: &str) {
    matches_reference_with::<D>(preset, false);
}

/// [`matches_reference`] with the tensor-core weight phases
/// (`Options::tensor_cores`), which must really run on the device; then the
/// prompt again through the prefill kernel, which reads their tile-order
/// weights: its last position's logits within the same bound.
fn tensor_cores_match_reference<D: Driver>(preset: &str) {
    matches_reference_with::<D>(preset, true);
}

fn matches_reference_with<D: Driver>(preset: &str, tensor_cores: bool) {
    let tc = if tensor_cores { ", tensor cores" } else { "" };
    let test = format!("{preset} {}{tc} vs CPU reference", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let r = reference_run(preset, &w);
    let opts = Options {
        tensor_cores,
        ..with_capacity(CAPACITY)
    };
    let mut gpu: GpuBackend<D> = open(&w, opts);
    if tensor_cores {
        assert!(
            gpu.kernel_build().tensor_core_phases(gpu.arch()).is_some(),
            "{test}: the tensor-core phases do not run on {}",
            describe(&gpu)
        );
    }
    let mut max_err = 0f64;
    for pos in 0..STEPS {
        let token = r.tokens[pos];
        let out = gpu.step(token, pos).unwrap();
        let lg = gpu.logits().unwrap();
        let e = rel_err(&lg, &r.logits[pos]);
        max_err = max_err.max(e);
        let (ig, ic) = (out.argmax, argmax(&r.logits[pos]));
        assert_eq!(
            ig,
            argmax(&lg),
            "{test}: pos {pos}: kernel argmax disagrees with its logits"
        );
        assert!(
            e <= TOL,
            "{test}: pos {pos}: relative logits error {e:.3e} > {TOL}"
        );
        if pos + 1 >= PROMPT.len() {
            assert_eq!(
                ig, ic,
                "{test}: pos {pos}: greedy ids differ (gpu {ig}, cpu {ic})"
            );
        }
    }
    println!("{test}: {GREEDY_STEPS} greedy steps, ids equal, max rel err {max_err:.3e}");
    if tensor_cores {
        gpu.reset().unwrap();
        let n = PROMPT.len();
        let out = gpu.prefill(&r.tokens[..n], 0).unwrap();
        let lg = gpu.logits().unwrap();
        let e = rel_err(&lg, &r.logits[n - 1]);
        assert!(
            e <= TOL,
            "{test}: prefill: relative logits error {e:.3e} > {TOL}"
        );
        assert_eq!(out.argmax, argmax(&r.logits[n - 1]), "{test}: prefill pick");
        println!("{test}: prefill of {n} tokens, rel err {e:.3e}");
    }
}

/// Same run twice: bit-identical logits; a prompt fed as queued decode
/// steps equals the same prompt step by step; bad inputs are typed errors;
/// a real hang becomes a kernel error (spin budget) or a timeout (host
/// deadline), and reset() recovers.
fn errors_and_determinism<D: Driver>() {
    let test = format!("{} errors and determinism", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let vocab = w.config.vocab_size as u32;
    let mut b: GpuBackend<D> = open(&w, with_capacity(64));
    let run = |b: &mut GpuBackend<D>| -> Vec<Vec<f32>> {
        b.reset().unwrap();
        let mut tok = PROMPT[0];
        (0..12)
            .map(|pos| {
                tok = b.step(tok, pos).unwrap().argmax;
                b.logits().unwrap()
            })
            .collect()
    };
    let a = run(&mut b);
    let c = run(&mut b);
    assert!(a == c, "{test}: logits differ between two identical runs");
    let barriers = b.barriers_last_step().unwrap();
    assert_eq!(barriers, b.kernel_build().barriers_per_step);
    println!("{test}: 12 steps bit-identical across two runs, {barriers} barriers/step");

    // A prompt below `prefill_min_tokens` goes as decode steps queued back
    // to back with one wait: bit-identical to feeding it step by step.
    b.set_prefill_min_tokens(usize::MAX);
    b.reset().unwrap();
    let mut last = 0;
    for (pos, &t) in PROMPT.iter().enumerate() {
        last = b.step(t, pos).unwrap().argmax;
    }
    let stepped = b.logits().unwrap();
    b.reset().unwrap();
    let out = b.prefill(&PROMPT, 0).unwrap();
    assert_eq!(out.argmax, last, "{test}: queued prefill picked another id");
    assert!(
        b.logits().unwrap() == stepped,
        "{test}: queued prefill logits differ from step by step"
    );
    b.set_prefill_min_tokens(qmk_gpu::DEFAULT_PREFILL_MIN_TOKENS);
    println!(
        "{test}: prefill of {} tokens as queued steps = step by step",
        PROMPT.len()
    );

    let expect = |r: qmk_gpu::Result<qmk_engine::StepOutput>, needle: &str| {
        let e = r.expect_err(needle).to_string();
        println!("{test}: -> {e}");
        assert!(
            e.contains(needle),
            "{test}: expected an error containing {needle:?}, got: {e}"
        );
    };
    b.reset().unwrap();
    expect(b.step(vocab, 0), "outside the vocabulary");
    expect(b.step(1, 64), "the KV cache holds 64 positions");
    expect(b.step(1, 5), "positions must be fed in order");

    b.set_debug_hang(true);
    b.set_spin_timeout(Duration::from_millis(20));
    let e = b.step(1, 0).unwrap_err();
    assert!(matches!(e, Error::Kernel { code: 1, .. }), "{test}: {e}");
    expect(Err(e), "grid barrier timed out");
    expect(b.step(1, 0), "needs reset()");
    b.reset().unwrap();

    b.set_spin_timeout(Duration::from_secs(60));
    b.set_step_deadline(Duration::from_millis(200));
    let t = Instant::now();
    let e = b.step(1, 0).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{test}: {e}");
    expect(Err(e), "did not finish within 200 ms");
    println!(
        "{test}: host deadline fired after {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    b.set_debug_hang(false);
    b.set_spin_timeout(Duration::from_secs(2));
    b.set_step_deadline(Duration::from_secs(30));
    b.reset().unwrap();
    assert_eq!(b.step(PROMPT[0], 0).unwrap().argmax, argmax(&a[0]));
    println!("{test}: token, position, spin timeout, host deadline all typed; reset recovers");
}

/// One backend's greedy run: (ids picked, logits) per step.
fn greedy<D: Driver>(w: &Weights) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut b: GpuBackend<D> = open(w, with_capacity(CAPACITY));
    let (mut ids, mut logits) = (Vec::new(), Vec::new());
    let mut token = PROMPT[0];
    for pos in 0..STEPS {
        if let Some(&t) = PROMPT.get(pos) {
            token = t;
        }
        token = b.step(token, pos).unwrap().argmax;
        ids.push(token);
        logits.push(b.logits().unwrap());
    }
    (ids, logits)
}

/// Same weights, same prompt, 32 greedy steps: identical ids and
/// bit-identical logits through cudarc and cust (one backend, one cubin,
/// one parameter block, one grid: any difference is a driver-side bug).
fn drivers_agree(preset: &str) {
    let test = format!("{preset} cudarc == cust");
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let (ids_a, log_a) = greedy::<CudarcDriver>(&w);
    let (ids_b, log_b) = greedy::<CustDriver>(&w);
    assert_eq!(ids_a, ids_b, "{test}: token ids differ");
    for (pos, (a, b)) in log_a.iter().zip(&log_b).enumerate() {
        let diff = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            diff, 0,
            "{test}: pos {pos}: {diff} logits differ in their bits"
        );
    }
    println!("{test}: {STEPS} steps, ids identical, logits bit-identical; ids {ids_a:?}");
}

// Test names sort so that one preset's tests run together (weights cache).
both!(a_errors_and_determinism, errors_and_determinism);
both!(b_0_5b_matches_reference, matches_reference, "0.5b");
both!(c_7b_matches_reference, matches_reference, "7b");
both!(
    c_7b_tensor_cores_match_reference,
    tensor_cores_match_reference,
    "7b"
);

#[test]
fn b_0_5b_drivers_bit_identical() {
    drivers_agree("0.5b");
}

#[test]
fn c_7b_drivers_bit_identical() {
    drivers_agree("7b");
}

/// Runs everywhere: with no device (CI, the stub libcuda) the error is the
/// typed "no CUDA device" (or "no CUDA driver"), with a message that says so.
fn no_device_is_a_typed_error<D: Driver>() {
    match qmk_gpu::device_count::<D>() {
        Ok(n) => println!("{}: {n} CUDA device(s): nothing to check here", D::NAME),
        Err(e) => {
            println!("{} without a device: {e}", D::NAME);
            assert!(matches!(e, Error::NoDevice(_) | Error::NoDriver), "{e:?}");
            assert!(e.to_string().contains("no CUDA"), "{e}");
            let w = weights("0.5b");
            let e = GpuBackend::<D>::new(&w, Options::default(), &mut ()).unwrap_err();
            assert!(matches!(e, Error::NoDevice(_) | Error::NoDriver), "{e:?}");
        }
    }
}

/// The 32-bit trap on the GPU: a 14B-shaped `gate_proj` read through the
/// kernel's offset arithmetic goes wrong exactly at the layer the layout
/// crate predicts when unsplit, and nowhere with the planner's split.
fn trap_probe_wraps_where_predicted<D: Driver>() {
    let test = format!("{} trap probe, 14B gate_proj", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let mut b: GpuBackend<D> = open(&w, with_capacity(16));
    let cfg = Config::preset("14b").unwrap();
    let r = b.trap_probe(&cfg, "gate_proj").unwrap();
    println!(
        "{test}: {} {} ({} bytes, {} bytes/layer): predicted first wrong layer {:?}",
        r.tensor, r.layout, r.total_bytes, r.layer_bytes, r.predicted_first_wrong
    );
    println!(
        "  split   chunks {:?}: wrong layers {:?}",
        r.split.chunks, r.split.wrong_layers
    );
    println!(
        "  unsplit chunks {:?}: first wrong {:?}, wrong layers {:?}",
        r.unsplit.chunks, r.unsplit.first_wrong, r.unsplit.wrong_layers
    );
    println!("  unsplit reads landed in layers {:?}", r.unsplit.landed_in);
    assert_eq!(r.predicted_first_wrong, Some(30));
    assert!(r.split.wrong_layers.is_empty());
    assert_eq!(r.unsplit.first_wrong, Some(30));
    assert!(r.as_predicted());
}

/// A cubin written to a file loads; one built for another model is refused
/// by its fingerprint; a KV cache larger than the GPU and one whose layer
/// passes the kernel's 32-bit offsets are typed errors with the numbers.
fn cubin_files_and_memory_errors<D: Driver>() {
    let test = format!("{} cubin files and memory errors", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let arch = qmk_gpu::device_info::<D>(0).unwrap().arch;
    let w = weights("0.5b");
    let compiler = qmk_kernels::Compiler::new().unwrap();
    let dir = std::env::temp_dir().join(format!("qmk-gpu-test-{}-{}", D::NAME, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let own = dir.join("own.cubin");
    let build = qmk_kernels::KernelBuild::new(&w.config).unwrap();
    compiler.compile(&build, arch).unwrap().write(&own).unwrap();
    let opts = Options {
        capacity: 16,
        cubin: Some(own),
        ..Options::default()
    };
    let mut b = GpuBackend::<D>::new(&w, opts, &mut ()).unwrap();
    b.step(PROMPT[0], 0).unwrap();
    drop(b);
    let foreign = dir.join("foreign.cubin");
    let other = qmk_kernels::KernelBuild::new(&Config::preset("1.5b").unwrap()).unwrap();
    compiler
        .compile(&other, arch)
        .unwrap()
        .write(&foreign)
        .unwrap();
    let opts = Options {
        capacity: 16,
        cubin: Some(foreign),
        ..Options::default()
    };
    let e = GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_err();
    println!("{test}: foreign cubin -> {e}");
    assert!(matches!(e, Error::Fingerprint { .. }), "{e}");
    let e = GpuBackend::<D>::new(&w, with_capacity(15_000_000), &mut ()).unwrap_err();
    println!("{test}: 15M-position KV cache -> {e}");
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    let e = GpuBackend::<D>::new(&w, with_capacity(20_000_000), &mut ()).unwrap_err();
    println!("{test}: 20M-position KV cache -> {e}");
    assert!(
        matches!(
            e,
            Error::Option {
                field: "capacity",
                ..
            }
        ),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

both!(no_device_is_a_typed_error, no_device_is_a_typed_error);
both!(d_trap_probe_14b, trap_probe_wraps_where_predicted);
both!(
    e_cubin_files_and_memory_errors,
    cubin_files_and_memory_errors
);

/// The step timeline changes no result: 12 traced steps give the picks and
/// bit-identical logits of 12 plain ones. Every trace is well formed (each
/// CTA's stamps in order; no CTA leaves a barrier before the last arrival,
/// up to 2 us of timer skew between multiprocessors), and the bench's
/// timeline splits the step: ops, barriers, launch skew and tail add up to
/// it. With the split attention forced at 300 positions, its marks split the
/// attention's critical path.
fn step_timeline<D: Driver>() {
    let test = format!("{} step timeline", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let mut b: GpuBackend<D> = open(&w, with_capacity(64));
    b.reset().unwrap();
    let mut tok = PROMPT[0];
    let mut plain = Vec::new();
    for pos in 0..12 {
        tok = b.step(tok, pos).unwrap().argmax;
        plain.push((tok, b.logits().unwrap()));
    }
    b.reset().unwrap();
    let mut tok = PROMPT[0];
    let barriers = b.kernel_build().barriers_per_step;
    for (pos, (want, logits)) in plain.iter().enumerate() {
        let (out, trace) = b.step_traced(tok, pos).unwrap();
        tok = out.argmax;
        assert_eq!(tok, *want, "{test}: step {pos} picked another id");
        assert!(
            b.logits().unwrap() == *logits,
            "{test}: step {pos}: logits differ with the timeline on"
        );
        assert_eq!(trace.barriers(), barriers);
        if let Err(e) = trace.check(2_000) {
            panic!("{test}: step {pos}: {e}");
        }
    }
    let t = b
        .bench_timeline(&qmk_gpu::BenchOptions {
            warmup: 4,
            steps: 16,
            ..Default::default()
        })
        .unwrap();
    let parts = t.parts_us();
    println!(
        "{test}: 12 traced steps equal plain ones; timeline {:.1} us/step (parts {parts:.1}), barriers {:.1} us, timer step <= {} ns",
        t.total_us,
        t.barrier_us(),
        t.tick_ns
    );
    for r in &t.rows {
        println!(
            "{test}:   {:<12} critical {:>8.1} us, mean CTA busy {:>8.1} us, barriers {:>6.1} us",
            r.name, r.critical_us, r.busy_mean_us, r.barrier_us
        );
        assert!(r.critical_us > 0.0, "{test}: {} took no time", r.name);
    }
    // Medians of sums need not add up exactly; within 5 %.
    assert!(
        (parts - t.total_us).abs() <= 0.05 * t.total_us,
        "{test}: parts {parts:.1} us vs step {:.1} us",
        t.total_us
    );
    assert!(
        t.attention.is_none(),
        "{test}: attention marks at 12 positions, where the split attention does not run"
    );

    // The split attention's marks: at 300 positions with the split forced,
    // 2 blocks per kv head (0.5B: 2 kv heads), so 4 items per layer, and
    // the last of each kv head's items combines.
    let mut b: GpuBackend<D> = open(&w, with_capacity(320));
    b.set_kernel_flags(FLAG_ATTN_FORCE_SPLIT, true);
    let t = b
        .bench_timeline(&qmk_gpu::BenchOptions {
            warmup: 2,
            steps: 8,
            context: 300,
            ..Default::default()
        })
        .unwrap();
    let a = t
        .attention
        .unwrap_or_else(|| panic!("{test}: no attention marks with the split forced"));
    let crit = t.rows[1].critical_us;
    println!("{test}: split attention at 300 positions: {a:?}; attention critical {crit:.1} us");
    assert_eq!(a.items, 4.0, "{test}: items per layer");
    assert!(
        a.stream_us > 0.0 && a.combine_us > 0.0 && a.combine_tail_us > 0.0,
        "{test}: {a:?}"
    );
    let sum = a.to_last_partial_us + a.combine_tail_us + a.to_arrival_us;
    assert!(
        (sum - crit).abs() <= 0.05 * crit,
        "{test}: the attention's parts {sum:.1} us vs its critical path {crit:.1} us"
    );
}

both!(f_step_timeline, step_timeline);
