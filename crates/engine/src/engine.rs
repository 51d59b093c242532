//! The decode loop, written once above every backend.

use std::ops::ControlFlow;
use std::time::Duration;

use crate::draft::{Drafter, PromptLookup};
use crate::sampling::Sampling;
use crate::speculative::{self, SpeculateMode, SpeculativeOptions, SpeculativeStats};
use crate::{Backend, EngineError};

/// What to generate and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate (the stop id, when one comes, included).
    pub max_new_tokens: usize,
    /// How each token is chosen from the logits.
    pub sampling: Sampling,
    /// Generation stops after emitting one of these (end-of-turn, end-of-text).
    pub stop_ids: Vec<u32>,
    /// Keep going past the stop ids (the golden tests do).
    pub ignore_eos: bool,
    /// Speculative decoding ([`crate::speculative`]): by default greedy
    /// requests speculate and sampled ones run plain steps; either way the
    /// output has the distribution plain decoding gives (greedy: the same
    /// ids).
    pub speculation: SpeculativeOptions,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 256,
            sampling: Sampling::greedy(),
            stop_ids: Vec::new(),
            ignore_eos: false,
            speculation: SpeculativeOptions::default(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop id was emitted (it is included in the output).
    Eos,
    /// `max_new_tokens` were produced.
    Length,
    /// The caller's callback asked to stop.
    Caller,
    /// The text contains one of the stop strings (see [`crate::text`]); the
    /// output ids end with the token that completed it.
    StopString,
}

impl StopReason {
    /// A short lowercase name for logs and JSON: `eos`, `length`, `caller`,
    /// `stop_string`.
    pub fn name(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length => "length",
            StopReason::Caller => "caller",
            StopReason::StopString => "stop_string",
        }
    }
}

/// The result of one `generate` call.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The prompt as given.
    pub prompt_ids: Vec<u32>,
    /// The generated tokens, in order.
    pub output_ids: Vec<u32>,
    /// Why generation ended.
    pub stop: StopReason,
    /// Time from the call to the first generated token (the prompt's steps).
    pub prefill: Duration,
    /// Time spent producing tokens after the first.
    pub decode: Duration,
    /// What speculation did (its mode is `Off` when plain steps ran).
    pub speculation: SpeculativeStats,
}

impl Generation {
    /// Decode rate over the tokens after the first (the first comes out of
    /// the prefill), or 0 when there were none.
    pub fn decode_tok_per_s(&self) -> f64 {
        let n = self.output_ids.len().saturating_sub(1);
        if n == 0 || self.decode.is_zero() {
            0.0
        } else {
            n as f64 / self.decode.as_secs_f64()
        }
    }
}

/// A backend plus the loop that drives it.
pub struct Engine<B: Backend> {
    backend: B,
    vocab_size: usize,
    /// The drafter of [`SpeculateMode::Draft`] (a draft model).
    drafter: Option<Box<dyn Drafter + Send>>,
    /// The drafter of [`SpeculateMode::Ngram`].
    lookup: PromptLookup,
}

impl<B: Backend> Engine<B> {
    /// An engine over `backend` for a model of `vocab_size` tokens (prompt
    /// ids at or past it are refused).
    pub fn new(backend: B, vocab_size: usize) -> Self {
        Engine {
            backend,
            vocab_size,
            drafter: None,
            lookup: PromptLookup::default(),
        }
    }

    /// Sets the drafter that [`SpeculateMode::Draft`] (and `Auto` for
    /// greedy requests) uses, e.g. a [`crate::draft::DraftModel`]; `None`
    /// removes it. `Send`, so an engine over a `Send` backend can still move
    /// to another thread.
    pub fn set_drafter(&mut self, drafter: Option<Box<dyn Drafter + Send>>) {
        self.drafter = drafter;
    }

