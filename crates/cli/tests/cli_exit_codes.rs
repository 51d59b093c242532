//! Exit codes and output streams: usage errors (exit 2, one line naming the
//! flag and its range), flag values that would size memory or work without
//! bound, a stdout or stderr that cannot be written (a closed pipe, a full
//! disk), and stdin that never ends. Every run is bounded by counted work
//! (values, bytes); the runner's deadline only guards against a hang.

mod support;

use std::path::Path;

use support::{chat_args, run, run_redirected, tiny_model_arg as dir, Generate, Sink};

/// `generate` of a few tokens on the tiny model (CPU), plus `extra`.
fn gen_args(m: &str, extra: &[&str]) -> Generate {
    Generate::cpu(m, "Hi").exactly("4").args(extra)
}

// ---- usage errors ---------------------------------------------------------

/// A stop string one byte past the limit.
static LONG_STOP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| "s".repeat(257));

#[test]
fn flag_values_that_size_memory_or_work_are_bounded() {
    // Checked by the parser: no model is looked at (this one does not exist).
    let g = |extra: &[&str]| Generate::new("nobody/nothing", "Hi").args(extra).run();
    for (args, needles) in [
        (
            &["--json", "--top-logprobs", "1000000000000"][..],
            &["--top-logprobs", "1000000000000", "0..=20"][..],
        ),
        (
            &["--json", "--top-logprobs", "21"],
            &["--top-logprobs", "0..=20"],
        ),
        (&["--top-k", "-3"], &["--top-k", "-3", "0..=4294967295"]),
        (
            &["--max-new-tokens", "0"],
            &["--max-new-tokens", "1..=4294967295"],
        ),
        (
            &["--max-new-tokens", "18446744073709551615"],
            &["--max-new-tokens", "18446744073709551615"],
        ),
        (&["--context", "0"], &["--context", "1..=4294967295"]),
        (
            &["--context", "35184372088832"],
            &["--context", "1..=4294967295"],
        ),
        (&["--context", "-1"], &["--context", "-1"]),
        (
            &["--prefill-chunk", "0"],
            &["--prefill-chunk", "1..=4294967295"],
        ),
        (
            &["--temperature", "-1"],
            &["--temperature", "finite number >= 0"],
        ),
        (
            &["--temperature", "NaN"],
            &["--temperature", "finite number >= 0"],
        ),
        (
            &["--temperature", "inf"],
            &["--temperature", "finite number >= 0"],
        ),
        (&["--top-p", "0"], &["--top-p", "(0, 1]"]),
        (&["--top-p", "1.5"], &["--top-p", "(0, 1]"]),
        (&["--top-p", "-0.5"], &["--top-p", "(0, 1]"]),
        (&["--seed", "-1"], &["--seed", "-1"]),
        (&["--min-p", "-0.1"], &["--min-p", "in [0, 1]"]),
        (&["--min-p", "1.5"], &["--min-p", "in [0, 1]"]),
        (&["--min-p", "NaN"], &["--min-p", "in [0, 1]"]),
        (
            &["--repetition-penalty", "0"],
            &["--repetition-penalty", "a finite number > 0"],
        ),
        (
            &["--repetition-penalty", "-1.1"],
            &["--repetition-penalty", "a finite number > 0"],
        ),
        (
            &["--repetition-penalty", "inf"],
            &["--repetition-penalty", "a finite number > 0"],
        ),
        (
            &["--presence-penalty", "2.5"],
            &["--presence-penalty", "in [-2, 2]"],
        ),
        (
            &["--presence-penalty", "NaN"],
            &["--presence-penalty", "in [-2, 2]"],
        ),
        (
            &["--frequency-penalty", "-3"],
            &["--frequency-penalty", "in [-2, 2]"],
        ),
        (&["--stop", ""], &["--stop", "empty stop string"]),
        (
            &["--stop", LONG_STOP.as_str()],
            &["--stop", "longer than 256"],
        ),
        (&["--stop"], &["--stop"]),
        (
            &["--revision", "../../x"],
            &["--revision", "not a branch, tag or commit"],
        ),
    ] {
        g(args).assert_usage_error(needles);
    }
    // More than 16 stop strings: refused before the model is looked at.
    let mut many = Vec::new();
    for _ in 0..17 {
        many.extend(["--stop", "x"]);
    }
    g(&many).assert_usage_error(&["--stop", "17 stop strings", "at most 16"]);
    run(&["chat", "--model", "nobody/nothing", "--context", "0"])
        .assert_usage_error(&["--context", "1..=4294967295"]);
    run(&["chat", "--model", "nobody/nothing", "--min-p", "2"])
        .assert_usage_error(&["--min-p", "in [0, 1]"]);
    run(&["plan", "--preset", "0.5b", "--context", "0"])
        .assert_usage_error(&["--context", "1..=4294967295"]);
    run(&["plan", "--preset", "0.5b", "--context", "5000000000"])
        .assert_usage_error(&["--context", "1..=4294967295"]);
}

