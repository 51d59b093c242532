#!/usr/bin/env python3
"""What cuBLAS (through torch) reaches on the prefill GEMM shapes of one model
on this GPU: the four projections of every layer at T tokens, each layer its
own weights (so the weights stream from HBM as in the prefill kernel), bf16,
timed with CUDA events, median of --reps runs of all layers. A reference
(what a vendor library does on the same shapes, in the same power state),
not a test; docs/decisions/0007-prefill-wgmma.md uses it.

    python3 scripts/gpu/lab/torch_gemm_ref.py --preset 7b --tokens 2048
"""
import argparse
import json
import statistics

import torch

SHAPES = {
    # hidden, q_dim, kv_dim, intermediate, layers
    "0.5b": (896, 896, 128, 4864, 24),
    "7b": (3584, 3584, 512, 18944, 28),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    h, q, kv, inter, layers = SHAPES[a.preset]
    t = a.tokens
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)

    # [layers] of W [N, K] per projection; y = x @ W^T as in nn.Linear.
    gemms = {
        "qkv": (h, q + 2 * kv),
        "o_proj": (q, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
    }
    ws = {k: [w(n, kk) for _ in range(layers)] for k, (kk, n) in gemms.items()}
    xs = {k: torch.randn(t, kk, device=dev, generator=g, dtype=torch.bfloat16) for k, (kk, _) in gemms.items()}
    res = {}
    for name, (kk, n) in gemms.items():
        for _ in range(2):
            for l in range(layers):
                torch.nn.functional.linear(xs[name], ws[name][l])
        ms = []
        for _ in range(a.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for l in range(layers):
                torch.nn.functional.linear(xs[name], ws[name][l])
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        med = statistics.median(ms)
        flop = 2.0 * t * kk * n * layers
        res[name] = {"ms": med, "tflops": flop / (med * 1e-3) / 1e12}
        print(f"torch {a.preset} T={t} {name:8s} [{t}x{kk}] . [{kk}x{n}] x {layers} layers: "
              f"{med:8.3f} ms  {res[name]['tflops']:6.1f} TFLOP/s", flush=True)
    tot = sum(v["ms"] for v in res.values())
    print(f"torch {a.preset} T={t} all four GEMMs, every layer: {tot:.3f} ms")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"preset": a.preset, "tokens": t, "gemms": res, "total_ms": tot,
                       "device": torch.cuda.get_device_name()}, f)


if __name__ == "__main__":
    main()
