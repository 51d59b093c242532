//! The libraries as another project uses them. A fresh crate in a
//! temporary directory, outside this workspace, depends on `qmk-engine`,
//! `qmk-model`, `qmk-backend-cudarc` and `qmk-server`, first by path and then by a
//! `file://` git URL of this repository's HEAD commit; its `main.rs` is the
//! README's "As a library" program, taken from README.md. The test builds it
//! offline with this workspace's Cargo.lock (no other versions), runs it on
//! a tiny synthetic model with the real Qwen tokenizer, and checks that it
//! prints the reply this workspace's own build decodes.
//!
//! The crate compiles the whole dependency tree again (minutes on two
//! cores), so the test is ignored by default; scripts/test.sh runs it as a
//! step of its own:
//!
//! ```sh
//! cargo test -p qmk-engine --test downstream -- --ignored --nocapture
//! ```
//!
//! Both variants share one target directory (under the workspace target's
//! `tmp/`), so the registry crates compile once.

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use qmk_engine::{CpuBackend, Engine, GenerateOptions};
use qmk_layout::DType;
use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::tokenizer::Tokenizer;
use qmk_model::{load_weights, synthetic_weights, Config};

const PACKAGE: &str = "qmk-downstream-check";
/// The library crates the downstream crate depends on, with their paths.
const DEPENDENCIES: [(&str, &str); 4] = [
    ("qmk-engine", "crates/engine"),
    ("qmk-model", "crates/model"),
    ("qmk-backend-cudarc", "crates/backend-cudarc"),
    // Built as a dependency too (the program does not start a server).
    ("qmk-server", "crates/server"),
];
/// An HTTP proxy nothing listens on: a cargo that tries the network fails.
const NO_NETWORK: &str = "http://127.0.0.1:9";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// The first ```rust block of README.md's "As a library" section.
fn readme_example(root: &Path) -> String {
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("As a library"))
        .expect("README.md has an `## As a library` section");
    let start = section.find("```rust\n").expect("a ```rust block") + "```rust\n".len();
    let len = section[start..].find("```").expect("the block's end");
    section[start..start + len].to_string()
}

/// A 2-layer model with Qwen's vocabulary and tokenizer files, small
/// enough that an unoptimised build decodes it in seconds.
fn write_tiny_model(root: &Path, dir: &Path) {
    let mut c = Config::preset("0.5b").unwrap();
    c.hidden_size = 32;
    c.intermediate_size = 64;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(8);
    c.max_position_embeddings = 4096;
    c.tie_word_embeddings = true;
    let weights = synthetic_weights(&c, 11);
    qmk_model::checkpoint::save_checkpoint(dir, &weights, DType::BF16, None).unwrap();
    let tokenizer = root.join("crates/model/tests/data/qwen-tokenizer");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tokenizer.join(f), dir.join(f)).unwrap();
    }
}

/// What the README program prints, computed by this workspace's build.
fn expected_output(model: &Path) -> String {
    let weights = Arc::new(load_weights(model).unwrap());
    let tok = Tokenizer::from_dir(model).unwrap();
    let chat = ChatTemplate::from_dir(model).unwrap();
    let prompt = tok
        .encode(&chat.render(&[Message::user("Hi")], true).unwrap())
        .unwrap();
    let backend = CpuBackend::new(weights.clone(), 4096).unwrap();
    let mut engine = Engine::new(backend, weights.config.vocab_size);
    let opts = GenerateOptions {
        max_new_tokens: 32,
        ..GenerateOptions::default()
    };
    let out = engine
        .generate(&prompt, &opts, |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.output_ids.len(), 32, "{out:?}");
    format!("{}\n", tok.decode(&out.output_ids, true).unwrap())
}

/// `(name, version)` of every package in a Cargo.lock.
fn locked_packages(lock: &Path) -> BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(lock).unwrap();
    let mut out = BTreeSet::new();
    for block in text.split("[[package]]").skip(1) {
        let field = |key: &str| {
            block
                .lines()
                .find_map(|l| {
                    l.strip_prefix(key)?
                        .strip_prefix(" = \"")?
                        .strip_suffix('"')
                })
                .unwrap_or_else(|| panic!("{}: a package without {key}", lock.display()))
                .to_string()
        };
        out.insert((field("name"), field("version")));
    }
    out
}