#[test]
fn bench_counts_are_bounded_before_any_gpu_work() {
    for (args, needles) in [
        // Before: warm-up + steps overflowed (a panic) before the GPU probe.
        (
            &["--warmup", "18446744073709551615"][..],
            &["--warmup", "0..=1000000"][..],
        ),
        (&["--steps", "0"], &["--steps", "1..=1000000"]),
        (&["--steps", "1000000000000"], &["--steps", "1..=1000000"]),
        (&["--profile-steps", "0"], &["--profile-steps"]),
        // Before: N + 1 positions overflowed (a panic).
        (
            &["--prefill", "18446744073709551615"],
            &["--prefill", "1..=4294967295"],
        ),
        (
            &["--prefill", "2048", "--prefill-chunk", "0"],
            &["--prefill-chunk"],
        ),
        (
            &["--prefill-reps", "100000"],
            &["--prefill-reps", "1..=10000"],
        ),
        (&["--ab-rounds", "0"], &["--ab-rounds", "1..=10000"]),
        (&["--stream-gib", "0"], &["--stream-gib", "1..=1024"]),
        (
            &["--stream-gib", "17179869184"],
            &["--stream-gib", "1..=1024"],
        ),
        (&["--ctas-per-sm", "0"], &["--ctas-per-sm", "1..=64"]),
        (&["--context", "8192,-1"], &["--context", "-1"]),
        (&["--kernel-flags", "-1"], &["--kernel-flags", "-1"]),
    ] {
        let mut a = vec!["bench"];
        a.extend_from_slice(args);
        run(&a).assert_usage_error(needles);
    }
    // List lengths: checked before the GPU is looked for.
    let many = vec!["0"; 65].join(",");
    run(&["bench", "--context", &many]).assert_usage_error(&["--context", "65 values", "64"]);
    run(&["bench", "--prefill", "16", "--ab", &many]).assert_usage_error(&[
        "--ab",
        "65 values",
        "64",
    ]);
}

#[test]
fn parser_errors_are_one_line_naming_the_flag() {
    run(&["generate", "--model", "m", "--prompt", "Hi", "--top", "3"])
        .assert_usage_error(&["unexpected argument '--top'", "tip: a similar argument"]);
    run(&[
        "generate",
        "--model",
        "m",
        "--prompt",
        "Hi",
        "--backend",
        "gpu",
    ])
    .assert_usage_error(&["--backend", "gpu", "cudarc"]);
    run(&["generate", "--model", "m"]).assert_usage_error(&["--prompt"]);
    run(&[
        "generate",
        "--model",
        "m",
        "--prompt",
        "Hi",
        "--top-logprobs",
        "2",
    ])
    .assert_usage_error(&["--json"]);
    run(&["generate", "--model", "m", "--prompt", "Hi", "--top-k"])
        .assert_usage_error(&["--top-k"]);
    run(&[
        "generate", "--model", "m", "--prompt", "Hi", "--raw", "--system", "s",
    ])
    .assert_usage_error(&["--system", "--raw"]);
    run(&["nonsense"]).assert_usage_error(&["nonsense"]);
    run(&[]).assert_usage_error(&["no command given", "generate", "chat"]);
    // Help and version are not errors: stdout, exit 0.
    let h = run(&["generate", "--help"]);
    h.assert_ok();
    assert!(h.stdout.contains("--top-logprobs"), "{h:#?}");
    assert_eq!(h.stderr, "");
    run(&["--version"]).assert_ok();
}

// ---- stdout and stderr that cannot be written ---------------------------------

#[test]
fn a_closed_stdout_ends_generate_and_chat_quietly() {
    let Some(m) = dir() else { return };
    // `| head -c 0`: the reader is gone before the first token is written.
    for extra in [&[][..], &["--json"]] {
        let r = run_redirected(
            &gen_args(&m, extra).argv(),
            None,
            Sink::ClosedPipe,
            Sink::Capture,
        );
        r.assert_no_panic();
        assert_eq!(r.code, 0, "{r:#?}");
        assert!(!r.stderr.contains("error"), "{r:#?}");
    }
    // chat: before, "error: Broken pipe (os error 32)" and exit 1.
    let stdin = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(stdin.path(), "Hello\nAgain\n").unwrap();
    let r = run_redirected(
        &chat_args(&m, "4", &["--ignore-eos"]),
        Some(stdin.path()),
        Sink::ClosedPipe,
        Sink::Capture,
    );
    r.assert_no_panic();
    assert_eq!(r.code, 0, "{r:#?}");
    assert!(!r.stderr.contains("error"), "{r:#?}");
    // The commands that print a result do the same.
    for args in [
        &["plan", "--preset", "0.5b"][..],
        &["plan", "--preset", "0.5b", "--json"],
        &["download", "--model", &m],
        &["generate", "--help"],
    ] {
        let r = run_redirected(args, None, Sink::ClosedPipe, Sink::Capture);
        r.assert_no_panic();
        assert_eq!((r.code, r.stderr.as_str()), (0, ""), "{args:?}: {r:#?}");
    }
}

