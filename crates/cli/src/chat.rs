//! `qwen-mk chat`: an interactive multi-turn session. Each turn renders the
//! whole history through the model's chat template and generates the reply,
//! streamed. A conversation that outgrows the context gets a message, not a
//! crash; `/reset` starts over.
//!
//! Input: one line is one message; a line `"""` opens a multi-line message
//! that the next line `"""` closes (pasted code stays one message). Ctrl-C
//! during a reply stops the reply (the part shown stays in the
//! conversation); Ctrl-C at the prompt ends the session (exit 130), as
//! does the end of input (exit 0).

use std::io::{BufRead, IsTerminal, Read, Write};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use qmk_engine::{Backend, Engine, StopReason, TextStream};
use qmk_model::chat::Message;

use crate::common::{
    choose_target, engine_error, open_backend, session_context, stats_line, with_draft, Model,
    ModelArgs, RunArgs, SamplingArgs, SpeculateArgs, MAX_STDIN_BYTES,
};
use crate::output::{eprint_line, stdout_error};
use crate::ui::Ui;

/// The line that opens and closes a multi-line message.
pub const BLOCK_FENCE: &str = "\"\"\"";

/// Exit code of a session ended by Ctrl-C at the prompt (128 + SIGINT, the
/// shell's convention).
pub const EXIT_INTERRUPTED: i32 = 130;

/// Chat with a model interactively: one line per message, or a multi-line
/// message between two lines `"""`; /reset clears the history, /exit (or
/// the end of input, Ctrl-D) quits; Ctrl-C stops a reply, and at the prompt
/// quits.
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
    pub speculate: SpeculateArgs,

    #[command(flatten)]
    pub run: RunArgs,
}

/// Where the session is, for the Ctrl-C handler.
const AT_PROMPT: u8 = 0;
const REPLYING: u8 = 1;
const STOP_REPLY: u8 = 2;

/// What Ctrl-C does: during a reply it asks the decode loop to stop (it
/// checks between steps); at the prompt, or a second time before the reply
/// has stopped, it ends the program.
#[derive(Clone, Default)]
pub struct Interrupt(Arc<AtomicU8>);

impl Interrupt {
    /// Installs the process's Ctrl-C handler for this session.
    fn install() -> Result<Interrupt> {
        let i = Interrupt::default();
        let state = i.clone();
        ctrlc::set_handler(move || {
            if state.on_signal() {
                // At the prompt: end the session, on a fresh line. (The
                // main thread holds stdout's lock and flushes every write.)
                eprint_line("");
                std::process::exit(EXIT_INTERRUPTED);
            }
        })
        .context("cannot install the Ctrl-C handler")?;
        Ok(i)
    }

    /// Records a Ctrl-C; true when it should end the program (no reply is
    /// running, or one was already asked to stop).
    fn on_signal(&self) -> bool {
        self.0
            .compare_exchange(REPLYING, STOP_REPLY, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
    }

    fn start_reply(&self) {
        self.0.store(REPLYING, Ordering::SeqCst);
    }

    /// Ends a reply; true when Ctrl-C stopped it.
    fn end_reply(&self) -> bool {
        self.0.swap(AT_PROMPT, Ordering::SeqCst) == STOP_REPLY
    }

    /// Whether Ctrl-C asked the running reply to stop.
    fn stop_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst) == STOP_REPLY
    }
}

