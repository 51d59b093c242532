//! What a Qwen2.5 checkpoint must contain for a config, and the stacked
//! tensors the engine builds from it.
//!
//! Two views of the same weights:
//! - the *checkpoint* view: one tensor per layer and matrix, named as in
//!   Hugging Face (`model.layers.{i}.mlp.gate_proj.weight`, `[I, H]`);
//! - the *stacked* view: one tensor per matrix with the layer as axis 0
//!   (`gate_proj`, `[L, I, H]`), which the megakernel reads and the layout
//!   crate plans (and splits where a span passes the offset model's limit).
//!
//! L = layers, H = hidden, Q = heads*head_dim, KV = kv_heads*head_dim,
//! I = intermediate, V = vocab.

use qmk_layout::{Bytes, DType, Layout, ModelPlan, TensorSpec};

use crate::config::Config;
use crate::error::{checked_product, ModelError};

/// One stacked weight tensor of the engine (a field of [`crate::Weights`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightKind {
    /// `[V, H]` token embedding table.
    EmbedTokens,
    /// `[L, H]` RMSNorm weight before attention.
    InputLayernorm,
    /// `[L, Q, H]`
    QProj,
    /// `[L, Q]`
    QBias,
    /// `[L, KV, H]`
    KProj,
    /// `[L, KV]`
    KBias,
    /// `[L, KV, H]`
    VProj,
    /// `[L, KV]`
    VBias,
    /// `[L, H, Q]`
    OProj,
    /// `[L, H]` RMSNorm weight before the MLP.
    PostAttentionLayernorm,
    /// `[L, I, H]`
    GateProj,
    /// `[L, I, H]`
    UpProj,
    /// `[L, H, I]`
    DownProj,
    /// `[H]` final RMSNorm weight.
    Norm,
    /// `[V, H]` output projection; only when `tie_word_embeddings` is false.
    LmHead,
}

/// Checked model dimensions as u64 (so products cannot wrap silently).
#[derive(Debug, Clone, Copy)]
struct Dims {
    h: u64,
    q: u64,
    kv: u64,
    i: u64,
    v: u64,
}

impl Dims {
    fn of(c: &Config) -> Result<Dims, ModelError> {
        let w = |n: usize| n as u64; // usize is at most 64 bits on every target we build
        let hd = w(c.head_dim());
        let width = |what: &str, heads: usize| {
            w(heads)
                .checked_mul(hd)
                .ok_or_else(|| ModelError::overflow(what, format!("{heads} heads x head_dim {hd}")))
        };
        Ok(Dims {
            h: w(c.hidden_size),
            q: width("q_proj width", c.num_attention_heads)?,
            kv: width("k_proj/v_proj width", c.num_kv_heads())?,
            i: w(c.intermediate_size),
            v: w(c.vocab_size),
        })
    }
}

impl WeightKind {
    /// Every kind, in the order of [`crate::Weights`]' fields (and of
    /// [`stacked_specs`]).
    pub const ALL: [WeightKind; 15] = [
        WeightKind::EmbedTokens,
        WeightKind::InputLayernorm,
        WeightKind::QProj,
        WeightKind::QBias,
        WeightKind::KProj,
        WeightKind::KBias,
        WeightKind::VProj,
        WeightKind::VBias,
        WeightKind::OProj,
        WeightKind::PostAttentionLayernorm,
        WeightKind::GateProj,
        WeightKind::UpProj,
        WeightKind::DownProj,
        WeightKind::Norm,
        WeightKind::LmHead,
    ];

