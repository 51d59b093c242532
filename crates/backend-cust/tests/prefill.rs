//! GPU tests of the tensor-core prefill kernel (`qmk_prefill_chunk`, issue
//! 9), generic over both CUDA backends (instantiated for `CudarcBackend` and
//! `CustBackend` by [`both!`], as in gpu.rs). Each skips with a printed
//! reason when there is no CUDA device.
//!
//! For a prompt of N synthetic token ids (N = 1, 17, 512, 3000) at the 0.5B
//! and 7B shapes, with `GpuOptions::prefill_chunk` = `QMK_PREFILL_CHUNK`
//! (default 256, so 512 and 3000 take several chunks and attend to positions
//! cached by earlier chunks):
//!   1. the last position's logits within 1e-2 relative error of the CPU
//!      reference's batched prefill (bf16 KV), and the kernel's pick equal
//!      to the argmax of its own logits;
//!   2. the KV cache of positions 0..N (every layer, K and V) within 1e-2
//!      relative error of the reference's cache;
//!   3. then 32 greedy decode steps (the decode megakernel) whose ids equal
//!      the reference's.
//!
//! Plus a threshold table per preset (`*_threshold`): host wall time of
//! step-by-step vs batched prefill at 1, 4, 16, 64 tokens, to set
//! `DEFAULT_PREFILL_MIN_TOKENS` from; it fails if the two paths' logits
//! differ by more than the tolerance.
//!
//! On the GPU machine, from the prebuilt binary (scripts/gpu/prefill.sh):
//! `prefill-tests --test-threads=1 --nocapture [filter]`. `prefill.sh run`
//! leaves out `c_7b_prompt_3000` (its CPU reference prefill is ~40 TFLOP,
//! minutes on 16 cores); `FULL=1 prefill.sh tests` runs it.

#[macro_use]
mod common;
use common::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use qmk_backend_cudarc::CudarcBackend;
use qmk_backend_cust::CustBackend;
use qmk_engine::Backend;
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::Weights;

const GREEDY_STEPS: usize = 32;
const TOL: f64 = 1e-2;

/// Prompt positions per prefill launch (`QMK_PREFILL_CHUNK`, default 256).
fn chunk() -> u32 {
    std::env::var("QMK_PREFILL_CHUNK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// A CUDA backend with the prefill kernel enabled, and its test hooks.
trait Pf: Backend + Sized {
    const NAME: &'static str;
    fn open(w: &Weights, capacity: usize, chunk: u32) -> Result<Self, Self::Error>;
    fn describe(&self) -> String;
    fn kv_cache(&mut self) -> Result<(Vec<u16>, Vec<u16>), Self::Error>;
    /// `GpuOptions::prefill_min_tokens` (1: every prompt through the
    /// kernel; usize::MAX: one decode step per token).
    fn set_min_tokens(&mut self, n: usize);
}

macro_rules! impl_pf {
    ($ty:ty, $name:literal, $krate:ident) => {
        impl Pf for $ty {
            const NAME: &'static str = $name;
            fn open(w: &Weights, capacity: usize, chunk: u32) -> Result<Self, Self::Error> {
                let opts = $krate::Options {
                    capacity,
                    prefill_chunk: Some(chunk),
                    // Every prompt through the kernel, 1 token included.
                    prefill_min_tokens: 1,
                    ..Default::default()
                };
                <$ty>::new(w, opts, &mut ())
            }
            fn set_min_tokens(&mut self, n: usize) {
                self.set_prefill_min_tokens(n);
            }
            fn describe(&self) -> String {
                let l = self.launch_info();
                let (pl, chunk) = self.prefill_launch().expect("prefill enabled");
                let pf = self
                    .resources()
                    .into_iter()
                    .find(|r| r.function == qmk_kernels::source::entry::PREFILL_CHUNK)
                    .map(|r| r.to_string())
                    .unwrap_or_default();
                format!(
                    "{}: {} ({}), decode grid {} x {}; prefill grid {} ({} CTA/SM of max {}), {} B dyn smem, {} regs, chunk {chunk}; {pf}",
                    $name,
                    self.device().name,
                    self.arch(),
                    l.grid,
                    l.block,
                    pl.grid,
                    pl.ctas_per_sm,
                    pl.max_ctas_per_sm,
                    pl.smem_bytes,
                    pl.registers
                )
            }
            fn kv_cache(&mut self) -> Result<(Vec<u16>, Vec<u16>), Self::Error> {
                self.read_kv_cache()
            }
        }
    };
}
impl_pf!(CudarcBackend, "cudarc", qmk_backend_cudarc);
impl_pf!(CustBackend, "cust", qmk_backend_cust);

/// N deterministic token ids below the special tokens (xorshift).
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let limit = vocab.min(151_643) as u64;
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ n as u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % limit) as u32
        })
        .collect()
}

fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The CPU reference for one (preset, N): last logits of the batched
/// prefill, K and V of positions 0..N per layer ([L, N, KV]), and the ids
/// of the 32 greedy steps after it (the prefill's pick first).
struct RefPrefill {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    ids: Vec<u32>,
}

