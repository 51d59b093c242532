//! The sampling controls end to end on the tiny synthetic model (real Qwen
//! tokenizer, Qwen2.5-Instruct's generation_config.json) with the CPU
//! backend: the model's defaults, the seed report, the penalties, stop
//! strings, and chat's multi-line input and Ctrl-C.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{
    chat_args, command, qwen_mk, run, tiny_model, tiny_model_arg as dir, tiny_model_copy,
    wait_with_deadline, Generate,
};

/// `generate --json` on `model` with `extra` flags (12 new tokens, the
/// end-of-text ids ignored).
fn gen_json(model: &str, extra: &[&str]) -> Value {
    let r = Generate::cpu(model, "Hi")
        .exactly("12")
        .json()
        .args(extra)
        .run();
    r.assert_ok();
    r.json()
}

/// A copy of the tiny model with `generation_config.json` replaced by
/// `text` (removed when `None`).
fn model_with_generation_config(text: Option<&str>) -> tempfile::TempDir {
    let tmp = tiny_model_copy().unwrap();
    let p = tmp.path().join("generation_config.json");
    match text {
        Some(t) => std::fs::write(p, t).unwrap(),
        None => std::fs::remove_file(p).unwrap(),
    }
    tmp
}

#[test]
fn the_models_generation_config_sets_the_defaults_and_the_seed_is_reported() {
    let Some(m) = dir() else { return };
    let a = gen_json(&m, &[]);
    let s = &a["sampling"];
    assert_eq!(s["greedy"], false, "{a}");
    assert_eq!(s["top_k"], 20);
    for (k, v) in [
        ("temperature", 0.7),
        ("top_p", 0.8),
        ("repetition_penalty", 1.1),
    ] {
        // Written as in the file (0.8, not 0.800000011920929).
        assert_eq!(s[k].as_f64().unwrap(), v, "{k}: {a}");
    }
    // A random seed each run, reported: passing it back repeats the run.
    let seed = s["seed"].as_u64().expect("a seed");
    let b = gen_json(&m, &[]);
    assert_ne!(
        b["sampling"]["seed"], a["sampling"]["seed"],
        "seeds are drawn"
    );
    let again = gen_json(&m, &["--seed", &seed.to_string()]);
    assert_eq!(again["output_ids"], a["output_ids"]);
    assert_eq!(again["text"], a["text"]);
    // The stats line names it too.
    let r = Generate::cpu(&m, "Hi")
        .max_new_tokens("2")
        .args(&["--seed", "77"])
        .run();
    r.assert_ok();
    assert!(r.stderr.contains("sampled with --seed 77"), "{r:#?}");
    // A flag overrides its default only.
    let c = gen_json(&m, &["--top-k", "5", "--repetition-penalty", "1"]);
    assert_eq!(c["sampling"]["top_k"], 5);
    assert_eq!(c["sampling"]["repetition_penalty"], 1.0);
    assert_eq!(c["sampling"]["top_p"], 0.8);
}

#[test]
fn temperature_zero_is_greedy_whatever_the_model_defaults() {
    let Some(m) = dir() else { return };
    let greedy = gen_json(&m, &["--temperature", "0"]);
    let s = &greedy["sampling"];
    assert_eq!(s["greedy"], true);
    // None of the model's sampling values: the raw argmax.
    assert_eq!(s["repetition_penalty"], 1.0);
    assert_eq!(s["top_k"], 0);
    // The same tokens as a model without generation_config.json, which is
    // greedy by default (as in transformers), and greedy with top-logprobs:
    // every pick is the most likely token.
    let bare = model_with_generation_config(None);
    let plain = gen_json(bare.path().to_str().unwrap(), &["--top-logprobs", "1"]);
    assert_eq!(plain["sampling"]["greedy"], true);
    assert_eq!(plain["output_ids"], greedy["output_ids"]);
    for (step, top) in plain["top_logprobs"].as_array().unwrap().iter().enumerate() {
        assert_eq!(top[0][0], plain["output_ids"][step]);
    }
    // A penalty given with --temperature 0 applies: greedy over the
    // penalised logits. A strong repetition penalty over 12 tokens of a
    // random model changes the output (its greedy output repeats ids).
    let ids = greedy["output_ids"].as_array().unwrap();
    let mut uniq = ids.clone();
    uniq.sort_by_key(|v| v.as_u64());
    uniq.dedup();
    assert!(uniq.len() < ids.len(), "the greedy output repeats: {ids:?}");
    let penalised = gen_json(
        &m,
        &[
            "--temperature",
            "0",
            "--frequency-penalty",
            "2",
            "--repetition-penalty",
            "5",
        ],
    );
    assert_eq!(penalised["sampling"]["greedy"], true);
    assert_ne!(penalised["output_ids"], greedy["output_ids"]);
}