    /// The stacked tensor's name (the `Weights` field name), e.g. `"q_bias"`.
    pub const fn name(self) -> &'static str {
        match self {
            WeightKind::EmbedTokens => "embed_tokens",
            WeightKind::InputLayernorm => "input_layernorm",
            WeightKind::QProj => "q_proj",
            WeightKind::QBias => "q_bias",
            WeightKind::KProj => "k_proj",
            WeightKind::KBias => "k_bias",
            WeightKind::VProj => "v_proj",
            WeightKind::VBias => "v_bias",
            WeightKind::OProj => "o_proj",
            WeightKind::PostAttentionLayernorm => "post_attention_layernorm",
            WeightKind::GateProj => "gate_proj",
            WeightKind::UpProj => "up_proj",
            WeightKind::DownProj => "down_proj",
            WeightKind::Norm => "norm",
            WeightKind::LmHead => "lm_head",
        }
    }

    /// Position in [`WeightKind::ALL`]; also the tensor id of
    /// [`crate::synthetic`].
    pub const fn index(self) -> usize {
        self as usize
    }

    /// True for the tensors with one checkpoint tensor per layer (stacked
    /// along axis 0).
    pub const fn per_layer(self) -> bool {
        !matches!(
            self,
            WeightKind::EmbedTokens | WeightKind::Norm | WeightKind::LmHead
        )
    }

    /// Whether the engine holds this tensor for `config`: `lm_head` only
    /// when untied (tied models read `embed_tokens` as the LM head).
    pub fn present(self, config: &Config) -> bool {
        self != WeightKind::LmHead || !config.tie_word_embeddings
    }

    /// The Hugging Face checkpoint name; `layer` is ignored for the
    /// non-per-layer kinds.
    pub fn checkpoint_name(self, layer: usize) -> String {
        let attn = |p: &str| format!("model.layers.{layer}.self_attn.{p}");
        let mlp = |p: &str| format!("model.layers.{layer}.mlp.{p}");
        match self {
            WeightKind::EmbedTokens => "model.embed_tokens.weight".to_string(),
            WeightKind::InputLayernorm => format!("model.layers.{layer}.input_layernorm.weight"),
            WeightKind::QProj => attn("q_proj.weight"),
            WeightKind::QBias => attn("q_proj.bias"),
            WeightKind::KProj => attn("k_proj.weight"),
            WeightKind::KBias => attn("k_proj.bias"),
            WeightKind::VProj => attn("v_proj.weight"),
            WeightKind::VBias => attn("v_proj.bias"),
            WeightKind::OProj => attn("o_proj.weight"),
            WeightKind::PostAttentionLayernorm => {
                format!("model.layers.{layer}.post_attention_layernorm.weight")
            }
            WeightKind::GateProj => mlp("gate_proj.weight"),
            WeightKind::UpProj => mlp("up_proj.weight"),
            WeightKind::DownProj => mlp("down_proj.weight"),
            WeightKind::Norm => "model.norm.weight".to_string(),
            WeightKind::LmHead => "lm_head.weight".to_string(),
        }
    }

    /// Shape of one checkpoint tensor (one layer's slice), row-major,
    /// `[out, in]` for projections as in `nn.Linear`.
    pub fn item_shape(self, config: &Config) -> Result<Vec<u64>, ModelError> {
        let d = Dims::of(config)?;
        Ok(match self {
            WeightKind::EmbedTokens | WeightKind::LmHead => vec![d.v, d.h],
            WeightKind::InputLayernorm | WeightKind::PostAttentionLayernorm | WeightKind::Norm => {
                vec![d.h]
            }
            WeightKind::QProj => vec![d.q, d.h],
            WeightKind::QBias => vec![d.q],
            WeightKind::KProj | WeightKind::VProj => vec![d.kv, d.h],
            WeightKind::KBias | WeightKind::VBias => vec![d.kv],
            WeightKind::OProj => vec![d.h, d.q],
            WeightKind::GateProj | WeightKind::UpProj => vec![d.i, d.h],
            WeightKind::DownProj => vec![d.h, d.i],
        })
    }

    /// Shape of the stacked tensor: `[L, ..item]` for per-layer kinds, the
    /// item shape otherwise.
    pub fn stacked_shape(self, config: &Config) -> Result<Vec<u64>, ModelError> {
        let item = self.item_shape(config)?;
        Ok(if self.per_layer() {
            std::iter::once(config.num_hidden_layers as u64)
                .chain(item)
                .collect()
        } else {
            item
        })
    }

    /// Elements of one checkpoint tensor (one layer), checked.
    pub fn item_elems(self, config: &Config) -> Result<u64, ModelError> {
        checked_product(self.name(), &self.item_shape(config)?)
    }

    /// Elements of the stacked tensor, checked.
    pub fn stacked_elems(self, config: &Config) -> Result<u64, ModelError> {
        checked_product(self.name(), &self.stacked_shape(config)?)
    }

    /// Number of checkpoint tensors stacked into this one: L or 1.
    pub fn items(self, config: &Config) -> usize {
        if self.per_layer() {
            config.num_hidden_layers
        } else {
            1
        }
    }
}

/// The kinds the engine holds for `config`, in [`WeightKind::ALL`] order.
pub fn present_kinds(config: &Config) -> impl Iterator<Item = WeightKind> + '_ {
    WeightKind::ALL.into_iter().filter(|k| k.present(config))
}

