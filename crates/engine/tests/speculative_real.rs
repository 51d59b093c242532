//! Speculative greedy decoding on the real Qwen2.5-Coder-0.5B-Instruct
//! checkpoint (directory in `QMK_REAL_QWEN`, built by
//! `scripts/fetch-real-qwen.sh`) on the CPU backend: the output ids equal
//! plain greedy decoding's on the golden prompts and on a long code edit,
//! with prompt lookup and with the model drafting for itself (every guess
//! accepted). Skips, saying so, when `QMK_REAL_QWEN` is unset.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use qmk_engine::draft::{DraftModel, ModelVocab};
use qmk_engine::{
    CpuBackend, Engine, GenerateOptions, Generation, SpeculateMode, SpeculativeOptions,
};
use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::tokenizer::Tokenizer;
use qmk_model::Weights;

/// Tokens generated per golden prompt (the goldens hold 48; fewer keep the
/// two-core CI quick while every prompt still runs several verifies).
const GOLDEN_TOKENS: usize = 16;
/// Tokens of the long generation.
const LONG_TOKENS: usize = 96;

const SOURCE: &str = "def total_price(items, discount=None):
    total = 0
    for item in items:
        if item.quantity <= 0:
            continue
        total += item.price * item.quantity
    if discount is not None:
        total = total * (1 - discount)
    return round(total, 2)
";

fn real_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from);
    if dir.is_none() {
        eprintln!(
            "SKIPPED: QMK_REAL_QWEN is not set (run scripts/fetch-real-qwen.sh and point \
             QMK_REAL_QWEN at the directory it prints)"
        );
    }
    dir
}

/// The golden prompts' input ids.
fn golden_prompts() -> Vec<(String, Vec<u32>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/golden/qwen2.5-coder-0.5b-instruct.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            (v["id"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

fn options(n: usize, mode: SpeculateMode, adaptive: bool) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        ignore_eos: true,
        speculation: SpeculativeOptions {
            mode,
            adaptive,
            ..SpeculativeOptions::default()
        },
        ..GenerateOptions::default()
    }
}

fn run(engine: &mut Engine<CpuBackend>, prompt: &[u32], opts: &GenerateOptions) -> Generation {
    engine
        .generate(prompt, opts, |_| ControlFlow::Continue(()))
        .unwrap()
}

/// An engine over the weights with the same weights drafting for it.
fn self_drafting(w: &Arc<Weights>, tok: &Tokenizer, capacity: usize) -> Engine<CpuBackend> {
    let vocab = ModelVocab {
        name: "qwen2.5-coder-0.5b-instruct",
        tokenizer: tok,
        rows: w.config.vocab_size,
    };
    let draft = DraftModel::new(
        CpuBackend::new(w.clone(), capacity).unwrap(),
        vocab,
        vocab,
        1.0,
    )
    .unwrap();
    let mut e = Engine::new(
        CpuBackend::new(w.clone(), capacity).unwrap(),
        w.config.vocab_size,
    );
    e.set_drafter(Some(Box::new(draft)));
    e
}

#[test]
fn speculative_greedy_equals_plain_greedy_on_real_weights() {
    let Some(dir) = real_dir() else {
        return;
    };
    let weights = Arc::new(qmk_model::load_weights(&dir).unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir).unwrap();
    let chat = |text: &str| {
        let rendered = tmpl.render(&[Message::user(text)], true).unwrap();
        tok.encode(&rendered).unwrap()
    };
    let mut cases: Vec<(String, Vec<u32>, usize)> = golden_prompts()
        .into_iter()
        .map(|(id, ids)| (id, ids, GOLDEN_TOKENS))
        .collect();
    cases.push((
        "long code edit".into(),
        chat(&format!(
            "{SOURCE}\nRename the variable `total` to `subtotal` in this function. Reply with \
             the whole function only."
        )),
        LONG_TOKENS,
    ));
    let capacity = cases.iter().map(|c| c.1.len() + c.2).max().unwrap();
    let mut plain = Engine::new(
        CpuBackend::new(weights.clone(), capacity).unwrap(),
        weights.config.vocab_size,
    );
    let mut drafted = self_drafting(&weights, &tok, capacity);
    for (name, prompt, n) in &cases {
        let want = run(&mut plain, prompt, &options(*n, SpeculateMode::Off, false));
        assert_eq!(want.speculation.mode, SpeculateMode::Off);
        // Prompt lookup: every guess verified on the goldens, the adaptive
        // rule on the long generation.
        {
            let adaptive = *n == LONG_TOKENS;
            let got = run(
                &mut plain,
                prompt,
                &options(*n, SpeculateMode::Ngram, adaptive),
            );
            eprintln!("{name} ngram adaptive {adaptive}: {:?}", got.speculation);
            assert_eq!(got.output_ids, want.output_ids, "{name}: ngram");
            if *n == LONG_TOKENS {
                // The edit copies its input: most tokens come from guesses.
                let s = got.speculation;
                assert!(s.accepted * 3 >= *n, "{name}: only {s:?}");
            }
        }
        // The model drafting for itself guesses its own picks: all held.
        let got = run(
            &mut drafted,
            prompt,
            &options(*n, SpeculateMode::Draft, false),
        );
        eprintln!("{name} draft: {:?}", got.speculation);
        assert_eq!(got.output_ids, want.output_ids, "{name}: draft");
        let s = got.speculation;
        assert_eq!(s.mode, SpeculateMode::Draft);
        assert!(s.proposed > 0, "{name}: {s:?}");
        assert_eq!(s.accepted, s.proposed, "{name}: {s:?}");
        assert!(s.tokens_per_step() > 4.0, "{name}: {s:?}");
        eprintln!("{name}: {:?}", tok.decode(&got.output_ids, false).unwrap());
    }
}
