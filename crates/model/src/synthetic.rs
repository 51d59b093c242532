//! Deterministic synthetic weights for any config, so GPU tests can run at
//! full real shapes (7B, 14B, 32B) without shipping a checkpoint.
//!
//! # The function (specified so a CUDA twin can reproduce it bit for bit)
//!
//! Element `i` (row-major linear index into the *stacked* tensor, e.g.
//! `i = (l * I + n) * H + k` for `gate_proj[l, n, k]`) of the tensor of kind
//! `t` ([`WeightKind::index`], 0..15 in [`WeightKind::ALL`] order) is, with
//! all integer arithmetic wrapping mod 2^64:
//!
//! ```text
//! GOLDEN   = 0x9E3779B97F4A7C15
//! mix64(z) = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;      // splitmix64's
//!            z ^= z >> 27; z *= 0x94D049BB133111EB;      // finaliser
//!            z ^ (z >> 31)
//! key      = mix64(seed ^ mix64((t + 1) * GOLDEN))       // per tensor
//! bits     = mix64(key + (i + 1) * GOLDEN)               // per element
//! u        = (float)(bits >> 40) * 2^-23 - 1.0f          // exact, in [-1, 1)
//! value    = bf16_rn(center + scale * u)                 // f32 mul, then f32 add,
//!                                                        // each rounded (no FMA)
//! ```
//!
//! `center` and `scale` per tensor come from [`synthetic_params`] (f32
//! values computed on the host; pass them to the twin rather than
//! recomputing the square roots). In CUDA: `__fadd_rn(center,
//! __fmul_rn(scale, u))` then `__float2bfloat16_rn` (nvcc would otherwise
//! contract to an FMA and differ in the last bit).
//!
//! # Scales: why activations stay O(1) and logits are not flat
//!
//! - norms `1 +- 0.1`: RMSNorm outputs have rms ~1;
//! - projections `U(-a, a)`, `a = sqrt(3 / fan_in)`: variance `1 / fan_in`,
//!   so a unit-rms input gives unit-variance outputs (attention scores
//!   `q.k / sqrt(d)` then have std ~1: softmax neither flat nor one-hot);
//! - biases `U(-0.5, 0.5)`: large enough that a kernel dropping a bias
//!   fails the comparison clearly;
//! - embedding and LM head `U(-s, s)`, `s = LOGIT_STD * sqrt(3 / H)`: the
//!   final normed hidden state has rms ~1, so logits have std ~LOGIT_STD and
//!   the greedy pick has a real margin over the runner-up.

use half::bf16;
use rayon::prelude::*;

use crate::config::Config;
use crate::error::ModelError;
use crate::inventory::WeightKind;
use crate::weights::Weights;

/// Weyl increment of splitmix64 (2^64 / golden ratio).
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Target standard deviation of the logits.
pub const LOGIT_STD: f32 = 5.0;
/// Half-width of the norm weights around 1.
pub const NORM_SPREAD: f32 = 0.1;
/// Half-width of the q/k/v biases.
pub const BIAS_SCALE: f32 = 0.5;
/// Elements per parallel task.
const BLOCK: usize = 1 << 16;

