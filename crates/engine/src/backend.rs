//! The one interface all decoders implement.

use crate::EngineError;

/// Which implementation runs the decode step. A library user switches backend
/// by changing this one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU reference forward (f32 math on bf16 weights).
    Cpu,
    /// The megakernel through the `cudarc` driver bindings.
    Cudarc,
    /// The megakernel through the `cust` driver bindings.
    Cust,
}

impl BackendKind {
    /// The name the command line and error messages use: `cpu`, `cudarc`,
    /// `cust`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cudarc => "cudarc",
            BackendKind::Cust => "cust",
        }
    }
}

/// Most positions one [`Backend::step_many`] call takes: a speculative
/// verify step checks the last accepted token plus up to 7 drafted ones.
pub const MAX_STEP_TOKENS: usize = 8;

/// What one decode step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutput {
    /// Greedy pick (argmax of the logits, lowest index on ties).
    pub argmax: u32,
}

/// The input of one multi-token step ([`Backend::step_many`]): `T =
/// 1..=`[`MAX_STEP_TOKENS`] consecutive tokens of one sequence at positions
/// `start..start + T`, all inside the KV cache. Checked when built, so a
/// backend receives only a valid run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultiStep<'a> {
    tokens: &'a [u32], // [T]
    start: usize,
    logits: bool,
}

impl<'a> MultiStep<'a> {
    /// `tokens` at positions `start..start + tokens.len()` of a cache of
    /// `capacity` positions (the backend's [`Backend::capacity`]). Only the
    /// greedy picks come back unless [`MultiStep::with_logits`] asks for the
    /// logits too.
    pub fn new(tokens: &'a [u32], start: usize, capacity: usize) -> Result<Self, EngineError> {
        if tokens.is_empty() || tokens.len() > MAX_STEP_TOKENS {
            return Err(EngineError::InvalidStep {
                field: "tokens",
                reason: format!(
                    "{} tokens; a multi-token step takes 1..={MAX_STEP_TOKENS}",
                    tokens.len()
                ),
            });
        }
        match start.checked_add(tokens.len()) {
            Some(end) if end <= capacity => Ok(Self {
                tokens,
                start,
                logits: false,
            }),
            _ => Err(EngineError::InvalidStep {
                field: "start",
                reason: format!(
                    "positions {start}..{start}+{} do not fit the KV cache of {capacity} positions",
                    tokens.len()
                ),
            }),
        }
    }

    /// Also returns every position's logits (rejection sampling needs
    /// them; greedy verification does not, and a GPU backend then skips
    /// `T` logits copies).
    pub fn with_logits(mut self, yes: bool) -> Self {
        self.logits = yes;
        self
    }

    /// The tokens `[T]`.
    pub fn tokens(&self) -> &'a [u32] {
        self.tokens
    }

    /// Position of the first token.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Number of positions `T` (1..=[`MAX_STEP_TOKENS`]).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a run holds at least one token (here for clippy's
    /// `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether every position's logits are asked for.
    pub fn wants_logits(&self) -> bool {
        self.logits
    }
}

/// What one multi-token step returns, position by position.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiStepOutput {
    /// Greedy pick after each position `[T]`: `argmax[i]` is the model's next
    /// token after `tokens[..=i]`, i.e. its guess for position `start + i + 1`.
    pub argmax: Vec<u32>, // [T]
    /// Logits `[T, V]` in position order when asked for
    /// ([`MultiStep::with_logits`]), empty otherwise.
    pub logits: Vec<f32>, // [T, V] or empty
}

impl MultiStepOutput {
    /// Position `start + i`'s logits `[V]`, if they were asked for.
    pub fn logits_at(&self, i: usize) -> Option<&[f32]> {
        let t = self.argmax.len();
        if self.logits.is_empty() || i >= t {
            return None;
        }
        let v = self.logits.len() / t;
        Some(&self.logits[i * v..(i + 1) * v])
    }
}

/// One decode step at a time over a KV cache the backend owns.
///
/// Contract: `step(token, pos)` embeds `token`, runs every layer at position
/// `pos` (writing K/V for `pos` into the cache, attending over `0..=pos`), and
/// leaves the logits of that position readable through [`Backend::logits`].
/// Positions are fed in order starting at 0 after [`Backend::reset`], and a
/// caller may go back: feeding a position `p` at or before the next one
/// rewrites `p`, and what was cached at `p` and after is never read again
/// (attention at `p` reads `0..=p` only). Speculative decoding drops a
/// rejected draft tail this way.
pub trait Backend {
    /// The backend's own error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Positions the KV cache holds.
    fn capacity(&self) -> usize;

    /// Runs one decode step for `token` at position `pos`.
    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, Self::Error>;

    /// Feeds `tokens` at positions `start..start + len` and returns the last
    /// position's output, its logits readable through [`Backend::logits`].
    /// The default runs one decode step per token; backends with a batched
    /// prefill override it.
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput, Self::Error> {
        let mut out = StepOutput { argmax: 0 };
        for (i, &t) in tokens.iter().enumerate() {
            out = self.step(t, start + i)?;
        }
        Ok(out)
    }

