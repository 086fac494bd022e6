"""dev/cuda/dg_sim.py: how the gate gradient's error depends on where its row and column sums of dS come from.

dg_u = scale * sum_{t >= u} (row sum of dS at t - column sum of dS at t): the pairs with both ends at or after u
cancel between the two sums, exactly only when both are taken from the same dS. This models the backward in fp64
(numpy, no GPU): softmax attention with the gate (PaTH's transport changes nothing here), delta from o and dO
rounded to bf16 as the kernels read them, and the scores perturbed by N(0, sigma) noise, either once (row and
column sums from one kernel) or independently for each (two kernels that round the scores differently). Prints
the relative L2 error of dg against the exact one, and the error the same noise gives o.
    python3 dev/cuda/dg_sim.py [--T 2048] [--K 128] [--seed 1]
"""
import argparse

import numpy as np


def bf16(x):
    """Round to bfloat16 (nearest even), returned as float64."""
    b = x.astype(np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32).astype(np.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    T, K = a.T, a.K
    sc = K ** -0.5
    q, k, v, do = (rng.standard_normal((T, K)) for _ in range(4))
    g = -np.log1p(np.exp(-(rng.standard_normal(T) + 3)))  # log sigmoid(x + 3), as bench/gpu_bench.py draws it
    G = np.cumsum(g)
    s = sc * (q @ k.T) + sc * (G[:, None] - G[None, :])
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(1, keepdims=True)
    lse = (np.log(np.exp(s - m).sum(1, keepdims=True)) + m)[:, 0]
    P = np.exp(s - lse[:, None])
    o = P @ v
    dP = do @ v.T
    dS = P * (dP - (o * do).sum(1)[:, None])

    def rev(x):
        return np.cumsum(x[::-1])[::-1]

    def rel(x, y):
        return np.linalg.norm(x - y) / np.linalg.norm(y)

    dg = rev(sc * dS.sum(1) - sc * dS.sum(0))
    delta = (bf16(o) * bf16(do)).sum(1)
    for sigma in (0.0, 1e-3, 3e-3, 1e-2):
        sa = s + sigma * rng.standard_normal((T, T))
        sb = s + sigma * rng.standard_normal((T, T))
        dsa = np.exp(sa - lse[:, None]) * (dP - delta[:, None])
        dsb = np.exp(sb - lse[:, None]) * (dP - delta[:, None])
        one = rev(sc * dsa.sum(1) - sc * dsa.sum(0))
        two = rev(sc * dsa.sum(1) - sc * dsb.sum(0))
        print(f"sigma {sigma:g}: o {rel(np.exp(sa - lse[:, None]) @ v, o):.2e}  dg, one kernel {rel(one, dg):.2e}  "
              f"dg, two kernels {rel(two, dg):.2e}")


if __name__ == "__main__":
    main()
