//! GPU tests of both CUDA backends: every check is one generic function over
//! [`Gpu`] (a [`Backend`] plus the test hooks), instantiated for
//! `CudarcBackend` and `CustBackend` by [`both!`]; plus the cross-backend
//! check that both produce identical ids and bit-identical logits.
//! Each test skips with a printed reason when there is no CUDA device
//! (here with the stub libcuda: CUDA_ERROR_NO_DEVICE).
//!
//! On the GPU machine, from the prebuilt binary (scripts/gpu/cust-and-bench.sh):
//! `cust-gpu-tests --test-threads=1 --nocapture`.

#[macro_use]
mod common;
use common::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use qmk_backend_cudarc::CudarcBackend;
use qmk_backend_cust::CustBackend;
use qmk_engine::Backend;
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::Weights;

/// A fixed prompt (Qwen2.5 token ids), fed one step at a time.
const PROMPT: [u32; 8] = [9707, 11, 1879, 0, 3555, 374, 279, 6722];
const GREEDY_STEPS: usize = 32;
const STEPS: usize = PROMPT.len() + GREEDY_STEPS;
const CAPACITY: usize = STEPS + 1;
const TOL: f64 = 1e-2;

/// A CUDA backend with the hooks the tests need.
trait Gpu: Backend + Sized {
    const NAME: &'static str;
    fn open(w: &Weights, capacity: usize) -> Result<Self, Self::Error>;
    fn describe(&self) -> String;
    fn set_debug_hang(&mut self, on: bool);
    fn set_spin_timeout(&mut self, t: Duration);
    fn set_step_deadline(&mut self, t: Duration);
    fn barriers_last_step(&mut self) -> Result<u32, Self::Error>;
    fn barriers_per_step(&self) -> u32;
}

macro_rules! impl_gpu {
    ($ty:ty, $name:literal, $krate:ident) => {
        impl Gpu for $ty {
            const NAME: &'static str = $name;
            fn open(w: &Weights, capacity: usize) -> Result<Self, Self::Error> {
                let opts = $krate::Options {
                    capacity,
                    ..Default::default()
                };
                <$ty>::new(w, opts, &mut ())
            }
            fn describe(&self) -> String {
                let l = self.launch_info();
                format!(
                    "{}: {} ({}), grid {} x {} threads ({} CTA/SM of max {}), {} B dyn smem, {} regs",
                    $name,
                    self.device().name,
                    self.arch(),
                    l.grid,
                    l.block,
                    l.ctas_per_sm,
                    l.max_ctas_per_sm,
                    l.smem_bytes,
                    l.registers
                )
            }
            fn set_debug_hang(&mut self, on: bool) {
                <$ty>::set_debug_hang(self, on)
            }
            fn set_spin_timeout(&mut self, t: Duration) {
                <$ty>::set_spin_timeout(self, t)
            }
            fn set_step_deadline(&mut self, t: Duration) {
                <$ty>::set_step_deadline(self, t)
            }
            fn barriers_last_step(&mut self) -> Result<u32, Self::Error> {
                <$ty>::barriers_last_step(self)
            }
            fn barriers_per_step(&self) -> u32 {
                self.kernel_build().barriers_per_step
            }
        }
    };
}
impl_gpu!(CudarcBackend, "cudarc", qmk_backend_cudarc);
impl_gpu!(CustBackend, "cust", qmk_backend_cust);

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

fn open<B: Gpu>(w: &Weights, capacity: usize) -> B {
    let b =
        B::open(w, capacity).unwrap_or_else(|e| panic!("{}: opening the backend: {e}", B::NAME));
    println!("{}", b.describe());
    b
}

/// Prompt, then 32 greedy steps: at every step the backend's pick equals the
/// argmax of its own logits and the CPU reference's pick, and its logits are
/// within 1e-2 relative error of the reference's.
fn matches_reference<B: Gpu>(preset: &str) {
    let test = format!("{preset} {} vs CPU reference", B::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let r = reference_run(preset, &w);
    let mut gpu = open::<B>(&w, CAPACITY);
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
}

/// Same run twice: bit-identical logits; bad inputs are typed errors; a
/// real hang becomes a kernel error (spin budget) or a timeout (host
/// deadline), and reset() recovers.
fn errors_and_determinism<B: Gpu>() {
    let test = format!("{} errors and determinism", B::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let vocab = w.config.vocab_size as u32;
    let mut b = open::<B>(&w, 64);
    let run = |b: &mut B| -> Vec<Vec<f32>> {
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
    assert_eq!(barriers, b.barriers_per_step());
    println!("{test}: 12 steps bit-identical across two runs, {barriers} barriers/step");

    let expect = |r: Result<qmk_engine::StepOutput, B::Error>, needle: &str| {
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
    expect(b.step(1, 0), "grid barrier timed out");
    expect(b.step(1, 0), "needs reset()");
    b.reset().unwrap();

    b.set_spin_timeout(Duration::from_secs(60));
    b.set_step_deadline(Duration::from_millis(200));
    let t = Instant::now();
    expect(b.step(1, 0), "did not finish within 200 ms");
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
fn greedy<B: Gpu>(w: &Weights) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut b = open::<B>(w, CAPACITY);
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
/// bit-identical logits from cudarc and cust (one cubin, one parameter
/// block, one grid: any difference is a host-side bug).
fn backends_agree(preset: &str) {
    let test = format!("{preset} cudarc == cust");
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let (ids_a, log_a) = greedy::<CudarcBackend>(&w);
    let (ids_b, log_b) = greedy::<CustBackend>(&w);
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

#[test]
fn b_0_5b_backends_bit_identical() {
    backends_agree("0.5b");
}

#[test]
fn c_7b_backends_bit_identical() {
    backends_agree("7b");
}

/// Runs everywhere: with no device (CI, the stub libcuda) the error is the
/// typed "no CUDA device", with a message that says so.
#[test]
fn no_device_is_a_typed_error() {
    match qmk_backend_cust::device_count() {
        Ok(n) => println!("{n} CUDA device(s): nothing to check here"),
        Err(e) => {
            println!("cust without a device: {e}");
            assert!(matches!(e, qmk_backend_cust::Error::NoDevice(_)), "{e:?}");
            assert!(e.to_string().contains("no CUDA device"), "{e}");
            let w = weights("0.5b");
            let e = CustBackend::new(&w, Default::default(), &mut ()).unwrap_err();
            assert!(matches!(e, qmk_backend_cust::Error::NoDevice(_)), "{e:?}");
        }
    }
}
