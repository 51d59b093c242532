//! `qwen-mk generate` and `qwen-mk chat` end to end on a tiny synthetic
//! model (real Qwen tokenizer) with the CPU backend.

mod support;

use std::time::Duration;

use support::{chat_args, qwen_mk, tiny_model_arg as dir, tiny_model_copy, Generate};

#[test]
fn json_output_has_every_field_and_the_chat_prompt() {
    let Some(m) = dir() else { return };
    let r = Generate::cpu(&m, "Hi").exactly("5").json().run();
    r.assert_ok();
    let j = r.json();
    for k in [
        "model",
        "backend",
        "prompt_ids",
        "output_ids",
        "text",
        "prefill_ms",
        "decode_tok_per_s",
    ] {
        assert!(j.get(k).is_some(), "missing {k}: {j}");
    }
    assert_eq!(j["backend"], "cpu");
    assert_eq!(j["model"], m.as_str());
    assert_eq!(j["output_ids"].as_array().unwrap().len(), 5);
    // The Qwen chat template with its default system message, as transformers
    // renders it (same ids as the golden "short" prompt).
    let want: Vec<u64> = vec![
        151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264,
        10950, 17847, 13, 151645, 198, 151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198,
    ];
    let got: Vec<u64> = j["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(got, want);
    assert!(j.get("top_logprobs").is_none());
}

#[test]
fn raw_system_and_top_logprobs() {
    let Some(m) = dir() else { return };
    let raw = Generate::cpu(&m, "Hello world")
        .raw()
        .exactly("4")
        .greedy()
        .json()
        .args(&["--top-logprobs", "3"])
        .run();
    raw.assert_ok();
    let j = raw.json();
    assert_eq!(j["prompt_ids"], serde_json::json!([9707, 1879]));
    let top = j["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 4, "one entry per generated token");
    for (step, entry) in top.iter().enumerate() {
        let entry = entry.as_array().unwrap();
        assert_eq!(entry.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(entry[0][0], j["output_ids"][step]);
        let lps: Vec<f64> = entry.iter().map(|e| e[1].as_f64().unwrap()).collect();
        assert!(
            lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0,
            "{lps:?}"
        );
    }
    let sys = Generate::cpu(&m, "Hi")
        .args(&["--system", "Be brief."])
        .max_new_tokens("1")
        .json()
        .run();
    sys.assert_ok();
    let ids = sys.json()["prompt_ids"].clone();
    // <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi...
    assert_eq!(&ids.as_array().unwrap()[..3], &[151644, 8948, 198]);
    assert!(
        ids.as_array().unwrap().len() < 20,
        "custom system replaces the default: {ids}"
    );
}

#[test]
fn streaming_prints_text_and_a_stats_line() {
    let Some(m) = dir() else { return };
    let six = Generate::cpu(&m, "Hi").exactly("6").greedy();
    let r = six.run();
    r.assert_ok();
    let j = six.json().run().json();
    // Streamed text is the decoded output (special tokens skipped) plus a newline.
    assert_eq!(r.stdout, format!("{}\n", j["text"].as_str().unwrap()));
    let stats = r.stderr.lines().last().unwrap();
    assert!(
        stats.contains("[cpu] prompt 30 tokens") && stats.contains("tok/s"),
        "{stats}"
    );
    // --quiet: nothing on stderr.
    let q = Generate::cpu(&m, "Hi")
        .max_new_tokens("2")
        .args(&["--quiet"])
        .run();
    q.assert_ok();
    assert_eq!(q.stderr, "");
}

#[test]
fn auto_backend_says_which_it_uses() {
    let Some(m) = dir() else { return };
    let r = Generate::new(&m, "Hi").max_new_tokens("1").run();
    r.assert_ok();
    assert!(r.stderr.contains("backend"), "{}", r.stderr);
}

#[test]
fn sampling_is_reproducible_with_a_seed() {
    let Some(m) = dir() else { return };
    let go = |seed: &str| {
        let r = Generate::cpu(&m, "Hi")
            .exactly("12")
            .json()
            .args(&["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95"])
            .args(&["--seed", seed])
            .run();
        r.assert_ok();
        r.json()["output_ids"].clone()
    };
    let a = go("1");
    assert_eq!(a, go("1"));
    assert_ne!(a, go("2"));
}

#[test]
fn stops_at_end_of_text_unless_ignored() {
    let Some(m) = dir() else { return };
    // Find what the model says first, then declare that id the end of text.
    let probe = Generate::cpu(&m, "Hi")
        .raw()
        .exactly("3")
        .greedy()
        .json()
        .run()
        .json();
    let first = probe["output_ids"][0].as_u64().unwrap();
    let tmp = tiny_model_copy().unwrap();
    std::fs::write(
        tmp.path().join("generation_config.json"),
        format!(r#"{{"eos_token_id": [{first}]}}"#),
    )
    .unwrap();
    let d = tmp.path().to_str().unwrap();
    let three = Generate::cpu(d, "Hi").raw().max_new_tokens("3").json();
    let stop = three.run().json();
    assert_eq!(stop["output_ids"], serde_json::json!([first]));
    assert_eq!(stop["stop"], "eos");
    let go_on = three.args(&["--ignore-eos"]).run().json();
    assert_eq!(go_on["output_ids"], probe["output_ids"]);
}

#[test]
fn prompt_from_stdin() {
    let Some(m) = dir() else { return };
    let r = qwen_mk(
        &Generate::cpu(&m, "-")
            .raw()
            .max_new_tokens("1")
            .json()
            .argv(),
        &[],
        "Hello world",
        Duration::from_secs(120),
    );
    r.assert_ok();
    assert_eq!(r.json()["prompt_ids"], serde_json::json!([9707, 1879]));
}

#[test]
fn chat_keeps_history_and_survives_a_full_context() {
    let Some(m) = dir() else { return };
    let r = qwen_mk(
        &chat_args(&m, "4", &["--ignore-eos"]),
        &[],
        "Hello\nHow are you?\n/reset\nAgain\n/exit\nnever read\n",
        Duration::from_secs(120),
    );
    r.assert_ok();
    let stats: Vec<&str> = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("[cpu]"))
        .collect();
    assert_eq!(stats.len(), 3, "{r:#?}");
    // The second turn carries the first exchange; after /reset the prompt
    // is as short as the first one.
    let prompt_len = |l: &str| -> usize {
        l.split("prompt ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (a, b, c) = (
        prompt_len(stats[0]),
        prompt_len(stats[1]),
        prompt_len(stats[2]),
    );
    assert!(b > a + 4, "history kept: {a} {b}");
    assert_eq!(a, c, "reset clears the history");

    // A context that one exchange nearly fills: a message, then a reset works.
    let r = qwen_mk(
        &chat_args(&m, "8", &["--ignore-eos", "--context", "40"]),
        &[],
        "Hello\nTell me more about that, please\n/reset\nHi\n",
        Duration::from_secs(120),
    );
    r.assert_ok();
    assert!(r.stdout.contains("[context full"), "{r:#?}");
    assert_eq!(
        r.stderr.lines().filter(|l| l.starts_with("[cpu]")).count(),
        2,
        "{r:#?}"
    );
}

#[test]
fn tensor_parallel_on_the_cpu_matches_one_rank_and_refuses_what_cannot_split() {
    let Some(m) = dir() else { return };
    let base = Generate::cpu(&m, "Hi").exactly("8").greedy().json();
    let one = base.run();
    one.assert_ok();
    let two = base.clone().args(&["--tp", "2"]).run();
    two.assert_ok();
    assert_eq!(one.json()["output_ids"], two.json()["output_ids"]);
    assert_eq!(
        (one.json()["tp"].as_u64(), two.json()["tp"].as_u64()),
        (Some(1), Some(2))
    );
    // The tiny model's 2 KV heads do not split among 4 ranks.
    Generate::cpu(&m, "Hi")
        .args(&["--tp", "4"])
        .run()
        .assert_error(&["--tp 4", "num_key_value_heads"]);
    // Outside 1..=8: a usage error.
    let r = Generate::cpu(&m, "Hi").args(&["--tp", "9"]).run();
    assert_eq!(r.code, 2, "{r:#?}");
}
