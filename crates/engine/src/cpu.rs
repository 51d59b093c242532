//! The CPU reference as a [`Backend`]: the oracle, and the fallback where
//! there is no GPU.

use std::sync::Arc;

use qmk_model::reference::{Logits, Reference, ReferenceOptions, Row};
use qmk_model::{ModelError, ShardedReference, Weights};

use crate::sampling::argmax;
use crate::{Backend, BackendKind, MultiStep, MultiStepOutput, StepOutput};

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

    /// One forward pass over the `T` rows: every matmul streams each weight
    /// row from memory once for all of them. The reference's matmul sums
    /// every output in the same order whatever rows share the call, and its
    /// other ops work row by row, so each position's logits equal a single
    /// step's bit for bit.
    fn step_many(&mut self, run: MultiStep<'_>) -> Result<MultiStepOutput, ModelError> {
        let rows: Vec<Row> = run
            .tokens()
            .iter()
            .enumerate()
            .map(|(i, &token)| Row {
                seq: 0,
                token,
                pos: run.start() + i,
            })
            .collect(); // [T]
        let logits = self.reference.forward(&rows, Logits::All, None)?; // [T, V]
        let v = logits.len() / rows.len();
        let argmax = logits.chunks_exact(v).map(argmax).collect();
        self.logits = logits[logits.len() - v..].to_vec();
        Ok(MultiStepOutput {
            argmax,
            logits: if run.wants_logits() {
                logits
            } else {
                Vec::new()
            },
        })
    }

    /// On a CPU each row of a multi-token step costs compute: 0.07 to 0.65
    /// of a step per extra position, median 0.35, was measured in two runs
    /// with the 0.5B on two busy cores (`cargo run --release -p qmk-engine
    /// --example speculate_cpu`).
    fn step_many_position_cost(&self) -> f64 {
        0.35
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

/// The CPU reference split over the ranks of a tensor-parallel group
/// ([`ShardedReference`]: each rank's shards, the all-reduces summed in rank
/// order): what `--tp N` runs without a GPU, with the GPU group's numerics.
pub struct CpuTpBackend {
    reference: ShardedReference,
    capacity: usize,
    logits: Vec<f32>, // [V] of the last step
}

impl CpuTpBackend {
    /// `weights` split over `ranks` ranks with KV caches of `capacity`
    /// positions (refused, naming the field, when the model does not split
    /// that way).
    pub fn new(weights: Arc<Weights>, ranks: usize, capacity: usize) -> Result<Self, ModelError> {
        Ok(CpuTpBackend {
            reference: ShardedReference::new(weights, ranks, capacity)?,
            capacity,
            logits: Vec::new(),
        })
    }

    /// Ranks in the group.
    pub fn ranks(&self) -> usize {
        self.reference.ranks()
    }
}

impl Backend for CpuTpBackend {
    type Error = ModelError;

    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, token: u32, pos: usize) -> Result<StepOutput, ModelError> {
        self.logits = self.reference.step(token, pos)?;
        Ok(StepOutput {
            argmax: argmax(&self.logits),
        })
    }

    fn logits(&mut self) -> Result<Vec<f32>, ModelError> {
        Ok(self.logits.clone())
    }

    fn reset(&mut self) -> Result<(), ModelError> {
        // Positions are rewritten from 0 by the next prompt.
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
        tiny_with(2, true)
    }

    /// The tiny model with `kv_heads` KV heads for its 4 query heads, tied
    /// or untied embeddings.
    fn tiny_with(kv_heads: usize, tied: bool) -> Arc<Weights> {
        let mut c = crate::test_models::tiny_config(64, 96, 16, 300);
        c.num_key_value_heads = Some(kv_heads);
        c.tie_word_embeddings = tied;
        Arc::new(qmk_model::synthetic_weights(&c, 42))
    }

    /// Token `i` of a fixed pseudo-random sequence (ids below 300).
    fn token(i: usize) -> u32 {
        ((i * 7919 + 13) % 300) as u32
    }

    /// Logits `[V]` of single steps over `tokens` at `start..`, after the
    /// positions before `start` were fed one by one.
    fn stepwise(b: &mut CpuBackend, tokens: &[u32], start: usize) -> Vec<Vec<f32>> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                b.step(t, start + i).unwrap();
                b.logits().unwrap()
            })
            .collect()
    }

    #[test]
    fn multi_step_is_bit_identical_to_single_steps() {
        let cases = [(2, true, false), (1, false, false), (4, true, true)];
        for (kv_heads, tied, kv_bf16) in cases {
            let w = tiny_with(kv_heads, tied);
            let opts = ReferenceOptions::new(64).kv_bf16(kv_bf16);
            for start in [0usize, 1, 5, 13, 50] {
                let history: Vec<u32> = (0..start).map(token).collect();
                for t in 1..=crate::MAX_STEP_TOKENS {
                    let run: Vec<u32> = (start..start + t).map(token).collect();
                    let mut single = CpuBackend::with_options(w.clone(), opts).unwrap();
                    let mut many = CpuBackend::with_options(w.clone(), opts).unwrap();
                    stepwise(&mut single, &history, 0);
                    stepwise(&mut many, &history, 0);
                    let want = stepwise(&mut single, &run, start);
                    let step = MultiStep::new(&run, start, 64).unwrap();
                    let got = many.step_many(step.with_logits(true)).unwrap();
                    let what = format!(
                        "kv_heads {kv_heads} tied {tied} bf16 {kv_bf16} start {start} T {t}"
                    );
                    assert_eq!(got.argmax.len(), t, "{what}");
                    for (i, w) in want.iter().enumerate() {
                        assert!(got.logits_at(i).unwrap() == &w[..], "{what}: position {i}");
                        assert_eq!(got.argmax[i], argmax(w), "{what}: position {i}");
                    }
                    assert_eq!(many.logits().unwrap(), want[t - 1], "{what}: last logits");
                    // Only the picks unless the logits are asked for.
                    let again = many.step_many(step).unwrap();
                    assert!(again.logits.is_empty() && again.logits_at(0).is_none());
                    assert_eq!(again.argmax, got.argmax, "{what}: rewritten in place");
                }
            }
        }
    }

    #[test]
    fn a_run_across_the_end_of_a_long_prompt_rewrites_its_tail() {
        // A 200-token prompt prefilled in one pass; a run starting 3 tokens
        // before its end rewrites those positions with other tokens and goes
        // 5 past it, as single steps over the same tokens do.
        let w = tiny();
        let prompt: Vec<u32> = (0..200).map(token).collect();
        let run: Vec<u32> = (1000..1008).map(token).collect();
        let mut single = CpuBackend::new(w.clone(), 256).unwrap();
        let mut many = CpuBackend::new(w.clone(), 256).unwrap();
        single.prefill(&prompt, 0).unwrap();
        many.prefill(&prompt, 0).unwrap();
        let want = stepwise(&mut single, &run, 197);
        let got = many
            .step_many(MultiStep::new(&run, 197, 256).unwrap().with_logits(true))
            .unwrap();
        for (i, w) in want.iter().enumerate() {
            assert!(got.logits_at(i).unwrap() == &w[..], "position {}", 197 + i);
        }
        // Backing up into the run: continuing at 197 + 3 gives what a fresh
        // cache holding only the accepted tokens gives.
        let next = many.step(token(5), 200).unwrap();
        let mut fresh = CpuBackend::new(w, 256).unwrap();
        let mut accepted = prompt[..197].to_vec();
        accepted.extend_from_slice(&run[..3]);
        fresh.prefill(&accepted, 0).unwrap();
        assert_eq!(fresh.step(token(5), 200).unwrap(), next);
        assert_eq!(fresh.logits().unwrap(), many.logits().unwrap());
    }

    #[test]
    fn batched_prefill_is_bit_identical_too() {
        // The same property for the prompt: the matmul's sums do not depend
        // on the batch, so the first generated token cannot depend on it.
        let w = tiny_with(1, false);
        let prompt: Vec<u32> = (0..37).map(token).collect();
        let mut a = CpuBackend::new(w.clone(), 64).unwrap();
        let mut b = CpuBackend::new(w, 64).unwrap();
        a.prefill(&prompt, 0).unwrap();
        let last = stepwise(&mut b, &prompt, 0).pop().unwrap();
        assert_eq!(a.logits().unwrap(), last);
    }

    #[test]
    fn bad_multi_steps_are_named_errors() {
        let field = |r: Result<MultiStep<'_>, crate::EngineError>| match r {
            Err(crate::EngineError::InvalidStep { field, .. }) => field,
            other => panic!("not an InvalidStep error: {other:?}"),
        };
        assert_eq!(field(MultiStep::new(&[], 0, 16)), "tokens");
        assert_eq!(field(MultiStep::new(&[1; 9], 0, 16)), "tokens");
        assert_eq!(field(MultiStep::new(&[1; 4], 13, 16)), "start");
        assert_eq!(field(MultiStep::new(&[1; 2], usize::MAX, 16)), "start");
        assert!(MultiStep::new(&[1; 8], 8, 16).is_ok());
        let e = MultiStep::new(&[1; 4], 13, 16).unwrap_err().to_string();
        assert!(e.contains("13") && e.contains("16"), "{e}");
        // The backend checks what it alone knows: the vocabulary, and its
        // own capacity when a run was built for another.
        let mut b = CpuBackend::new(tiny(), 16).unwrap();
        let bad_token = b.step_many(MultiStep::new(&[1, 300], 0, 16).unwrap());
        assert!(matches!(
            bad_token,
            Err(ModelError::TokenOutOfVocab { token: 300, .. })
        ));
        let too_far = b.step_many(MultiStep::new(&[1, 2], 15, 32).unwrap());
        assert!(matches!(
            too_far,
            Err(ModelError::PositionOutOfRange { pos: 16, .. })
        ));
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
    fn engine_on_the_cpu_group_matches_its_sharded_reference_and_refuses_bad_groups() {
        // 2 KV heads: 2 ranks split them; 4 do not.
        let w = tiny_with(2, false);
        let prompt = [5u32, 17, 250, 3];
        let want = ShardedReference::new(w.clone(), 2, 64)
            .unwrap()
            .generate_greedy(&prompt, 12)
            .unwrap();
        let group = CpuTpBackend::new(w.clone(), 2, 64).unwrap();
        assert_eq!((group.ranks(), group.capacity()), (2, 64));
        let mut e = Engine::new(group, 300);
        let opts = GenerateOptions {
            max_new_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        };
        for _ in 0..2 {
            let got = e
                .generate(&prompt, &opts, |_| ControlFlow::Continue(()))
                .unwrap();
            assert_eq!(got.output_ids, want);
        }
        let bad = CpuTpBackend::new(w, 4, 64).err().unwrap().to_string();
        assert!(bad.contains("num_key_value_heads"), "{bad}");
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
