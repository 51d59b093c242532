//! Entry points of the fuzz targets in `fuzz/` (cargo-fuzz) and of the test
//! that replays their corpora in CI (`tests/fuzz_corpus_replay.rs`): one
//! function per target, so the two cannot drift. Not part of the API.
//!
//! Each takes arbitrary bytes and must return: no panic, no hang, memory
//! bounded by the input. Whatever parses is checked against the invariants
//! the rest of the engine relies on (the asserts below).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use half::bf16;

use crate::chat::{ChatTemplate, Message, MAX_RENDER_BYTES};
use crate::checkpoint::{check_tensors, parse_header, parse_index, stage_block, INDEX_FILE};
use crate::config::{Config, GenerationConfig};
use crate::error::ModelError;
use crate::inventory::{expected_tensors, model_plan, stacked_specs, weight_bytes};
use crate::{synthetic_weights, Checkpoint};

/// A fuzz target: (name = folder under `fuzz/corpus/`, entry point).
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: [Target; 4] = [
    ("config", config),
    ("safetensors_header", safetensors_header),
    ("sharded_index", sharded_index),
    ("chat_template", chat_template),
];

/// A valid config small enough to write whole checkpoints of (the one the
/// checkpoint tests use): hidden 16, 2 layers, 4 heads of 4, vocab 40.
pub fn tiny_config(tied: bool) -> Config {
    let mut c = Config::preset("0.5b").expect("preset");
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = Some(2);
    c.head_dim = None;
    c.vocab_size = 40;
    c.tie_word_embeddings = tied;
    c
}

/// `config.json` (and `generation_config.json`): parse and validate, then
/// everything derived from a valid config (sizes, layout plan, inventory
/// check) is a value or a typed error.
pub fn config(data: &[u8]) {
    let path = Path::new("fuzz/config.json");
    let text = String::from_utf8_lossy(data);
    let _ = GenerationConfig::from_json_str(&text, Path::new("fuzz/generation_config.json"));
    let Ok(c) = Config::from_json_str(&text, path) else {
        return;
    };
    let _ = (c.q_dim(), c.kv_dim(), c.gqa_group(), c.eos_token_ids());
    let _ = weight_bytes(&c);
    let _ = stacked_specs(&c);
    let _ = model_plan(&c);
    // Against an empty checkpoint the first expected tensor is missing (or
    // its size overflows): found without listing every layer first.
    let e = check_tensors(&c, path, |_| None).expect_err("nothing is present");
    assert!(
        matches!(
            e,
            ModelError::MissingTensor { .. } | ModelError::Overflow { .. }
        ),
        "{e}"
    );
    let first: Vec<_> = match expected_tensors(&c) {
        Ok(tensors) => tensors.take(64).collect(),
        Err(_) => Vec::new(),
    };
    for t in first {
        assert!(!t.shape.is_empty() && t.shape.iter().all(|&d| d > 0));
    }
}

/// A whole safetensors file: header validation, then every tensor's bytes
/// are inside the file and stage to bf16, then the inventory check of the
/// tiny config (tied and untied) against it.
pub fn safetensors_header(data: &[u8]) {
    let path = Path::new("fuzz/model.safetensors");
    let Ok(h) = parse_header(path, data) else {
        return;
    };
    assert_eq!(h.data_start + h.data_len, data.len() as u64);
    for t in h.tensors.values() {
        let (b, e) = t.data_offsets;
        assert!(b <= e && e <= h.data_len, "{t:?}");
        let at = |x: u64| usize::try_from(h.data_start + x).expect("inside the input");
        let bytes = &data[at(b)..at(e)];
        if let Some(dtype) = t.staged_dtype() {
            assert_eq!(bytes.len() as u64, t.elems() * dtype.size_bytes());
            // elems <= input length / 2: bounded by the input.
            let mut dst = vec![bf16::ZERO; usize::try_from(t.elems()).expect("bounded")];
            stage_block(dtype, bytes, &mut dst);
        }
    }
    for tied in [true, false] {
        let _ = check_tensors(&tiny_config(tied), path, |name| {
            h.tensors.get(name).map(|e| (path, e))
        });
    }
}

/// A checkpoint directory holding the tiny untied model in shards, written
/// once per process; the index is rewritten by each [`sharded_index`] call.
fn shard_dir() -> &'static Mutex<PathBuf> {
    static DIR: OnceLock<Mutex<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("qmk-fuzz-shards-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the shard directory");
        let w = synthetic_weights(&tiny_config(false), 1);
        crate::checkpoint::save_checkpoint(&dir, &w, qmk_layout::DType::BF16, Some(300))
            .expect("write the shards");
        Mutex::new(dir)
    })
}

/// `model.safetensors.index.json`: parsing and shard-name validation (no
/// name reaches outside the directory), then a full `Checkpoint::open` +
/// check with that index over real shards of the tiny model.
pub fn sharded_index(data: &[u8]) {
    let index_path = Path::new("fuzz").join(INDEX_FILE);
    let text = String::from_utf8_lossy(data);
    let Ok(index) = parse_index(&index_path, &text) else {
        return;
    };
    let root = Path::new("/model");
    for (shard, tensor) in &index.shards {
        assert_eq!(root.join(shard).parent(), Some(root), "{shard:?} escapes");
        assert_eq!(index.weight_map.get(tensor), Some(shard));
    }
    let dir = shard_dir().lock().unwrap_or_else(|p| p.into_inner());
    std::fs::write(dir.join(INDEX_FILE), data).expect("write the index");
    if let Ok(ckpt) = Checkpoint::open(&dir) {
        let _ = ckpt.check(&tiny_config(false));
    }
}

/// Instruction budget of a fuzzed render: [`crate::chat::RENDER_FUEL`]
/// takes over 10 s under ASan and coverage instrumentation; this ends a
/// runaway template within a quarter of a second there, exercising the same
/// limit. A 4-message render of Qwen2.5's template needs under 250.
pub const FUZZ_FUEL: u64 = 200_000;

/// A chat template (bytes up to the first NUL; what follows is the user
/// message): compile, render a short conversation with [`FUZZ_FUEL`]. Every
/// render ends within the fuel, recursion and output limits of
/// [`crate::chat`].
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (source, content) = text.split_once('\0').unwrap_or((&text, "Hello"));
    let tokens = BTreeMap::from([
        ("bos_token".to_string(), "<|endoftext|>".to_string()),
        ("eos_token".to_string(), "<|im_end|>".to_string()),
    ]);
    let Ok(t) = ChatTemplate::new(source, "fuzz/chat_template.jinja", tokens) else {
        return;
    };
    let t = t.with_fuel(FUZZ_FUEL);
    let messages = [
        Message::system("You are a helpful assistant."),
        Message::user(content),
        Message::assistant("Hi!"),
        Message::user("Bye"),
    ];
    match t.render(&messages, data.len() % 2 == 0) {
        Ok(s) => assert!(s.len() <= MAX_RENDER_BYTES),
        Err(e) => assert!(
            matches!(
                e,
                ModelError::ChatTemplate { .. } | ModelError::TemplateLimit { .. }
            ),
            "{e}"
        ),
    }
}
