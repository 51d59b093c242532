"""The server's own timing against `qwen-mk generate`'s on the same request.

Starts `qwen-mk serve` (the Server of crates/cli/tests/serve_openai.py),
sends one greedy chat request of N new tokens (after one warm-up request),
reads the server's log line for it (time to first token, decode tok/s),
runs `qwen-mk generate` on the same messages with the same settings, and
prints both and their ratio. Exits non-zero when the two decode rates differ
by more than --tolerance (default 5 %).

usage: python serve_speed.py --qwen-mk BIN --model DIR --backend cudarc [--tokens 256]
"""

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../crates/cli/tests"))
from serve_openai import KEY, Server  # noqa: E402

import openai  # noqa: E402

PROMPT = "Write a Python function that merges two sorted lists, with a docstring and tests."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen-mk", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cudarc")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--tolerance", type=float, default=0.05)
    a = ap.parse_args()
    server = Server(a.qwen_mk, a.model, a.backend, 4096)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        kw = dict(model="qwen-test", messages=[{"role": "user", "content": PROMPT}], temperature=0)
        client.chat.completions.create(max_tokens=16, **kw)
        r = client.chat.completions.create(max_tokens=a.tokens, **kw)
    finally:
        server.stop()
    line = [l for l in server.log().splitlines() if r.id in l]
    m = re.search(r"completion (\d+) tokens.*time to first token ([\d.]+) ms, decode ([\d.]+) tok/s", line[-1])
    n, ttft, rate = int(m.group(1)), float(m.group(2)), float(m.group(3))
    out = subprocess.run(
        [a.qwen_mk, "generate", "--model", a.model, "--backend", a.backend, "--temperature", "0",
         "--max-new-tokens", str(a.tokens), "--context", "4096", "--json", "--quiet", "--prompt", PROMPT],
        capture_output=True, text=True, check=True,
    )
    g = json.loads(out.stdout)
    ratio = rate / g["decode_tok_per_s"]
    print(f"serve {a.backend}: {n} tokens, time to first token {ttft:.1f} ms, {rate:.1f} tok/s")
    print(f"generate {a.backend}: {len(g['output_ids'])} tokens, prefill {g['prefill_ms']:.1f} ms, "
          f"{g['decode_tok_per_s']:.1f} tok/s")
    print(f"serve / generate decode rate: {ratio:.3f}")
    same = r.choices[0].message.content == g["text"]
    print(f"same text: {same}")
    return 0 if same and abs(ratio - 1) <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