/// One tensor a checkpoint must contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// Hugging Face name, e.g. `model.layers.3.mlp.up_proj.weight`.
    pub name: String,
    /// Row-major shape the config implies.
    pub shape: Vec<u64>,
    /// The stacked tensor it goes into.
    pub kind: WeightKind,
    /// Its index along the stacked axis (0 for non-per-layer kinds).
    pub layer: usize,
}

/// Every tensor a checkpoint must hold for `config` (`lm_head.weight` only
/// when untied; a tied checkpoint may carry it and it is then ignored).
/// Errors: an invalid config, or a size that overflows.
pub fn checkpoint_inventory(config: &Config) -> Result<Vec<ExpectedTensor>, ModelError> {
    Ok(expected_tensors(config)?.collect())
}

/// [`checkpoint_inventory`] as a lazy iterator, same order: a checker that
/// stops at the first bad tensor never lists the rest (a hostile config.json
/// may claim 10^15 layers).
pub fn expected_tensors(
    config: &Config,
) -> Result<impl Iterator<Item = ExpectedTensor> + '_, ModelError> {
    config.validate()?;
    let mut kinds = Vec::new();
    for kind in present_kinds(config) {
        let shape = kind.item_shape(config)?;
        // Checked here so later element counts of single items cannot wrap.
        kind.item_elems(config)?;
        kinds.push((kind, shape));
    }
    Ok(kinds.into_iter().flat_map(move |(kind, shape)| {
        (0..kind.items(config)).map(move |layer| ExpectedTensor {
            name: kind.checkpoint_name(layer),
            shape: shape.clone(),
            kind,
            layer,
        })
    }))
}

/// Every stacked weight tensor as a layout-crate spec: bf16, row-major,
/// axis 0 = layers for per-layer kinds (`embed_tokens` `[V, H]`, `lm_head`
/// `[V, H]` when untied, `norm` `[H]` are not stacked). Order as
/// [`WeightKind::ALL`].
pub fn stacked_specs(config: &Config) -> Result<Vec<TensorSpec>, ModelError> {
    config.validate()?;
    present_kinds(config)
        .map(|kind| {
            let shape = kind.stacked_shape(config)?;
            let layout = Layout::row_major(&shape).map_err(|source| ModelError::Layout {
                tensor: kind.name().to_string(),
                source: Box::new(source),
            })?;
            Ok(TensorSpec {
                name: kind.name().to_string(),
                layout,
                dtype: DType::BF16,
            })
        })
        .collect()
}

/// The split plan of every stacked tensor under the offset model the kernel
/// is compiled with.
pub fn model_plan(config: &Config) -> Result<ModelPlan, ModelError> {
    let specs = stacked_specs(config)?;
    qmk_layout::plan_model(&specs, &qmk_layout::KERNEL_OFFSET_MODEL).map_err(|source| {
        ModelError::Layout {
            tensor: "(model plan)".to_string(),
            source: Box::new(source),
        }
    })
}

/// Weight bytes of a model in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightBytes {
    /// Every stacked tensor (embedding table and, when untied, lm_head).
    pub total: Bytes,
    /// Bytes one decode step must read: every weight except the embedding
    /// table, plus the one embedding row of the input token, plus the LM
    /// head matrix (which for a tied model *is* the embedding table, read in
    /// full to compute logits). The KV cache is not included.
    pub per_decode_step: Bytes,
}

