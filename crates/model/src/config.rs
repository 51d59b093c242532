//! `config.json` of a Qwen2.5 checkpoint, Hugging Face field names verbatim,
//! plus presets for every dense Qwen2.5 size and `generation_config.json`.
//!
//! The field names and types of [`Config`] are what the other crates code
//! against: extend them, never rename.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::ModelError;

/// The only `model_type` the engine runs.
pub const MODEL_TYPE: &str = "qwen2";
/// The only architecture the engine runs (a causal LM head on Qwen2).
pub const ARCHITECTURE: &str = "Qwen2ForCausalLM";

/// The fields of a Qwen2 `config.json` the engine reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Model classes; must include `Qwen2ForCausalLM` when present.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// Must be `qwen2`.
    pub model_type: String,
    /// Width of the residual stream (H).
    pub hidden_size: usize,
    /// Width of the MLP (I).
    pub intermediate_size: usize,
    /// Decoder layers (L).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// transformers defaults a missing value to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Not in every config; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Rows of the embedding and LM head (V).
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary position embedding (transformers' default when
    /// absent; a `rope_theta` inside `rope_parameters` takes precedence).
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// The LM head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Sliding-window attention; the engine runs only `false`.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Window size when `use_sliding_window` is set.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Layers from this index on slide their window when
    /// `use_sliding_window` is set (transformers' default: 28).
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Per-layer attention kind, `full_attention` or `sliding_attention`.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// The MLP's activation; the engine runs `silu` (alias `swish`).
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Rotary scaling as older transformers writes it (`type` or
    /// `rope_type`, `factor`, ...); see [`crate::rope`].
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Rotary parameters as newer transformers writes them (`rope_type`,
    /// `rope_theta` and the scaling fields); see [`crate::rope`].
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// Set in quantised checkpoints (AWQ, GPTQ, FP8, ...), which the
    /// engine refuses.
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
    /// Biases on q/k/v; Qwen2 always has them, so only `true` runs.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases on the MLP projections; Qwen2 has none, so only `false` runs.
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// Fraction of each head that rotates; only 1 runs.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// The checkpoint's dtype as transformers names it.
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Beginning-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id(s), an int or a list, as in the file.
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

/// Names accepted by [`Config::preset`], smallest first.
pub const PRESETS: [&str; 7] = ["0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b"];

/// One row of the Qwen2.5 size table (the dense models' config.json
/// values).
struct PresetRow {
    name: &'static str,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    tied: bool,
}

#[rustfmt::skip]
const PRESET_TABLE: [PresetRow; 7] = [
    PresetRow { name: "0.5b", hidden: 896, inter: 4864, layers: 24, heads: 14, kv_heads: 2, head_dim: 64, vocab: 151936, tied: true },
    PresetRow { name: "1.5b", hidden: 1536, inter: 8960, layers: 28, heads: 12, kv_heads: 2, head_dim: 128, vocab: 151936, tied: true },
    PresetRow { name: "3b", hidden: 2048, inter: 11008, layers: 36, heads: 16, kv_heads: 2, head_dim: 128, vocab: 151936, tied: true },
    PresetRow { name: "7b", hidden: 3584, inter: 18944, layers: 28, heads: 28, kv_heads: 4, head_dim: 128, vocab: 152064, tied: false },
    PresetRow { name: "14b", hidden: 5120, inter: 13824, layers: 48, heads: 40, kv_heads: 8, head_dim: 128, vocab: 152064, tied: false },
    PresetRow { name: "32b", hidden: 5120, inter: 27648, layers: 64, heads: 40, kv_heads: 8, head_dim: 128, vocab: 152064, tied: false },
    PresetRow { name: "72b", hidden: 8192, inter: 29568, layers: 80, heads: 64, kv_heads: 8, head_dim: 128, vocab: 152064, tied: false },
];

impl Config {
    /// The config of a dense Qwen2.5 size: `"0.5b"`, `"1.5b"`, `"3b"`, `"7b"`,
    /// `"14b"`, `"32b"` or `"72b"` (case-insensitive, an optional
    /// `qwen2.5-` prefix is ignored). Token ids are those of the Instruct
    /// models (bos 151643 `<|endoftext|>`, eos 151645 `<|im_end|>`).
    pub fn preset(name: &str) -> Result<Config, ModelError> {
        let lower = name.trim().to_ascii_lowercase();
        let key = lower.strip_prefix("qwen2.5-").unwrap_or(&lower);
        let row = PRESET_TABLE.iter().find(|r| r.name == key).ok_or_else(|| {
            ModelError::UnknownPreset {
                name: name.to_string(),
                known: PRESETS.join(", "),
            }
        })?;
        Ok(Config {
            architectures: vec![ARCHITECTURE.to_string()],
            model_type: MODEL_TYPE.to_string(),
            hidden_size: row.hidden,
            intermediate_size: row.inter,
            num_hidden_layers: row.layers,
            num_attention_heads: row.heads,
            num_key_value_heads: Some(row.kv_heads),
            head_dim: Some(row.head_dim),
            vocab_size: row.vocab,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            tie_word_embeddings: row.tied,
            use_sliding_window: false,
            sliding_window: Some(32768),
            max_window_layers: None,
            layer_types: None,
            hidden_act: Some("silu".to_string()),
            rope_scaling: None,
            rope_parameters: None,
            quantization_config: None,
            attention_bias: None,
            mlp_bias: None,
            partial_rotary_factor: None,
            torch_dtype: Some("bfloat16".to_string()),
            bos_token_id: Some(151643),
            eos_token_id: Some(serde_json::Value::from(151645u32)),
        })
    }

    /// Reads and validates `config.json`. Errors name the file and, for
    /// validation failures, the field.
    pub fn from_file(path: &Path) -> Result<Config, ModelError> {
        let text = crate::read_small_file(path, crate::SMALL_FILE_CAP)?;
        Config::from_json_str(&text, path)
    }

    /// Parses and validates config JSON; `path` only labels errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Config, ModelError> {
        let config: Config = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        config.validate_at(path)?;
        Ok(config)
    }

    /// Checks that the engine can run this config; errors label the file
    /// `config.json`. See [`Config::validate_at`] for the conditions.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.validate_at(Path::new("config.json"))
    }

    /// Checks, in order, with `path` labelling errors:
    /// 1. `model_type` is `qwen2` and every `architectures` entry is
    ///    `Qwen2ForCausalLM` (an empty list is accepted);
    /// 2. every size is non-zero;
    /// 3. `num_attention_heads % num_key_value_heads == 0` (GQA groups);
    /// 4. without `head_dim`, `hidden_size % num_attention_heads == 0`;
    /// 5. `head_dim` is even (rotate-half RoPE pairs dims `i` and `i + d/2`);
    /// 6. no layer slides its attention window (the kernel attends to the
    ///    full context): `use_sliding_window` is false, or no layer reaches
    ///    `max_window_layers`, or `layer_types` has no sliding layer;
    /// 7. `rms_norm_eps` and `rope_theta` are finite and positive;
    /// 8. the widths `heads * head_dim` etc. fit in `usize` (sizes of whole
    ///    tensors are checked by [`crate::inventory`]);
    /// 9. every field that changes the maths has a value the engine
    ///    computes: `hidden_act` SiLU, the rotary entry plain or YaRN
    ///    ([`crate::rope::rope_spec`]), no `quantization_config`, q/k/v
    ///    biases on, MLP biases off, `partial_rotary_factor` 1.
    pub fn validate_at(&self, path: &Path) -> Result<(), ModelError> {
        let bad = |field: &'static str, reason: String| ModelError::InvalidConfig {
            path: path.to_path_buf(),
            field,
            reason,
        };
        // 1. architecture
        if self.model_type != MODEL_TYPE {
            return Err(bad(
                "model_type",
                format!(
                    "`{}` is not supported (expected `{MODEL_TYPE}`)",
                    self.model_type
                ),
            ));
        }
        if let Some(a) = self.architectures.iter().find(|a| *a != ARCHITECTURE) {
            return Err(bad(
                "architectures",
                format!("`{a}` is not supported (expected `{ARCHITECTURE}`)"),
            ));
        }
        // 2. non-zero sizes
        let sizes: [(&'static str, Option<usize>); 8] = [
            ("hidden_size", Some(self.hidden_size)),
            ("intermediate_size", Some(self.intermediate_size)),
            ("num_hidden_layers", Some(self.num_hidden_layers)),
            ("num_attention_heads", Some(self.num_attention_heads)),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", Some(self.vocab_size)),
            (
                "max_position_embeddings",
                Some(self.max_position_embeddings),
            ),
        ];
        for (field, value) in sizes {
            if value == Some(0) {
                return Err(bad(field, "must be greater than zero".to_string()));
            }
        }
        // 3. GQA: every kv head serves the same number of query heads
        let (heads, kv) = (self.num_attention_heads, self.num_kv_heads());
        if heads % kv != 0 {
            return Err(bad(
                "num_key_value_heads",
                format!("{kv} does not divide num_attention_heads = {heads}"),
            ));
        }
        // 4. implied head_dim must be exact
        if self.head_dim.is_none() && self.hidden_size % heads != 0 {
            return Err(bad(
                "hidden_size",
                format!(
                    "{} is not divisible by num_attention_heads = {heads} (and head_dim is absent)",
                    self.hidden_size
                ),
            ));
        }
        // 5. rotate-half RoPE
        let d = self.head_dim();
        if d % 2 != 0 {
            return Err(bad(
                "head_dim",
                format!("{d} is odd; rotary embedding needs an even head_dim"),
            ));
        }
        // 6. full attention only
        if let Some(t) = self
            .layer_types
            .iter()
            .flatten()
            .find(|t| *t != "full_attention" && *t != "sliding_attention")
        {
            return Err(bad(
                "layer_types",
                format!("`{t}` is not an attention kind (full_attention, sliding_attention)"),
            ));
        }
        if let Some(first) = self.first_sliding_layer() {
            return Err(bad(
                "use_sliding_window",
                format!(
                    "layers {first}.. attend through a window of {} positions; \
                     sliding-window attention is not supported",
                    self.sliding_window.unwrap_or(0)
                ),
            ));
        }
        // 7. float parameters
        for (field, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(field, format!("{v} must be finite and positive")));
            }
        }
        // 8. projection widths
        for (field, n) in [("num_attention_heads", heads), ("num_key_value_heads", kv)] {
            if n.checked_mul(d).is_none() {
                return Err(ModelError::overflow(
                    field,
                    format!("{n} heads x head_dim {d} exceeds usize"),
                ));
            }
        }
        // 9. fields that change the maths
        if let Some(act) = &self.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(bad(
                    "hidden_act",
                    format!("`{act}` is not supported (the engine's MLP runs silu)"),
                ));
            }
        }
        crate::rope::rope_spec(self, path)?;
        if let Some(q) = self.quantization_config.as_ref().filter(|q| !q.is_null()) {
            let method = q
                .get("quant_method")
                .and_then(|m| m.as_str())
                .unwrap_or("unnamed");
            return Err(bad(
                "quantization_config",
                format!(
                    "quantised checkpoints ({method}) are not supported; use the bf16, f16 or f32 weights"
                ),
            ));
        }
        if self.attention_bias == Some(false) {
            return Err(bad(
                "attention_bias",
                "false is not supported (Qwen2 adds biases to q, k and v)".to_string(),
            ));
        }
        if self.mlp_bias == Some(true) {
            return Err(bad(
                "mlp_bias",
                "true is not supported (Qwen2's MLP has no biases)".to_string(),
            ));
        }
        if let Some(p) = self.partial_rotary_factor.filter(|p| *p != 1.0) {
            return Err(bad(
                "partial_rotary_factor",
                format!("{p} is not supported (every dimension of a head rotates)"),
            ));
        }
        Ok(())
    }

    /// The first layer that attends through a sliding window, as
    /// transformers decides it: the window is on only with
    /// `use_sliding_window` and a `sliding_window`; then `layer_types` names
    /// the sliding layers, or else every layer from `max_window_layers`
    /// (default 28) on slides.
    pub fn first_sliding_layer(&self) -> Option<usize> {
        if !self.use_sliding_window || self.sliding_window.is_none() {
            return None;
        }
        match &self.layer_types {
            Some(types) => types.iter().position(|t| t == "sliding_attention"),
            None => {
                let from = self.max_window_layers.unwrap_or(28);
                (from < self.num_hidden_layers).then_some(from)
            }
        }
    }

    /// The rotary embedding this config asks for (validated; errors label
    /// the file `config.json`).
    pub fn rope(&self) -> Result<crate::rope::RopeSpec, ModelError> {
        crate::rope::rope_spec(self, Path::new("config.json"))
    }

    /// The longest context the model supports: `max_position_embeddings`,
    /// or with YaRN scaling `factor · original_max_position_embeddings`
    /// when larger.
    pub fn max_context(&self) -> usize {
        match self.rope() {
            Ok(spec) => crate::rope::max_context(self, &spec),
            Err(_) => self.max_position_embeddings,
        }
    }

    /// Key/value heads; transformers defaults a missing value to
    /// `num_attention_heads`.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    /// Per-head width; `hidden_size / num_attention_heads` when absent
    /// (0 for a config with zero heads, which `validate` rejects).
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or_else(|| {
            self.hidden_size
                .checked_div(self.num_attention_heads)
                .unwrap_or(0)
        })
    }
    /// q_proj output width: heads x head_dim.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }
    /// k_proj / v_proj output width: kv heads x head_dim.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads() * self.head_dim()
    }
    /// Query heads per key/value head (GQA group size).
    pub fn gqa_group(&self) -> usize {
        self.num_attention_heads
            .checked_div(self.num_kv_heads())
            .unwrap_or(0)
    }
    /// `eos_token_id` as a list (it may be an int or a list in config.json);
    /// entries that are not u32 are skipped.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(|v| ids_from_value(v).unwrap_or_default())
            .unwrap_or_default()
    }
}

