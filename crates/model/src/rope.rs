//! The rotary embedding a `config.json` asks for: the base, and the
//! scaling (none, or YaRN), read from either form transformers writes:
//! `rope_theta` + `rope_scaling` (older files) or `rope_parameters` (newer
//! files, with the base inside). Every other scaling type is refused by
//! name.
//!
//! YaRN ("Yet another RoPE extensioN") is Qwen2.5's documented route past
//! its 32k training context: a per-frequency blend between the original
//! frequency and the frequency divided by `factor`, chosen by how many
//! turns each frequency makes over the original context, and an attention
//! factor that multiplies the cos and sin tables (so q and k both carry it
//! and the attention logits carry its square). The blend is static: it
//! applies at every position, short prompts included, as in transformers.
//!
//! [`inv_freq`] computes the frequencies with transformers' f32 steps; the
//! CPU reference and the GPU backend build their tables from it, so both
//! see the same numbers.

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::Config;
use crate::error::ModelError;

/// The base transformers uses when a config names none.
pub const DEFAULT_THETA: f64 = 10_000.0;

/// The rotary embedding of a model, validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    /// Base of the geometric frequency ladder.
    pub theta: f64,
    /// Scaling on top of the plain ladder.
    pub scaling: RopeScaling,
}

/// Scaling of the rotary frequencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// The plain ladder (`rope_type` `default`, or no scaling entry).
    None,
    /// YaRN with its parameters resolved.
    Yarn(Yarn),
}

/// YaRN's parameters, defaults filled in as transformers fills them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Context extension factor (`factor`; when absent,
    /// `max_position_embeddings / original_max_position_embeddings`).
    pub factor: f64,
    /// The context the model was trained for.
    pub original_max_position_embeddings: usize,
    /// Multiplies cos and sin (`attention_factor`, else derived from
    /// `factor` and `mscale` / `mscale_all_dim`).
    pub attention_factor: f64,
    /// Turns over the original context above which a frequency is kept
    /// as is (default 32).
    pub beta_fast: f64,
    /// Turns below which a frequency is fully interpolated (default 1).
    pub beta_slow: f64,
    /// Rounds the blend's dimension range outwards to integers (default
    /// true).
    pub truncate: bool,
}

impl RopeSpec {
    /// The factor the cos and sin tables are multiplied by (1 without
    /// scaling).
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Yarn(y) => y.attention_factor,
        }
    }
}

/// Keys a rotary entry may carry; any other key is refused by name, since
/// an unread key may change the maths.
const KNOWN_KEYS: [&str; 12] = [
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "partial_rotary_factor",
];

/// Reads the rotary embedding of `config`; `path` labels errors.
///
/// The entry is `rope_scaling` when set (transformers reads it first),
/// else `rope_parameters`; both set and different is refused. The base is
/// the entry's `rope_theta` when present, else the top-level `rope_theta`.
pub fn rope_spec(config: &Config, path: &Path) -> Result<RopeSpec, ModelError> {
    let non_null = |v: &Option<Value>| v.as_ref().filter(|v| !v.is_null()).cloned();
    let (field, entry) = match (
        non_null(&config.rope_scaling),
        non_null(&config.rope_parameters),
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(
                path,
                "rope_scaling",
                "both `rope_scaling` and `rope_parameters` are set and differ; keep one".into(),
            ))
        }
        (Some(a), _) => ("rope_scaling", Some(a)),
        (None, Some(b)) => ("rope_parameters", Some(b)),
        (None, None) => ("rope_scaling", None),
    };
    let Some(entry) = entry else {
        return Ok(RopeSpec {
            theta: positive(path, "rope_theta", config.rope_theta)?,
            scaling: RopeScaling::None,
        });
    };
    let Value::Object(map) = entry else {
        return Err(bad(path, field, format!("expected an object, got {entry}")));
    };
    if let Some(k) = map.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
        return Err(bad(
            path,
            field,
            format!("unknown key `{k}` (known: {})", KNOWN_KEYS.join(", ")),
        ));
    }
    let theta = match number(path, field, &map, "rope_theta")? {
        Some(t) => positive(path, field, t)?,
        None => positive(path, "rope_theta", config.rope_theta)?,
    };
    if let Some(p) = number(path, field, &map, "partial_rotary_factor")? {
        if p != 1.0 {
            return Err(bad(
                path,
                field,
                format!("partial_rotary_factor {p} is not supported (only 1.0: every dimension rotates)"),
            ));
        }
    }
    let kind = match (map.get("rope_type"), map.get("type")) {
        (Some(Value::String(s)), _) => s.as_str(),
        (None, Some(Value::String(s))) => s.as_str(),
        (None, None) => "default",
        (Some(v), _) | (None, Some(v)) => {
            return Err(bad(
                path,
                field,
                format!("rope_type must be a string, got {v}"),
            ))
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "yarn" => RopeScaling::Yarn(yarn(config, path, field, &map)?),
        other => {
            return Err(bad(
                path,
                field,
                format!("rope scaling type `{other}` is not supported (supported: default, yarn)"),
            ))
        }
    };
    Ok(RopeSpec { theta, scaling })
}

