//! `qwen-mk download`: fetch (and check) a Hub model into the cache, print
//! its directory, and optionally copy it to a plain local directory (for
//! machines without network: copy that directory over and pass it to
//! `--model`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::common::ModelArgs;
use crate::output::print;
use crate::ui::Ui;

/// Download a model from the Hugging Face Hub (checked) and print its directory.
#[derive(Debug, Clone, Args)]
pub struct DownloadArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    /// Also copy the files into this directory (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// No progress bars or notes on stderr.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

pub fn run(args: DownloadArgs) -> Result<()> {
    let ui = Ui::new(args.quiet);
    let dir = crate::common::locate(&args.model.model, &args.model.revision, &ui)?;
    let Some(out) = args.out else {
        return print(&format!("{}\n", dir.display()));
    };
    if out.exists() && !out.is_dir() {
        bail!("--out {}: exists and is not a directory", out.display());
    }
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let list =
        |e: std::io::Error| anyhow::Error::new(e).context(format!("cannot list {}", dir.display()));
    for entry in std::fs::read_dir(&dir).map_err(list)? {
        let entry = entry.map_err(list)?;
        let src = entry.path();
        // Snapshot entries are links into the blob store: copy the bytes.
        if !src.is_file() {
            continue;
        }
        let dst = out.join(entry.file_name());
        std::fs::copy(&src, &dst)
            .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
    }
    print(&format!("{}\n", out.display()))
}
