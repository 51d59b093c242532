//! Speculative decoding, a mode of [`crate::Engine::generate`]: a
//! [`Drafter`] guesses the next tokens, one multi-token step
//! ([`Backend::step_many`]) checks the last accepted token and the guesses
//! together, and the accepted prefix plus one token of the model's own are
//! kept.
//!
//! Greedy decoding keeps the guesses that equal the model's picks. A
//! multi-token step gives each position the logits `T` single steps would
//! (bit for bit), so the output is exactly plain greedy decoding's; only the
//! number of steps changes. With a penalty set, each position's pick is the
//! argmax of its logits penalised over the history plus the guesses before
//! it.
//!
//! Sampling (temperature > 0) uses the standard rejection rule over the
//! processed distribution `p` the plain sampler draws from (penalties with
//! the history plus the earlier accepted guesses, temperature, top-k, top-p,
//! min-p; [`crate::sampling`]). A guess `x` drafted from a distribution `q`
//! is accepted with probability `min(1, p(x) / q(x))`; on a rejection the
//! token is drawn from `max(0, p - q)` renormalised, and after the last
//! accepted guess one more token is drawn from `p`. A deterministic drafter
//! (prompt lookup) has a one-hot `q`: `x` is kept with probability `p(x)`,
//! else the token is drawn from `p` without `x`. Each output token then has
//! exactly the plain sampler's distribution; the random draws differ, so a
//! fixed seed gives other tokens than plain sampling does.
//!
//! When it runs plain steps instead (the adaptive rule): a verify of `k`
//! drafted tokens costs what the backend reports a step of `k + 1`
//! positions costs ([`Backend::step_many_cost`]: on a GPU, what each size
//! measured; or `1 + k·c` with [`SpeculativeOptions::position_cost`] `c`
//! when that is set), plus `k·d`, the drafter's own cost per guess (0 for
//! prompt lookup; for a drafter with a cost, [`Drafter::cost_per_token`]
//! (a draft model's weight-bytes ratio) until the generation has timed a
//! few drafts and steps, then their measured ratio), and yields
//! `E(k) = 1 + a + … + aᵏ` tokens on average if each guess holds with
//! probability `a` (given the ones before it held). Before each step the
//! loop asks the drafter which class its next draft is of
//! ([`Drafter::next_class`]; prompt lookup: the length of the matched
//! n-gram, as longer matches hold longer) and picks the `k` in
//! `0..=max_draft` with the most tokens per unit of cost for that class's
//! `a`; `k = 0` is a plain step. A class's estimate of `a` is `(accepted +
//! 0.8) / (accepted + rejected + 1)` over counts that decay by [`DECAY`]
//! every step of that class (a verify whose guesses were not all kept
//! counts one rejection): an optimistic prior worth one observation, so
//! speculation starts at once; a bad stretch turns it off, and as that
//! evidence fades over plain steps the loop tries again (sooner when
//! verifies are cheap). When every extra position costs a whole step, what
//! the default `step_many` (one single step per position) costs, no `k > 0`
//! ever pays and the loop runs plain steps.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::draft::{Drafter, DRAFT_CLASSES};
use crate::engine::{GenerateOptions, Generation, StopReason};
use crate::sampling::{apply_penalties, argmax, candidates, choose, Rng, Sampling, TokenHistory};
use crate::{Backend, EngineError, MultiStep, RunningMean, MAX_STEP_TOKENS};

/// Weight that a class's acceptance counts keep per step of that class.
pub const DECAY: f64 = 0.95;

/// Which drafter speculation uses (`--speculate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SpeculateMode {
    /// Greedy decoding speculates (with the engine's drafter when one is
    /// set, [`crate::Engine::set_drafter`], else prompt lookup); sampling
    /// runs plain steps.
    #[default]
    Auto,
    /// Prompt lookup ([`crate::draft::PromptLookup`]), greedy or sampling.
    Ngram,
    /// The engine's drafter (a draft model), greedy or sampling.
    Draft,
    /// Plain steps only.
    Off,
}

impl SpeculateMode {
    /// The name the command line and JSON use: `auto`, `ngram`, `draft`,
    /// `off`.
    pub fn name(self) -> &'static str {
        match self {
            SpeculateMode::Auto => "auto",
            SpeculateMode::Ngram => "ngram",
            SpeculateMode::Draft => "draft",
            SpeculateMode::Off => "off",
        }
    }

    /// What this mode does for a request with `sampling` on an engine that
    /// has a drafter of its own (`has_drafter`): `Ngram`, `Draft` or `Off`,
    /// never `Auto`. `Draft` without a drafter is an error.
    pub fn resolve(self, sampling: &Sampling, has_drafter: bool) -> Result<Self, EngineError> {
        match self {
            SpeculateMode::Auto if !sampling.is_greedy() => Ok(SpeculateMode::Off),
            SpeculateMode::Auto if has_drafter => Ok(SpeculateMode::Draft),
            SpeculateMode::Auto => Ok(SpeculateMode::Ngram),
            SpeculateMode::Draft if !has_drafter => Err(EngineError::InvalidSpeculation {
                field: "mode",
                reason: "draft: the engine has no draft model".into(),
            }),
            m => Ok(m),
        }
    }
}

