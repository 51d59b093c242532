//! Greedy speculative decoding: a [`Drafter`] guesses the next tokens, one
//! multi-token step ([`Backend::step_many`]) checks the last accepted token
//! and the guesses together, and the agreed prefix plus the model's own next
//! token are kept. A multi-token step gives each position the logits `T`
//! single steps would (bit for bit), so the output is exactly plain greedy
//! decoding's; only the number of steps changes.
//!
//! When it runs plain steps instead (the adaptive rule): a verify of `k`
//! drafted tokens costs `1 + k·c` single steps, where `c` is
//! [`SpeculativeOptions::position_cost`] (by default the backend's
//! [`Backend::step_many_position_cost`]), and yields `E(k) = 1 + a + … + aᵏ`
//! tokens on average if each guess holds with probability `a` (given the
//! ones before it held). Before each step the loop picks the `k` in
//! `0..=max_draft` with the most tokens per unit of cost, `E(k) / (1 + k·c)`;
//! `k = 0` is a plain step. The estimate of `a` is
//! `(accepted + 0.8) / (accepted + rejected + 1)` over counts that decay by
//! [`DECAY`] every step (a verify whose guesses were not all kept counts one
//! rejection): an optimistic prior worth one observation, so speculation
//! starts at once; a bad stretch turns it off, and as that evidence fades
//! over plain steps the loop tries again (sooner when verifies are cheap). With `c = 1`, what the
//! default `step_many` (one single step per position) costs, no `k > 0`
//! ever pays and the loop runs plain steps.

use std::ops::ControlFlow;

use crate::draft::Drafter;
use crate::engine::StopReason;
use crate::{Backend, EngineError, MultiStep, MAX_STEP_TOKENS};

/// Weight that the acceptance counts keep per step.
pub const DECAY: f64 = 0.95;

/// What to generate, when to stop, and how hard to speculate.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeOptions {
    /// Most tokens to generate (the stop id, when one comes, included).
    pub max_new_tokens: usize,
    /// Generation stops after emitting one of these.
    pub stop_ids: Vec<u32>,
    /// Most drafted tokens per verify, `1..MAX_STEP_TOKENS` (the verify
    /// step also carries the last accepted token).
    pub max_draft: usize,
    /// Cost of each position after the first in a multi-token step, as a
    /// fraction of a single step (finite, `>= 0`): what the adaptive rule
    /// weighs acceptance against. `None`: the backend's own
    /// ([`Backend::step_many_position_cost`]).
    pub position_cost: Option<f64>,
    /// Apply the adaptive rule (module docs). Off: every step drafts
    /// `max_draft` tokens whenever the drafter has a guess.
    pub adaptive: bool,
}

impl Default for SpeculativeOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            stop_ids: Vec::new(),
            max_draft: MAX_STEP_TOKENS - 1,
            position_cost: None,
            adaptive: true,
        }
    }
}

impl SpeculativeOptions {
    /// Rejects values that have no meaning, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !(1..MAX_STEP_TOKENS).contains(&self.max_draft) {
            return Err(EngineError::InvalidSpeculation {
                field: "max_draft",
                reason: format!(
                    "{} (must be in 1..={})",
                    self.max_draft,
                    MAX_STEP_TOKENS - 1
                ),
            });
        }
        if let Some(c) = self.position_cost {
            if !(c.is_finite() && c >= 0.0) {
                return Err(EngineError::InvalidSpeculation {
                    field: "position_cost",
                    reason: format!("{c} (must be finite and >= 0)"),
                });
            }
        }
        Ok(())
    }
}

/// What speculation did over one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// Backend calls after the prompt's prefill: plain steps and verifies.
    pub steps: usize,
    /// Of those, multi-token verify steps.
    pub verifies: usize,
    /// Positions those calls processed (a verify of `k` guesses: `k + 1`).
    pub positions: usize,
    /// Drafted tokens sent to verification.
    pub proposed: usize,
    /// Drafted tokens that the model agreed with.
    pub accepted: usize,
    /// Output tokens produced by the steps (all but the prefill's first).
    pub decoded: usize,
}