fn cargo(dir: &Path, target: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target)
        .env("CARGO_HTTP_PROXY", NO_NETWORK)
        .env("CARGO_TERM_COLOR", "never");
    cmd
}

fn run(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stderr}",
        out.status
    );
    eprint!("{stderr}");
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// Writes the crate with `deps` as its `[dependencies]` table, builds it
/// with the workspace's lockfile and runs the README program on `model`.
fn build_and_run(root: &Path, variant: &str, deps: &str, target: &Path, model: &Path) -> String {
    let dir = tempfile::Builder::new()
        .prefix(&format!("{PACKAGE}-{variant}-"))
        .tempdir()
        .unwrap();
    assert!(
        !dir.path().starts_with(root),
        "the crate must live outside the repository"
    );
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!(
            "[package]\nname = \"{PACKAGE}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
             publish = false\n\n[dependencies]\n{deps}\n\n# A workspace of its own.\n[workspace]\n"
        ),
    )
    .unwrap();
    std::fs::write(dir.path().join("src/main.rs"), readme_example(root)).unwrap();
    std::fs::copy(root.join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();

    // Resolution adds this crate to the lockfile and drops what it does not
    // use; every version must be the workspace's. A path variant resolves
    // offline; a git one clones the repository from file:// (which
    // `--offline` forbids), with no network for the rest.
    let mut fetch = cargo(dir.path(), target, &["fetch"]);
    if variant == "path" {
        fetch.arg("--offline");
    }
    run(fetch, &format!("{variant}: cargo fetch"));
    let ours = locked_packages(&root.join("Cargo.lock"));
    let theirs = locked_packages(&dir.path().join("Cargo.lock"));
    let foreign: Vec<_> = theirs
        .iter()
        .filter(|(name, _)| name != PACKAGE)
        .filter(|p| !ours.contains(*p))
        .collect();
    assert!(
        foreign.is_empty(),
        "{variant}: versions not in the workspace's Cargo.lock: {foreign:?}"
    );
    for (name, _) in DEPENDENCIES {
        assert!(
            theirs.iter().any(|(n, _)| n == name),
            "{variant}: {name} is not in the crate's lockfile"
        );
    }

    run(
        cargo(dir.path(), target, &["build", "--offline", "--locked"]),
        &format!("{variant}: cargo build"),
    );
    let exe = target.join("debug").join(PACKAGE);
    let mut cmd = Command::new(&exe);
    cmd.arg(model);
    run(cmd, &format!("{variant}: {}", exe.display()))
}

#[test]
#[ignore = "builds a crate outside the workspace (minutes); scripts/test.sh runs it"]
fn readme_library_example_builds_and_runs_as_a_dependency() {
    let root = repo_root();
    let model = tempfile::tempdir().unwrap();
    write_tiny_model(&root, model.path());
    let expected = expected_output(model.path());
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("downstream");

    let by_path: String = DEPENDENCIES
        .iter()
        .map(|(name, path)| {
            let path = root.join(path);
            format!("{name} = {{ path = {:?} }}\n", path.display().to_string())
        })
        .collect();
    let printed = build_and_run(&root, "path", &by_path, &target, model.path());
    assert_eq!(printed, expected, "by path");

    // The committed tree: HEAD of the repository, whatever the work tree
    // holds.
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let Some(head) = head else {
        panic!(
            "{} is not a git checkout: the git-URL variant needs one",
            root.display()
        );
    };
    let url = format!("file://{}", root.display());
    let by_git: String = DEPENDENCIES
        .iter()
        .map(|(name, _)| format!("{name} = {{ git = {url:?}, rev = \"{head}\" }}\n"))
        .collect();
    let printed = build_and_run(&root, "git", &by_git, &target, model.path());
    assert_eq!(printed, expected, "by git URL at {head}");
}