pub fn run(args: ChatArgs) -> Result<()> {
    let ui = Ui::new(args.run.quiet);
    args.sampling.check()?;
    args.speculate.check()?;
    let target = choose_target(args.run.backend, &ui)?;
    let model = Model::open(&args.model, &ui)?;
    let template = model.chat_template()?;
    let capacity = session_context(&model.config, args.run.context)?;
    // One seed for the session: each reply is reproducible with it.
    let mut base_opts = args.sampling.options(&model)?;
    base_opts.speculation = args.speculate.options();
    let stops = args.sampling.stop_matcher()?;
    // The draft model first: a GPU target may then take the memory left.
    let draft = args
        .speculate
        .open_draft(&model, &target, &args.run, capacity, &ui)?;
    let backend = open_backend(&model, target, &args.run, capacity, &ui)?;
    // A GPU backend without --context takes the largest context that fits.
    let capacity = backend.capacity();
    let backend_name = backend.kind().name();
    let mut engine = with_draft(Engine::new(backend, model.config.vocab_size), draft);
    let interrupt = Interrupt::install()?;

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        ui.note(format!(
            "chatting with {} on the {backend_name} backend ({capacity} positions); a line {BLOCK_FENCE} \
             opens and closes a multi-line message; /reset clears the history; Ctrl-C stops a \
             reply; /exit, Ctrl-D or Ctrl-C at the prompt quits",
            model.name
        ));
    }
    let mut history: Vec<Message> = Vec::new();
    if let Some(sys) = &args.system {
        history.push(Message::system(sys.clone()));
    }
    let system_len = history.len();
    let mut stdin = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    loop {
        let mut show_prompt = |cont: bool| -> Result<()> {
            if interactive {
                let p: &[u8] = if cont { b". " } else { b"> " };
                out.write_all(p)
                    .and_then(|()| out.flush())
                    .map_err(stdout_error)?;
            }
            Ok(())
        };
        let Some(entry) = read_entry(&mut stdin, &mut show_prompt)? else {
            break;
        };
        let text = match entry {
            Entry::Command(Command::Exit) => break,
            Entry::Command(Command::Reset) => {
                history.truncate(system_len);
                ui.note("(history cleared)");
                continue;
            }
            Entry::Message(text) => text,
        };
        history.push(Message::user(text));
        let prompt_ids = model.encode_chat(&template, &history)?;
        if prompt_ids.len() > capacity {
            history.pop();
            writeln!(
                out,
                "[context full: the conversation would be {} tokens but the context holds {capacity}; /reset to start a new one]",
                prompt_ids.len()
            )
            .map_err(stdout_error)?;
            continue;
        }
        let room = capacity - prompt_ids.len() + 1;
        let mut opts = base_opts.clone();
        opts.max_new_tokens = opts.max_new_tokens.min(room);

        let mut reply = TextStream::new(&model.tokenizer, stops.clone());
        let mut failure: Option<anyhow::Error> = None;
        interrupt.start_reply();
        let g = engine.generate_text(&prompt_ids, &opts, &mut reply, |delta| {
            if let Err(e) = out.write_all(delta.as_bytes()).and_then(|()| out.flush()) {
                failure = Some(stdout_error(e));
                return ControlFlow::Break(());
            }
            if interrupt.stop_requested() {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        let stopped = interrupt.end_reply();
        let g = g.map_err(engine_error)?;
        if let Some(e) = failure {
            return Err(e);
        }
        let mut tail = String::from("\n");
        let cut_by_context =
            g.stop == StopReason::Length && opts.max_new_tokens < base_opts.max_new_tokens;
        if cut_by_context {
            tail.push_str(&format!(
                "[context full: the reply was cut at {} tokens; /reset to start a new conversation]\n",
                g.output_ids.len()
            ));
        }
        out.write_all(tail.as_bytes())
            .and_then(|()| out.flush())
            .map_err(stdout_error)?;
        if stopped && g.stop == StopReason::Caller {
            ui.note("(reply stopped; what was shown stays in the conversation)");
        }
        if !ui.quiet() {
            let s = &opts.sampling;
            let seed = (!s.is_greedy()).then_some(s.seed);
            eprint_line(&stats_line(&g, backend_name, seed));
        }
        history.push(Message::assistant(reply.text()));
    }
    Ok(())
}

/// A session command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    /// `/exit` or `/quit`.
    Exit,
    /// `/reset`.
    Reset,
}

/// One thing typed at the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// A message to send (never empty or only blanks).
    Message(String),
    /// A command line.
    Command(Command),
}

/// The next entry of `input`, `None` at its end. A line is a message (its
/// blanks trimmed), a command (`/exit`, `/quit`, `/reset`) or, when blank,
/// nothing. A line [`BLOCK_FENCE`] (blanks around it allowed) opens a
/// multi-line message: every following line as typed, until a closing
/// fence line, is one message (commands inside are text). The end of input
/// inside a block sends what the block holds. A message is at most
/// [`MAX_STDIN_BYTES`]. `prompt(continued)` runs before each line is read.
fn read_entry(
    input: &mut impl BufRead,
    prompt: &mut impl FnMut(bool) -> Result<()>,
) -> Result<Option<Entry>> {
    loop {
        prompt(false)?;
        let Some(line) = read_line(input)? else {
            return Ok(None);
        };
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" => return Ok(Some(Entry::Command(Command::Exit))),
            "/reset" => return Ok(Some(Entry::Command(Command::Reset))),
            BLOCK_FENCE => {}
            _ => return Ok(Some(Entry::Message(text.to_string()))),
        }
        let mut lines: Vec<String> = Vec::new();
        let mut bytes = 0usize;
        loop {
            prompt(true)?;
            let Some(line) = read_line(input)? else {
                break;
            };
            if line.trim() == BLOCK_FENCE {
                break;
            }
            bytes += line.len() + 1;
            if bytes as u64 > MAX_STDIN_BYTES {
                bail!(
                    "a message on stdin is longer than {} MiB",
                    MAX_STDIN_BYTES >> 20
                );
            }
            lines.push(line);
        }
        let message = lines.join("\n");
        if !message.trim().is_empty() {
            return Ok(Some(Entry::Message(message)));
        }
    }
}

