"""Shared helpers of the pathattn Python tests: seeded inputs, an independent numpy reference of the op
(docs/spec.md, section 1, written from the definition with explicit Householder steps), error metrics, and
skips for backends this build or machine does not have."""
import zlib

import numpy as np
import pytest

import pathattn


def rel_l2(a, b):
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    nb = np.linalg.norm(b)
    na = np.linalg.norm(a - b)
    return float(na / nb) if nb > 0 else float(na)


def same_greedy_tokens(got, want, ref, prompt_len, tie_rel):
    """Checks generate()'s greedy tokens got against want (torch sequences [B, prompt_len + steps]): equal, except
    at a step where the reference's logits ref [B, steps, vocab] put their two best closer than tie_rel times the
    step's largest |logit| (a tie that either run's rounding may tip). A row is compared up to its first differing
    token. Returns the [B, steps] bool mask of the steps whose context both runs share (their logits compare)."""
    B, steps = ref.shape[:2]
    same = ref.new_ones((B, steps), dtype=bool)
    for n in range(B):
        differ = (got[n, prompt_len:] != want[n, prompt_len:]).nonzero()
        if len(differ):
            t = int(differ[0])
            top = ref[n, t].topk(2).values
            tie = tie_rel * float(ref[n, t].abs().max())
            print(f"[greedy tokens] row {n} differs at step {t}: the reference's margin {float(top[0] - top[1]):.2e}, "
                  f"a tie below {tie:.2e}")
            assert float(top[0] - top[1]) < tie, f"row {n}, step {t}: tokens differ where the reference is no tie"
            same[n, t + 1:] = False
    return same


def require_backend(name):
    """Skips the calling test while `name` reports BackendUnavailableError (not built or not written yet)."""
    if not pathattn.backend_available(name):
        pytest.skip(f"backend {name!r} is unavailable in this build / on this machine")


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test: seeded from the test's name.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def make_inputs(rng, B=2, T=17, HQ=4, H=2, K=16, V=8, gate=True, dtype=np.float32, beta_range=(0.0, 2.0),
                path=True):
    """Random op inputs: q, k, v ~ N(0, 1); w unit rows (float32); beta ~ U(beta_range); g = log U(0.9, 1)."""
    fdt = np.float64 if dtype == np.float64 else np.float32
    x = {
        "q": rng.standard_normal((B, T, HQ, K)).astype(dtype),
        "k": rng.standard_normal((B, T, H, K)).astype(dtype),
        "v": rng.standard_normal((B, T, H, V)).astype(dtype),
        "w": None,
        "beta": None,
        "g": None,
    }
    if path:
        w = rng.standard_normal((B, T, H, K))
        x["w"] = (w / np.linalg.norm(w, axis=-1, keepdims=True)).astype(fdt)
        x["beta"] = rng.uniform(beta_range[0], beta_range[1], (B, T, H)).astype(fdt)
    if gate:
        x["g"] = np.log(rng.uniform(0.9, 1.0, (B, T, HQ))).astype(fdt)
    return x


def as_f64(x):
    return {n: (None if a is None else np.asarray(a, dtype=np.float64)) for n, a in x.items()}


def _ref_one(q, k, v, w, beta, g, scale, gate_scale):
    """One sequence, all heads, float64. q [T,HQ,K], k [T,H,K], v [T,H,V], w [T,H,K], beta [T,H], g [T,HQ].
    Returns o [T,HQ,V], lse [T,HQ] and the keys transported to the end kc [T,H,K]."""
    T, HQ, K = q.shape
    H = k.shape[1]
    grp = HQ // H
    kv = np.arange(HQ) // grp  # kv head of each query head
    kq, vq = k[:, kv], v[:, kv]  # [T, HQ, *]
    logits = np.full((HQ, T, T), -np.inf)
    A = q.copy()  # A[i] = q_i H_i ... H_{j+1} at step j
    for j in range(T - 1, -1, -1):
        logits[:, j:, j] = np.einsum("ihk,hk->hi", A[j:], kq[j])
        if w is not None:
            wj, bj = w[j, kv], beta[j, kv]  # [HQ, K], [HQ]
            A[j:] -= bj[None, :, None] * np.einsum("ihk,hk->ih", A[j:], wj)[:, :, None] * wj[None]
    s = scale * logits
    if g is not None:
        G = np.cumsum(g, axis=0).T  # [HQ, T]
        s = s + gate_scale * (G[:, :, None] - G[:, None, :])
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    lse = (np.log(p.sum(-1)) + m[..., 0]).T  # [T, HQ]
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hij,jhv->ihv", p, vq)
    kc = k.copy()
    if w is not None:
        for t in range(1, T):
            d = np.einsum("jhk,hk->jh", kc[:t], w[t])
            kc[:t] -= beta[t][None, :, None] * d[:, :, None] * w[t][None]
    return o, lse, kc


def ref_forward(x, scale=None, gate_scale=None, cu_seqlens=None):
    """The op from its definition, in float64: returns (o, lse, k_cache) in [B,T,...] layout."""
    x = as_f64(x)
    q, k, v, w, beta, g = (x[n] for n in ("q", "k", "v", "w", "beta", "g"))
    B, T, HQ, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    gate_scale = scale if gate_scale is None else gate_scale
    o = np.zeros((B, T, HQ, v.shape[3]))
    lse = np.zeros((B, T, HQ))
    kc = np.zeros(k.shape)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = list(np.asarray(cu_seqlens))
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1) if cu[n + 1] > cu[n]]
    for b, t0, t1 in spans:
        sl = (b, slice(t0, t1))
        res = _ref_one(q[sl], k[sl], v[sl], None if w is None else w[sl], None if beta is None else beta[sl],
                       None if g is None else g[sl], scale, gate_scale)
        o[sl], lse[sl], kc[sl] = res
    return o, lse, kc


def call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["w"], x["beta"], x["g"], **kw)
