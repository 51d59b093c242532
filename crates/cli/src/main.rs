//! `qwen-mk`: a thin command line over the engine. One module per command;
//! each exposes an `Args` struct (clap derive) and `run(args) ->
//! anyhow::Result<()>`. Errors print as one `error: ...` line, exit code 1.

mod backend;
mod bench;
mod chat;
mod common;
mod compile;
mod download;
mod generate;
mod gpu;
mod hub;
mod plan;
mod synth;
mod ui;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    Chat(chat::ChatArgs),
    /// Download a model from the Hugging Face Hub (checked) and print its directory.
    Download(download::DownloadArgs),
    /// Show every stacked weight tensor's layout and split plan.
    Plan(plan::PlanArgs),
    /// Decode speed of the megakernel vs the bandwidth floor (synthetic weights).
    Bench(bench::BenchArgs),
    /// Write the megakernel cubin for a model and GPU arch (for machines without NVRTC).
    Compile(compile::CompileArgs),
    /// Write a preset's synthetic weights as a safetensors checkpoint (for `bench --model`).
    #[command(hide = true)]
    WriteSynthetic(synth::WriteSyntheticArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Download(a) => download::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Compile(a) => compile::run(a),
        Command::WriteSynthetic(a) => synth::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` joins the context chain on one line.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
