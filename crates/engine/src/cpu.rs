//! The CPU reference as a [`Backend`]: the oracle, and the fallback where
//! there is no GPU.

use std::sync::Arc;

use qmk_model::reference::{Reference, ReferenceOptions};
use qmk_model::{ModelError, Weights};

use crate::sampling::argmax;
use crate::{Backend, BackendKind, StepOutput};

/// Runs the plain f32 reference forward pass on the host.
pub struct CpuBackend {
    reference: Reference,
    logits: Vec<f32>, // [V] of the last step
}

impl CpuBackend {
    /// A CPU backend over `weights` with a KV cache of `capacity` positions.
    pub fn new(weights: Arc<Weights>, capacity: usize) -> Result<Self, ModelError> {
        Self::with_options(weights, ReferenceOptions::new(capacity))
    }

    /// As [`CpuBackend::new`], with the reference's own options (e.g. a bf16
    /// KV cache to mirror the GPU kernel).
    pub fn with_options(weights: Arc<Weights>, opts: ReferenceOptions) -> Result<Self, ModelError> {
        Ok(CpuBackend {
            reference: Reference::new(weights, opts)?,
            logits: Vec::new(),
        })
    }

    /// The reference forward pass underneath (its KV cache, options).
    pub fn reference(&self) -> &Reference {
        &self.reference
    }
}

impl Backend for CpuBackend {
    type Error = ModelError;

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn capacity(&self) -> usize {
        self.reference.capacity()
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, ModelError> {
        self.logits = self.reference.step(token, pos)?;
        Ok(StepOutput {
            argmax: argmax(&self.logits),
        })
    }

    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<StepOutput, ModelError> {
        // One batched pass over the prompt: matrix-matrix products.
        self.logits = self.reference.prefill_seq(0, tokens, start)?;
        Ok(StepOutput {
            argmax: argmax(&self.logits),
        })
    }

    fn logits(&mut self) -> Result<Vec<f32>, ModelError> {
        Ok(self.logits.clone())
    }

    fn reset(&mut self) -> Result<(), ModelError> {
        // Positions are rewritten from 0 by the next prompt; nothing to clear.
        self.logits.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::ops::ControlFlow;

    use super::*;
    use crate::{Engine, GenerateOptions};

    fn tiny() -> Arc<Weights> {
        let mut c = qmk_model::Config::preset("0.5b").unwrap();
        c.hidden_size = 64;
        c.intermediate_size = 96;
        c.num_hidden_layers = 2;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(16);
        c.vocab_size = 300;
        Arc::new(qmk_model::synthetic_weights(&c, 42))
    }

    #[test]
    fn engine_on_cpu_matches_the_reference_greedy_loop() {
        let w = tiny();
        let prompt = [5u32, 17, 250, 3];
        let want = Reference::new(w.clone(), ReferenceOptions::new(64))
            .unwrap()
            .generate_greedy(&prompt, 12)
            .unwrap();
        let mut e = Engine::new(CpuBackend::new(w.clone(), 64).unwrap(), 300);
        let opts = GenerateOptions {
            max_new_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        };
        let got = e
            .generate(&prompt, &opts, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(got.output_ids, want);
        // A second request reuses the backend from position 0.
        let again = e
            .generate(&prompt, &opts, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(again.output_ids, want);
    }

    #[test]
    fn batched_prefill_equals_step_by_step() {
        let w = tiny();
        let prompt = [1u32, 2, 3, 4, 5, 6, 7];
        let mut a = CpuBackend::new(w.clone(), 16).unwrap();
        let mut b = CpuBackend::new(w, 16).unwrap();
        let pa = a.prefill(&prompt, 0).unwrap();
        let mut pb = StepOutput { argmax: 0 };
        for (i, &t) in prompt.iter().enumerate() {
            pb = b.step(t, i).unwrap();
        }
        assert_eq!(pa, pb);
        let (la, lb) = (a.logits().unwrap(), b.logits().unwrap());
        let err = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-3, "max |prefill - steps| = {err}");
    }
}
