"""numpy forward: the oracle and cpu backends through the bindings, against the numpy reference of the
definition (conftest.ref_forward) and against each other; conventions, varlen, use_cache, zero-copy."""
import numpy as np
import pytest

import pathattn
from conftest import as_f64, call, make_inputs, ref_forward, rel_l2, require_backend

# Shapes: (B, T, HQ, H, K, V). Awkward T, MHA and GQA (4:1, MQA), K != V.
SHAPES = [
    (1, 1, 1, 1, 8, 8),
    (2, 7, 2, 2, 16, 8),
    (2, 17, 4, 1, 16, 24),
    (1, 65, 8, 2, 32, 32),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", [False, True])
def test_oracle_f64_matches_definition(rng, shape, gate):
    B, T, HQ, H, K, V = shape
    x = make_inputs(rng, B, T, HQ, H, K, V, gate=gate, dtype=np.float64)
    o, k_cache, lse = call(pathattn.parallel_path_attn, x, backend="oracle", return_lse=True)
    ro, rlse, _ = ref_forward(x)
    assert k_cache is None
    assert o.dtype == np.float64 and o.shape == (B, T, HQ, V)
    assert lse.dtype == np.float64 and lse.shape == (B, T, HQ)
    assert rel_l2(o, ro) < 1e-12
    assert rel_l2(lse, rlse) < 1e-12


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("gate", [False, True])
def test_oracle_f32_inputs_vs_f64(rng, shape, gate):
    # The oracle computes in fp64 whatever the input dtype: f32 inputs differ from the f64 run on the same
    # (f32-rounded) values only by the final rounding of o to f32.
    x = make_inputs(rng, *shape, gate=gate, dtype=np.float32)
    o, _ = call(pathattn.parallel_path_attn, x, backend="oracle")
    o64, _ = call(pathattn.parallel_path_attn, as_f64(x), backend="oracle")
    assert o.dtype == np.float32
    assert rel_l2(o, o64) < 2e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("beta_range", [(0.0, 2.0), (1.9, 2.0)])
def test_cpu_f32_vs_oracle_f64(rng, shape, gate, beta_range):
    require_backend("cpu")
    x = make_inputs(rng, *shape, gate=gate, dtype=np.float32, beta_range=beta_range)
    o, _, lse = call(pathattn.parallel_path_attn, x, backend="cpu", return_lse=True)
    o64, _, lse64 = call(pathattn.parallel_path_attn, as_f64(x), backend="oracle", return_lse=True)
    assert rel_l2(o, o64) < 2e-5
    assert rel_l2(lse, lse64) < 2e-5


def test_cpu_longer_sequence_vs_oracle(rng):
    require_backend("cpu")
    x = make_inputs(rng, 1, 300, 4, 2, 64, 64, gate=True)
    o, _ = call(pathattn.parallel_path_attn, x, backend="cpu")
    o64, _ = call(pathattn.parallel_path_attn, as_f64(x), backend="oracle")
    assert rel_l2(o, o64) < 2e-5


def test_default_backend_is_cpu_for_numpy(rng):
    require_backend("cpu")
    x = make_inputs(rng)
    o, _ = call(pathattn.parallel_path_attn, x)
    oc, _ = call(pathattn.parallel_path_attn, x, backend="cpu")
    np.testing.assert_array_equal(o, oc)


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
def test_float16_inputs(rng, backend):
    require_backend(backend)
    x = make_inputs(rng, 1, 20, 2, 2, 16, 16, gate=True)
    for n in ("q", "k", "v"):
        x[n] = x[n].astype(np.float16)
    o, _ = call(pathattn.parallel_path_attn, x, backend=backend)
    ro, _, _ = ref_forward(x)
    assert o.dtype == np.float16
    assert rel_l2(o, ro) < 2e-3  # fp16 output rounding (2^-11) plus fp32 accumulation


def test_gate_scale_convention(rng):
    # Default: the gate is multiplied by scale (fla). gate_scale=1 is the FoX paper's convention.
    x = make_inputs(rng, 1, 12, 2, 2, 16, 8, gate=True, dtype=np.float64)
    x["g"] = np.log(rng.uniform(0.2, 1.0, x["g"].shape))  # strong gate, so conventions differ visibly
    o_def, _ = call(pathattn.parallel_path_attn, x, backend="oracle")
    o_s, _ = call(pathattn.parallel_path_attn, x, backend="oracle", scale=0.3)
    o_fox, _ = call(pathattn.parallel_path_attn, x, backend="oracle", gate_scale=1.0)
    assert rel_l2(o_def, ref_forward(x)[0]) < 1e-12
    assert rel_l2(o_s, ref_forward(x, scale=0.3)[0]) < 1e-12
    assert rel_l2(o_fox, ref_forward(x, gate_scale=1.0)[0]) < 1e-12
    assert rel_l2(o_fox, o_def) > 1e-3


def test_beta_zero_is_causal_softmax(rng):
    x = make_inputs(rng, 2, 9, 2, 1, 8, 8, gate=False, dtype=np.float64)
    x["beta"][:] = 0.0
    o, _ = call(pathattn.parallel_path_attn, x, backend="oracle")
    q, k, v = x["q"], x["k"], x["v"]
    s = np.einsum("bihk,bjhk->bhij", q, np.repeat(k, 2, axis=2)) * 8 ** -0.5
    s = np.where(np.tril(np.ones((9, 9), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhij,bjhv->bihv", p, np.repeat(v, 2, axis=2))
    assert rel_l2(o, ref) < 1e-12
    # w = beta = None is the same plain attention.
    o2, _ = pathattn.parallel_path_attn(q, k, v, None, None, backend="oracle")
    assert rel_l2(o2, ref) < 1e-12


def test_single_token_returns_v(rng):
    x = make_inputs(rng, 3, 1, 4, 2, 8, 16, gate=True)
    o, _ = call(pathattn.parallel_path_attn, x, backend="oracle")
    np.testing.assert_allclose(o, np.repeat(x["v"], 2, axis=2), rtol=1e-6)


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
@pytest.mark.parametrize("cu", [[0, 5, 5, 19, 30], [0, 30], [0, 1, 2, 30]])
def test_varlen_equals_separate_sequences(rng, backend, cu):
    require_backend(backend)
    T = cu[-1]
    x = make_inputs(rng, 1, T, 4, 2, 16, 8, gate=True)
    for cu_arr in (np.asarray(cu, np.int32), np.asarray(cu, np.int64), list(cu)):
        o, _ = call(pathattn.parallel_path_attn, x, backend=backend, cu_seqlens=cu_arr)
        ro, _, _ = ref_forward(x, cu_seqlens=cu)
        assert rel_l2(o, ro) < 2e-5
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            part = {n: (None if t is None else t[:, a:b]) for n, t in x.items()}
            op, _ = call(pathattn.parallel_path_attn, part, backend=backend)
            np.testing.assert_allclose(o[:, a:b], op, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
@pytest.mark.parametrize("cu", [None, [0, 4, 4, 13, 21]])
def test_use_cache_returns_transported_keys(rng, backend, cu):
    require_backend(backend)
    T = 21
    x = make_inputs(rng, 1 if cu else 2, T, 4, 2, 16, 8, gate=True)
    o, k_cache = call(pathattn.parallel_path_attn, x, backend=backend, cu_seqlens=cu, use_cache=True)
    ro, _, rkc = ref_forward(x, cu_seqlens=cu)
    assert k_cache.shape == x["k"].shape and k_cache.dtype == x["k"].dtype
    assert k_cache.flags.c_contiguous
    assert rel_l2(o, ro) < 2e-5
    assert rel_l2(k_cache, rkc) < 2e-5
    # The last key of each sequence is not transported.
    ends = [T - 1] if cu is None else [b - 1 for a, b in zip(cu[:-1], cu[1:]) if b > a]
    for t in ends:
        np.testing.assert_array_equal(k_cache[:, t], x["k"][:, t])


def test_householder_swap_transports_one_hot_keys():
    # docs/spec.md, section 7: beta = 2, w = (e_a - e_b)/sqrt(2) swaps coordinates a and b exactly.
    K = 8
    q = np.zeros((1, 2, 1, K))
    k = np.zeros((1, 2, 1, K))
    k[0, 0, 0, 1] = 1.0  # key 0 = e_1
    k[0, 1, 0, 5] = 1.0
    q[0, 1, 0, 6] = 1.0  # query 1 = e_6: after the swap (1 <-> 6) it sees key 0 with logit 1
    w = np.zeros((1, 2, 1, K))
    w[0, 1, 0, 1], w[0, 1, 0, 6] = 2 ** -0.5, -(2 ** -0.5)
    beta = np.full((1, 2, 1), 2.0)
    v = np.eye(K)[None, :2, None]  # value j = e_j
    o, kc, lse = pathattn.parallel_path_attn(q, k, v, w, beta, scale=1.0, use_cache=True, return_lse=True,
                                             backend="oracle")
    np.testing.assert_allclose(kc[0, 0, 0], np.eye(K)[6], atol=1e-15)
    p1 = np.exp(1.0) / (np.exp(1.0) + 1.0)  # logits of query 1: key 0 -> 1, key 1 -> 0
    np.testing.assert_allclose(o[0, 1, 0, :2], [p1, 1 - p1], rtol=1e-12)
    np.testing.assert_allclose(lse[0, 1, 0], np.log(np.e + 1.0), rtol=1e-12)


def test_describe_sees_numpy_memory_without_copy():
    a = np.zeros((3, 5, 4, 16), np.float32)
    view = a[:, 1:, ::2]  # strided in T and H, last dim contiguous
    d = pathattn._pathattn.describe(view)
    assert d["data"] == view.ctypes.data
    assert d["shape"] == view.shape
    assert d["stride"] == tuple(s // 4 for s in view.strides)
    assert d["dtype"] == "float32" and d["device"] == "cpu"
    ro = np.zeros((2, 8), np.float64)
    ro.flags.writeable = False  # read-only inputs are accepted
    assert pathattn._pathattn.describe(ro)["data"] == ro.ctypes.data


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
def test_strided_inputs_match_contiguous(rng, backend):
    # Any strides with the last dimension contiguous are read in place.
    require_backend(backend)
    B, T, HQ, H, K, V = 2, 11, 4, 2, 16, 8
    big = make_inputs(rng, B + 1, 2 * T, 2 * HQ, 2 * H, K, V, gate=True)
    x = {
        "q": big["q"][1:, ::2, ::2],
        "k": big["k"][1:, 1::2, 1::2],
        "v": big["v"][:B, :T, :H],
        "w": big["w"][:B, T:, H:],
        "beta": big["beta"][1:, ::2, 1:H + 1],
        "g": big["g"][:B, 1::2, HQ:],
    }
    assert not x["q"].flags.c_contiguous
    o, _ = call(pathattn.parallel_path_attn, x, backend=backend)
    xc = {n: np.ascontiguousarray(a) for n, a in x.items()}
    oc, _ = call(pathattn.parallel_path_attn, xc, backend=backend)
    np.testing.assert_array_equal(o, oc)
    # Head-major storage seen through a transpose: [B, H, T, K] memory as [B, T, H, K].
    qh = np.ascontiguousarray(xc["q"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    o2, _ = pathattn.parallel_path_attn(qh, xc["k"], xc["v"], xc["w"], xc["beta"], xc["g"], backend=backend)
    np.testing.assert_array_equal(o2, oc)


def test_alias_and_build_info():
    assert pathattn.parallel_path_attention is pathattn.parallel_path_attn
    info = pathattn.build_info()
    assert "oracle" in info and "cpu" in info
