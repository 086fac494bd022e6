"""numpy backward (parallel_path_attn_bwd): the oracle against central finite differences of the forward
in float64, and the cpu backend (float32) against the oracle (float64)."""
import numpy as np
import pytest

import pathattn
from conftest import as_f64, make_inputs, rel_l2, require_backend

NAMES = ("q", "k", "v", "w", "beta", "g")


def fwd_bwd(x, do, backend, cu=None, **kw):
    o, _, lse = pathattn.parallel_path_attn(x["q"], x["k"], x["v"], x["w"], x["beta"], x["g"], cu_seqlens=cu,
                                            return_lse=True, backend=backend, **kw)
    grads = pathattn.parallel_path_attn_bwd(x["q"], x["k"], x["v"], x["w"], x["beta"], o, lse, do, g=x["g"],
                                            cu_seqlens=cu, backend=backend, **kw)
    return o, grads


def loss(x, do, cu=None, **kw):
    o, _ = pathattn.parallel_path_attn(x["q"], x["k"], x["v"], x["w"], x["beta"], x["g"], cu_seqlens=cu,
                                       backend="oracle", **kw)
    return float(np.sum(o * do))


@pytest.mark.parametrize("case", [
    dict(B=1, T=5, HQ=2, H=1, K=8, V=8, gate=True),
    dict(B=2, T=4, HQ=2, H=2, K=8, V=16, gate=False),
])
@pytest.mark.parametrize("varlen", [False, True])
def test_oracle_bwd_vs_finite_differences(rng, case, varlen):
    if varlen:
        case = dict(case, B=1, T=7)
    cu = [0, 3, 3, 7] if varlen else None
    x = make_inputs(rng, dtype=np.float64, beta_range=(0.2, 1.8), **case)
    do = rng.standard_normal((case["B"], case["T"], case["HQ"], case["V"]))
    kw = dict(scale=0.7, gate_scale=0.9)
    _, grads = fwd_bwd(x, do, "oracle", cu, **kw)
    assert isinstance(grads, pathattn.PathGrads)
    eps = 1e-6
    for name in NAMES:
        if x[name] is None:
            assert getattr(grads, "d" + name) is None
            continue
        analytic = getattr(grads, "d" + name)
        assert analytic.shape == x[name].shape and analytic.dtype == np.float64
        numeric = np.zeros_like(x[name])
        it = np.nditer(x[name], flags=["multi_index"])
        for _ in it:
            idx = it.multi_index
            orig = x[name][idx]
            x[name][idx] = orig + eps
            lp = loss(x, do, cu, **kw)
            x[name][idx] = orig - eps
            lm = loss(x, do, cu, **kw)
            x[name][idx] = orig
            numeric[idx] = (lp - lm) / (2 * eps)
        assert rel_l2(analytic, numeric) < 1e-6, name


@pytest.mark.parametrize("shape", [(1, 9, 2, 2, 16, 8), (2, 33, 4, 1, 32, 16), (1, 70, 4, 2, 16, 16)])
@pytest.mark.parametrize("gate", [False, True])
def test_cpu_bwd_f32_vs_oracle_f64(rng, shape, gate):
    require_backend("cpu")
    B, T, HQ, H, K, V = shape
    x = make_inputs(rng, *shape, gate=gate, beta_range=(0.5, 2.0))
    do = rng.standard_normal((B, T, HQ, V)).astype(np.float32)
    _, g32 = fwd_bwd(x, do, "cpu")
    _, g64 = fwd_bwd(as_f64(x), do.astype(np.float64), "oracle")
    for name in NAMES:
        a, b = getattr(g32, "d" + name), getattr(g64, "d" + name)
        if b is None:
            assert a is None
            continue
        assert a.dtype == np.float32
        assert rel_l2(a, b) < 1e-4, name  # fp32 accumulation over T; docs/numerics.md has the budget


def test_bwd_plain_attention_has_no_path_gradients(rng):
    x = make_inputs(rng, 1, 6, 2, 1, 8, 8, gate=False, path=False, dtype=np.float64)
    do = rng.standard_normal((1, 6, 2, 8))
    _, grads = fwd_bwd(x, do, "oracle")
    assert grads.dw is None and grads.dbeta is None and grads.dg is None
    assert grads.dq.shape == x["q"].shape


def test_bwd_is_deterministic(rng):
    x = make_inputs(rng, 1, 20, 4, 2, 16, 8, gate=True)
    do = rng.standard_normal((1, 20, 4, 8)).astype(np.float32)
    for backend in ("oracle", "cpu"):
        if not pathattn.backend_available(backend):
            continue
        _, a = fwd_bwd(x, do, backend, deterministic=True)
        _, b = fwd_bwd(x, do, backend, deterministic=True)
        for name in NAMES:
            np.testing.assert_array_equal(getattr(a, "d" + name), getattr(b, "d" + name))
