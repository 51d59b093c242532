//! Shared by the CLI's integration tests: a tiny synthetic Qwen2 model built
//! with the real Qwen tokenizer files, and a runner for the `qwen-mk` binary
//! with a clean environment and a deadline.
#![allow(dead_code)]

pub mod hub_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use qmk_layout::DType;
use qmk_model::Config;

/// The real Qwen tokenizer files (tokenizer.json, tokenizer_config.json,
/// chat_template.jinja), kept in the model crate's test data. An `Option`
/// for the callers' sake: it is always there.
pub fn tokenizer_fixture() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/qwen-tokenizer");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "tokenizer fixture missing at {}",
        dir.display()
    );
    Some(dir)
}

/// A tiny Qwen2 config (2 layers, hidden 32) with the real vocabulary size,
/// so the real tokenizer's ids are all in range.
pub fn tiny_config() -> Config {
    let mut c = Config::preset("0.5b").unwrap();
    c.hidden_size = 32;
    c.intermediate_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(8);
    c.max_position_embeddings = 256;
    c.tie_word_embeddings = true;
    c
}

/// Writes the tiny model into `dir`: config.json, generation_config.json,
/// the tokenizer files and safetensors (sharded when `shard_bytes` is set).
pub fn write_tiny_model(dir: &Path, tokenizer: &Path, shard_bytes: Option<u64>) {
    std::fs::create_dir_all(dir).unwrap();
    let w = qmk_model::synthetic_weights(&tiny_config(), 7);
    qmk_model::checkpoint::save_checkpoint(dir, &w, DType::BF16, shard_bytes).unwrap();
    // Qwen2.5-0.5B-Instruct's generation_config.json: it samples by
    // default, so a test that relies on greedy decoding must ask for it
    // (`--temperature 0`), as users must.
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true,
            "eos_token_id": [151645, 151643], "repetition_penalty": 1.1,
            "temperature": 0.7, "top_p": 0.8, "top_k": 20}"#,
    )
    .unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tokenizer.join(f), dir.join(f)).unwrap();
    }
}

/// The tiny model, built once per test binary; `None` (skip) without the
/// tokenizer fixture.
pub fn tiny_model() -> Option<&'static Path> {
    static DIR: OnceLock<Option<tempfile::TempDir>> = OnceLock::new();
    DIR.get_or_init(|| {
        let tok = tokenizer_fixture()?;
        let d = tempfile::tempdir().unwrap();
        write_tiny_model(d.path(), &tok, None);
        Some(d)
    })
    .as_ref()
    .map(|d| d.path())
}

/// The tiny model's directory as an argument; `None` (skip) as for
/// [`tiny_model`].
pub fn tiny_model_arg() -> Option<String> {
    tiny_model().map(|p| p.to_string_lossy().into_owned())
}

/// A copy of the tiny model in a fresh temporary directory, for a test that
/// changes its files; `None` (skip) as for [`tiny_model`].
pub fn tiny_model_copy() -> Option<tempfile::TempDir> {
    let src = tiny_model()?;
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    Some(tmp)
}

/// A `qwen-mk generate` command line, built flag by flag: the flags most
/// runs repeat have a method each, the rest go in through [`Generate::args`].
#[derive(Debug, Clone)]
pub struct Generate {
    args: Vec<String>,
}

impl Generate {
    /// `generate --model MODEL --prompt PROMPT` (backend left to `auto`).
    pub fn new(model: &str, prompt: &str) -> Self {
        Generate {
            args: ["generate", "--model", model, "--prompt", prompt]
                .map(String::from)
                .to_vec(),
        }
    }

    /// `generate --model MODEL --prompt PROMPT --backend cpu`.
    pub fn cpu(model: &str, prompt: &str) -> Self {
        Self::new(model, prompt).args(&["--backend", "cpu"])
    }

    /// `--max-new-tokens N`.
    pub fn max_new_tokens(self, n: &str) -> Self {
        self.args(&["--max-new-tokens", n])
    }

    /// `--max-new-tokens N --ignore-eos`: exactly `n` new tokens.
    pub fn exactly(self, n: &str) -> Self {
        self.max_new_tokens(n).args(&["--ignore-eos"])
    }

    /// `--raw`: the prompt without the chat template.
    pub fn raw(self) -> Self {
        self.args(&["--raw"])
    }