fn capacity(n: usize) -> usize {
    n + GREEDY_STEPS + 1
}

/// CPU reference runs by (preset, N), shared by both backends' tests.
type RefCache = Mutex<HashMap<(String, usize), Arc<RefPrefill>>>;

fn reference(preset: &str, n: usize, w: &Arc<Weights>) -> Arc<RefPrefill> {
    static CACHE: OnceLock<RefCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (preset.to_string(), n);
    if let Some(r) = cache.lock().unwrap().get(&key) {
        return r.clone();
    }
    let t = Instant::now();
    let tokens = prompt(n, w.config.vocab_size);
    let cap = capacity(n);
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(cap).kv_bf16(true)).unwrap();
    let logits = cpu.prefill(&tokens).unwrap();
    let kv = w.config.kv_dim();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for l in 0..w.config.num_hidden_layers {
        k.extend_from_slice(&cpu.cache(0).k_layer(l)[..n * kv]);
        v.extend_from_slice(&cpu.cache(0).v_layer(l)[..n * kv]);
    }
    let t_prefill = t.elapsed().as_secs_f64();
    let mut ids = Vec::with_capacity(GREEDY_STEPS + 1);
    let mut tok = argmax(&logits);
    for i in 0..GREEDY_STEPS {
        ids.push(tok);
        tok = argmax(&cpu.step(tok, n + i).unwrap());
    }
    ids.push(tok);
    println!(
        "{preset}: CPU reference, prefill of {n} tokens in {t_prefill:.1} s, {GREEDY_STEPS} steps in {:.1} s",
        t.elapsed().as_secs_f64() - t_prefill
    );
    let r = Arc::new(RefPrefill {
        tokens,
        logits,
        k,
        v,
        ids,
    });
    cache.lock().unwrap().insert(key, r.clone());
    r
}

