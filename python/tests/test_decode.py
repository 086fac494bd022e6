"""prefill / decode_step (numpy): prefill + N steps equals one forward over all tokens (docs/spec.md, section 7),
for batches, varlen prompts, gates, cache growth; and argument errors."""
import numpy as np
import pytest

import pathattn
from conftest import as_f64, make_inputs, ref_forward, rel_l2


def require_decode():
    x = np.zeros((1, 1, 1, 8), np.float32)
    try:
        pathattn.prefill(x, x, x, x, np.zeros((1, 1, 1), np.float32))
    except pathattn.BackendUnavailableError:
        pytest.skip("prefill / decode are unavailable in this build")


def sl(x, a, b):
    return {n: (None if t is None else t[:, a:b]) for n, t in x.items()}


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("backend", [None, "oracle"])
@pytest.mark.parametrize("capacity", [None, 0])  # 0: every step beyond the prompt grows the cache
def test_prefill_then_decode_equals_forward(rng, gate, backend, capacity):
    require_decode()
    B, T, P = 2, 40, 13
    x = make_inputs(rng, B, T, 4, 2, 16, 8, gate=gate)
    o_pre, cache = pathattn.prefill(**{n: t for n, t in sl(x, 0, P).items()}, backend=backend, capacity=capacity)
    assert isinstance(cache, pathattn.PathCache)
    assert cache.lengths.tolist() == [P, P]
    outs = [pathattn.decode_step(cache, **sl(x, t, t + 1)) for t in range(P, T)]
    assert cache.lengths.tolist() == [T, T]
    assert cache.capacity >= T
    o = np.concatenate([o_pre] + outs, axis=1)
    ro, _, rkc = ref_forward(x)
    assert rel_l2(o, ro) < 2e-5
    # The cache holds the keys transported to the last token.
    for n in range(B):
        assert rel_l2(cache.keys(n).transpose(1, 0, 2), rkc[n]) < 2e-5


def test_prefill_varlen_prompts_then_batched_steps(rng):
    require_decode()
    lens = [3, 0, 9]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    steps = 6
    seqs = [make_inputs(rng, 1, L + steps, 2, 1, 8, 16, gate=True) for L in lens]
    prompt = {n: np.concatenate([s[n][:, :L] for s, L in zip(seqs, lens)], axis=1) for n in seqs[0]}
    o_pre, cache, lse = pathattn.prefill(**prompt, cu_seqlens=cu, return_lse=True)
    assert cache.num_seqs == 3 and cache.lengths.tolist() == lens
    outs = []
    for t in range(steps):
        tok = {n: np.concatenate([s[n][:, L + t:L + t + 1] for s, L in zip(seqs, lens)], axis=0) for n in seqs[0]}
        outs.append(pathattn.decode_step(cache, **tok))
    for i, (s, L) in enumerate(zip(seqs, lens)):
        ro, _, _ = ref_forward(s)
        if L:
            assert rel_l2(o_pre[:, cu[i]:cu[i + 1]], ro[:, :L]) < 2e-5
        dec = np.concatenate([o[i:i + 1] for o in outs], axis=1)
        assert rel_l2(dec, ro[:, L:]) < 2e-5


def test_decode_float64_cache(rng):
    require_decode()
    x = as_f64(make_inputs(rng, 1, 10, 2, 2, 8, 8, gate=True))
    o_pre, cache = pathattn.prefill(**sl(x, 0, 4), backend="oracle")
    assert cache.kc.dtype == np.float64
    outs = [pathattn.decode_step(cache, **sl(x, t, t + 1)) for t in range(4, 10)]
    assert rel_l2(np.concatenate([o_pre] + outs, 1), ref_forward(x)[0]) < 1e-12


def test_decode_errors(rng):
    require_decode()
    x = make_inputs(rng, 2, 5, 2, 2, 8, 8, gate=True)
    _, cache = pathattn.prefill(**sl(x, 0, 4))
    tok = sl(x, 4, 5)
    with pytest.raises(TypeError, match=r"^cache: expected a pathattn.PathCache"):
        pathattn.decode_step(None, **tok)
    with pytest.raises(ValueError, match=r"^cache.gc: .*g is absent"):  # the cache was built with a gate
        pathattn.decode_step(cache, **dict(tok, g=None))
    with pytest.raises(ValueError, match=r"^q"):
        pathattn.decode_step(cache, **dict(tok, q=x["q"][:, 4:5, :1]))
    with pytest.raises(TypeError, match=r"^w: expected dtype"):  # fp16 w is fine (test_param_dtypes.py)
        pathattn.decode_step(cache, **dict(tok, w=tok["w"].astype(np.int32)))
    with pytest.raises(ValueError, match=r"^capacity"):
        pathattn.prefill(**sl(x, 0, 4), capacity=-1)
    assert cache.lengths.tolist() == [4, 4]  # failed steps leave the cache alone