/// How hard to speculate ([`GenerateOptions::speculation`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculativeOptions {
    /// Which drafter, if any.
    pub mode: SpeculateMode,
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
            mode: SpeculateMode::Auto,
            max_draft: MAX_STEP_TOKENS - 1,
            position_cost: None,
            adaptive: true,
        }
    }
}

impl SpeculativeOptions {
    /// Plain steps only.
    pub fn off() -> Self {
        Self {
            mode: SpeculateMode::Off,
            ..Self::default()
        }
    }

    /// Speculation in `mode` on every step: the adaptive rule off, so every
    /// guess is verified however few are accepted (tests and benchmarks of
    /// the verify path).
    pub fn always(mode: SpeculateMode) -> Self {
        Self {
            mode,
            adaptive: false,
            ..Self::default()
        }
    }

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
    /// The mode that ran: `Ngram`, `Draft` or `Off` (`Auto` resolved).
    pub mode: SpeculateMode,
    /// Backend calls after the prompt's prefill: plain steps and verifies.
    pub steps: usize,
    /// Of those, multi-token verify steps.
    pub verifies: usize,
    /// Positions those calls processed (a verify of `k` guesses: `k + 1`).
    pub positions: usize,
    /// Drafted tokens sent to verification.
    pub proposed: usize,
    /// Drafted tokens that the model accepted.
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