/// Prefill of N tokens vs the CPU reference: last logits, KV cache, then 32
/// greedy decode steps.
fn prefill_matches_reference<B: Pf>(preset: &str, n: usize) {
    let test = format!(
        "{preset} {} prefill of {n} tokens vs CPU reference",
        B::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let r = reference(preset, n, &w);
    let cap = capacity(n);
    let mut gpu =
        B::open(&w, cap, chunk()).unwrap_or_else(|e| panic!("{test}: opening the backend: {e}"));
    println!("{}", gpu.describe());

    let t = Instant::now();
    let out = gpu.prefill(&r.tokens, 0).unwrap();
    let wall = t.elapsed().as_secs_f64();
    let lg = gpu.logits().unwrap();
    let e_logits = rel_err(&lg, &r.logits);
    assert_eq!(
        out.argmax,
        argmax(&lg),
        "{test}: the kernel's pick disagrees with its logits"
    );
    assert!(
        e_logits <= TOL,
        "{test}: last-position logits rel. err {e_logits:.3e} > {TOL}"
    );

    let (kc, vc) = gpu.kv_cache().unwrap();
    let (layers, kv) = (w.config.num_hidden_layers, w.config.kv_dim());
    let rows = |c: &[u16]| -> Vec<f32> {
        let mut out = Vec::with_capacity(layers * n * kv);
        for l in 0..layers {
            let base = l * cap * kv;
            out.extend(c[base..base + n * kv].iter().map(|&b| bf16(b)));
        }
        out
    };
    let e_k = rel_err(&rows(&kc), &r.k);
    let e_v = rel_err(&rows(&vc), &r.v);
    assert!(e_k <= TOL, "{test}: K cache rel. err {e_k:.3e} > {TOL}");
    assert!(e_v <= TOL, "{test}: V cache rel. err {e_v:.3e} > {TOL}");

    let mut ids = Vec::with_capacity(GREEDY_STEPS + 1);
    let mut tok = out.argmax;
    for i in 0..GREEDY_STEPS {
        ids.push(tok);
        tok = gpu.step(tok, n + i).unwrap().argmax;
    }
    ids.push(tok);
    let first_diff = ids.iter().zip(&r.ids).position(|(a, b)| a != b);
    assert!(
        first_diff.is_none(),
        "{test}: greedy ids differ from the reference at step {first_diff:?}:\n gpu {ids:?}\n cpu {:?}",
        r.ids
    );
    println!(
        "{test}: logits rel err {e_logits:.3e}, K {e_k:.3e}, V {e_v:.3e}, {} greedy ids equal; prefill wall {:.2} ms (host clock, incl. upload of the ids)",
        ids.len(),
        wall * 1e3
    );
}

/// Typed errors before any launch, and a prompt longer than one chunk
/// starting after decode steps (positions cached by the decode kernel).
fn prefill_errors_and_continuation<B: Pf>() {
    let test = format!("{} prefill errors and continuation", B::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let vocab = w.config.vocab_size as u32;
    let mut gpu = B::open(&w, 64, 16).unwrap();
    let expect = |r: Result<qmk_engine::StepOutput, B::Error>, needle: &str| {
        let e = r.expect_err(needle).to_string();
        println!("{test}: -> {e}");
        assert!(e.contains(needle), "{test}: expected {needle:?}, got: {e}");
    };
    expect(gpu.prefill(&[], 0), "empty prompt");
    expect(gpu.prefill(&[1, vocab], 0), "outside the vocabulary");
    expect(gpu.prefill(&[1; 65], 0), "the KV cache holds 64 positions");
    gpu.reset().unwrap();

    // 3 decode steps, then 40 prompt positions by prefill (chunks of 16),
    // vs the CPU reference fed the same way.
    let tokens = prompt(43, w.config.vocab_size);
    let mut cpu = Reference::new(w.clone(), ReferenceOptions::new(64).kv_bf16(true)).unwrap();
    for (i, &t) in tokens[..3].iter().enumerate() {
        cpu.step(t, i).unwrap();
        gpu.step(t, i).unwrap();
    }
    let want = cpu.prefill_seq(0, &tokens[3..], 3).unwrap();
    let out = gpu.prefill(&tokens[3..], 3).unwrap();
    let lg = gpu.logits().unwrap();
    let e = rel_err(&lg, &want);
    assert!(
        e <= TOL,
        "{test}: logits rel. err {e:.3e} after 3 steps + prefill"
    );
    assert_eq!(out.argmax, argmax(&want), "{test}: pick differs");
    println!("{test}: 3 decode steps + 40-token prefill (chunks of 16): rel err {e:.3e}");
}

/// Time to first token of the two prefill paths at short prompts (1, 4,
/// 16, 64 tokens): one decode step per token (launched back to back on
/// cudarc; one step() each on cust) vs the tensor-core kernel (one chunk).
/// Prints a table to set `DEFAULT_PREFILL_MIN_TOKENS` from; fails if the
/// two paths' last logits differ by more than the tolerance.
fn prefill_threshold_table<B: Pf>(preset: &str) {
    let test = format!("{preset} {} prefill threshold", B::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    const LENS: [usize; 4] = [1, 4, 16, 64];
    const REPS: usize = 5;
    let mut gpu = B::open(&w, LENS[3] + 1, qmk_kernels::host::DEFAULT_PREFILL_CHUNK)
        .unwrap_or_else(|e| panic!("{test}: opening the backend: {e}"));
    println!("{}", gpu.describe());
    // Median host wall time of REPS prefills (after one warm-up), and the
    // last logits.
    let time = |gpu: &mut B, tokens: &[u32], min_tokens: usize| -> (f64, Vec<f32>) {
        gpu.set_min_tokens(min_tokens);
        let mut ms = Vec::with_capacity(REPS);
        for r in 0..=REPS {
            gpu.reset().unwrap();
            let t = Instant::now();
            gpu.prefill(tokens, 0).unwrap();
            if r > 0 {
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        ms.sort_by(f64::total_cmp);
        (ms[REPS / 2], gpu.logits().unwrap())
    };
    println!(
        "threshold {preset} {}: tokens | step-by-step ms | batched ms | faster",
        B::NAME
    );
    let mut first_win = None;
    for n in LENS {
        let tokens = prompt(n, w.config.vocab_size);
        let (t_steps, l_steps) = time(&mut gpu, &tokens, usize::MAX);
        let (t_batch, l_batch) = time(&mut gpu, &tokens, 1);
        let e = rel_err(&l_batch, &l_steps);
        let win = if t_batch < t_steps {
            "batched"
        } else {
            "steps"
        };
        if t_batch < t_steps && first_win.is_none() {
            first_win = Some(n);
        }
        println!(
            "threshold {preset} {}: {n:>4} | {t_steps:>8.3} | {t_batch:>8.3} | {win} (logits rel. diff {e:.2e})",
            B::NAME
        );
        assert!(
            e <= TOL,
            "{test}: {n} tokens: batched vs step-by-step logits rel. diff {e:.3e} > {TOL}"
        );
    }
    println!(
        "threshold {preset} {}: batched first faster at {first_win:?} tokens (default prefill_min_tokens = {})",
        B::NAME,
        qmk_kernels::host::DEFAULT_PREFILL_MIN_TOKENS
    );
}

// Test names sort so that one preset's tests run together (weights cache).
both!(a_errors_and_continuation, prefill_errors_and_continuation);
both!(b_0_5b_prompt_1, prefill_matches_reference, "0.5b", 1);
both!(b_0_5b_prompt_17, prefill_matches_reference, "0.5b", 17);
both!(b_0_5b_prompt_512, prefill_matches_reference, "0.5b", 512);
both!(b_0_5b_prompt_3000, prefill_matches_reference, "0.5b", 3000);
both!(c_7b_prompt_1, prefill_matches_reference, "7b", 1);
both!(c_7b_prompt_17, prefill_matches_reference, "7b", 17);
both!(c_7b_prompt_512, prefill_matches_reference, "7b", 512);
both!(c_7b_prompt_3000, prefill_matches_reference, "7b", 3000);
both!(b_0_5b_threshold, prefill_threshold_table, "0.5b");
both!(c_7b_threshold, prefill_threshold_table, "7b");
