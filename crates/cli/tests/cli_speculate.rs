//! Speculative decoding through the command line on the tiny synthetic
//! model (real Qwen tokenizer) with the CPU backend: `--speculate` and
//! `--draft-model` on generate, chat and `bench --prompts`, the
//! `speculation` object of `--json`, and the flag errors.

mod support;

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{
    chat_args, command, run, tiny_model_arg as dir, tiny_model_copy, wait_with_deadline, Generate,
};

/// Greedy `generate --json` of 24 tokens (end-of-text ignored) with `extra`.
fn greedy(model: &str, extra: &[&str]) -> Value {
    let r = Generate::cpu(model, "one two three one two three one two")
        .raw()
        .exactly("24")
        .greedy()
        .json()
        .args(extra)
        .run();
    r.assert_ok();
    r.json()
}

#[test]
fn every_mode_gives_the_plain_greedy_ids_and_reports_what_it_did() {
    let Some(m) = dir() else { return };
    let plain = greedy(&m, &["--speculate", "off"]);
    assert_eq!(plain["speculation"]["mode"], "off", "{plain}");
    assert_eq!(plain["speculation"]["proposed"], 0);
    assert_eq!(plain["speculation"]["tokens_per_step"], 1.0);
    let ids = &plain["output_ids"];
    assert_eq!(ids.as_array().unwrap().len(), 24);
    for (extra, mode) in [
        (&["--speculate", "ngram", "--speculate-always"][..], "ngram"),
        (&[][..], "ngram"), // auto: prompt lookup without a draft model
        (
            &[
                "--draft-model",
                &m,
                "--speculate",
                "draft",
                "--speculate-always",
            ][..],
            "draft",
        ),
        (&["--draft-model", &m, "--speculate-always"][..], "draft"), // auto
    ] {
        let v = greedy(&m, extra);
        let s = &v["speculation"];
        assert_eq!(&v["output_ids"], ids, "{extra:?}: {v}");
        assert_eq!(s["mode"], mode, "{extra:?}: {s}");
        for k in ["proposed", "accepted", "steps", "verify_steps"] {
            assert!(s[k].is_u64(), "{k}: {s}");
        }
        assert!(s["tokens_per_step"].as_f64().unwrap() >= 1.0, "{s}");
        if mode == "draft" {
            // The model drafting for itself: every guess holds.
            assert!(s["proposed"].as_u64().unwrap() > 0, "{s}");
            assert_eq!(s["accepted"], s["proposed"], "{s}");
            assert_eq!(s["acceptance"], 1.0, "{s}");
        }
    }
}

#[test]
fn top_logprobs_are_the_same_with_speculation() {
    let Some(m) = dir() else { return };
    let plain = greedy(&m, &["--speculate", "off", "--top-logprobs", "3"]);
    let spec = greedy(
        &m,
        &[
            "--speculate",
            "ngram",
            "--speculate-always",
            "--top-logprobs",
            "3",
        ],
    );
    assert!(
        spec["speculation"]["verify_steps"].as_u64().unwrap() > 0,
        "{spec}"
    );
    assert_eq!(spec["top_logprobs"].as_array().unwrap().len(), 24);
    assert_eq!(spec["top_logprobs"], plain["top_logprobs"]);
}

#[test]
fn sampling_speculates_only_when_asked() {
    let Some(m) = dir() else { return };
    let sample = |extra: &[&str]| {
        let r = Generate::cpu(&m, "Hi")
            .exactly("8")
            .args(&["--seed", "3"])
            .json()
            .args(extra)
            .run();
        r.assert_ok();
        r.json()
    };
    // The model's generation_config.json samples: auto runs plain steps.
    let auto = sample(&[]);
    assert_eq!(auto["sampling"]["greedy"], false);
    assert_eq!(auto["speculation"]["mode"], "off", "{auto}");
    let asked = sample(&["--speculate", "ngram", "--speculate-always"]);
    assert_eq!(asked["speculation"]["mode"], "ngram", "{asked}");
    assert_eq!(asked["output_ids"].as_array().unwrap().len(), 8);
    let drafted = sample(&["--speculate", "draft", "--draft-model", &m]);
    assert_eq!(drafted["speculation"]["mode"], "draft", "{drafted}");
}