    /// Runs `run.len()` consecutive decode steps as one: the tokens at
    /// positions `start..start + T`, each attending causally over the cache
    /// and the run's earlier positions, K/V written for all `T`. The verify
    /// step of speculative decoding: feed the last accepted token plus the
    /// drafted ones, keep the drafts that equal the greedy picks.
    ///
    /// Contract:
    /// * each position's greedy pick and logits are bit-identical to `T`
    ///   single [`Backend::step`] calls on the same cache, so greedy output
    ///   does not depend on how positions are grouped;
    /// * afterwards the caller continues at any position `p <= start + T`
    ///   (a rejected tail is simply rewritten, see the trait docs), and
    ///   [`Backend::logits`] holds the last position's logits;
    /// * tokens outside the vocabulary and positions past the cache are
    ///   errors; after an error, positions `start..` hold nothing usable
    ///   (resume at `start` or before).
    ///
    /// The default runs `T` single steps (correct everywhere; it saves
    /// nothing). Backends that can read each weight once for all `T`
    /// positions override it.
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, Self::Error> {
        let mut out = MultiStepOutput {
            argmax: Vec::with_capacity(run.len()),
            logits: Vec::new(),
        };
        for (i, &t) in run.tokens().iter().enumerate() {
            out.argmax.push(self.step(t, run.start() + i)?.argmax);
            if run.wants_logits() {
                out.logits.extend(self.logits()?);
            }
        }
        Ok(out)
    }

    /// Cost of each position after the first in [`Backend::step_many`], as
    /// a fraction of one single step: what speculative decoding weighs
    /// acceptance against. The default `step_many` runs single steps, so
    /// the default is 1 (speculation never pays); a backend that overrides
    /// `step_many` reports its own.
    fn step_many_position_cost(&self) -> f64 {
        1.0
    }

    /// Cost of one [`Backend::step_many`] of `positions` positions, in
    /// single steps: what the adaptive rule of speculative decoding prices
    /// a verify at. By default `1 + (positions - 1)` times
    /// [`Backend::step_many_position_cost`]; a backend that times its
    /// launches reports what each size measured.
    fn step_many_cost(&self, positions: usize) -> f64 {
        1.0 + positions.saturating_sub(1) as f64 * self.step_many_position_cost()
    }

    /// Logits `[vocab]` of the last step.
    fn logits(&mut self) -> Result<Vec<f32>, Self::Error>;

    /// Forget the cache: the next step starts at position 0.
    fn reset(&mut self) -> Result<(), Self::Error>;
}

/// A running mean of measured seconds, for pricing steps and drafts by what
/// they cost here: the plain mean of the first `window` counted samples,
/// then an exponential mean with weight `1 / window`, so it follows a
/// drifting cost (a growing context). The first `skip` samples are not
/// counted (a first launch may load its kernel); a negative or non-finite
/// sample is ignored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunningMean {
    skip: u32,
    window: u32,
    seen: u64,
    mean: f64,
}

impl RunningMean {
    /// An empty mean that skips its first `skip` samples and weighs new
    /// ones by `1 / window` (at least 1) once it has counted `window`.
    pub const fn new(skip: u32, window: u32) -> Self {
        Self {
            skip,
            window: if window == 0 { 1 } else { window },
            seen: 0,
            mean: 0.0,
        }
    }

    /// Adds one sample, seconds.
    pub fn add(&mut self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        self.seen = self.seen.saturating_add(1);
        let n = self.samples().min(u64::from(self.window));
        if n > 0 {
            self.mean += (secs - self.mean) / n as f64;
        }
    }

    /// Samples counted so far (the skipped ones not included).
    pub fn samples(&self) -> u64 {
        self.seen.saturating_sub(u64::from(self.skip))
    }

    /// The mean, once at least `warm` samples are counted and it is
    /// positive.
    pub fn mean(&self, warm: u64) -> Option<f64> {
        (self.samples() >= warm.max(1) && self.mean > 0.0).then_some(self.mean)
    }
}

#[cfg(test)]
mod tests {
    use super::RunningMean;

    #[test]
    fn running_means_skip_average_then_follow() {
        let mut m = RunningMean::new(1, 2);
        m.add(9.0); // skipped
        assert_eq!((m.samples(), m.mean(1)), (0, None));
        m.add(1.0);
        m.add(3.0);
        assert_eq!(m.mean(1), Some(2.0));
        assert_eq!(m.mean(3), None, "two samples are not warm at three");
        // Past the window: weight 1/2 each.
        m.add(6.0);
        assert_eq!(m.mean(1), Some(4.0));
        // Bad samples are not samples.
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            m.add(bad);
        }
        assert_eq!((m.samples(), m.mean(1)), (3, Some(4.0)));
        // A zero mean is no price.
        let mut z = RunningMean::new(0, 4);
        z.add(0.0);
        assert_eq!(z.mean(1), None);
    }
}
