//! Token selection from logits: greedy, or temperature / top-k / top-p with a
//! seeded generator so a run can be reproduced exactly.

use crate::EngineError;

/// How the next token is chosen. `temperature == 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy; otherwise logits are divided by it. Must be finite, >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = no limit.
    pub top_k: usize,
    /// Keep the smallest set whose probability mass reaches `top_p`; in (0, 1].
    pub top_p: f32,
    /// Seed of the generator; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Always the most likely token (temperature 0, no top-k / top-p).
    pub const fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Whether these settings always pick the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Rejects values that have no meaning, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(EngineError::InvalidSampling {
                field: "temperature",
                reason: format!("{} (must be finite and >= 0)", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidSampling {
                field: "top_p",
                reason: format!("{} (must be in (0, 1])", self.top_p),
            });
        }
        Ok(())
    }
}

/// Index of the largest value; the lowest index wins ties, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// A small, fast, seedable generator (SplitMix64): no dependency, identical on
/// every platform, so `--seed` reproduces a run anywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks a token from `logits` `[vocab]` under `s`, drawing from `rng`.
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    if s.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    // Candidates sorted by logit, descending; ties by index for determinism.
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    idx.sort_unstable_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    if s.top_k > 0 && idx.len() > s.top_k {
        idx.truncate(s.top_k);
    }
    let inv_t = 1.0 / s.temperature as f64;
    let max = logits[idx[0] as usize] as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if s.top_p < 1.0 {
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (n, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= s.top_p as f64 {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut r = rng.next_f64();
    for (n, p) in probs.iter().enumerate() {
        if r < *p {
            return idx[n];
        }
        r -= p;
    }
    *idx.last().expect("non-empty candidate list")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_lowest_index_on_ties_and_ignores_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.25]), 1);
    }

    #[test]
    fn greedy_equals_argmax() {
        let l = [0.1, 2.0, -1.0, 1.9];
        let mut rng = Rng::new(1);
        assert_eq!(sample(&l, &Sampling::greedy(), &mut rng), 1);
        let top1 = Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 0,
        };
        assert_eq!(sample(&l, &top1, &mut rng), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_respected() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let s = Sampling {
            temperature: 1.5,
            top_k: 5,
            top_p: 1.0,
            seed: 7,
        };
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let allowed = &order[..5];
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..200)
                .map(|_| sample(&logits, &s, &mut rng))
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert!(a.iter().all(|t| allowed.contains(t)));
        assert_ne!(a, run(8));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds almost all the mass: top_p 0.5 must always pick it.
        let mut logits = vec![0.0f32; 50];
        logits[17] = 20.0;
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 3,
        };
        let mut rng = Rng::new(3);
        assert!((0..100).all(|_| sample(&logits, &s, &mut rng) == 17));
    }

    #[test]
    fn sampling_distribution_follows_softmax() {
        // Two tokens with logits ln(3) and 0: probabilities 0.75 / 0.25.
        let logits = [3f32.ln(), 0.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 11,
        };
        let mut rng = Rng::new(11);
        let n = 20_000;
        let zeros = (0..n)
            .filter(|_| sample(&logits, &s, &mut rng) == 0)
            .count();
        let frac = zeros as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let mut s = Sampling::greedy();
        s.temperature = -1.0;
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        s.temperature = f32::NAN;
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        s.temperature = 1.0;
        s.top_p = 0.0;
        assert!(s.validate().unwrap_err().to_string().contains("top_p"));
        s.top_p = 1.5;
        assert!(s.validate().unwrap_err().to_string().contains("top_p"));
    }
}