/// YaRN's parameters from its entry, defaults as transformers sets them.
fn yarn(
    config: &Config,
    path: &Path,
    field: &'static str,
    map: &Map<String, Value>,
) -> Result<Yarn, ModelError> {
    let original = match map.get("original_max_position_embeddings") {
        None | Some(Value::Null) => config.max_position_embeddings,
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n > 0 => n,
            _ => {
                return Err(bad(
                    path,
                    field,
                    format!("original_max_position_embeddings must be a positive integer, got {v}"),
                ))
            }
        },
    };
    let factor = match number(path, field, map, "factor")? {
        Some(f) => f,
        None => config.max_position_embeddings as f64 / original as f64,
    };
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(bad(
            path,
            field,
            format!("YaRN factor {factor} must be finite and at least 1"),
        ));
    }
    let mscale = number(path, field, map, "mscale")?;
    let mscale_all_dim = number(path, field, map, "mscale_all_dim")?;
    let attention_factor = match number(path, field, map, "attention_factor")? {
        Some(a) => a,
        None => match (mscale, mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                yarn_mscale(factor, m) / yarn_mscale(factor, a)
            }
            _ => yarn_mscale(factor, 1.0),
        },
    };
    if !(attention_factor.is_finite() && attention_factor > 0.0) {
        return Err(bad(
            path,
            field,
            format!("YaRN attention_factor {attention_factor} must be finite and positive"),
        ));
    }
    // transformers treats 0 / null as "use the default" for the betas.
    let beta = |key, default: f64| -> Result<f64, ModelError> {
        Ok(number(path, field, map, key)?
            .filter(|b| *b != 0.0)
            .unwrap_or(default))
    };
    let (beta_fast, beta_slow) = (beta("beta_fast", 32.0)?, beta("beta_slow", 1.0)?);
    if !(beta_fast.is_finite() && beta_slow.is_finite() && beta_fast > 0.0 && beta_slow > 0.0) {
        return Err(bad(
            path,
            field,
            format!(
                "YaRN beta_fast {beta_fast} and beta_slow {beta_slow} must be finite and positive"
            ),
        ));
    }
    let truncate = match map.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                path,
                field,
                format!("truncate must be a bool, got {v}"),
            ))
        }
    };
    Ok(Yarn {
        factor,
        original_max_position_embeddings: original,
        attention_factor,
        beta_fast,
        beta_slow,
        truncate,
    })
}

