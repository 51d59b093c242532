//! Replays every file of `fuzz/corpus/<target>/` through the function of
//! `qmk_model::fuzzing` that the cargo-fuzz target of the same name calls,
//! so an input the fuzzer once found (kept in the corpus) fails CI if it
//! regresses, without nightly or cargo-fuzz. What bounds each input's work
//! is counted inside the target (the chat template's fuel, byte budgets and
//! item caps); the clock here only calls an input that has not finished
//! within [`HANG_GUARD`] a hang.
//!
//! `cargo test -p qmk-model --test fuzz_corpus_replay -- --ignored` rewrites
//! the hand-made seeds (`seed-*`) the fuzz runs started from.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use qmk_layout::DType;
use qmk_model::checkpoint::{safetensors_from_parts, save_checkpoint, INDEX_FILE, SINGLE_FILE};
use qmk_model::fuzzing::{tiny_config, TARGETS};
use qmk_model::{synthetic_weights, Config};

/// How long one input may run before the replay calls it a hang; bounded
/// inputs end in well under a second, so this is no performance check.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

fn replay(target: &str) {
    let (_, run) = *TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: empty corpus", dir.display());
    let count = files.len();
    // The inputs run on a worker thread that reports each one it starts
    // and each result; the test thread waits at most HANG_GUARD for the
    // next report.
    let (tx, rx) = mpsc::channel::<Result<(PathBuf, Duration), String>>();
    let target_name = target.to_string();
    std::thread::spawn(move || {
        for file in files {
            let data = match std::fs::read(&file) {
                Ok(d) => d,
                // A fuzzer running alongside replaces reduced inputs.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    let _ = tx.send(Err(format!("{}: {e}", file.display())));
                    return;
                }
            };
            let t = Instant::now();
            if let Err(panic) = std::panic::catch_unwind(|| run(&data)) {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let _ = tx.send(Err(format!(
                    "{target_name}: {} panicked: {msg}",
                    file.display()
                )));
                return;
            }
            if tx.send(Ok((file, t.elapsed()))).is_err() {
                return;
            }
        }
    });
    let start = Instant::now();
    let mut slowest = (Duration::ZERO, PathBuf::new());
    let mut done = 0;
    let mut last = PathBuf::from("(none)");
    loop {
        match rx.recv_timeout(HANG_GUARD) {
            Ok(Ok((file, took))) => {
                done += 1;
                if took > slowest.0 {
                    slowest = (took, file.clone());
                }
                last = file;
            }
            Ok(Err(failure)) => panic!("{failure}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                "{target}: the input after {} ({done} of {count} done) has not finished \
                 after {HANG_GUARD:?}, taken for a hang",
                last.display()
            ),
        }
    }
    println!(
        "{target}: {done} inputs in {:?}, slowest {:?} ({})",
        start.elapsed(),
        slowest.0,
        slowest.1.display()
    );
}

#[test]
fn config_corpus() {
    replay("config");
}

#[test]
fn safetensors_header_corpus() {
    replay("safetensors_header");
}

#[test]
fn sharded_index_corpus() {
    replay("sharded_index");
}

#[test]
fn chat_template_corpus() {
    replay("chat_template");
}

