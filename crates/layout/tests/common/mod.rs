//! Qwen2.5 preset dimensions, hard-coded here (layout must not depend on the
//! model crate), and the stacked tensors a megakernel builds from them.

#![allow(dead_code)]

use qmk_layout::{DType, TensorSpec};

/// One Qwen2.5 dense size, from its config.json.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    pub name: &'static str,
    pub hidden: u64,
    pub inter: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
}

/// `(name, hidden, inter, layers, heads, kv_heads, head_dim, vocab)`.
const fn p(name: &'static str, dims: [u64; 7]) -> Preset {
    let [hidden, inter, layers, heads, kv_heads, head_dim, vocab] = dims;
    Preset {
        name,
        hidden,
        inter,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
    }
}

pub const PRESETS: [Preset; 7] = [
    p("0.5B", [896, 4864, 24, 14, 2, 64, 151_936]),
    p("1.5B", [1536, 8960, 28, 12, 2, 128, 151_936]),
    p("3B", [2048, 11008, 36, 16, 2, 128, 151_936]),
    p("7B", [3584, 18944, 28, 28, 4, 128, 152_064]),
    p("14B", [5120, 13824, 48, 40, 8, 128, 152_064]),
    p("32B", [5120, 27648, 64, 40, 8, 128, 152_064]),
    p("72B", [8192, 29568, 80, 64, 8, 128, 152_064]),
];

pub fn preset(name: &str) -> Preset {
    *PRESETS.iter().find(|p| p.name == name).unwrap()
}

/// The stacked (layer-major) tensors, bf16, unfused, named as in the
/// checkpoint.
pub fn stacked_shapes(p: &Preset) -> Vec<(&'static str, Vec<u64>)> {
    let (l, h, i) = (p.layers, p.hidden, p.inter);
    let q = p.heads * p.head_dim;
    let kv = p.kv_heads * p.head_dim;
    vec![
        ("q_proj", vec![l, q, h]),                // [L, heads*hd, H]
        ("k_proj", vec![l, kv, h]),               // [L, kv*hd, H]
        ("v_proj", vec![l, kv, h]),               // [L, kv*hd, H]
        ("o_proj", vec![l, h, q]),                // [L, H, heads*hd]
        ("gate_proj", vec![l, i, h]),             // [L, I, H]
        ("up_proj", vec![l, i, h]),               // [L, I, H]
        ("down_proj", vec![l, h, i]),             // [L, H, I]
        ("q_bias", vec![l, q]),                   // [L, heads*hd]
        ("k_bias", vec![l, kv]),                  // [L, kv*hd]
        ("v_bias", vec![l, kv]),                  // [L, kv*hd]
        ("input_layernorm", vec![l, h]),          // [L, H]
        ("post_attention_layernorm", vec![l, h]), // [L, H]
    ]
}

pub fn stacked_specs(p: &Preset) -> Vec<TensorSpec> {
    stacked_shapes(p)
        .into_iter()
        .map(|(name, shape)| TensorSpec::row_major(name, &shape, DType::BF16).unwrap())
        .collect()
}

/// The model-wide constants the kernel header carries besides the plan.
pub fn header_consts(p: &Preset) -> Vec<(&'static str, u64)> {
    vec![
        ("kHidden", p.hidden),
        ("kIntermediate", p.inter),
        ("kNumLayers", p.layers),
        ("kNumHeads", p.heads),
        ("kNumKvHeads", p.kv_heads),
        ("kHeadDim", p.head_dim),
        ("kVocab", p.vocab),
    ]
}
