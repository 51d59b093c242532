//! The server's log on stderr: one line per generation (id, prompt and
//! completion tokens, time to first token, tok/s) and per refused request;
//! `--quiet` silences those, never an engine failure.

use std::io::Write;

/// Where log lines go.
#[derive(Debug, Clone, Copy)]
pub struct Log {
    quiet: bool,
}

impl Log {
    /// A log that writes request lines unless `quiet`.
    pub fn new(quiet: bool) -> Self {
        Log { quiet }
    }

    /// A per-request line (silenced by `quiet`).
    pub fn line(&self, text: impl AsRef<str>) {
        if !self.quiet {
            Self::always(self, text);
        }
    }

    /// A line that is written even when quiet (engine failures).
    pub fn always(&self, text: impl AsRef<str>) {
        // A closed stderr must not take the server down.
        let _ = writeln!(std::io::stderr().lock(), "[serve] {}", text.as_ref());
    }
}
