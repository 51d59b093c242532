//! Speculative greedy decoding on the GPU backend, on both drivers: with
//! prompt lookup and with a second backend of the same weights drafting,
//! every guess verified by the multi-token kernel (the adaptive rule off, so
//! every step verifies), the output ids equal plain greedy decoding's: on
//! the synthetic 0.5B, and on the real
//! Qwen2.5-Coder-0.5B-Instruct (directory in `QMK_REAL_QWEN`) for the golden
//! prompts. Skips with a printed reason when there is no device (or no real
//! weights).

use qmk_gpu_tests::*;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use qmk_engine::draft::{DraftModel, ModelVocab};
use qmk_engine::{Engine, GenerateOptions, Generation, SpeculateMode, SpeculativeOptions};
use qmk_gpu::Driver;
use qmk_model::tokenizer::Tokenizer;

const NEW_TOKENS: usize = 64;

/// `new_tokens` ids (end of text ignored) decoded in `mode` with every guess
/// verified: the adaptive rule off.
fn verify_every_guess(mode: SpeculateMode, new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: new_tokens,
        ignore_eos: true,
        speculation: SpeculativeOptions::always(mode),
        ..GenerateOptions::default()
    }
}

fn speculative_equals_plain<D: Driver + 'static>() {
    let test = format!("speculative greedy == plain greedy ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    // A repeated stretch: something for prompt lookup to copy.
    let mut prompt = synthetic_prompt(12, SEED);
    prompt.extend(prompt.clone());
    let capacity = prompt.len() + NEW_TOKENS;
    let mut engine = Engine::new(open::<D>(&w, with_capacity(capacity)), w.config.vocab_size);
    let go = |e: &mut Engine<_>, mode| -> Generation {
        e.generate(&prompt, &verify_every_guess(mode, NEW_TOKENS), |_| {
            ControlFlow::Continue(())
        })
        .unwrap_or_else(|err| panic!("{test}: {}: {err}", mode.name()))
    };
    let plain = go(&mut engine, SpeculateMode::Off);
    let ngram = go(&mut engine, SpeculateMode::Ngram);
    assert_eq!(ngram.output_ids, plain.output_ids, "{test}: ngram");
    assert!(
        ngram.speculation.verifies > 0,
        "{test}: {:?}",
        ngram.speculation
    );

    // The synthetic model's ids all belong to the Qwen tokenizer.
    let tok = Tokenizer::from_dir(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/qwen-tokenizer"),
    )
    .unwrap();
    let vocab = ModelVocab {
        name: "synthetic 0.5b",
        tokenizer: &tok,
        rows: w.config.vocab_size,
    };
    let draft = DraftModel::new(open::<D>(&w, with_capacity(capacity)), vocab, vocab, 1.0)
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    engine.set_drafter(Some(Box::new(draft)));
    let drafted = go(&mut engine, SpeculateMode::Draft);
    assert_eq!(drafted.output_ids, plain.output_ids, "{test}: draft model");
    let s = drafted.speculation;
    assert!(s.proposed > 0, "{test}: {s:?}");
    // A model drafting for itself guesses the target's own picks: the
    // multi-token step gives each position a one-token step's bits.
    assert_eq!(
        s.accepted, s.proposed,
        "{test}: self-drafting rejected a guess"
    );
    println!(
        "{test}: {NEW_TOKENS} ids identical; ngram {:?}; draft model {s:?} (acceptance {:.3})",
        ngram.speculation,
        s.acceptance()
    );
}

both!(speculative_greedy_equals_plain, speculative_equals_plain);

/// Tokens per golden prompt (as many as the goldens hold).
const GOLDEN_TOKENS: usize = 48;

fn real_goldens_speculative<D: Driver + 'static>() {
    let test = format!("real 0.5B goldens, speculative == plain ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        println!("SKIPPED {test}: QMK_REAL_QWEN is not set (the real-weights directory)");
        return;
    };
    let w = Arc::new(qmk_model::load_weights(&dir).unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let golden = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/golden/qwen2.5-coder-0.5b-instruct.jsonl");
    let prompts: Vec<(String, Vec<u32>)> = std::fs::read_to_string(&golden)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["input_ids"].as_array().unwrap();
            let ids = ids.iter().map(|x| x.as_u64().unwrap() as u32).collect();
            (v["id"].as_str().unwrap().to_string(), ids)
        })
        .collect();
    let capacity = prompts.iter().map(|p| p.1.len()).max().unwrap() + GOLDEN_TOKENS;
    let vocab = ModelVocab {
        name: "qwen2.5-coder-0.5b-instruct",
        tokenizer: &tok,
        rows: w.config.vocab_size,
    };
    let mut engine = Engine::new(open::<D>(&w, with_capacity(capacity)), w.config.vocab_size);
    let draft = DraftModel::new(open::<D>(&w, with_capacity(capacity)), vocab, vocab, 1.0)
        .unwrap_or_else(|e| panic!("{test}: {e}"));
    engine.set_drafter(Some(Box::new(draft)));
    let (mut proposed, mut accepted) = (0, 0);
    for (name, prompt) in &prompts {
        let mut go = |mode| {
            let opts = verify_every_guess(mode, GOLDEN_TOKENS);
            engine
                .generate(prompt, &opts, |_| ControlFlow::Continue(()))
                .unwrap_or_else(|e| panic!("{test}: {name}: {e}"))
        };
        let plain = go(SpeculateMode::Off);
        for mode in [SpeculateMode::Ngram, SpeculateMode::Draft] {
            let got = go(mode);
            assert_eq!(
                got.output_ids,
                plain.output_ids,
                "{test}: {name}: {}",
                mode.name()
            );
            if mode == SpeculateMode::Draft {
                proposed += got.speculation.proposed;
                accepted += got.speculation.accepted;
            }
        }
    }
    assert_eq!(
        accepted, proposed,
        "{test}: the 0.5B drafting for itself rejected a guess"
    );
    println!(
        "{test}: {} prompts x {GOLDEN_TOKENS} ids identical for ngram and the 0.5B drafting \
         for itself ({accepted} of {proposed} guesses accepted)",
        prompts.len()
    );
}

both!(
    real_goldens_speculative_equal_plain,
    real_goldens_speculative
);
