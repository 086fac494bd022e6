"""Bad arguments raise ValueError / TypeError / NotImplementedError / RuntimeError whose message names the
argument, from the Python checks and from the C++ validation alike, and never touch memory."""
import numpy as np
import pytest

import pathattn
from conftest import make_inputs


def run(x, **kw):
    return pathattn.parallel_path_attn(x["q"], x["k"], x["v"], x["w"], x["beta"], x["g"],
                                       **dict(dict(backend="oracle"), **kw))


@pytest.fixture
def x(rng):
    return make_inputs(rng, 2, 6, 4, 2, 16, 8, gate=True)


def expect(exc, match, x, **kw):
    with pytest.raises(exc, match=match):
        run(x, **kw)


def test_wrong_rank_names_argument(x):
    x["q"] = x["q"][0]
    expect(ValueError, r"^q: expected 4 dimensions", x)


def test_shape_mismatch_names_argument(x):
    x2 = dict(x, k=x["k"][:, :5])
    expect(ValueError, r"^k: expected shape", x2)
    x3 = dict(x, v=x["v"][:1])
    expect(ValueError, r"^v: expected shape", x3)
    x4 = dict(x, w=x["w"][..., :8])
    expect(ValueError, r"^w: expected shape", x4)
    x5 = dict(x, beta=x["beta"][:, :, :1])
    expect(ValueError, r"^beta: expected shape", x5)
    x6 = dict(x, g=x["g"][:, :, :2])  # g has HQ heads, not H
    expect(ValueError, r"^g: expected shape", x6)


def test_gqa_head_count(x):
    x["q"] = x["q"][:, :, :3]
    expect(ValueError, r"^q: the number of query heads", x)


# w, beta and g take any float dtype (test_param_dtypes.py); integer ones, and k / v unlike q, are refused.
@pytest.mark.parametrize("name,dtype", [("w", np.int32), ("beta", np.int64), ("g", np.int32),
                                        ("k", np.float64), ("v", np.float16)])
def test_dtype_errors_are_type_errors(x, name, dtype):
    x[name] = x[name].astype(dtype)
    expect(TypeError, rf"^{name}: expected dtype", x)


@pytest.mark.parametrize("name,dtype", [("w", np.float16), ("beta", np.float64), ("g", np.float16)])
def test_float_params_in_any_dtype_are_accepted(x, name, dtype):
    o_ref, _ = run(x)
    o, _ = run(dict(x, **{name: x[name].astype(dtype).astype(np.float32)}))
    o2, _ = run(dict(x, **{name: x[name].astype(dtype)}))
    np.testing.assert_array_equal(o2, o)  # the same values, read exactly
    assert np.abs(o2 - o_ref).max() < 1e-2


def test_unsupported_dtypes(x):
    x["q"] = x["q"].astype(np.int32)
    expect(TypeError, r"^q: expected dtype", x)
    x["q"] = np.zeros(x["q"].shape, np.complex64)
    expect(TypeError, r"^q: expected dtype", x)


def test_non_array_arguments(x):
    expect(TypeError, r"^q: expected a numpy.ndarray or torch.Tensor, got builtins.list",
           dict(x, q=x["q"].tolist()))
    expect(TypeError, r"^w: expected a numpy.ndarray", dict(x, w="w"))
    expect(TypeError, r"^k: expected a numpy.ndarray, got None", dict(x, k=None))
    expect(ValueError, r"^beta: w and beta must be given together", dict(x, beta=None))
    expect(ValueError, r"^w: w and beta must be given together", dict(x, w=None))


def test_scalar_arguments(x):
    expect(TypeError, r"^scale: expected a float or None, got str", x, scale="0.5")
    expect(TypeError, r"^scale: expected a float or None, got bool", x, scale=True)
    expect(ValueError, r"^scale: expected a finite number", x, scale=float("inf"))
    expect(TypeError, r"^gate_scale: expected a float or None", x, gate_scale=[1.0])
    expect(TypeError, r"^use_cache: expected a bool", x, use_cache=1)
    expect(TypeError, r"^return_lse: expected a bool", x, return_lse="yes")
    expect(ValueError, r"^backend: expected None, 'auto', 'oracle', 'cpu' or 'cuda', got 'gpu'", x, backend="gpu")


