//! GPU tests: the megakernel against the CPU reference on the same synthetic
//! weights, the trap probe, determinism and the error paths. Each test skips
//! with a printed reason when there is no CUDA device (or no libcuda).
//!
//! Run on the GPU machine from the prebuilt test binary (scripts/gpu/check.sh):
//! `gpu-<hash> --test-threads=1 --nocapture`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use qmk_backend_cudarc::{device_count, CudarcBackend, Error, Options};
use qmk_engine::Backend;
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::{synthetic_weights, Config, Weights};

/// One GPU test at a time: each launch wants every SM.
static GPU: Mutex<()> = Mutex::new(());

const SEED: u64 = 20261129;
/// A fixed prompt (Qwen2.5 token ids), fed one step at a time.
const PROMPT: [u32; 8] = [9707, 11, 1879, 0, 3555, 374, 279, 6722];
const GREEDY_STEPS: usize = 32;
const TOL: f64 = 1e-2;

fn gpu_or_skip(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    match device_count() {
        Ok(_) => Some(GPU.lock().unwrap_or_else(|e| e.into_inner())),
        Err(e) => {
            println!("SKIPPED {test}: {e}");
            None
        }
    }
}

fn rel_err(gpu: &[f32], cpu: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &c) in gpu.iter().zip(cpu) {
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    (num / den).sqrt()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn backend(w: &Weights, capacity: usize) -> CudarcBackend {
    let opts = Options {
        capacity,
        // Step-by-step prefill: the tests below compare it bit for bit with
        // single steps (the tensor-core prefill is tested in
        // crates/backend-cust/tests/prefill.rs).
        prefill_chunk: None,
        ..Options::default()
    };
    let b = CudarcBackend::new(w, opts, &mut ()).unwrap_or_else(|e| panic!("backend: {e}"));
    let l = b.launch_info();
    println!(
        "device {} ({}), grid {} x {} threads ({} CTA/SM of max {}), {} B dyn smem, {} regs, {} barriers/step",
        b.device().name,
        b.arch(),
        l.grid,
        l.block,
        l.ctas_per_sm,
        l.max_ctas_per_sm,
        l.smem_bytes,
        l.registers,
        b.kernel_build().barriers_per_step
    );
    b
}

/// Prompt, then greedy steps: ids equal and logits close at every step.
fn matches_reference(preset: &str) {
    let Some(_g) = gpu_or_skip(preset) else {
        return;
    };
    let config = Config::preset(preset).unwrap();
    let t = std::time::Instant::now();
    let w = Arc::new(synthetic_weights(&config, SEED));
    println!(
        "{preset}: synthetic weights in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let capacity = PROMPT.len() + GREEDY_STEPS + 1;
    let mut gpu = backend(&w, capacity);
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(capacity).kv_bf16(true)).unwrap();
    let mut token = PROMPT[0];
    let mut max_err = 0f64;
    let mut ids = Vec::new();
    for pos in 0..PROMPT.len() + GREEDY_STEPS {
        if let Some(&t) = PROMPT.get(pos) {
            token = t;
        }
        let out = gpu.step(token, pos).unwrap();
        let lg = gpu.logits().unwrap();
        let lc = cpu.step(token, pos).unwrap();
        let e = rel_err(&lg, &lc);
        max_err = max_err.max(e);
        let (ig, ic) = (out.argmax, argmax(&lc));
        println!(
            "{preset} pos {pos:2} token {token:6}: gpu {ig:6} cpu {ic:6} rel err {e:.3e} (gpu logits argmax {})",
            argmax(&lg)
        );
        assert_eq!(
            ig,
            argmax(&lg),
            "{preset} pos {pos}: kernel argmax disagrees with its logits"
        );
        assert!(
            e <= TOL,
            "{preset} pos {pos}: relative logits error {e:.3e} > {TOL}"
        );
        if pos + 1 >= PROMPT.len() {
            assert_eq!(ig, ic, "{preset} pos {pos}: greedy ids differ");
            ids.push(ig);
        }
        token = ig;
    }
    println!(
        "{preset}: {GREEDY_STEPS} greedy steps, ids equal, max rel err {max_err:.3e}; ids {ids:?}"
    );
}

#[test]
fn megakernel_matches_reference_0_5b() {
    matches_reference("0.5b");
}

#[test]
fn megakernel_matches_reference_7b() {
    matches_reference("7b");
}

#[test]
fn logits_are_bit_identical_across_runs_and_a_hang_becomes_an_error() {
    let Some(_g) = gpu_or_skip("determinism") else {
        return;
    };
    let config = Config::preset("0.5b").unwrap();
    let w = synthetic_weights(&config, SEED);
    let mut b = backend(&w, 64);
    let run = |b: &mut CudarcBackend| -> Vec<Vec<f32>> {
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
    assert!(a == c, "logits differ between two identical runs");
    println!("determinism: 12 steps bit-identical across two runs");

    // Prefill (steps launched back to back, one wait) = step by step.
    b.reset().unwrap();
    let mut last = 0;
    for (pos, &t) in PROMPT.iter().enumerate() {
        last = b.step(t, pos).unwrap().argmax;
    }
    let stepped = b.logits().unwrap();
    b.reset().unwrap();
    let out = b.prefill(&PROMPT, 0).unwrap();
    assert_eq!(out.argmax, last);
    assert!(
        b.logits().unwrap() == stepped,
        "prefill logits differ from step-by-step"
    );
    let next = b.step(out.argmax, PROMPT.len()).unwrap();
    println!(
        "prefill of {} tokens = step by step (bit-identical); next pick {}",
        PROMPT.len(),
        next.argmax
    );
    let bars = b.barriers_last_step().unwrap();
    println!("barriers in the last step: {bars}");
    assert_eq!(bars, b.kernel_build().barriers_per_step);

    // Bad inputs are typed errors, checked before launch.
    b.reset().unwrap();
    assert!(matches!(
        b.step(config.vocab_size as u32, 0),
        Err(Error::Token { .. })
    ));
    assert!(matches!(b.step(1, 64), Err(Error::Position { .. })));
    assert!(matches!(b.step(1, 5), Err(Error::Position { .. })));

    // A real hang (one CTA never arrives at the first barrier) with a short
    // spin budget: the waiting CTAs give up, the kernel reports where, the
    // engine asks for a reset, and a reset recovers.
    b.set_debug_hang(true);
    b.set_spin_timeout(Duration::from_millis(20));
    let t = std::time::Instant::now();
    let e = b.step(1, 0).unwrap_err();
    println!(
        "hang + 20 ms spin budget -> {e} (after {:.1} ms)",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(matches!(e, Error::Kernel { code: 1, .. }), "{e}");
    assert!(matches!(b.step(1, 0), Err(Error::NeedsReset(_))));
    b.reset().unwrap();

    // The same hang with a long spin budget: the host deadline (200 ms)
    // raises the abort flag, the kernel stops, the host reports a timeout.
    b.set_spin_timeout(Duration::from_secs(60));
    b.set_step_deadline(Duration::from_millis(200));
    let t = std::time::Instant::now();
    let e = b.step(1, 0).unwrap_err();
    println!(
        "hang + 200 ms host deadline -> {e} (after {:.1} ms)",
        t.elapsed().as_secs_f64() * 1e3
    );
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    b.set_debug_hang(false);
    b.set_spin_timeout(Duration::from_secs(2));
    b.set_step_deadline(Duration::from_secs(30));
    b.reset().unwrap();
    assert_eq!(b.step(PROMPT[0], 0).unwrap().argmax, argmax(&a[0]));
    println!("error paths: token, position, spin timeout, host deadline all typed; reset recovers");
}

#[test]
fn trap_probe_wraps_unsplit_exactly_where_predicted_14b() {
    let Some(_g) = gpu_or_skip("trap probe") else {
        return;
    };
    let w = synthetic_weights(&Config::preset("0.5b").unwrap(), SEED);
    let mut b = backend(&w, 16);
    let cfg = Config::preset("14b").unwrap();
    let r = b.trap_probe(&cfg, "gate_proj").unwrap();
    println!(
        "trap probe {} {} ({} bytes, {} bytes/layer): predicted first wrong layer {:?}",
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

#[test]
fn cubin_from_file_memory_errors_and_foreign_cubins_are_typed() {
    let Some(_g) = gpu_or_skip("cubin/memory errors") else {
        return;
    };
    let arch = qmk_backend_cudarc::device_info(0).unwrap().arch;
    let w = synthetic_weights(&Config::preset("0.5b").unwrap(), SEED);
    // A cubin written to a file (what `qwen-mk compile` does) loads.
    let compiler = qmk_kernels::Compiler::new().unwrap();
    let dir = std::env::temp_dir().join(format!("qmk-gpu-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let own = dir.join("own.cubin");
    let build = qmk_kernels::KernelBuild::new(&w.config).unwrap();
    compiler.compile(&build, arch).unwrap().write(&own).unwrap();
    let opts = Options {
        capacity: 16,
        cubin: Some(own),
        ..Options::default()
    };
    let mut b = CudarcBackend::new(&w, opts, &mut ()).unwrap();
    b.step(PROMPT[0], 0).unwrap();
    drop(b);
    // A cubin built for another model is refused by its fingerprint.
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
    let e = CudarcBackend::new(&w, opts, &mut ()).unwrap_err();
    println!("foreign cubin -> {e}");
    assert!(matches!(e, Error::Fingerprint { .. }), "{e}");
    // A KV cache larger than the GPU: a typed error with the numbers.
    let opts = Options {
        capacity: 15_000_000,
        ..Options::default()
    };
    let e = CudarcBackend::new(&w, opts, &mut ()).unwrap_err();
    println!("15M-position KV cache -> {e}");
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    // One KV layer past the kernel's 32-bit in-layer offsets.
    let opts = Options {
        capacity: 20_000_000,
        ..Options::default()
    };
    let e = CudarcBackend::new(&w, opts, &mut ()).unwrap_err();
    println!("20M-position KV cache -> {e}");
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
