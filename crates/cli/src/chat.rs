//! `qwen-mk chat`: an interactive multi-turn session. Each turn renders the
//! whole history through the model's chat template and generates the reply,
//! streamed. A conversation that outgrows the context gets a message, not a
//! crash; `/reset` starts over.

use std::io::{BufRead, IsTerminal, Read, Write};
use std::ops::ControlFlow;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use qmk_engine::{Backend, Engine, StopReason};
use qmk_model::chat::Message;

use crate::common::{
    choose_target, engine_error, open_backend, session_context, stats_line, Model, ModelArgs,
    RunArgs, SamplingArgs, MAX_STDIN_BYTES,
};
use crate::output::{eprint_line, stdout_error};
use crate::ui::Ui;

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
    let ui = Ui::new(args.run.quiet);
    args.sampling.sampling()?;
    let target = choose_target(args.run.backend, &ui)?;
    let model = Model::open(&args.model, &ui)?;
    let template = model.chat_template()?;
    let capacity = session_context(&model.config, args.run.context)?;
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
    let mut stdin = std::io::stdin().lock();
    let mut out = std::io::stdout().lock();
    loop {
        if interactive {
            out.write_all(b"> ")
                .and_then(|()| out.flush())
                .map_err(stdout_error)?;
        }
        let Some(line) = read_line(&mut stdin)? else {
            break;
        };
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
            )
            .map_err(stdout_error)?;
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
                        out.write_all(t.as_bytes())
                            .and_then(|()| out.flush())
                            .map_err(stdout_error)?;
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
        let mut tail = dec.flush()?.unwrap_or_default();
        tail.push('\n');
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
        if !ui.quiet() {
            eprint_line(&stats_line(&g, backend_name));
        }
        let reply = model.tokenizer.decode(&g.output_ids, true)?;
        history.push(Message::assistant(reply));
    }
    Ok(())
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
}
