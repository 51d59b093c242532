//! Plain vs speculative (prompt-lookup) greedy decoding on the CPU backend,
//! with a model directory from the Hugging Face Hub layout:
//!
//! ```sh
//! cargo run --release -p qmk-engine --example speculate_cpu -- MODEL_DIR [NEW_TOKENS]
//! ```
//!
//! Prints the cost of one multi-token step of `T = 1..=8` positions against
//! one single step (what `SpeculativeOptions::position_cost` should be on
//! this machine), then for each code-editing prompt the decode rate of both
//! loops, the speculation statistics and whether the outputs are equal.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use qmk_engine::{
    Backend, CpuBackend, Engine, GenerateOptions, MultiStep, SpeculateMode, SpeculativeOptions,
    MAX_STEP_TOKENS,
};
use qmk_model::chat::{ChatTemplate, Message};
use qmk_model::tokenizer::Tokenizer;

const SOURCE: &str = "def load_config(path):
    with open(path) as f:
        text = f.read()
    config = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith('#'):
            continue
        key, value = line.split('=', 1)
        config[key.strip()] = value.strip()
    return config
";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: speculate_cpu MODEL_DIR [NEW_TOKENS]")?;
    let new_tokens: usize = args.next().map_or(Ok(64), |s| s.parse())?;
    let weights = Arc::new(qmk_model::load_weights(std::path::Path::new(&dir))?);
    let vocab = weights.config.vocab_size;
    let tok = Tokenizer::from_dir(&dir)?;
    let tmpl = ChatTemplate::from_dir(&dir)?;

    // Step cost: the same context, a run of T positions vs one position.
    let context: Vec<u32> = tok.encode(SOURCE)?;
    let mut b = CpuBackend::new(weights.clone(), context.len() + MAX_STEP_TOKENS)?;
    b.prefill(&context, 0)?;
    let reps = 3;
    let mut single = 0.0;
    println!("T  ms/step  cost vs T=1  cost per extra position");
    for t in 1..=MAX_STEP_TOKENS {
        let run = &context[..t];
        let start = context.len() - 1;
        let t0 = Instant::now();
        for _ in 0..reps {
            b.step_many(MultiStep::new(run, start, b.capacity())?)?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
        if t == 1 {
            single = ms;
        }
        let extra = if t > 1 {
            format!("{:.3}", (ms / single - 1.0) / (t - 1) as f64)
        } else {
            "-".into()
        };
        println!("{t}  {ms:7.1}  {:11.2}  {extra}", ms / single);
    }

    for ask in [
        "Rename the variable `config` to `settings` in this function. Reply with the whole function.",
        "Add error handling to this function: raise a ValueError naming the line when a line has no '='. Reply with the whole function.",
    ] {
        let prompt = tok.encode(&tmpl.render(&[Message::user(format!("{SOURCE}\n{ask}"))], true)?)?;
        let capacity = prompt.len() + new_tokens;
        let mut engine = Engine::new(CpuBackend::new(weights.clone(), capacity)?, vocab);
        let plain_opts = GenerateOptions {
            max_new_tokens: new_tokens,
            ignore_eos: true,
            speculation: SpeculativeOptions::off(),
            ..GenerateOptions::default()
        };
        let plain = engine.generate(&prompt, &plain_opts, |_| ControlFlow::Continue(()))?;
        let opts = GenerateOptions {
            speculation: SpeculativeOptions {
                mode: SpeculateMode::Ngram,
                ..SpeculativeOptions::default()
            },
            ..plain_opts
        };
        let spec = engine.generate(&prompt, &opts, |_| ControlFlow::Continue(()))?;
        let spec_rate = spec.decode_tok_per_s();
        println!(
            "\n{ask}\n  prompt {} tokens, {new_tokens} new; plain {:.2} tok/s, speculative {spec_rate:.2} tok/s ({:.2}x); same output: {}\n  {:?}, {:.2} tokens/step, acceptance {:.2}",
            prompt.len(),
            plain.decode_tok_per_s(),
            spec_rate / plain.decode_tok_per_s(),
            spec.output_ids == plain.output_ids,
            spec.speculation,
            spec.speculation.tokens_per_step(),
            spec.speculation.acceptance(),
        );
    }
    Ok(())
}
