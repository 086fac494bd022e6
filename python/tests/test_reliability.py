"""Bad input and shared state through the Python API: empty arrays, argument order of checks, byte order and
read-only arrays, integer arguments, the validating mode, and a PathCache stepped from several threads."""
import threading

import numpy as np
import pytest

import pathattn
from conftest import make_inputs


def args(x, **kw):
    return (x["q"], x["k"], x["v"], x["w"], x["beta"]), dict(dict(g=x.get("g")), **kw)


@pytest.mark.parametrize("shape", [(1, 0), (0, 5), (2, 0)])
def test_empty_batch_or_length_is_legal(rng, shape):
    B, T = shape
    x = make_inputs(rng, B, T, 2, 2, 8, 8)
    a, kw = args(x)
    o, _, lse = pathattn.parallel_path_attn(*a, return_lse=True, **kw)
    assert o.shape == (B, T, 2, 8) and lse.shape == (B, T, 2)
    grads = pathattn.parallel_path_attn_bwd(*a, o, lse, np.zeros_like(o), **kw)
    assert grads.dq.shape == x["q"].shape and grads.dg.shape == x["g"].shape
    o2, cache = pathattn.prefill(*a, **kw)
    assert o2.shape == o.shape and list(cache.lengths) == [0] * B


def test_sliced_empty_inputs(rng):
    # A zero-length slice of a real array: the error (if any) would name an argument the caller never passed.
    x = make_inputs(rng, 1, 6, 2, 2, 8, 8)
    s = {n: (a[:, 3:3] if a is not None else None) for n, a in x.items()}
    a, kw = args(s)
    o, _ = pathattn.parallel_path_attn(*a, **kw)
    assert o.shape == (1, 0, 2, 8)


def test_bad_argument_reported_before_outputs_are_allocated(rng):
    # q claims 2^34 tokens (no memory behind it: stride 0); k does not match. The error names k, not numpy's
    # failure to allocate o.
    base = np.zeros(8, np.float32)
    big = np.lib.stride_tricks.as_strided(base, (1, 1 << 34, 1, 8), (0, 0, 0, 4))
    bad_k = np.lib.stride_tricks.as_strided(base, (1, 1 << 34, 1, 16), (0, 0, 0, 4))
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        pathattn.parallel_path_attn(big, bad_k, big, None, None)
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        pathattn.prefill(big, bad_k, big, None, None)
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        pathattn.parallel_path_attn_bwd(big, bad_k, big, None, None, big, big[..., 0], big)


def test_big_endian_and_read_only_arrays_named(rng):
    x = make_inputs(rng, 1, 6, 2, 2, 8, 8)
    a, kw = args(x)
    with pytest.raises(TypeError, match=r"^q: dtype >f4 is not in this machine's byte order"):
        pathattn.parallel_path_attn(x["q"].astype(">f4"), *a[1:], **kw)
    o, _, lse = pathattn.parallel_path_attn(*a, return_lse=True, **kw)
    with pytest.raises(TypeError, match=r"^do: dtype >f4"):
        pathattn.parallel_path_attn_bwd(*a, o, lse, o.astype(">f4"), **kw)
    ro = {n: v.copy() for n, v in x.items()}
    for v in ro.values():
        v.flags.writeable = False
    a2, kw2 = args(ro)
    o2, _ = pathattn.parallel_path_attn(*a2, **kw2)  # read-only inputs are fine
    np.testing.assert_array_equal(o2, o)
    _, cache = pathattn.prefill(*a, **kw)
    cache.kc.flags.writeable = False
    step = [v[:, :1] for v in a] + [x["g"][:, :1]]
    with pytest.raises(ValueError, match=r"^cache.kc: the array is read-only"):
        pathattn.decode_step(cache, *step[:5], g=step[5])


@pytest.mark.parametrize("dtype", [np.uint32, np.int8, np.uint64, np.float64])
def test_cu_seqlens_dtype_message(rng, dtype):
    x = make_inputs(rng, 1, 8, 2, 2, 8, 8)
    a, kw = args(x)
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected dtype int32 or int64, got " + np.dtype(dtype).name):
        pathattn.parallel_path_attn(*a, cu_seqlens=np.array([0, 4, 8], dtype), **kw)


@pytest.mark.parametrize("cu", [[0, 4.5, 8], [0, 4.0, 8], [0, True, 8]])
def test_cu_seqlens_list_must_hold_integers(rng, cu):
    x = make_inputs(rng, 1, 8, 2, 2, 8, 8)
    a, kw = args(x)
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected integers"):
        pathattn.parallel_path_attn(*a, cu_seqlens=cu, **kw)
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected integers"):
        pathattn.prefill(*a, cu_seqlens=cu, **kw)
    o, _ = pathattn.parallel_path_attn(*a, cu_seqlens=[0, np.int64(4), 8], **kw)  # numpy ints are ints
    assert np.all(np.isfinite(o))


def test_validate_option(rng):
    x = make_inputs(rng, 1, 6, 2, 2, 8, 8)
    a, kw = args(x)
    o, _, lse = pathattn.parallel_path_attn(*a, return_lse=True, validate=True, **kw)
    pathattn.parallel_path_attn_bwd(*a, o, lse, np.ones_like(o), validate=True, **kw)
    pathattn.prefill(*a, validate=True, **kw)
    bad = dict(x, beta=x["beta"] * 0 + 2.5)
    a2, kw2 = args(bad)
    pathattn.parallel_path_attn(*a2, **kw2)  # off by default: passes through
    with pytest.raises(ValueError, match=r"^beta: value 2.5 at \[0, 0, 0\] is outside \[0, 2\]"):
        pathattn.parallel_path_attn(*a2, validate=True, **kw2)
    with pytest.raises(ValueError, match=r"^beta: value 2.5"):
        pathattn.prefill(*a2, validate=True, **kw2)
    nan_do = np.ones_like(o)
    nan_do[0, 2, 1, 3] = np.nan
    with pytest.raises(ValueError, match=r"^do: non-finite value nan at \[0, 2, 1, 3\]"):
        pathattn.parallel_path_attn_bwd(*a, o, lse, nan_do, validate=True, **kw)
    with pytest.raises(TypeError, match=r"^validate: expected a bool"):
        pathattn.parallel_path_attn(*a, validate=1, **kw)
    with pytest.raises(TypeError):
        pathattn.parallel_path_attn(*a, kw["g"], None, None, False, True)  # keyword-only


def test_backend_available_cuda_without_torch(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.setattr(pathattn._api, "_available", {})
    assert pathattn.backend_available("cuda") is False


def test_path_cache_shared_between_threads(rng):
    # Two threads step one cache 20 times each: every token lands (lengths 4 + 40), in all trials.
    x = make_inputs(rng, 2, 4, 2, 2, 8, 8)
    a, kw = args(x)
    steps = make_inputs(rng, 2, 1, 2, 2, 8, 8)
    sa, skw = args(steps)
    for _ in range(5):
        _, cache = pathattn.prefill(*a, capacity=8, **kw)  # small capacity: steps also grow the cache
        barrier = threading.Barrier(2)
        errors = []

        def work():
            barrier.wait()
            try:
                for _ in range(20):
                    pathattn.decode_step(cache, *sa, **skw)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        ts = [threading.Thread(target=work) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        assert list(cache.lengths) == [44, 44]