/// transformers' base when a config names none.
fn default_rope_theta() -> f64 {
    crate::rope::DEFAULT_THETA
}

/// Token ids from a JSON int or list of ints; `None` for anything else.
fn ids_from_value(v: &serde_json::Value) -> Option<Vec<u32>> {
    let one = |v: &serde_json::Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    match v {
        serde_json::Value::Null => Some(Vec::new()),
        serde_json::Value::Array(items) => items.iter().map(one).collect(),
        other => one(other).map(|id| vec![id]),
    }
}

/// `generation_config.json`: the defaults Hugging Face generation uses.
/// Every field is optional in the file (a `null` counts as absent); fields
/// not listed here are ignored. Read it with [`GenerationConfig::from_file`]
/// or [`GenerationConfig::from_json_str`], which check every field.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenerationConfig {
    /// Beginning-of-sequence token id.
    pub bos_token_id: Option<u32>,
    /// Any of these ends generation; may be an int or a list in the file.
    pub eos_token_id: Vec<u32>,
    /// Padding token id.
    pub pad_token_id: Option<u32>,
    /// false (or absent): greedy decoding; true: sample with the values
    /// below.
    pub do_sample: bool,
    /// Sampling temperature, finite and >= 0.
    pub temperature: Option<f64>,
    /// Top-k sampling cutoff; 0 = no limit.
    pub top_k: Option<usize>,
    /// Top-p (nucleus) sampling mass, in (0, 1].
    pub top_p: Option<f64>,
    /// Min-p sampling floor, in [0, 1].
    pub min_p: Option<f64>,
    /// Repetition penalty, finite and > 0.
    pub repetition_penalty: Option<f64>,
    /// Default number of tokens to generate.
    pub max_new_tokens: Option<usize>,
}

