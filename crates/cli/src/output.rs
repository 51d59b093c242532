//! What the CLI writes to stdout and stderr, and how a run ends.
//!
//! Exit codes (the README's table):
//! - 0: success, and also a stdout whose reader went away (`| head`): the
//!   run ends quietly at the first write that fails with a broken pipe;
//! - 1: any other error, one `error: ...` line on stderr (a stdout that
//!   cannot be written, e.g. a full disk, included);
//! - 2: a usage error: the command line alone is wrong (an unknown or missing
//!   flag, a value of the wrong type or outside the flag's range), one
//!   `error: ...` line naming the flag, before anything is read or loaded.
//!
//! Nothing here panics on a failed write (the `print!` family does): stderr
//! carries notes and the error line on a best-effort basis (a message that
//! cannot be written is dropped, the exit code still tells), and a failed
//! stdout write ends the run as above.

use std::io::{self, Write};
use std::process::ExitCode;

/// Exit code of an error while running.
pub const EXIT_ERROR: u8 = 1;
/// Exit code of a usage error (the argument parser's convention).
pub const EXIT_USAGE: u8 = 2;

/// A write to stdout failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to stdout: {0}")]
pub struct StdoutError(pub io::Error);

/// The command line alone is wrong (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A usage error with `msg` (which names the flag).
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// A failed stdout write, as the error that ends the run.
pub fn stdout_error(e: io::Error) -> anyhow::Error {
    StdoutError(e).into()
}

/// Writes `text` to stdout and flushes it.
pub fn print(text: &str) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(stdout_error)
}

/// `text` and a newline on stderr, in one write; a failed write is dropped.
pub fn eprint_line(text: &str) {
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    line.push('\n');
    let _ = io::stderr().lock().write_all(line.as_bytes());
}

/// Ends a command that returned `result` (see the module docs).
pub fn finish(result: anyhow::Result<()>) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    let (code, line) = verdict(&e);
    if let Some(line) = line {
        eprint_line(&line);
    }
    ExitCode::from(code)
}

/// The exit code of error `e` and the line to show, if any.
fn verdict(e: &anyhow::Error) -> (u8, Option<String>) {
    let stdout = e.chain().find_map(|c| c.downcast_ref::<StdoutError>());
    if stdout.is_some_and(|s| s.0.kind() == io::ErrorKind::BrokenPipe) {
        return (0, None);
    }
    let usage = e.chain().any(|c| c.is::<UsageError>());
    let code = if usage { EXIT_USAGE } else { EXIT_ERROR };
    (code, Some(format!("error: {}", one_line(e))))
}

/// Ends a run whose command line did not parse (`cli` is the whole
/// command): help and version go to stdout (exit 0); anything else is a
/// usage error on one line.
pub fn parse_failed(e: clap::Error, cli: &clap::Command) -> ExitCode {
    use clap::error::ErrorKind;
    let line = match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            return finish(e.print().map_err(stdout_error));
        }
        // No command at all: the parser would print the whole help.
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let names: Vec<&str> = cli.get_subcommands().map(|c| c.get_name()).collect();
            format!(
                "no command given: use one of {} (see `{} --help`)",
                names.join(", "),
                cli.get_name()
            )
        }
        _ => parser_line(&e.render().to_string()),
    };
    eprint_line(&format!("error: {}", clean(&line)));
    ExitCode::from(EXIT_USAGE)
}

/// The argument parser's message (several lines: the error, tips, possible
/// values, a usage line) as one line: the error and what qualifies it, the
/// usage and help pointers dropped.
fn parser_line(text: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with("Usage:") || l.starts_with("For more information") {
            break;
        }
        if l.is_empty() {
            continue;
        }
        let l = l.strip_prefix("error:").map_or(l, str::trim_start);
        parts.push(if l.starts_with("tip:") {
            format!("({l})")
        } else {
            l.to_string()
        });
    }
    parts.join(" ")
}

/// An error and its causes as one line without repeats (library errors
/// often print their source inside their own message too).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if line.contains(&t) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&t);
    }
    clean(&line)
}

/// `text` on one line: a line break or tab and the blanks around it become
/// one space; other control characters (a terminal escape sent by a server)
/// are shown escaped.
fn clean(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    let mut broken = false;
    for c in text.trim().chars() {
        if matches!(c, '\n' | '\r' | '\t') || (broken && c == ' ') {
            if !broken {
                s.truncate(s.trim_end_matches(' ').len());
                s.push(' ');
            }
            broken = true;
            continue;
        }
        broken = false;
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_messages_become_one_line() {
        let text = "error: unexpected argument '--top' found\n\n  tip: a similar argument \
                    exists: '--top-k'\n\nUsage: qwen-mk generate --model <HUB_ID|DIR>\n\n\
                    For more information, try '--help'.\n";
        assert_eq!(
            parser_line(text),
            "unexpected argument '--top' found (tip: a similar argument exists: '--top-k')"
        );
        let text = "error: invalid value 'x' for '--backend <BACKEND>'\n  [possible values: \
                    auto, cpu]\n\nFor more information, try '--help'.\n";
        assert_eq!(
            parser_line(text),
            "invalid value 'x' for '--backend <BACKEND>' [possible values: auto, cpu]"
        );
    }

    #[test]
    fn errors_become_one_clean_line() {
        let e = anyhow::anyhow!("b: c").context("a");
        assert_eq!(one_line(&e.context("top")), "top: a: b: c");
        assert_eq!(clean("x \n\n  y\tz\u{1b}[2J"), "x y z\\u{1b}[2J");
    }

    #[test]
    fn a_broken_stdout_pipe_ends_quietly_other_write_errors_do_not() {
        let pipe = stdout_error(io::Error::from(io::ErrorKind::BrokenPipe));
        assert_eq!(verdict(&pipe.context("writing")), (0, None));
        let full = verdict(&stdout_error(io::Error::from_raw_os_error(28)));
        assert_eq!(full.0, EXIT_ERROR);
        assert!(full
            .1
            .unwrap()
            .starts_with("error: cannot write to stdout: "));
        let usage = verdict(&usage("--x 3: not in 0..=2").context("parsing"));
        assert_eq!(
            usage,
            (
                EXIT_USAGE,
                Some("error: parsing: --x 3: not in 0..=2".into())
            )
        );
        // A broken pipe elsewhere (a socket) is an error like any other.
        let other = anyhow::Error::from(io::Error::from(io::ErrorKind::BrokenPipe));
        assert_eq!(verdict(&other).0, EXIT_ERROR);
        assert_eq!(finish(Ok(())), ExitCode::SUCCESS);
    }
}
