//! Against Hugging Face transformers' goldens
//! (`tests/data/golden/qwen2.5-coder-0.5b-instruct.jsonl`):
//!
//! * the tokenizer and chat template reproduce every prompt's `input_ids`
//!   (always runs; the tokenizer fixtures are small);
//! * the CPU reference on the real Qwen2.5-Coder-0.5B-Instruct weights
//!   (directory in `QMK_REAL_QWEN`, built by `scripts/fetch-real-qwen.sh`;
//!   skipped with a message when unset) follows the comparison rule of
//!   vLLM's `check_logprobs_close`: greedy ids
//!   equal up to the first divergence, and there each side's token is in the
//!   other's top 5. It prints how many of the 8 prompts match all 48 ids and
//!   the largest difference of the golden top-1 token's logprob;
//! * the same with Qwen2.5's YaRN setting in the config, against
//!   transformers' goldens made with it, after checking the rotary
//!   frequencies and attention factor against the ones transformers
//!   computed.
//!
//! The golden files and the tokenizer files they were made with live in
//! `tests/data/` (its README says how they were made).

use std::path::PathBuf;
use std::sync::Arc;

use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::reference::{argmax, log_softmax, top_k, Reference, ReferenceOptions};
use qmk_model::tokenizer::Tokenizer;
use serde::Deserialize;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn tokenizer_dir() -> PathBuf {
    data().join("qwen-tokenizer")
}

#[derive(Debug, Deserialize)]
struct Golden {
    id: String,
    prompt: String,
    chat: bool,
    input_ids: Vec<u32>,
    output_ids: Vec<u32>,
    top5: Vec<Vec<(u32, f64)>>, // [steps, 5] of (id, logprob)
    text: String,
}

/// Transformers' greedy outputs on the real weights, plain rotary table.
const PLAIN: &str = "golden/qwen2.5-coder-0.5b-instruct.jsonl";
/// The same with Qwen2.5's documented YaRN setting ([`yarn_scaling`]).
const YARN: &str = "golden/qwen2.5-coder-0.5b-instruct-yarn4.jsonl";
/// The rotary frequencies and attention factor transformers computed for
/// that setting.
const YARN_ROPE: &str = "golden/rope-yarn4.json";

fn yarn_scaling() -> serde_json::Value {
    serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
}

fn goldens() -> Vec<Golden> {
    goldens_in(PLAIN)
}

fn goldens_in(file: &str) -> Vec<Golden> {
    let path = data().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("golden line"))
        .collect()
}

/// The prompt's ids as transformers built them: chat prompts through the
/// template (one user message, generation prompt on), no special tokens
/// added by the tokenizer.
fn prompt_ids(tok: &Tokenizer, tmpl: &ChatTemplate, g: &Golden) -> Vec<u32> {
    let text = if g.chat {
        tmpl.render(&[Message::user(g.prompt.as_str())], true)
            .unwrap()
    } else {
        g.prompt.clone()
    };
    tok.encode(&text).unwrap()
}

#[test]
fn tokenizer_and_chat_template_reproduce_golden_input_ids() {
    let tok = Tokenizer::from_dir(tokenizer_dir()).unwrap();
    let tmpl = ChatTemplate::from_dir(tokenizer_dir()).unwrap();
    let gs = goldens();
    assert_eq!(gs.len(), 8);
    for g in &gs {
        assert_eq!(prompt_ids(&tok, &tmpl, g), g.input_ids, "prompt `{}`", g.id);
        // Decoding the golden output gives transformers' text.
        assert_eq!(
            tok.decode(&g.output_ids, false).unwrap(),
            g.text,
            "text `{}`",
            g.id
        );
    }
}

