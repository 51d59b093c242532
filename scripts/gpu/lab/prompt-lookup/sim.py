#!/usr/bin/env python3
"""Prompt-lookup policies replayed on recorded greedy outputs.

Greedy output does not depend on how the positions are grouped, so a
drafting policy can be scored offline: replay each prompt's greedy ids,
let the policy draft and verify against them, and price every launch with
a measured cost table (one launch of T positions, in one-token steps). The
drafter and the rule mirror crates/engine/src/draft.rs and speculative.rs.

    # greedy outputs of the code-edit prompts on the CPU reference (~6 min):
    python3 sim.py generate MODEL_DIR benches/prompts/code-edit.jsonl greedy.jsonl
    # the policies, priced by the cost table (0.5B, H200) with a fixed
    # per-step host overhead of F one-token steps:
    python3 sim.py score greedy.jsonl [F]
"""
import json
import subprocess
import sys

DECAY = 0.95
# One launch of T positions in one-token steps: 0.5B on the H200
# (docs/performance.md, the multi-token cost table).
COST_05B = {1: 1.0, 2: 1.209, 3: 1.356, 4: 1.537, 5: 1.903, 6: 2.094, 7: 2.465, 8: 2.688}


class Lookup:
    """PromptLookup: longest n-gram first, most recent occurrence."""

    def __init__(self, nmin, nmax):
        self.nmin, self.nmax, self.h, self.idx = nmin, nmax, [], {}

    def extend(self, toks):
        for t in toks:
            n_hist = len(self.h)
            for n in range(self.nmin, min(self.nmax, n_hist) + 1):
                self.idx[tuple(self.h[n_hist - n:])] = n_hist
            self.h.append(t)

    def match(self):
        n_hist = len(self.h)
        for n in range(min(self.nmax, n_hist), self.nmin - 1, -1):
            j = self.idx.get(tuple(self.h[n_hist - n:]))
            if j is not None:
                return n, j
        return None

    def draft(self, k):
        m = self.match()
        if m is None:
            return []
        j, n_hist, out = m[1], len(self.h), []
        for i in range(k):
            out.append(self.h[j + i] if j + i < n_hist else out[j + i - n_hist])
        return out


def best_k(rate, max_draft, cost):
    best, bk, e, ak = 1.0, 0, 1.0, 1.0
    for k in range(1, max_draft + 1):
        ak *= rate
        e += ak
        if e / cost(k) > best:
            best, bk = e / cost(k), k
    return bk


def replay(rows, w, nmax=3, per_class=False, table=False, linear=0.25, always=False, max_draft=7):
    """Tokens per unit of cost over all rows (plain decoding: 1)."""
    total_t, total_tok = 0.0, 0
    cost = (lambda k: w[k + 1]) if table else (lambda k: 1 + k * linear)
    for r in rows:
        prompt, want = r["prompt_ids"], r["output_ids"]
        d = Lookup(1, nmax)
        d.extend(prompt)
        out = [want[0]]
        d.extend(out)
        stats, t = {}, 0.0
        while len(out) < len(want):
            m = d.match()
            cls = None if m is None else (m[0] if per_class else 0)
            acc, rej = stats.get(cls, (0.0, 0.0))
            if cls is None:
                k = 0
            elif always:
                k = max_draft
            else:
                k = best_k((acc + 0.8) / (acc + rej + 1.0), max_draft, cost)
            k = min(k, len(want) - len(out) - 1)
            guess = d.draft(k) if k > 0 else []
            i = len(out)
            agreed = 0
            while agreed < len(guess) and guess[agreed] == want[i + agreed]:
                agreed += 1
            new = guess[:agreed] + [want[i + agreed]]
            t += w[len(guess) + 1]
            if cls is not None:
                stats[cls] = (acc * DECAY + agreed, rej * DECAY + (agreed < len(guess)))
            out += new
            d.extend(new)
        assert out == want, r.get("name")
        total_t += t
        total_tok += len(want) - 1
    return total_tok / total_t


def generate(model, prompts, out_path):
    with open(out_path, "w") as out:
        for line in open(prompts):
            p = json.loads(line)
            r = subprocess.run(["qwen-mk", "generate", "--backend", "cpu", "-m", model, "-p",
                                p["messages"][-1]["content"], "--max-new-tokens", "256", "--json",
                                "--speculate", "off", "-q"], capture_output=True, text=True, check=True)
            g = json.loads(r.stdout)
            out.write(json.dumps({"name": p["name"], "prompt_ids": g["prompt_ids"],
                                  "output_ids": g["output_ids"]}) + "\n")
            print(p["name"], len(g["prompt_ids"]), len(g["output_ids"]), flush=True)


def score(path, f):
    rows = [json.loads(line) for line in open(path)]
    w = {t: (f + c) / (f + 1) for t, c in COST_05B.items()}
    print(f"host overhead {f} steps per launch; tokens per unit of cost (plain = 1):")
    print("n-grams  always  linear 0.25  cost table  table + class per match length")
    for nmax in (3, 4, 5, 6, 8):
        print(f"1..{nmax}     {replay(rows, w, nmax, always=True):.3f}   {replay(rows, w, nmax):.3f}"
              f"        {replay(rows, w, nmax, table=True):.3f}       "
              f"{replay(rows, w, nmax, per_class=True, table=True):.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["generate"]:
        generate(*sys.argv[2:5])
    elif sys.argv[1:2] == ["score"]:
        score(sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.15)
    else:
        sys.exit(__doc__)
