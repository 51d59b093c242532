# The multi-token weight rings' copy cursor against their sums, in Python: for one warp of
# the 132 x 16 grid, the segments the copies issue (unit, chunk, vector
# offset, in order) must be the segments the sums read, in every phase of
# every shape and T the H200 runs (the index arithmetic mirrors
# `MtRing` and `mt_units` in kernels/cuda/decode/multi.cuh). python3 cursor_sim.py
import itertools
SM=57088; W=16; GRID=132
def lv(K): return (K//8+31)//32
def batch(K,NR): return min(lv(K), 8//NR)
def stride(k): return (k+31)//32*32
def unit_at(units,k,warp,block):
    nwt=GRID*W; tail = k >= units//nwt
    return k*nwt + (warp*GRID+block if tail else block*W+warp)
def cta_has_unit(units,k,block):
    nwt=GRID*W; tail = k >= units//nwt
    return k*nwt + (block if tail else block*W) < units
def ring_geom(K,NR,front,most=4,big=1):
    per=(SM-front)//W if front<SM else 0
    UB=batch(K,NR)
    BIG= big and per//(NR*UB*128)>=3
    U= UB if BIG else max(1,UB//2)
    seg=NR*U*128; S=min(per//seg, most)
    return U,S
def unchunked(K,NR,T,units,unit_of):
    U,S=ring_geom(K,NR,T*stride(K))
    if S<3: return None
    CV=K//8; NB=(lv(K)+U-1)//U
    prod=[]; pk=0; pb=0; pu=unit_of(0)
    def issue():
        nonlocal pk,pb,pu
        if pu<units:
            prod.append((pu,pb*32*U))
            pb+=1
            if pb==NB: pb=0; pk+=1; pu=unit_of(pk)
        else: prod.append(None)
    for s in range(S-1): issue()
    cons=[]; k=0
    while unit_of(k)<units:
        u=unit_of(k)
        for b in range(NB):
            # wait: segment len(cons) must be issued
            assert len(prod)>len(cons)
            issue()
            cons.append((u,b*32*U))
        k+=1
    assert prod[:len(cons)]==cons, "mismatch"
    assert all(x is None for x in prod[len(cons):])
    return len(cons)
def chunked(K,NR,T,units,warp,block):
    G = 4 if T*NR<=4 else 2
    U=max(1,batch(K,NR)//2); S=3; SEG=NR*U*128; RING=W*S*SEG
    CHR=(SM-RING)//T//256*256 if RING<SM else 0
    if CHR<1024: return None
    CH=CHR; NCH=(K+CH-1)//CH; NBC=(CH//256+U-1)//U
    prod=[]; pk0=pc=pg=pb=0; pu=unit_at(units,0,warp,block)
    def issue():
        nonlocal pk0,pc,pg,pb,pu
        if pu<units:
            c0=pc*CH; cv=min(CH,K-c0)//8
            prod.append((pu,c0,pb*32*U,cv))
        else: prod.append(None)
        pb+=1
        if pb==NBC:
            pb=0; pg+=1
            if pg==G:
                pg=0; pc+=1
                if pc==NCH: pc=0; pk0+=G
            pu=unit_at(units,pk0+pg,warp,block)
    for s in range(S-1): issue()
    cons=[]; k0=0
    while cta_has_unit(units,k0,block):
        for c in range(NCH):
            c0=c*CH; C=min(CH,K-c0)
            for g in range(G):
                u=unit_at(units,k0+g,warp,block)
                for b in range(NBC):
                    issue()
                    cons.append((u,c0,b*32*U,C//8) if u<units else None)
        k0+=G
    assert prod[:len(cons)]==cons
    # every vector of every unit of this warp covered exactly once
    return len(cons)
shapes={'0.5b':(896,4864,896,128,151936),'7b':(3584,18944,3584,512,152064),'14b':(5120,13824,5120,1024,152064),'32b':(5120,27648,5120,1024,152064),'72b':(8192,29568,8192,1024,152064)}
n=0
for name,(H,I,Q,KV,V) in shapes.items():
    for T in range(2,9):
        if T*stride(H)>SM: continue
        wide = 2 if H>1024 and T>=4 else 1
        for warp,block in [(0,0),(5,7),(15,131),(3,64)]:
            phases=[('qkv',H,2,Q//2+KV), ('gu',H,2*wide,I//wide), ('o',Q,wide,H//wide)]
            for ph,K,NR,units in phases:
                n+= unchunked(K,NR,T,units,lambda k: unit_at(units,k,warp,block)) is not None
            # lm head
            units=V//wide; nwt=GRID*W
            n+= unchunked(H,wide,T,units,lambda k: block*W+warp+k*nwt) is not None
            # down
            K=I; units=H//wide
            if T*stride(K)<=SM: n+= unchunked(K,wide,T,units,lambda k: unit_at(units,k,warp,block)) is not None
            else: n+= chunked(K,wide,T,units,warp,block) is not None
print("ok, ring phases checked:", n)