impl SpeculativeStats {
    /// Output tokens per backend call after the prefill (1 without
    /// speculation; 0 when no step ran).
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.decoded as f64 / self.steps as f64
        }
    }

    /// Fraction of drafted tokens accepted (0 when none was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// The result of one speculative generation.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeGeneration {
    /// The generated tokens, in order (the plain greedy output).
    pub output_ids: Vec<u32>,
    /// Why generation ended.
    pub stop: StopReason,
    /// What speculation did.
    pub stats: SpeculativeStats,
}

/// The adaptive rule's state: decayed counts of accepted guesses and of
/// rejections.
#[derive(Debug, Clone, Copy, Default)]
struct Acceptance {
    accepted: f64,
    rejected: f64,
}

impl Acceptance {
    /// Estimated chance that a guess holds, given the ones before it held.
    fn rate(&self) -> f64 {
        (self.accepted + 0.8) / (self.accepted + self.rejected + 1.0)
    }

    /// The number of guesses worth verifying (0: a plain step).
    fn best_draft(&self, max_draft: usize, cost: f64) -> usize {
        let a = self.rate();
        let (mut best, mut best_k) = (1.0, 0); // k = 0: one token per step
        let (mut expected, mut ak) = (1.0, 1.0);
        for k in 1..=max_draft {
            ak *= a;
            expected += ak;
            let per_cost = expected / (1.0 + k as f64 * cost);
            if per_cost > best {
                (best, best_k) = (per_cost, k);
            }
        }
        best_k
    }

    /// One step happened: `accepted` of `proposed` guesses held.
    fn record(&mut self, accepted: usize, proposed: usize) {
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.rejected = self.rejected * DECAY + f64::from(u8::from(accepted < proposed));
    }
}