def test_cu_seqlens_errors(rng):
    x = make_inputs(rng, 1, 10, 2, 2, 8, 8)
    expect(ValueError, r"^cu_seqlens: must be non-decreasing", x, cu_seqlens=[0, 6, 4, 10])
    expect(ValueError, r"^cu_seqlens: the last entry must equal T = 10", x, cu_seqlens=[0, 4, 9])
    expect(ValueError, r"^cu_seqlens: the first entry must be 0", x, cu_seqlens=[1, 10])
    expect(TypeError, r"^cu_seqlens: expected dtype int32 or int64", x,
           cu_seqlens=np.array([0.0, 10.0], np.float32))
    expect(TypeError, r"^cu_seqlens: expected a numpy.ndarray", x, cu_seqlens="0,10")
    x2 = make_inputs(rng, 2, 10, 2, 2, 8, 8)
    expect(ValueError, r"^cu_seqlens: requires batch size B == 1", x2, cu_seqlens=[0, 10])


def test_last_dim_must_be_contiguous_for_numpy(x):
    q = np.asfortranarray(x["q"])
    expect(ValueError, r"^q: the last dimension must be contiguous", dict(x, q=q))


def test_head_dim_not_supported_is_not_implemented(rng):
    x = make_inputs(rng, 1, 4, 2, 2, 12, 8)
    with pytest.raises(NotImplementedError, match=r"^q: head dim K = 12 is not supported"):
        run(x)
    with pytest.raises(pathattn.UnsupportedError):
        run(x)


def test_cuda_backend_unavailable_or_wrong_device(x):
    # In a build without CUDA the backend is unavailable (RuntimeError); with CUDA, host arrays are on the
    # wrong device (ValueError). Both name the problem.
    with pytest.raises((pathattn.BackendUnavailableError, ValueError), match=r"(backend: cuda|q: tensor is on the cpu)"):
        run(x, backend="cuda")
    if "cuda" not in pathattn.build_info():
        with pytest.raises(RuntimeError):
            run(x, backend="cuda")


def test_bwd_argument_errors(rng):
    x = make_inputs(rng, 1, 6, 2, 2, 8, 8, gate=True)
    o, _, lse = run(x, return_lse=True)
    do = np.ones_like(o)
    args = (x["q"], x["k"], x["v"], x["w"], x["beta"])
    with pytest.raises(ValueError, match=r"^lse: expected shape"):
        pathattn.parallel_path_attn_bwd(*args, o, lse[:, :3], do, g=x["g"], backend="oracle")
    with pytest.raises(TypeError, match=r"^do: expected dtype float32"):
        pathattn.parallel_path_attn_bwd(*args, o, lse, do.astype(np.float64), g=x["g"], backend="oracle")
    with pytest.raises(TypeError, match=r"^o: expected a numpy.ndarray"):
        pathattn.parallel_path_attn_bwd(*args, None, lse, do, g=x["g"], backend="oracle")


def test_validating_mode_is_not_default_and_bad_values_pass_through(rng):
    # beta outside [0, 2] and non-unit w are legal input (no stability promise): no exception.
    x = make_inputs(rng, 1, 5, 2, 2, 8, 8)
    x["beta"][:] = 3.0
    x["w"] *= 2.0
    o, _ = run(x)
    assert np.all(np.isfinite(o))


def test_workspace_limit_setting(x):
    assert pathattn.workspace_limit() == 0
    try:
        pathattn.set_workspace_limit(1 << 20)
        assert pathattn.workspace_limit() == 1 << 20
        o, _ = run(x, backend="cpu")  # CPU backends ignore the limit
        assert np.isfinite(o).all()
        with pytest.raises(TypeError, match="nbytes"):
            pathattn.set_workspace_limit(1.5)
        with pytest.raises(TypeError, match="nbytes"):
            pathattn.set_workspace_limit(True)
        assert pathattn.workspace_limit() == 1 << 20
    finally:
        pathattn.set_workspace_limit(0)
    assert pathattn.workspace_limit() == 0
