//! The one interface all decoders implement.

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

/// What one decode step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutput {
    /// Greedy pick (argmax of the logits, lowest index on ties).
    pub argmax: u32,
}

/// One decode step at a time over a KV cache the backend owns.
///
/// Contract: `step(token, pos)` embeds `token`, runs every layer at position
/// `pos` (writing K/V for `pos` into the cache, attending over `0..=pos`), and
/// leaves the logits of that position readable through [`Backend::logits`].
/// Positions must be fed in order starting at 0 after [`Backend::reset`].
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

    /// Logits `[vocab]` of the last step.
    fn logits(&mut self) -> Result<Vec<f32>, Self::Error>;

    /// Forget the cache: the next step starts at position 0.
    fn reset(&mut self) -> Result<(), Self::Error>;
}
