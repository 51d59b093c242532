//! `qwen-mk serve` against the official `openai` Python client, on the real
//! 0.5B model and the CPU backend: runs `serve_openai.py` beside this file
//! (what it checks is listed there) and fails when any of its checks fail.
//!
//! Skips (saying so) when QMK_REAL_QWEN is unset; CI sets it. The client
//! comes from `.ci/openai.sh` (a pinned `openai` in a cached venv): the
//! Python it names in QMK_OPENAI_PYTHON, else the script is run here.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Only a guard against a hang: the suite takes a few minutes.
const HANG_GUARD: Duration = Duration::from_secs(1800);

/// The Python that has `openai`: QMK_OPENAI_PYTHON, else what
/// `.ci/openai.sh` installs.
fn openai_python(root: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("QMK_OPENAI_PYTHON") {
        return PathBuf::from(p);
    }
    let out = Command::new("bash")
        .arg(root.join(".ci/openai.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run .ci/openai.sh");
    assert!(out.status.success(), ".ci/openai.sh failed");
    let text = String::from_utf8(out.stdout).unwrap();
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("export QMK_OPENAI_PYTHON="))
        .unwrap_or_else(|| panic!(".ci/openai.sh printed no QMK_OPENAI_PYTHON: {text}"));
    PathBuf::from(path.trim_matches('\''))
}

#[test]
fn openai_client_suite_against_serve() {
    let Some(model) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!("SKIP: QMK_REAL_QWEN is unset (run scripts/fetch-real-qwen.sh and export it)");
        return;
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..");
    let python = openai_python(&root);
    let mut child = Command::new(&python)
        .arg(manifest.join("tests/serve_openai.py"))
        .arg("--qwen-mk")
        .arg(env!("CARGO_BIN_EXE_qwen-mk"))
        .arg("--model")
        .arg(&model)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > HANG_GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve_openai.py still running after {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "serve_openai.py failed ({status}); its output is above"
    );
}