    /// The number of guesses worth verifying (0: a plain step) when a
    /// verify of `k` costs `cost(k)` single steps.
    fn best_draft(&self, max_draft: usize, cost: impl Fn(usize) -> f64) -> usize {
        let a = self.rate();
        let (mut best, mut best_k) = (1.0, 0); // k = 0: one token per step
        let (mut expected, mut ak) = (1.0, 1.0);
        for k in 1..=max_draft {
            ak *= a;
            expected += ak;
            let per_cost = expected / cost(k);
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

/// What drafting costs in this generation, measured: running means of the
/// seconds per drafted guess and of one single step of the target (a plain
/// step's time, or a verify's over its cost in single steps). A draft
/// model's price by weight bytes misses what its steps spend on barriers
/// and launches (the 0.5B step takes 0.14 of a 7B step, not 0.065).
#[derive(Debug, Clone, Copy)]
struct DraftClock {
    per_guess: RunningMean,
    single: RunningMean,
}

impl Default for DraftClock {
    fn default() -> Self {
        Self {
            per_guess: RunningMean::new(0, Self::WINDOW),
            single: RunningMean::new(0, Self::WINDOW),
        }
    }
}

impl DraftClock {
    /// Samples of each beyond which the measured price replaces the prior;
    /// the first calls of each may load kernels.
    const WARM: u32 = 3;
    /// Weight of a new sample once a mean has this many.
    const WINDOW: u32 = 32;

    /// A draft of `guesses` took `secs`.
    fn drafted(&mut self, secs: f64, guesses: usize) {
        if guesses > 0 {
            self.per_guess.add(secs / guesses as f64);
        }
    }

    /// A target step worth `steps` single steps took `secs`.
    fn stepped(&mut self, secs: f64, steps: f64) {
        if steps > 0.0 {
            self.single.add(secs / steps);
        }
    }

    /// Single steps per guess: the measured ratio once both means are
    /// warm, else `prior`.
    fn price(&self, prior: f64) -> f64 {
        let warm = u64::from(Self::WARM) + 1;
        match (self.per_guess.mean(warm), self.single.mean(warm)) {
            (Some(guess), Some(single)) => (guess / single).clamp(0.0, 100.0),
            _ => prior,
        }
    }
}

/// Probability of `id` in a distribution of `(id, probability)` pairs.
fn prob(dist: &[(u32, f64)], id: u32) -> f64 {
    dist.iter()
        .find(|&&(i, _)| i == id)
        .map_or(0.0, |&(_, p)| p)
}

/// A draw from `dist` (probabilities summing to 1); `None` when empty.
pub(crate) fn draw(dist: &[(u32, f64)], rng: &mut Rng) -> Option<u32> {
    let &(last, _) = dist.last()?;
    let mut r = rng.next_f64();
    for &(id, p) in dist {
        if r < p {
            return Some(id);
        }
        r -= p;
    }
    Some(last)
}

/// The rejection rule for one guess `x` under the target's processed
/// distribution `p`; `q` is the distribution `x` was drawn from (`None`:
/// a deterministic guess, `q` one-hot at `x`). Returns whether `x` is
/// accepted and the output token (`x`, or the replacement drawn from
/// `max(0, p - q)` renormalised).
pub(crate) fn accept_or_resample(
    p: &[(u32, f64)],
    x: u32,
    q: Option<&[(u32, f64)]>,
    rng: &mut Rng,
) -> (bool, u32) {
    let px = prob(p, x);
    let qx = q.map_or(1.0, |q| prob(q, x));
    // Accept with probability min(1, p(x) / q(x)); `u < 1` always holds.
    if px > 0.0 && rng.next_f64() * qx < px {
        return (true, x);
    }
    let residual: Vec<(u32, f64)> = match q {
        None => p.iter().copied().filter(|&(i, _)| i != x).collect(),
        Some(q) => {
            let q: HashMap<u32, f64> = q.iter().copied().collect();
            p.iter()
                .map(|&(i, pi)| (i, (pi - q.get(&i).copied().unwrap_or(0.0)).max(0.0)))
                .filter(|&(_, r)| r > 0.0)
                .collect()
        }
    };
    let total: f64 = residual.iter().map(|&(_, r)| r).sum();
    if total > 0.0 && total.is_finite() {
        let mut r = rng.next_f64() * total;
        for &(id, w) in &residual {
            if r < w {
                return (false, id);
            }
            r -= w;
        }
        if let Some(&(id, _)) = residual.last() {
            return (false, id);
        }
    }
    // p equals q up to rounding (or p is empty): nothing is left to
    // correct, so a draw from p itself has the right distribution.
    (false, draw(p, rng).unwrap_or(x))
}

/// The decode loop of [`crate::Engine::generate`]: plain steps when
/// `drafter` is `None`, speculation with it otherwise. The request is
/// already checked ([`crate::Engine::check`]).
pub(crate) fn decode<B: Backend>(
    backend: &mut B,
    mut drafter: Option<&mut (dyn Drafter + 'static)>,
    mode: SpeculateMode,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation, EngineError> {
    let start = Instant::now();
    let name = backend.kind().name();
    let err = |e: B::Error| EngineError::Backend {
        backend: name,
        source: Box::new(e),
    };
    let capacity = backend.capacity();
    let spec = &opts.speculation;
    let draft_cost = drafter.as_ref().map_or(0.0, |d| d.cost_per_token());
    // A drafter that costs something is priced by what it measures here;
    // free ones (prompt lookup) stay free.
    let timed = draft_cost > 0.0;
    let mut clock = DraftClock::default();
    // A step of `positions` positions, in single steps.
    let step_cost = |backend: &B, positions: usize| match spec.position_cost {
        Some(c) => 1.0 + positions.saturating_sub(1) as f64 * c,
        None => backend.step_many_cost(positions),
    };
    let s = &opts.sampling;
    let mut rng = Rng::new(s.seed);
    // Greedy without a penalty is the backend's own pick: no logits copy.
    let needs_logits = !s.is_greedy() || s.has_penalty();
    let mut history = if s.has_penalty() {
        TokenHistory::new(prompt)
    } else {
        TokenHistory::default()
    };
    let mut stats = SpeculativeStats {
        mode,
        ..SpeculativeStats::default()
    };
    let mut out: Vec<u32> = Vec::with_capacity(opts.max_new_tokens);
    backend.reset().map_err(err)?;
    let finish = |out: Vec<u32>, stop, prefill, decode: Duration, stats| Generation {
        prompt_ids: prompt.to_vec(),
        output_ids: out,
        stop,
        prefill,
        decode,
        speculation: stats,
    };
    if opts.max_new_tokens == 0 {
        return Ok(finish(
            out,
            StopReason::Length,
            start.elapsed(),
            Duration::ZERO,
            stats,
        ));
    }
    if let Some(d) = drafter.as_mut() {
        d.reset();
        d.extend(prompt);
    }

    // Emits one token; says why to stop, if it is time.
    let mut emit = |tok: u32, out: &mut Vec<u32>, history: &mut TokenHistory| {
        if s.has_penalty() {
            history.push(tok);
        }
        out.push(tok);
        if on_token(tok).is_break() {
            Some(StopReason::Caller)
        } else if !opts.ignore_eos && opts.stop_ids.contains(&tok) {
            Some(StopReason::Eos)
        } else if out.len() >= opts.max_new_tokens {
            Some(StopReason::Length)
        } else {
            None
        }
    };
    // The next token from the backend's last logits (or its own pick).
    let pick = |backend: &mut B, argmax: u32, history: &TokenHistory, rng: &mut Rng| {
        if !needs_logits {
            return Ok(argmax);
        }
        let mut logits = backend.logits().map_err(err)?;
        Ok::<u32, EngineError>(choose(&mut logits, s, history, rng))
    };

    let first = backend.prefill(prompt, 0).map_err(err)?.argmax;
    let first = pick(backend, first, &history, &mut rng)?;
    let prefill = start.elapsed();
    let decode_start = Instant::now();
    if let Some(stop) = emit(first, &mut out, &mut history) {
        return Ok(finish(out, stop, prefill, decode_start.elapsed(), stats));
    }
    if let Some(d) = drafter.as_mut() {
        d.extend(&[first]);
    }

    let mut acceptance = [Acceptance::default(); DRAFT_CLASSES];
    let (mut last, mut pos) = (first, prompt.len()); // `last` is fed at `pos`
    let mut draft: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS);
    let mut dists: Vec<Vec<(u32, f64)>> = Vec::new(); // [k] the guesses' q
    let mut run: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS); // [last, draft..]
    let mut new: Vec<u32> = Vec::with_capacity(MAX_STEP_TOKENS);
    loop {
        // More than `remaining` tokens would write positions plain decoding
        // never writes (and may not fit the cache).
        let remaining = opts.max_new_tokens - out.len();
        draft.clear();
        dists.clear();
        let mut class = None;
        if let Some(d) = drafter.as_mut() {
            class = d.next_class().map(|c| c.min(DRAFT_CLASSES - 1));
            // A verify of `k` guesses, in single steps: the step of k + 1
            // positions and the k guesses' drafting.
            let per_guess = clock.price(draft_cost);
            let verify_cost = |k: usize| step_cost(backend, k + 1) + k as f64 * per_guess;
            let k = match class {
                None => 0,
                Some(c) if spec.adaptive => acceptance[c].best_draft(spec.max_draft, verify_cost),
                Some(_) => spec.max_draft,
            }
            .min(remaining - 1);
            if k > 0 {
                let t0 = Instant::now();
                if s.is_greedy() {
                    d.draft(k, &mut draft)?;
                } else {
                    d.draft_sampled(k, s, &history, &mut rng, &mut draft, &mut dists)?;
                }
                draft.truncate(k);
                if timed {
                    clock.drafted(t0.elapsed().as_secs_f64(), draft.len());
                }
            }
        }
        new.clear();
        let t0 = Instant::now();
        if draft.is_empty() {
            let r = backend.step(last, pos).map_err(err)?;
            if timed {
                clock.stepped(t0.elapsed().as_secs_f64(), 1.0);
            }
            new.push(pick(backend, r.argmax, &history, &mut rng)?);
            stats.positions += 1;
        } else {
            run.clear();
            run.push(last);
            run.extend_from_slice(&draft);
            let step = MultiStep::new(&run, pos, capacity)?.with_logits(needs_logits);
            let verified = backend.step_many(step).map_err(err)?; // [k + 1]
            if timed {
                let steps = step_cost(backend, run.len());
                clock.stepped(t0.elapsed().as_secs_f64(), steps);
            }
            if !needs_logits {
                let picks = &verified.argmax;
                let agreed = draft.iter().zip(picks).take_while(|(d, p)| d == p).count();
                new.extend_from_slice(&draft[..agreed]);
                new.push(picks[agreed]);
            } else {
                // Each position's distribution sees the guesses before it.
                let mut h = history.clone();
                for i in 0..=draft.len() {
                    let mut logits = verified
                        .logits_at(i)
                        .ok_or_else(|| EngineError::InvalidStep {
                            field: "logits",
                            reason: format!("the {name} backend returned no logits for position {i} of a verify step"),
                        })?
                        .to_vec();
                    apply_penalties(&mut logits, s, &h);
                    let Some(&x) = draft.get(i) else {
                        // Every guess held: one more token of the model's.
                        let bonus = if s.is_greedy() {
                            argmax(&logits)
                        } else {
                            draw(&candidates(&logits, s), &mut rng)
                                .unwrap_or_else(|| argmax(&logits))
                        };
                        new.push(bonus);
                        break;
                    };
                    let (held, tok) = if s.is_greedy() {
                        let p = argmax(&logits);
                        (p == x, p)
                    } else {
                        let p = candidates(&logits, s);
                        accept_or_resample(&p, x, dists.get(i).map(Vec::as_slice), &mut rng)
                    };
                    new.push(tok);
                    if !held {
                        break;
                    }
                    if s.has_penalty() {
                        h.push(x);
                    }
                }
            }
            stats.verifies += 1;
            stats.positions += run.len();
            stats.proposed += draft.len();
            stats.accepted += new.len() - 1;
        }
        stats.steps += 1;
        if let Some(c) = class {
            acceptance[c].record(new.len() - 1, draft.len());
        }
        for &t in &new {
            stats.decoded += 1;
            if let Some(stop) = emit(t, &mut out, &mut history) {
                return Ok(finish(out, stop, prefill, decode_start.elapsed(), stats));
            }
        }
        if let Some(d) = drafter.as_mut() {
            d.extend(&new);
        }
        pos += new.len();
        last = *new.last().expect("a step yields at least one token");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use qmk_model::Weights;

    use super::*;
    use crate::{BackendKind, CpuBackend, Engine, MultiStepOutput, StepOutput};

    fn tiny(seed: u64) -> Arc<Weights> {
        let c = crate::test_models::tiny_config(64, 96, 16, 300);
        Arc::new(qmk_model::synthetic_weights(&c, seed))
    }

    fn plain(w: &Arc<Weights>, prompt: &[u32], n: usize, stop_ids: &[u32]) -> Vec<u32> {
        let cap = prompt.len() + n;
        let mut e = Engine::new(CpuBackend::new(w.clone(), cap).unwrap(), 300);
        let opts = GenerateOptions {
            max_new_tokens: n,
            stop_ids: stop_ids.to_vec(),
            speculation: SpeculativeOptions::off(),
            ..Default::default()
        };
        let g = e
            .generate(prompt, &opts, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(g.speculation.mode, SpeculateMode::Off);
        g.output_ids
    }

    /// Generation with `opts` on an engine over `backend`, with `drafter`
    /// as its draft drafter when given.
    fn speculate<B: Backend>(
        engine: &mut Engine<B>,
        drafter: Option<Box<dyn Drafter + Send>>,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Generation {
        engine.set_drafter(drafter);
        engine
            .generate(prompt, opts, |_| ControlFlow::Continue(()))
            .unwrap()
    }

    /// Greedy prompt-lookup speculation for `n` tokens.
    fn opts(n: usize, adaptive: bool) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: n,
            speculation: SpeculativeOptions {
                mode: SpeculateMode::Ngram,
                adaptive,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The same, drafting with the engine's drafter.
    fn drafted(n: usize, adaptive: bool) -> GenerateOptions {
        let mut o = opts(n, adaptive);
        o.speculation.mode = SpeculateMode::Draft;
        o
    }

    fn engine(w: &Arc<Weights>, capacity: usize) -> Engine<CpuBackend> {
        Engine::new(CpuBackend::new(w.clone(), capacity).unwrap(), 300)
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
                    let mut e = engine(&w, prompt.len() + n);
                    let got = speculate(&mut e, None, prompt, &opts(n, adaptive));
                    assert_eq!(
                        got.output_ids, want,
                        "seed {seed} prompt {i} adaptive {adaptive}"
                    );
                    assert_eq!(got.stop, StopReason::Length);
                    let s = got.speculation;
                    assert_eq!(s.mode, SpeculateMode::Ngram);
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
        fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError> {
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
            Ok(())
        }
    }

    #[test]
    fn perfect_guesses_take_max_draft_plus_one_tokens_per_step() {
        let w = tiny(4);
        let prompt = random_prompt(99, 5);
        let n = 50;
        let want = plain(&w, &prompt, n, &[]);
        let d = Oracle {
            answer: want.clone(),
            prompt_len: prompt.len(),
            seen: 0,
            wrong_after: usize::MAX,
        };
        let mut e = engine(&w, prompt.len() + n);
        let mut o = drafted(n, true);
        o.speculation.position_cost = Some(0.1);
        let got = speculate(&mut e, Some(Box::new(d)), &prompt, &o);
        assert_eq!(got.output_ids, want);
        let s = got.speculation;
        assert_eq!(s.mode, SpeculateMode::Draft);
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
        let oracle = |wrong_after| -> Option<Box<dyn Drafter + Send>> {
            Some(Box::new(Oracle {
                answer: want.clone(),
                prompt_len: prompt.len(),
                seen: 0,
                wrong_after,
            }))
        };
        // Always wrong: without the rule every step verifies; with it, few.
        let mut b = engine(&w, prompt.len() + n);
        let eager = speculate(&mut b, oracle(0), &prompt, &drafted(n, false));
        let careful = speculate(&mut b, oracle(0), &prompt, &drafted(n, true));
        assert_eq!(eager.output_ids, want);
        assert_eq!(careful.output_ids, want);
        // (The last step has one token left to make: nothing to guess.)
        assert_eq!(eager.speculation.verifies, eager.speculation.steps - 1);
        assert_eq!(eager.speculation.accepted, 0);
        assert!(
            careful.speculation.verifies * 4 <= careful.speculation.steps,
            "{:?}",
            careful.speculation
        );
        // Retried: a few probes happen over a long run.
        assert!(
            careful.speculation.verifies >= 3,
            "{:?}",
            careful.speculation
        );
        // Right for the first 60 tokens, then wrong: the rule speculates
        // early and backs off late.
        let mixed = speculate(&mut b, oracle(60), &prompt, &drafted(n, true));
        assert_eq!(mixed.output_ids, want);
        assert!(mixed.speculation.accepted >= 40, "{:?}", mixed.speculation);
        // A verify at full price never pays: plain steps only.
        let mut o = drafted(n, true);
        o.speculation.position_cost = Some(1.0);
        let priced = speculate(&mut b, oracle(usize::MAX), &prompt, &o);
        assert_eq!(priced.output_ids, want);
        assert_eq!(priced.speculation.verifies, 0);
        assert_eq!(priced.speculation.steps, n - 1);
    }

    /// The CPU backend, with steps of more than `cheap` positions priced
    /// far above what they save.
    struct Priced {
        inner: CpuBackend,
        cheap: usize,
    }

    impl Backend for Priced {
        type Error = qmk_model::ModelError;
        fn kind(&self) -> BackendKind {
            self.inner.kind()
        }
        fn capacity(&self) -> usize {
            self.inner.capacity()
        }
        fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, Self::Error> {
            self.inner.step(token, pos)
        }
        fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, Self::Error> {
            self.inner.step_many(run)
        }
        fn step_many_cost(&self, positions: usize) -> f64 {
            if positions <= self.cheap {
                1.0 + 0.05 * (positions - 1) as f64
            } else {
                100.0
            }
        }
        fn logits(&mut self) -> Result<Vec<f32>, Self::Error> {
            self.inner.logits()
        }
        fn reset(&mut self) -> Result<(), Self::Error> {
            self.inner.reset()
        }
    }

    #[test]
    fn the_rule_prices_each_size_as_the_backend_reports() {
        let w = tiny(11);
        let prompt = random_prompt(13, 5);
        let n = 60;
        let want = plain(&w, &prompt, n, &[]);
        for cheap in [2, 3, 5] {
            let d = Oracle {
                answer: want.clone(),
                prompt_len: prompt.len(),
                seen: 0,
                wrong_after: usize::MAX,
            };
            let inner = CpuBackend::new(w.clone(), prompt.len() + n).unwrap();
            let mut e = Engine::new(Priced { inner, cheap }, 300);
            let got = speculate(&mut e, Some(Box::new(d)), &prompt, &drafted(n, true));
            assert_eq!(got.output_ids, want);
            let s = got.speculation;
            // Every verify is of the largest cheap size: its guesses all
            // hold, so each step makes `cheap` tokens.
            assert_eq!(s.accepted, s.proposed, "{s:?}");
            assert!(
                s.proposed <= s.verifies * (cheap - 1),
                "cheap {cheap}: {s:?}"
            );
            assert!(
                s.steps <= (n - 1).div_ceil(cheap) + 1,
                "cheap {cheap}: {s:?}"
            );
        }
    }

    /// Wrong guesses where `seen` is a multiple of 3, right ones elsewhere;
    /// the class tells which (or, with `classes` false, every draft is of
    /// one).
    struct Mixed {
        oracle: Oracle,
        classes: bool,
    }

    impl Drafter for Mixed {
        fn reset(&mut self) {
            self.oracle.reset();
        }
        fn extend(&mut self, tokens: &[u32]) {
            self.oracle.extend(tokens);
        }
        fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError> {
            self.oracle.wrong_after = if self.oracle.seen % 3 == 0 {
                0
            } else {
                usize::MAX
            };
            self.oracle.draft(max, out)
        }
        fn next_class(&mut self) -> Option<usize> {
            Some(match (self.classes, self.oracle.seen % 3) {
                (false, _) => 0,
                (true, 0) => 1,
                (true, _) => 2,
            })
        }
    }

    #[test]
    fn acceptance_is_kept_per_class_of_draft() {
        let w = tiny(12);
        let prompt = random_prompt(17, 6);
        let n = 150;
        let want = plain(&w, &prompt, n, &[]);
        let run = |classes| {
            let d = Mixed {
                oracle: Oracle {
                    answer: want.clone(),
                    prompt_len: prompt.len(),
                    seen: 0,
                    wrong_after: 0,
                },
                classes,
            };
            let mut e = engine(&w, prompt.len() + n);
            let mut o = drafted(n, true);
            o.speculation.position_cost = Some(0.3);
            let got = speculate(&mut e, Some(Box::new(d)), &prompt, &o);
            assert_eq!(got.output_ids, want);
            got.speculation
        };
        let (one, two) = (run(false), run(true));
        // Told apart, the wrong class is rarely verified and the right one
        // runs long: fewer wasted guesses, and the same tokens for less
        // (each step costs 1, each guess 0.3 more).
        let wasted = |s: &SpeculativeStats| s.proposed - s.accepted;
        let cost = |s: &SpeculativeStats| s.steps as f64 + 0.3 * s.proposed as f64;
        assert!(wasted(&two) * 4 < wasted(&one), "{two:?} against {one:?}");
        assert!(cost(&two) < 0.9 * cost(&one), "{two:?} against {one:?}");
    }

    #[test]
    fn drafting_is_priced_by_what_it_measures_once_warm() {
        let mut c = DraftClock::default();
        assert_eq!(c.price(0.065), 0.065);
        // A target step of 4 ms, guesses of 0.6 ms (after kernel loads).
        for _ in 0..=DraftClock::WARM {
            c.drafted(0.0024, 4);
            assert_eq!(c.price(0.065), 0.065, "only warm means count");
            c.stepped(0.010, 2.5);
        }
        assert!((c.price(0.065) - 0.15).abs() < 1e-9, "{}", c.price(0.065));
        // Drafts without guesses, steps of no cost and bad times are not
        // samples.
        let before = (c.per_guess, c.single);
        c.drafted(1.0, 0);
        c.stepped(1.0, 0.0);
        c.stepped(f64::NAN, 1.0);
        c.drafted(-1.0, 3);
        assert_eq!((c.per_guess, c.single), before);
        // The means follow new samples.
        for _ in 0..200 {
            c.drafted(0.0016, 4);
        }
        assert!((c.price(0.065) - 0.1).abs() < 1e-3, "{}", c.price(0.065));
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
            let mut e = engine(&w, prompt.len() + n);
            let mut o = opts(n, false);
            o.stop_ids = vec![stop];
            let got = speculate(&mut e, None, &prompt, &o);
            assert_eq!(got.output_ids, want, "stop id {stop}");
            assert_eq!(got.stop, StopReason::Eos);
            assert_eq!(*got.output_ids.last().unwrap(), stop);
        }
        // The callback stops it after exactly the tokens it saw.
        let mut e = engine(&w, prompt.len() + n);
        let mut seen = vec![];
        let got = e
            .generate(&prompt, &opts(n, false), |t| {
                seen.push(t);
                if seen.len() == 13 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
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
            let mut e = engine(&w, (prompt.len() + n).saturating_sub(1).max(1));
            let got = speculate(&mut e, None, &prompt, &opts(n, false));
            assert_eq!(got.output_ids, want[..n], "n = {n}");
        }
    }

    #[test]
    fn bad_requests_are_named_errors() {
        let w = tiny(9);
        let mut e = engine(&w, 16);
        let mut run = |p: &[u32], o: &GenerateOptions| {
            e.generate(p, o, |_| ControlFlow::Continue(())).unwrap_err()
        };
        let with = |f: fn(&mut SpeculativeOptions)| {
            let mut o = opts(4, true);
            f(&mut o.speculation);
            o
        };
        for (field, o) in [
            ("max_draft", with(|s| s.max_draft = 0)),
            ("max_draft", with(|s| s.max_draft = MAX_STEP_TOKENS)),
            ("position_cost", with(|s| s.position_cost = Some(f64::NAN))),
            ("position_cost", with(|s| s.position_cost = Some(-1.0))),
            // No draft model set.
            ("mode", with(|s| s.mode = SpeculateMode::Draft)),
        ] {
            let e = run(&[1], &o);
            assert!(
                matches!(e, EngineError::InvalidSpeculation { field: f, .. } if f == field),
                "{e}"
            );
        }
        assert!(matches!(run(&[], &opts(4, true)), EngineError::EmptyPrompt));
        assert!(matches!(
            run(&[1; 10], &opts(8, true)),
            EngineError::ContextFull {
                needed: 17,
                capacity: 16,
                ..
            }
        ));
        assert!(matches!(
            run(&[1, 300], &opts(4, true)),
            EngineError::TokenOutOfVocab { index: 1, .. }
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
        let mut e = Engine::new(
            Stepwise(CpuBackend::new(w.clone(), prompt.len() + n).unwrap()),
            300,
        );
        let got = speculate(&mut e, None, &prompt, &opts(n, false));
        assert_eq!(got.output_ids, want);
        assert!(got.speculation.accepted > 0, "{:?}", got.speculation);
        // Left to the rule, a backend whose positions cost full steps
        // never speculates.
        let plainly = speculate(&mut e, None, &prompt, &opts(n, true));
        assert_eq!(plainly.output_ids, want);
        assert_eq!(
            (plainly.speculation.verifies, plainly.speculation.steps),
            (0, n - 1)
        );
        // And the default's per-position output equals the CPU override's.
        let mut b = e.into_backend();
        let mut c = CpuBackend::new(w, 32).unwrap();
        let toks = [5u32, 6, 7, 8, 9];
        b.0.prefill(&[1, 2, 3], 0).unwrap();
        c.prefill(&[1, 2, 3], 0).unwrap();
        let run = |cap| MultiStep::new(&toks, 3, cap).unwrap().with_logits(true);
        let x: MultiStepOutput = b.step_many(run(b.capacity())).unwrap();
        let y = c.step_many(run(c.capacity())).unwrap();
        assert_eq!(x, y);
    }

    /// The sampling settings of the statistical tests: every part of the
    /// processed distribution in play, at most 4 candidates per step.
    fn stat_sampling(seed: u64) -> Sampling {
        Sampling {
            temperature: 10.0,
            top_k: 4,
            top_p: 0.97,
            min_p: 0.02,
            repetition_penalty: 2.0,
            presence_penalty: 2.0,
            frequency_penalty: 2.0,
            seed,
        }
    }

    const STAT_VOCAB: usize = 24;
    const STAT_NEW: usize = 4;

    fn stat_weights(seed: u64) -> Arc<Weights> {
        let c = crate::test_models::tiny_config(32, 64, 8, STAT_VOCAB);
        Arc::new(qmk_model::synthetic_weights(&c, seed))
    }

    /// The plain sampler's exact distribution over the first `STAT_NEW`
    /// tokens: every path through the processed distributions, its
    /// probability the product of each step's.
    fn exact_sequences(w: &Arc<Weights>, prompt: &[u32]) -> HashMap<Vec<u32>, f64> {
        fn walk(
            b: &mut CpuBackend,
            s: &Sampling,
            prompt: &[u32],
            path: &mut Vec<u32>,
            p: f64,
            out: &mut HashMap<Vec<u32>, f64>,
        ) {
            if path.len() == STAT_NEW {
                *out.entry(path.clone()).or_insert(0.0) += p;
                return;
            }
            if let Some(&t) = path.last() {
                b.step(t, prompt.len() + path.len() - 1).unwrap();
            } else {
                b.prefill(prompt, 0).unwrap();
            }
            let mut logits = b.logits().unwrap();
            let mut h = TokenHistory::new(prompt);
            path.iter().for_each(|&t| h.push(t));
            apply_penalties(&mut logits, s, &h);
            for (id, q) in candidates(&logits, s) {
                path.push(id);
                walk(b, s, prompt, path, p * q, out);
                path.pop();
            }
        }
        let mut b = CpuBackend::new(w.clone(), prompt.len() + STAT_NEW).unwrap();
        let mut out = HashMap::new();
        walk(
            &mut b,
            &stat_sampling(0),
            prompt,
            &mut vec![],
            1.0,
            &mut out,
        );
        let total: f64 = out.values().sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        out
    }

    /// Pearson's chi-square of `counts` (from `n` runs) against `exact`,
    /// cells expecting fewer than 5 pooled into one, and the bound that a
    /// correct sampler stays under: the degrees of freedom plus 6 standard
    /// deviations of the statistic (`sqrt(2·df)`), exceeded by chance with
    /// probability below 1e-6 at these sizes.
    fn chi_square(
        exact: &HashMap<Vec<u32>, f64>,
        counts: &HashMap<Vec<u32>, usize>,
        n: usize,
    ) -> (f64, f64) {
        let nf = n as f64;
        let (mut stat, mut cells) = (0.0, 0usize);
        let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
        for (seq, &p) in exact {
            let e = p * nf;
            let o = counts.get(seq).copied().unwrap_or(0) as f64;
            if e < 5.0 {
                pooled_e += e;
                pooled_o += o;
            } else {
                stat += (o - e).powi(2) / e;
                cells += 1;
            }
        }
        // A sequence the exact distribution never produces counts fully.
        let impossible: usize = counts
            .iter()
            .filter(|(seq, _)| !exact.contains_key(*seq))
            .map(|(_, &c)| c)
            .sum();
        pooled_o += impossible as f64;
        if pooled_e > 0.0 {
            stat += (pooled_o - pooled_e).powi(2) / pooled_e;
            cells += 1;
        } else if impossible > 0 {
            stat = f64::INFINITY;
        }
        let df = (cells - 1) as f64;
        (stat, df + 6.0 * (2.0 * df).sqrt())
    }

    /// Greedy picks of a second model, with no distribution: the engine
    /// treats them as deterministic guesses (a one-hot `q`).
    struct OneHot(crate::draft::DraftModel<CpuBackend>);

    impl Drafter for OneHot {
        fn reset(&mut self) {
            self.0.reset();
        }
        fn extend(&mut self, tokens: &[u32]) {
            self.0.extend(tokens);
        }
        fn draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), EngineError> {
            self.0.draft(max, out)
        }
    }

    /// Counts the sequences `runs` seeded generations produce with `opts`.
    fn sample_sequences(
        e: &mut Engine<CpuBackend>,
        prompt: &[u32],
        opts: &GenerateOptions,
        runs: usize,
    ) -> (HashMap<Vec<u32>, usize>, SpeculativeStats) {
        let mut counts = HashMap::new();
        let mut total = SpeculativeStats::default();
        for seed in 0..runs as u64 {
            let mut o = opts.clone();
            o.sampling.seed = seed;
            let g = e
                .generate(prompt, &o, |_| ControlFlow::Continue(()))
                .unwrap();
            *counts.entry(g.output_ids).or_insert(0) += 1;
            total.mode = g.speculation.mode;
            total.proposed += g.speculation.proposed;
            total.accepted += g.speculation.accepted;
            total.verifies += g.speculation.verifies;
        }
        (counts, total)
    }

    #[test]
    fn speculative_sampling_has_the_plain_samplers_distribution() {
        let w = stat_weights(21);
        let prompt = [3u32, 7, 3, 9];
        let exact = exact_sequences(&w, &prompt);
        let runs = 4_000;
        let cap = prompt.len() + STAT_NEW;
        let tok = qmk_model::tokenizer::Tokenizer::from_dir(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../model/tests/data/qwen-tokenizer"),
        )
        .unwrap();
        let vocab = crate::draft::ModelVocab {
            name: "stat",
            tokenizer: &tok,
            rows: STAT_VOCAB,
        };
        let draft_model = |seed| {
            crate::draft::DraftModel::new(
                CpuBackend::new(stat_weights(seed), cap).unwrap(),
                vocab,
                vocab,
                0.0,
            )
            .unwrap()
        };
        let opts = |mode| GenerateOptions {
            max_new_tokens: STAT_NEW,
            sampling: stat_sampling(0),
            speculation: SpeculativeOptions::always(mode),
            ..GenerateOptions::default()
        };
        let mut e = Engine::new(CpuBackend::new(w.clone(), cap).unwrap(), STAT_VOCAB);
        // (what drafts, drafter, mode): after the first token (the prefill's)
        // one verify checks 2 guesses and adds a third token.
        type Case = (&'static str, Option<Box<dyn Drafter + Send>>, SpeculateMode);
        let cases: Vec<Case> = vec![
            ("plain sampler", None, SpeculateMode::Off),
            (
                "one-hot: the target's own greedy picks",
                Some(Box::new(OneHot(draft_model(21)))),
                SpeculateMode::Draft,
            ),
            (
                "draft model: another model's distribution",
                Some(Box::new(draft_model(22))),
                SpeculateMode::Draft,
            ),
            (
                "draft model: the target's own distribution",
                Some(Box::new(draft_model(21))),
                SpeculateMode::Draft,
            ),
        ];
        for (what, drafter, mode) in cases {
            e.set_drafter(drafter);
            let (counts, s) = sample_sequences(&mut e, &prompt, &opts(mode), runs);
            let (stat, bound) = chi_square(&exact, &counts, runs);
            eprintln!(
                "{what}: chi-square {stat:.1} (bound {bound:.1}), {} of {} guesses accepted",
                s.accepted, s.proposed
            );
            assert!(stat < bound, "{what}: chi-square {stat:.1} >= {bound:.1}");
            if mode == SpeculateMode::Draft {
                assert_eq!(s.mode, SpeculateMode::Draft);
                // One verify of 2 guesses per run, another of 1 after a
                // first guess is rejected.
                assert!(s.verifies >= runs, "{what}: {s:?}");
                if what.contains("target's own distribution") {
                    // q = p: every guess holds.
                    assert_eq!(s.accepted, s.proposed, "{what}");
                } else {
                    // Both branches of the rule are exercised.
                    let a = s.acceptance();
                    assert!(a > 0.05 && a < 0.95, "{what}: acceptance {a}");
                }
            }
        }
        // The bound is tight enough to catch a modest distortion: the plain
        // sampler at temperature 20 instead of 10 fails it.
        e.set_drafter(None);
        let mut warmer = opts(SpeculateMode::Off);
        warmer.sampling.temperature = 20.0;
        let (counts, _) = sample_sequences(&mut e, &prompt, &warmer, runs);
        let (stat, bound) = chi_square(&exact, &counts, runs);
        assert!(
            stat > bound,
            "temperature 20: chi-square {stat:.1} < {bound:.1}"
        );
    }
}
