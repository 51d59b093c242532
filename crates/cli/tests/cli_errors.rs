//! Every user error of `generate` / `chat` exits 1 with one readable
//! `error:` line (no panic, no backtrace). Usage errors (exit 2) and output
//! streams are in cli_exit_codes.rs; Hub errors (unknown model, no network,
//! offline cache miss, bad downloads) in hub_loopback.rs.

mod support;

use std::path::Path;

use support::{run, tiny_model_arg as dir, tiny_model_copy as model_copy, Generate};

fn gen(m: &str, extra: &[&str]) -> support::Run {
    let mut args = vec!["generate", "--model", m, "--backend", "cpu"];
    args.extend_from_slice(extra);
    run(&args)
}

#[test]
fn empty_prompt() {
    let Some(m) = dir() else { return };
    gen(&m, &["--prompt", ""]).assert_error(&["empty prompt"]);
    gen(&m, &["--prompt", "", "--raw"]).assert_error(&["empty prompt"]);
}

#[test]
fn prompt_longer_than_the_context() {
    let Some(m) = dir() else { return };
    let long = "word ".repeat(400);
    // The tiny model's max_position_embeddings is 256.
    gen(&m, &["--prompt", &long, "--raw"]).assert_error(&[
        "prompt too long",
        "tokens do not fit",
        "max_position_embeddings = 256",
    ]);
    gen(
        &m,
        &[
            "--prompt",
            "one two three four five six",
            "--raw",
            "--context",
            "4",
        ],
    )
    .assert_error(&["prompt too long", "--context 4"]);
    gen(&m, &["--prompt", "Hi", "--context", "100000"])
        .assert_error(&["--context 100000", "max_position_embeddings (256)"]);
}

#[test]
fn invalid_sampling_values() {
    let Some(m) = dir() else { return };
    // Usage errors (exit 2), naming the flag and the values it takes.
    for (flag, value, range) in [
        ("--temperature", "-1", "finite number >= 0"),
        ("--temperature", "NaN", "finite number >= 0"),
        ("--temperature", "inf", "finite number >= 0"),
        ("--top-p", "0", "(0, 1]"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--top-p", "-0.5", "(0, 1]"),
        ("--max-new-tokens", "0", "1..="),
    ] {
        gen(&m, &["--prompt", "Hi", flag, value]).assert_usage_error(&[flag, value, range]);
    }
    // Checked before anything is downloaded or loaded: a model that does
    // not exist is not even looked at.
    Generate::new("nobody/nothing", "Hi")
        .args(&["--top-p", "2"])
        .run()
        .assert_usage_error(&["--top-p"]);
}

#[test]
fn missing_local_model() {
    Generate::new("./no/such/dir", "Hi")
        .run()
        .assert_error(&["./no/such/dir", "no such directory"]);
    let Some(m) = dir() else { return };
    let file = Path::new(&m).join("config.json");
    Generate::new(file.to_str().unwrap(), "Hi")
        .run()
        .assert_error(&["not a directory"]);
}

fn gpu_present() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

#[test]
fn no_gpu_for_a_gpu_backend() {
    let Some(m) = dir() else { return };
    if gpu_present() {
        eprintln!("SKIP: a GPU is present; the no-GPU error cannot be provoked here");
        return;
    }
    Generate::new(&m, "Hi")
        .args(&["--backend", "cudarc"])
        .run()
        .assert_error(&["--backend cudarc", "no GPU"]);
    // cust: either not compiled in, or no GPU.
    let r = Generate::new(&m, "Hi").args(&["--backend", "cust"]).run();
    r.assert_error(&[]);
    assert!(
        r.stderr.contains("no GPU") || r.stderr.contains("--features cust"),
        "{r:#?}"
    );
    run(&["chat", "--model", &m, "--backend", "cudarc"]).assert_error(&["no GPU"]);
}

/// The tiny model with an enormous max_position_embeddings, so a context
/// can be asked for that no machine holds.
fn huge_context_model() -> Option<tempfile::TempDir> {
    let tmp = model_copy()?;
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(1u64 << 50);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    Some(tmp)
}

#[test]
fn out_of_memory_is_refused_before_allocating() {
    let Some(tmp) = huge_context_model() else {
        return;
    };
    let d = tmp.path().to_str().unwrap();
    // The largest context the flag takes: ~1.2 TB of KV cache here.
    let ctx = u32::MAX.to_string();
    Generate::cpu(d, "Hi")
        .args(&["--context", &ctx])
        .run()
        .assert_error(&["out of memory", "--context"]);
    run(&["chat", "--model", d, "--backend", "cpu", "--context", &ctx])
        .assert_error(&["out of memory"]);
}

#[test]
fn out_of_device_memory() {
    let Some(tmp) = huge_context_model() else {
        return;
    };
    if !gpu_present() {
        eprintln!("SKIP: no GPU; out-of-device-memory needs one (the CPU twin is tested above)");
        return;
    }
    let d = tmp.path().to_str().unwrap();
    let ctx = u32::MAX.to_string();
    let r = Generate::new(d, "Hi")
        .args(&["--backend", "cudarc", "--context", &ctx])
        .run();
    r.assert_error(&["out of device memory"]);
}

#[test]
fn broken_model_files_name_the_file() {
    let Some(tmp) = model_copy() else { return };
    let d = tmp.path().to_str().unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), "{ not json").unwrap();
    Generate::cpu(d, "Hi")
        .run()
        .assert_error(&["tokenizer.json"]);
    std::fs::write(tmp.path().join("config.json"), "{}").unwrap();
    Generate::cpu(d, "Hi").run().assert_error(&["config.json"]);
}

