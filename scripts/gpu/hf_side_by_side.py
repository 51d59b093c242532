#!/usr/bin/env python3
"""Hugging Face transformers eager bf16 on the Qwen2.5 shapes, in the same GPU
run as our bench, and the speed ratios.

  python3 scripts/gpu/hf_side_by_side.py [--budget S] [--json-out F] BENCH.jsonl ...
  python3 scripts/gpu/hf_side_by_side.py --selftest      # no GPU, no torch

Models: `Qwen2ForCausalLM` built from a `Qwen2Config` with the shapes of
crates/model's presets (random weights, built on the GPU in bf16, no network,
attn_implementation="eager").
Decode: `generate` of 128 greedy tokens (min_new_tokens = max_new_tokens =
128) after an 8-token prompt, one warm-up run, median of the timed runs,
tok/s = 128 / wall time (cuda-synchronized).
Prefill: time to first token = forward of a 512- and a
2,048-token prompt with the KV cache on, LM head on the last position only,
cuda-synchronized, median of 5 after one warm-up; 0.5B and 7B.
Reads our `qwen-mk bench --json` lines (decode: "tok_per_s"; prefill:
"ttft_ms") and prints per shape: ours, HF, ours / HF, the llama.cpp figure
(docs/performance.md, "Peers") and ours / llama.cpp. The same as JSON
with --json-out. Within --budget seconds (default 80): 14B decode is the
first thing skipped (it says so).
"""
import argparse
import json
import statistics
import sys
import time

# Qwen2.5 shapes (crates/model/src/config.rs PRESET_TABLE).
SHAPES = {
    "0.5b": dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936, tied=True),
    "7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064, tied=False),
    "14b": dict(hidden=5120, inter=13824, layers=48, heads=40, kv_heads=8, head_dim=128, vocab=152064, tied=False),
}
# Measured on an H200 before this project (docs/performance.md, "Peers").
LLAMA_DECODE = {"0.5b": 771.0, "7b": 198.0, "14b": 112.0}
LLAMA_TTFT_MS = {("0.5b", 512): 6.2, ("0.5b", 2048): 23.0, ("7b", 512): 19.7, ("7b", 2048): 70.1}
HF_EARLIER_DECODE = {"0.5b": 44.5, "7b": 35.7, "14b": 22.7}
HF_EARLIER_TTFT_MS = {("0.5b", 512): 30.5, ("0.5b", 2048): 31.5, ("7b", 512): 36.3, ("7b", 2048): 56.4}
NEW_TOKENS = 128
PROMPT_LENS = (512, 2048)


# ---------------------------------------------------------------- no torch below


