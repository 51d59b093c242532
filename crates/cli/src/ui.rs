//! What the CLI shows on stderr besides errors: progress bars (downloads,
//! weight loading and upload, kernel compilation) and one-line notes.
//!
//! Bars are drawn only when stderr is a terminal and `--quiet` is off; notes
//! and the closing stats line are printed unless `--quiet`.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Debug, Clone, Copy)]
pub struct Ui {
    bars: bool,
    quiet: bool,
}

impl Ui {
    pub fn new(quiet: bool) -> Self {
        Ui {
            bars: !quiet && std::io::stderr().is_terminal(),
            quiet,
        }
    }

    /// A UI that shows nothing (library-style use, tests).
    #[allow(dead_code)]
    pub fn silent() -> Self {
        Ui {
            bars: false,
            quiet: true,
        }
    }

    pub fn quiet(&self) -> bool {
        self.quiet
    }

    /// A byte-count bar (download, upload, hashing); hidden when bars are off.
    /// `len` 0 means unknown until the first `set_length`.
    pub fn bytes_bar(&self, len: u64, msg: impl Into<String>) -> ProgressBar {
        if !self.bars {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:>24} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ({eta})",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.set_message(msg.into());
        bar
    }

    /// A spinner for a step of unknown length (loading weights, compiling
    /// the kernel); hidden when bars are off.
    pub fn spinner(&self, msg: impl Into<String>) -> ProgressBar {
        if !self.bars {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"),
        );
        bar.set_message(msg.into());
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// A one-line note on stderr, unless quiet (never fatal: see
    /// [`crate::output::eprint_line`]).
    pub fn note(&self, msg: impl AsRef<str>) {
        if !self.quiet {
            crate::output::eprint_line(msg.as_ref());
        }
    }
}
