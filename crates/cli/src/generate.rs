//! `qwen-mk generate`: one prompt in, text out (streamed, or one JSON object).

use std::io::{Read, Write};
use std::ops::ControlFlow;

use anyhow::{bail, Context, Result};
use clap::Args;
use qmk_engine::{Backend, Engine, TextStream};
use qmk_model::chat::Message;

use crate::common::{
    choose_target, engine_error, fit_request, open_backend, plan_context, speculation_json,
    stats_line, whole, with_draft, Model, ModelArgs, RunArgs, SamplingArgs, SpeculateArgs,
    MAX_STDIN_BYTES, MAX_TOP_LOGPROBS,
};
use crate::output::{eprint_line, stdout_error};
use crate::ui::Ui;

/// Generate text from one prompt.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// The prompt text (`-` reads it from stdin).
    #[arg(long, short = 'p')]
    pub prompt: String,

    /// Feed the prompt as-is, without the chat template.
    #[arg(long)]
    pub raw: bool,

    /// System message for the chat template (default: the template's own).
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    #[command(flatten)]
    pub speculate: SpeculateArgs,

    #[command(flatten)]
    pub run: RunArgs,

    /// Print one JSON object instead of streaming text: model, backend,
    /// prompt_ids, output_ids, text, stop, stop_string, sampling (the
    /// values used, seed included), prefill_ms, decode_tok_per_s,
    /// speculation (mode, proposed, accepted, acceptance, steps,
    /// verify_steps, tokens_per_step).
    #[arg(long)]
    pub json: bool,

    /// With --json, add the N most likely tokens (N at most 20) and their
    /// log-probabilities at every generated position ("top_logprobs").
    #[arg(long, value_name = "N", requires = "json", default_value_t = 0,
          allow_negative_numbers = true, value_parser = whole::<usize>(0..=MAX_TOP_LOGPROBS))]
    pub top_logprobs: usize,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let ui = Ui::new(args.run.quiet);
    // Everything that can be checked without the model first.
    let prompt = read_prompt(&args.prompt)?;
    if prompt.is_empty() {
        bail!("empty prompt: give some text with --prompt");
    }
    args.sampling.check()?;
    args.speculate.check()?;
    let target = choose_target(args.run.backend, &ui)?;

    let model = Model::open(&args.model, &ui)?;
    let prompt_ids = if args.raw {
        model.tokenizer.encode(&prompt)?
    } else {
        let template = model.chat_template()?;
        let mut messages = Vec::new();
        if let Some(sys) = &args.system {
            messages.push(Message::system(sys.clone()));
        }
        messages.push(Message::user(prompt.clone()));
        model.encode_chat(&template, &messages)?
    };
    if prompt_ids.is_empty() {
        bail!("empty prompt: the text encodes to no tokens");
    }
    let (capacity, max_new) = plan_context(
        &model.config,
        prompt_ids.len(),
        args.sampling.max_new_tokens,
        args.run.context,
        &ui,
    )?;
    let mut opts = args.sampling.options(&model)?;
    opts.speculation = args.speculate.options();
    if opts.stop_ids.is_empty() && !opts.ignore_eos {
        ui.note("note: the model names no end-of-text token; generating until --max-new-tokens");
    }

    // The draft model first: a GPU target may then take the memory left.
    let draft = args
        .speculate
        .open_draft(&model, &target, &args.run, capacity, &ui)?;
    let mut backend = open_backend(&model, target, &args.run, capacity, &ui)?;
    // A GPU backend may have picked a context other than `capacity` (the
    // largest that fits): the request must fit that one.
    opts.max_new_tokens = fit_request(prompt_ids.len(), max_new, backend.capacity(), &ui)?;
    let backend_name = backend.kind().name();
    if args.top_logprobs > 0 {
        backend.record_top_logprobs(args.top_logprobs, prompt_ids.len());
    }
    let mut engine = with_draft(Engine::new(backend, model.config.vocab_size), draft);

    let mut text = TextStream::new(&model.tokenizer, args.sampling.stop_matcher()?);
    let mut out = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let generation = engine
        .generate_text(&prompt_ids, &opts, &mut text, |delta| {
            if args.json {
                return ControlFlow::Continue(());
            }
            match out.write_all(delta.as_bytes()).and_then(|_| out.flush()) {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => {
                    write_err = Some(e);
                    ControlFlow::Break(())
                }
            }
        })
        .map_err(engine_error)?;
    if let Some(e) = write_err {
        // A closed pipe (`| head`) ends the run quietly (output::finish).
        return Err(stdout_error(e));
    }

    let s = &opts.sampling;
    let mut line = String::new();
    if args.json {
        let mut obj = serde_json::json!({
            "model": model.name,
            "backend": backend_name,
            "tp": args.run.tp,
            "prompt_ids": generation.prompt_ids,
            "output_ids": generation.output_ids,
            "text": text.text(),
            "stop": generation.stop.name(),
            "stop_string": text.stop_string(),
            "sampling": {
                "greedy": s.is_greedy(),
                "temperature": decimal(s.temperature),
                "top_k": s.top_k,
                "top_p": decimal(s.top_p),
                "min_p": decimal(s.min_p),
                "repetition_penalty": decimal(s.repetition_penalty),
                "presence_penalty": decimal(s.presence_penalty),
                "frequency_penalty": decimal(s.frequency_penalty),
                "seed": s.seed,
            },
            "prefill_ms": generation.prefill.as_secs_f64() * 1e3,
            "decode_tok_per_s": generation.decode_tok_per_s(),
            "speculation": speculation_json(&generation.speculation),
        });
        if args.top_logprobs > 0 {
            let mut top = engine.backend_mut().take_top_logprobs();
            // A last verify may have looked past the last token.
            top.truncate(generation.output_ids.len());
            obj["top_logprobs"] = serde_json::to_value(top)?;
        }
        line = obj.to_string();
    }
    line.push('\n');
    out.write_all(line.as_bytes())
        .and_then(|()| out.flush())
        .map_err(stdout_error)?;
    if !ui.quiet() {
        let seed = (!s.is_greedy()).then_some(s.seed);
        eprint_line(&stats_line(&generation, backend_name, seed));
    }
    Ok(())
}

/// `x` as the double with the same shortest decimal form (0.8, not the
/// 0.800000011920929 a plain widening gives), for JSON.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// The prompt: `arg` itself, or stdin for `-` (at most [`MAX_STDIN_BYTES`],
/// so an endless stdin is refused after that much, not read until memory
/// runs out).
fn read_prompt(arg: &str) -> Result<String> {
    if arg != "-" {
        return Ok(arg.to_string());
    }
    let mut bytes = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_STDIN_BYTES + 1)
        .read_to_end(&mut bytes)
        .context("cannot read the prompt from stdin")?;
    if bytes.len() as u64 > MAX_STDIN_BYTES {
        bail!(
            "the prompt on stdin (--prompt -) is longer than {} MiB",
            MAX_STDIN_BYTES >> 20
        );
    }
    String::from_utf8(bytes).context("the prompt on stdin (--prompt -) is not UTF-8 text")
}
