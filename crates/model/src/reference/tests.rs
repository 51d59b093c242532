//! The reference against a second, deliberately naive implementation (f64,
//! whole-sequence causal attention recomputed every step, rotate-half built by
//! concatenation as transformers writes it) on tiny synthetic weights.

use std::sync::Arc;

use half::bf16;

use super::*;
use crate::synthetic::synthetic_weights;
use crate::Config;

fn tiny_config(tied: bool) -> Config {
    Config {
        architectures: vec!["Qwen2ForCausalLM".into()],
        model_type: "qwen2".into(),
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(16),
        vocab_size: 101,
        max_position_embeddings: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        tie_word_embeddings: tied,
        use_sliding_window: false,
        sliding_window: None,
        max_window_layers: None,
        layer_types: None,
        hidden_act: None,
        rope_scaling: None,
        rope_parameters: None,
        quantization_config: None,
        attention_bias: None,
        mlp_bias: None,
        partial_rotary_factor: None,
        torch_dtype: Some("bfloat16".into()),
        bos_token_id: None,
        eos_token_id: None,
    }
}

fn f(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

/// `y[n] = Σ_k x[k] w[n, k]`, `w` `[N, K]`.
fn linear(x: &[f64], w: &[f64]) -> Vec<f64> {
    w.chunks(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    x.iter()
        .zip(w)
        .map(|(v, g)| v / (ms + eps).sqrt() * g)
        .collect()
}

/// transformers' `apply_rotary_pos_emb` for one head: `x·cos + rotate_half(x)·sin`
/// with `cos = cat(c, c)`, `rotate_half(x) = cat(-x2, x1)`.
fn rope_head(x: &[f64], pos: usize, theta: f64) -> Vec<f64> {
    let d = x.len();
    let half = d / 2;
    let mut rot = Vec::with_capacity(d);
    rot.extend(x[half..].iter().map(|v| -v));
    rot.extend_from_slice(&x[..half]);
    (0..d)
        .map(|i| {
            let fi = (i % half) as f64;
            let a = pos as f64 / theta.powf(2.0 * fi / d as f64);
            x[i] * a.cos() + rot[i] * a.sin()
        })
        .collect()
}

/// Logits for every position of `tokens`, recomputing the whole sequence.
fn naive_logits(w: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let c = &w.config;
    let (h, nh, nkv, hd, inter) = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_kv_heads(),
        c.head_dim(),
        c.intermediate_size,
    );
    let (qd, kvd, eps) = (nh * hd, nkv * hd, c.rms_norm_eps);
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| f(&w.embed_tokens[t as usize * h..(t as usize + 1) * h]))
        .collect();
    for l in 0..c.num_hidden_layers {
        let sl = |v: &[bf16], n: usize| f(&v[l * n..(l + 1) * n]);
        let (ln1, ln2) = (
            sl(&w.input_layernorm, h),
            sl(&w.post_attention_layernorm, h),
        );
        let (wq, bq) = (sl(&w.q_proj, qd * h), sl(&w.q_bias, qd));
        let (wk, bk) = (sl(&w.k_proj, kvd * h), sl(&w.k_bias, kvd));
        let (wv, bv) = (sl(&w.v_proj, kvd * h), sl(&w.v_bias, kvd));
        let wo = sl(&w.o_proj, h * qd);
        let (wg, wu, wd) = (
            sl(&w.gate_proj, inter * h),
            sl(&w.up_proj, inter * h),
            sl(&w.down_proj, h * inter),
        );
        let mut qs = vec![];
        let mut ks = vec![];
        let mut vs = vec![];
        for (p, x) in xs.iter().enumerate() {
            let xn = norm(x, &ln1, eps);
            let add = |a: Vec<f64>, b: &[f64]| -> Vec<f64> {
                a.iter().zip(b).map(|(x, y)| x + y).collect()
            };
            let q = add(linear(&xn, &wq), &bq);
            let k = add(linear(&xn, &wk), &bk);
            let v = add(linear(&xn, &wv), &bv);
            qs.push(
                q.chunks(hd)
                    .flat_map(|hh| rope_head(hh, p, c.rope_theta))
                    .collect::<Vec<_>>(),
            );
            ks.push(
                k.chunks(hd)
                    .flat_map(|hh| rope_head(hh, p, c.rope_theta))
                    .collect::<Vec<_>>(),
            );
            vs.push(v);
        }
        for p in 0..xs.len() {
            let mut att = vec![0f64; qd];
            for head in 0..nh {
                let kvh = head * nkv / nh;
                let q = &qs[p][head * hd..(head + 1) * hd];
                let s: Vec<f64> = (0..=p)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for i in 0..hd {
                        att[head * hd + i] += ej / z * vs[j][kvh * hd + i];
                    }
                }
            }
            let o = linear(&att, &wo);
            let x = &mut xs[p];
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let xn = norm(x, &ln2, eps);
            let g = linear(&xn, &wg);
            let u = linear(&xn, &wu);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let dn = linear(&act, &wd);
            for (a, b) in x.iter_mut().zip(&dn) {
                *a += b;
            }
        }
    }
    let fnorm = f(&w.norm);
    let head = f(w.lm_head());
    xs.iter()
        .map(|x| linear(&norm(x, &fnorm, eps), &head))
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max).max(1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

const TOKENS: [u32; 7] = [3, 17, 99, 42, 0, 100, 17];

#[test]
fn step_by_step_matches_naive() {
    for tied in [true, false] {
        let w = Arc::new(synthetic_weights(&tiny_config(tied), 7));
        let want = naive_logits(&w, &TOKENS);
        let mut r = Reference::new(w, ReferenceOptions::new(16)).unwrap();
        for (p, &t) in TOKENS.iter().enumerate() {
            let got = r.step(t, p).unwrap();
            assert_close(&got, &want[p], 1e-4, &format!("tied={tied} pos {p}"));
        }
    }
}

#[test]
fn prefill_equals_steps_and_naive() {
    let w = Arc::new(synthetic_weights(&tiny_config(true), 11));
    let want = naive_logits(&w, &TOKENS);
    let mut a = Reference::new(w.clone(), ReferenceOptions::new(16)).unwrap();
    let last = a.prefill(&TOKENS[..5]).unwrap();
    assert_close(&last, &want[4], 1e-4, "prefill last");
    // Continue decoding after a prefill.
    let got = a.step(TOKENS[5], 5).unwrap();
    assert_close(&got, &want[5], 1e-4, "step after prefill");
    // Prefill from a non-zero start on top of earlier steps.
    let mut b = Reference::new(w, ReferenceOptions::new(16)).unwrap();
    b.step(TOKENS[0], 0).unwrap();
    b.step(TOKENS[1], 1).unwrap();
    let last = b.prefill_seq(0, &TOKENS[2..7], 2).unwrap();
    assert_close(&last, &want[6], 1e-4, "prefill_seq from 2");
}

#[test]
fn batched_sequences_equal_single_sequences() {
    let w = Arc::new(synthetic_weights(&tiny_config(false), 3));
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[50], &[7, 7, 7, 7, 7]];
    let mut multi = Reference::new(w.clone(), ReferenceOptions::new(12).sequences(3)).unwrap();
    let mut next = vec![];
    let mut pos = vec![];
    for (s, p) in prompts.iter().enumerate() {
        next.push(argmax(&multi.prefill_seq(s, p, 0).unwrap()));
        pos.push(p.len());
    }
    let mut batched: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    for _ in 0..4 {
        let logits = multi.step_batch(&next, &pos).unwrap();
        for (b, row) in logits.chunks(w.config.vocab_size).enumerate() {
            next[b] = argmax(row);
            pos[b] += 1;
            batched[b].push(next[b]);
        }
    }
    for (s, p) in prompts.iter().enumerate() {
        let mut single = Reference::new(w.clone(), ReferenceOptions::new(12)).unwrap();
        assert_eq!(single.generate_greedy(p, 5).unwrap(), batched[s], "seq {s}");
    }
}