#[test]
fn chat_template_render_is_the_qwen_format() {
    let tmpl = ChatTemplate::from_dir(tokenizer_dir()).unwrap();
    let out = tmpl
        .render(
            &[
                Message::system("Be brief."),
                Message::user("Hi"),
                Message::assistant("Hello!"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n"
    );
    let no_gen = tmpl.render(&[Message::user("Hi")], false).unwrap();
    assert!(
        no_gen.ends_with("<|im_start|>user\nHi<|im_end|>\n"),
        "{no_gen}"
    );
    // Tools go through `tojson` with Python's separators.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    let out = tmpl
        .render_with(&[Message::user("x")], Some(&tools), true)
        .unwrap();
    assert!(
        out.contains(r#"{"function": {"name": "f"}, "type": "function"}"#),
        "{out}"
    );
}

#[test]
fn chat_template_sources_and_precedence() {
    let src = std::fs::read_to_string(tokenizer_dir().join("chat_template.jinja")).unwrap();
    let msgs = [Message::user("Hi")];
    let want = ChatTemplate::from_dir(tokenizer_dir())
        .unwrap()
        .render(&msgs, true)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = |t: serde_json::Value| {
        serde_json::json!({"eos_token": {"content": "<|im_end|>"}, "chat_template": t}).to_string()
    };
    // 1. a string field in tokenizer_config.json
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        cfg(src.clone().into()),
    )
    .unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap();
    assert_eq!(t.render(&msgs, true).unwrap(), want);
    assert_eq!(t.special_tokens()["eos_token"], "<|im_end|>");
    // 2. a list of named templates: `default` is used
    let list = serde_json::json!([
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": src},
    ]);
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg(list)).unwrap();
    assert_eq!(
        ChatTemplate::from_dir(dir.path())
            .unwrap()
            .render(&msgs, true)
            .unwrap(),
        want
    );
    // 3. chat_template.jinja takes precedence over the config field
    std::fs::write(dir.path().join("chat_template.jinja"), "J{{ eos_token }}").unwrap();
    assert_eq!(
        ChatTemplate::from_dir(dir.path())
            .unwrap()
            .render(&msgs, true)
            .unwrap(),
        "J<|im_end|>"
    );
    // 4. nothing at all: an error naming the directory
    let empty = tempfile::tempdir().unwrap();
    let e = ChatTemplate::from_dir(empty.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no chat template"), "{e}");
}

#[test]
fn malformed_tokenizer_json_is_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, "{\"model\": 3").unwrap();
    let e = Tokenizer::from_file(&path).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("malformed"),
        "{e}"
    );
    let e = Tokenizer::from_dir(dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot read"), "{e}");
}

#[test]
fn stream_decode_never_splits_a_character() {
    let tok = Tokenizer::from_dir(tokenizer_dir()).unwrap();
    let text = "Rust 🦀 macht Spaß — 中文字符，日本語の文字 and emoji 👩‍👩‍👧‍👦!\n<|im_end|>";
    let ids = tok.encode(text).unwrap();
    // Some token must end mid-character for this test to mean anything.
    let cut = (1..ids.len())
        .find(|&n| tok.decode(&ids[..n], false).unwrap().ends_with('\u{FFFD}'))
        .expect("no token boundary falls inside a character");
    let mut dec = tok.stream_decoder(false);
    let mut out = String::new();
    for &id in &ids {
        if let Some(piece) = dec.push(id).unwrap() {
            assert!(
                !piece.contains('\u{FFFD}'),
                "piece {piece:?} splits a character"
            );
            out.push_str(&piece);
        }
    }
    assert_eq!(dec.flush().unwrap(), None);
    assert_eq!(out, text);
    // Skipping special tokens drops `<|im_end|>` and nothing else.
    let mut dec = tok.stream_decoder(true);
    let out: String = ids.iter().filter_map(|&id| dec.push(id).unwrap()).collect();
    assert_eq!(out, text.trim_end_matches("<|im_end|>"));
    // Every golden output streams to the golden text.
    for g in goldens() {
        let mut dec = tok.stream_decoder(false);
        let mut out: String = g
            .output_ids
            .iter()
            .filter_map(|&id| dec.push(id).unwrap())
            .collect();
        out.extend(dec.flush().unwrap());
        assert_eq!(out, g.text, "{}", g.id);
    }
    // An incomplete character at the end is held back, then flushed as
    // `decode` shows it.
    let mut dec = tok.stream_decoder(false);
    let mut out: String = ids[..cut]
        .iter()
        .filter_map(|&id| dec.push(id).unwrap())
        .collect();
    assert!(!out.ends_with('\u{FFFD}'));
    out.extend(dec.flush().unwrap());
    assert_eq!(out, tok.decode(&ids[..cut], false).unwrap());
}