#[test]
fn a_hostile_generation_config_is_one_error_naming_file_and_field() {
    if tiny_model().is_none() {
        return;
    }
    for (text, field) in [
        (
            r#"{"do_sample": true, "temperature": "hot"}"#,
            "temperature",
        ),
        (r#"{"do_sample": true, "top_p": 7}"#, "top_p"),
        (r#"{"repetition_penalty": -1}"#, "repetition_penalty"),
        (r#"{"top_k": 1e300}"#, "top_k"),
    ] {
        let m = model_with_generation_config(Some(text));
        let r = Generate::cpu(m.path().to_str().unwrap(), "Hi").run();
        r.assert_error(&["generation_config.json", field]);
    }
    let m = model_with_generation_config(Some(r#"{"temperature": NaN}"#));
    let r = Generate::new(m.path().to_str().unwrap(), "Hi").run();
    r.assert_error(&["generation_config.json", "invalid JSON"]);
}

#[test]
fn a_stop_string_ends_the_text_before_it_streamed_or_not() {
    let Some(m) = dir() else { return };
    let full = gen_json(&m, &["--temperature", "0"]);
    let text = full["text"].as_str().unwrap().to_string();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() >= 6, "{full}");
    // Three characters from the middle of the greedy text.
    let at = chars[chars.len() / 2].0;
    let end = chars.get(chars.len() / 2 + 3).map_or(text.len(), |c| c.0);
    let stop = &text[at..end];
    let want = &text[..text.find(stop).unwrap()];
    let stop_flag = format!("--stop={stop}");
    let cut = gen_json(
        &m,
        &["--temperature", "0", &stop_flag, "--stop", "never-said-0"],
    );
    assert_eq!(cut["text"], want, "stop {stop:?} in {text:?}");
    assert_eq!(cut["stop"], "stop_string");
    assert_eq!(cut["stop_string"], stop);
    let n = cut["output_ids"].as_array().unwrap().len();
    assert!(n < 12 || end == text.len(), "generation ended early: {n}");
    assert_eq!(
        cut["output_ids"].as_array().unwrap()[..],
        full["output_ids"].as_array().unwrap()[..n]
    );
    // Streamed: the same text, never the stop string.
    let r = Generate::cpu(&m, "Hi")
        .exactly("12")
        .greedy()
        .args(&[&stop_flag])
        .run();
    r.assert_ok();
    assert_eq!(r.stdout, format!("{want}\n"));
    // A stop string that never comes changes nothing.
    let same = gen_json(&m, &["--temperature", "0", "--stop", "never-said-0"]);
    assert_eq!(same["text"], full["text"]);
    assert_eq!(same["stop"], "length");
    assert_eq!(same["stop_string"], Value::Null);
}

/// Stats lines of a chat run (one per reply).
fn replies(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("[cpu]")).collect()
}

#[test]
fn chat_takes_a_fenced_block_as_one_message() {
    let Some(m) = dir() else { return };
    let chat = |input: &str| {
        let r = qwen_mk(
            &chat_args(&m, "2", &["--temperature", "0"]),
            &[],
            input,
            Duration::from_secs(120),
        );
        r.assert_ok();
        r
    };
    let block = chat("\"\"\"\nfn main() {\n    /reset\n}\n\"\"\"\n");
    let lines = chat("fn main() {\n    /reset\n}\n");
    // One reply for the block; the same three lines unfenced are two
    // messages and a command.
    assert_eq!(replies(&block.stderr).len(), 1, "{block:#?}");
    assert_eq!(replies(&lines.stderr).len(), 2, "{lines:#?}");
    assert!(lines.stderr.contains("(history cleared)"), "{lines:#?}");
    // The block's prompt holds all of it: longer than its first line's.
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
    assert!(
        prompt_len(replies(&block.stderr)[0]) > prompt_len(replies(&lines.stderr)[0]) + 2,
        "{block:#?}"
    );
}

#[test]
fn chat_help_documents_the_input_syntax_and_ctrl_c() {
    let h = run(&["chat", "--help"]);
    h.assert_ok();
    for needle in [
        "a line `\"\"\"` opens a multi-line message",
        "Ctrl-C stops a reply",
        "130",
    ] {
        assert!(h.stdout.contains(needle), "{needle}: {}", h.stdout);
    }
}

#[cfg(unix)]
#[test]
fn ctrl_c_at_the_chat_prompt_ends_the_session() {
    let Some(m) = dir() else { return };
    let mut child = command(&chat_args(&m, "2", &["--temperature", "0"]), &[])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Hello\n").unwrap();
    stdin.flush().unwrap();
    // Once the reply's stats line is out, the session waits at the prompt
    // (stdin stays open).
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("chat ended before replying: {seen}");
        }
        seen.push_str(&line);
        if line.starts_with("[cpu]") {
            break;
        }
    }
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
    let code = wait_with_deadline(&mut child, Duration::from_secs(60));
    drop(stdin);
    assert_eq!(code, Some(130), "Ctrl-C at the prompt: exit 130 ({seen})");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(
        !rest.contains("error") && !rest.contains("panicked"),
        "{rest}"
    );
}
