//! `qwen-mk chat`: an interactive multi-turn session. Each turn renders the
//! whole history through the model's chat template and generates the reply,
//! streamed. A conversation that outgrows the context gets a message, not a
//! crash; `/reset` starts over.

use std::io::{BufRead, IsTerminal, Write};
use std::ops::ControlFlow;

use anyhow::{bail, Context, Result};
use clap::Args;
use qmk_engine::{Backend, Engine, StopReason};
use qmk_model::chat::Message;

use crate::common::{
    choose_target, engine_error, open_backend, stats_line, Model, ModelArgs, RunArgs, SamplingArgs,
};
use crate::ui::Ui;

/// Default context of a chat session (capped by the model's own limit).
const DEFAULT_CONTEXT: usize = 8192;

/// Chat with a model interactively (one line per message; /reset, /exit).
#[derive(Debug, Clone, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// System message (default: the chat template's own).
    #[arg(long)]
    pub system: Option<String>,

    #[command(flatten)]
    pub sampling: SamplingArgs,

    #[command(flatten)]
    pub run: RunArgs,
}

pub fn run(args: ChatArgs) -> Result<()> {
    run_inner(args).map_err(crate::common::one_line)
}

fn run_inner(args: ChatArgs) -> Result<()> {
    let ui = Ui::new(args.run.quiet);
    args.sampling.sampling()?;
    let target = choose_target(args.run.backend, &ui)?;
    let model = Model::open(&args.model, &ui)?;
    let template = model.chat_template()?;
    let (model_max, max_name) = crate::common::model_context(&model.config);
    let capacity = match args.run.context {
        Some(0) => bail!("invalid value for --context: 0 (must be at least 1)"),
        Some(c) if c > model_max => {
            bail!("--context {c} exceeds the model's {max_name} ({model_max})")
        }
        Some(c) => c,
        None => model_max.min(DEFAULT_CONTEXT),
    };
    let backend = open_backend(&model, target, &args.run, capacity, &ui)?;
    // A GPU backend without --context takes the largest context that fits.
    let capacity = backend.capacity();
    let backend_name = backend.kind().name();
    let mut engine = Engine::new(backend, model.config.vocab_size);
    let base_opts = args.sampling.options(model.stop_ids())?;

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        ui.note(format!(
            "chatting with {} on the {backend_name} backend ({capacity} positions); /reset clears the history, /exit or Ctrl-D quits",
            model.name
        ));
    }
    let mut history: Vec<Message> = Vec::new();
    if let Some(sys) = &args.system {
        history.push(Message::system(sys.clone()));
    }
    let system_len = history.len();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout().lock();
    loop {
        if interactive {
            write!(out, "> ")?;
            out.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("cannot read from stdin")?;
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.truncate(system_len);
                ui.note("(history cleared)");
                continue;
            }
            _ => {}
        }
        history.push(Message::user(text));
        let prompt_ids = model.encode_chat(&template, &history)?;
        if prompt_ids.len() > capacity {
            history.pop();
            writeln!(
                out,
                "[context full: the conversation would be {} tokens but the context holds {capacity}; /reset to start a new one]",
                prompt_ids.len()
            )?;
            continue;
        }
        let room = capacity - prompt_ids.len() + 1;
        let mut opts = base_opts.clone();
        opts.max_new_tokens = opts.max_new_tokens.min(room);

        let mut dec = model.tokenizer.stream_decoder(true);
        let mut failure: Option<anyhow::Error> = None;
        let g = engine
            .generate(&prompt_ids, &opts, |tok| {
                let r = dec.push(tok).map_err(anyhow::Error::from).and_then(|t| {
                    if let Some(t) = t {
                        out.write_all(t.as_bytes())?;
                        out.flush()?;
                    }
                    Ok(())
                });
                match r {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => {
                        failure = Some(e);
                        ControlFlow::Break(())
                    }
                }
            })
            .map_err(engine_error)?;
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some(rest) = dec.flush()? {
            out.write_all(rest.as_bytes())?;
        }
        writeln!(out)?;
        let cut_by_context =
            g.stop == StopReason::Length && opts.max_new_tokens < base_opts.max_new_tokens;
        if cut_by_context {
            writeln!(
                out,
                "[context full: the reply was cut at {} tokens; /reset to start a new conversation]",
                g.output_ids.len()
            )?;
        }
        out.flush()?;
        if !ui.quiet() {
            eprintln!("{}", stats_line(&g, backend_name));
        }
        let reply = model.tokenizer.decode(&g.output_ids, true)?;
        history.push(Message::assistant(reply));
    }
    Ok(())
}
