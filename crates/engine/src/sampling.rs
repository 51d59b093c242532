//! Token selection from logits: greedy, or sampling with a seeded generator
//! so a run can be reproduced exactly.
//!
//! Each step processes the logits `[vocab]` in the order transformers
//! applies its logits processors and warpers (vLLM's sampler agrees on
//! everything but min-p, which it applies before top-k / top-p):
//!
//! 1. penalties, over the raw logits: repetition (every id of the prompt and
//!    the output: a positive logit is divided by the penalty, a negative one
//!    multiplied), then frequency (minus the penalty times how often the id
//!    was generated) and presence (minus the penalty once for every id
//!    generated at least once);
//! 2. temperature: the logits are divided by it; 0 is greedy, the argmax of
//!    the (penalised) logits;
//! 3. top-k: the `k` largest logits stay;
//! 4. top-p: the smallest set of the most likely tokens whose probability
//!    reaches `p` stays;
//! 5. min-p: tokens less likely than `min_p` times the most likely one go;
//! 6. a draw from what is left, renormalised.
//!
//! Greedy decoding with no penalty set is exactly the argmax of the raw
//! logits (the engine then uses the backend's own pick, no logits copy).

use std::collections::{HashMap, HashSet};

use qmk_model::GenerationConfig;

use crate::EngineError;

/// Largest magnitude of the presence and frequency penalties (OpenAI's and
/// vLLM's range).
pub const MAX_ADDITIVE_PENALTY: f32 = 2.0;

/// How the next token is chosen. `temperature == 0` means greedy. Build it
/// from optional request values and the model's defaults with
/// [`SamplingRequest::resolve`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy; otherwise logits are divided by it. Must be finite, >= 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = no limit.
    pub top_k: usize,
    /// Keep the smallest set whose probability mass reaches `top_p`; in (0, 1].
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the largest; in
    /// [0, 1], 0 = off.
    pub min_p: f32,
    /// Divides positive and multiplies negative logits of every id in the
    /// prompt or the output (transformers' and vLLM's meaning); finite and
    /// > 0, 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every id generated so far
    /// (OpenAI's meaning); in [-2, 2], 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every generated id, times how often it
    /// was generated (OpenAI's meaning); in [-2, 2], 0 = off.
    pub frequency_penalty: f32,
    /// Seed of the generator; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Always the most likely token of the raw logits (temperature 0, no
    /// top-k / top-p / min-p, no penalty).
    pub const fn greedy() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// Whether these settings always pick the most likely token (of the
    /// penalised logits, when a penalty is set).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether any penalty changes the logits.
    pub fn has_penalty(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Rejects values that have no meaning, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |field: &'static str, value: f32, must: &str| EngineError::InvalidSampling {
            field,
            reason: format!("{value} (must be {must})"),
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(bad("temperature", self.temperature, "finite and >= 0"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p, "in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", self.min_p, "in [0, 1]"));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(bad(
                "repetition_penalty",
                self.repetition_penalty,
                "finite and > 0",
            ));
        }
        let additive = -MAX_ADDITIVE_PENALTY..=MAX_ADDITIVE_PENALTY;
        if !additive.contains(&self.presence_penalty) {
            return Err(bad("presence_penalty", self.presence_penalty, "in [-2, 2]"));
        }
        if !additive.contains(&self.frequency_penalty) {
            return Err(bad(
                "frequency_penalty",
                self.frequency_penalty,
                "in [-2, 2]",
            ));
        }
        Ok(())
    }
}

/// The model's sampling defaults: what its `generation_config.json` asks
/// for, for the values a request leaves unset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: usize,
    /// 1: no limit.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// 1: off.
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults::GREEDY
    }
}

impl SamplingDefaults {
    /// Greedy, nothing else set: transformers' defaults, used when a model
    /// ships no `generation_config.json` or sets `do_sample` false.
    pub const GREEDY: SamplingDefaults = SamplingDefaults {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };

