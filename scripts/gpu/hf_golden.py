#!/usr/bin/env python3
"""Record Hugging Face transformers' greedy decoding as golden data.

  python3 scripts/gpu/hf_golden.py MODEL_DIR PROMPTS.jsonl OUT.jsonl
      [--new-tokens N] [--rope-scaling JSON] [--rope-out FILE]

Each input line: {"id": "...", "prompt": "...", "chat": true|false}. Each
output line adds input_ids (the tokenizer's ids, chat template applied when
chat is true), output_ids (the greedy continuation, float32 maths on the
checkpoint's weights, on the CPU), top5 (per generated step, the five best
[token_id, logprob] pairs) and text.

--rope-scaling replaces the config's `rope_scaling` (e.g. Qwen2.5's YaRN
setting '{"type": "yarn", "factor": 4.0, "original_max_position_embeddings":
32768}') through a patched copy of config.json; the other files are linked.
--rope-out writes the rotary frequencies and attention factor transformers
computed, so the engine's table can be compared number by number.

Compare an engine against it the way vLLM's check_logprobs_close does: ids
agree up to the first divergence, and there each side's token is in the
other's top 5 (crates/model/tests/golden.rs).
"""
import argparse
import json
import os
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("prompts")
ap.add_argument("out")
ap.add_argument("--new-tokens", type=int, default=48)
ap.add_argument("--rope-scaling")
ap.add_argument("--rope-out")
a = ap.parse_args()

model_dir = a.model
if a.rope_scaling:
    patched = tempfile.mkdtemp(prefix="hf-golden-")
    for name in os.listdir(a.model):
        if name != "config.json":
            os.symlink(os.path.join(os.path.abspath(a.model), name), os.path.join(patched, name))
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = json.loads(a.rope_scaling)
    with open(os.path.join(patched, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model_dir = patched

tok = AutoTokenizer.from_pretrained(model_dir)
m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
rot = m.model.rotary_emb
print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
      f"rope {rot.rope_type}, attention factor {rot.attention_scaling}", flush=True)
if a.rope_out:
    with open(a.rope_out, "w") as f:
        json.dump({"transformers": transformers.__version__, "rope_type": rot.rope_type,
                   "rope_scaling": json.loads(a.rope_scaling) if a.rope_scaling else None,
                   "attention_factor": float(rot.attention_scaling),
                   "inv_freq": [float(x) for x in rot.inv_freq.float().cpu()]}, f)
        f.write("\n")

with open(a.prompts) as f, open(a.out, "w") as out:
    for line in f:
        p = json.loads(line)
        text = p["prompt"]
        if p.get("chat"):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            # Greedy over the raw logits: do_sample=False alone would still
            # apply a repetition_penalty from the model's generation_config.json
            # (qwen-mk's --temperature 0 does not).
            g = m.generate(ids, max_new_tokens=a.new_tokens, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, eos_token_id=None, pad_token_id=151643,
                           repetition_penalty=1.0)
        gen = g.sequences[0, ids.shape[1]:].tolist()
        top5 = []
        for s in g.scores:
            lp = torch.log_softmax(s[0].float(), -1)
            v, i = lp.topk(5)
            top5.append([[int(t), round(float(x), 5)] for t, x in zip(i, v)])
        p.update(input_ids=ids[0].tolist(), output_ids=gen, top5=top5, text=tok.decode(gen))
        out.write(json.dumps(p, ensure_ascii=False) + "\n")
        print(p["id"], len(ids[0]), repr(p["text"][:80]), flush=True)
