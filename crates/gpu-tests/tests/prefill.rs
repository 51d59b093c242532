//! GPU tests of the tensor-core prefill kernel (`qmk_prefill_chunk`), one
//! generic function each, run on both drivers by [`both!`]. Each skips with
//! a printed reason when there is no CUDA device.
//!
//! For a prompt of N synthetic token ids (N = 1, 17, 512, 3000) at the 0.5B
//! and 7B shapes, with `Options::prefill_chunk` = `QMK_PREFILL_CHUNK`
//! (default 256, so 512 and 3000 take several chunks and attend to positions
//! cached by earlier chunks):
//!   1. the last position's logits within 1e-2 relative error of the CPU
//!      reference's batched prefill (bf16 KV), and the kernel's pick equal
//!      to the argmax of its own logits;
//!   2. the KV cache of positions 0..N (every layer, K and V) within 1e-2
//!      relative error of the reference's cache;
//!   3. then 32 greedy decode steps (the decode megakernel) whose ids equal
//!      the reference's, up to near-ties (MAX_TIES steps where the
//!      reference's own top two logits are closer than the tolerance; the
//!      reference's id is fed on and reported).
//!
//! `d_stream_k_*`: the wgmma GEMM's stream-K schedule against the same
//! kernel data-parallel (GPU vs GPU: layer 0 to 1e-3, the rest to TOL).
//! Plus a threshold table per preset (`*_threshold`): host wall time of step-by-step vs batched prefill
//! at 1, 4, 16, 64 tokens, to set `DEFAULT_PREFILL_MIN_TOKENS` from; it
//! fails if the two paths' logits differ by more than the tolerance.
//! `QMK_TEST_KERNEL_FLAGS` runs everything on another GEMM path.
//!
//! On the GPU machine, from the prebuilt binary:
//! `prefill-<hash> --test-threads=1 --nocapture [filter]`. The 7B
//! 3,000-token reference is ~40 TFLOP of CPU work: `write_reference`
//! computes it on the build machine into `QMK_PREFILL_REF_DIR` (~25 min on
//! 2 cores), to be carried with the binary; without a file the test
//! computes the reference itself (minutes).

use qmk_gpu_tests::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use qmk_engine::Backend;
use qmk_gpu::{Driver, GpuBackend, Options};
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