#[test]
fn a_full_stdout_is_an_error_naming_stdout() {
    let Some(m) = dir() else { return };
    for extra in [&[][..], &["--json"]] {
        let r = run_redirected(&gen_args(&m, extra).argv(), None, Sink::Full, Sink::Capture);
        r.assert_no_panic();
        r.assert_error(&["cannot write to stdout", "No space left on device"]);
    }
    let stdin = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(stdin.path(), "Hello\n").unwrap();
    let r = run_redirected(
        &chat_args(&m, "2", &[]),
        Some(stdin.path()),
        Sink::Full,
        Sink::Capture,
    );
    r.assert_error(&["cannot write to stdout", "No space left on device"]);
    for args in [
        &["plan", "--preset", "0.5b"][..],
        &["plan", "--preset", "0.5b", "--json"],
        &["download", "--model", &m],
        &["generate", "--help"],
    ] {
        let r = run_redirected(args, None, Sink::Full, Sink::Capture);
        r.assert_no_panic();
        r.assert_one_error_line(&["cannot write to stdout", "No space left on device"]);
        assert_eq!(r.code, 1, "{args:?}: {r:#?}");
    }
}

#[test]
fn a_stderr_that_cannot_be_written_is_never_fatal() {
    let Some(m) = dir() else { return };
    for sink in [Sink::Full, Sink::ClosedPipe] {
        // Success with notes and a stats line on stderr: before, a panic
        // (exit 101) at the first note.
        let r = run_redirected(&gen_args(&m, &[]).argv(), None, Sink::Capture, sink);
        assert_eq!(r.code, 0, "{sink:?}: {r:#?}");
        assert!(!r.stdout.is_empty(), "{sink:?}: {r:#?}");
        let j = run_redirected(&gen_args(&m, &["--json"]).argv(), None, Sink::Capture, sink);
        assert_eq!(j.code, 0, "{sink:?}: {j:#?}");
        assert!(j.stdout.contains("\"output_ids\""), "{j:#?}");
        // Error paths keep their exit codes: 1 for an error, 2 for usage.
        let e = run_redirected(
            &["generate", "--model", "./no/such/dir", "--prompt", "Hi"],
            None,
            Sink::Capture,
            sink,
        );
        assert_eq!(e.code, 1, "{sink:?}: {e:#?}");
        let u = run_redirected(
            &["generate", "--model", &m, "--prompt", "Hi", "--top-k", "-3"],
            None,
            Sink::Capture,
            sink,
        );
        assert_eq!(u.code, 2, "{sink:?}: {u:#?}");
        let p = run_redirected(&["plan", "--preset", "nosuch"], None, Sink::Capture, sink);
        assert_eq!(p.code, 1, "{sink:?}: {p:#?}");
    }
    // `2>&1 | true`: both streams gone; the run still ends without a panic.
    let r = run_redirected(
        &gen_args(&m, &[]).argv(),
        None,
        Sink::ClosedPipe,
        Sink::ClosedPipe,
    );
    assert_eq!(r.code, 0, "{r:#?}");
    let r = run_redirected(
        &["generate", "--model", "./no/such/dir", "--prompt", "Hi"],
        None,
        Sink::ClosedPipe,
        Sink::ClosedPipe,
    );
    assert_eq!(r.code, 1, "{r:#?}");
    let r = run_redirected(
        &["generate", "--model", "./no/such/dir", "--prompt", "Hi"],
        None,
        Sink::Full,
        Sink::Full,
    );
    assert_eq!(r.code, 1, "{r:#?}");
}

// ---- stdin that never ends --------------------------------------------------

#[test]
fn endless_stdin_is_refused_after_the_cap() {
    let Some(m) = dir() else { return };
    let zero = Path::new("/dev/zero");
    // Before: read until memory ran out. Now: 64 MiB + 1 byte, then an error.
    let r = run_redirected(
        &Generate::cpu(&m, "-").raw().argv(),
        Some(zero),
        Sink::Capture,
        Sink::Capture,
    );
    r.assert_error(&["--prompt -", "longer than 64 MiB"]);
    let r = run_redirected(
        &["chat", "--model", &m, "--backend", "cpu"],
        Some(zero),
        Sink::Capture,
        Sink::Capture,
    );
    r.assert_error(&["message on stdin", "longer than 64 MiB"]);
}