#[test]
fn the_stats_line_and_chat_report_speculation() {
    let Some(m) = dir() else { return };
    let r = Generate::cpu(&m, "a b a b a b")
        .raw()
        .exactly("6")
        .greedy()
        .args(&["--speculate", "ngram"])
        .run();
    r.assert_ok();
    assert!(
        r.stderr.contains("speculation ngram: ") && r.stderr.contains("tokens/step"),
        "{r:#?}"
    );
    // chat: the same flags, a reply per line of stdin.
    let mut child = command(
        &chat_args(
            &m,
            "6",
            &[
                "--temperature",
                "0",
                "--draft-model",
                &m,
                "--speculate-always",
            ],
        ),
        &[],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let code = wait_with_deadline(&mut child, Duration::from_secs(300));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("speculation draft: "), "{err}");
}

#[test]
fn bad_speculation_flags_are_refused() {
    let base = |extra: &[&str]| Generate::new("/nonexistent", "x").args(extra).run();
    base(&["--speculate", "draft"]).assert_usage_error(&["--speculate draft needs --draft-model"]);
    base(&["--speculate", "off", "--draft-model", "/x"])
        .assert_usage_error(&["--draft-model is unused with --speculate off"]);
    base(&["--speculate", "sometimes"]).assert_usage_error(&["--speculate", "auto"]);
    base(&["--draft-revision", "main"]).assert_usage_error(&["--draft-model"]);
    run(&["bench", "--speculate", "ngram"]).assert_usage_error(&["--prompts"]);
    for cmd in ["chat", "serve"] {
        run(&[cmd, "--model", "/nonexistent", "--speculate", "draft"])
            .assert_usage_error(&["--speculate draft needs --draft-model"]);
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_naming_both() {
    let Some(m) = dir() else { return };
    // A copy whose config claims more rows than the target has: refused
    // before its weights are read.
    let big = tiny_model_copy().unwrap();
    let cfg = big.path().join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["vocab_size"] = 152_064.into();
    std::fs::write(&cfg, c.to_string()).unwrap();
    let draft = big.path().to_string_lossy().into_owned();
    let r = Generate::cpu(&m, "x")
        .args(&["--draft-model", &draft])
        .run();
    r.assert_error(&["draft model", &draft, "cannot draft for", &m, "152063"]);
}

#[test]
fn bench_prompts_compares_plain_and_speculative_decoding() {
    let Some(m) = dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"name\": \"chat\", \"messages\": [{\"role\": \"user\", \"content\": \"rename x to y: x = x + 1\"}]}\n\
         \n\
         {\"name\": \"raw\", \"prompt\": \"a b c a b c a b\"}\n",
    )
    .unwrap();
    let p = prompts.to_string_lossy().into_owned();
    // `bench --prompts` on the tiny model (CPU), plus `extra`.
    let bench = |extra: &[&str]| {
        let mut args = vec!["bench", "--model", &m, "--backend", "cpu", "--prompts", &p];
        args.extend_from_slice(extra);
        run(&args)
    };
    let r = bench(&[
        "--speculate",
        "ngram",
        "--speculate-always",
        "--max-new-tokens",
        "8",
        "--json",
    ]);
    r.assert_ok();
    let lines: Vec<Value> = r
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{r:#?}");
    assert_eq!(lines[0]["name"], "chat");
    assert_eq!(lines[1]["name"], "raw");
    for l in &lines[..2] {
        assert_eq!(l["identical"], true, "{l}");
        assert_eq!(l["speculation"]["mode"], "ngram", "{l}");
        assert!(l["plain_tok_per_s"].as_f64().unwrap() > 0.0, "{l}");
    }
    let s = &lines[2];
    assert_eq!(
        (s["summary"].clone(), s["prompts"].clone()),
        (true.into(), 2.into())
    );
    assert_eq!(s["identical"], true);
    assert_eq!(s["speculate"], "ngram");
    // Text: one line per prompt and the summary.
    let r = bench(&["--max-new-tokens", "4"]);
    r.assert_ok();
    assert!(r.stdout.contains("all 2 prompts on cpu"), "{r:#?}");
    assert!(r.stdout.contains("identical: yes"), "{r:#?}");
    // The tiny model holds 256 positions.
    bench(&["--max-new-tokens", "300"])
        .assert_error(&["--max-new-tokens 300", "max_position_embeddings (256)"]);
    // --speculate off has nothing to compare.
    bench(&["--speculate", "off"]).assert_error(&["not off"]);
}