    /// Whether a drafter is set ([`Engine::set_drafter`]).
    pub fn has_drafter(&self) -> bool {
        self.drafter.is_some()
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, for backend-specific calls between generations.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Gives the backend back.
    pub fn into_backend(self) -> B {
        self.backend
    }

    /// Checks a request before any device work: prompt, vocabulary, capacity,
    /// sampling values.
    pub fn check(&self, prompt: &[u32], opts: &GenerateOptions) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some((index, &id)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(EngineError::TokenOutOfVocab {
                index,
                id,
                vocab: self.vocab_size,
            });
        }
        opts.sampling.validate()?;
        opts.speculation.validate()?;
        opts.speculation
            .mode
            .resolve(&opts.sampling, self.has_drafter())?;
        // The last generated token is never fed back, so prompt + new - 1
        // positions are written; checked_add guards absurd requests.
        let needed = prompt
            .len()
            .checked_add(opts.max_new_tokens)
            .map(|n| n - 1)
            .unwrap_or(usize::MAX);
        let capacity = self.backend.capacity();
        if needed > capacity {
            return Err(EngineError::ContextFull {
                prompt: prompt.len(),
                new: opts.max_new_tokens,
                needed,
                capacity,
            });
        }
        Ok(())
    }

    /// Generates from `prompt` (token ids), calling `on_token` with each new
    /// id as soon as it is chosen; the callback may stop generation early
    /// (within one step: a verify's accepted tokens come one call each).
    /// `opts.speculation` says whether and how to speculate
    /// ([`crate::speculative`]).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation, EngineError> {
        self.check(prompt, opts)?;
        let mode = opts
            .speculation
            .mode
            .resolve(&opts.sampling, self.has_drafter())?;
        let drafter: Option<&mut (dyn Drafter + 'static)> = match mode {
            SpeculateMode::Ngram => Some(&mut self.lookup),
            SpeculateMode::Draft => self
                .drafter
                .as_deref_mut()
                .map(|d| d as &mut (dyn Drafter + 'static)),
            _ => None,
        };
        speculative::decode(&mut self.backend, drafter, mode, prompt, opts, on_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackendKind, StepOutput};

    /// A backend whose next token is a fixed function of the fed token, with
    /// logits that make that token the argmax.
    struct Fake {
        vocab: usize,
        cap: usize,
        fed: Vec<(u32, usize)>,
        last: u32,
        logits_calls: usize,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("fake failure")]
    struct FakeErr;

    impl Backend for Fake {
        type Error = FakeErr;
        fn kind(&self) -> BackendKind {
            BackendKind::Cpu
        }
        fn capacity(&self) -> usize {
            self.cap
        }
        fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, FakeErr> {
            if pos != self.fed.len() {
                return Err(FakeErr);
            }
            self.fed.push((token, pos));
            self.last = (token * 7 + 3) % self.vocab as u32;
            Ok(StepOutput { argmax: self.last })
        }
        fn logits(&mut self) -> Result<Vec<f32>, FakeErr> {
            self.logits_calls += 1;
            let mut l = vec![0.0; self.vocab];
            l[self.last as usize] = 100.0;
            // A close second, so that a penalty can change the pick.
            l[(self.last as usize + 1) % self.vocab] = 99.5;
            Ok(l)
        }
        fn reset(&mut self) -> Result<(), FakeErr> {
            self.fed.clear();
            Ok(())
        }
    }

    fn engine(cap: usize) -> Engine<Fake> {
        Engine::new(
            Fake {
                vocab: 50,
                cap,
                fed: vec![],
                last: 0,
                logits_calls: 0,
            },
            50,
        )
    }

    fn run(
        e: &mut Engine<Fake>,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<Generation, EngineError> {
        e.generate(prompt, opts, |_| ControlFlow::Continue(()))
    }

    #[test]
    fn an_engine_over_a_send_backend_is_send() {
        fn send<T: Send>() {}
        send::<Engine<crate::CpuBackend>>();
        send::<Engine<Fake>>();
    }

    #[test]
    fn feeds_positions_in_order_and_never_feeds_the_last_token() {
        let mut e = engine(64);
        let opts = GenerateOptions {
            max_new_tokens: 4,
            ..Default::default()
        };
        let g = run(&mut e, &[1, 2, 3], &opts).unwrap();
        // 3 -> 24 -> 21 -> 0 -> 3
        assert_eq!(g.output_ids, vec![24, 21, 0, 3]);
        let fed: Vec<_> = e.backend().fed.clone();
        assert_eq!(fed, vec![(1, 0), (2, 1), (3, 2), (24, 3), (21, 4), (0, 5)]);
        assert_eq!(g.stop, StopReason::Length);
    }

    #[test]
    fn stops_at_eos_unless_ignored() {
        let mut e = engine(64);
        let mut opts = GenerateOptions {
            max_new_tokens: 10,
            stop_ids: vec![21],
            ..Default::default()
        };
        let g = run(&mut e, &[3], &opts).unwrap();
        assert_eq!(g.output_ids, vec![24, 21]);
        assert_eq!(g.stop, StopReason::Eos);
        opts.ignore_eos = true;
        let g = run(&mut e, &[3], &opts).unwrap();
        assert_eq!(g.output_ids.len(), 10);
    }

    #[test]
    fn sampling_path_uses_logits_and_callback_can_stop() {
        let mut e = engine(64);
        let opts = GenerateOptions {
            max_new_tokens: 10,
            // The top token holds 0.65 of the mass at this temperature: top-p
            // 0.5 keeps only it, so the picks are known.
            sampling: Sampling {
                temperature: 0.8,
                top_p: 0.5,
                seed: 5,
                ..Sampling::greedy()
            },
            ..Default::default()
        };
        let mut seen = 0;
        let g = e
            .generate(&[3], &opts, |_| {
                seen += 1;
                if seen == 3 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
        assert_eq!(g.output_ids, vec![24, 21, 0]);
        assert_eq!(g.stop, StopReason::Caller);
    }

    #[test]
    fn bad_requests_are_refused_before_any_step() {
        let mut e = engine(8);
        let opts = GenerateOptions {
            max_new_tokens: 4,
            ..Default::default()
        };
        assert!(matches!(
            run(&mut e, &[], &opts),
            Err(EngineError::EmptyPrompt)
        ));
        let err = run(&mut e, &[1, 50], &opts).unwrap_err();
        assert!(
            matches!(
                err,
                EngineError::TokenOutOfVocab {
                    index: 1,
                    id: 50,
                    ..
                }
            ),
            "{err}"
        );
        // 6 prompt + 4 new - 1 = 9 positions > 8.
        let err = run(&mut e, &[1; 6], &opts).unwrap_err();
        assert!(err.to_string().contains("capacity of 8"), "{err}");
        // Exactly at capacity is fine.
        assert!(run(&mut e, &[1; 5], &opts).is_ok());
        let bad = GenerateOptions {
            sampling: Sampling {
                temperature: -1.0,
                ..Sampling::greedy()
            },
            ..opts.clone()
        };
        assert!(run(&mut e, &[1], &bad)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        let err = run(
            &mut e,
            &[1; 1],
            &GenerateOptions {
                max_new_tokens: usize::MAX,
                ..opts
            },
        )
        .unwrap_err();
        assert!(matches!(err, EngineError::ContextFull { .. }));
    }

    #[test]
    fn greedy_reads_logits_only_when_a_penalty_is_set() {
        let mut e = engine(64);
        let mut opts = GenerateOptions {
            max_new_tokens: 1,
            ..Default::default()
        };
        // Feeding 24 then 3 makes 24 the argmax; 24 is also in the prompt.
        let g = run(&mut e, &[24, 3], &opts).unwrap();
        assert_eq!(g.output_ids, vec![24]);
        assert_eq!(e.backend().logits_calls, 0, "greedy: the backend's pick");
        opts.sampling.repetition_penalty = 1.01;
        let g = run(&mut e, &[24, 3], &opts).unwrap();
        // 100 / 1.01 < 99.5: the penalised argmax is 25.
        assert_eq!(g.output_ids, vec![25]);
        assert_eq!(e.backend().logits_calls, 1);
        // Without 24 in the prompt the penalty changes nothing.
        let g = run(&mut e, &[3], &opts).unwrap();
        assert_eq!(g.output_ids, vec![24]);
    }

    #[test]
    fn frequency_penalty_counts_the_generated_tokens() {
        // From 3 the picks cycle 24, 21, 0, 3, 24 ... A frequency penalty of
        // 2 lowers 24's logit to 98 when it comes back (generated once):
        // its neighbour (99.5) wins, and the chain moves on from there.
        let mut e = engine(64);
        let mut opts = GenerateOptions {
            max_new_tokens: 6,
            ..Default::default()
        };
        let g = run(&mut e, &[3], &opts).unwrap();
        assert_eq!(g.output_ids, vec![24, 21, 0, 3, 24, 21]);
        opts.sampling.frequency_penalty = 2.0;
        let g = run(&mut e, &[3], &opts).unwrap();
        assert_eq!(g.output_ids, vec![24, 21, 0, 3, 25, 28]);
        // The prompt's 3 is not generated: no penalty on its first pick.
        assert_eq!(g.stop.name(), "length");
    }
}
