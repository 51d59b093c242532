//! `qwen-mk plan` end to end: the binary's JSON and text output.

use std::process::{Command, Output};

fn qwen_mk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qwen-mk"))
        .args(args)
        .output()
        .expect("run qwen-mk")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = qwen_mk(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn tensor<'a>(plan: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    plan["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

fn chunks(plan: &serde_json::Value, name: &str) -> usize {
    tensor(plan, name)["chunks"].as_array().unwrap().len()
}

/// Every chunk of every tensor fits 32-bit byte offsets, and chunks tile
/// axis 0 in order.
fn assert_all_chunks_fit(plan: &serde_json::Value) {
    for t in plan["tensors"].as_array().unwrap() {
        let mut at = 0;
        for c in t["chunks"].as_array().unwrap() {
            let span = c["byte_span"].as_u64().unwrap();
            assert!(span <= 1 << 32, "{}: chunk span {span}", t["name"]);
            assert_eq!(c["start"].as_u64().unwrap(), at, "{}", t["name"]);
            at = c["end"].as_u64().unwrap();
        }
        assert_eq!(at, t["shape"][0].as_u64().unwrap(), "{}", t["name"]);
    }
}

#[test]
fn plan_14b_json_splits_mlp_in_two() {
    let plan = json(&["plan", "--preset", "14b", "--json"]);
    assert_eq!(plan["model"], "14b");
    assert_eq!(plan["offset_model"]["bits"], 32);
    for name in ["gate_proj", "up_proj", "down_proj"] {
        assert_eq!(chunks(&plan, name), 2, "{name}");
    }
    for name in [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "embed_tokens",
        "lm_head",
    ] {
        assert_eq!(chunks(&plan, name), 1, "{name}");
    }
    let gate = tensor(&plan, "gate_proj");
    assert_eq!(gate["shape"], serde_json::json!([48, 13824, 5120]));
    assert_eq!(gate["stride"], serde_json::json!([70778880, 5120, 1]));
    assert_eq!(gate["dtype"], "bf16");
    assert_eq!(gate["byte_span"], 6_794_772_480u64);
    assert_all_chunks_fit(&plan);
    assert_eq!(plan["tensors"].as_array().unwrap().len(), 15);
}

#[test]
fn plan_every_preset_fits() {
    for (preset, mlp_chunks) in [
        ("0.5b", 1),
        ("1.5b", 1),
        ("3b", 1),
        ("7b", 1),
        ("14b", 2),
        ("32b", 5),
        ("72b", 10),
    ] {
        let plan = json(&["plan", "--preset", preset, "--json"]);
        assert_all_chunks_fit(&plan);
        assert_eq!(chunks(&plan, "gate_proj"), mlp_chunks, "{preset}");
    }
}

#[test]
fn plan_text_is_readable() {
    let out = qwen_mk(&["plan", "--preset", "14b"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("(48,13824,5120):(70778880,5120,1)"), "{text}");
    assert!(text.contains("6.79 GB"), "{text}");
    assert!(text.contains("32-bit offsets in bytes"), "{text}");
    assert!(text.contains("chunk 0: layers [0, 24)"), "{text}");
}

#[test]
fn plan_from_config_file_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(include_str!("data/qwen2.5-7b-config.json")).unwrap();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let by_file = json(&["plan", "--config", path.to_str().unwrap(), "--json"]);
    let by_dir = json(&["plan", "--config", dir.path().to_str().unwrap(), "--json"]);
    let preset = json(&["plan", "--preset", "7b", "--json"]);
    assert_eq!(by_file["tensors"], preset["tensors"]);
    assert_eq!(by_dir["tensors"], preset["tensors"]);

    // A bad config: one error line naming the file and the field.
    cfg["num_key_value_heads"] = 5.into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let out = qwen_mk(&["plan", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        err.contains("config.json") && err.contains("num_key_value_heads"),
        "{err}"
    );

    let out = qwen_mk(&["plan", "--preset", "13b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown preset `13b`"));
    // Neither or both sources: a usage error from clap.
    assert_eq!(qwen_mk(&["plan"]).status.code(), Some(2));
    assert_eq!(
        qwen_mk(&["plan", "--preset", "7b", "--config", "x"])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn plan_reports_the_largest_context_for_a_device_memory() {
    let h200 = json(&["plan", "--preset", "72b", "--json"]);
    let m = &h200["memory"];
    assert_eq!(m["device_memory"], 150_109_880_320u64);
    let best = m["largest_context"].as_u64().unwrap();
    assert!((11_000..12_500).contains(&best), "{best}");
    let bigger = json(&[
        "plan",
        "--preset",
        "72b",
        "--json",
        "--device-memory",
        "160GB",
    ]);
    assert!(bigger["memory"]["largest_context"].as_u64().unwrap() > best);
    let small = json(&[
        "plan",
        "--preset",
        "72b",
        "--json",
        "--device-memory",
        "80GiB",
    ]);
    assert!(small["memory"]["largest_context"].is_null());
    let out = qwen_mk(&["plan", "--preset", "0.5b", "--device-memory", "141GB"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("largest context in 141.00 GB") && text.contains("32768 positions"),
        "{text}"
    );
    let out = qwen_mk(&["plan", "--preset", "0.5b", "--device-memory", "12XB"]);
    assert!(!out.status.success());
}