    /// The defaults a `generation_config.json` sets: with `do_sample` true
    /// its temperature (1 when absent), top_k, top_p, min_p and
    /// repetition_penalty, each neutral when absent; with `do_sample` false
    /// (or absent), greedy. The model crate has checked the ranges.
    pub fn from_generation_config(g: &GenerationConfig) -> SamplingDefaults {
        if !g.do_sample {
            return SamplingDefaults::GREEDY;
        }
        let n = SamplingDefaults::GREEDY;
        SamplingDefaults {
            temperature: g.temperature.map_or(1.0, |v| v as f32),
            top_k: g.top_k.unwrap_or(n.top_k),
            top_p: g.top_p.map_or(n.top_p, |v| v as f32),
            min_p: g.min_p.map_or(n.min_p, |v| v as f32),
            repetition_penalty: g
                .repetition_penalty
                .map_or(n.repetition_penalty, |v| v as f32),
        }
    }
}

/// Sampling values as a caller gives them (command-line flags, the fields
/// of an API request): each may be left unset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingRequest {
    /// `temperature`; 0 asks for greedy decoding.
    pub temperature: Option<f32>,
    /// `top_k`; 0 = no limit.
    pub top_k: Option<usize>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
    /// `seed`; unset draws a random one ([`random_seed`]), which the
    /// resolved [`Sampling::seed`] reports.
    pub seed: Option<u64>,
}

impl SamplingRequest {
    /// The settings to run: each value the request sets, else the model's
    /// default, else neutral; then checked ([`Sampling::validate`]).
    ///
    /// Greedy decoding (a temperature of 0, given or by default) takes none
    /// of the model's defaults, so it is the argmax of the raw logits unless
    /// the request itself sets a penalty. (transformers and vLLM would apply
    /// a `repetition_penalty` from the model's file there too; here greedy
    /// output stays comparable with every other engine's greedy output.)
    pub fn resolve(&self, defaults: &SamplingDefaults) -> Result<Sampling, EngineError> {
        let temperature = self.temperature.unwrap_or(defaults.temperature);
        let model = if temperature == 0.0 {
            SamplingDefaults::GREEDY
        } else {
            *defaults
        };
        let s = Sampling {
            temperature,
            top_k: self.top_k.unwrap_or(model.top_k),
            top_p: self.top_p.unwrap_or(model.top_p),
            min_p: self.min_p.unwrap_or(model.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(model.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.unwrap_or_else(random_seed),
        };
        s.validate()?;
        Ok(s)
    }
}

/// A fresh seed from the operating system's randomness (through std's
/// randomly keyed hasher: no dependency), below 2^53 so that it survives a
/// JSON number read as a double.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.finish() & ((1u64 << 53) - 1)
}

/// What the penalties look at: every id of the prompt and the output so far
/// (repetition) and how often each id was generated (presence, frequency).
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    seen: HashSet<u32>,
    generated: HashMap<u32, u32>,
}

impl TokenHistory {
    /// A history holding the prompt's ids.
    pub fn new(prompt: &[u32]) -> Self {
        TokenHistory {
            seen: prompt.iter().copied().collect(),
            generated: HashMap::new(),
        }
    }

    /// Records a generated id.
    pub fn push(&mut self, id: u32) {
        self.seen.insert(id);
        *self.generated.entry(id).or_insert(0) += 1;
    }
}