#[test]
fn trace_records_every_op_consistently() {
    let w = Arc::new(synthetic_weights(&tiny_config(true), 5));
    let mut r = Reference::new(w.clone(), ReferenceOptions::new(8)).unwrap();
    r.step(4, 0).unwrap();
    let tr = r.step_traced(9, 1).unwrap();
    let d = *r.dims();
    assert_eq!(tr.layers.len(), d.layers);
    assert_eq!(tr.embed.len(), d.hidden);
    assert_eq!(tr.logits.len(), d.vocab);
    let l0 = &tr.layers[0];
    assert_eq!(l0.q.len(), d.q_dim());
    assert_eq!(l0.k_rot.len(), d.kv_dim());
    assert_eq!(l0.act.len(), d.intermediate);
    // Ops recomputed from the trace agree with the trace.
    let lw = layer_weights(&w, &d, 0);
    let mut xn = vec![0f32; d.hidden];
    rms_norm(&tr.embed, lw.input_layernorm, d.rms_norm_eps, &mut xn);
    assert_eq!(xn, l0.attn_norm);
    let mut q = l0.q.clone();
    rotary(&mut q, &[1], r.rope());
    assert_eq!(q, l0.q_rot);
    // The cache holds this step's rotated K at position 1.
    assert_eq!(
        &r.cache(0).k_layer(0)[d.kv_dim()..2 * d.kv_dim()],
        &l0.k_rot[..]
    );
    // Layer 1 starts from layer 0's output.
    rms_norm(
        &l0.h_out,
        layer_weights(&w, &d, 1).input_layernorm,
        d.rms_norm_eps,
        &mut xn,
    );
    assert_eq!(xn, tr.layers[1].attn_norm);
    assert_eq!(argmax(&tr.logits), argmax(&r.step(9, 1).unwrap()));
}

