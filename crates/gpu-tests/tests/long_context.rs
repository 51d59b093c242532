//! Long-context GPU tests: decode at positions in the thousands, where the
//! attention is split along the sequence across CTAs (flash-decoding,
//! `attention_split` in the kernel). Every check is one generic function
//! run on both drivers. Skips with a printed reason when there is no CUDA
//! device.
//!
//! - `a_0_5b_long_vs_reference`: a 2,048-token synthetic prompt (GPU:
//!   `Backend::prefill`; CPU reference: one batched prefill), then 8 greedy
//!   steps: logits within 1e-2 of the CPU reference at every step, ids
//!   equal; the last position also with the unsplit attention
//!   (`FLAG_ATTN_NO_SPLIT`). 16 sequence blocks per kv head there.
//! - `b_0_5b_split_vs_unsplit` (8,300 positions: the split count is capped
//!   at 64 blocks per kv head, the combine's > 32-block loop runs),
//!   `c_7b_split_vs_unsplit` (1,100 positions, head_dim 128) and the short
//!   `b_0_5b_short_forced_split` / `d_7b_short_forced_split` (100 / 200
//!   positions, split forced: one block per kv head): the split
//!   (`FLAG_ATTN_FORCE_SPLIT`) and the unsplit attention
//!   (`FLAG_ATTN_NO_SPLIT`) agree (logits within 1e-3: the same maths
//!   summed in another order), the split is bit-identical when repeated,
//!   and the default flags pick the split from `ATTN_SPLIT_MIN_CONTEXT`
//!   cached positions on, the unsplit attention below (bit-identical to the
//!   one picked).
//!
//! On the GPU machine, from the prebuilt binary:
//! `long_context-<hash> --test-threads=1 --nocapture`.

use qmk_gpu_tests::*;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use qmk_engine::Backend;
use qmk_gpu::{Driver, GpuBackend, Options};
use qmk_kernels::params::{ATTN_SPLIT_MIN_CONTEXT, FLAG_ATTN_FORCE_SPLIT, FLAG_ATTN_NO_SPLIT};
use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::Weights;

const TOL: f64 = 1e-2;
/// Split vs unsplit attention: same maths, another summation order.
const TOL_PATHS: f64 = 1e-3;
const REF_PROMPT: usize = 2048;
const REF_STEPS: usize = 8;

/// `n` synthetic prompt ids below the special tokens (deterministic).
fn prompt(n: usize) -> Vec<u32> {
    synthetic_prompt(n, 0x2545_F491_4F6C_DD1D)
}

/// The backend through `D` with a long host deadline (a prompt of
/// thousands of tokens is one wait).
fn open_long<D: Driver>(w: &Weights, capacity: usize) -> GpuBackend<D> {
    open(
        w,
        Options {
            capacity,
            step_deadline: Duration::from_secs(60),
            ..Default::default()
        },
    )
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

fn long_vs_reference<D: Driver>() {
    let test = format!(
        "0.5b {} at {REF_PROMPT} positions vs CPU reference",
        D::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let r = reference_run(&w);
    let mut gpu = open_long::<D>(&w, REF_PROMPT + REF_STEPS + 1);
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
    // The last position again with the unsplit attention.
    let pos = REF_PROMPT + REF_STEPS - 1;
    gpu.set_kernel_flags(FLAG_ATTN_NO_SPLIT, true);
    gpu.step(r.tokens[REF_STEPS - 1], pos).unwrap();
    let unsplit = gpu.logits().unwrap();
    let e_unsplit = rel_err(&unsplit, &r.logits[REF_STEPS]);
    assert!(
        e_unsplit <= TOL,
        "{test}: unsplit attention at pos {pos}: rel err {e_unsplit:.3e}"
    );
    let e_paths = rel_err(&lg, &unsplit);
    assert!(
        e_paths <= TOL_PATHS,
        "{test}: split vs unsplit attention at pos {pos}: rel err {e_paths:.3e} > {TOL_PATHS}"
    );
    println!(
        "{test}: PASS: {REF_STEPS} greedy ids equal, max rel err {max_err:.3e} (split), \
         unsplit path {e_unsplit:.3e}, split vs unsplit {e_paths:.3e}; GPU prefill {prefill_s:.1} s"
    );
}

/// At position `n` after an `n`-token prompt: split (twice) vs unsplit
/// attention, and what the default flags pick.
fn split_vs_unsplit<D: Driver>(preset: &str, n: usize) {
    let test = format!("{preset} {} split attention at {n} positions", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let mut gpu = open_long::<D>(&w, n + 2);
    let p = prompt(n + 1);
    let t = Instant::now();
    gpu.prefill(&p[..n], 0).unwrap();
    let prefill_s = t.elapsed().as_secs_f64();
    const ALL: u32 = FLAG_ATTN_NO_SPLIT | FLAG_ATTN_FORCE_SPLIT;
    let at_n = |gpu: &mut GpuBackend<D>, mask: u32| {
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
    let (av, unsplit) = at_n(&mut gpu, FLAG_ATTN_NO_SPLIT);
    let (ad, dflt) = at_n(&mut gpu, 0);
    gpu.set_kernel_flags(ALL, false);
    let split_default = n + 1 >= ATTN_SPLIT_MIN_CONTEXT as usize;
    let (want_a, want) = if split_default {
        (a1, &split1)
    } else {
        (av, &unsplit)
    };
    assert!(
        ad == want_a && &dflt == want,
        "{test}: the default flags did not pick the {} attention bit for bit",
        if split_default { "split" } else { "unsplit" }
    );
    assert!(
        a1 == a2 && split1 == split2,
        "{test}: the split attention is not bit-identical run to run"
    );
    let e = rel_err(&split1, &unsplit);
    assert!(
        e <= TOL_PATHS,
        "{test}: split vs unsplit attention: rel err {e:.3e} > {TOL_PATHS}"
    );
    println!(
        "{test}: PASS: split vs unsplit rel err {e:.3e}, split repeat bit-identical; \
         prefill {prefill_s:.1} s"
    );
}

// Names sort so one preset's tests run together (weights cache).
both!(a_0_5b_long_vs_reference, long_vs_reference);
both!(b_0_5b_split_vs_unsplit, split_vs_unsplit, "0.5b", 8300);
both!(b_0_5b_short_forced_split, split_vs_unsplit, "0.5b", 100);
both!(c_7b_split_vs_unsplit, split_vs_unsplit, "7b", 1100);
both!(d_7b_short_forced_split, split_vs_unsplit, "7b", 200);