/// The next line of `input` without its line break, `None` at the end; a
/// line is at most [`MAX_STDIN_BYTES`] (an endless line is refused after
/// that much, not read until memory runs out).
fn read_line(input: &mut impl BufRead) -> Result<Option<String>> {
    let mut bytes = Vec::new();
    input
        .take(MAX_STDIN_BYTES + 1)
        .read_until(b'\n', &mut bytes)
        .context("cannot read from stdin")?;
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.len() as u64 > MAX_STDIN_BYTES {
        bail!(
            "a message on stdin is longer than {} MiB",
            MAX_STDIN_BYTES >> 20
        );
    }
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| anyhow!("a message on stdin is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_one_at_a_time_and_bounded() {
        let mut input = std::io::Cursor::new(b"one\r\ntwo\n\nlast".to_vec());
        let mut got = Vec::new();
        while let Some(l) = read_line(&mut input).unwrap() {
            got.push(l);
        }
        assert_eq!(got, ["one", "two", "", "last"]);
        // An endless line: refused after the cap, not read to the end.
        let mut endless = std::io::BufReader::new(std::io::repeat(b'x'));
        let e = read_line(&mut endless).unwrap_err().to_string();
        assert!(e.contains("longer than 64 MiB"), "{e}");
        let mut bad = std::io::Cursor::new(vec![0xff, b'\n']);
        assert!(read_line(&mut bad)
            .unwrap_err()
            .to_string()
            .contains("UTF-8"));
    }

    fn entries(text: &str) -> Vec<Entry> {
        let mut input = std::io::Cursor::new(text.as_bytes().to_vec());
        let mut prompts = 0;
        let mut got = Vec::new();
        while let Some(e) = read_entry(&mut input, &mut |_| {
            prompts += 1;
            Ok(())
        })
        .unwrap()
        {
            got.push(e);
        }
        got
    }

    fn msg(s: &str) -> Entry {
        Entry::Message(s.to_string())
    }

    #[test]
    fn one_line_one_message_and_commands() {
        assert_eq!(
            entries("  hello  \n\n   \n/reset\nbye\r\n/quit\n/exit"),
            [
                msg("hello"),
                Entry::Command(Command::Reset),
                msg("bye"),
                Entry::Command(Command::Exit),
                Entry::Command(Command::Exit),
            ]
        );
        assert_eq!(entries(""), []);
    }

    #[test]
    fn a_fenced_block_is_one_message_kept_as_typed() {
        let code = "fn main() {\n    println!(\"hi\");\n\n}";
        let text = format!("Explain this:\n\"\"\"\n{code}\n\"\"\"\nthanks\n");
        assert_eq!(
            entries(&text),
            [msg("Explain this:"), msg(code), msg("thanks")]
        );
        // Commands and blank lines inside a block are text; fences may carry
        // blanks around them; CRLF line ends are taken off.
        assert_eq!(
            entries("  \"\"\"  \r\n/reset\r\n\r\n/exit\r\n\"\"\" \r\n/exit\n"),
            [msg("/reset\n\n/exit"), Entry::Command(Command::Exit)]
        );
        // A fence that is not alone on its line is text.
        assert_eq!(entries("say \"\"\" ok\n"), [msg("say \"\"\" ok")]);
        // An empty block sends nothing; the end of input inside a block
        // sends what it holds.
        assert_eq!(entries("\"\"\"\n\n\"\"\"\nnext\n"), [msg("next")]);
        assert_eq!(
            entries("\"\"\"\nline one\nline two"),
            [msg("line one\nline two")]
        );
    }

    #[test]
    fn a_block_prompts_for_each_continued_line() {
        let mut input = std::io::Cursor::new(b"\"\"\"\na\nb\n\"\"\"\n".to_vec());
        let mut seen = Vec::new();
        let e = read_entry(&mut input, &mut |cont| {
            seen.push(cont);
            Ok(())
        })
        .unwrap();
        assert_eq!(e, Some(msg("a\nb")));
        assert_eq!(seen, [false, true, true, true]);
    }

    /// Endless input of 1 MiB lines.
    struct MiBLines(usize);

    impl Read for MiBLines {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            for b in buf.iter_mut() {
                self.0 += 1;
                *b = if self.0 % (1 << 20) == 0 { b'\n' } else { b'x' };
            }
            Ok(buf.len())
        }
    }

    #[test]
    fn an_endless_block_is_refused_after_the_cap() {
        let fence = std::io::Cursor::new(b"\"\"\"\n".to_vec());
        let mut input = std::io::BufReader::new(fence.chain(MiBLines(0)));
        let e = read_entry(&mut input, &mut |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("longer than 64 MiB"), "{e}");
    }

    #[test]
    fn ctrl_c_stops_a_reply_and_ends_the_session_at_the_prompt() {
        let i = Interrupt::default();
        // At the prompt: the program ends.
        assert!(i.on_signal());
        i.start_reply();
        assert!(!i.stop_requested());
        // During a reply: the reply is asked to stop, the program goes on.
        assert!(!i.on_signal());
        assert!(i.stop_requested());
        assert!(i.end_reply(), "the reply was stopped");
        assert!(!i.stop_requested());
        i.start_reply();
        assert!(!i.end_reply(), "a reply nobody stopped");
        assert!(i.on_signal(), "back at the prompt");
        // A second Ctrl-C before a reply has stopped ends the program (a
        // long prefill only checks at its first token).
        i.start_reply();
        assert!(!i.on_signal());
        assert!(i.on_signal());
    }
}
