//! Speculative greedy decoding on the real Qwen2.5-Coder-0.5B-Instruct
//! checkpoint (directory in `QMK_REAL_QWEN`, built by
//! `scripts/fetch-real-qwen.sh`) on the CPU backend: the output ids equal
//! plain greedy decoding's, and on a code-editing prompt the prompt-lookup
//! drafts are accepted. Skips, saying so, when `QMK_REAL_QWEN` is unset.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use qmk_engine::draft::PromptLookup;
use qmk_engine::speculative::{generate_greedy, SpeculativeOptions};
use qmk_engine::{CpuBackend, Engine, GenerateOptions};
use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::tokenizer::Tokenizer;

/// Tokens generated per prompt: short, the reference runs on two cores.
const NEW_TOKENS: usize = 32;

const SOURCE: &str = "def total_price(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total
";

#[test]
fn speculative_greedy_equals_plain_greedy_on_real_weights() {
    let Some(dir) = std::env::var_os("QMK_REAL_QWEN").map(PathBuf::from) else {
        eprintln!(
            "SKIPPED: QMK_REAL_QWEN is not set (run scripts/fetch-real-qwen.sh and point \
             QMK_REAL_QWEN at the directory it prints)"
        );
        return;
    };
    let weights = Arc::new(qmk_model::load_weights(&dir).unwrap());
    let vocab = weights.config.vocab_size;
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir).unwrap();
    let chat = |text: &str| {
        let rendered = tmpl.render(&[Message::user(text)], true).unwrap();
        tok.encode(&rendered).unwrap()
    };
    // (name, prompt ids, whether lookup must hit): a code edit that copies
    // its input, two of the golden prompts (one chat, one raw text).
    let prompts = [
        (
            "rename",
            chat(&format!(
                "{SOURCE}\nRename the variable `total` to `subtotal` in this function. \
                 Reply with the whole function only."
            )),
            true,
        ),
        (
            "prime",
            chat("Write a Python function that checks whether a number is prime."),
            false,
        ),
        (
            "raw-text",
            tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
                .unwrap(),
            false,
        ),
    ];
    for (name, prompt, must_hit) in &prompts {
        let capacity = prompt.len() + NEW_TOKENS;
        let mut plain = Engine::new(CpuBackend::new(weights.clone(), capacity).unwrap(), vocab);
        let plain_opts = GenerateOptions {
            max_new_tokens: NEW_TOKENS,
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let want = plain
            .generate(prompt, &plain_opts, |_| ControlFlow::Continue(()))
            .unwrap()
            .output_ids;
        let mut backend = plain.into_backend();
        let opts = SpeculativeOptions {
            max_new_tokens: NEW_TOKENS,
            adaptive: false,
            ..SpeculativeOptions::default()
        };
        let got = generate_greedy(
            &mut backend,
            &mut PromptLookup::default(),
            prompt,
            &opts,
            |_| ControlFlow::Continue(()),
        )
        .unwrap();
        eprintln!(
            "{name}: {:?} -> {:?}",
            got.stats,
            tok.decode(&got.output_ids, false).unwrap()
        );
        assert_eq!(got.output_ids, want, "{name}");
        if *must_hit {
            assert!(
                got.stats.accepted * 4 >= NEW_TOKENS,
                "{name}: only {} of {NEW_TOKENS} tokens came from accepted drafts: {:?}",
                got.stats.accepted,
                got.stats
            );
        }
    }
}