/// One prompt's comparison with its golden.
struct Outcome {
    id: String,
    /// First step where our id differs from the golden id.
    divergence: Option<usize>,
    /// At the divergence each side's token is in the other's top 5 (true
    /// when there is none).
    rule_ok: bool,
    /// Largest |our logprob - golden logprob| of the golden top-1 token, over
    /// the steps whose context is identical (up to the divergence).
    max_lp_diff: f64,
    detail: String,
}

#[test]
fn cpu_reference_matches_hf_goldens_on_real_weights() {
    check_real_weights(PLAIN, None);
}

/// Qwen2.5's YaRN setting on the real weights: the rotary table equals
/// transformers' number by number, and the greedy outputs follow its
/// goldens by the same rule as the plain ones.
#[test]
fn cpu_reference_matches_hf_yarn_goldens_on_real_weights() {
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data().join(YARN_ROPE)).unwrap()).unwrap();
    assert_eq!(hf["rope_scaling"], yarn_scaling());
    let mut config = qmk_model::Config::preset("0.5b").unwrap();
    config.rope_scaling = Some(yarn_scaling());
    let spec = config.rope().unwrap();
    let ours = qmk_model::rope::inv_freq(&spec, config.head_dim());
    let theirs: Vec<f64> = hf["inv_freq"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(ours.len(), theirs.len());
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        // Same f32 steps; a last-bit difference of powf is allowed.
        assert!(
            (*a as f64 - b).abs() <= 4.0 * f32::EPSILON as f64 * b.abs(),
            "inv_freq[{i}]: ours {a:e}, transformers {b:e}"
        );
    }
    let af = hf["attention_factor"].as_f64().unwrap();
    assert!(
        (spec.attention_factor() - af).abs() < 1e-12,
        "attention factor: ours {}, transformers {af}",
        spec.attention_factor()
    );
    // The plain and the YaRN goldens differ, so the check below sees the
    // scaling.
    let (plain, yarn) = (goldens_in(PLAIN), goldens_in(YARN));
    assert!(
        plain
            .iter()
            .zip(&yarn)
            .any(|(p, y)| p.output_ids != y.output_ids),
        "the YaRN goldens equal the plain ones"
    );
    check_real_weights(YARN, Some(yarn_scaling()));
}

