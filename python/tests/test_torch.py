"""torch integration on the CPU: the custom ops pathattn::path_attn_fwd / path_attn_bwd (opcheck), autograd
against finite differences in float64 (gradcheck), torch.compile(fullgraph=True), zero-copy, decode."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pathattn  # noqa: E402
from conftest import make_inputs, ref_forward, rel_l2, require_backend  # noqa: E402

NAMES = ("q", "k", "v", "w", "beta", "g")


def to_torch(x, dtype=None, requires_grad=False):
    out = {}
    for n, a in x.items():
        if a is None:
            out[n] = None
            continue
        t = torch.from_numpy(np.ascontiguousarray(a))
        if dtype is not None and n in ("q", "k", "v"):
            t = t.to(dtype)
        out[n] = t.requires_grad_(requires_grad)
    return out


def run(x, **kw):
    return pathattn.parallel_path_attn(x["q"], x["k"], x["v"], x["w"], x["beta"], x["g"], **kw)


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
def test_torch_forward_matches_numpy(rng, backend):
    require_backend(backend)
    x = make_inputs(rng, 2, 13, 4, 2, 16, 8, gate=True)
    o_np, _, lse_np = run(x, backend=backend, return_lse=True)
    o, k_cache, lse = run(to_torch(x), backend=backend, return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32 and k_cache is None
    np.testing.assert_array_equal(o.numpy(), o_np)
    np.testing.assert_array_equal(lse.numpy(), lse_np)


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_inputs(rng, backend, dtype):
    require_backend(backend)
    dt = getattr(torch, dtype)
    x = make_inputs(rng, 1, 30, 4, 2, 32, 32, gate=True)
    xt = to_torch(x, dtype=dt)
    o, _ = run(xt, backend=backend)
    assert o.dtype == dt
    ref = {n: (None if t is None else t.double().numpy()) for n, t in xt.items()}
    ro, _, _ = ref_forward(ref)
    tol = 1e-2 if dtype == "bfloat16" else 2e-3  # output rounding: 2^-8 (bf16), 2^-11 (fp16)
    assert rel_l2(o.double().numpy(), ro) < tol


@pytest.mark.parametrize("backend", ["oracle", "cpu"])
@pytest.mark.parametrize("case", [
    dict(B=1, T=5, HQ=2, H=1, K=8, V=8, gate=True, cu=None),
    dict(B=2, T=4, HQ=2, H=2, K=8, V=16, gate=False, cu=None),
    dict(B=1, T=6, HQ=2, H=2, K=8, V=8, gate=True, cu=[0, 2, 6]),
])
def test_gradcheck_float64(rng, backend, case):
    require_backend(backend)
    case = dict(case)
    cu = case.pop("cu")
    x = make_inputs(rng, dtype=np.float64, beta_range=(0.2, 1.8), **case)
    xt = to_torch(x, requires_grad=True)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    present = [n for n in NAMES if xt[n] is not None]

    def f(*args):
        d = dict(zip(present, args))
        o, _ = pathattn.parallel_path_attn(d["q"], d["k"], d["v"], d["w"], d["beta"], d.get("g"), scale=0.6,
                                           cu_seqlens=cu_t, gate_scale=0.8, backend=backend)
        return o

    # fast_mode checks J u for random u against finite differences (the full Jacobians of the same ops are
    # checked in test_backward.py); it keeps this test to a few seconds.
    assert torch.autograd.gradcheck(f, tuple(xt[n] for n in present), eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [False, True])
def test_opcheck_fwd_and_bwd(rng, dtype, gate):
    x = make_inputs(rng, 1, 6, 2, 1, 8, 8, gate=gate, dtype=np.float64 if dtype == torch.float64 else np.float32)
    xt = to_torch(x, requires_grad=True)
    scale = 8 ** -0.5
    args = (xt["q"], xt["k"], xt["v"], xt["w"], xt["beta"], xt["g"], None, scale, scale, False, 1, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_fwd.default, args)
    args_cache = args[:9] + (True,) + args[10:]
    torch.library.opcheck(torch.ops.pathattn.path_attn_fwd.default, args_cache)
    plain = {n: (t.detach() if t is not None else None) for n, t in xt.items()}
    o, lse, _ = torch.ops.pathattn.path_attn_fwd(plain["q"], plain["k"], plain["v"], plain["w"], plain["beta"],
                                                 plain["g"], None, scale, scale, False, 1, False)
    do = torch.randn_like(o)
    bargs = (do, plain["q"], plain["k"], plain["v"], plain["w"], plain["beta"], plain["g"], None, o, lse, scale,
             scale, 1, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_bwd.default, bargs)


def test_opcheck_varlen(rng):
    x = make_inputs(rng, 1, 9, 2, 2, 8, 8, gate=True)
    xt = to_torch(x, requires_grad=True)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int64)
    args = (xt["q"], xt["k"], xt["v"], xt["w"], xt["beta"], xt["g"], cu, 0.5, 0.5, False, 1, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_fwd.default, args)


class TinyPaTH(torch.nn.Module):
    """Projections around the op: what a model does, small enough to compile quickly."""

    def __init__(self, d=32, heads=2, kv_heads=1, backend="oracle"):
        super().__init__()
        self.h, self.hk, self.dk = heads, kv_heads, d // heads
        self.q = torch.nn.Linear(d, heads * self.dk, bias=False)
        self.k = torch.nn.Linear(d, kv_heads * self.dk, bias=False)
        self.v = torch.nn.Linear(d, kv_heads * self.dk, bias=False)
        self.w = torch.nn.Linear(d, kv_heads * self.dk, bias=False)
        self.b = torch.nn.Linear(d, kv_heads)
        self.gp = torch.nn.Linear(d, heads)
        self.o = torch.nn.Linear(heads * self.dk, d, bias=False)
        self.backend = backend

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.dk)
        k = self.k(x).view(B, T, self.hk, self.dk)
        v = self.v(x).view(B, T, self.hk, self.dk)
        w = torch.nn.functional.normalize(self.w(x).view(B, T, self.hk, self.dk).float(), dim=-1)
        beta = 2 * torch.sigmoid(self.b(x).float())
        g = torch.nn.functional.logsigmoid(self.gp(x).float())
        o, _ = pathattn.parallel_path_attn(q, k, v, w, beta, g, backend=self.backend)
        return self.o(o.reshape(B, T, -1))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(rng, compile_backend):
    # No on-disk compile caches: a cached graph must not stand in for the op's current registration.
    cfg = getattr(torch.compiler, "config", None)
    if cfg is not None and hasattr(cfg, "force_disable_caches"):
        with cfg.patch(force_disable_caches=True):
            compile_and_compare(compile_backend)
    else:
        compile_and_compare(compile_backend)


def compile_and_compare(compile_backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TinyPaTH()
    x = torch.randn(2, 10, 32)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, gr in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, gr, rtol=1e-4, atol=1e-6)


def test_zero_copy_and_strided_tensors(rng):
    base = torch.randn(2, 20, 4, 16)
    view = base[:, ::2, 1:3]
    d = pathattn._pathattn.describe(view)
    assert d["data"] == view.data_ptr()
    assert d["stride"] == tuple(view.stride()) and d["shape"] == tuple(view.shape)
    x = make_inputs(rng, 2, 10, 2, 2, 16, 8, gate=True)
    xt = to_torch(x)
    xt["q"] = view
    o, _ = run(xt, backend="oracle")
    o2, _ = run(dict(xt, q=view.contiguous()), backend="oracle")
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    # A non-contiguous last dimension is copied (fla makes inputs contiguous too), not rejected.
    qt = view.transpose(2, 3).contiguous().transpose(2, 3)
    assert qt.stride(-1) != 1
    o3, _ = run(dict(xt, q=qt), backend="oracle")
    torch.testing.assert_close(o3, o2, rtol=0, atol=0)


def test_partial_requires_grad_and_lse_not_differentiable(rng):
    x = make_inputs(rng, 1, 7, 2, 1, 8, 8, gate=True)
    xt = to_torch(x)
    xt["v"].requires_grad_(True)
    xt["g"].requires_grad_(True)
    o, _, lse = run(xt, backend="oracle", return_lse=True)
    assert not lse.requires_grad
    o.sum().backward()
    assert xt["v"].grad is not None and xt["g"].grad is not None and xt["q"].grad is None


@pytest.mark.parametrize("cu", [None, [0, 3, 11]])
def test_torch_use_cache(rng, cu):
    x = make_inputs(rng, 1 if cu else 2, 11, 2, 2, 8, 8, gate=True)
    o, k_cache = run(to_torch(x), backend="oracle", use_cache=True,
                     cu_seqlens=None if cu is None else torch.tensor(cu))
    _, _, rkc = ref_forward(x, cu_seqlens=cu)
    assert k_cache.dtype == torch.float32 and k_cache.is_contiguous()
    assert rel_l2(k_cache.numpy(), rkc) < 2e-5


def test_torch_decode(rng):
    x = make_inputs(rng, 2, 12, 2, 1, 8, 8, gate=True)
    xt = to_torch(x)
    try:
        o_pre, cache = pathattn.prefill(**{n: (t[:, :5] if t is not None else None) for n, t in xt.items()})
    except pathattn.BackendUnavailableError:
        pytest.skip("decode unavailable")
    assert isinstance(cache.kc, torch.Tensor)
    outs = [pathattn.decode_step(cache, **{n: (t[:, s:s + 1] if t is not None else None) for n, t in xt.items()})
            for s in range(5, 12)]
    o = torch.cat([o_pre] + outs, 1)
    assert rel_l2(o.numpy(), ref_forward(x)[0]) < 2e-5


def test_torch_bwd_function(rng):
    x = make_inputs(rng, 1, 8, 2, 2, 8, 8, gate=True)
    xt = to_torch(x)
    o, _, lse = run(xt, backend="oracle", return_lse=True)
    do = torch.randn_like(o)
    grads = pathattn.parallel_path_attn_bwd(xt["q"], xt["k"], xt["v"], xt["w"], xt["beta"], o, lse, do,
                                            g=xt["g"], backend="oracle")
    xr = to_torch(x, requires_grad=True)
    o2, _ = run(xr, backend="oracle")
    o2.backward(do)
    for n in NAMES:
        torch.testing.assert_close(getattr(grads, "d" + n), xr[n].grad)


def test_mixed_numpy_and_torch_is_a_type_error(rng):
    x = make_inputs(rng, 1, 4, 2, 2, 8, 8)
    xt = to_torch(x)
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor like q, got a numpy.ndarray"):
        run(dict(xt, k=x["k"]))
    with pytest.raises(TypeError, match=r"^cu_seqlens: expected a torch.Tensor"):
        run(dict(xt), cu_seqlens="x")
    with pytest.raises(TypeError, match=r"^w: expected dtype bfloat16, float16, float32 or float64, got int32"):
        run(dict(xt, w=xt["w"].to(torch.int32)), backend="oracle")


def test_cu_seqlens_as_a_python_list(rng):
    # Torch tensors with cu_seqlens given as a list of ints: the same as the int64 tensor.
    x = make_inputs(rng, 1, 12, 2, 2, 8, 8)
    xt = to_torch(x)
    o_list, _ = run(dict(xt), cu_seqlens=[0, 5, 12])
    o_tensor, _ = run(dict(xt), cu_seqlens=torch.tensor([0, 5, 12]))
    torch.testing.assert_close(o_list, o_tensor, rtol=0, atol=0)


def test_bf16_w_is_accepted_and_its_gradient_is_bf16(rng):
    # flash-linear-attention may pass w and beta in the model's dtype: same values, same results.
    x = make_inputs(rng, 1, 8, 2, 2, 8, 8, gate=True)
    xt = to_torch(x)
    xb = dict(xt, w=xt["w"].bfloat16().requires_grad_(), beta=xt["beta"].bfloat16().requires_grad_())
    o, _ = run(xb, backend="oracle")
    o_ref, _ = run(dict(xt, w=xb["w"].detach().float(), beta=xb["beta"].detach().float()), backend="oracle")
    assert torch.equal(o, o_ref)
    o.sum().backward()
    assert xb["w"].grad.dtype == torch.bfloat16 and xb["beta"].grad.dtype == torch.bfloat16
