//! Speculative greedy decoding on the GPU backend, on both drivers: with
//! prompt lookup and with a second backend of the same synthetic 0.5B
//! weights drafting, every guess verified (the adaptive rule off, since the
//! GPU backend's multi-token step is still the default one, which never
//! pays), the output ids equal plain greedy decoding's. Skips with a
//! printed reason when there is no device.

use qmk_gpu_tests::*;

use std::ops::ControlFlow;
use std::path::Path;

use qmk_engine::draft::{DraftModel, ModelVocab};
use qmk_engine::{Engine, GenerateOptions, Generation, SpeculateMode, SpeculativeOptions};
use qmk_gpu::Driver;
use qmk_model::tokenizer::Tokenizer;

const NEW_TOKENS: usize = 64;

fn speculative_equals_plain<D: Driver + 'static>() {
    let test = format!("speculative greedy == plain greedy ({})", D::NAME);
    let Some(_g) = gpu_or_skip(&test) else { return };
    let w = weights("0.5b");
    // A repeated stretch: something for prompt lookup to copy.
    let mut prompt = synthetic_prompt(12, SEED);
    prompt.extend(prompt.clone());
    let capacity = prompt.len() + NEW_TOKENS;
    let opts = |mode| GenerateOptions {
        max_new_tokens: NEW_TOKENS,
        ignore_eos: true,
        speculation: SpeculativeOptions {
            mode,
            adaptive: false,
            ..SpeculativeOptions::default()
        },
        ..GenerateOptions::default()
    };
    let mut engine = Engine::new(open::<D>(&w, with_capacity(capacity)), w.config.vocab_size);
    let go = |e: &mut Engine<_>, mode| -> Generation {
        e.generate(&prompt, &opts(mode), |_| ControlFlow::Continue(()))
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
    println!(
        "{test}: {NEW_TOKENS} ids identical; ngram {:?}; draft model {s:?} (acceptance {:.3}; \
         below 1 only where the prefill kernel's logits of a catch-up differ from a step's)",
        ngram.speculation,
        s.acceptance()
    );
}

both!(speculative_greedy_equals_plain, speculative_equals_plain);