/// YaRN's magnitude correction `0.1 · m · ln(s) + 1` (1 for `s <= 1`).
fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// The rotary inverse frequencies `[head_dim / 2]`, in transformers' f32
/// steps (its rounding keeps the oracle close to Hugging Face).
pub fn inv_freq(spec: &RopeSpec, head_dim: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let dim = head_dim as f32;
    // base^(2i / d), as torch computes a scalar base to an f32 exponent.
    let pos_freqs: Vec<f32> = (0..half) // [hd/2]
        .map(|i| (spec.theta as f32).powf((2 * i) as f32 / dim))
        .collect();
    match spec.scaling {
        RopeScaling::None => pos_freqs.iter().map(|p| 1.0 / p).collect(),
        RopeScaling::Yarn(y) => {
            let (low, high) = correction_range(&y, spec.theta, head_dim);
            let span = if low == high { 0.001 } else { high - low };
            let factor = y.factor as f32;
            pos_freqs
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let extrapolation = 1.0 / p;
                    let interpolation = 1.0 / (factor * p);
                    let ramp = ((i as f32 - low as f32) / span as f32).clamp(0.0, 1.0);
                    // 1 - ramp keeps the original frequency (fast dimensions).
                    let keep = 1.0 - ramp;
                    interpolation * (1.0 - keep) + extrapolation * keep
                })
                .collect()
        }
    }
}

/// The dimension range `[low, high]` over which YaRN blends, from the
/// number of turns `beta_fast` / `beta_slow` over the original context.
fn correction_range(y: &Yarn, theta: f64, head_dim: usize) -> (f64, f64) {
    let d = head_dim as f64;
    let orig = y.original_max_position_embeddings as f64;
    let dim_for =
        |turns: f64| d * (orig / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (dim_for(y.beta_fast), dim_for(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(d - 1.0))
}

/// The longest context the config supports: `max_position_embeddings`, or
/// with YaRN `factor · original_max_position_embeddings` when larger.
pub fn max_context(config: &Config, spec: &RopeSpec) -> usize {
    match spec.scaling {
        RopeScaling::None => config.max_position_embeddings,
        RopeScaling::Yarn(y) => {
            let scaled = (y.factor * y.original_max_position_embeddings as f64).floor();
            // `as` saturates; the cap keeps an absurd factor from sizing memory.
            let scaled = if scaled >= usize::MAX as f64 {
                usize::MAX
            } else {
                scaled as usize
            };
            config.max_position_embeddings.max(scaled)
        }
    }
}

fn number(
    path: &Path,
    field: &'static str,
    map: &Map<String, Value>,
    key: &str,
) -> Result<Option<f64>, ModelError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => Err(bad(path, field, format!("{key} must be a number, got {v}"))),
        },
    }
}

fn positive(path: &Path, field: &'static str, v: f64) -> Result<f64, ModelError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(bad(path, field, format!("{v} must be finite and positive")))
    }
}