/// The hand-made starting points of the fuzz runs (kept in the corpora).
#[test]
#[ignore = "rewrites fuzz/corpus/*/seed-*; run by hand"]
fn write_seed_corpora() {
    let put = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    };

    // config.json: real and preset configs, and one of each rejected kind.
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/tests/data");
    put(
        "config",
        "qwen2.5-7b",
        &std::fs::read(shared.join("qwen2.5-7b-config.json")).unwrap(),
    );
    for p in ["0.5b", "14b", "72b"] {
        let c = Config::preset(p).unwrap();
        put("config", p, serde_json::to_string(&c).unwrap().as_bytes());
    }
    put(
        "config",
        "tiny",
        serde_json::to_string(&tiny_config(false))
            .unwrap()
            .as_bytes(),
    );
    let base = serde_json::to_value(Config::preset("0.5b").unwrap()).unwrap();
    for (name, field, value) in [
        ("zero-heads", "num_attention_heads", serde_json::json!(0)),
        ("kv-3", "num_key_value_heads", serde_json::json!(3)),
        ("llama", "model_type", serde_json::json!("llama")),
        ("sliding", "use_sliding_window", serde_json::json!(true)),
        (
            "layers-1e15",
            "num_hidden_layers",
            serde_json::json!(1u64 << 50),
        ),
        ("eos-list", "eos_token_id", serde_json::json!([1, 2, 3])),
    ] {
        let mut v = base.clone();
        v[field] = value;
        put("config", name, v.to_string().as_bytes());
    }

    // safetensors: whole tiny checkpoints (tied bf16, untied f32) and small
    // hand-made files.
    for (name, tied, dtype) in [
        ("tiny-tied", true, DType::BF16),
        ("tiny-f32", false, DType::F32),
    ] {
        let d = tempfile::tempdir().unwrap();
        save_checkpoint(
            d.path(),
            &synthetic_weights(&tiny_config(tied), 1),
            dtype,
            None,
        )
        .unwrap();
        put(
            "safetensors_header",
            name,
            &std::fs::read(d.path().join(SINGLE_FILE)).unwrap(),
        );
    }
    put(
        "safetensors_header",
        "three-dtypes",
        &safetensors_from_parts(
            r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[3],"data_offsets":[8,20]},"c":{"dtype":"F16","shape":[],"data_offsets":[20,22]}}"#,
            &[7; 22],
        ),
    );
    put(
        "safetensors_header",
        "overlap",
        &safetensors_from_parts(
            r#"{"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[4],"data_offsets":[6,14]}}"#,
            &[0; 16],
        ),
    );
    put(
        "safetensors_header",
        "f4-i8",
        &safetensors_from_parts(
            r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]},"b":{"dtype":"I8","shape":[2],"data_offsets":[2,4]}}"#,
            &[0; 4],
        ),
    );

    // Sharded index: the real one of a sharded tiny checkpoint, and escapes.
    let d = tempfile::tempdir().unwrap();
    save_checkpoint(
        d.path(),
        &synthetic_weights(&tiny_config(false), 1),
        DType::BF16,
        Some(300),
    )
    .unwrap();
    let index = std::fs::read_to_string(d.path().join(INDEX_FILE)).unwrap();
    put("sharded_index", "tiny", index.as_bytes());
    put(
        "sharded_index",
        "escape",
        index
            .replacen("\"model-00001", "\"../model-00001", 1)
            .as_bytes(),
    );
    put(
        "sharded_index",
        "absolute",
        br#"{"weight_map": {"model.norm.weight": "/etc/passwd"}}"#,
    );

    // Chat templates: Qwen2.5's (with a NUL-separated user message) and
    // hostile ones.
    let qwen =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen-tokenizer/chat_template.jinja");
    if let Ok(t) = std::fs::read(&qwen) {
        put("chat_template", "qwen2.5", &t);
        put(
            "chat_template",
            "qwen2.5-with-message",
            &[&t[..], b"\0What is 2+2?"].concat(),
        );
    }
    for (name, t) in [
        ("macro-recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
        ("loop-1e9", "{% for x in ['a'] * 1000000000 %}{% endfor %}"),
        ("nested-loops", "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"),
        ("string-1e9", "{{ 'x' * 10**9 }}"),
        ("output-100mb", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"),
        ("indent", "{{ messages[0].content | indent(1000000000000) }}"),
        ("tojson-indent", "{{ messages | tojson(indent=1000000000000) }}"),
        ("messages", "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
        ("raise", "{{ raise_exception('no') }}"),
        ("map-1e12", "{{ (['x'] * 10**12) | map('upper') | list }}"),
        ("slice-1e12", "{{ [1] | slice(10**12) | list }}"),
        ("format-width", "{{ '%099999999999d' | format(1) }}{{ '{:>99999999999}'.format(1) }}"),
        ("replace-empty", "{{ ('x' * 10**7) | replace('', 'y' * 100) }}"),
        ("repeat-overflow", "{{ (range(10) * 4611686018427387904) | length }}"),
        ("tojson-nested", "{{ {'a': [['x'] * 10**12]} | tojson }}"),
    ] {
        put("chat_template", name, t.as_bytes());
    }
}