/// splitmix64's output finaliser (a bijection on u64 with full avalanche).
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How one tensor is generated: `value = bf16(center + scale * u)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticParams {
    /// Per-tensor hash key, from the seed and the tensor id.
    pub key: u64,
    /// Middle of the uniform range.
    pub center: f32,
    /// Half-width of the uniform range.
    pub scale: f32,
}

/// The parameters of tensor `kind` for `config` and `seed`.
pub fn synthetic_params(config: &Config, kind: WeightKind, seed: u64) -> SyntheticParams {
    let fan = |n: usize| (3.0 / n.max(1) as f64).sqrt() as f32;
    let (center, scale) = match kind {
        WeightKind::InputLayernorm | WeightKind::PostAttentionLayernorm | WeightKind::Norm => {
            (1.0, NORM_SPREAD)
        }
        WeightKind::QBias | WeightKind::KBias | WeightKind::VBias => (0.0, BIAS_SCALE),
        WeightKind::QProj
        | WeightKind::KProj
        | WeightKind::VProj
        | WeightKind::GateProj
        | WeightKind::UpProj => (0.0, fan(config.hidden_size)),
        WeightKind::OProj => (0.0, fan(config.q_dim())),
        WeightKind::DownProj => (0.0, fan(config.intermediate_size)),
        WeightKind::EmbedTokens | WeightKind::LmHead => (0.0, LOGIT_STD * fan(config.hidden_size)),
    };
    let tensor_id = kind.index() as u64;
    SyntheticParams {
        key: mix64(seed ^ mix64(tensor_id.wrapping_add(1).wrapping_mul(GOLDEN))),
        center,
        scale,
    }
}

/// Element `index` of the tensor generated with `p` (see the module docs).
#[inline]
pub fn synthetic_value(p: &SyntheticParams, index: u64) -> bf16 {
    let bits = mix64(
        p.key
            .wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN)),
    );
    // 24 random bits -> [-1, 1) exactly (k * 2^-23 is exact in f32).
    let u = (bits >> 40) as f32 * (1.0 / 8_388_608.0) - 1.0;
    // Rust never contracts this to an FMA: one rounded mul, one rounded add.
    bf16::from_f32(p.center + p.scale * u)
}

/// Fills `dst` with elements `first..first + dst.len()` of the tensor
/// generated with `p`, in parallel.
pub fn fill_synthetic(dst: &mut [bf16], p: &SyntheticParams, first: u64) {
    dst.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(b, chunk)| {
            let base = first.wrapping_add((b * BLOCK) as u64);
            for (j, d) in chunk.iter_mut().enumerate() {
                *d = synthetic_value(p, base.wrapping_add(j as u64));
            }
        });
}

/// Synthetic weights described rather than materialised: any range of
/// any stacked tensor generated on demand, bit-identical to the same range
/// of [`synthetic_weights`]. A streamed upload fills its pinned buffers
/// from it piece by piece, so no model size ever sits whole in host memory.
#[derive(Debug, Clone)]
pub struct SyntheticSource {
    config: Config,
    seed: u64,
}

impl SyntheticSource {
    /// The weights [`synthetic_weights`]`(config, seed)` would give.
    pub fn new(config: &Config, seed: u64) -> Result<SyntheticSource, ModelError> {
        config.validate()?;
        for kind in WeightKind::ALL {
            kind.stacked_elems(config)?; // every size checked once, here
        }
        Ok(SyntheticSource {
            config: config.clone(),
            seed,
        })
    }

    /// The model.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Fills `dst` with elements `first..first + dst.len()` of the stacked
    /// tensor `kind` (row-major over its stacked shape), in parallel. A range
    /// past the tensor, or an absent `lm_head`, is an error naming it.
    pub fn fill(&self, kind: WeightKind, first: u64, dst: &mut [bf16]) -> Result<(), ModelError> {
        check_range(&self.config, kind, first, dst.len())?;
        fill_synthetic(dst, &synthetic_params(&self.config, kind, self.seed), first);
        Ok(())
    }
}

/// Checks that `kind` is present and `first..first + len` lies inside its
/// stacked tensor.
pub(crate) fn check_range(
    config: &Config,
    kind: WeightKind,
    first: u64,
    len: usize,
) -> Result<(), ModelError> {
    let total = kind.stacked_elems(config)?;
    let present = kind.present(config);
    let inside = first.checked_add(len as u64).is_some_and(|e| e <= total);
    if !present || !inside {
        return Err(ModelError::Range {
            tensor: kind.name(),
            first,
            len: len as u64,
            total: if present { total } else { 0 },
            note: if present {
                ""
            } else {
                " (absent: the embeddings are tied)"
            },
        });
    }
    Ok(())
}

/// Deterministic synthetic weights for `config` (see the module docs for
/// the exact function). Generated in parallel straight into the final
/// buffers. The same `(config, seed)` always gives the same bits.
///
/// # Panics
/// If `config` is invalid or too large to allocate; use
/// [`try_synthetic_weights`] for an error instead.
pub fn synthetic_weights(config: &Config, seed: u64) -> Weights {
    try_synthetic_weights(config, seed).unwrap_or_else(|e| panic!("synthetic_weights: {e}"))
}

/// [`synthetic_weights`], with invalid configs and size overflow as errors.
pub fn try_synthetic_weights(config: &Config, seed: u64) -> Result<Weights, ModelError> {
    let mut w = Weights::zeroed(config)?;
    w.tensors_mut().into_par_iter().for_each(|(kind, buf)| {
        fill_synthetic(buf, &synthetic_params(config, kind, seed), 0);
    });
    Ok(w)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A 3-layer, 64-wide untied model for tests (the CPU references'
    /// tests use it too).
    pub(crate) fn tiny() -> Config {
        let mut c = Config::preset("0.5b").unwrap();
        c.hidden_size = 64;
        c.intermediate_size = 96;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.num_key_value_heads = Some(2);
        c.head_dim = Some(16);
        c.vocab_size = 300;
        c.tie_word_embeddings = false;
        c
    }

    #[test]
    fn mix64_known_values() {
        // splitmix64 with state 0: first output is mix64(GOLDEN).
        assert_eq!(mix64(GOLDEN), 0xE220_A839_7B1D_CDAF);
        assert_eq!(mix64(0), 0);
    }

    #[test]
    fn deterministic_and_seed_dependent() {
        let c = tiny();
        let a = synthetic_weights(&c, 7);
        let b = synthetic_weights(&c, 7);
        let d = synthetic_weights(&c, 8);
        for kind in WeightKind::ALL {
            let (x, y, z) = (
                a.get(kind).unwrap(),
                b.get(kind).unwrap(),
                d.get(kind).unwrap(),
            );
            assert_eq!(x, y, "{kind:?}");
            assert_ne!(x, z, "{kind:?}");
        }
        // Element-wise formula (the CUDA twin's reference).
        let p = synthetic_params(&c, WeightKind::GateProj, 7);
        let l1 = a.layer(WeightKind::GateProj, 1).unwrap();
        assert_eq!(l1[5], synthetic_value(&p, 96 * 64 + 5));
        // Pinned bits: if these change, the function changed and every CUDA
        // twin and stored expectation with it.
        let p = synthetic_params(&Config::preset("7b").unwrap(), WeightKind::QProj, 0);
        assert_eq!(p.key, mix64(mix64(3u64.wrapping_mul(GOLDEN))));
        let first: Vec<u16> = (0..4).map(|i| synthetic_value(&p, i).to_bits()).collect();
        assert_eq!(first, [15253, 15248, 15536, 15286]);
    }

    /// Mean, standard deviation, min and max of `v`.
    fn stats(v: &[bf16]) -> (f64, f64, f32, f32) {
        let n = v.len() as f64;
        let (s, s2, lo, hi) =
            v.iter()
                .fold((0.0, 0.0, f32::MAX, f32::MIN), |(s, s2, lo, hi), x| {
                    let f = x.to_f32();
                    (
                        s + f as f64,
                        s2 + (f as f64) * (f as f64),
                        lo.min(f),
                        hi.max(f),
                    )
                });
        let mean = s / n;
        (mean, (s2 / n - mean * mean).max(0.0).sqrt(), lo, hi)
    }

    #[test]
    fn full_05b_shape_stats_and_logit_margins() {
        let c = Config::preset("0.5b").unwrap();
        let w = synthetic_weights(&c, 1234);
        w.check_sizes().unwrap();
        for (kind, buf) in WeightKind::ALL.iter().filter_map(|&k| Some((k, w.get(k)?))) {
            let p = synthetic_params(&c, kind, 1234);
            let (mean, std, lo, hi) = stats(buf);
            let n = buf.len() as f64;
            let want_std = p.scale as f64 / 3f64.sqrt();
            assert!(
                (mean - p.center as f64).abs() < 5.0 * want_std / n.sqrt() + 1e-3 * p.scale as f64,
                "{kind:?}: mean {mean}"
            );
            assert!(
                (std / want_std - 1.0).abs() < 0.05,
                "{kind:?}: std {std} vs {want_std}"
            );
            let slack = p.scale * 0.01 + 0.01; // bf16 rounding at the ends
            assert!(lo >= p.center - p.scale - slack && hi <= p.center + p.scale + slack);
        }
        // Logits of unit-rms hidden states: std ~LOGIT_STD, and a clear
        // top-1 over top-2 margin.
        let h = c.hidden_size;
        let lm = w.lm_head();
        let mut gaps = Vec::new();
        for s in 0..8u64 {
            let p = SyntheticParams {
                key: mix64(s + 99),
                center: 0.0,
                scale: 3f32.sqrt(),
            };
            let x: Vec<f32> = (0..h as u64)
                .map(|i| synthetic_value(&p, i).to_f32())
                .collect();
            let logits: Vec<f32> = lm
                .par_chunks(h)
                .map(|row| row.iter().zip(&x).map(|(a, b)| a.to_f32() * b).sum())
                .collect();
            let mean = logits.iter().sum::<f32>() / logits.len() as f32;
            let std = (logits.iter().map(|l| (l - mean).powi(2)).sum::<f32>()
                / logits.len() as f32)
                .sqrt();
            assert!((std / LOGIT_STD - 1.0).abs() < 0.15, "logit std {std}");
            let mut top = [f32::MIN; 2];
            for &l in &logits {
                if l > top[0] {
                    top = [l, top[0]];
                } else if l > top[1] {
                    top[1] = l;
                }
            }
            gaps.push(top[0] - top[1]);
        }
        gaps.sort_by(f32::total_cmp);
        assert!(gaps[4] > 0.05, "median top-1 margin {}", gaps[4]);
    }

    /// Generation time at a real shape (default 7b; `QMK_SYNTH_PRESET`
    /// picks another): `cargo test -p qmk-model -- --ignored
    /// synthetic_timing --nocapture`.
    #[test]
    #[ignore = "allocates a whole model; run by hand"]
    fn synthetic_timing() {
        let name = std::env::var("QMK_SYNTH_PRESET").unwrap_or_else(|_| "7b".into());
        let c = Config::preset(&name).unwrap();
        let t = std::time::Instant::now();
        let w = synthetic_weights(&c, 0);
        let dt = t.elapsed();
        let bytes = crate::inventory::weight_bytes(&c).unwrap().total.0;
        eprintln!(
            "{name}: {:.2} GB in {:.2} s on {} threads ({:.2} GB/s)",
            bytes as f64 / 1e9,
            dt.as_secs_f64(),
            rayon::current_num_threads(),
            bytes as f64 / 1e9 / dt.as_secs_f64()
        );
        // Again into the same (already faulted-in) buffers: the hashing
        // alone, without first-touch page faults.
        let mut w = w;
        let t = std::time::Instant::now();
        w.tensors_mut().into_par_iter().for_each(|(kind, buf)| {
            fill_synthetic(buf, &synthetic_params(&c, kind, 0), 0);
        });
        eprintln!("{name}: refill in {:.2} s", t.elapsed().as_secs_f64());
        assert_eq!(w.norm.len(), c.hidden_size);
    }

    /// The chunked generator gives the whole-tensor generator's bits, for
    /// any split of any tensor (the GPU checksum records depend on it).
    #[test]
    fn chunked_fill_is_bit_identical_to_the_whole_tensor() {
        for tied in [true, false] {
            let mut c = tiny();
            c.tie_word_embeddings = tied;
            let whole = synthetic_weights(&c, 20261129);
            let src = SyntheticSource::new(&c, 20261129).unwrap();
            for kind in WeightKind::ALL {
                let Some(want) = whole.get(kind) else {
                    let mut one = [bf16::ZERO];
                    assert!(src.fill(kind, 0, &mut one).is_err(), "{kind:?}");
                    continue;
                };
                // Pieces of a prime length, so they straddle rows, layers and
                // the generator's parallel blocks.
                for piece in [1usize, 7, 997, BLOCK + 3] {
                    let mut got = vec![bf16::ZERO; want.len()];
                    let mut at = 0;
                    while at < got.len() {
                        let n = piece.min(got.len() - at);
                        src.fill(kind, at as u64, &mut got[at..at + n]).unwrap();
                        at += n;
                    }
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kind:?} in pieces of {piece}");
                }
                // One past the end is refused, naming the tensor.
                let mut two = [bf16::ZERO; 2];
                let e = src.fill(kind, want.len() as u64 - 1, &mut two).unwrap_err();
                assert!(e.to_string().contains(kind.name()), "{e}");
            }
        }
    }

    #[test]
    fn invalid_config_is_an_error() {
        let mut c = tiny();
        c.num_attention_heads = 0;
        assert!(try_synthetic_weights(&c, 0).is_err());
    }
}