#[test]
fn missing_cubin_file() {
    let Some(m) = dir() else { return };
    gen(&m, &["--prompt", "Hi", "--cubin", "/no/such.cubin"])
        .assert_error(&["--cubin", "no such file"]);
}

#[test]
fn template_errors_are_one_line_naming_file_and_line() {
    let Some(tmp) = model_copy() else { return };
    let d = tmp.path().to_str().unwrap();
    let file = tmp.path().join("chat_template.jinja");
    let path = file.to_str().unwrap();
    let go = |src: &str| {
        std::fs::write(&file, src).unwrap();
        gen(d, &["--prompt", "Hi"])
    };
    // Before: minijinja's display over 7 lines (a source excerpt).
    let r = go("{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}\n");
    r.assert_error(&[path, "does not compile", "syntax error at line 3"]);
    r.assert_one_error_line(&[]);
    // A render error, its message holding a line break.
    let r = go("{% for m in messages %}\n{{ raise_exception('no\\nsystem role') }}{% endfor %}");
    r.assert_error(&[path, "render failed", "at line 2", "no system role"]);
    r.assert_one_error_line(&[]);
    // A panic inside the template engine (caught by the library) prints
    // nothing but the error line.
    let r = go("{% for in ['a'] * 0000002000 %}x in ['a'] * 0000002000 %}{% endfor %}");
    if r.code != 0 {
        assert_eq!(r.code, 1, "{r:#?}");
        r.assert_one_error_line(&[path]);
    }
    // chat reports the same line.
    std::fs::write(&file, "{% if %}").unwrap();
    let r = support::qwen_mk(
        &["chat", "--model", d, "--backend", "cpu"],
        &[],
        "Hi\n",
        std::time::Duration::from_secs(120),
    );
    r.assert_error(&[path, "does not compile", "at line 1"]);
    r.assert_one_error_line(&[]);
}

#[test]
fn template_rendering_nothing_says_so() {
    let Some(tmp) = model_copy() else { return };
    let d = tmp.path().to_str().unwrap();
    let file = tmp.path().join("chat_template.jinja");
    let path = file.to_str().unwrap();
    // Before: "empty prompt: the text encodes to no tokens".
    for (src, needles) in [
        (
            "{% if false %}x{% endif %}",
            &[path, "rendered an empty prompt"][..],
        ),
        (
            "{% for m in messages %} {% endfor %}\n",
            &[path, "only blanks"],
        ),
    ] {
        std::fs::write(&file, src).unwrap();
        let r = gen(d, &["--prompt", "Hi"]);
        r.assert_error(needles);
        assert!(!r.stderr.contains("encodes to no tokens"), "{r:#?}");
    }
    std::fs::write(&file, "").unwrap();
    let r = support::qwen_mk(
        &["chat", "--model", d, "--backend", "cpu"],
        &[],
        "Hi\n",
        std::time::Duration::from_secs(120),
    );
    r.assert_error(&[path, "rendered an empty prompt"]);
    // --raw does not use the template.
    gen(d, &["--prompt", "Hi", "--raw", "--max-new-tokens", "1"]).assert_ok();
}
