//! Long-context GPU tests (issue 8): decode at positions in the thousands,
//! where the attention is split along the sequence across CTAs
//! (flash-decoding, `attention_split` in kernels/cuda/attention.cuh).
//! Every check is one generic function instantiated for both backends.
//! Skips with a printed reason when there is no CUDA device.
//!
//! - `a_0_5b_long_vs_reference`: a 2,048-token synthetic prompt (GPU: one
//!   decode step per token; CPU reference: one batched prefill), then 8
//!   greedy steps: logits within 1e-2 of the CPU reference at every
//!   step, ids equal; the last position also with the v1.2 attention
//!   (`FLAG_ATTN_NO_SPLIT`). 16 sequence blocks per kv head there.
//! - `b_0_5b_split_vs_v1` (8,300 positions: the split count is capped at
//!   64 blocks per kv head, the combine's > 32-block loop runs),
//!   `c_7b_split_vs_v1` (1,100 positions, head_dim 128) and the short
//!   `b_0_5b_short_forced_split` / `d_7b_short_forced_split` (100 / 200
//!   positions, split forced: one block per kv head): the split
//!   (`FLAG_ATTN_FORCE_SPLIT`) and the v1.2 attention (`FLAG_ATTN_NO_SPLIT`)
//!   agree (logits within 1e-3: the same maths summed in another order),
//!   the split is bit-identical when repeated, and the default flags pick the
//!   split from `ATTN_SPLIT_MIN_CONTEXT` cached positions on, v1.2 below
//!   (bit-identical to the one picked).
//!
//! On the GPU machine, from the prebuilt binary (scripts/gpu/perf.sh):
//! `long-context-tests --test-threads=1 --nocapture`.

#[macro_use]
mod common;
use common::*;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use qmk_backend_cudarc::CudarcBackend;
use qmk_backend_cust::CustBackend;
use qmk_engine::Backend;
use qmk_kernels::params::{ATTN_SPLIT_MIN_CONTEXT, FLAG_ATTN_FORCE_SPLIT, FLAG_ATTN_NO_SPLIT};
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::Weights;

const TOL: f64 = 1e-2;
/// Split vs v1.2 attention: same maths, another summation order.
const TOL_PATHS: f64 = 1e-3;
const REF_PROMPT: usize = 2048;
const REF_STEPS: usize = 8;

/// A CUDA backend with the flag hook.
trait Gpu: Backend + Sized {
    const NAME: &'static str;
    fn open(w: &Weights, capacity: usize) -> Result<Self, Self::Error>;
    fn set_kernel_flags(&mut self, mask: u32, on: bool);
}

macro_rules! impl_gpu {
    ($ty:ty, $name:literal, $krate:ident) => {
        impl Gpu for $ty {
            const NAME: &'static str = $name;
            fn open(w: &Weights, capacity: usize) -> Result<Self, Self::Error> {
                let opts = $krate::Options {
                    capacity,
                    step_deadline: Duration::from_secs(60),
                    ..Default::default()
                };
                <$ty>::new(w, opts, &mut ())
            }
            fn set_kernel_flags(&mut self, mask: u32, on: bool) {
                <$ty>::set_kernel_flags(self, mask, on)
            }
        }
    };
}
impl_gpu!(CudarcBackend, "cudarc", qmk_backend_cudarc);
impl_gpu!(CustBackend, "cust", qmk_backend_cust);

/// `n` synthetic prompt ids below the special tokens (deterministic).
fn prompt(n: usize) -> Vec<u32> {
    let mut s = 0x2545_F491_4F6C_DD1Du64 ^ n as u64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 151_643) as u32
        })
        .collect()
}

fn open<B: Gpu>(w: &Weights, capacity: usize) -> B {
    B::open(w, capacity).unwrap_or_else(|e| panic!("{}: opening the backend: {e}", B::NAME))
}

