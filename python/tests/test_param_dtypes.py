"""w, beta and g in the model's dtype (bf16 / fp16) or any other float dtype, on every Python entry point.

flash-linear-attention's PaTH op test, restated: bf16 q, k, v, w, beta with beta ~ U(1.5, 2), an fp32
g = log U(0.95, 1), its five fixed-length shapes (T = 62 included), and its fp16 varlen cases (w, beta fp16,
beta = sigmoid(U(0, 1))); every output and gradient within its tolerances (RMS of the difference over RMS of the
reference) of an fp32 reference on the same values. The reference is the cpu backend on the inputs cast to fp32
(the fp64 oracle for the T = 62 case); the cpu backend itself is checked against the fp64 oracle and the numpy
definition in test_forward.py / test_backward.py. Also: mixed dtypes, gradients in the dtype of their input,
numpy, opcheck / torch.compile fakes, prefill and decode, and the dtypes still refused.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import pathattn  # noqa: E402
from conftest import make_inputs, ref_forward, rel_l2, require_backend  # noqa: E402

# (B, T, H, HQ, K, gate): flash-linear-attention's fixed-length cases.
FIXED = [(10, 62, 2, 8, 128, True), (5, 512, 2, 8, 128, True), (3, 1024, 2, 8, 64, True),
         (2, 2000, 1, 4, 64, False), (1, 4000, 1, 2, 128, False)]
# Its tolerances, per output: relative RMS error.
TOL_FIXED = {"o": 0.005, "q": 0.008, "k": 0.008, "v": 0.008, "g": 0.02, "w": 0.015, "beta": 0.02}
# (H, HQ, K, gate, cu_seqlens): its fp16 varlen cases; tolerance 0.005 for everything.
VARLEN = [(2, 4, 128, False, [0, 15, 333, 2048]), (2, 4, 128, True, [0, 15, 333, 2048]),
          (2, 4, 64, True, [0, 841, 889, 4096]), (2, 4, 64, False, [0, 841, 889, 4096])]


def err_ratio(ref, got):
    """RMS(got - ref) / RMS(ref), in float64."""
    ref = ref.detach().double()
    got = got.detach().double()
    return ((got - ref).square().mean().sqrt() / (ref.square().mean().sqrt() + 1e-8)).item()


def leaves(dtype, param_dtype, B, T, H, HQ, K, gate, beta_fn, gen):
    """q, k, v in dtype; w (unit rows) and beta in param_dtype; g fp32 (None without a gate)."""
    x = {
        "q": torch.randn((B, T, HQ, K), generator=gen).to(dtype),
        "k": torch.randn((B, T, H, K), generator=gen).to(dtype),
        "v": torch.randn((B, T, H, K), generator=gen).to(dtype),
        "w": F.normalize(torch.randn((B, T, H, K), generator=gen), dim=-1, p=2).to(param_dtype),
        "beta": beta_fn((B, T, H)).to(param_dtype),
        "g": torch.empty((B, T, HQ)).uniform_(0.95, 1.0, generator=gen).log() if gate else None,
    }
    return x


def run_grads(x, do, cast=None, **kw):
    """Output and gradients of every input present, the inputs first cast to `cast` (None: as they are)."""
    xs = {n: (None if t is None else (t if cast is None else t.to(cast)).detach().requires_grad_(True))
          for n, t in x.items()}
    o, _ = pathattn.parallel_path_attention(xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], xs["g"], **kw)
    o.backward(do if cast is None else do.to(cast))
    return o, {n: t.grad for n, t in xs.items() if t is not None}


def check_against_fp32(x, do, tol, ref_backend="cpu", **kw):
    o, grads = run_grads(x, do, backend="cpu", **kw)
    cast = torch.float64 if ref_backend == "oracle" else torch.float32
    o_ref, grads_ref = run_grads(x, do, cast=cast, backend=ref_backend, **kw)
    assert o.dtype == x["v"].dtype
    errs = {"o": err_ratio(o_ref, o)}
    for n, gr in grads.items():
        assert gr.dtype == x[n].dtype, f"d{n}: dtype {gr.dtype}, expected that of {n}: {x[n].dtype}"
        assert torch.isfinite(gr).all(), f"d{n} has NaN / Inf"
        errs[n] = err_ratio(grads_ref[n], gr)
    print(" ".join(f"{'d' + n if n != 'o' else n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < tol[n], f"{n}: error ratio {e:.3e} >= {tol[n]}"


@pytest.mark.parametrize("B,T,H,HQ,K,gate", FIXED, ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-HQ{c[3]}-K{c[4]}-gate{c[5]}"
                                                       for c in FIXED])
def test_fla_fixed_cases_bf16(B, T, H, HQ, K, gate):
    require_backend("cpu")
    gen = torch.Generator().manual_seed(B * 100003 + T)
    x = leaves(torch.bfloat16, torch.bfloat16, B, T, H, HQ, K, gate,
               lambda s: torch.empty(s).uniform_(1.5, 2.0, generator=gen), gen)
    do = torch.rand((B, T, HQ, K), generator=gen).to(torch.bfloat16)
    # T = 62: also against the fp64 oracle (small enough for it).
    check_against_fp32(x, do, TOL_FIXED, ref_backend="oracle" if T <= 64 else "cpu", scale=K ** -0.5)


@pytest.mark.parametrize("H,HQ,K,gate,cu", VARLEN, ids=[f"H{c[0]}-HQ{c[1]}-K{c[2]}-gate{c[3]}-T{c[4][-1]}"
                                                      for c in VARLEN])
def test_fla_varlen_cases_fp16(H, HQ, K, gate, cu):
    require_backend("cpu")
    T = cu[-1]
    gen = torch.Generator().manual_seed(T * 7 + K + int(gate))
    x = leaves(torch.float16, torch.float16, 1, T, H, HQ, K, gate,
               lambda s: torch.rand(s, generator=gen).sigmoid(), gen)
    do = torch.randn((1, T, HQ, K), generator=gen).to(torch.float16)
    tol = dict.fromkeys(TOL_FIXED, 0.005)
    check_against_fp32(x, do, tol, cu_seqlens=torch.tensor(cu, dtype=torch.int32), scale=K ** -0.5)


# Exactness: the backends read 16-bit w, beta, g exactly into their compute type, so a narrow call equals,
# bitwise, the call with the same values in fp32, and its gradients are that call's rounded to their dtype.
MIXED = [(torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32, torch.bfloat16),
         (torch.float32, torch.float16, torch.float16), (torch.bfloat16, torch.float32, torch.float32)]


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wdt,bdt,gdt", MIXED)
def test_mixed_dtypes_equal_fp32_values(rng, backend, qdt, wdt, bdt, gdt):
    require_backend(backend)
    x = make_inputs(rng, 2, 19, 4, 2, 16, 8, gate=True)
    dts = {"q": qdt, "k": qdt, "v": qdt, "w": wdt, "beta": bdt, "g": gdt}
    narrow = {n: torch.from_numpy(a).to(dts[n]) for n, a in x.items()}
    wide = {n: (t.float() if n in ("w", "beta", "g") else t) for n, t in narrow.items()}
    do = torch.randn(2, 19, 4, 8).to(qdt)
    o_n, g_n = run_grads(narrow, do, backend=backend)
    o_w, g_w = run_grads(wide, do, backend=backend)
    assert torch.equal(o_n, o_w)
    for n in ("q", "k", "v"):
        assert torch.equal(g_n[n], g_w[n]), n
    for n in ("w", "beta", "g"):
        assert g_n[n].dtype == dts[n]
        assert torch.equal(g_n[n], g_w[n].to(dts[n])), n


def test_numpy_narrow_and_wide_params(rng):
    x = make_inputs(rng, 1, 11, 2, 2, 8, 8, gate=True)
    n16 = dict(x, w=x["w"].astype(np.float16), beta=x["beta"].astype(np.float64), g=x["g"].astype(np.float16))
    wide = dict(x, w=n16["w"].astype(np.float32), beta=n16["beta"].astype(np.float32), g=n16["g"].astype(np.float32))
    o, _, lse = pathattn.parallel_path_attn(**n16, backend="cpu", return_lse=True)
    o2, _, lse2 = pathattn.parallel_path_attn(**wide, backend="cpu", return_lse=True)
    np.testing.assert_array_equal(o, o2)
    assert rel_l2(o, ref_forward(wide)[0]) < 2e-5
    do = np.ones_like(o)
    gr = pathattn.parallel_path_attn_bwd(n16["q"], n16["k"], n16["v"], n16["w"], n16["beta"], o, lse, do,
                                         g=n16["g"], backend="cpu")
    grw = pathattn.parallel_path_attn_bwd(wide["q"], wide["k"], wide["v"], wide["w"], wide["beta"], o2, lse2, do,
                                          g=wide["g"], backend="cpu")
    assert (gr.dw.dtype, gr.dbeta.dtype, gr.dg.dtype) == (np.float16, np.float64, np.float16)
    np.testing.assert_array_equal(gr.dw, grw.dw.astype(np.float16))
    np.testing.assert_array_equal(gr.dg, grw.dg.astype(np.float16))
    assert rel_l2(gr.dbeta, grw.dbeta) < 1e-6  # fp64 storage keeps digits fp32 rounds off


def test_refused_dtypes_are_named_type_errors(rng):
    x = make_inputs(rng, 1, 5, 2, 2, 8, 8, gate=True)
    xt = {n: torch.from_numpy(a) for n, a in x.items()}
    for name, bad in (("w", torch.int32), ("beta", torch.int64), ("g", torch.int32)):
        with pytest.raises(TypeError, match=rf"^{name}: expected dtype bfloat16, float16, float32 or float64, got"):
            pathattn.parallel_path_attn(**dict(xt, **{name: xt[name].to(bad)}), backend="cpu")
    with pytest.raises(TypeError, match=r"^w: expected dtype"):
        pathattn.parallel_path_attn(**dict(xt, w=xt["w"].to(torch.complex64)), backend="cpu")
    with pytest.raises(TypeError, match=r"^beta: expected dtype"):
        pathattn.parallel_path_attn(**dict(xt, beta=xt["beta"] > 1), backend="cpu")
    with pytest.raises(TypeError, match=r"^w: expected dtype"):
        pathattn.parallel_path_attn(**dict(x, w=x["w"].astype(np.complex64)), backend="cpu")
    with pytest.raises(TypeError, match=r"^g: expected dtype"):
        pathattn.parallel_path_attn(**dict(x, g=x["g"].astype(np.int16)), backend="cpu")


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float16])
def test_opcheck_with_narrow_params(rng, pdt):
    x = make_inputs(rng, 1, 6, 2, 1, 8, 8, gate=True)
    xt = {n: torch.from_numpy(a).to(pdt if n in ("w", "beta") else torch.float32).requires_grad_(True)
          for n, a in x.items()}
    scale = 8 ** -0.5
    args = (xt["q"], xt["k"], xt["v"], xt["w"], xt["beta"], xt["g"], None, scale, scale, False, 2, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_fwd.default, args)
    plain = {n: t.detach() for n, t in xt.items()}
    o, lse, _ = torch.ops.pathattn.path_attn_fwd(plain["q"], plain["k"], plain["v"], plain["w"], plain["beta"],
                                                 plain["g"], None, scale, scale, False, 2, False)
    bargs = (torch.randn_like(o), plain["q"], plain["k"], plain["v"], plain["w"], plain["beta"], plain["g"], None,
             o, lse, scale, scale, 2, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_bwd.default, bargs)
    dq, dk, dv, dw, dbeta, dg = torch.ops.pathattn.path_attn_bwd(*bargs)
    assert (dw.dtype, dbeta.dtype, dg.dtype) == (pdt, pdt, torch.float32)


def test_torch_compile_with_bf16_params(rng):
    x = make_inputs(rng, 2, 9, 4, 2, 16, 16, gate=True)
    xt = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in x.items()}

    def f(q, k, v, w, beta, g):
        o, _ = pathattn.parallel_path_attn(q, k, v, w, beta, g, backend="cpu")
        return o.float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    eager_in = {n: t.clone().requires_grad_(True) for n, t in xt.items()}
    comp_in = {n: t.clone().requires_grad_(True) for n, t in xt.items()}
    f(**eager_in).backward()
    compiled(**comp_in).backward()
    for n in xt:
        assert comp_in[n].grad.dtype == torch.bfloat16
        assert torch.equal(comp_in[n].grad, eager_in[n].grad), n


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_prefill_and_decode_with_narrow_params(rng, kind):
    x = make_inputs(rng, 2, 12, 4, 2, 8, 8, gate=True)
    if kind == "numpy":
        narrow = dict(x, w=x["w"].astype(np.float16), beta=x["beta"].astype(np.float16), g=x["g"].astype(np.float16))
        wide = {n: (a.astype(np.float32) if n in ("w", "beta", "g") else a) for n, a in narrow.items()}
        cat = np.concatenate
    else:
        narrow = {n: torch.from_numpy(a).to(torch.bfloat16 if n in ("w", "beta", "g") else torch.float32)
                  for n, a in x.items()}
        wide = {n: t.float() for n, t in narrow.items()}
        cat = torch.cat

    def sl(d, a, b):
        return {n: t[:, a:b] for n, t in d.items()}

    def run(d):
        o, cache = pathattn.prefill(**sl(d, 0, 7), backend="cpu")
        outs = [o] + [pathattn.decode_step(cache, **sl(d, t, t + 1)) for t in range(7, 12)]
        return (cat(outs, 1)), cache

    o_n, c_n = run(narrow)
    o_w, c_w = run(wide)
    as_np = (lambda a: a) if kind == "numpy" else (lambda a: a.numpy())
    np.testing.assert_array_equal(as_np(o_n), as_np(o_w))
    np.testing.assert_array_equal(as_np(c_n.kc), as_np(c_w.kc))
    np.testing.assert_array_equal(as_np(c_n.gc), as_np(c_w.gc))
    assert rel_l2(as_np(o_w), ref_forward({n: as_np(t) for n, t in wide.items()})[0]) < 2e-5