fn bad(path: &Path, field: &'static str, reason: String) -> ModelError {
    ModelError::InvalidConfig {
        path: path.to_path_buf(),
        field,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: Value) -> Config {
        let mut c = Config::preset("0.5b").unwrap();
        let obj = extra.as_object().unwrap();
        if let Some(v) = obj.get("rope_scaling") {
            c.rope_scaling = Some(v.clone());
        }
        if let Some(v) = obj.get("rope_parameters") {
            c.rope_parameters = Some(v.clone());
        }
        c
    }

    fn spec(extra: Value) -> Result<RopeSpec, ModelError> {
        rope_spec(&cfg(extra), Path::new("/m/config.json"))
    }

    fn qwen_yarn() -> Value {
        serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}})
    }

    #[test]
    fn no_entry_and_default_type_are_the_plain_ladder() {
        let s = spec(serde_json::json!({})).unwrap();
        assert_eq!(s.scaling, RopeScaling::None);
        assert_eq!(s.theta, 1e6);
        let s = spec(
            serde_json::json!({"rope_parameters": {"rope_type": "default",
            "rope_theta": 5e5}}),
        )
        .unwrap();
        assert_eq!((s.scaling, s.theta), (RopeScaling::None, 5e5));
        let plain: Vec<f32> = (0..32)
            .map(|i| 1.0 / (1e6f32).powf((2 * i) as f32 / 64.0))
            .collect();
        assert_eq!(inv_freq(&spec(serde_json::json!({})).unwrap(), 64), plain);
    }

    #[test]
    fn both_forms_give_the_same_yarn() {
        let a = spec(qwen_yarn()).unwrap();
        let b = spec(serde_json::json!({"rope_parameters": {"rope_type": "yarn",
            "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}}))
        .unwrap();
        assert_eq!(a, b);
        let RopeScaling::Yarn(y) = a.scaling else {
            panic!("not yarn")
        };
        assert_eq!(y.factor, 4.0);
        // 0.1 ln 4 + 1
        assert!((y.attention_factor - 1.138_629_436_111_989).abs() < 1e-12);
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        assert_eq!(max_context(&cfg(qwen_yarn()), &a), 131_072);
    }

    /// The blend against its definition in f64: the fast dimensions keep
    /// their frequency, the slow ones are divided by the factor, and the
    /// ones in between are a linear ramp.
    #[test]
    fn yarn_frequencies_follow_the_ramp() {
        let s = spec(qwen_yarn()).unwrap();
        let f = inv_freq(&s, 64);
        let plain = inv_freq(&spec(serde_json::json!({})).unwrap(), 64);
        // theta 1e6, d 64, original 32768: the blend runs from dim 11 to
        // dim 20 (floor 11.80, ceil 19.83).
        let d = |turns: f64| {
            64.0 * (32768.0 / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 1e6f64.ln())
        };
        let (low, high) = (d(32.0).floor(), d(1.0).ceil());
        assert_eq!((low, high), (11.0, 20.0));
        for i in 0..32 {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let want = plain[i] as f64 * (1.0 - ramp) + plain[i] as f64 / 4.0 * ramp;
            assert!(
                (f[i] as f64 - want).abs() <= 1e-6 * want,
                "dim {i}: {} vs {want}",
                f[i]
            );
        }
        assert_eq!(f[0], plain[0]);
        assert!((f[31] as f64 - plain[31] as f64 / 4.0).abs() < 1e-6 * plain[31] as f64);
    }

    #[test]
    fn attention_factor_forms() {
        let with = |extra: Value| {
            let mut e = qwen_yarn();
            for (k, v) in extra.as_object().unwrap() {
                e["rope_scaling"][k] = v.clone();
            }
            spec(e).unwrap().attention_factor()
        };
        assert_eq!(with(serde_json::json!({"attention_factor": 0.5})), 0.5);
        let m = with(serde_json::json!({"mscale": 2.0, "mscale_all_dim": 1.0}));
        let want = (0.2 * 4f64.ln() + 1.0) / (0.1 * 4f64.ln() + 1.0);
        assert!((m - want).abs() < 1e-12);
        // Factor absent: the ratio of the two context lengths.
        let mut c = cfg(serde_json::json!({"rope_scaling": {"type": "yarn",
            "original_max_position_embeddings": 8192}}));
        c.max_position_embeddings = 32768;
        let s = rope_spec(&c, Path::new("c")).unwrap();
        let RopeScaling::Yarn(y) = s.scaling else {
            panic!()
        };
        assert_eq!(y.factor, 4.0);
    }

    #[test]
    fn refusals_name_the_field_and_the_value() {
        let cases = [
            (
                serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
                "rope_scaling",
                "linear",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),
                "rope_parameters",
                "dynamic",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "longrope"}}),
                "rope_scaling",
                "longrope",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "llama3", "factor": 8.0}}),
                "rope_scaling",
                "llama3",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 0.5}}),
                "rope_scaling",
                "at least 1",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": "4"}}),
                "rope_scaling",
                "factor must be a number",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "low_freq_factor": 1}}),
                "rope_scaling",
                "low_freq_factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": -1}}),
                "rope_scaling",
                "original_max_position_embeddings",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}}),
                "rope_scaling",
                "partial_rotary_factor",
            ),
            (
                serde_json::json!({"rope_scaling": "yarn"}),
                "rope_scaling",
                "object",
            ),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0}, "rope_parameters": {"rope_type": "default"}}),
                "rope_scaling",
                "differ",
            ),
        ];
        for (extra, field, needle) in cases {
            let e = spec(extra.clone()).unwrap_err();
            let msg = e.to_string();
            match e {
                ModelError::InvalidConfig { field: f, .. } => assert_eq!(f, field, "{extra}"),
                other => panic!("{extra}: {other:?}"),
            }
            assert!(msg.contains(needle), "{extra}: `{msg}` lacks `{needle}`");
            assert!(msg.contains("/m/config.json"), "{msg}");
        }
    }
}
