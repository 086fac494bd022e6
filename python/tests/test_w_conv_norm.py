"""pathattn.nn.w_conv_norm (the w preparation op: short convolution, SiLU, per-head L2 norm) on the CPU: forward and
gradients against the layer's unfused modules (ShortConvolution + l2_norm) in float32 and float64, varlen with
empty sequences, gradcheck, opcheck and torch.compile through the op, argument errors, and the PaTH layer's output
and gradients with the op against the unfused path. Tolerances: docs/numerics.md, "The w preparation op"."""
import pytest

torch = pytest.importorskip("torch")

import pathattn  # noqa: E402
from pathattn.nn import PaTHAttention, ShortConvolution, l2_norm, w_conv_norm  # noqa: E402

TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=2e-6)}


def unfused(x, conv, head_dim, cu_seqlens):
    """The layer's composition the op replaces: ShortConvolution (SiLU) then l2_norm per head, as [B, T, D]."""
    B, T, D = x.shape
    if conv is not None:
        x, _ = conv(x, cu_seqlens=cu_seqlens)
    return l2_norm(x.view(B, T, D // head_dim, head_dim)).reshape(B, T, D)


def make_conv(D, W, bias, dtype, seed):
    torch.manual_seed(seed)
    conv = ShortConvolution(D, W, bias=bias, activation="silu", dtype=dtype)
    with torch.no_grad():
        conv.weight.copy_(0.6 * torch.randn_like(conv.weight))
        if bias:
            conv.bias.copy_(0.3 * torch.randn_like(conv.bias))
    return conv


def grads_of(fn, x, params, dout):
    x = x.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    out = fn(x)
    out.backward(dout)
    return out.detach(), x.grad, [p.grad.clone() for p in params]


CASES = [  # (B, T, D, head_dim, W, bias, cu_seqlens)
    (2, 13, 128, 64, 3, False, None),
    (2, 13, 128, 64, 2, True, None),
    (1, 17, 256, 128, 4, True, [0, 0, 5, 6, 6, 17]),
    (1, 9, 64, 16, 3, False, [0, 4, 4, 9]),
    (3, 1, 32, 32, 4, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", [None, "cpu", "oracle"])
def test_op_equals_unfused_modules(case, dtype, backend):
    B, T, D, hd, W, bias, cu = case
    if backend == "oracle" and dtype == torch.float32:
        pytest.skip("the oracle computes in fp64: compared in float64 only")
    conv = make_conv(D, W, bias, dtype, seed=T + D)
    cu_t = None if cu is None else torch.tensor(cu)
    x = torch.randn(B, T, D, dtype=dtype)
    dout = torch.randn(B, T, D, dtype=dtype)
    params = [conv.weight] + ([conv.bias] if bias else [])
    ref = grads_of(lambda t: unfused(t, conv, hd, cu_t), x, params, dout)
    got = grads_of(lambda t: w_conv_norm(t, conv.weight, conv.bias, head_dim=hd, cu_seqlens=cu_t, backend=backend),
                   x, params, dout)
    assert got[0].dtype == dtype
    torch.testing.assert_close(got[0], ref[0], **TOL[dtype])
    torch.testing.assert_close(got[1], ref[1], **TOL[dtype])
    for g, r in zip(got[2], ref[2]):
        torch.testing.assert_close(g, r, **TOL[dtype])


@pytest.mark.parametrize("activation", [False, True])
def test_norm_alone_without_weight(activation):
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    out = w_conv_norm(x, None, head_dim=16, activation=activation)
    a = torch.nn.functional.silu(x) if activation else x
    ref = l2_norm(a.view(2, 7, 3, 16)).reshape(2, 7, 48)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    dout = torch.randn_like(x)
    (g,) = torch.autograd.grad(out, x, dout)
    (gr,) = torch.autograd.grad(ref, x, dout)
    torch.testing.assert_close(g, gr, rtol=1e-12, atol=1e-12)


def test_gradcheck_float64():
    torch.manual_seed(3)
    x = torch.randn(1, 8, 8, dtype=torch.float64, requires_grad=True)
    w = (0.6 * torch.randn(8, 3, dtype=torch.float64)).requires_grad_()
    b = (0.3 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    cu = torch.tensor([0, 3, 3, 8])
    assert torch.autograd.gradcheck(lambda x, w, b: w_conv_norm(x, w, b, head_dim=4, cu_seqlens=cu), (x, w, b),
                                     eps=1e-6, atol=1e-8, rtol=1e-6)


def test_opcheck_and_compile():
    torch.manual_seed(4)
    x = torch.randn(2, 6, 32, requires_grad=True)
    w = torch.randn(32, 3, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    torch.library.opcheck(torch.ops.pathattn.w_conv_norm_fwd.default, (x, w, b, None, 16, True, 1e-6, 0))
    torch._dynamo.reset()

    def f(x, w, b):
        return w_conv_norm(x, w, b, head_dim=16).square().sum()

    ref = f(x, w, b)
    gref = torch.autograd.grad(ref, (x, w, b))
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
    gout = torch.autograd.grad(out, (x, w, b))
    torch.testing.assert_close(out, ref)
    for g, r in zip(gout, gref):
        torch.testing.assert_close(g, r)


def test_conv1d_weight_layout_and_bf16_output():
    conv = make_conv(64, 3, True, torch.float32, seed=1)
    x = torch.randn(1, 10, 64).to(torch.bfloat16)
    a = w_conv_norm(x, conv.weight, conv.bias, head_dim=32)           # nn.Conv1d's [D, 1, W]
    b = w_conv_norm(x, conv.weight[:, 0, :], conv.bias, head_dim=32)  # [D, W]
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # One rounding to bf16 of the fp32 result (the unfused path rounds the convolution's output to bf16 too).
    ref = w_conv_norm(x.float(), conv.weight, conv.bias, head_dim=32)
    torch.testing.assert_close(a.float(), ref, rtol=2 ** -8, atol=1e-6)


def test_errors_name_the_argument():
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match=r"^head_dim:"):
        w_conv_norm(x, None, head_dim=12)
    with pytest.raises(ValueError, match=r"^x:"):
        w_conv_norm(torch.randn(4, 32), None, head_dim=16)
    with pytest.raises(ValueError, match=r"^weight:"):
        w_conv_norm(x, torch.randn(31, 3), head_dim=16)
    with pytest.raises(ValueError, match=r"^bias:"):
        w_conv_norm(x, None, torch.randn(32), head_dim=16)
    with pytest.raises(ValueError, match=r"^cu_seqlens:"):
        w_conv_norm(x, torch.randn(32, 3), head_dim=16, cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(TypeError, match=r"^x:"):
        w_conv_norm(x.to(torch.int32), None, head_dim=16)


LAYER_CFGS = [dict(), dict(conv_bias=True, conv_size=4, num_kv_heads=2), dict(use_w_shortconv=False)]


@pytest.mark.parametrize("cfg", LAYER_CFGS)
def test_layer_with_op_equals_unfused_layer(cfg, monkeypatch):
    torch.manual_seed(0)
    layer = PaTHAttention(hidden_size=64, num_heads=4, **cfg)
    x = torch.randn(1, 15, 64)
    cu = torch.tensor([0, 6, 6, 15])
    dy = torch.randn(1, 15, 64)

    def run():
        layer.zero_grad()
        xx = x.clone().requires_grad_(True)
        y, _, _ = layer(xx, cu_seqlens=cu)
        y.backward(dy)
        return y.detach(), xx.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    fused = run()
    monkeypatch.setattr(PaTHAttention, "_fused_w", lambda self, w: False)
    ref = run()
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=1e-6)
    for n in ref[2]:
        torch.testing.assert_close(fused[2][n], ref[2][n], rtol=1e-4, atol=1e-6, msg=n)


def test_layer_bf16_with_op_close_to_unfused_layer(monkeypatch):
    # The op rounds w to bf16 once at its end; the unfused path rounds the convolution's output to bf16 and keeps
    # the normalised w in fp32: both within bf16 rounding of each other.
    torch.manual_seed(1)
    layer = PaTHAttention(hidden_size=128, num_heads=2, dtype=torch.bfloat16)
    x = torch.randn(2, 24, 128, dtype=torch.bfloat16)
    y = layer(x)[0].float()
    monkeypatch.setattr(PaTHAttention, "_fused_w", lambda self, w: False)
    ref = layer(x)[0].float()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


def test_prefill_uses_the_training_w():
    torch.manual_seed(2)
    layer = PaTHAttention(hidden_size=64, num_heads=4, conv_size=4, dtype=torch.bfloat16).eval()
    x = torch.randn(2, 11, 64, dtype=torch.bfloat16)
    try:
        y_pre, state = layer.prefill(x)
    except pathattn.BackendUnavailableError:
        pytest.skip("prefill is unavailable in this build")
    y = layer(x)[0]
    torch.testing.assert_close(y_pre.float(), y.float(), rtol=2e-2, atol=2e-3)
    _, ref_state = layer.w_conv1d(layer._project(x)[3], output_final_state=True)
    assert torch.equal(state.conv_state, ref_state)
