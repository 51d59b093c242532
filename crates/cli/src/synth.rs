//! `qwen-mk write-synthetic` (hidden): writes the synthetic weights of a
//! preset as a bf16 safetensors checkpoint directory, generated and written
//! block by block (memory stays at one block whatever the size), so the
//! file path of the streamed upload can be measured at real shapes without
//! a download: `qwen-mk bench --model DIR` reads it back.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use qmk_model::{Config, SyntheticSource};

use crate::ui::Ui;

#[derive(Args, Debug)]
pub struct WriteSyntheticArgs {
    /// Model shape: 0.5b, 1.5b, 3b, 7b, 14b, 32b, 72b.
    #[arg(long)]
    preset: String,
    /// The directory to write (created; existing files are overwritten).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Synthetic-weight seed (the default is `bench`'s, so both give the
    /// same weights).
    #[arg(long, default_value_t = 20261129)]
    seed: u64,
    /// Largest shard, GB of tensor data (Hugging Face shards at about 5).
    #[arg(long, default_value_t = 5.0)]
    shard_gb: f64,
    /// No progress bar.
    #[arg(long, short = 'q')]
    quiet: bool,
}

pub fn run(a: WriteSyntheticArgs) -> Result<()> {
    let ui = Ui::new(a.quiet);
    let config = Config::preset(&a.preset)?;
    let source = SyntheticSource::new(&config, a.seed)?;
    let total = qmk_model::weight_bytes(&config)?.total.0;
    let shard = (a.shard_gb > 0.0).then_some((a.shard_gb * 1e9) as u64);
    let bar = ui.bytes_bar(total, format!("writing {}", a.out.display()));
    let t = std::time::Instant::now();
    let written =
        qmk_model::write_synthetic_checkpoint(&a.out, &source, shard, &mut |b| bar.inc(b))
            .with_context(|| format!("writing the synthetic {} checkpoint", a.preset))?;
    bar.finish_and_clear();
    let s = t.elapsed().as_secs_f64();
    ui.note(format!(
        "{}: synthetic {} weights (seed {}), {:.2} GB of bf16 in {:.1} s ({:.2} GB/s)",
        a.out.display(),
        a.preset,
        a.seed,
        written as f64 / 1e9,
        s,
        written as f64 / 1e9 / s.max(1e-9)
    ));
    Ok(())
}
