"""dev/cuda/decode_drift.py: how a 16-bit decode cache drifts, and what bounds it (numpy, no GPU).

A PaTH decode step moves every cached key across the new token's factor H_t = I - beta_t w_t w_t^T (the cache
holds keys transported to the current position). Kept in fp32, as the library's cache is today, that costs
twice a 16-bit cache's bytes; kept in 16 bits and re-rounded at every step, the rounding errors of thousands of
steps add up. The lazy form re-rounds only every S steps: the cache stays transported to the last flush point m,
the query is carried back across the pending factors instead (q^ = H_{m+1} ... H_i q_i, exact because every
H_t is symmetric), the pending tokens are attended directly, and every S steps their S factors are applied to
the whole cache at once. This script runs one head's recurrence in fp64 (the reference) beside the candidate
caches and prints the relative L2 error of the outputs over windows of steps:
  f32_step    fp32 cache, transported every step (today's device cache)
  bf16_step   bf16 cache, transported and re-rounded every step
  bf16_lazy   bf16 cache, lazy with flushes every S steps (pending keys and the query carried in fp32)
  f16_lazy    the same in fp16 (8x finer rounding than bf16; a transported key never grows, |H_t| <= 1 for
              beta in [0, 2], so fp16's range suffices for keys of unit scale)
  bf16_lazy_R bf16 lazy, the cache rebuilt exactly from the original keys every R steps (rounded once)
Inputs as the issue's accuracy bar: a prefill of P tokens, then N decode steps, q, k, v ~ N(0, 1) rounded to
bf16, w unit vectors, beta ~ U(0, 2) or 2.
    python3 dev/cuda/decode_drift.py [--K 64] [--prefill 1024] [--steps 16384] [--S 64] [--R 4096] [--beta2]
"""
import argparse

import numpy as np


def bf16(x):
    """Round float64 / float32 values to bfloat16 (round to nearest even), returned as float32."""
    a = np.asarray(x, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def attend(q, keys, vals, scale):
    s = (keys @ q) * scale
    s = s - s.max()
    p = np.exp(s)
    return (p @ vals) / p.sum()


def transport(c, w, b):
    """c <- H c for every row (c: [n, K]); H = I - b w w^T."""
    c -= b * np.outer(c @ w, w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16384)
    ap.add_argument("--S", type=int, default=64, help="lazy flush interval")
    ap.add_argument("--R", type=int, default=4096, help="rebuild interval of bf16_lazy_R")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--beta2", action="store_true", help="beta = 2 everywhere (else U(0, 2))")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    K, P, N, S = a.K, a.prefill, a.steps, a.S
    L = P + N
    q = bf16(rng.standard_normal((L, K))).astype(np.float64)
    k = bf16(rng.standard_normal((L, K))).astype(np.float64)
    v = bf16(rng.standard_normal((L, K))).astype(np.float64)
    w = rng.standard_normal((L, K))
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    beta = np.full(L, 2.0) if a.beta2 else rng.uniform(0.0, 2.0, L)
    scale = 1.0 / np.sqrt(K)

    # Caches after the prefill: keys moved to position P - 1 (computed in fp64, then rounded as each stores them).
    ref = np.zeros((L, K))
    for t in range(P):
        transport(ref[:t], w[t], beta[t])
        ref[t] = k[t]
    f32 = ref[:P].astype(np.float32).astype(np.float64)
    bst = bf16(ref[:P]).astype(np.float64)
    lazy = {"bf16_lazy": (bf16, bf16(ref[:P]).astype(np.float64)), "f16_lazy": (f16, f16(ref[:P]).astype(np.float64)),
            "bf16_lazy_R": (bf16, bf16(ref[:P]).astype(np.float64))}
    f32 = np.concatenate([f32, np.zeros((N, K))])
    bst = np.concatenate([bst, np.zeros((N, K))])
    lazy = {n: (r, np.concatenate([c, np.zeros((N, K))])) for n, (r, c) in lazy.items()}
    m = P - 1  # the lazy caches' flush point: rows <= m are transported to m
    names = ["f32_step", "bf16_step"] + list(lazy)
    err = {n: [] for n in names}
    ref_out = []
    for i in range(P, L):
        # Reference and the step-wise caches: move rows < i across H_i, add k_i.
        transport(ref[:i], w[i], beta[i])
        ref[i] = k[i]
        transport(f32[:i], w[i], beta[i])
        f32[:i] = f32[:i].astype(np.float32)
        f32[i] = k[i]
        transport(bst[:i], w[i], beta[i])
        bst[:i] = bf16(bst[:i])
        bst[i] = k[i]
        o_ref = attend(q[i], ref[:i + 1], v[:i + 1], scale)
        outs = {"f32_step": attend(q[i], f32[:i + 1], v[:i + 1], scale),
                "bf16_step": attend(q[i], bst[:i + 1], v[:i + 1], scale)}
        for n, (rnd, c) in lazy.items():
            # Pending tokens m+1..i: scores by carrying the query back (fp32), then the cache's with q^.
            u = q[i].astype(np.float32).astype(np.float64)
            pend = np.empty(i - m)
            for j in range(i, m, -1):
                pend[i - j] = u @ k[j]
                u = (u - beta[j] * (u @ w[j]) * w[j]).astype(np.float32).astype(np.float64)
            s = np.concatenate([(c[:m + 1] @ u), pend[::-1]]) * scale
            s -= s.max()
            p = np.exp(s)
            outs[n] = (p @ v[:i + 1]) / p.sum()
        for n in names:
            err[n].append((np.sum((outs[n] - o_ref) ** 2), np.sum(o_ref ** 2)))
        ref_out.append(o_ref)
        # Flush: the pending factors applied to the whole cache in fp32, the cache rounded once, pending keys in.
        if i - m == S or i == L - 1:
            for n, (rnd, c) in lazy.items():
                rebuild = n.endswith("_R") and (i - P + 1) % a.R == 0
                if rebuild:
                    c[:i + 1] = rnd(ref[:i + 1])
                    continue
                for j in range(m + 1, i + 1):
                    c[:j] = (c[:j] - beta[j] * np.outer(c[:j] @ w[j], w[j])).astype(np.float32)
                    c[j] = k[j]
                c[:i + 1] = rnd(c[:i + 1])
            m = i
    print(f"K {K}, prefill {P}, {N} decode steps, beta {'2' if a.beta2 else 'U(0, 2)'}, S {S}, R {a.R}")
    print("relative L2 error of the outputs against fp64, by window of steps:")
    print("steps".ljust(16) + "".join(n.rjust(13) for n in names))
    for w0 in range(0, N, a.window):
        cells = []
        for n in names:
            e = np.array(err[n][w0:w0 + a.window])
            cells.append(f"{np.sqrt(e[:, 0].sum() / e[:, 1].sum()):13.2e}")
        print(f"{w0:>6}..{min(N, w0 + a.window) - 1:<7} " + "".join(cells))
    tail = slice(N - 256, N)
    print("last 256 steps: " + " ".join(
        f"{n} {np.sqrt(np.array(err[n][tail])[:, 0].sum() / np.array(err[n][tail])[:, 1].sum()):.2e}" for n in names))


if __name__ == "__main__":
    main()