    /// `--temperature 0`: greedy, whatever the model's defaults.
    pub fn greedy(self) -> Self {
        self.args(&["--temperature", "0"])
    }

    /// `--json`.
    pub fn json(self) -> Self {
        self.args(&["--json"])
    }

    /// Any other flags, in order.
    pub fn args(mut self, extra: &[&str]) -> Self {
        self.args.extend(extra.iter().map(|a| a.to_string()));
        self
    }

    /// The command line, without the program name.
    pub fn argv(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// Runs it with [`run`].
    pub fn run(&self) -> Run {
        run(&self.argv())
    }
}

/// `chat --model MODEL --backend cpu --max-new-tokens N`, plus `extra`.
pub fn chat_args<'a>(model: &'a str, new_tokens: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "chat",
        "--model",
        model,
        "--backend",
        "cpu",
        "--max-new-tokens",
        new_tokens,
    ];
    a.extend_from_slice(extra);
    a
}

/// What a run of the binary produced.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Exit 1 with exactly one `error: ...` line on stderr that contains
    /// every one of `needles`, and no panic.
    pub fn assert_error(&self, needles: &[&str]) {
        assert_eq!(self.code, 1, "expected exit 1: {self:#?}");
        assert!(!self.stderr.contains("panicked"), "panic: {self:#?}");
        assert!(
            !self.stderr.contains("stack backtrace"),
            "backtrace: {self:#?}"
        );
        let errors: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| l.starts_with("error:"))
            .collect();
        assert_eq!(errors.len(), 1, "expected one error line: {self:#?}");
        eprintln!("{}", errors[0]);
        for n in needles {
            assert!(
                errors[0].contains(n),
                "error line lacks `{n}`: {:?}\n{self:#?}",
                errors[0]
            );
        }
    }

    /// Exit 2 (a usage error) with stderr exactly one `error: ...` line
    /// that contains every one of `needles`, nothing on stdout, no panic.
    pub fn assert_usage_error(&self, needles: &[&str]) {
        assert_eq!(self.code, 2, "expected exit 2: {self:#?}");
        self.assert_one_error_line(needles);
        assert_eq!(self.stdout, "", "{self:#?}");
    }

    /// stderr is exactly one line, an `error: ...` containing every one of
    /// `needles` (no notes, no panic message, no usage block).
    pub fn assert_one_error_line(&self, needles: &[&str]) {
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "expected one stderr line: {self:#?}");
        assert!(lines[0].starts_with("error: "), "{self:#?}");
        eprintln!("{}", lines[0]);
        for n in needles {
            assert!(
                lines[0].contains(n),
                "error line lacks `{n}`: {:?}\n{self:#?}",
                lines[0]
            );
        }
    }

    pub fn assert_ok(&self) {
        assert_eq!(self.code, 0, "expected success: {self:#?}");
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {self:#?}"))
    }
}

/// `qwen-mk args...` with the HF_* environment cleared, `env` added and
/// HOME pointing at an empty place; stdio as the caller sets it.
pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_qwen-mk"));
    cmd.args(args);
    for k in [
        "HF_ENDPOINT",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
        "QMK_HUB_CONNECT_TIMEOUT_MS",
        "QMK_HUB_READ_TIMEOUT_MS",
        "QMK_HUB_RETRIES",
        "QMK_HUB_RETRY_DELAY_MS",
        "QMK_HUB_LOCK_WAIT_MS",
        "RUST_BACKTRACE",
        "RUST_LIB_BACKTRACE",
    ] {
        cmd.env_remove(k);
    }
    // A place with no Hub cache or token of the user's.
    static HOME: OnceLock<tempfile::TempDir> = OnceLock::new();
    let home = HOME.get_or_init(|| tempfile::tempdir().unwrap());
    cmd.env("HOME", home.path());
    cmd.env("RUST_BACKTRACE", "1"); // a panic would show a backtrace: caught by assert_error
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Waits for `child`, killing it after `timeout` (a hang guard); the exit
/// code, or `None` when it had to be killed.
pub fn wait_with_deadline(child: &mut std::process::Child, timeout: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s.code().unwrap_or(-1));
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `qwen-mk args...` with the HF_* environment cleared, `env` added,
/// HOME pointing at an empty place, `stdin` fed, and a deadline.
pub fn qwen_mk(args: &[&str], env: &[(&str, &str)], stdin: &str, timeout: Duration) -> Run {
    let mut cmd = command(args, env);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn qwen-mk");
    {
        use std::io::Write;
        let mut sin = child.stdin.take().unwrap();
        let data = stdin.as_bytes().to_vec();
        std::thread::spawn(move || {
            let _ = sin.write_all(&data);
        });
    }
    let out_pipe = child.stdout.take().unwrap();
    let err_pipe = child.stderr.take().unwrap();
    let read_all = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = p.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out_t = read_all(Box::new(out_pipe));
    let err_t = read_all(Box::new(err_pipe));
    let code = wait_with_deadline(&mut child, timeout);
    let stdout = out_t.join().unwrap();
    let stderr = err_t.join().unwrap();
    let Some(code) = code else {
        panic!("qwen-mk {args:?} timed out after {timeout:?}\nstdout: {stdout}\nstderr: {stderr}");
    };
    Run {
        code,
        stdout,
        stderr,
    }
}