impl Default for GenerationConfig {
    /// Greedy, no token ids known.
    fn default() -> Self {
        GenerationConfig {
            bos_token_id: None,
            eos_token_id: Vec::new(),
            pad_token_id: None,
            do_sample: false,
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            max_new_tokens: None,
        }
    }
}

impl GenerationConfig {
    /// Reads `generation_config.json` (a regular file of at most
    /// [`crate::SMALL_FILE_CAP`] bytes); errors name the file, and the field
    /// for a value of the wrong type or out of range.
    pub fn from_file(path: &Path) -> Result<GenerationConfig, ModelError> {
        let text = crate::read_small_file(path, crate::SMALL_FILE_CAP)?;
        GenerationConfig::from_json_str(&text, path)
    }

    /// Parses and checks `generation_config.json` contents; `path` only
    /// labels errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<GenerationConfig, ModelError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|source| ModelError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let bad = |field: &'static str, reason: String| ModelError::InvalidConfig {
            path: path.to_path_buf(),
            field,
            reason,
        };
        let serde_json::Value::Object(obj) = value else {
            return Err(bad(
                "(top level)",
                format!("expected a JSON object, got {}", kind_of(&value)),
            ));
        };
        let get = |field: &str| obj.get(field).filter(|v| !v.is_null());
        let id = |field: &'static str| -> Result<Option<u32>, ModelError> {
            get(field)
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| bad(field, format!("expected a token id, got {}", show(v))))
                })
                .transpose()
        };
        let whole = |field: &'static str| -> Result<Option<usize>, ModelError> {
            get(field)
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| {
                            bad(
                                field,
                                format!("expected a whole number >= 0, got {}", show(v)),
                            )
                        })
                })
                .transpose()
        };
        let real = |field: &'static str,
                    must: &str,
                    ok: fn(f64) -> bool|
         -> Result<Option<f64>, ModelError> {
            get(field)
                .map(|v| match v.as_f64() {
                    Some(x) if ok(x) => Ok(x),
                    Some(_) => Err(bad(field, format!("{} is not {must}", show(v)))),
                    None => Err(bad(
                        field,
                        format!("expected a number {must}, got {}", show(v)),
                    )),
                })
                .transpose()
        };
        let eos_token_id = match get("eos_token_id") {
            None => Vec::new(),
            Some(v) => ids_from_value(v).ok_or_else(|| {
                bad(
                    "eos_token_id",
                    format!(
                        "expected a token id or a list of token ids, got {}",
                        show(v)
                    ),
                )
            })?,
        };
        let do_sample = match get("do_sample") {
            None => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(v) => {
                return Err(bad(
                    "do_sample",
                    format!("expected true or false, got {}", show(v)),
                ))
            }
        };
        Ok(GenerationConfig {
            bos_token_id: id("bos_token_id")?,
            eos_token_id,
            pad_token_id: id("pad_token_id")?,
            do_sample,
            temperature: real("temperature", "finite and >= 0", |x| {
                x.is_finite() && x >= 0.0
            })?,
            top_k: whole("top_k")?,
            top_p: real("top_p", "in (0, 1]", |x| x > 0.0 && x <= 1.0)?,
            min_p: real("min_p", "in [0, 1]", |x| (0.0..=1.0).contains(&x))?,
            repetition_penalty: real("repetition_penalty", "finite and > 0", |x| {
                x.is_finite() && x > 0.0
            })?,
            max_new_tokens: whole("max_new_tokens")?,
        })
    }

    /// `dir/generation_config.json` if present, else ids from `config`
    /// (bos, eos) and greedy defaults, as transformers does. A path that
    /// exists but is not a readable regular file is an error naming it.
    pub fn from_dir_or_config(dir: &Path, config: &Config) -> Result<GenerationConfig, ModelError> {
        let path = dir.join("generation_config.json");
        if path.exists() {
            return GenerationConfig::from_file(&path);
        }
        Ok(GenerationConfig {
            bos_token_id: config.bos_token_id,
            eos_token_id: config.eos_token_ids(),
            ..GenerationConfig::default()
        })
    }
}