/// Total and per-decode-step weight bytes for `config` (bf16), checked.
pub fn weight_bytes(config: &Config) -> Result<WeightBytes, ModelError> {
    config.validate()?;
    let bf16 = DType::BF16.size_bytes();
    let bytes_of = |kind: WeightKind| -> Result<u64, ModelError> {
        kind.stacked_elems(config)?
            .checked_mul(bf16)
            .ok_or_else(|| ModelError::overflow(kind.name(), "bytes exceed u64"))
    };
    let sum = |acc: u64, b: u64| {
        acc.checked_add(b)
            .ok_or_else(|| ModelError::overflow("total weight bytes", "sum exceeds u64"))
    };
    let mut total = 0u64;
    let mut step = 0u64;
    for kind in present_kinds(config) {
        let b = bytes_of(kind)?;
        total = sum(total, b)?;
        if kind != WeightKind::EmbedTokens {
            step = sum(step, b)?;
        }
    }
    let row = (config.hidden_size as u64)
        .checked_mul(bf16)
        .ok_or_else(|| ModelError::overflow("embedding row", "bytes exceed u64"))?;
    step = sum(step, row)?;
    if config.tie_word_embeddings {
        // The tied LM head is the embedding table, read whole every step.
        step = sum(step, bytes_of(WeightKind::EmbedTokens)?)?;
    }
    Ok(WeightBytes {
        total: Bytes(total),
        per_decode_step: Bytes(step),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PRESETS;

    #[test]
    fn inventory_counts_and_names() {
        let c = Config::preset("0.5b").unwrap();
        let inv = checkpoint_inventory(&c).unwrap();
        // 12 per layer + embed + norm; tied: no lm_head.
        assert_eq!(inv.len(), 24 * 12 + 2);
        assert!(inv.iter().all(|t| t.name != "lm_head.weight"));
        let t = inv
            .iter()
            .find(|t| t.name == "model.layers.23.self_attn.k_proj.bias")
            .unwrap();
        assert_eq!(
            (t.kind, t.layer, t.shape.clone()),
            (WeightKind::KBias, 23, vec![128])
        );
        let t = inv
            .iter()
            .find(|t| t.name == "model.layers.0.mlp.down_proj.weight")
            .unwrap();
        assert_eq!(t.shape, vec![896, 4864]);

        let c = Config::preset("7b").unwrap();
        let inv = checkpoint_inventory(&c).unwrap();
        assert_eq!(inv.len(), 28 * 12 + 3);
        let lm = inv.iter().find(|t| t.name == "lm_head.weight").unwrap();
        assert_eq!(lm.shape, vec![152064, 3584]);
    }

    #[test]
    fn stacked_specs_shapes() {
        let c = Config::preset("14b").unwrap();
        let specs = stacked_specs(&c).unwrap();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            WeightKind::ALL.iter().map(|k| k.name()).collect::<Vec<_>>()
        );
        let gate = WeightKind::GateProj.stacked_shape(&c).unwrap();
        assert_eq!(gate, vec![48, 13824, 5120]);
        assert_eq!(
            WeightKind::DownProj.stacked_shape(&c).unwrap(),
            vec![48, 5120, 13824]
        );
        assert_eq!(WeightKind::QBias.stacked_shape(&c).unwrap(), vec![48, 5120]);
        assert_eq!(
            WeightKind::KProj.stacked_shape(&c).unwrap(),
            vec![48, 1024, 5120]
        );
        assert_eq!(WeightKind::Norm.stacked_shape(&c).unwrap(), vec![5120]);
        // The seed's 6.79 GB stacked gate.
        assert_eq!(
            WeightKind::GateProj.stacked_elems(&c).unwrap() * 2,
            6_794_772_480
        );
        // Tied models have no lm_head spec.
        let c = Config::preset("3b").unwrap();
        assert!(stacked_specs(&c)
            .unwrap()
            .iter()
            .all(|s| s.name != "lm_head"));
    }

    #[test]
    fn weight_bytes_match_known_sizes() {
        // 0.5B: 494,032,768 parameters (HF model card); tied, so the LM head
        // read is the whole embedding table.
        let c = Config::preset("0.5b").unwrap();
        let b = weight_bytes(&c).unwrap();
        assert_eq!(b.total, Bytes(494_032_768 * 2));
        assert_eq!(b.per_decode_step, Bytes(494_032_768 * 2 + 896 * 2));
        // 7B: 7,615,616,512 parameters; untied, the embedding table is not read.
        let c = Config::preset("7b").unwrap();
        let b = weight_bytes(&c).unwrap();
        assert_eq!(b.total, Bytes(7_615_616_512 * 2));
        assert_eq!(
            b.per_decode_step,
            Bytes((7_615_616_512 - 152_064 * 3584 + 3584) * 2)
        );
        for name in PRESETS {
            let b = weight_bytes(&Config::preset(name).unwrap()).unwrap();
            assert!(b.per_decode_step <= Bytes(b.total.0 + 16384));
        }
    }

    #[test]
    fn overflowing_config_is_a_typed_error() {
        let mut c = Config::preset("0.5b").unwrap();
        c.hidden_size = usize::MAX / 2;
        c.head_dim = Some(64);
        c.intermediate_size = usize::MAX / 2;
        let e = weight_bytes(&c).unwrap_err();
        assert!(matches!(e, ModelError::Overflow { .. }), "{e}");
        let e = stacked_specs(&c).unwrap_err();
        assert!(
            matches!(e, ModelError::Overflow { .. } | ModelError::Layout { .. }),
            "{e}"
        );
    }

    #[test]
    fn invalid_config_rejected_before_layout() {
        let mut c = Config::preset("0.5b").unwrap();
        c.num_hidden_layers = 0;
        assert!(matches!(
            stacked_specs(&c),
            Err(ModelError::InvalidConfig {
                field: "num_hidden_layers",
                ..
            })
        ));
    }
}
