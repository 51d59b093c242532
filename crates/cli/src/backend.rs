//! One concrete backend type for the CLI's engine, whatever runs underneath
//! (CPU reference, cudarc, cust), plus an optional tap that records the top
//! log-probabilities of every generated position (`--top-logprobs`).

use qmk_engine::{Backend, BackendKind, MultiStep, MultiStepOutput, StepOutput};

pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Object-safe mirror of [`Backend`] with boxed errors.
trait ErasedBackend {
    fn kind(&self) -> BackendKind;
    fn capacity(&self) -> usize;
    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, BoxError>;
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput, BoxError>;
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, BoxError>;
    fn step_many_position_cost(&self) -> f64;
    fn step_many_cost(&self, positions: usize) -> f64;
    fn logits(&mut self) -> Result<Vec<f32>, BoxError>;
    fn reset(&mut self) -> Result<(), BoxError>;
}

impl<B: Backend> ErasedBackend for B {
    fn kind(&self) -> BackendKind {
        Backend::kind(self)
    }
    fn capacity(&self) -> usize {
        Backend::capacity(self)
    }
    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, BoxError> {
        Backend::step(self, token, pos).map_err(|e| Box::new(e) as BoxError)
    }
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput, BoxError> {
        Backend::prefill(self, tokens, start).map_err(|e| Box::new(e) as BoxError)
    }
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, BoxError> {
        Backend::step_many(self, run).map_err(|e| Box::new(e) as BoxError)
    }
    fn step_many_position_cost(&self) -> f64 {
        Backend::step_many_position_cost(self)
    }
    fn step_many_cost(&self, positions: usize) -> f64 {
        Backend::step_many_cost(self, positions)
    }
    fn logits(&mut self) -> Result<Vec<f32>, BoxError> {
        Backend::logits(self).map_err(|e| Box::new(e) as BoxError)
    }
    fn reset(&mut self) -> Result<(), BoxError> {
        Backend::reset(self).map_err(|e| Box::new(e) as BoxError)
    }
}

/// A backend error, shown as the underlying backend shows it.
#[derive(Debug)]
pub struct AnyError(BoxError);

impl std::fmt::Display for AnyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for AnyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Top-`k` (token id, natural-log probability) per generated position.
pub type TopLogprobs = Vec<Vec<(u32, f32)>>;

struct Tap {
    k: usize,
    /// Logits of positions `>= from_pos` predict generated tokens.
    from_pos: usize,
    /// Entry `i` is position `from_pos + i`'s: a position fed again (a
    /// rejected speculative guess rewritten) replaces its entry and drops
    /// the later ones.
    records: TopLogprobs,
}

impl Tap {
    /// Records `logits` as position `pos`'s, when it picks a generated token.
    fn record(&mut self, pos: usize, logits: &[f32]) {
        if let Some(i) = pos.checked_sub(self.from_pos) {
            self.records.truncate(i);
            self.records.push(top_logprobs(logits, self.k));
        }
    }
}

/// Any backend, erased, with an optional top-logprobs tap.
pub struct AnyBackend {
    inner: Box<dyn ErasedBackend + Send>,
    tap: Option<Tap>,
}

impl AnyBackend {
    pub fn new<B: Backend + Send + 'static>(backend: B) -> Self {
        AnyBackend {
            inner: Box::new(backend),
            tap: None,
        }
    }

    /// Records the top `k` log-probabilities after every step at a position
    /// `>= prompt_len - 1` (each of those picks a generated token). Cleared
    /// by `reset`.
    pub fn record_top_logprobs(&mut self, k: usize, prompt_len: usize) {
        self.tap = (k > 0).then(|| Tap {
            k,
            from_pos: prompt_len.saturating_sub(1),
            records: Vec::new(),
        });
    }

    /// What the tap recorded, one entry per position that picked a token
    /// (a speculative run may leave entries past the last generated token:
    /// keep as many as there are output tokens).
    pub fn take_top_logprobs(&mut self) -> TopLogprobs {
        self.tap
            .as_mut()
            .map(|t| std::mem::take(&mut t.records))
            .unwrap_or_default()
    }
}

impl AnyBackend {
    /// Records the logits of position `pos` when they pick a generated token.
    fn tap_after(&mut self, pos: usize) -> Result<(), AnyError> {
        if let Some(tap) = self.tap.as_mut() {
            if pos >= tap.from_pos {
                let logits = self.inner.logits().map_err(AnyError)?;
                tap.record(pos, &logits);
            }
        }
        Ok(())
    }
}

impl Backend for AnyBackend {
    type Error = AnyError;

    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, AnyError> {
        let out = self.inner.step(token, pos).map_err(AnyError)?;
        self.tap_after(pos)?;
        Ok(out)
    }
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput, AnyError> {
        let out = self.inner.prefill(tokens, start).map_err(AnyError)?;
        if let Some(last) = (start + tokens.len()).checked_sub(1) {
            self.tap_after(last)?;
        }
        Ok(out)
    }
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, AnyError> {
        let Some(tap) = self.tap.as_mut() else {
            return self.inner.step_many(run).map_err(AnyError);
        };
        // The tap needs every position's logits.
        let mut out = self
            .inner
            .step_many(run.with_logits(true))
            .map_err(AnyError)?;
        for i in 0..run.len() {
            if let Some(logits) = out.logits_at(i) {
                tap.record(run.start() + i, logits);
            }
        }
        if !run.wants_logits() {
            out.logits = Vec::new();
        }
        Ok(out)
    }
    fn step_many_position_cost(&self) -> f64 {
        self.inner.step_many_position_cost()
    }
    fn step_many_cost(&self, positions: usize) -> f64 {
        self.inner.step_many_cost(positions)
    }
    fn logits(&mut self) -> Result<Vec<f32>, AnyError> {
        self.inner.logits().map_err(AnyError)
    }
    fn reset(&mut self) -> Result<(), AnyError> {
        if let Some(tap) = self.tap.as_mut() {
            tap.records.clear();
        }
        self.inner.reset().map_err(AnyError)
    }
}

/// The `k` most likely tokens with their log-softmax values, most likely
/// first (lower id first on ties); non-finite logits never appear.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return Vec::new();
    }
    let sum: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    let log_z = max as f64 + sum.ln();
    let k = k.min(logits.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_finite() {
            continue;
        }
        if best.len() == k && best.last().is_some_and(|&(_, w)| v <= w) {
            continue;
        }
        let at = best.partition_point(|&(_, w)| w >= v);
        best.insert(at, (i as u32, v));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(i, v)| (i, (v as f64 - log_z) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_are_sorted_normalised_and_tie_stable() {
        let l = [1.0f32, 3.0, 3.0, f32::NAN, 2.0];
        let t = top_logprobs(&l, 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 4]);
        let z: f64 = [1.0f64, 3.0, 3.0, 2.0].iter().map(|v| v.exp()).sum();
        assert!((t[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-5);
        assert_eq!(top_logprobs(&l, 10).len(), 4);
        assert!(top_logprobs(&[f32::NAN], 2).is_empty());
    }
}
