"""What rounding the decode's matvec inputs does to the Hugging Face match,
on the CPU reference and the real 0.5B checkpoint (no GPU).

A tensor-core step multiplies bf16 by bf16, so its inputs (the normed
residual, the attention output, the MLP's hidden vector) lose their f32
mantissa unless each is split into two bf16 planes, hi = bf16(x) and
lo = bf16(x - hi). `cpu-inputs.patch` makes the CPU reference's matmul do
either (QMK_LAB_BF16_INPUTS=1: bf16; =2: hi + lo). This script runs the 8
golden prompts greedily for 48 tokens with each setting and reports, per
setting, the prompts identical to Hugging Face's tokens and the distance of
every top-5 logprob from Hugging Face's over the identical prefix.

    git apply scripts/gpu/lab/tensor-dot/cpu-inputs.patch
    cargo build --release -p qwen-mk
    python3 scripts/gpu/lab/tensor-dot/cpu_goldens.py QWEN_MK MODEL_DIR GOLDEN_JSONL

MODEL_DIR: the directory fetch-real-qwen prints; GOLDEN_JSONL: the 8
goldens (crates/model/tests/data/golden/qwen2.5-coder-0.5b-instruct.jsonl).
About 2 minutes per setting on 2 cores.
"""

import json
import os
import subprocess
import sys

qwen_mk, model, golden_path = sys.argv[1:4]
goldens = [json.loads(line) for line in open(golden_path) if line.strip()]

for name, setting in (("f32", None), ("bf16", "1"), ("bf16 hi + lo", "2")):
    env = dict(os.environ)
    env.pop("QMK_LAB_BF16_INPUTS", None)
    if setting:
        env["QMK_LAB_BF16_INPUTS"] = setting
    identical, diverged, dists = 0, [], []
    for g in goldens:
        args = [qwen_mk, "generate", "--model", model, "--backend", "cpu", "--max-new-tokens", "48",
                "--ignore-eos", "--temperature", "0", "--json", "--top-logprobs", "5", "--prompt", g["prompt"]]
        if g["chat"] is False:
            args.append("--raw")
        r = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
        ours = json.loads(r.stdout.strip().splitlines()[-1])
        want, got = g["output_ids"], ours["output_ids"]
        first = next((i for i in range(len(want)) if want[i] != got[i]), None)
        if first is None:
            identical += 1
        else:
            diverged.append(f'{g["id"]} at step {first}')
        for s in range(len(want) if first is None else first):
            hf = {p[0]: p[1] for p in g["top5"][s]}
            mine = {p[0]: p[1] for p in ours["top_logprobs"][s]}
            dists += [abs(hf[t] - mine[t]) for t in hf if t in mine]
    dists.sort()
    print(f"{name}: {identical} of {len(goldens)} identical ({', '.join(diverged) or 'none diverged'}); "
          f"top-5 |logprob - HF|: mean {sum(dists) / len(dists):.2e}, median {dists[len(dists) // 2]:.2e}, "
          f"p99 {dists[int(len(dists) * 0.99)]:.2e}, max {dists[-1]:.2e} over {len(dists)}", flush=True)
