"""dev/cuda/packed_chunks.py: several whole short sequences in one 64-row chunk, checked in fp64 numpy.

Question: can sequences shorter than a chunk share one, so that the per-chunk kernels do one chunk's work for
several of them (the engine's A5 steps run 10-token sequences, each a whole chunk's work today)?
Claim: yes, with the chunk's matrices masked by M (M[r, s] = 1 where rows r and s belong to one sequence):
    A = strict_lower(diag(b) W W^T) * M        block-diagonal, so E = (I + A)^-1 is block-diagonal too
    U = E diag(b) (strict_lower(W K^T) * M)
    A_loc = (tril_incl(Q K^T) - tril_incl(Q W^T) U) * M,  scores outside M masked like the causal ones
and every sequence's logits are then its own: no transport or score crosses a boundary. This script builds
random packings (lengths that sum to at most 64, unit w, beta in [0, 2] and at 2), compares A_loc and the
attention outputs with each sequence computed alone by the definition (explicit Householder products), and
prints the largest relative differences. Verdict and use: dev/cuda/HISTORY.md ("Next (after v3.80)").
    python3 dev/cuda/packed_chunks.py
"""
import numpy as np


def brute_logits(q, k, w, b):
    """S[i, j] = q_i . (H_i ... H_{j+1} k_j) for j <= i (H_t = I - b_t w_t w_t^T), else -inf."""
    T, K = q.shape
    S = np.full((T, T), -np.inf)
    for j in range(T):
        x = k[j].copy()
        for i in range(j, T):
            if i > j:
                x = x - b[i] * w[i] * (w[i] @ x)  # x = H_i ... H_{j+1} k_j
            S[i, j] = q[i] @ x
    return S


def packed_logits(q, k, w, b, seg):
    """A_loc of one chunk holding the sequences seg (a sequence id per row), masked by M."""
    M = (seg[:, None] == seg[None, :]).astype(np.float64)
    A = np.tril(b[:, None] * (w @ w.T), -1) * M
    E = np.linalg.inv(np.eye(len(b)) + A)
    U = E @ (b[:, None] * (np.tril(w @ k.T, -1) * M))
    A_loc = (np.tril(q @ k.T) - np.tril(q @ w.T) @ U) * M
    causal_same = np.tril(M) > 0
    return np.where(causal_same, A_loc, -np.inf), E, M


def softmax_out(S, v):
    P = np.exp(S - S.max(axis=1, keepdims=True))
    return (P / P.sum(axis=1, keepdims=True)) @ v


def main():
    rng = np.random.default_rng(7)
    K = 32
    worst_s = worst_o = 0.0
    cases = [[10] * 6, [64], [1, 63], [7, 1, 20, 26, 3], [2] * 32, [33, 31], [5, 9, 13, 17, 20]]
    for lengths in cases:
        for beta_kind in ("u02", "two"):
            T = sum(lengths)
            seg = np.repeat(np.arange(len(lengths)), lengths)
            q, k, v = rng.standard_normal((3, T, K))
            w = rng.standard_normal((T, K))
            w /= np.linalg.norm(w, axis=1, keepdims=True)
            b = rng.uniform(0, 2, T) if beta_kind == "u02" else np.full(T, 2.0)
            S, E, M = packed_logits(q, k, w, b, seg)
            assert np.array_equal(E * (1 - M), np.zeros_like(E)), "E must be block-diagonal"
            o = softmax_out(S, v)
            start = 0
            for n in lengths:
                sl = slice(start, start + n)
                ref = brute_logits(q[sl], k[sl], w[sl], b[sl])
                fin = np.isfinite(ref)
                assert np.array_equal(fin, np.isfinite(S[sl, sl])), "the causal pattern inside a sequence"
                worst_s = max(worst_s, np.abs(S[sl, sl][fin] - ref[fin]).max() / np.abs(ref[fin]).max())
                o_ref = softmax_out(ref, v[sl])
                worst_o = max(worst_o, np.abs(o[sl] - o_ref).max() / np.abs(o_ref).max())
                start += n
    print(f"packed chunks: {len(cases) * 2} packings, worst relative difference against each sequence alone: "
          f"logits {worst_s:.2e}, outputs {worst_o:.2e}")
    assert worst_s < 1e-12 and worst_o < 1e-12


if __name__ == "__main__":
    main()