/// `QMK_TEST_KERNEL_FLAGS` (decimal): kernel flags for every backend these
/// tests open, e.g. 262144 (`FLAG_PF_MMA_SYNC`) or 524288
/// (`FLAG_PF_NO_STREAM_K`) to run the same checks on another GEMM path.
fn test_kernel_flags() -> u32 {
    std::env::var("QMK_TEST_KERNEL_FLAGS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The backend through `D` with the prefill kernel in chunks of `chunk`
/// positions, every prompt through it (1 token included), and the test's
/// kernel flags.
fn open_pf<D: Driver>(w: &Weights, capacity: usize, chunk: u32) -> qmk_gpu::Result<GpuBackend<D>> {
    let opts = Options {
        capacity,
        prefill_chunk: Some(chunk),
        prefill_min_tokens: 1,
        ..Default::default()
    };
    let mut b = GpuBackend::<D>::new(w, opts, &mut ())?;
    b.set_kernel_flags(test_kernel_flags(), true);
    Ok(b)
}

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
    /// The cache positions whose K / V rows `k` and `v` hold, per layer
    /// ([L, positions, KV]): all of 0..N when computed here, every
    /// REF_FILE_KV_STRIDE-th (and the last) in a reference file.
    positions: Vec<usize>,
    k: Vec<f32>,
    v: Vec<f32>,
    ids: Vec<u32>,
    /// Per id: the reference's top-1 minus top-2 logit, and the rms of its
    /// logits (a near-tie is a margin below TOL x rms).
    margins: Vec<(f32, f32)>,
}

/// Top-1 minus top-2 logit, and the rms of the logits.
fn margin(logits: &[f32]) -> (f32, f32) {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    let mut ss = 0f64;
    for &x in logits {
        ss += (x as f64).powi(2);
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    (a - b, (ss / logits.len().max(1) as f64).sqrt() as f32)
}

/// Greedy decoding may meet the reference at a near-tie: the two paths
/// agree to TOL (relative), so where the reference's own top two logits are
/// closer than TOL x rms(logits), either pick is within tolerance. Such a
/// step is a tie: it is reported, the reference's id is fed on (teacher
/// forcing) and comparing continues. At most MAX_TIES per run; a differing
/// id at any other step fails.
const MAX_TIES: usize = 2;

fn capacity(n: usize) -> usize {
    n + GREEDY_STEPS + 1
}

/// CPU reference runs by (preset, N), shared by both drivers' tests.
type RefCache = Mutex<HashMap<(String, usize), Arc<RefPrefill>>>;

fn reference(preset: &str, n: usize, w: &Arc<Weights>) -> Arc<RefPrefill> {
    static CACHE: OnceLock<RefCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (preset.to_string(), n);
    if let Some(r) = cache.lock().unwrap().get(&key) {
        return r.clone();
    }
    if let Some(r) = load_reference(preset, n, w) {
        let r = Arc::new(r);
        cache.lock().unwrap().insert(key, r.clone());
        return r;
    }
    let r = Arc::new(compute_reference(preset, n, w));
    cache.lock().unwrap().insert(key, r.clone());
    r
}

/// Positions per sampled KV row in a reference file.
const REF_FILE_KV_STRIDE: usize = 47;
const REF_FILE_MAGIC: &[u8; 8] = b"QMKPREF1";

/// `QMK_PREFILL_REF_DIR/<preset>-<n>.bin`: a CPU reference computed
/// elsewhere (`write_reference`, below), for cases whose reference takes
/// minutes (7B at 3,000 tokens is ~40 TFLOP): written on the build machine,
/// carried to the GPU machine. Same numbers as computing it here, KV rows
/// sampled every REF_FILE_KV_STRIDE positions (and the last).
fn ref_file(preset: &str, n: usize) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("QMK_PREFILL_REF_DIR")?;
    Some(std::path::Path::new(&dir).join(format!("{preset}-{n}.bin")))
}

fn load_reference(preset: &str, n: usize, w: &Weights) -> Option<RefPrefill> {
    let path = ref_file(preset, n)?;
    let bytes = std::fs::read(&path).ok()?;
    let bad = |what: &str| -> ! { panic!("{}: {what}", path.display()) };
    if bytes.get(..8) != Some(&REF_FILE_MAGIC[..]) {
        bad("not a reference file");
    }
    // After the magic, every field is a little-endian 32-bit word.
    let words: Vec<u32> = bytes[8..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let mut at = 0usize;
    let mut next = |k: usize| -> &[u32] {
        let s = words.get(at..at + k).unwrap_or_else(|| bad("truncated"));
        at += k;
        s
    };
    let floats = |s: &[u32]| -> Vec<f32> { s.iter().map(|&x| f32::from_bits(x)).collect() };
    let &[fn_, vocab, n_pos, kv_len, n_ids, seed] = next(6) else {
        unreachable!()
    };
    if fn_ as usize != n || vocab as usize != w.config.vocab_size || seed != SEED as u32 {
        bad("written for another case");
    }
    let (n_pos, kv_len, n_ids) = (n_pos as usize, kv_len as usize, n_ids as usize);
    let tokens = next(n).to_vec();
    let positions = next(n_pos).iter().map(|&p| p as usize).collect();
    let ids = next(n_ids).to_vec();
    let logits = floats(next(vocab as usize));
    let k = floats(next(kv_len));
    let v = floats(next(kv_len));
    let margins = floats(next(2 * n_ids))
        .chunks_exact(2)
        .map(|c| (c[0], c[1]))
        .collect();
    println!(
        "{preset}: CPU reference of {n} tokens from {}",
        path.display()
    );
    Some(RefPrefill {
        tokens,
        logits,
        positions,
        k,
        v,
        ids,
        margins,
    })
}

/// Writes the reference of (QMK_REF_PRESET, QMK_REF_N) into
/// QMK_PREFILL_REF_DIR (no GPU needed; `cargo test --release --test prefill
/// -- --ignored write_reference`).
#[test]
#[ignore = "writes a CPU reference file; run by hand (see ref_file)"]
fn write_reference() {
    let preset = std::env::var("QMK_REF_PRESET").unwrap_or_else(|_| "7b".into());
    let n: usize = std::env::var("QMK_REF_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let path = ref_file(&preset, n).expect("set QMK_PREFILL_REF_DIR");
    let w = weights(&preset);
    let r = compute_reference(&preset, n, &w);
    let kv = w.config.kv_dim();
    let layers = w.config.num_hidden_layers;
    let mut pos: Vec<usize> = (0..n).step_by(REF_FILE_KV_STRIDE).collect();
    if pos.last() != Some(&(n - 1)) {
        pos.push(n - 1);
    }
    let pick = |c: &[f32]| -> Vec<f32> {
        let mut out = Vec::with_capacity(layers * pos.len() * kv);
        for l in 0..layers {
            for &p in &pos {
                let i = (l * n + p) * kv;
                out.extend_from_slice(&c[i..i + kv]);
            }
        }
        out
    };
    let (k, v) = (pick(&r.k), pick(&r.v));
    // The layout load_reference reads: magic, then 32-bit words.
    let mut words: Vec<u32> = [n, w.config.vocab_size, pos.len(), k.len(), r.ids.len()]
        .iter()
        .map(|&x| x as u32)
        .collect();
    words.push(SEED as u32);
    words.extend(&r.tokens);
    words.extend(pos.iter().map(|&p| p as u32));
    words.extend(&r.ids);
    words.extend(r.logits.iter().chain(&k).chain(&v).map(|x| x.to_bits()));
    words.extend(
        r.margins
            .iter()
            .flat_map(|&(m, rms)| [m.to_bits(), rms.to_bits()]),
    );
    let mut b = REF_FILE_MAGIC.to_vec();
    b.extend(words.iter().flat_map(|x| x.to_le_bytes()));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, &b).unwrap();
    println!("wrote {} ({} bytes)", path.display(), b.len());
    let back = load_reference(&preset, n, &w).unwrap();
    assert_eq!(back.ids, r.ids);
    assert_eq!(back.logits, r.logits);
    assert_eq!(back.k, k);
}

fn compute_reference(preset: &str, n: usize, w: &Arc<Weights>) -> RefPrefill {
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
    let mut margins = vec![margin(&logits)];
    let mut tok = argmax(&logits);
    for i in 0..GREEDY_STEPS {
        ids.push(tok);
        let l = cpu.step(tok, n + i).unwrap();
        margins.push(margin(&l));
        tok = argmax(&l);
    }
    ids.push(tok);
    println!(
        "{preset}: CPU reference, prefill of {n} tokens in {t_prefill:.1} s, {GREEDY_STEPS} steps in {:.1} s",
        t.elapsed().as_secs_f64() - t_prefill
    );
    RefPrefill {
        tokens,
        logits,
        positions: (0..n).collect(),
        k,
        v,
        ids,
        margins,
    }
}

/// The backend for a GPU-vs-GPU comparison of wgmma-path variants: the
/// weights, the prompt of `n` tokens and the backend opened with chunks of `chunk`;
/// None (saying so) on GPUs without the wgmma path. The caller holds the
/// GPU guard.
fn open_wgmma<D: Driver>(
    test: &str,
    preset: &str,
    n: usize,
    chunk: u32,
) -> Option<(Arc<Weights>, Vec<u32>, GpuBackend<D>)> {
    let w = weights(preset);
    let tokens = prompt(n, w.config.vocab_size);
    let gpu = open_pf::<D>(&w, capacity(n), chunk)
        .unwrap_or_else(|e| panic!("{test}: opening the backend: {e}"));
    if !gpu.arch().has_wgmma() {
        println!("SKIPPED {test}: no wgmma prefill GEMM on this GPU");
        return None;
    }
    Some((w, tokens, gpu))
}

/// One prefill of `tokens` into a reset cache, kernel flags `mask` set to
/// `on & mask`: the kernel's pick, the last logits and the K / V caches
/// (bf16 bits, [layer, capacity, kv]).
struct Variant {
    pick: u32,
    logits: Vec<f32>,
    k: Vec<u16>,
    v: Vec<u16>,
}

fn prefill_variant<D: Driver>(
    gpu: &mut GpuBackend<D>,
    tokens: &[u32],
    mask: u32,
    on: u32,
) -> Variant {
    gpu.reset().unwrap();
    gpu.set_kernel_flags(mask, false);
    gpu.set_kernel_flags(on & mask, true);
    let pick = gpu.prefill(tokens, 0).unwrap().argmax;
    let logits = gpu.logits().unwrap();
    let (k, v) = gpu.read_kv_cache().unwrap();
    Variant { pick, logits, k, v }
}

fn bf16s(c: &[u16]) -> Vec<f32> {
    c.iter().map(|&b| bf16(b)).collect()
}

/// The wgmma GEMM's stream-K split (`wg_phase`) against the same kernel with every tile data-parallel
/// (`FLAG_PF_NO_STREAM_K`), GPU against GPU. Only the f32 summation order
/// of the split tiles differs, so layers 0 and 1 of the KV cache (layer 0:
/// the split q/k/v GEMM; layer 1: also layer 0's split o_proj and down)
/// agree: layer 0 to 1e-3 (measured 0 to 6e-5), layer 1 and everything
/// after only to the CPU tolerance, because a bf16 rounding that flips
/// anywhere in layer 0 (norm, attention, SiLU x up outputs) grows through
/// the random-weight layers to the bf16 noise level (measured: layer 1
/// 0.5-3.5e-3, last layer 3-7e-3, the size of GPU vs CPU). A lost or
/// doubled partial is off by ~1/splits of a row, far above both bounds.
/// Skips (saying so) on GPUs without the wgmma path.
fn stream_k_matches_data_parallel<D: Driver>(preset: &str, n: usize) {
    stream_k_chunk_matches_data_parallel::<D>(preset, n, chunk());
}

/// As [`stream_k_matches_data_parallel`] in chunks of `chunk` tokens: one
/// chunk of 2,048 runs 7B's q/k/v with a stream-K tail after two
/// data-parallel waves (288 tiles = 2 x 132 + 24).
fn stream_k_chunk_matches_data_parallel<D: Driver>(preset: &str, n: usize, chunk: u32) {
    let test = format!(
        "{preset} {} stream-K vs data-parallel, {n} tokens in chunks of {chunk}",
        D::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let Some((w, tokens, mut gpu)) = open_wgmma::<D>(&test, preset, n, chunk) else {
        return;
    };
    use qmk_kernels::params::FLAG_PF_NO_STREAM_K as NO_SK;
    let split = prefill_variant(&mut gpu, &tokens, NO_SK, 0);
    let dp = prefill_variant(&mut gpu, &tokens, NO_SK, NO_SK);
    let (a0, l0, k0, v0) = (split.pick, split.logits, bf16s(&split.k), bf16s(&split.v));
    let (a1, l1, k1, v1) = (dp.pick, dp.logits, bf16s(&dp.k), bf16s(&dp.v));
    let (el, ek, ev) = (rel_err(&l0, &l1), rel_err(&k0, &k1), rel_err(&v0, &v1));
    // Layers 0 and 1, positions 0..n.
    let (cap, kv) = (capacity(n), w.config.kv_dim());
    let early = |c: &[f32], l: usize| c[l * cap * kv..(l * cap + n) * kv].to_vec();
    let e01: Vec<(f64, f64)> = (0..2)
        .map(|l| {
            (
                rel_err(&early(&k0, l), &early(&k1, l)),
                rel_err(&early(&v0, l), &early(&v1, l)),
            )
        })
        .collect();
    let e01s: Vec<String> = e01
        .iter()
        .map(|(k, v)| format!("{k:.2e} / {v:.2e}"))
        .collect();
    println!(
        "{test}: layers 0, 1 K / V rel diff {e01s:?}; all layers K {ek:.3e}, V {ev:.3e}, logits {el:.3e}; picks {a0} / {a1}"
    );
    const SAME: f64 = 1e-3;
    assert!(
        e01[0].0 <= SAME && e01[0].1 <= SAME,
        "{test}: layer 0 of the two GEMM schedules differs by more than {SAME}"
    );
    assert!(
        e01[1].0 <= TOL && e01[1].1 <= TOL,
        "{test}: layer 1 of the two GEMM schedules differs by more than {TOL}"
    );
    assert!(
        el <= TOL && ek <= TOL && ev <= TOL,
        "{test}: the two GEMM schedules differ by more than {TOL}"
    );
}

/// Prefill of N tokens vs the CPU reference: last logits, KV cache, then 32
/// greedy decode steps.
fn prefill_matches_reference<D: Driver>(preset: &str, n: usize) {
    let test = format!(
        "{preset} {} prefill of {n} tokens vs CPU reference",
        D::NAME
    );
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    let r = reference(preset, n, &w);
    let cap = capacity(n);
    let mut gpu = open_pf::<D>(&w, cap, chunk())
        .unwrap_or_else(|e| panic!("{test}: opening the backend: {e}"));
    println!("{}", describe(&gpu));

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

    let (kc, vc) = gpu.read_kv_cache().unwrap();
    let (layers, kv) = (w.config.num_hidden_layers, w.config.kv_dim());
    let rows = |c: &[u16]| -> Vec<f32> {
        let mut out = Vec::with_capacity(layers * r.positions.len() * kv);
        for l in 0..layers {
            for &p in &r.positions {
                let base = (l * cap + p) * kv;
                out.extend(c[base..base + kv].iter().map(|&b| bf16(b)));
            }
        }
        out
    };
    let e_k = rel_err(&rows(&kc), &r.k);
    let e_v = rel_err(&rows(&vc), &r.v);
    assert!(e_k <= TOL, "{test}: K cache rel. err {e_k:.3e} > {TOL}");
    assert!(e_v <= TOL, "{test}: V cache rel. err {e_v:.3e} > {TOL}");

    let mut ids = Vec::with_capacity(GREEDY_STEPS + 1);
    let mut ties = Vec::new();
    let mut tok = out.argmax;
    for i in 0..=GREEDY_STEPS {
        if tok != r.ids[i] {
            let (m, rms) = r.margins[i];
            assert!(
                m <= TOL as f32 * rms && ties.len() < MAX_TIES,
                "{test}: greedy id {tok} differs from the reference's {} at step {i} (reference margin {m:.4} vs tie bound {:.4}, ties so far {ties:?}):\n gpu {ids:?} + {tok}\n cpu {:?}",
                r.ids[i],
                TOL as f32 * rms,
                r.ids
            );
            ties.push(i);
            tok = r.ids[i];
        }
        ids.push(tok);
        if i < GREEDY_STEPS {
            tok = gpu.step(tok, n + i).unwrap().argmax;
        }
    }
    let tie_note = if ties.is_empty() {
        String::new()
    } else {
        format!(
            " ({} near-tie(s) at steps {ties:?}, reference margins {:?})",
            ties.len(),
            ties.iter().map(|&i| r.margins[i].0).collect::<Vec<_>>()
        )
    };
    println!(
        "{test}: logits rel err {e_logits:.3e}, K {e_k:.3e}, V {e_v:.3e}, {} greedy ids equal{tie_note}; prefill wall {:.2} ms (host clock, incl. upload of the ids)",
        ids.len(),
        wall * 1e3
    );
}

/// Typed errors before any launch, and a prompt longer than one chunk
/// starting after decode steps (positions cached by the decode kernel).
fn prefill_errors_and_continuation<D: Driver>() {
    let test = format!("{} prefill errors and continuation", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    let vocab = w.config.vocab_size as u32;
    let mut gpu = open_pf::<D>(&w, 64, 16).unwrap();
    let expect = |r: qmk_gpu::Result<qmk_engine::StepOutput>, needle: &str| {
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
/// 16, 64 tokens): one decode step per token (queued back to back, one
/// wait) vs the tensor-core kernel (one chunk).
/// Prints a table to set `DEFAULT_PREFILL_MIN_TOKENS` from; fails if the
/// two paths' last logits differ by more than the tolerance.
fn prefill_threshold_table<D: Driver>(preset: &str) {
    let test = format!("{preset} {} prefill threshold", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights(preset);
    const LENS: [usize; 4] = [1, 4, 16, 64];
    const REPS: usize = 5;
    let mut gpu = open_pf::<D>(&w, LENS[3] + 1, qmk_gpu::DEFAULT_PREFILL_CHUNK)
        .unwrap_or_else(|e| panic!("{test}: opening the backend: {e}"));
    println!("{}", describe(&gpu));
    // Median host wall time of REPS prefills (after one warm-up), and the
    // last logits.
    let time = |gpu: &mut GpuBackend<D>, tokens: &[u32], min_tokens: usize| -> (f64, Vec<f32>) {
        gpu.set_prefill_min_tokens(min_tokens);
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
        D::NAME
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
            D::NAME
        );
        assert!(
            e <= TOL,
            "{test}: {n} tokens: batched vs step-by-step logits rel. diff {e:.3e} > {TOL}"
        );
    }
    println!(
        "threshold {preset} {}: batched first faster at {first_win:?} tokens (default prefill_min_tokens = {})",
        D::NAME,
        qmk_gpu::DEFAULT_PREFILL_MIN_TOKENS
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
both!(
    d_stream_k_0_5b_512,
    stream_k_matches_data_parallel,
    "0.5b",
    512
);
both!(d_stream_k_7b_17, stream_k_matches_data_parallel, "7b", 17);
both!(d_stream_k_7b_512, stream_k_matches_data_parallel, "7b", 512);
both!(
    d_stream_k_7b_2048,
    stream_k_chunk_matches_data_parallel,
    "7b",
    2048,
    2048
);
both!(b_0_5b_threshold, prefill_threshold_table, "0.5b");
both!(c_7b_threshold, prefill_threshold_table, "7b");