/// Applies `s`'s penalties to `logits` `[vocab]` in place (step 1 of the
/// module's order). Ids past the end of `logits` are ignored.
pub fn apply_penalties(logits: &mut [f32], s: &Sampling, history: &TokenHistory) {
    if s.repetition_penalty != 1.0 {
        let r = s.repetition_penalty;
        for &id in &history.seen {
            if let Some(l) = logits.get_mut(id as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if s.presence_penalty != 0.0 || s.frequency_penalty != 0.0 {
        for (&id, &n) in &history.generated {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= s.frequency_penalty * n as f32 + s.presence_penalty;
            }
        }
    }
}

/// Picks the next token: the penalties applied to `logits` `[vocab]` (in
/// place), then greedy or [`sample`].
pub fn choose(logits: &mut [f32], s: &Sampling, history: &TokenHistory, rng: &mut Rng) -> u32 {
    apply_penalties(logits, s, history);
    if s.is_greedy() {
        argmax(logits)
    } else {
        sample(logits, s, rng)
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

/// The distribution a sampling step draws from: steps 2 to 5 of the
/// module's order over `logits` `[vocab]` (already penalised), as
/// `(id, probability)` pairs, most likely first (ties by id), probabilities
/// summing to 1. Non-finite logits never take part; empty when none is
/// finite. Not meant for greedy settings (temperature 0).
pub fn candidates(logits: &[f32], s: &Sampling) -> Vec<(u32, f64)> {
    // Candidates sorted by logit, descending; ties by index for determinism.
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    if idx.is_empty() {
        return Vec::new();
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
    normalise(&mut probs);
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
        normalise(&mut probs);
    }
    if s.min_p > 0.0 {
        // probs[0] is the largest; it always stays.
        let floor = s.min_p as f64 * probs[0];
        let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        probs.truncate(keep);
        normalise(&mut probs);
    }
    idx.into_iter().zip(probs).collect()
}

fn normalise(probs: &mut [f64]) {
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
}

/// Picks a token from `logits` `[vocab]` (already penalised) under `s`,
/// drawing from `rng`: the argmax for greedy settings, else a draw from
/// [`candidates`].
pub fn sample(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    if s.is_greedy() {
        return argmax(logits);
    }
    let cands = candidates(logits, s);
    let Some(&(last, _)) = cands.last() else {
        return argmax(logits);
    };
    let mut r = rng.next_f64();
    for &(id, p) in &cands {
        if r < p {
            return id;
        }
        r -= p;
    }
    last
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
            ..Sampling::greedy()
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
            ..Sampling::greedy()
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
            ..Sampling::greedy()
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
            ..Sampling::greedy()
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

    fn sampling(temperature: f32) -> Sampling {
        Sampling {
            temperature,
            ..Sampling::greedy()
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() {
        let mut l = vec![2.0f32, -2.0, 3.0, -1.0, 0.0, 4.0];
        let s = Sampling {
            repetition_penalty: 2.0,
            ..Sampling::greedy()
        };
        // Prompt 0, 1, 4 (repeated ids count once); generated 3; 2 and 5 unseen;
        // 99 is past the vocabulary and ignored.
        let mut h = TokenHistory::new(&[0, 1, 4, 0, 99]);
        h.push(3);
        h.push(3);
        apply_penalties(&mut l, &s, &h);
        assert_eq!(l, vec![1.0, -4.0, 3.0, -2.0, 0.0, 4.0]);
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_ids_only() {
        let mut l = vec![1.0f32; 5];
        let s = Sampling {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Sampling::greedy()
        };
        // Id 0 is in the prompt only: untouched. 1 generated 3 times, 2 once.
        let mut h = TokenHistory::new(&[0, 1]);
        for id in [1, 2, 1, 1] {
            h.push(id);
        }
        apply_penalties(&mut l, &s, &h);
        assert_eq!(l, vec![1.0, 1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0, 1.0]);
        // Negative values reward repetition.
        let mut l = vec![1.0f32; 3];
        let s = Sampling {
            presence_penalty: -1.0,
            ..Sampling::greedy()
        };
        apply_penalties(&mut l, &s, &h);
        assert_eq!(l, vec![1.0, 2.0, 2.0]);
    }

    #[test]
    fn repetition_comes_before_the_additive_penalties() {
        // (4 / 2) - 1 = 1; the other order would give (4 - 1) / 2 = 1.5.
        let mut l = vec![4.0f32];
        let s = Sampling {
            repetition_penalty: 2.0,
            presence_penalty: 1.0,
            ..Sampling::greedy()
        };
        let mut h = TokenHistory::new(&[]);
        h.push(0);
        apply_penalties(&mut l, &s, &h);
        assert_eq!(l, vec![1.0]);
    }

    #[test]
    fn greedy_without_penalty_is_the_raw_argmax_and_with_one_the_penalised() {
        let mut rng = Rng::new(0);
        let raw = [5.0f32, 4.0, -1.0];
        let mut h = TokenHistory::new(&[0]);
        let mut l = raw;
        assert_eq!(choose(&mut l, &Sampling::greedy(), &h, &mut rng), 0);
        assert_eq!(l, raw, "no penalty: the logits are untouched");
        let s = Sampling {
            repetition_penalty: 1.5,
            ..Sampling::greedy()
        };
        assert!(s.is_greedy() && s.has_penalty());
        let mut l = raw;
        // 5 / 1.5 < 4: the penalised argmax is id 1.
        assert_eq!(choose(&mut l, &s, &h, &mut rng), 1);
        h.push(1);
        let mut l = raw;
        // Both penalised: 5 / 1.5 > 4 / 1.5.
        assert_eq!(choose(&mut l, &s, &h, &mut rng), 0);
    }

    #[test]
    fn min_p_keeps_tokens_at_least_min_p_times_the_most_likely() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 (logits are log2 steps).
        let l: Vec<f32> = [8.0f32, 4.0, 2.0, 2.0].iter().map(|p| p.ln()).collect();
        let ids = |s: &Sampling| candidates(&l, s).iter().map(|c| c.0).collect::<Vec<_>>();
        let mut s = sampling(1.0);
        assert_eq!(ids(&s), vec![0, 1, 2, 3]);
        s.min_p = 0.45; // floor 0.225: 0.25 stays, 0.125 goes
        assert_eq!(ids(&s), vec![0, 1]);
        let c = candidates(&l, &s);
        assert!((c[0].1 - 2.0 / 3.0).abs() < 1e-6 && (c[1].1 - 1.0 / 3.0).abs() < 1e-6);
        s.min_p = 0.55;
        assert_eq!(ids(&s), vec![0]);
        s.min_p = 1.0; // only the most likely (and its ties) stay
        assert_eq!(ids(&s), vec![0]);
        s.min_p = 0.2;
        assert_eq!(ids(&s), vec![0, 1, 2, 3]);
        // Temperature comes first: at T = 0.5 the probabilities are
        // 16:4:1:1, so min_p 0.2 keeps only the first two.
        s.temperature = 0.5;
        s.min_p = 0.2;
        assert_eq!(ids(&s), vec![0, 1]);
        // And sampling never leaves the kept set.
        let mut rng = Rng::new(9);
        assert!((0..500).all(|_| sample(&l, &s, &mut rng) <= 1));
    }

    #[test]
    fn top_k_then_top_p_then_min_p() {
        // Probabilities 0.4, 0.3, 0.2, 0.1.
        let l: Vec<f32> = [4.0f32, 3.0, 2.0, 1.0].iter().map(|p| p.ln()).collect();
        let ids = |s: &Sampling| candidates(&l, s).iter().map(|c| c.0).collect::<Vec<_>>();
        // top-p 0.75 over all four keeps 0.4 + 0.3 + 0.2 (reaches 0.9).
        let s = Sampling {
            top_p: 0.75,
            ..sampling(1.0)
        };
        assert_eq!(ids(&s), vec![0, 1, 2]);
        // top-k 2 first renormalises to 4/7, 3/7: top-p 0.5 then keeps one.
        // The other order (top-p first) would keep two.
        let s = Sampling {
            top_k: 2,
            top_p: 0.5,
            ..sampling(1.0)
        };
        assert_eq!(ids(&s), vec![0]);
        // top-p 0.95 keeps all four; min-p 0.6 then drops 0.2 and 0.1
        // (below 0.6 x 0.4).
        let s = Sampling {
            top_p: 0.95,
            min_p: 0.6,
            ..sampling(1.0)
        };
        assert_eq!(ids(&s), vec![0, 1]);
        // Non-finite logits never take part.
        let l2 = [f32::NAN, 1.0, f32::NEG_INFINITY, 0.5];
        let c: Vec<u32> = candidates(&l2, &sampling(1.0))
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(c, vec![1, 3]);
        assert!(candidates(&[f32::NAN], &sampling(1.0)).is_empty());
    }

    #[test]
    fn every_new_field_is_validated_by_name() {
        type Set = fn(&mut Sampling);
        let cases: [(&str, Set); 10] = [
            ("min_p", |s| s.min_p = -0.1),
            ("min_p", |s| s.min_p = 1.5),
            ("min_p", |s| s.min_p = f32::NAN),
            ("repetition_penalty", |s| s.repetition_penalty = 0.0),
            ("repetition_penalty", |s| s.repetition_penalty = -1.0),
            ("repetition_penalty", |s| {
                s.repetition_penalty = f32::INFINITY
            }),
            ("presence_penalty", |s| s.presence_penalty = 2.5),
            ("presence_penalty", |s| s.presence_penalty = f32::NAN),
            ("frequency_penalty", |s| s.frequency_penalty = -2.01),
            ("frequency_penalty", |s| {
                s.frequency_penalty = f32::NEG_INFINITY
            }),
        ];
        for (field, set) in cases {
            let mut s = Sampling::greedy();
            set(&mut s);
            match s.validate() {
                Err(EngineError::InvalidSampling { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected InvalidSampling, got {other:?}"),
            }
        }
        let edges = Sampling {
            min_p: 1.0,
            repetition_penalty: 1e-3,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            ..Sampling::greedy()
        };
        edges.validate().unwrap();
    }

    fn sampling_config() -> GenerationConfig {
        // Qwen2.5 instruct models' generation_config.json values.
        GenerationConfig {
            do_sample: true,
            temperature: Some(0.7),
            top_k: Some(20),
            top_p: Some(0.8),
            repetition_penalty: Some(1.1),
            ..GenerationConfig::default()
        }
    }

    #[test]
    fn defaults_come_from_the_generation_config_when_it_samples() {
        let d = SamplingDefaults::from_generation_config(&sampling_config());
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: 0.7,
                top_k: 20,
                top_p: 0.8,
                min_p: 0.0,
                repetition_penalty: 1.1,
            }
        );
        let greedy_file = GenerationConfig {
            do_sample: false,
            ..sampling_config()
        };
        assert_eq!(
            SamplingDefaults::from_generation_config(&greedy_file),
            SamplingDefaults::GREEDY
        );
        assert_eq!(
            SamplingDefaults::from_generation_config(&GenerationConfig::default()),
            SamplingDefaults::GREEDY
        );
        // do_sample with nothing else: temperature 1, the rest neutral.
        let bare = GenerationConfig {
            do_sample: true,
            min_p: Some(0.05),
            ..GenerationConfig::default()
        };
        let d = SamplingDefaults::from_generation_config(&bare);
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (1.0, 0, 1.0, 0.05)
        );
    }

    #[test]
    fn a_request_overrides_each_default_and_greedy_takes_none() {
        let d = SamplingDefaults::from_generation_config(&sampling_config());
        let s = SamplingRequest {
            seed: Some(3),
            ..Default::default()
        }
        .resolve(&d)
        .unwrap();
        assert_eq!(
            (
                s.temperature,
                s.top_k,
                s.top_p,
                s.repetition_penalty,
                s.seed
            ),
            (0.7, 20, 0.8, 1.1, 3)
        );
        let s = SamplingRequest {
            temperature: Some(1.2),
            top_k: Some(0),
            repetition_penalty: Some(1.0),
            presence_penalty: Some(0.5),
            ..Default::default()
        }
        .resolve(&d)
        .unwrap();
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.repetition_penalty),
            (1.2, 0, 0.8, 1.0)
        );
        assert_eq!((s.presence_penalty, s.frequency_penalty), (0.5, 0.0));
        // Temperature 0: the raw argmax, none of the model's values...
        let s = SamplingRequest {
            temperature: Some(0.0),
            ..Default::default()
        }
        .resolve(&d)
        .unwrap();
        assert!(s.is_greedy() && !s.has_penalty());
        assert_eq!((s.top_k, s.top_p), (0, 1.0));
        // ...unless the request sets a penalty itself.
        let s = SamplingRequest {
            temperature: Some(0.0),
            repetition_penalty: Some(1.3),
            ..Default::default()
        }
        .resolve(&d)
        .unwrap();
        assert_eq!(s.repetition_penalty, 1.3);
        // Without a sampling file the default is greedy.
        let s = SamplingRequest::default()
            .resolve(&SamplingDefaults::GREEDY)
            .unwrap();
        assert!(s.is_greedy() && !s.has_penalty());
        // The resolved values are checked, naming the field.
        let e = SamplingRequest {
            min_p: Some(2.0),
            ..Default::default()
        }
        .resolve(&d)
        .unwrap_err();
        assert!(e.to_string().contains("min_p"), "{e}");
    }

    #[test]
    fn unset_seeds_are_drawn_and_fit_a_double() {
        let seeds: Vec<u64> = (0..8)
            .map(|_| {
                SamplingRequest::default()
                    .resolve(&SamplingDefaults::GREEDY)
                    .unwrap()
                    .seed
            })
            .collect();
        assert!(seeds.iter().all(|&s| s < 1 << 53));
        let mut unique = seeds.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), seeds.len(), "{seeds:?}");
    }
}