/// Shorthand: no extra env, no stdin, 120 s.
pub fn run(args: &[&str]) -> Run {
    qwen_mk(args, &[], "", Duration::from_secs(120))
}

/// Where [`run_redirected`] sends stdout or stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// A pipe the test reads (the text lands in [`Run`]).
    Capture,
    /// `/dev/full`: every write fails with ENOSPC (`> /dev/full`).
    Full,
    /// A pipe whose reader is gone before the program starts: every write
    /// fails with EPIPE (`| true`, `| head -c 0`).
    ClosedPipe,
}

impl Sink {
    /// The file or pipe end the child gets; `None` for [`Sink::Capture`].
    fn open(self) -> Option<Stdio> {
        match self {
            Sink::Capture => None,
            Sink::Full => Some(Stdio::from(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .expect("/dev/full (Linux)"),
            )),
            Sink::ClosedPipe => {
                use std::os::fd::FromRawFd;
                let mut fds = [0 as libc::c_int; 2];
                // SAFETY: pipe(2) writes two new descriptors into `fds`;
                // each is owned by exactly one File from here on.
                assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
                let (reader, writer) = unsafe {
                    (
                        std::fs::File::from_raw_fd(fds[0]),
                        std::fs::File::from_raw_fd(fds[1]),
                    )
                };
                drop(reader);
                Some(Stdio::from(writer))
            }
        }
    }
}

/// Runs `qwen-mk args...` (environment as in [`qwen_mk`]) with stdin from
/// `stdin` (a file, e.g. `/dev/zero`, or empty), stdout and stderr sent to
/// `stdout` / `stderr`, and the runner's deadline. Streams not captured read
/// as "".
pub fn run_redirected(args: &[&str], stdin: Option<&Path>, stdout: Sink, stderr: Sink) -> Run {
    let mut cmd = command(args, &[]);
    cmd.stdin(match stdin {
        Some(p) => Stdio::from(std::fs::File::open(p).unwrap()),
        None => Stdio::null(),
    });
    cmd.stdout(stdout.open().unwrap_or_else(Stdio::piped));
    cmd.stderr(stderr.open().unwrap_or_else(Stdio::piped));
    let mut child = cmd.spawn().expect("spawn qwen-mk");
    // The parent's copies of the redirected ends are closed by now (moved
    // into the Command, dropped with it).
    drop(cmd);
    let read_all = |p: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out_t = read_all(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let err_t = read_all(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    );
    let code = wait_with_deadline(&mut child, Duration::from_secs(120));
    let (stdout, stderr) = (out_t.join().unwrap(), err_t.join().unwrap());
    let Some(code) = code else {
        panic!("qwen-mk {args:?} timed out\nstdout: {stdout}\nstderr: {stderr}");
    };
    Run {
        code,
        stdout,
        stderr,
    }
}

impl Run {
    /// No panic: exit code not 101, no panic message or backtrace.
    pub fn assert_no_panic(&self) {
        assert_ne!(self.code, 101, "panicked: {self:#?}");
        assert!(!self.stderr.contains("panicked"), "panic: {self:#?}");
        assert!(
            !self.stderr.contains("stack backtrace"),
            "backtrace: {self:#?}"
        );
    }
}