/// The CPU reference: logits after the batched prefill of the prompt, then
/// after each of `REF_STEPS` greedy steps; and the tokens fed.
struct RefRun {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn reference_run(w: &Arc<Weights>) -> &'static RefRun {
    static RUN: OnceLock<RefRun> = OnceLock::new();
    RUN.get_or_init(|| {
        let t = Instant::now();
        let p = prompt(REF_PROMPT);
        let opts = ReferenceOptions::new(REF_PROMPT + REF_STEPS + 1).kv_bf16(true);
        let mut cpu = Reference::new(w.clone(), opts).unwrap();
        let mut logits = vec![cpu.prefill(&p).unwrap()];
        let mut tokens = Vec::new();
        for i in 0..REF_STEPS {
            let token = argmax(logits.last().unwrap());
            tokens.push(token);
            logits.push(cpu.step(token, REF_PROMPT + i).unwrap());
        }
        println!(
            "0.5b: CPU reference, prefill of {REF_PROMPT} tokens + {REF_STEPS} steps in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        RefRun { tokens, logits }
    })
}

fn long_vs_reference<B: Gpu>() {
    let test = format!(
        "0.5b {} at {REF_PROMPT} positions vs CPU reference",
        B::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let r = reference_run(&w);
    let mut gpu = open::<B>(&w, REF_PROMPT + REF_STEPS + 1);
    let p = prompt(REF_PROMPT);
    let t = Instant::now();
    let out = gpu.prefill(&p, 0).unwrap();
    let prefill_s = t.elapsed().as_secs_f64();
    let mut lg = gpu.logits().unwrap();
    let mut max_err = rel_err(&lg, &r.logits[0]);
    assert!(
        max_err <= TOL,
        "{test}: after the prompt: rel err {max_err:.3e} > {TOL}"
    );
    assert_eq!(
        out.argmax,
        argmax(&r.logits[0]),
        "{test}: first greedy id differs"
    );
    for i in 0..REF_STEPS {
        let pos = REF_PROMPT + i;
        let out = gpu.step(r.tokens[i], pos).unwrap();
        lg = gpu.logits().unwrap();
        let e = rel_err(&lg, &r.logits[i + 1]);
        max_err = max_err.max(e);
        assert!(e <= TOL, "{test}: pos {pos}: rel err {e:.3e} > {TOL}");
        assert_eq!(
            out.argmax,
            argmax(&lg),
            "{test}: pos {pos}: pick != argmax of logits"
        );
        assert_eq!(
            out.argmax,
            argmax(&r.logits[i + 1]),
            "{test}: pos {pos}: greedy ids differ"
        );
    }
    // The last position again with the v1.2 attention.
    let pos = REF_PROMPT + REF_STEPS - 1;
    gpu.set_kernel_flags(FLAG_ATTN_NO_SPLIT, true);
    gpu.step(r.tokens[REF_STEPS - 1], pos).unwrap();
    let v1 = gpu.logits().unwrap();
    let e_v1 = rel_err(&v1, &r.logits[REF_STEPS]);
    assert!(
        e_v1 <= TOL,
        "{test}: v1.2 attention at pos {pos}: rel err {e_v1:.3e}"
    );
    let e_paths = rel_err(&lg, &v1);
    assert!(
        e_paths <= TOL_PATHS,
        "{test}: split vs v1.2 attention at pos {pos}: rel err {e_paths:.3e} > {TOL_PATHS}"
    );
    println!(
        "{test}: PASS: {REF_STEPS} greedy ids equal, max rel err {max_err:.3e} (split), \
         v1.2 path {e_v1:.3e}, split vs v1.2 {e_paths:.3e}; GPU prefill (step by step) {prefill_s:.1} s"
    );
}

/// At position `n` after an `n`-token prompt: split (twice) vs unsplit
/// attention.
fn split_vs_v1<B: Gpu>(preset: &str, n: usize) {
    let test = format!("{preset} {} split attention at {n} positions", B::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let mut gpu = open::<B>(&w, n + 2);
    let p = prompt(n + 1);
    let t = Instant::now();
    gpu.prefill(&p[..n], 0).unwrap();
    let prefill_s = t.elapsed().as_secs_f64();
    const ALL: u32 = FLAG_ATTN_NO_SPLIT | FLAG_ATTN_FORCE_SPLIT;
    let at_n = |gpu: &mut B, mask: u32| {
        gpu.set_kernel_flags(ALL, false);
        gpu.set_kernel_flags(mask, true);
        let out = gpu.step(p[n], n).unwrap();
        let lg = gpu.logits().unwrap();
        assert!(
            lg.iter().all(|x| x.is_finite()),
            "{test}: flags {mask}: non-finite logits"
        );
        (out.argmax, lg)
    };
    let (a1, split1) = at_n(&mut gpu, FLAG_ATTN_FORCE_SPLIT);
    let (a2, split2) = at_n(&mut gpu, FLAG_ATTN_FORCE_SPLIT);
    let (av, v1) = at_n(&mut gpu, FLAG_ATTN_NO_SPLIT);
    let (ad, dflt) = at_n(&mut gpu, 0);
    gpu.set_kernel_flags(ALL, false);
    let split_default = n + 1 >= ATTN_SPLIT_MIN_CONTEXT as usize;
    let (want_a, want) = if split_default {
        (a1, &split1)
    } else {
        (av, &v1)
    };
    assert!(
        ad == want_a && &dflt == want,
        "{test}: the default flags did not pick the {} attention bit for bit",
        if split_default { "split" } else { "v1.2" }
    );
    assert!(
        a1 == a2 && split1 == split2,
        "{test}: the split attention is not bit-identical run to run"
    );
    let e = rel_err(&split1, &v1);
    assert!(
        e <= TOL_PATHS,
        "{test}: split vs v1.2 attention: rel err {e:.3e} > {TOL_PATHS}"
    );
    println!(
        "{test}: PASS: split vs v1.2 rel err {e:.3e}, split repeat bit-identical; \
         prefill (step by step) {prefill_s:.1} s"
    );
}

// Names sort so one preset's tests run together (weights cache).
both!(a_0_5b_long_vs_reference, long_vs_reference);
both!(b_0_5b_split_vs_v1, split_vs_v1, "0.5b", 8300);
both!(b_0_5b_short_forced_split, split_vs_v1, "0.5b", 100);
both!(c_7b_split_vs_v1, split_vs_v1, "7b", 1100);
both!(d_7b_short_forced_split, split_vs_v1, "7b", 200);
