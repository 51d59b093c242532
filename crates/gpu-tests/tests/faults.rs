//! Fault tests on both drivers: a hang, a counter that is never signalled,
//! an illegal address, the sanitizer targets and a cubin for another
//! architecture.
//!
//! A hang or an illegal address must not take the test process down with
//! it, so each fault runs in a child process: the parent test re-executes
//! this test binary (`--exact <child> --nocapture --test-threads=1`) with
//! `QMK_FAULT_CHILD=<child>` and asserts on the child's exit status and
//! output. The child tests do nothing unless that variable names them, so a
//! normal `cargo test` runs only the parents, which skip with a printed
//! reason where there is no GPU.
//!
//! On the GPU machine: `faults-<hash> --test-threads=1 --nocapture`.

use qmk_engine::{Backend, MultiStep};
use qmk_gpu_tests::*;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use qmk_gpu::{Driver, Error, GpuBackend, Options};
use qmk_kernels::params::{FLAG_ATTN_FORCE_SPLIT, FLAG_DEBUG_NO_TICKET};
use qmk_kernels::{Arch, Compiler, KernelBuild};
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::{synthetic_weights, Config, Weights};

/// The variable that marks a child process and names the child test.
const CHILD: &str = "QMK_FAULT_CHILD";

/// A fixed prompt (Qwen2.5 token ids).
const PROMPT: [u32; 8] = [9707, 11, 1879, 0, 3555, 374, 279, 6722];

/// Where a hung step must have turned into an error: the host deadline
/// (200 ms) plus the time the kernel takes to see the abort flag (its
/// spin-waits poll it) and the host's 20 us polling; 2 s is far below
/// `ABORT_GRACE` (10 s), past which the engine is declared dead instead.
const HANG_BOUND: Duration = Duration::from_secs(2);

fn is_child(name: &str) -> bool {
    std::env::var(CHILD).as_deref() == Ok(name)
}

/// Whether child test `me` runs here (only as `parent`'s child); prints why
/// not.
fn runs_as_child_of(me: &str, parent: &str) -> bool {
    let yes = is_child(me);
    if !yes {
        println!("{me}: runs only as the child of {parent}");
    }
    yes
}

/// Parent of a child test that prints `CHILD-OK <tag>` once its checks
/// pass: the child must exit 0 after printing it.
fn child_passes(test: &str, child: &str, tag: &str) {
    let Some((code, out)) = run_child(test, child) else {
        return;
    };
    assert_eq!(code, Some(0), "{test}: the child failed (output above)");
    assert!(
        out.contains(&format!("CHILD-OK {tag}")),
        "{test}: the child did not run its checks (output above)"
    );
}

