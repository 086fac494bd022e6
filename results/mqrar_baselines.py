# Accuracy of simple answer rules on MQRAR-N streams (docs/tasks.md format; results/mqrar.md, "Reference
# points"). A Python re-statement of the generator with its own random numbers: same distribution, not the
# same streams as the engine. Usage: python3 results/mqrar_baselines.py
import random
def gen(rng, L=128, nk=8, nv=16, qp=0.25, N=1):
    hist=[[] for _ in range(nk)]; s=0; ready=[]; qs=[]
    while s < L:
        if ready and rng.random() < qp:
            k=rng.choice(ready); h=hist[k]
            if s+1 < L-1 or s+2 <= L-1:  # answer position s+2 must be < L (target of token s+1 within model_len)
                if s+2 < L: qs.append((list(h), h[-N]))
            s+=3
        else:
            k=rng.randrange(nk); v=rng.randrange(nv); hist[k].append(v)
            if len(hist[k])==N: ready.append(k)
            s+=2
    return qs
# (length, keys, values, streams): the small CPU config and the paper-scale config (configs/repro_mqrar*.json).
for L, nk, nv, streams in ((128, 8, 16, 4000), (768, 32, 32, 1000)):
    print(f"length {L}, {nk} keys, {nv} values, {streams} streams per N")
    rng=random.Random(0)
    for N in (1,2,3,4):
        tot=0; uni=0; rec=0; first=0; ex=0
        for _ in range(streams):
            for h,a in gen(rng,L=L,nk=nk,nv=nv,N=N):
                tot+=1; uni+=h.count(a)/len(h); rec+= (h[-1]==a); first+=(h[0]==a); ex += len(h)==N
        print(N, tot/streams, 'uniform-over-key %.1f'%(100*uni/tot), 'most-recent %.1f'%(100*rec/tot), 'first %.1f'%(100*first/tot), 'exactly-N %.1f'%(100*ex/tot))
