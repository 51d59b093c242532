//! The tiny synthetic Qwen2 shapes the engine's unit tests run on.

/// A 2-layer Qwen2 config with 4 query heads and 2 KV heads: hidden size
/// `hidden`, MLP width `inter`, head size `head_dim`, `vocab` tokens.
pub(crate) fn tiny_config(
    hidden: usize,
    inter: usize,
    head_dim: usize,
    vocab: usize,
) -> qmk_model::Config {
    let mut c = qmk_model::Config::preset("0.5b").unwrap();
    c.hidden_size = hidden;
    c.intermediate_size = inter;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = Some(2);
    c.head_dim = Some(head_dim);
    c.vocab_size = vocab;
    c
}
