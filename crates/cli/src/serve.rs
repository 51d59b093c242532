//! `qwen-mk serve`: the OpenAI-compatible HTTP server of `qmk-server`
//! over one engine, opened the way `generate` and `chat` open theirs.

use std::io::Write;
use std::sync::Arc;

use anyhow::Result;
use clap::Args;
use qmk_engine::Engine;
use qmk_server::{ModelInfo, Server, ServerConfig, DEFAULT_MAX_QUEUE};

use crate::common::{
    choose_target, open_backend, session_context, whole, with_draft, Model, ModelArgs, RunArgs,
    SpeculateArgs,
};
use crate::ui::Ui;

/// Serve the model over an OpenAI-compatible HTTP API.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000, allow_negative_numbers = true,
          value_parser = whole::<u16>(0..=u16::MAX as i64))]
    pub port: u16,

    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,

    /// The model name clients use (default: --model as given).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,

    /// Requests that may wait while one is generated; more are answered 429.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_QUEUE,
          allow_negative_numbers = true, value_parser = whole::<usize>(1..=4096))]
    pub max_queue: usize,

    #[command(flatten)]
    pub speculate: SpeculateArgs,

    // --quiet also silences the per-request log lines.
    #[command(flatten)]
    pub run: RunArgs,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let ui = Ui::new(args.run.quiet);
    args.speculate.check()?;
    let target = choose_target(args.run.backend, &ui)?;
    let model = Model::open(&args.model, &ui)?;
    let template = match model.chat_template() {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            ui.note(format!("{e:#}; only /v1/completions will work"));
            None
        }
    };
    let capacity = session_context(&model.config, args.run.context)?;
    let info = ModelInfo {
        name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| model.name.clone()),
        tokenizer: model.tokenizer.clone(),
        template,
        stop_ids: model.stop_ids(),
        vocab_size: model.config.vocab_size,
        sampling: qmk_engine::SamplingDefaults::from_generation_config(&model.generation),
        speculation: args.speculate.options(),
    };
    let config = ServerConfig {
        api_key: args.api_key.clone(),
        max_queue: args.max_queue,
        quiet: args.run.quiet,
        ..ServerConfig::default()
    };
    let run = args.run.clone();
    let speculate = args.speculate.clone();
    // The engine is opened on its own thread: a GPU context stays there.
    let server = Server::start(info, config, move || {
        // The draft model first: a GPU target may then take the memory left.
        let draft = speculate.open_draft(&model, &target, &run, capacity, &ui)?;
        let backend = open_backend(&model, target, &run, capacity, &ui)?;
        Ok(with_draft(
            Engine::new(backend, model.config.vocab_size),
            draft,
        ))
    })?;
    ui.note(format!(
        "context: {} positions (prompt plus completion)",
        server.capacity()
    ));
    let host = if args.host.contains(':') {
        format!("[{}]", args.host)
    } else {
        args.host.clone()
    };
    let addr = format!("{host}:{}", args.port);
    server.serve(&addr, |bound| {
        // The address on stdout, always: with --port 0 it is how a caller
        // learns the port.
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on http://{bound}").and_then(|()| out.flush());
    })?;
    Ok(())
}
