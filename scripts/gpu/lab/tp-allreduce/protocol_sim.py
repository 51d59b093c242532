#!/usr/bin/env python3
"""The tensor-parallel exchange protocol of kernels/cuda/decode/tp.cuh,
replayed under random interleavings (no GPU; sequentially consistent
memory, so it checks the protocol's logic, not its fences).

R ranks of C CTAs run S steps of L layers. Per exchange (o_proj and down of
each layer): every CTA writes its rows of the rank's partial (buffer by the
epoch's parity), grid barrier, CTA 0 publishes the epoch into every rank's
flag slot for it, every CTA waits for every rank's flag, reads its slice of
every rank's partial, grid barrier. After the LM head: CTA 0 pushes its pick
into every rank's slot (by parity), publishes, waits, reads the picks. A
step is one launch: a rank's next step starts when all its CTAs ended.

Checked: every read sees the value written for its own epoch (a buffer
reused too early would show the next epoch's or the last one's), every run
ends (no deadlock), and with one rank stopped at its first exchange, every
other rank ends blocked in a flag wait (the kernel's bounded wait turns
that into kErrTpTimeout), not anywhere else.

Run: python3 protocol_sim.py [--seeds N]
"""

import argparse
import random


class Sim:
    def __init__(self, ranks, ctas, layers, steps, rng, stop_rank=None, lead=None, buffers=2):
        self.R, self.C, self.L, self.S = ranks, ctas, layers, steps
        self.buffers = buffers  # 1: the mutant with one buffer (must fail)
        self.rng = rng
        self.stop_rank = stop_rank
        self.lead = lead  # a rank the scheduler favours (runs ahead when it can)
        per = 2 * layers + 1
        self.per = per
        # Region of rank r: partial[par][row] = (writer rank, epoch),
        # flags[k], picks[par][k] = (k, epoch).
        self.partial = [[[None] * ctas for _ in range(2)] for _ in range(ranks)]
        self.flags = [[0] * ranks for _ in range(ranks)]
        self.picks = [[[None] * ranks for _ in range(2)] for _ in range(ranks)]
        self.arrived = [0] * ranks  # grid barrier counters (monotonic)
        self.progs = {}
        for r in range(ranks):
            for c in range(ctas):
                self.progs[(r, c)] = self.program(r, c)
        self.state = {k: None for k in self.progs}  # pending blocking condition
        self.done = set()
        self.step_done = [[0] * ctas for _ in range(ranks)]

    def program(self, r, c):
        """A generator of actions; yields a predicate when it must wait."""
        bar = 0
        for s in range(self.S):
            # A launch starts when every CTA of the rank ended the last one.
            yield lambda s=s: all(d >= s for d in self.step_done[r])
            base = s * self.per
            for k in range(2 * self.L):
                e = base + k + 1
                par = e % self.buffers
                if self.stop_rank == r:
                    # Returns at its first exchange: no publish, no error.
                    return
                # Produce: this CTA writes "its" rows; with C rows per rank
                # and CTA c writing row (c + k) % C, the reader of a row is
                # usually another CTA.
                row = (c + k) % self.C
                self.partial[r][par][row] = (r, e)
                yield None
                bar += 1
                self.arrived[r] += 1
                yield lambda t=bar * self.C: self.arrived[r] >= t
                if c == 0:
                    for q in range(self.R):
                        self.flags[q][r] = e
                        yield None
                yield lambda e=e: all(f >= e for f in self.flags[r])
                for q in range(self.R):
                    got = self.partial[q][par][c]
                    assert got == (q, e), f"rank {r} CTA {c} epoch {e}: read {got} from rank {q}"
                    yield None
                bar += 1
                self.arrived[r] += 1
                yield lambda t=bar * self.C: self.arrived[r] >= t
            # LM head, barrier, then CTA 0 folds.
            bar += 1
            self.arrived[r] += 1
            yield lambda t=bar * self.C: self.arrived[r] >= t
            if c == 0:
                e = base + 2 * self.L + 1
                par = e % self.buffers
                for q in range(self.R):
                    self.picks[q][par][r] = (r, e)
                    yield None
                for q in range(self.R):
                    self.flags[q][r] = e
                    yield None
                yield lambda e=e: all(f >= e for f in self.flags[r])
                for q in range(self.R):
                    got = self.picks[r][par][q]
                    assert got == (q, e), f"rank {r} pick epoch {e}: read {got} from rank {q}"
                    yield None
            self.step_done[r][c] = s + 1

    def runnable(self, key):
        w = self.state[key]
        return w is None or w()

    def run(self):
        while True:
            live = [k for k in self.progs if k not in self.done]
            if not live:
                return "done", []
            ready = [k for k in live if self.runnable(k)]
            if not ready:
                return "blocked", live
            if self.lead is not None and any(k[0] == self.lead for k in ready) and self.rng.random() < 0.9:
                ready = [k for k in ready if k[0] == self.lead]
            k = self.rng.choice(ready)
            try:
                self.state[k] = next(self.progs[k])
            except StopIteration:
                self.done.add(k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=300)
    a = ap.parse_args()
    runs = 0
    for ranks in (2, 4, 8):
        for ctas in (2, 3):
            for layers in (1, 2):
                for seed in range(a.seeds):
                    rng = random.Random(seed * 7919 + ranks * 31 + ctas * 7 + layers)
                    lead = rng.randrange(ranks) if seed % 2 else None
                    sim = Sim(ranks, ctas, layers, 3, rng, lead=lead)
                    verdict, stuck = sim.run()
                    assert verdict == "done", f"R={ranks} C={ctas} L={layers} seed {seed}: deadlock {stuck}"
                    runs += 1
                    # One rank stopped at its first exchange: the others end
                    # blocked in a flag wait of the first exchange.
                    stop = rng.randrange(ranks)
                    sim = Sim(ranks, ctas, layers, 3, random.Random(seed), stop_rank=stop)
                    verdict, stuck = sim.run()
                    assert verdict == "blocked", f"stop {stop}: {verdict}"
                    assert all(k[0] != stop for k in stuck), stuck
                    # Every live CTA waits on flags (its barrier was passed:
                    # all CTAs of its rank arrived), none on a barrier.
                    for k in stuck:
                        r = k[0]
                        assert sim.arrived[r] == sim.C, f"stop {stop}: rank {r} stuck before the first barrier"
                    runs += 1
    # The check bites: with one buffer instead of two, some interleaving
    # reads a partial of the next epoch.
    caught = 0
    for seed in range(a.seeds):
        rng = random.Random(seed)
        sim = Sim(2, 2, 2, 3, rng, lead=seed % 2, buffers=1)
        try:
            sim.run()
        except AssertionError:
            caught += 1
    assert caught > 0, "one buffer was never caught"
    print(f"protocol_sim: {runs} runs, every read saw its own epoch, no deadlock, stopped ranks "
          f"block peers in the flag wait; one buffer instead of two caught in {caught} of {a.seeds} runs")


if __name__ == "__main__":
    main()