#[test]
fn kv_bf16_rounds_the_cache_only() {
    let w = Arc::new(synthetic_weights(&tiny_config(true), 9));
    let mut exact = Reference::new(w.clone(), ReferenceOptions::new(8)).unwrap();
    let mut rounded = Reference::new(w, ReferenceOptions::new(8).kv_bf16(true)).unwrap();
    let a = exact.prefill(&[5, 6, 7]).unwrap();
    let b = rounded.prefill(&[5, 6, 7]).unwrap();
    for v in &rounded.cache(0).k[..3 * 32] {
        assert_eq!(*v, bf16::from_f32(*v).to_f32(), "cache entry not bf16");
    }
    assert_ne!(a, b, "rounding should perturb logits");
    let rel = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f32>()
        .sqrt()
        / a.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!(rel < 2e-2, "bf16 KV changed logits by {rel}");
}

#[test]
fn rotary_pairs_i_and_i_plus_half() {
    let rope = Rope::new(8, 10_000.0, 4);
    let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 1.0).collect(); // [2 heads, 8]
    let mut x = x0.clone();
    rotary(&mut x, &[3], &rope);
    for head in 0..2 {
        let want = rope_head(
            &x0[head * 8..(head + 1) * 8]
                .iter()
                .map(|&v| f64::from(v))
                .collect::<Vec<_>>(),
            3,
            10_000.0,
        );
        assert_close(&x[head * 8..(head + 1) * 8], &want, 1e-6, "rotary");
    }
    // Position 0 is the identity.
    let mut y = x0.clone();
    rotary(&mut y, &[0], &rope);
    assert_eq!(y, x0);
}

#[test]
fn argmax_ties_pick_lowest_index() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
    assert_eq!(
        top_k(&[1.0, 3.0, 3.0, 2.0, 0.0], 3),
        vec![(1, 3.0), (2, 3.0), (3, 2.0)]
    );
}

#[test]
fn bad_inputs_are_named_errors() {
    let w = Arc::new(synthetic_weights(&tiny_config(true), 1));
    let mut r = Reference::new(w.clone(), ReferenceOptions::new(4)).unwrap();
    assert!(matches!(
        r.step(101, 0),
        Err(ModelError::TokenOutOfVocab {
            token: 101,
            vocab_size: 101
        })
    ));
    assert!(matches!(
        r.step(1, 4),
        Err(ModelError::PositionOutOfRange {
            pos: 4,
            capacity: 4
        })
    ));
    assert!(matches!(r.prefill(&[]), Err(ModelError::EmptyPrompt)));
    assert!(matches!(
        r.generate_greedy(&[1, 2], 3),
        Err(ModelError::KvCapacity {
            prompt: 2,
            new_tokens: 3,
            capacity: 4
        })
    ));
    assert_eq!(r.generate_greedy(&[1, 2], 2).unwrap().len(), 2);
    let mut short = (*w).clone();
    short.q_bias.pop();
    let e = Reference::new(Arc::new(short), ReferenceOptions::new(4)).unwrap_err();
    assert!(e.to_string().contains("q_bias"), "{e}");
}
