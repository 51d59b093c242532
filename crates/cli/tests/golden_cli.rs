//! The golden check through the CLI: for each of the 8 golden prompts,
//! `qwen-mk generate --model $QMK_REAL_QWEN --backend cpu --max-new-tokens 48
//! --ignore-eos --temperature 0 --json --top-logprobs 5 [--raw]` (greedy:
//! the model's own sampling defaults would apply otherwise) must give `prompt_ids` equal
//! to Hugging Face's `input_ids`, and `output_ids` passing the golden rule
//! (vLLM's check_logprobs_close): identical up to the first divergence;
//! there, each side's token is in the other's top 5.
//!
//! Skips (saying so) when QMK_REAL_QWEN is unset; CI sets it.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::qwen_mk;

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Token ids of one step's top-k list `[[id, logprob], ...]`.
fn top_ids(step: &Value) -> Vec<u64> {
    step.as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect()
}

/// The golden rule; `Err` describes the failure.
fn check_close(golden: &Value, ours: &Value) -> Result<String, String> {
    let want = ids(&golden["output_ids"]);
    let got = ids(&ours["output_ids"]);
    if got.len() != want.len() {
        return Err(format!(
            "{} output ids, golden has {}",
            got.len(),
            want.len()
        ));
    }
    let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) else {
        return Ok("identical".to_string());
    };
    let hf_top = top_ids(&golden["top5"][i]);
    let our_top = top_ids(&ours["top_logprobs"][i]);
    if !hf_top.contains(&got[i]) {
        return Err(format!(
            "step {i}: our token {} is not in HF's top 5 {hf_top:?}",
            got[i]
        ));
    }
    if !our_top.contains(&want[i]) {
        return Err(format!(
            "step {i}: HF's token {} is not in our top 5 {our_top:?}",
            want[i]
        ));
    }
    Ok(format!("diverged at step {i} within the top 5"))
}

#[test]
fn golden_prompts_through_the_cli() {
    let Some(model) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!("SKIP: QMK_REAL_QWEN is unset (run scripts/fetch-real-qwen.sh and export it)");
        return;
    };
    let golden_path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/golden/qwen2.5-coder-0.5b-instruct.jsonl");
    let text = std::fs::read_to_string(&golden_path)
        .unwrap_or_else(|e| panic!("{}: {e}", golden_path.display()));
    let goldens: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(goldens.len(), 8);
    let model = model.to_str().unwrap().to_string();
    let mut failures = Vec::new();
    for g in &goldens {
        let id = g["id"].as_str().unwrap();
        let prompt = g["prompt"].as_str().unwrap();
        let mut args = vec![
            "generate",
            "--model",
            &model,
            "--backend",
            "cpu",
            "--max-new-tokens",
            "48",
            "--ignore-eos",
            "--temperature",
            "0",
            "--json",
            "--top-logprobs",
            "5",
            "--prompt",
            prompt,
        ];
        if g["chat"] == Value::Bool(false) {
            args.push("--raw");
        }
        let r = qwen_mk(&args, &[], "", Duration::from_secs(900));
        r.assert_ok();
        let ours = r.json();
        if ids(&ours["prompt_ids"]) != ids(&g["input_ids"]) {
            failures.push(format!("{id}: prompt_ids differ from the golden input_ids"));
            continue;
        }
        match check_close(g, &ours) {
            Ok(how) => eprintln!(
                "{id}: ok ({how}); {:.1} tok/s",
                ours["decode_tok_per_s"].as_f64().unwrap_or(0.0)
            ),
            Err(e) => failures.push(format!("{id}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "golden failures:\n{}",
        failures.join("\n")
    );
}