/// The CPU reference on the real weights (with `rope_scaling` replaced when
/// given) against the goldens in `file`.
fn check_real_weights(file: &str, rope_scaling: Option<serde_json::Value>) {
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: QMK_REAL_QWEN is not set (run scripts/fetch-real-qwen.sh and point \
             QMK_REAL_QWEN at the directory it prints)"
        );
        return;
    };
    let t0 = std::time::Instant::now();
    let mut weights = qmk_model::load_weights(&dir).unwrap();
    if let Some(s) = rope_scaling {
        weights.config.rope_scaling = Some(s);
        weights.config.validate().unwrap();
    }
    let weights = Arc::new(weights);
    let vocab = weights.config.vocab_size;
    eprintln!("loaded {} in {:.1?}", dir.display(), t0.elapsed());

    // The prompt ids from our own tokenizer and template (asserted equal to
    // the goldens' by the test above; checked again here on the model dir's
    // copies).
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir).unwrap();
    let gs = goldens_in(file);
    let prompts: Vec<Vec<u32>> = gs.iter().map(|g| prompt_ids(&tok, &tmpl, g)).collect();
    for (g, p) in gs.iter().zip(&prompts) {
        assert_eq!(p, &g.input_ids, "prompt `{}`", g.id);
    }
    let steps = gs[0].output_ids.len();
    let capacity = prompts.iter().map(Vec::len).max().unwrap() + steps;

    // All 8 prompts share each decode step's pass over the weights.
    let t1 = std::time::Instant::now();
    let opts = ReferenceOptions::new(capacity).sequences(gs.len());
    let mut r = Reference::new(weights, opts).unwrap();
    let mut logits: Vec<f32> = Vec::with_capacity(gs.len() * vocab); // [8, V]
    for (s, p) in prompts.iter().enumerate() {
        logits.extend(r.prefill_seq(s, p, 0).unwrap());
    }
    let t_prefill = t1.elapsed();
    let mut ours: Vec<Vec<u32>> = vec![vec![]; gs.len()]; // [8, steps]
    let mut our_top5: Vec<Vec<Vec<u32>>> = vec![vec![]; gs.len()]; // [8, steps, 5]
    let mut lp_of_golden_top1: Vec<Vec<f64>> = vec![vec![]; gs.len()]; // [8, steps]
    for step in 0..steps {
        for (s, row) in logits.chunks(vocab).enumerate() {
            let lp = log_softmax(row);
            let gold_top1 = gs[s].top5[step][0].0;
            lp_of_golden_top1[s].push(lp[gold_top1 as usize]);
            our_top5[s].push(top_k(row, 5).into_iter().map(|(i, _)| i).collect());
            ours[s].push(argmax(row));
        }
        if step + 1 < steps {
            let next: Vec<u32> = ours.iter().map(|o| o[step]).collect();
            let pos: Vec<usize> = prompts.iter().map(|p| p.len() + step).collect();
            logits = r.step_batch(&next, &pos).unwrap();
        }
    }
    let t_all = t1.elapsed();

    let mut outcomes = vec![];
    for (s, g) in gs.iter().enumerate() {
        let divergence = (0..steps).find(|&i| ours[s][i] != g.output_ids[i]);
        let last_same_context = divergence.unwrap_or(steps - 1);
        let max_lp_diff = (0..=last_same_context)
            .map(|i| (lp_of_golden_top1[s][i] - g.top5[i][0].1).abs())
            .fold(0.0, f64::max);
        let (rule_ok, detail) = match divergence {
            None => (true, "all ids equal".to_string()),
            Some(i) => {
                let gold_top5: Vec<u32> = g.top5[i].iter().map(|&(id, _)| id).collect();
                let ok =
                    gold_top5.contains(&ours[s][i]) && our_top5[s][i].contains(&g.output_ids[i]);
                (
                    ok,
                    format!(
                        "diverges at step {i}: ours {} (golden top5 {:?}), golden {} (our top5 {:?})",
                        ours[s][i], g.top5[i], g.output_ids[i], our_top5[s][i]
                    ),
                )
            }
        };
        outcomes.push(Outcome {
            id: g.id.clone(),
            divergence,
            rule_ok,
            max_lp_diff,
            detail,
        });
    }

    let exact = outcomes.iter().filter(|o| o.divergence.is_none()).count();
    let worst = outcomes.iter().map(|o| o.max_lp_diff).fold(0.0, f64::max);
    eprintln!("golden report ({file}: CPU reference vs HF transformers, {steps} greedy steps):");
    for o in &outcomes {
        eprintln!(
            "  {:<9} {} max |dlogprob(top1)| = {:.2e}  {}",
            o.id,
            if o.rule_ok { "ok  " } else { "FAIL" },
            o.max_lp_diff,
            o.detail
        );
    }
    eprintln!(
        "  exact match of all {steps} ids: {exact} of {}",
        outcomes.len()
    );
    eprintln!("  largest |logprob difference| of the golden top-1 token: {worst:.3e}");
    eprintln!(
        "  time: prefill {:.1?}, prefill + {} batched steps {:.1?}",
        t_prefill,
        steps - 1,
        t_all
    );
    for o in &outcomes {
        assert!(o.rule_ok, "prompt `{}` fails the rule: {}", o.id, o.detail);
    }
}

/// The CPU reference split over 2 tensor-parallel ranks (the real model's 14
/// query heads and 2 KV heads, one KV group per rank; its 4,864-wide MLP and
/// 151,936-row vocabulary halved), with the partial sums all-reduced in rank
/// order: the first 2 golden prompts give transformers' 48 ids exactly.
#[test]
fn tensor_parallel_reference_matches_hf_goldens_at_two_ranks() {
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: QMK_REAL_QWEN is not set (run scripts/fetch-real-qwen.sh and point \
             QMK_REAL_QWEN at the directory it prints)"
        );
        return;
    };
    let weights = Arc::new(qmk_model::load_weights(&dir).unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir).unwrap();
    for g in goldens().iter().take(2) {
        let prompt = prompt_ids(&tok, &tmpl, g);
        assert_eq!(prompt, g.input_ids, "prompt `{}`", g.id);
        let n = g.output_ids.len();
        let mut tp =
            qmk_model::ShardedReference::new(weights.clone(), 2, prompt.len() + n).unwrap();
        let ours = tp.generate_greedy(&prompt, n).unwrap();
        assert_eq!(ours, g.output_ids, "prompt `{}` at 2 ranks", g.id);
        eprintln!("PASS {}: {n} ids equal at 2 ranks", g.id);
    }
}