def ratio(a, b):
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def read_ours(paths):
    """Our bench JSON lines -> ({preset: decode tok/s}, {(preset, n): ttft ms}).
    Decode: short-context rows only (first timed position below 1,000), cudarc
    preferred, default kernel flags; the best such row per preset."""
    best, ttft = {}, {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            print(f"note: cannot read {path}: {e}", file=sys.stderr)
            continue
        for line in lines:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            preset = v.get("preset")
            if "ttft_ms" in v and "prefill_tokens" in v:
                k = (preset, int(v["prefill_tokens"]))
                if k not in ttft or v["ttft_ms"] < ttft[k]:
                    ttft[k] = float(v["ttft_ms"])
            elif "tok_per_s" in v:
                if v.get("first_timed_pos", 0) >= 1000 or v.get("kernel_flags", 0) != 0:
                    continue
                # cudarc first, then the fastest row.
                key = (0 if v.get("backend", "cudarc") == "cudarc" else 1, -float(v["tok_per_s"]))
                if preset not in best or key < best[preset]:
                    best[preset] = key
    decode = {p: -k[1] for p, k in best.items()}
    return decode, ttft


def build_table(ours_decode, ours_ttft, hf_decode, hf_ttft, skipped=()):
    """Rows of the side-by-side table (dicts), decode then prefill."""
    rows = []
    for p in SHAPES:
        o, h, ll = ours_decode.get(p), hf_decode.get(p), LLAMA_DECODE.get(p)
        rows.append(dict(kind="decode", preset=p, unit="tok/s", ours=o, hf=h, llama_cpp=ll,
                         hf_earlier=HF_EARLIER_DECODE.get(p),
                         ours_over_hf=ratio(o, h), ours_over_llama_cpp=ratio(o, ll),
                         note="HF skipped (budget)" if ("decode", p) in skipped else ""))
    for (p, n), ll in LLAMA_TTFT_MS.items():
        o, h = ours_ttft.get((p, n)), hf_ttft.get((p, n))
        # Time: smaller is better, so the speed ratio is theirs / ours.
        rows.append(dict(kind="ttft", preset=p, tokens=n, unit="ms", ours=o, hf=h, llama_cpp=ll,
                         hf_earlier=HF_EARLIER_TTFT_MS.get((p, n)),
                         ours_over_hf=ratio(h, o), ours_over_llama_cpp=ratio(ll, o),
                         note="HF skipped (budget)" if ("ttft", p, n) in skipped else ""))
    return rows


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def render(rows):
    out = ["shape            unit        ours          HF   ours/HF   llama.cpp   ours/llama   (HF earlier)"]
    for r in rows:
        name = r["preset"] + (" decode" if r["kind"] == "decode" else " ttft %d" % r["tokens"])
        out.append("  %-14s %-5s %10s  %10s  %8s  %10s  %11s   %s %s" % (
            name, r["unit"], fmt(r["ours"], ".2f"), fmt(r["hf"], ".2f"),
            fmt(r["ours_over_hf"], ".2f") + ("x" if r["ours_over_hf"] else ""),
            fmt(r["llama_cpp"], ".1f"),
            fmt(r["ours_over_llama_cpp"], ".2f") + ("x" if r["ours_over_llama_cpp"] else ""),
            fmt(r["hf_earlier"], ".1f"), r["note"]))
    out.append("  (speed ratios: decode tok/s ours / theirs; ttft theirs / ours; > 1 = ours faster)")
    return "\n".join(out)


def selftest():
    import os
    import tempfile
    lines = [
        {"preset": "0.5b", "backend": "cudarc", "tok_per_s": 1500.0, "first_timed_pos": 16, "kernel_flags": 0},
        {"preset": "0.5b", "backend": "cust", "tok_per_s": 1600.0, "first_timed_pos": 16, "kernel_flags": 0},
        {"preset": "7b", "backend": "cudarc", "tok_per_s": 250.0, "first_timed_pos": 16},
        {"preset": "7b", "backend": "cudarc", "tok_per_s": 200.0, "first_timed_pos": 8192},
        {"preset": "7b", "backend": "cudarc", "tok_per_s": 999.0, "first_timed_pos": 16, "kernel_flags": 32},
        {"preset": "0.5b", "backend": "cudarc", "ttft_ms": 9.2, "prefill_tokens": 512},
        {"preset": "0.5b", "backend": "cudarc", "ttft_ms": 10.0, "prefill_tokens": 512},
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for v in lines:
            f.write(json.dumps(v) + "\n")
        f.write("not json\n")
        path = f.name
    try:
        d, t = read_ours([path, path + ".missing"])
    finally:
        os.unlink(path)
    assert d == {"0.5b": 1500.0, "7b": 250.0}, d  # cudarc preferred; long/flagged rows ignored
    assert t == {("0.5b", 512): 9.2}, t
    rows = build_table(d, t, {"0.5b": 50.0, "7b": 40.0}, {("0.5b", 512): 30.0}, skipped={("decode", "14b")})
    by = {(r["kind"], r["preset"], r.get("tokens")): r for r in rows}
    assert abs(by[("decode", "0.5b", None)]["ours_over_hf"] - 30.0) < 1e-12
    assert abs(by[("decode", "7b", None)]["ours_over_llama_cpp"] - 250.0 / 198.0) < 1e-12
    assert by[("decode", "14b", None)]["ours_over_hf"] is None
    assert by[("decode", "14b", None)]["note"] == "HF skipped (budget)"
    r = by[("ttft", "0.5b", 512)]
    assert abs(r["ours_over_hf"] - 30.0 / 9.2) < 1e-12 and abs(r["ours_over_llama_cpp"] - 6.2 / 9.2) < 1e-12
    assert by[("ttft", "7b", 2048)]["ours"] is None
    text = render(rows)
    assert "30.00x" in text and "0.5b ttft 512" in text and "HF skipped" in text, text
    json.dumps(rows)
    print(text)
    print("selftest: PASS")


# ---------------------------------------------------------------- GPU part


def hf_config(preset):
    from transformers import Qwen2Config
    s = SHAPES[preset]
    return Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=s["tied"], use_sliding_window=False,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
        torch_dtype="bfloat16")


def build_model(preset):
    import torch
    from transformers import Qwen2ForCausalLM
    cfg = hf_config(preset)
    cfg._attn_implementation = "eager"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            try:
                m = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager", torch_dtype=torch.bfloat16)
            except TypeError:
                m = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    m = m.to(device="cuda", dtype=torch.bfloat16).eval()
    torch.cuda.synchronize()
    return m


def time_decode(model, runs):
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 151000, (1, 8), device="cuda", generator=g)
    # repetition_penalty=1.0: plain greedy, as qwen-mk's; do_sample=False alone
    # keeps a penalty from the model's generation_config.json.
    kw = dict(do_sample=False, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
              pad_token_id=151643, attention_mask=torch.ones_like(ids), repetition_penalty=1.0)
    with torch.inference_mode():
        model.generate(ids, **dict(kw, min_new_tokens=8, max_new_tokens=8))  # warm-up
        ts = []
        for _ in range(runs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
            assert out.shape[1] == ids.shape[1] + NEW_TOKENS, out.shape
    return NEW_TOKENS / statistics.median(ts)


def time_ttft(model, n, reps=5):
    import torch
    g = torch.Generator(device="cuda").manual_seed(n)
    ids = torch.randint(0, 151000, (1, n), device="cuda", generator=g)

    def once():
        out = model.model(input_ids=ids, use_cache=True)
        return model.lm_head(out.last_hidden_state[:, -1:, :])

    with torch.inference_mode():
        once()
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            once()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="*", help="our bench JSON-lines files")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds for the HF timings")
    ap.add_argument("--runs", type=int, default=3, help="timed generate runs per shape")
    ap.add_argument("--json-out", help="write the table as JSON here")
    ap.add_argument("--selftest", action="store_true", help="check the table code; no GPU")
    ap.add_argument("--ttft-only", action="store_true",
                    help="prefill (time to first token) only: 0.5B and 7B, no decode")
    a = ap.parse_args()
    if a.selftest:
        selftest()
        return 0
    t0 = time.perf_counter()
    left = lambda: a.budget - (time.perf_counter() - t0)
    import torch
    import transformers
    print(f"HF transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    hf_decode, hf_ttft, skipped, errors = {}, {}, set(), []
    # Rough seconds each shape needs (build + warm-up + runs + prefill).
    need = {"0.5b": 18, "7b": 25, "14b": 35}
    if a.ttft_only:
        need = {"0.5b": 8, "7b": 15}
    for p in need:
        if left() < need[p]:
            skipped.add(("decode", p))
            for n in PROMPT_LENS:
                if (p, n) in LLAMA_TTFT_MS:
                    skipped.add(("ttft", p, n))
            print(f"HF {p}: skipped ({left():.0f} s of the budget left, needs ~{need[p]} s)", flush=True)
            continue
        try:
            t = time.perf_counter()
            m = build_model(p)
            print(f"HF {p}: built in {time.perf_counter() - t:.1f} s", flush=True)
            if not a.ttft_only:
                hf_decode[p] = time_decode(m, a.runs)
                print(f"HF {p}: decode {hf_decode[p]:.2f} tok/s", flush=True)
            for n in PROMPT_LENS:
                if (p, n) in LLAMA_TTFT_MS:
                    hf_ttft[(p, n)] = time_ttft(m, n)
                    print(f"HF {p}: ttft {n} tokens {hf_ttft[(p, n)]:.2f} ms", flush=True)
            del m
            torch.cuda.empty_cache()
        except Exception as e:  # keep going: a table with holes beats none
            errors.append(f"{p}: {type(e).__name__}: {e}")
            print(f"HF {p}: FAILED: {type(e).__name__}: {e}", flush=True)
    ours_decode, ours_ttft = read_ours(a.bench)
    rows = build_table(ours_decode, ours_ttft, hf_decode, hf_ttft, skipped)
    print(render(rows))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(dict(rows=rows, errors=errors, skipped=sorted(map(list, skipped)),
                           seconds=time.perf_counter() - t0), f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
