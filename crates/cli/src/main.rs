//! `qwen-mk`: a thin command line over the engine. One module per command;
//! each exposes an `Args` struct (clap derive) and `run(args) ->
//! anyhow::Result<()>`. Errors print as one `error: ...` line; the exit
//! codes are in [`output`].

mod backend;
mod bench;
mod chat;
mod common;
mod compile;
mod download;
mod generate;
mod gpu;
mod hub;
mod output;
mod plan;
mod serve;
mod spec_bench;
mod synth;
mod ui;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "qwen-mk", version, about = "Qwen2.5 decode megakernel engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for a prompt.
    Generate(generate::GenerateArgs),
    /// Chat interactively, or over stdin.
    ///
    /// One line is one message; a line `"""` opens a multi-line message
    /// that the next line `"""` closes (pasted code stays one message).
    /// /reset clears the history; /exit or Ctrl-D quits. Ctrl-C stops a
    /// reply (the part shown stays in the conversation); at the prompt it
    /// quits (exit code 130).
    Chat(chat::ChatArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Download a model from the Hugging Face Hub (checked) and print its directory.
    Download(download::DownloadArgs),
    /// Show every stacked weight tensor's layout and split plan.
    Plan(plan::PlanArgs),
    /// Decode speed of the megakernel vs the bandwidth floor (synthetic
    /// weights), or plain vs speculative decoding on given prompts (--prompts).
    Bench(bench::BenchArgs),
    /// Write the megakernel cubin for a model and GPU arch (for machines without NVRTC).
    Compile(compile::CompileArgs),
    /// Write a preset's synthetic weights as a safetensors checkpoint (for `bench --model`).
    #[command(hide = true)]
    WriteSynthetic(synth::WriteSyntheticArgs),
}

fn main() -> ExitCode {
    quiet_template_engine_panics();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return output::parse_failed(e, &Cli::command()),
    };
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Download(a) => download::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Compile(a) => compile::run(a),
        Command::WriteSynthetic(a) => synth::run(a),
    };
    output::finish(result)
}

/// The chat-template library turns a panic inside the template engine
/// (minijinja, on a hostile template) into an error, which the user sees as
/// one line; the default hook would print the panic on stderr first. Any
/// other panic is reported as usual.
fn quiet_template_engine_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let in_engine = info
            .location()
            .is_some_and(|l| l.file().contains("minijinja"));
        if !in_engine {
            default(info);
        }
    }));
}
