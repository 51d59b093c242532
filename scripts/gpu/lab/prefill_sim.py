#!/usr/bin/env python3
# Lane-level simulation of the prefill kernel's tensor-core data flow, checked
# exact against numpy (integer-valued data), no GPU: (1) prefill_gemm.cuh
# gemm_tile: cp.async loader, padded smem stages, ldmatrix.x4, mma m16n8k16,
# epilogue mapping, for BM 64/128, NB 1/2, ragged T / N (the mma.sync path:
# pre-Hopper GPUs and FLAG_PF_MMA_SYNC); (2) prefill_wgmma.cuh wg_phase: the
# stream-K partition and its owner / partial bookkeeping. (The prefill
# attention reads K / V through ldmatrix from shared memory; it is checked on
# the GPU against the CPU reference, not here.) Needs numpy. Keep it in step
# with the kernel:
# python3 scripts/gpu/lab/prefill_sim.py
# Simulates prefill_gemm.cuh's gemm_tile data flow (loader -> smem ->
# ldmatrix -> mma -> epilogue) lane by lane, against X . W^T.
import numpy as np
BN, BK, LD, STAGES, WARPS = 128, 32, 40, 4, 16

def run(BM, NB, K, t_end, m0, n0, n_end, seed=0):
    rng = np.random.default_rng(seed)
    T = max(t_end, m0 + BM) + 3
    X = rng.integers(-3, 4, size=(T, K)).astype(np.float64)
    W = [rng.integers(-3, 4, size=(max(n_end, n0 + BN) + 3, K)).astype(np.float64) for _ in range(NB)]
    WM = BM // 32; WN = WARPS // WM; WNC = BN // WN; WNT = WNC // NB; JT = WNC // 8; JTB = JT // NB
    KT = K // BK; STAGE = (BM + BN) * LD
    smem = np.full(STAGES * STAGE, np.nan)
    def load_stage(kt, s):
        so = s * STAGE
        for tid in range(512):
            lrow, lpiece = tid >> 2, tid & 3
            a_loader = lrow < BM
            a_ok = a_loader and m0 + lrow < t_end
            arow = m0 + (lrow if a_ok else 0)
            if a_loader:
                dst = so + lrow * LD + lpiece * 8
                src = X[arow, kt * BK + lpiece * 8: kt * BK + lpiece * 8 + 8]
                smem[dst:dst + 8] = src if a_ok else 0
            bgrp, bin_ = lrow // WNC, lrow % WNC
            bt = bin_ // WNT
            bn = n0 + bgrp * WNT + bin_ % WNT
            b_ok = bn < n_end
            w = W[0] if NB == 1 else W[bt]
            row = bn if b_ok else n0
            dst = so + (BM + lrow) * LD + lpiece * 8
            src = w[row, kt * BK + lpiece * 8: kt * BK + lpiece * 8 + 8]
            smem[dst:dst + 8] = src if b_ok else 0
    def ldmatrix_x4(addr_of_lane):
        # returns regs[lane][i] = (lo, hi)
        regs = [[None] * 4 for _ in range(32)]
        for i in range(4):
            rows = [smem[addr_of_lane[8 * i + r]: addr_of_lane[8 * i + r] + 8] for r in range(8)]
            for l in range(32):
                r, c = l // 4, l % 4
                regs[l][i] = (rows[r][2 * c], rows[r][2 * c + 1])
        return regs
    def mma(acc, a, b0, b1):
        # a[lane][0..3], b0[lane], b1[lane] pairs; acc[lane][4]
        A = np.zeros((16, 16)); B = np.zeros((16, 8))
        for l in range(32):
            g, c = l >> 2, l & 3
            A[g, 2*c:2*c+2] = a[l][0]; A[g+8, 2*c:2*c+2] = a[l][1]
            A[g, 2*c+8:2*c+10] = a[l][2]; A[g+8, 2*c+8:2*c+10] = a[l][3]
            B[2*c:2*c+2, g] = b0[l]; B[2*c+8:2*c+10, g] = b1[l]
        assert not np.isnan(A).any() and not np.isnan(B).any()
        C = A @ B
        for l in range(32):
            g, c = l >> 2, l & 3
            acc[l][0] += C[g, 2*c]; acc[l][1] += C[g, 2*c+1]
            acc[l][2] += C[g+8, 2*c]; acc[l][3] += C[g+8, 2*c+1]
    acc = np.zeros((WARPS, 2, JT, 32, 4))
    pending = []
    for s in range(STAGES - 1):
        if s < KT: load_stage(s, s)
    for kt in range(KT):
        nk = kt + STAGES - 1
        # compute reads stage kt%STAGES; the refill targets (kt-1)%STAGES
        assert nk % STAGES != kt % STAGES
        if nk < KT: load_stage(nk, nk % STAGES)
        so = (kt % STAGES) * STAGE
        for warp in range(WARPS):
            wm, wn = warp // WN, warp % WN
            a_frag = [((wm * 32 + (l & 15)) * LD + (l >> 4) * 8) for l in range(32)]
            b_frag = [((BM + wn * WNC + (l >> 4) * 8 + (l & 7)) * LD + ((l >> 3) & 1) * 8) for l in range(32)]
            for kk in range(0, BK, 16):
                af = [ldmatrix_x4([so + a_frag[l] + i * 16 * LD + kk for l in range(32)]) for i in range(2)]
                for jp in range(JT // 2):
                    bf = ldmatrix_x4([so + b_frag[l] + jp * 16 * LD + kk for l in range(32)])
                    for i in range(2):
                        mma(acc[warp, i, 2*jp], af[i], [bf[l][0] for l in range(32)], [bf[l][1] for l in range(32)])
                        mma(acc[warp, i, 2*jp+1], af[i], [bf[l][2] for l in range(32)], [bf[l][3] for l in range(32)])
    out = {}
    for warp in range(WARPS):
        wm, wn = warp // WN, warp % WN
        for l in range(32):
            g, c = l >> 2, l & 3
            for j in range(JTB):
                n = n0 + wn * WNT + j * 8 + 2 * c
                if n >= n_end: continue
                for i in range(2):
                    for h in range(2):
                        t = m0 + wm * 32 + i * 16 + g + 8 * h
                        if t >= t_end: continue
                        for b in range(NB):
                            for e in range(2):
                                key = (t, b, n + e)
                                assert key not in out, key
                                out[key] = acc[warp, i, j + b * JTB, l, 2 * h + e]
    # every valid (t, b, n) in the tile exactly once, with the right value
    cnt = 0
    for t in range(m0, min(m0 + BM, t_end)):
        for b in range(NB):
            for n in range(n0, min(n0 + BN // NB, n_end)):
                want = X[t] @ W[b][n]
                assert (t, b, n) in out, (t, b, n)
                assert out[(t, b, n)] == want, ((t, b, n), out[(t, b, n)], want)
                cnt += 1
    assert cnt == len(out), (cnt, len(out))
    return cnt

for BM in (64, 128):
    for NB in (1, 2):
        for (K, t_end, m0, n0, n_end) in [(32, 5, 0, 0, 200), (96, 100, 64, 128, 200), (160, 400, 128, 0, 1000), (64, 17, 0, 64, 90)]:
            if m0 % BM: continue
            c = run(BM, NB, K, t_end, m0, n0, n_end)
            print(f"BM={BM} NB={NB} K={K} t_end={t_end} m0={m0} n0={n0} n_end={n_end}: {c} outputs exact")


# ---- prefill_wgmma.cuh wg_phase: the stream-K partition (no numpy). Every
# (tile, K step) computed exactly once; the owner of each split tile (the range
# holding its K step 0) collects exactly the partials of the later ranges of
# that tile, in CTA order; no CTA publishes two partials in one phase.
def stream_k(tiles, KT, G, min_split=16):
    ms = max(1, KT // min_split)
    gsk = min(G, tiles * ms)
    iters = tiles * KT
    rs = lambda b: (iters * b) // gsk
    cover, contrib, owners = {}, {}, {}
    for c in range(gsk):
        s, e = rs(c), rs(c + 1)
        it = s
        while it < e:
            r, kb = divmod(it, KT)
            ke = min(KT, kb + (e - it))
            for k in range(kb, ke):
                cover[(r, k)] = cover.get((r, k), 0) + 1
            if kb != 0:
                assert c not in contrib, ("two partials", tiles, KT, G, c)
                contrib[c] = (r, kb, ke)
            else:
                got = []
                if ke < KT:
                    for b in range(c + 1, gsk):
                        bs = rs(b)
                        if bs >= (r + 1) * KT: break
                        if rs(b + 1) == bs: continue
                        got.append(b)
                owners[r] = (got, ke)
            it += ke - kb
    for r in range(tiles):
        assert all(cover.get((r, k)) == 1 for k in range(KT)), (tiles, KT, G, r)
        got, ke = owners[r]
        assert got == sorted(b for b, x in contrib.items() if x[0] == r), (tiles, KT, G, r)
        ks = sorted(k for b in got for k in range(contrib[b][1], contrib[b][2]))
        assert ks == list(range(ke, KT)), (tiles, KT, G, r)

n = 0
for tiles in range(1, 132):
    for KT in (14, 56, 76, 296, 462):
        for G in (132, 66, 7):
            if tiles < G:
                stream_k(tiles, KT, G); n += 1
print(f"stream-K partition: {n} (tiles, K steps, grid) cases exact")