/// Runs child test `child` of this binary in a subprocess; `None` (after
/// printing why) without a GPU. Returns (exit code, stdout + stderr).
fn run_child(test: &str, child: &str) -> Option<(Option<i32>, String)> {
    let _g = gpu_or_skip(test)?;
    let exe = std::env::current_exe().expect("the test binary's path");
    let t = Instant::now();
    let out = Command::new(&exe)
        .args(["--exact", child, "--nocapture", "--test-threads=1"])
        .env(CHILD, child)
        .output()
        .unwrap_or_else(|e| panic!("{test}: starting {}: {e}", exe.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "{test}: child `{child}` exited with {:?} after {:.1} s; its output:\n{text}\n-- end of child output",
        out.status.code(),
        t.elapsed().as_secs_f64()
    );
    Some((out.status.code(), text))
}

/// Child: a CTA that skips its first barrier arrival (FLAG_DEBUG_HANG) is a
/// typed kernel error within the spin budget, and a typed timeout within
/// the host deadline when the spin budget is long; reset() recovers.
fn hang_child<D: Driver>() {
    let me = format!("hang_child::{}", D::NAME);
    if !runs_as_child_of(&me, &format!("hang_is_bounded::{}", D::NAME)) {
        return;
    }
    let w = weights("0.5b");
    let opts = Options {
        capacity: 64,
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{me}: open: {e}"));
    println!("{}", describe(&b));
    let first = b.step(PROMPT[0], 0).unwrap().argmax;
    b.reset().unwrap();

    b.set_debug_hang(true);
    b.set_spin_timeout(Duration::from_millis(20));
    let t = Instant::now();
    let e = b.step(PROMPT[0], 0).unwrap_err();
    let el = t.elapsed();
    println!("CHILD hang, spin budget 20 ms: error after {el:?}: {e}");
    assert!(
        matches!(e, Error::Kernel { .. }),
        "{me}: expected a kernel error: {e:?}"
    );
    assert!(
        e.to_string().contains("grid barrier timed out"),
        "{me}: {e}"
    );
    assert!(el < HANG_BOUND, "{me}: the spin budget fired after {el:?}");
    b.reset().unwrap();

    let deadline = Duration::from_millis(200);
    b.set_spin_timeout(Duration::from_secs(60));
    b.set_step_deadline(deadline);
    let t = Instant::now();
    let e = b.step(PROMPT[0], 0).unwrap_err();
    let el = t.elapsed();
    println!("CHILD hang, host deadline 200 ms: error after {el:?}: {e}");
    assert!(
        matches!(e, Error::Timeout { .. }),
        "{me}: expected a timeout: {e:?}"
    );
    assert!(e.to_string().contains("200 ms"), "{me}: {e}");
    assert!(
        el >= deadline && el < deadline + HANG_BOUND,
        "{me}: the host deadline fired after {el:?} (bound {:?})",
        deadline + HANG_BOUND
    );

    b.set_debug_hang(false);
    b.set_spin_timeout(Duration::from_secs(2));
    b.set_step_deadline(Duration::from_secs(30));
    b.reset().unwrap();
    assert_eq!(b.step(PROMPT[0], 0).unwrap().argmax, first);
    println!(
        "CHILD-OK hang {}: spin budget and host deadline both typed errors within {HANG_BOUND:?}; reset recovers",
        D::NAME
    );
}

/// Parent of [`hang_child`].
fn hang_is_bounded<D: Driver>() {
    child_passes(
        &format!("hang_is_bounded {}", D::NAME),
        &format!("hang_child::{}", D::NAME),
        &format!("hang {}", D::NAME),
    );
}

/// Child: a CTA that never signals its counter. At 301 positions with the
/// split attention forced (2 blocks per kv head), the first item skips its
/// ticket (FLAG_DEBUG_NO_TICKET): every CTA that combines kv head 0 waits
/// for a count that never comes. The step must end in the typed counter
/// timeout within [`HANG_BOUND`], and after a reset the same step gives the
/// same pick as before.
fn ticket_child<D: Driver>() {
    let me = format!("ticket_child::{}", D::NAME);
    if !runs_as_child_of(&me, &format!("ticket_wait_is_bounded::{}", D::NAME)) {
        return;
    }
    let w = weights("0.5b");
    let opts = Options {
        capacity: 320,
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{me}: open: {e}"));
    println!("{}", describe(&b));
    let prompt: Vec<u32> = (0..300).map(|i| PROMPT[i % PROMPT.len()]).collect();
    b.set_kernel_flags(FLAG_ATTN_FORCE_SPLIT, true);
    let tok = b.prefill(&prompt, 0).unwrap().argmax;
    let want = b.step(tok, 300).unwrap().argmax;

    b.set_kernel_flags(FLAG_DEBUG_NO_TICKET, true);
    b.set_spin_timeout(Duration::from_millis(20));
    let t = Instant::now();
    let e = b.step(tok, 300).unwrap_err();
    let el = t.elapsed();
    println!("CHILD ticket, spin budget 20 ms: error after {el:?}: {e}");
    assert!(
        matches!(e, Error::Kernel { .. }),
        "{me}: expected a kernel error: {e:?}"
    );
    let m = e.to_string();
    assert!(m.contains("counter wait timed out"), "{me}: {m}");
    assert!(
        m.contains("attention"),
        "{me}: the error does not name the phase: {m}"
    );
    assert!(el < HANG_BOUND, "{me}: the spin budget fired after {el:?}");

    b.set_kernel_flags(FLAG_DEBUG_NO_TICKET, false);
    b.set_spin_timeout(Duration::from_secs(2));
    b.reset().unwrap();
    let tok2 = b.prefill(&prompt, 0).unwrap().argmax;
    assert_eq!(
        tok2, tok,
        "{me}: the prefill after the reset picked another id"
    );
    assert_eq!(
        b.step(tok, 300).unwrap().argmax,
        want,
        "{me}: the step after the reset"
    );
    println!(
        "CHILD-OK ticket {}: a missing ticket is a typed error within {HANG_BOUND:?}; reset recovers",
        D::NAME
    );
}

/// Parent of [`ticket_child`].
fn ticket_wait_is_bounded<D: Driver>() {
    child_passes(
        &format!("ticket_wait_is_bounded {}", D::NAME),
        &format!("ticket_child::{}", D::NAME),
        &format!("ticket {}", D::NAME),
    );
}

/// Child: an out-of-bounds read in the kernel (FLAG_DEBUG_OOB) is reported
/// once as a sticky error naming the CUDA error; every later call is refused
/// with the same "unusable" report, without a driver call or a panic; the
/// engine drops cleanly and the process exits 0.
fn oob_child<D: Driver>() {
    let me = format!("oob_child::{}", D::NAME);
    if !runs_as_child_of(&me, &format!("oob_is_sticky::{}", D::NAME)) {
        return;
    }
    let w = weights("0.5b");
    let opts = Options {
        capacity: 64,
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{me}: open: {e}"));
    println!("{}", describe(&b));
    b.step(PROMPT[0], 0).unwrap();

    b.set_debug_oob(true);
    let t = Instant::now();
    let e1 = b.step(PROMPT[1], 1).unwrap_err();
    println!("CHILD oob, first error after {:?}: {e1}", t.elapsed());
    let m1 = e1.to_string();
    assert!(e1.is_unusable(), "{me}: expected Unusable: {e1:?}");
    assert!(
        m1.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
        "{me}: the error does not name the CUDA error: {m1}"
    );
    assert!(m1.contains("unusable"), "{me}: {m1}");

    // The hook is off again: a refusal now cannot be a new kernel fault.
    b.set_debug_oob(false);
    let t = Instant::now();
    let e2 = b.step(PROMPT[1], 1).unwrap_err();
    let el = t.elapsed();
    println!("CHILD oob, next step refused after {el:?}: {e2}");
    assert!(e2.is_unusable(), "{me}: {e2:?}");
    assert_eq!(
        e2.to_string(),
        m1,
        "{me}: the refusal must repeat the first report, not a new CUDA error"
    );
    assert!(
        el < Duration::from_millis(50),
        "{me}: the refusal took {el:?} (a driver call or a launch?)"
    );
    let e3 = b.logits().unwrap_err();
    let e4 = b.reset().unwrap_err();
    for e in [&e3, &e4] {
        assert!(e.is_unusable(), "{me}: {e:?}");
        assert_eq!(e.to_string(), m1, "{me}");
    }
    println!("CHILD oob, logits() and reset() refused the same way");
    drop(b);
    println!(
        "CHILD-OK oob {}: sticky error reported once, later calls refused, dropped cleanly",
        D::NAME
    );
}

/// Parent of [`oob_child`]: also checks the process exit and that no panic
/// happened (in drop or anywhere else).
fn oob_is_sticky<D: Driver>() {
    let test = format!("oob_is_sticky {}", D::NAME);
    let Some((code, out)) = run_child(&test, &format!("oob_child::{}", D::NAME)) else {
        return;
    };
    assert!(!out.contains("panicked"), "{test}: the child panicked");
    assert_eq!(
        code,
        Some(0),
        "{test}: the child did not exit cleanly (output above)"
    );
    assert!(
        out.contains(&format!("CHILD-OK oob {}", D::NAME)),
        "{test}: the child did not run its checks (output above)"
    );
}

/// The sanitizer target (the GPU script runs it under compute-sanitizer
/// memcheck, racecheck, synccheck and initcheck): a 17-token prompt
/// through the tensor-core prefill in chunks of 16 (two launches), then 3
/// greedy decode steps, at 0.5B shapes (or those `sanitize_weights` is
/// told); the ids must be the CPU reference's. `QMK_TEST_SPIN_S` /
/// `QMK_TEST_DEADLINE_S` raise the spin budget and host deadline
/// (sanitizers slow kernels 10-100x).
fn sanitize_target<D: Driver>() {
    let test = format!("sanitize_target {}", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = sanitize_weights(&test);
    let prompt: Vec<u32> = PROMPT.iter().chain(&PROMPT).chain(&[13]).copied().collect();
    let steps = 3;
    let capacity = 32;
    let opts = Options {
        capacity,
        prefill_chunk: Some(16),
        // Every prompt through the prefill kernel (the default sends short
        // ones through decode steps).
        prefill_min_tokens: 1,
        spin_timeout: env_secs("QMK_TEST_SPIN_S", Duration::from_secs(2)),
        step_deadline: env_secs("QMK_TEST_DEADLINE_S", Duration::from_secs(30)),
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{test}: open: {e}"));
    println!("{}", describe(&b));
    assert_eq!(
        b.prefill_launch().map(|(_, chunk)| chunk),
        Some(16),
        "{test}: the prefill kernel is off"
    );
    let t = Instant::now();
    let mut tok = b.prefill(&prompt, 0).unwrap().argmax;
    let mut ids = vec![tok];
    for i in 0..steps {
        tok = b.step(tok, prompt.len() + i).unwrap().argmax;
        ids.push(tok);
    }
    println!(
        "{test}: prefill of {} tokens + {steps} steps in {:.2} s, ids {ids:?}",
        prompt.len(),
        t.elapsed().as_secs_f64()
    );

    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(capacity).kv_bf16(true)).unwrap();
    let mut logits = Vec::new();
    for (pos, &t) in prompt.iter().enumerate() {
        logits = cpu.step(t, pos).unwrap();
    }
    let mut want = vec![argmax(&logits)];
    for i in 0..steps {
        logits = cpu.step(*want.last().unwrap(), prompt.len() + i).unwrap();
        want.push(argmax(&logits));
    }
    assert_eq!(ids, want, "{test}: ids differ from the CPU reference");
    println!("{test}: ids equal the CPU reference");
}

/// Target of the sanitizer runs for the split attention: the KV cache
/// filled with the bench's synthetic K/V, then 3 greedy steps from position
/// 300 with the split attention forced and the step timeline on (its marks
/// inside the attention included): 2 blocks per kv head, so every kv head's
/// last block combines the partials. The long-context tests check its
/// results; here the sanitizers check its memory accesses and
/// synchronisation.
fn sanitize_split_target<D: Driver>() {
    let test = format!("sanitize_split_target {}", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = sanitize_weights(&test);
    let opts = Options {
        capacity: 320,
        spin_timeout: env_secs("QMK_TEST_SPIN_S", Duration::from_secs(2)),
        step_deadline: env_secs("QMK_TEST_DEADLINE_S", Duration::from_secs(30)),
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{test}: open: {e}"));
    b.set_kernel_flags(FLAG_ATTN_FORCE_SPLIT, true);
    let t = Instant::now();
    let tl = b
        .bench_timeline(&qmk_gpu::BenchOptions {
            warmup: 1,
            steps: 2,
            context: 300,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    let a = tl
        .attention
        .unwrap_or_else(|| panic!("{test}: no split-attention marks"));
    println!(
        "{test}: 3 steps from position 300 in {:.2} s, {} items per layer, combine {:.1} us",
        t.elapsed().as_secs_f64(),
        a.items,
        a.combine_us
    );
    assert_eq!(a.items, 4.0, "{test}: items per layer");
}

/// Target of the sanitizer runs for the multi-token step: one launch of
/// every T from 2 to the device's most, back to back over consecutive
/// positions of a synthetic sequence (each T's kernel once, its weight
/// rings and its causal attention among the new positions included). The
/// multi-token test program checks their bits against one-token steps;
/// here the ids are checked against the CPU reference and the sanitizers
/// check the memory accesses and synchronisation.
fn sanitize_multi_target<D: Driver>() {
    let test = format!("sanitize_multi_target {}", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = sanitize_weights(&test);
    let opts = Options {
        capacity: 64,
        spin_timeout: env_secs("QMK_TEST_SPIN_S", Duration::from_secs(2)),
        step_deadline: env_secs("QMK_TEST_DEADLINE_S", Duration::from_secs(30)),
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{test}: open: {e}"));
    let max = b.multi_max_tokens();
    assert!(max >= 2, "{test}: no multi-token step on {}", describe(&b));
    // One run of each T in 2..=max: (max + 2) * (max - 1) / 2 positions.
    let len = (2..=max).sum::<usize>();
    let vocab = w.config.vocab_size as u32;
    let tokens: Vec<u32> = synthetic_prompt(len, SEED)
        .into_iter()
        .map(|t| t % vocab)
        .collect();
    let t = Instant::now();
    let (mut ids, mut pos) = (Vec::with_capacity(len), 0);
    for n in 2..=max {
        let run = MultiStep::new(&tokens[pos..pos + n], pos, 64).unwrap();
        let out = b
            .step_many(run)
            .unwrap_or_else(|e| panic!("{test}: T = {n} at {pos}: {e}"));
        ids.extend(out.argmax);
        pos += n;
    }
    println!(
        "{test}: T = 2..={max} over {len} positions in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(64).kv_bf16(true)).unwrap();
    let want: Vec<u32> = tokens
        .iter()
        .enumerate()
        .map(|(p, &t)| argmax(&cpu.step(t, p).unwrap()))
        .collect();
    assert_eq!(ids, want, "{test}: ids differ from the CPU reference");
    println!("{test}: ids equal the CPU reference");
}

/// The sanitizer targets' weights: the preset `QMK_SAN_PRESET` names (0.5B
/// when unset), cut to its first n layers with `QMK_SAN_LAYERS=n` (every
/// layer runs the same code at the same shapes: the fallback when a
/// sanitizer is too slow for all of them). 0.5B's q/k/v stages its rows
/// and takes them in pairs; from 1.5B on q/k/v takes v's rows one by one
/// and no phase stages, so a larger preset covers those paths.
/// `QMK_SAN_VOCAB=n` cuts the vocabulary to n rows (the LM head's code is
/// the same for any row count; the sanitizers are slow on 151,936 of them).
fn sanitize_weights(test: &str) -> Arc<Weights> {
    let preset = std::env::var("QMK_SAN_PRESET").unwrap_or_else(|_| "0.5b".to_string());
    let mut c =
        Config::preset(&preset).unwrap_or_else(|e| panic!("{test}: QMK_SAN_PRESET={preset}: {e}"));
    let env_count = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
    };
    let (layers, vocab) = (env_count("QMK_SAN_LAYERS"), env_count("QMK_SAN_VOCAB"));
    if layers.is_none() && vocab.is_none() {
        return weights(&preset);
    }
    if let Some(n) = layers {
        c.num_hidden_layers = n;
    }
    if let Some(n) = vocab {
        c.vocab_size = n;
    }
    println!(
        "{test}: {preset} shapes, {} layers, vocabulary {} (QMK_SAN_LAYERS, QMK_SAN_VOCAB)",
        c.num_hidden_layers, c.vocab_size
    );
    Arc::new(synthetic_weights(&c, SEED))
}

/// Child, run by the GPU script under memcheck only: the OOB hook must be caught
/// (proves that the sanitizer run can fail). Its own check is only that the
/// step fails and the engine is unusable.
fn sanitize_oob_child<D: Driver>() {
    let me = format!("sanitize_oob_child::{}", D::NAME);
    if !is_child(&me) {
        println!("{me}: runs only under compute-sanitizer memcheck (the GPU script)");
        return;
    }
    let Some(_g) = gpu_or_skip(&me) else { return };
    let w = weights("0.5b");
    let opts = Options {
        capacity: 32,
        spin_timeout: env_secs("QMK_TEST_SPIN_S", Duration::from_secs(2)),
        step_deadline: env_secs("QMK_TEST_DEADLINE_S", Duration::from_secs(30)),
        ..Default::default()
    };
    let mut b =
        GpuBackend::<D>::new(&w, opts, &mut ()).unwrap_or_else(|e| panic!("{me}: open: {e}"));
    b.step(PROMPT[0], 0).unwrap();
    b.set_debug_oob(true);
    let e = b.step(PROMPT[1], 1).unwrap_err();
    println!("SANITIZE-OOB {}: {e}", D::NAME);
    assert!(e.is_unusable(), "{me}: {e:?}");
}

/// A cubin built for another architecture (sm_80 on
/// an sm_90 device, sm_90 on an sm_8x one) is a typed `CubinArch` error
/// naming both architectures and the file, not a crash. The driver does not
/// run SASS across major versions (CUDA_ERROR_NO_BINARY_FOR_GPU, 209).
fn wrong_arch_cubin<D: Driver>() {
    let test = format!("wrong_arch_cubin {}", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let info = qmk_gpu::device_info::<D>(0).unwrap();
    let other = if info.arch.0 / 10 == 8 {
        Arch(90)
    } else {
        Arch(80)
    };
    let w = weights("0.5b");
    let build = KernelBuild::new(&w.config).unwrap();
    let cubin = Compiler::new()
        .and_then(|c| c.compile(&build, other))
        .unwrap_or_else(|e| panic!("{test}: compiling for {other}: {e}"));
    let path = std::env::temp_dir().join(format!(
        "qmk-wrong-arch-{other}-{}-{}.cubin",
        D::NAME,
        std::process::id()
    ));
    cubin.write(&path).unwrap();
    let opts = Options {
        capacity: 16,
        cubin: Some(path.clone()),
        ..Default::default()
    };
    let r = GpuBackend::<D>::new(&w, opts, &mut ()).map(|_| ());
    let _ = std::fs::remove_file(&path);
    let e = r.expect_err("a cubin for another arch must not load");
    let m = e.to_string();
    println!(
        "{test}: {} cubin on {} ({}): {m}",
        other, info.name, info.arch
    );
    assert!(
        matches!(e, Error::CubinArch { .. }),
        "{test}: expected CubinArch: {e:?}"
    );
    for needle in [
        other.to_string(),
        info.arch.to_string(),
        path.display().to_string(),
        "CUDA_ERROR_".to_string(),
    ] {
        assert!(m.contains(&needle), "{test}: {needle:?} missing in: {m}");
    }
}

both!(hang_is_bounded, hang_is_bounded);
both!(hang_child, hang_child);
both!(ticket_wait_is_bounded, ticket_wait_is_bounded);
both!(ticket_child, ticket_child);
both!(oob_is_sticky, oob_is_sticky);
both!(oob_child, oob_child);
both!(sanitize_target, sanitize_target);
both!(sanitize_split_target, sanitize_split_target);
both!(sanitize_multi_target, sanitize_multi_target);
both!(sanitize_oob_child, sanitize_oob_child);
both!(wrong_arch_cubin, wrong_arch_cubin);