/// Greedy decoding of `prompt` with speculation: resets `backend` and
/// `drafter`, prefills the prompt at position 0, then generates until a
/// stop id, `max_new_tokens` or the callback's `Break`. `on_token` sees each
/// output token in order as soon as it is accepted. The output ids equal
/// plain greedy decoding's ([`crate::Engine::generate`] with greedy
/// sampling); the positions written are the same too (at most
/// `prompt + max_new_tokens - 1`).
pub fn generate_greedy<B: Backend, D: Drafter + ?Sized>(
    backend: &mut B,
    drafter: &mut D,
    prompt: &[u32],
    opts: &SpeculativeOptions,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<SpeculativeGeneration, EngineError> {
    opts.validate()?;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let capacity = backend.capacity();
    let needed = prompt
        .len()
        .checked_add(opts.max_new_tokens)
        .map_or(usize::MAX, |n| n - 1);
    if needed > capacity {
        return Err(EngineError::ContextFull {
            prompt: prompt.len(),
            new: opts.max_new_tokens,
            needed,
            capacity,
        });
    }
    let name = backend.kind().name();
    let cost = opts
        .position_cost
        .unwrap_or_else(|| backend.step_many_position_cost());
    let err = |e: B::Error| EngineError::Backend {
        backend: name,
        source: Box::new(e),
    };

    let mut stats = SpeculativeStats::default();
    let mut out = Vec::with_capacity(opts.max_new_tokens);
    backend.reset().map_err(err)?;
    drafter.reset();
    if opts.max_new_tokens == 0 {
        return Ok(SpeculativeGeneration {
            output_ids: out,
            stop: StopReason::Length,
            stats,
        });
    }
    drafter.extend(prompt);
    let first = backend.prefill(prompt, 0).map_err(err)?.argmax;

    // Emits one token; says why to stop, if it is time.
    let mut emit = |tok: u32, out: &mut Vec<u32>| -> Option<StopReason> {
        out.push(tok);
        if on_token(tok).is_break() {
            Some(StopReason::Caller)
        } else if opts.stop_ids.contains(&tok) {
            Some(StopReason::Eos)
        } else if out.len() >= opts.max_new_tokens {
            Some(StopReason::Length)
        } else {
            None
        }
    };
    if let Some(stop) = emit(first, &mut out) {
        return Ok(SpeculativeGeneration {
            output_ids: out,
            stop,
            stats,
        });
    }
    drafter.extend(&[first]);

    let mut acceptance = Acceptance::default();
    let (mut last, mut pos) = (first, prompt.len()); // `last` is fed at `pos`
    let mut draft: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS);
    let mut run: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS); // [last, draft..]
    let mut new: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS);
    loop {
        // More than `remaining` tokens would write positions plain decoding
        // never writes (and may not fit the cache).
        let remaining = opts.max_new_tokens - out.len();
        let k = if opts.adaptive {
            acceptance.best_draft(opts.max_draft, cost)
        } else {
            opts.max_draft
        }
        .min(remaining - 1);
        draft.clear();
        if k > 0 {
            drafter.draft(k, &mut draft);
            draft.truncate(k);
        }
        new.clear();
        if draft.is_empty() {
            new.push(backend.step(last, pos).map_err(err)?.argmax);
            stats.positions += 1;
        } else {
            run.clear();
            run.push(last);
            run.extend_from_slice(&draft);
            let picks = backend
                .step_many(MultiStep::new(&run, pos, capacity)?)
                .map_err(err)?
                .argmax; // [k + 1]
            let agreed = draft.iter().zip(&picks).take_while(|(d, p)| d == p).count();
            new.extend_from_slice(&draft[..agreed]);
            new.push(picks[agreed]);
            stats.verifies += 1;
            stats.positions += run.len();
            stats.proposed += draft.len();
            stats.accepted += agreed;
        }
        stats.steps += 1;
        acceptance.record(new.len() - 1, draft.len());
        for &t in &new {
            stats.decoded += 1;
            if let Some(stop) = emit(t, &mut out) {
                return Ok(SpeculativeGeneration {
                    output_ids: out,
                    stop,
                    stats,
                });
            }
        }
        drafter.extend(&new);
        pos += new.len();
        last = *new.last().expect("a step yields at least one token");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use qmk_model::Weights;

    use super::*;
    use crate::draft::PromptLookup;
    use crate::{BackendKind, CpuBackend, Engine, GenerateOptions, MultiStepOutput, StepOutput};

    fn tiny(seed: u64) -> Arc<Weights> {
        let mut c = qmk_model::Config::preset("0.5b").unwrap();
        c.hidden_size = 64;
        c.intermediate_size = 96;
        c.num_hidden_layers = 2;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(16);
        c.vocab_size = 300;
        Arc::new(qmk_model::synthetic_weights(&c, seed))
    }

    fn plain(w: &Arc<Weights>, prompt: &[u32], n: usize, stop_ids: &[u32]) -> Vec<u32> {
        let cap = prompt.len() + n;
        let mut e = Engine::new(CpuBackend::new(w.clone(), cap).unwrap(), 300);
        let opts = GenerateOptions {
            max_new_tokens: n,
            stop_ids: stop_ids.to_vec(),
            ..Default::default()
        };
        e.generate(prompt, &opts, |_| ControlFlow::Continue(()))
            .unwrap()
            .output_ids
    }

    fn speculate(
        backend: &mut impl Backend,
        drafter: &mut (impl Drafter + ?Sized),
        prompt: &[u32],
        opts: &SpeculativeOptions,
    ) -> SpeculativeGeneration {
        generate_greedy(
            backend,
            drafter,
            prompt,
            opts,
            |_| ControlFlow::Continue(()),
        )
        .unwrap()
    }

    fn opts(n: usize, adaptive: bool) -> SpeculativeOptions {
        SpeculativeOptions {
            max_new_tokens: n,
            adaptive,
            ..Default::default()
        }
    }

    /// Deterministic pseudo-random prompt of `len` ids below 300.
    fn random_prompt(seed: u64, len: usize) -> Vec<u32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 300) as u32
            })
            .collect()
    }

    #[test]
    fn equals_plain_greedy_on_many_prompts() {
        let mut any_accepted = 0;
        for seed in [1u64, 2, 3] {
            let w = tiny(seed);
            let mut prompts: Vec<Vec<u32>> = (0..6)
                .map(|i| random_prompt(seed * 10 + i, 3 + 5 * i as usize))
                .collect();
            // Repetitive prompts, where lookup has something to copy.
            prompts.push([10u32, 20, 30, 40].repeat(6));
            prompts.push([7u32; 12].to_vec());
            let mut rep = random_prompt(seed, 9);
            rep.extend(rep.clone());
            prompts.push(rep);
            for (i, prompt) in prompts.iter().enumerate() {
                let n = 40;
                let want = plain(&w, prompt, n, &[]);
                for adaptive in [false, true] {
                    let mut b = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
                    let mut d = PromptLookup::default();
                    let got = speculate(&mut b, &mut d, prompt, &opts(n, adaptive));
                    assert_eq!(
                        got.output_ids, want,
                        "seed {seed} prompt {i} adaptive {adaptive}"
                    );
                    assert_eq!(got.stop, StopReason::Length);
                    let s = got.stats;
                    assert_eq!(s.decoded, n - 1);
                    assert!(s.accepted <= s.proposed && s.verifies <= s.steps);
                    assert_eq!(s.positions, s.steps + s.proposed);
                    if i >= 6 && !adaptive {
                        any_accepted += usize::from(s.accepted > 0);
                    }
                }
            }
        }
        // Greedy decoding of these random models falls into loops that the
        // lookup drafts: most repetitive runs accept something.
        assert!(
            any_accepted >= 6,
            "only {any_accepted} of 9 repetitive runs accepted a draft"
        );
    }

    /// Guesses from a known answer, wrong from a given point on.
    struct Oracle {
        answer: Vec<u32>,
        prompt_len: usize,
        seen: usize,
        wrong_after: usize,
    }

    impl Drafter for Oracle {
        fn reset(&mut self) {
            self.seen = 0;
        }
        fn extend(&mut self, tokens: &[u32]) {
            self.seen += tokens.len();
        }
        fn draft(&mut self, max: usize, out: &mut Vec<u32>) {
            out.clear();
            let at = self.seen - self.prompt_len;
            for i in at..(at + max).min(self.answer.len()) {
                let t = self.answer[i];
                out.push(if i >= self.wrong_after {
                    (t + 1) % 300
                } else {
                    t
                });
            }
        }
    }

    #[test]
    fn perfect_guesses_take_max_draft_plus_one_tokens_per_step() {
        let w = tiny(4);
        let prompt = random_prompt(99, 5);
        let n = 50;
        let want = plain(&w, &prompt, n, &[]);
        let mut d = Oracle {
            answer: want.clone(),
            prompt_len: prompt.len(),
            seen: 0,
            wrong_after: usize::MAX,
        };
        let mut b = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
        let mut o = opts(n, true);
        o.position_cost = Some(0.1);
        let got = speculate(&mut b, &mut d, &prompt, &o);
        assert_eq!(got.output_ids, want);
        let s = got.stats;
        assert_eq!(s.accepted, s.proposed);
        // 49 tokens after the prefill's: the rule ramps up from its 0.8 prior,
        // then runs 8 tokens per step.
        assert!(s.steps <= 12, "{s:?}");
        assert!(s.tokens_per_step() > 4.0, "{s:?}");
    }

    #[test]
    fn wrong_guesses_turn_speculation_off_and_it_is_retried() {
        let w = tiny(5);
        let prompt = random_prompt(7, 6);
        let n = 120;
        let want = plain(&w, &prompt, n, &[]);
        let oracle = |wrong_after| Oracle {
            answer: want.clone(),
            prompt_len: prompt.len(),
            seen: 0,
            wrong_after,
        };
        // Always wrong: without the rule every step verifies; with it, few.
        let mut b = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
        let eager = speculate(&mut b, &mut oracle(0), &prompt, &opts(n, false));
        let careful = speculate(&mut b, &mut oracle(0), &prompt, &opts(n, true));
        assert_eq!(eager.output_ids, want);
        assert_eq!(careful.output_ids, want);
        // (The last step has one token left to make: nothing to guess.)
        assert_eq!(eager.stats.verifies, eager.stats.steps - 1);
        assert_eq!(eager.stats.accepted, 0);
        assert!(
            careful.stats.verifies * 4 <= careful.stats.steps,
            "{:?}",
            careful.stats
        );
        // Retried: a few probes happen over a long run.
        assert!(careful.stats.verifies >= 3, "{:?}", careful.stats);
        // Right for the first 60 tokens, then wrong: the rule speculates
        // early and backs off late.
        let mixed = speculate(&mut b, &mut oracle(60), &prompt, &opts(n, true));
        assert_eq!(mixed.output_ids, want);
        assert!(mixed.stats.accepted >= 40, "{:?}", mixed.stats);
        // A verify at full price never pays: plain steps only.
        let mut o = opts(n, true);
        o.position_cost = Some(1.0);
        let priced = speculate(&mut b, &mut oracle(usize::MAX), &prompt, &o);
        assert_eq!(priced.output_ids, want);
        assert_eq!(priced.stats.verifies, 0);
        assert_eq!(priced.stats.steps, n - 1);
    }

    #[test]
    fn stops_where_plain_greedy_stops() {
        let w = tiny(6);
        let prompt = [10u32, 20, 30, 40].repeat(4);
        let n = 40;
        let all = plain(&w, &prompt, n, &[]);
        // Every distinct token of the output as a stop id in turn (some come
        // inside an accepted run of guesses).
        let mut ids = all.clone();
        ids.sort_unstable();
        ids.dedup();
        for &stop in &ids {
            let want = plain(&w, &prompt, n, &[stop]);
            let mut b = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
            let mut o = opts(n, false);
            o.stop_ids = vec![stop];
            let got = speculate(&mut b, &mut PromptLookup::default(), &prompt, &o);
            assert_eq!(got.output_ids, want, "stop id {stop}");
            assert_eq!(got.stop, StopReason::Eos);
            assert_eq!(*got.output_ids.last().unwrap(), stop);
        }
        // The callback stops it after exactly the tokens it saw.
        let mut b = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
        let mut seen = vec![];
        let got = generate_greedy(
            &mut b,
            &mut PromptLookup::default(),
            &prompt,
            &opts(n, false),
            |t| {
                seen.push(t);
                if seen.len() == 13 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            },
        )
        .unwrap();
        assert_eq!(got.stop, StopReason::Caller);
        assert_eq!(got.output_ids, all[..13]);
        assert_eq!(seen, all[..13]);
    }

    #[test]
    fn short_requests_and_an_exactly_full_cache() {
        let w = tiny(8);
        let prompt = [7u32; 6];
        for n in [0usize, 1, 2, 3, 9] {
            let want = plain(&w, &prompt, n.max(1), &[]);
            // prompt + n - 1 positions: the tightest cache plain decoding fits.
            let mut b =
                CpuBackend::new(w.clone(), (prompt.len() + n).saturating_sub(1).max(1)).unwrap();
            let got = speculate(
                &mut b,
                &mut PromptLookup::default(),
                &prompt,
                &opts(n, false),
            );
            assert_eq!(got.output_ids, want[..n], "n = {n}");
        }
    }

    #[test]
    fn bad_requests_are_named_errors() {
        let w = tiny(9);
        let mut b = CpuBackend::new(w, 16).unwrap();
        let mut d = PromptLookup::default();
        let run = |b: &mut CpuBackend, d: &mut PromptLookup, p: &[u32], o: &SpeculativeOptions| {
            generate_greedy(b, d, p, o, |_| ControlFlow::Continue(())).unwrap_err()
        };
        for (field, o) in [
            (
                "max_draft",
                SpeculativeOptions {
                    max_draft: 0,
                    ..opts(4, true)
                },
            ),
            (
                "max_draft",
                SpeculativeOptions {
                    max_draft: MAX_STEP_TOKENS,
                    ..opts(4, true)
                },
            ),
            (
                "position_cost",
                SpeculativeOptions {
                    position_cost: Some(f64::NAN),
                    ..opts(4, true)
                },
            ),
            (
                "position_cost",
                SpeculativeOptions {
                    position_cost: Some(-1.0),
                    ..opts(4, true)
                },
            ),
        ] {
            let e = run(&mut b, &mut d, &[1], &o);
            assert!(
                matches!(e, EngineError::InvalidSpeculation { field: f, .. } if f == field),
                "{e}"
            );
        }
        assert!(matches!(
            run(&mut b, &mut d, &[], &opts(4, true)),
            EngineError::EmptyPrompt
        ));
        assert!(matches!(
            run(&mut b, &mut d, &[1; 10], &opts(8, true)),
            EngineError::ContextFull {
                needed: 17,
                capacity: 16,
                ..
            }
        ));
        assert!(matches!(
            run(&mut b, &mut d, &[1, 300], &opts(4, true)),
            EngineError::Backend { backend: "cpu", .. }
        ));
    }

    /// The CPU backend with only the required methods: `step_many` is the
    /// trait's default, as on the GPU backends today.
    struct Stepwise(CpuBackend);

    impl Backend for Stepwise {
        type Error = qmk_model::ModelError;
        fn kind(&self) -> BackendKind {
            self.0.kind()
        }
        fn capacity(&self) -> usize {
            self.0.capacity()
        }
        fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, Self::Error> {
            self.0.step(token, pos)
        }
        fn logits(&mut self) -> Result<Vec<f32>, Self::Error> {
            self.0.logits()
        }
        fn reset(&mut self) -> Result<(), Self::Error> {
            self.0.reset()
        }
    }

    #[test]
    fn the_default_multi_step_gives_the_same_output() {
        let w = tiny(10);
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6].repeat(2);
        let n = 30;
        let want = plain(&w, &prompt, n, &[]);
        let mut b = Stepwise(CpuBackend::new(w.clone(), prompt.len() + n).unwrap());
        let got = speculate(
            &mut b,
            &mut PromptLookup::default(),
            &prompt,
            &opts(n, false),
        );
        assert_eq!(got.output_ids, want);
        assert!(got.stats.accepted > 0, "{:?}", got.stats);
        // Left to the rule, a backend whose positions cost full steps
        // never speculates.
        let plainly = speculate(
            &mut b,
            &mut PromptLookup::default(),
            &prompt,
            &opts(n, true),
        );
        assert_eq!(plainly.output_ids, want);
        assert_eq!((plainly.stats.verifies, plainly.stats.steps), (0, n - 1));
        // And the default's per-position output equals the CPU override's.
        let mut c = CpuBackend::new(w, 32).unwrap();
        let toks = [5u32, 6, 7, 8, 9];
        b.0.prefill(&[1, 2, 3], 0).unwrap();
        c.prefill(&[1, 2, 3], 0).unwrap();
        let run = |cap| MultiStep::new(&toks, 3, cap).unwrap().with_logits(true);
        let x: MultiStepOutput = b.step_many(run(b.capacity())).unwrap();
        let y = c.step_many(run(c.capacity())).unwrap();
        assert_eq!(x, y);
    }
}
