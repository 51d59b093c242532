//! Text on top of the id-level decode loop: stop strings and streamed text
//! deltas, written once for every front end (the CLI, a server).
//!
//! - [`StopMatcher`] finds stop strings in text pushed piece by piece and
//!   holds back any tail that could still become one, so a streaming reader
//!   never sees part of a stop string.
//! - [`TextStream`] feeds generated ids through the tokenizer's incremental
//!   decoder ([`qmk_model::tokenizer::StreamDecoder`]) and a [`StopMatcher`]:
//!   ids in, final text deltas out.
//! - [`Engine::generate_text`] runs the decode loop with a [`TextStream`],
//!   calling back with each text delta and ending at a stop string
//!   ([`StopReason::StopString`]).
//!
//! As in vLLM and OpenAI's API, the stop string and everything after it are
//! not part of the returned text; the token that completed it is the last of
//! the output ids.

use std::ops::ControlFlow;

use qmk_model::tokenizer::{StreamDecoder, Tokenizer};

use crate::{Backend, Engine, EngineError, GenerateOptions, Generation, StopReason};

/// Most stop strings one request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Longest stop string, in bytes: the matcher's work per delta grows with
/// the square of it.
pub const MAX_STOP_BYTES: usize = 256;

/// Finds the first stop string in a text pushed in pieces.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released: a tail that is the start of some stop string.
    held: String,
    /// Index in `stops` of the one found.
    hit: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops` (none: never stops, holds nothing back). An
    /// empty string, more than [`MAX_STOP_STRINGS`] strings or one longer
    /// than [`MAX_STOP_BYTES`] is an [`EngineError::InvalidSampling`] for the
    /// field `stop`.
    pub fn new<S: Into<String>>(stops: impl IntoIterator<Item = S>) -> Result<Self, EngineError> {
        let stops: Vec<String> = stops.into_iter().map(Into::into).collect();
        let bad = |reason: String| EngineError::InvalidSampling {
            field: "stop",
            reason,
        };
        if stops.len() > MAX_STOP_STRINGS {
            return Err(bad(format!(
                "{} stop strings (at most {MAX_STOP_STRINGS})",
                stops.len()
            )));
        }
        if stops.iter().any(String::is_empty) {
            return Err(bad("an empty stop string".into()));
        }
        if let Some(s) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(bad(format!(
                "a stop string of {} bytes (at most {MAX_STOP_BYTES})",
                s.len()
            )));
        }
        Ok(StopMatcher {
            stops,
            held: String::new(),
            hit: None,
        })
    }

    /// Adds `delta` to the text; returns the part that is now final: all of
    /// it up to a stop string (which ends the text: later pushes return
    /// nothing), or all but a tail that may still grow into one.
    pub fn push(&mut self, delta: &str) -> String {
        if self.hit.is_some() {
            return String::new();
        }
        self.held.push_str(delta);
        // Any match starts inside `held`: released text never ends in the
        // start of a stop string.
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = first {
            self.hit = Some(i);
            self.held.truncate(at);
            return std::mem::take(&mut self.held);
        }
        let cut = self.held_back_from();
        let rest = self.held.split_off(cut);
        std::mem::replace(&mut self.held, rest)
    }

    /// Where the longest tail of `held` that is a proper start of some stop
    /// string begins (`held.len()` when there is none).
    fn held_back_from(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let earliest = self.held.len().saturating_sub(longest.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= earliest)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }

    /// Ends the text: returns whatever is still held back (it never became a
    /// stop string), or nothing after a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The stop string found, if any.
    pub fn stopped(&self) -> Option<&str> {
        self.hit.map(|i| self.stops[i].as_str())
    }

    /// The stop strings.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }
}

/// What one generated id adds to the text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextDelta {
    /// New final text (often empty: an incomplete character, or a tail held
    /// back as a possible stop string).
    pub text: String,
    /// A stop string ended the text with this id.
    pub stopped: bool,
}

/// Generated ids in, final text out: the tokenizer's incremental decoder
/// (special tokens skipped) followed by a [`StopMatcher`]. The concatenated
/// deltas, [`TextStream::finish`] included, are the returned text.
#[derive(Debug, Clone)]
pub struct TextStream {
    decoder: StreamDecoder,
    stops: StopMatcher,
    text: String,
}

impl TextStream {
    /// A stream over `tokenizer` ending at any of `stops`.
    pub fn new(tokenizer: &Tokenizer, stops: StopMatcher) -> Self {
        TextStream {
            decoder: tokenizer.stream_decoder(true),
            stops,
            text: String::new(),
        }
    }

    /// Adds one generated id. After a stop string every push is empty.
    pub fn push(&mut self, id: u32) -> Result<TextDelta, EngineError> {
        if self.stops.stopped().is_some() {
            return Ok(TextDelta {
                text: String::new(),
                stopped: true,
            });
        }
        let decoded = self.decoder.push(id).map_err(EngineError::detokenize)?;
        let text = decoded.map_or_else(String::new, |d| self.stops.push(&d));
        self.text.push_str(&text);
        Ok(TextDelta {
            text,
            stopped: self.stops.stopped().is_some(),
        })
    }

    /// Ends the text: what the decoder and the matcher still hold (an
    /// incomplete character decodes to U+FFFD, as a whole decode shows it).
    pub fn finish(&mut self) -> Result<String, EngineError> {
        let mut out = String::new();
        if self.stops.stopped().is_none() {
            if let Some(rest) = self.decoder.flush().map_err(EngineError::detokenize)? {
                out = self.stops.push(&rest);
            }
            out.push_str(&self.stops.finish());
        }
        self.text.push_str(&out);
        Ok(out)
    }

    /// All text released so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The stop string that ended the text, if any.
    pub fn stop_string(&self) -> Option<&str> {
        self.stops.stopped()
    }
}

impl<B: Backend> Engine<B> {
    /// [`Engine::generate`] with text: every generated id goes through
    /// `text`, and `on_text` gets its final delta, once per id (often empty:
    /// an incomplete character, or a tail held back as a possible stop
    /// string, so a caller can still stop within one step), then the rest
    /// from [`TextStream::finish`] when there is any. Generation ends at a stop string
    /// ([`StopReason::StopString`]), a stop id, the length limit, or when
    /// `on_text` breaks ([`StopReason::Caller`]). The text is
    /// [`TextStream::text`].
    pub fn generate_text(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        text: &mut TextStream,
        mut on_text: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        let mut failure = None;
        let mut caller_stop = false;
        let mut g = self.generate(prompt, opts, |id| match text.push(id) {
            Ok(d) => {
                if on_text(&d.text).is_break() {
                    caller_stop = true;
                    return ControlFlow::Break(());
                }
                if d.stopped {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            }
            Err(e) => {
                failure = Some(e);
                ControlFlow::Break(())
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        if text.stop_string().is_some() && !caller_stop {
            g.stop = StopReason::StopString;
        }
        let rest = text.finish()?;
        if !rest.is_empty() {
            // The run is over: a break here has nothing left to stop.
            let _ = on_text(&rest);
        }
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `pieces` one by one; returns what each push released, then
    /// what `finish` released.
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, Option<String>) {
        let mut m = StopMatcher::new(stops.iter().copied()).unwrap();
        let out = pieces.iter().map(|p| m.push(p)).collect();
        let rest = m.finish();
        (out, rest, m.stopped().map(String::from))
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_cut() {
        let (out, rest, hit) = run(
            &["</answer>"],
            &["The answer", " is 4</", "ans", "wer> and more"],
        );
        assert_eq!(out, ["The answer", " is 4", "", ""]);
        assert_eq!(rest, "");
        assert_eq!(hit.as_deref(), Some("</answer>"));
    }

    #[test]
    fn a_possible_start_is_held_back_then_released_when_it_is_not_one() {
        let (out, rest, hit) = run(&["STOP"], &["go ST", "O", "P?", "x"]);
        // "ST" and "STO" could start STOP; "STOP?" contains it.
        assert_eq!(out, ["go ", "", "", ""]);
        assert_eq!((rest.as_str(), hit.as_deref()), ("", Some("STOP")));
        let (out, rest, hit) = run(&["STOP"], &["go ST", "O", "NE"]);
        assert_eq!(out, ["go ", "", "STONE"]);
        assert_eq!((rest.as_str(), hit), ("", None));
        // Held at the end of the text: released by finish.
        let (out, rest, hit) = run(&["STOP"], &["a", "ST"]);
        assert_eq!(out, ["a", ""]);
        assert_eq!((rest.as_str(), hit), ("ST", None));
        // The whole concatenation is never changed when nothing matches.
        let pieces = ["S", "T", "S", "TO", "S", "STO", "x"];
        let (out, rest, _) = run(&["STOP"], &pieces);
        assert_eq!(out.concat() + &rest, pieces.concat());
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let (out, _, hit) = run(&["world", "lo w", "\n\n"], &["hello world"]);
        assert_eq!(out, ["hel"]);
        assert_eq!(hit.as_deref(), Some("lo w"));
        let (out, _, hit) = run(&["b", "a"], &["xxab"]);
        assert_eq!(out, ["xx"]);
        assert_eq!(hit.as_deref(), Some("a"));
        // Holding back serves the longest possible start over all stops.
        let (out, _, _) = run(&["abc", "bcd"], &["xab"]);
        assert_eq!(out, ["x"]);
    }

    #[test]
    fn a_stop_string_at_the_very_start_gives_no_text() {
        let (out, rest, hit) = run(&["<|"], &["<|", "im_end|>"]);
        assert_eq!(out, ["", ""]);
        assert_eq!((rest.as_str(), hit.as_deref()), ("", Some("<|")));
        let (out, _, hit) = run(&["Hello"], &["Hello"]);
        assert_eq!(out, [""]);
        assert!(hit.is_some());
    }

    #[test]
    fn unicode_is_held_and_cut_at_character_boundaries() {
        // "日本" is 6 bytes; the held tail must start at a char boundary.
        let (out, rest, hit) = run(&["日本語"], &["今日は日", "本", "語です"]);
        assert_eq!(out, ["今日は", "", ""]);
        assert_eq!((rest.as_str(), hit.as_deref()), ("", Some("日本語")));
        let (out, rest, _) = run(&["🦀!"], &["I like 🦀", "s"]);
        assert_eq!(out, ["I like ", "🦀s"]);
        assert_eq!(rest, "");
        let (out, _, hit) = run(&["é"], &["caf", "é au lait"]);
        assert_eq!(out, ["caf", ""]);
        assert_eq!(hit.as_deref(), Some("é"));
    }

    #[test]
    fn no_stop_strings_release_everything_at_once() {
        let (out, rest, hit) = run(&[], &["a", "b"]);
        assert_eq!(out, ["a", "b"]);
        assert_eq!((rest.as_str(), hit), ("", None));
    }

    #[test]
    fn bad_stop_lists_name_the_field() {
        for stops in [
            vec![String::new()],
            vec!["x".to_string(); MAX_STOP_STRINGS + 1],
            vec!["y".repeat(MAX_STOP_BYTES + 1)],
        ] {
            match StopMatcher::new(stops) {
                Err(e @ EngineError::InvalidSampling { field: "stop", .. }) => {
                    assert!(e.to_string().contains("stop"), "{e}")
                }
                other => panic!("expected InvalidSampling(stop), got {other:?}"),
            }
        }
        StopMatcher::new(vec!["z".repeat(MAX_STOP_BYTES); MAX_STOP_STRINGS]).unwrap();
    }

    fn tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/qwen-tokenizer");
        Tokenizer::from_dir(dir).unwrap()
    }

    /// Streams `ids`; returns the deltas (finish last) and the stream.
    fn stream(tok: &Tokenizer, stops: &[&str], ids: &[u32]) -> (Vec<String>, TextStream) {
        let mut s = TextStream::new(tok, StopMatcher::new(stops.iter().copied()).unwrap());
        let mut deltas = Vec::new();
        for &id in ids {
            let d = s.push(id).unwrap();
            deltas.push(d.text);
            if d.stopped {
                break;
            }
        }
        deltas.push(s.finish().unwrap());
        (deltas, s)
    }

    #[test]
    fn token_streams_equal_the_whole_decode_and_stop_across_tokens() {
        let tok = tokenizer();
        let text = "Hello, wörld! 日本語 and 🦀🦀 crabs.\nEND of it";
        let ids = tok.encode(text).unwrap();
        assert!(ids.len() > 8, "{ids:?}");
        // No stop strings: the deltas concatenate to the whole decode.
        let (deltas, s) = stream(&tok, &[], &ids);
        assert_eq!(deltas.concat(), tok.decode(&ids, true).unwrap());
        assert_eq!(s.text(), text);
        // A stop string spanning several tokens ("🦀🦀 cr" is more than one).
        let (deltas, s) = stream(&tok, &["🦀 cr"], &ids);
        assert_eq!(deltas.concat(), "Hello, wörld! 日本語 and 🦀");
        assert_eq!(s.text(), deltas.concat());
        assert_eq!(s.stop_string(), Some("🦀 cr"));
        // No delta ever shows a piece of the stop string.
        assert!(deltas.iter().all(|d| !d.contains("🦀 ")), "{deltas:?}");
        // At the very start, and a stop that never comes (held tail at the
        // end released by finish).
        let (deltas, _) = stream(&tok, &["Hello"], &ids);
        assert_eq!(deltas.concat(), "");
        let (deltas, s) = stream(&tok, &["of it!"], &ids);
        assert_eq!(deltas.concat(), text);
        assert_eq!(s.stop_string(), None);
        assert!(deltas.last().unwrap().ends_with("of it"), "{deltas:?}");
    }

    /// A backend that says `script` in order, whatever it is fed.
    struct Script {
        script: Vec<u32>,
        next: usize,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("never fails")]
    struct Never;

    impl Backend for Script {
        type Error = Never;
        fn kind(&self) -> crate::BackendKind {
            crate::BackendKind::Cpu
        }
        fn capacity(&self) -> usize {
            1024
        }
        fn step(&mut self, _token: u32, _pos: usize) -> Result<crate::StepOutput, Never> {
            let argmax = self.script[self.next % self.script.len()];
            self.next += 1;
            Ok(crate::StepOutput { argmax })
        }
        fn logits(&mut self) -> Result<Vec<f32>, Never> {
            unreachable!("greedy without a penalty never reads logits")
        }
        fn reset(&mut self) -> Result<(), Never> {
            self.next = 0;
            Ok(())
        }
    }

    /// Runs the engine over a backend that says `text`; returns the
    /// generation, the deltas the callback saw and the stream.
    fn generate(
        text: &str,
        stops: &[&str],
        mut on_delta: impl FnMut(&str) -> ControlFlow<()>,
    ) -> (Generation, Vec<String>, TextStream, Vec<u32>) {
        let tok = tokenizer();
        let script = tok.encode(text).unwrap();
        // The prompt's last step yields the first scripted id.
        let mut e = Engine::new(
            Script {
                script: script.clone(),
                next: 0,
            },
            tok.vocab_size(),
        );
        let opts = GenerateOptions {
            max_new_tokens: script.len(),
            ..GenerateOptions::default()
        };
        let mut stream = TextStream::new(&tok, StopMatcher::new(stops.iter().copied()).unwrap());
        let mut deltas = Vec::new();
        let g = e
            .generate_text(&[1], &opts, &mut stream, |d| {
                deltas.push(d.to_string());
                on_delta(d)
            })
            .unwrap();
        (g, deltas, stream, script)
    }

    #[test]
    fn generate_text_ends_at_a_stop_string_and_never_shows_part_of_it() {
        let text = "First line.\n\nSecond line, more words.";
        let (g, deltas, s, script) = generate(text, &["\n\nSec"], |_| ControlFlow::Continue(()));
        assert_eq!(g.stop, StopReason::StopString);
        assert_eq!(deltas.concat(), "First line.");
        assert_eq!(s.text(), "First line.");
        assert!(deltas.iter().all(|d| !d.contains('\n')), "{deltas:?}");
        // The output ends with the token that completed the stop string.
        let n = g.output_ids.len();
        assert!(n < script.len());
        assert_eq!(g.output_ids, script[..n]);
        let tok = tokenizer();
        assert!(tok.decode(&g.output_ids, true).unwrap().contains("\n\nSec"));
        assert!(!tok
            .decode(&g.output_ids[..n - 1], true)
            .unwrap()
            .contains("\n\nSec"));

        // No stop string met: the whole text, ended by length.
        let (g, deltas, s, _) = generate(text, &["zzz"], |_| ControlFlow::Continue(()));
        assert_eq!(g.stop, StopReason::Length);
        assert_eq!(deltas.concat(), text);
        assert_eq!(s.stop_string(), None);

        // The callback stops it: the caller's stop, not the stop string's.
        let (g, deltas, _, _) = generate(text, &["\n\nSec"], |_| ControlFlow::Break(()));
        assert_eq!(g.stop, StopReason::Caller);
        assert_eq!(deltas.len(), 1, "{deltas:?}");
    }
}