/// A JSON value for an error message, cut to a readable length.
fn show(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s,
    }
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B-Instruct's config.json, verbatim.
    const QWEN_05B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"],
      "attention_dropout": 0.0,
      "bos_token_id": 151643,
      "eos_token_id": 151645,
      "hidden_act": "silu",
      "hidden_size": 896,
      "initializer_range": 0.02,
      "intermediate_size": 4864,
      "max_position_embeddings": 32768,
      "max_window_layers": 21,
      "model_type": "qwen2",
      "num_attention_heads": 14,
      "num_hidden_layers": 24,
      "num_key_value_heads": 2,
      "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0,
      "sliding_window": 32768,
      "tie_word_embeddings": true,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1",
      "use_cache": true,
      "use_sliding_window": false,
      "vocab_size": 151936
    }"#;

    fn parse(text: &str) -> Result<Config, ModelError> {
        Config::from_json_str(text, Path::new("/m/config.json"))
    }

    /// QWEN_05B with one field replaced (or removed when `value` is None).
    fn with(field: &str, value: Option<serde_json::Value>) -> String {
        let mut v: serde_json::Value = serde_json::from_str(QWEN_05B).unwrap();
        let obj = v.as_object_mut().unwrap();
        match value {
            Some(x) => obj.insert(field.to_string(), x),
            None => obj.remove(field),
        };
        v.to_string()
    }

    fn field_of(e: ModelError) -> &'static str {
        match e {
            ModelError::InvalidConfig { field, path, .. } => {
                assert_eq!(path, Path::new("/m/config.json"));
                field
            }
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn real_config_parses_and_matches_preset() {
        let c = parse(QWEN_05B).unwrap();
        let p = Config::preset("0.5b").unwrap();
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.q_dim(), 896);
        assert_eq!(c.kv_dim(), 128);
        assert_eq!(c.gqa_group(), 7);
        assert_eq!(c.eos_token_ids(), vec![151645]);
        // Same model apart from fields the file leaves implicit.
        assert_eq!(
            Config {
                head_dim: Some(64),
                max_window_layers: None,
                ..c
            },
            p,
            "0.5b preset must equal the real config"
        );
    }

    #[test]
    fn every_preset_is_valid_and_matches_table() {
        for name in PRESETS {
            let c = Config::preset(name).unwrap();
            c.validate().unwrap();
            assert_eq!(c.head_dim(), if name == "0.5b" { 64 } else { 128 });
            assert_eq!(
                c.tie_word_embeddings,
                matches!(name, "0.5b" | "1.5b" | "3b")
            );
            // Round trip through JSON as HF names.
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(parse(&json).unwrap(), c);
        }
        let c = Config::preset("14B").unwrap();
        assert_eq!(
            (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
            (5120, 13824, 48)
        );
        assert_eq!(Config::preset("Qwen2.5-72B").unwrap().hidden_size, 8192);
        assert!(matches!(
            Config::preset("13b"),
            Err(ModelError::UnknownPreset { .. })
        ));
    }

    #[test]
    fn missing_kv_heads_defaults_to_heads() {
        let c = parse(&with("num_key_value_heads", None)).unwrap();
        assert_eq!(c.num_kv_heads(), 14);
        assert_eq!(c.kv_dim(), 896);
    }

    #[test]
    fn zero_sizes_name_their_field() {
        for field in [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ] {
            let e = parse(&with(field, Some(0.into()))).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
            assert_eq!(field_of(e), field);
        }
    }

    #[test]
    fn non_dividing_heads() {
        let e = parse(&with("num_key_value_heads", Some(3.into()))).unwrap_err();
        assert!(e.to_string().contains("does not divide"), "{e}");
        assert_eq!(field_of(e), "num_key_value_heads");
        let e = parse(&with("num_key_value_heads", Some(28.into()))).unwrap_err();
        assert_eq!(field_of(e), "num_key_value_heads");
        // hidden 896 / 12 heads is not exact, no head_dim given
        let e = parse(&with("num_attention_heads", Some(12.into()))).unwrap_err();
        assert_eq!(field_of(e), "hidden_size");
        // with an explicit head_dim it is fine (heads*head_dim need not be hidden)
        let mut v: serde_json::Value =
            serde_json::from_str(&with("num_attention_heads", Some(12.into()))).unwrap();
        v["head_dim"] = 64.into();
        parse(&v.to_string()).unwrap();
        let e = parse(&with("head_dim", Some(63.into()))).unwrap_err();
        assert_eq!(field_of(e), "head_dim");
    }

    #[test]
    fn unknown_architecture_and_model_type() {
        let e = parse(&with("model_type", Some("llama".into()))).unwrap_err();
        assert!(e.to_string().contains("llama"), "{e}");
        assert_eq!(field_of(e), "model_type");
        let e = parse(&with(
            "architectures",
            Some(serde_json::json!(["Qwen2ForSequenceClassification"])),
        ))
        .unwrap_err();
        assert_eq!(field_of(e), "architectures");
    }

    #[test]
    fn sliding_window_rejected() {
        // max_window_layers 21 < 24 layers: layers 21.. would slide.
        let e = parse(&with("use_sliding_window", Some(true.into()))).unwrap_err();
        assert!(e.to_string().contains("layers 21.."), "{e}");
        assert_eq!(field_of(e), "use_sliding_window");
    }

    /// transformers turns the window on only with `use_sliding_window` and
    /// a `sliding_window`, and only from `max_window_layers` on (or where
    /// `layer_types` says): a config where no layer slides runs.
    #[test]
    fn sliding_window_that_no_layer_reaches_runs() {
        let mut v: serde_json::Value = serde_json::from_str(QWEN_05B).unwrap();
        v["use_sliding_window"] = true.into();
        v["max_window_layers"] = 24.into();
        parse(&v.to_string()).unwrap();
        v["sliding_window"] = serde_json::Value::Null;
        v["max_window_layers"] = 0.into();
        parse(&v.to_string()).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(QWEN_05B).unwrap();
        v["use_sliding_window"] = true.into();
        v["max_window_layers"] = 0.into();
        let mut kinds = vec!["full_attention"; 24];
        v["layer_types"] = serde_json::json!(kinds);
        parse(&v.to_string()).unwrap();
        kinds[5] = "sliding_attention";
        v["layer_types"] = serde_json::json!(kinds);
        let e = parse(&v.to_string()).unwrap_err();
        assert!(e.to_string().contains("layers 5.."), "{e}");
        assert_eq!(field_of(e), "use_sliding_window");
        kinds[5] = "linear_attention";
        v["layer_types"] = serde_json::json!(kinds);
        assert_eq!(field_of(parse(&v.to_string()).unwrap_err()), "layer_types");
    }

    /// Every field that changes the maths runs as the file says or is
    /// refused with its name and value.
    #[test]
    fn math_fields_are_run_or_refused_by_name() {
        for ok in ["silu", "swish"] {
            parse(&with("hidden_act", Some(ok.into()))).unwrap();
        }
        let refused: [(&str, serde_json::Value, &str); 8] = [
            ("hidden_act", "gelu".into(), "gelu"),
            ("hidden_act", "relu".into(), "relu"),
            (
                "quantization_config",
                serde_json::json!({"quant_method": "awq", "bits": 4}),
                "awq",
            ),
            (
                "quantization_config",
                serde_json::json!({"quant_method": "fp8"}),
                "fp8",
            ),
            ("attention_bias", false.into(), "false"),
            ("mlp_bias", true.into(), "true"),
            ("partial_rotary_factor", 0.5.into(), "0.5"),
            (
                "rope_scaling",
                serde_json::json!({"type": "linear", "factor": 2.0}),
                "linear",
            ),
        ];
        for (field, value, needle) in refused {
            let e = parse(&with(field, Some(value.clone()))).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(needle), "{field} = {value}: {msg}");
            assert_eq!(field_of(e), field, "{field} = {value}");
        }
        for (field, value) in [
            ("attention_bias", serde_json::Value::from(true)),
            ("mlp_bias", false.into()),
            ("partial_rotary_factor", 1.0.into()),
            ("quantization_config", serde_json::Value::Null),
        ] {
            parse(&with(field, Some(value))).unwrap();
        }
    }

    /// Qwen2.5's documented YaRN setting, in both forms transformers
    /// writes, and a newer file with the base only inside
    /// `rope_parameters`.
    #[test]
    fn yarn_in_both_forms_and_base_inside_rope_parameters() {
        use crate::rope::RopeScaling;
        let old = parse(&with(
            "rope_scaling",
            Some(serde_json::json!({"type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768})),
        ))
        .unwrap();
        let mut v: serde_json::Value = serde_json::from_str(QWEN_05B).unwrap();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768, "rope_theta": 1000000.0});
        let new = parse(&v.to_string()).unwrap();
        assert_eq!(old.rope().unwrap(), new.rope().unwrap());
        assert!(matches!(old.rope().unwrap().scaling, RopeScaling::Yarn(_)));
        assert_eq!(old.max_context(), 131_072);
        assert_eq!(parse(QWEN_05B).unwrap().max_context(), 32_768);
        // No base anywhere: transformers' default.
        v["rope_parameters"] = serde_json::json!({"rope_type": "default"});
        assert_eq!(
            parse(&v.to_string()).unwrap().rope().unwrap().theta,
            10_000.0
        );
    }

    #[test]
    fn bad_floats_rejected() {
        let e = parse(&with("rms_norm_eps", Some((-1.0).into()))).unwrap_err();
        assert_eq!(field_of(e), "rms_norm_eps");
        let e = parse(&with("rope_theta", Some(0.0.into()))).unwrap_err();
        assert_eq!(field_of(e), "rope_theta");
    }

    #[test]
    fn malformed_json_names_file() {
        let e = parse("{ not json").unwrap_err();
        assert!(matches!(e, ModelError::Json { .. }));
        assert!(e.to_string().starts_with("/m/config.json"), "{e}");
        let e = parse(&with("hidden_size", None)).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let e = Config::from_file(Path::new("/nonexistent/config.json")).unwrap_err();
        assert!(matches!(e, ModelError::Io { .. }));
        assert!(e.to_string().contains("/nonexistent/config.json"), "{e}");
    }

    fn gen(text: &str) -> Result<GenerationConfig, ModelError> {
        GenerationConfig::from_json_str(text, Path::new("/m/generation_config.json"))
    }

    #[test]
    fn generation_config_int_or_list() {
        // Qwen2.5-0.5B-Instruct's generation_config.json, verbatim.
        let g = gen(
            r#"{"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true,
                "eos_token_id": [151645, 151643], "repetition_penalty": 1.1,
                "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}"#,
        )
        .unwrap();
        assert_eq!(g.eos_token_id, vec![151645, 151643]);
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.temperature, Some(0.7));
        assert_eq!(g.top_p, Some(0.8));
        assert_eq!(g.repetition_penalty, Some(1.1));
        assert_eq!(g.min_p, None);
        assert!(g.do_sample);
        let g = gen(r#"{"eos_token_id": 7, "min_p": 0.05}"#).unwrap();
        assert_eq!(g.eos_token_id, vec![7]);
        assert_eq!(g.min_p, Some(0.05));
        assert_eq!(g.bos_token_id, None);
        assert!(!g.do_sample);
        assert_eq!(gen("{}").unwrap(), GenerationConfig::default());
        // null is absent, as transformers writes it.
        let g = gen(r#"{"temperature": null, "do_sample": null, "eos_token_id": null}"#).unwrap();
        assert_eq!(g, GenerationConfig::default());

        let dir = tempfile::tempdir().unwrap();
        let c = Config::preset("7b").unwrap();
        let g = GenerationConfig::from_dir_or_config(dir.path(), &c).unwrap();
        assert_eq!(g.eos_token_id, vec![151645]);
        assert_eq!(g.bos_token_id, Some(151643));
        assert!(!g.do_sample, "no file: greedy, as transformers");
        let p = dir.path().join("generation_config.json");
        std::fs::write(&p, r#"{"eos_token_id": [1, 2]}"#).unwrap();
        assert_eq!(
            GenerationConfig::from_dir_or_config(dir.path(), &c)
                .unwrap()
                .eos_token_id,
            vec![1, 2]
        );
        std::fs::write(&p, r#"{"eos_token_id": [1, -2]}"#).unwrap();
        let e = GenerationConfig::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        // A directory in the file's place is an error, not "no file".
        std::fs::remove_file(&p).unwrap();
        std::fs::create_dir(&p).unwrap();
        let e = GenerationConfig::from_dir_or_config(dir.path(), &c)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("not a regular file"),
            "{e}"
        );
    }

    #[test]
    fn hostile_generation_configs_are_refused_naming_file_and_field() {
        let cases = [
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"temperature": -0.5}"#, "temperature"),
            (r#"{"temperature": [0.7]}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"top_k": -1}"#, "top_k"),
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"top_k": 1e30}"#, "top_k"),
            (r#"{"min_p": -0.1}"#, "min_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"repetition_penalty": -1.1}"#, "repetition_penalty"),
            (r#"{"do_sample": "yes"}"#, "do_sample"),
            (r#"{"do_sample": 1}"#, "do_sample"),
            (r#"{"eos_token_id": "x"}"#, "eos_token_id"),
            (r#"{"eos_token_id": 4294967296}"#, "eos_token_id"),
            (r#"{"bos_token_id": -1}"#, "bos_token_id"),
            (r#"{"pad_token_id": {}}"#, "pad_token_id"),
            (r#"{"max_new_tokens": -5}"#, "max_new_tokens"),
            ("[1, 2]", "(top level)"),
            ("7", "(top level)"),
        ];
        for (text, field) in cases {
            match gen(text) {
                Err(e @ ModelError::InvalidConfig { field: f, .. }) => {
                    assert_eq!(f, field, "{text}");
                    let m = e.to_string();
                    assert!(
                        m.contains("/m/generation_config.json") && m.contains(field),
                        "{m}"
                    );
                }
                other => panic!("{text}: expected InvalidConfig({field}), got {other:?}"),
            }
        }
        // What is not JSON at all: NaN and infinities are not JSON numbers,
        // nor is 1e999 (out of range), and nesting is bounded by serde_json.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        for text in [
            r#"{"temperature": NaN}"#,
            r#"{"temperature": Infinity}"#,
            r#"{"temperature": 1e999}"#,
            "",
            "{",
            deep.as_str(),
        ] {
            let e = gen(text).unwrap_err();
            assert!(matches!(e, ModelError::Json { .. }), "{e}");
            assert!(e.to_string().contains("/m/generation_config.json"), "{e}");
        }
        // A long value is cut in the message.
        let long = format!(r#"{{"temperature": "{}"}}"#, "x".repeat(10_000));
        let e = gen(&long).unwrap_err().to_string();
        assert!(e.len() < 300, "{e}");
        // A file over the cap is refused before parsing (small_file.rs tests
        // the cap itself).
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("generation_config.json");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(crate::SMALL_FILE_CAP + 1).unwrap();
        let e = GenerationConfig::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("limit"),
            "{e}"
        );
    }
}
