"""pathattn.nn.PaTHAttention on the CPU: parameter names and shapes of fla's layer, the forward against an
independent float64 re-implementation (torch conv1d + the numpy definition of the op), varlen and padding
masks, gradients, torch.compile, and prefill + decode steps against the full forward."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import pathattn  # noqa: E402
from pathattn.nn import PaTHAttention, PaTHAttentionState  # noqa: E402
from conftest import ref_forward, rel_l2  # noqa: E402

HID, HEADS = 64, 4  # head_dim 16


def fla_param_shapes(hidden, heads, num_kv_heads=None, use_forget_gate=False, use_qk_norm=False, use_low_rank_w=True,
                     use_w_shortconv=True, conv_size=3, conv_bias=False):
    """The state_dict of fla.layers.PaTHAttention(...) with these arguments: names and shapes."""
    kv = heads if num_kv_heads is None else num_kv_heads
    d = hidden // heads
    s = {"q_proj.weight": (hidden, hidden), "k_proj.weight": (kv * d, hidden), "v_proj.weight": (kv * d, hidden)}
    if use_low_rank_w:
        s.update({"w_proj.0.weight": (32, hidden), "w_proj.1.weight": (kv * d, 32)})
    else:
        s["w_proj.weight"] = (kv * d, hidden)
    if use_qk_norm:
        s.update({"maybe_q_norm.weight": (d,), "maybe_k_norm.weight": (d,)})
    if use_w_shortconv:
        s["w_conv1d.weight"] = (kv * d, 1, conv_size)
        if conv_bias:
            s["w_conv1d.bias"] = (kv * d,)
    s.update({"bt_proj.weight": (kv, hidden), "bt_proj.bias": (kv,)})
    if use_forget_gate:
        s.update({"g_proj.weight": (heads, hidden), "g_proj.bias": (heads,)})
    s["o_proj.weight"] = (hidden, hidden)
    return s


CONFIGS = [
    dict(),
    dict(num_kv_heads=2, use_low_rank_w=False, use_forget_gate=True),
    dict(use_qk_norm=True, use_forget_gate=True, conv_bias=True, conv_size=4),
    dict(use_w_shortconv=False, num_kv_heads=1),
]


def make_layer(cfg, backend="oracle", seed=0):
    torch.manual_seed(seed)
    layer = PaTHAttention(hidden_size=HID, num_heads=HEADS, backend=backend, **cfg)
    with torch.no_grad():  # non-trivial norms, biases and gates
        for name, p in layer.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return layer


def ref_layer(layer, x):
    """Float64 re-implementation from docs/spec.md, section 4 for one unpadded sequence batch x [B, T, hidden]."""
    sd = {k: v.detach().double() for k, v in layer.state_dict().items()}
    x = x.detach().double()
    B, T, _ = x.shape
    H, HQ, D = layer.num_kv_heads, layer.num_heads, layer.head_dim
    lin = lambda name, y: y @ sd[name + ".weight"].T + (sd[name + ".bias"] if name + ".bias" in sd else 0)  # noqa
    q, k, v = lin("q_proj", x), lin("k_proj", x), lin("v_proj", x)
    w = lin("w_proj.1", lin("w_proj.0", x)) if "w_proj.0.weight" in sd else lin("w_proj", x)
    if "w_conv1d.weight" in sd:
        W = sd["w_conv1d.weight"].shape[-1]
        w = F.conv1d(w.transpose(1, 2), sd["w_conv1d.weight"], sd.get("w_conv1d.bias"), padding=W - 1,
                     groups=w.shape[-1])[..., :T].transpose(1, 2)
        w = F.silu(w)
    q, k, v, w = q.view(B, T, HQ, D), k.view(B, T, H, D), v.view(B, T, H, D), w.view(B, T, H, D)
    if "maybe_q_norm.weight" in sd:
        rms = lambda y, wt: y / torch.sqrt(y.square().mean(-1, keepdim=True) + 1e-5) * wt  # noqa
        q, k = rms(q, sd["maybe_q_norm.weight"]), rms(k, sd["maybe_k_norm.weight"])
    w = w / torch.sqrt(w.square().sum(-1, keepdim=True) + 1e-6)
    beta = 2 * torch.sigmoid(lin("bt_proj", x))
    g = F.logsigmoid(lin("g_proj", x)) if "g_proj.weight" in sd else None
    inp = {"q": q, "k": k, "v": v, "w": w, "beta": beta, "g": g}
    o, _, _ = ref_forward({n: (None if t is None else t.numpy()) for n, t in inp.items()})
    return (torch.from_numpy(o).reshape(B, T, -1) @ sd["o_proj.weight"].T)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_state_dict_matches_fla_layout(cfg):
    layer = PaTHAttention(hidden_size=HID, num_heads=HEADS, **cfg)
    got = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert got == fla_param_shapes(HID, HEADS, **cfg)
    # An fla-shaped state_dict loads strictly.
    sd = {k: torch.randn(s) for k, s in fla_param_shapes(HID, HEADS, **cfg).items()}
    layer.load_state_dict(sd, strict=True)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("backend", ["oracle", "cpu"])
def test_forward_matches_reference(cfg, backend):
    if not pathattn.backend_available(backend):
        pytest.skip(f"backend {backend} unavailable")
    layer = make_layer(cfg, backend)
    x = torch.randn(2, 19, HID)
    y, none1, none2 = layer(x)
    assert none1 is None and none2 is None and y.shape == x.shape
    assert rel_l2(y.detach().numpy(), ref_layer(layer, x).numpy()) < 1e-4


@pytest.mark.parametrize("cfg", CONFIGS[1:3])
def test_varlen_and_padding_mask(cfg):
    layer = make_layer(cfg)
    lens = [5, 1, 12]
    xs = [torch.randn(1, L, HID) for L in lens]
    refs = [layer(x)[0] for x in xs]
    y, _, _ = layer(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 5, 6, 18]))
    torch.testing.assert_close(y, torch.cat(refs, 1), rtol=1e-4, atol=1e-5)
    # Left padding with an attention mask.
    T = max(lens)
    x = torch.zeros(3, T, HID)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, (xi, L) in enumerate(zip(xs, lens)):
        x[i, T - L:] = xi[0]
        mask[i, T - L:] = 1
    y, _, _ = layer(x, attention_mask=mask)
    for i, (r, L) in enumerate(zip(refs, lens)):
        torch.testing.assert_close(y[i, T - L:], r[0], rtol=1e-4, atol=1e-5)
        assert torch.all(y[i, :T - L] == 0)


def test_gradients_reach_every_parameter():
    layer = make_layer(dict(use_forget_gate=True, use_qk_norm=True, conv_bias=True))
    x = torch.randn(2, 9, HID, requires_grad=True)
    layer(x)[0].square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name
    assert x.grad is not None


def test_layer_gradcheck_float64():
    layer = make_layer(dict(use_forget_gate=True, num_kv_heads=2, use_low_rank_w=False)).double()
    x = torch.randn(1, 5, HID, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t)[0], (x,), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_layer_compiles_fullgraph():
    torch._dynamo.reset()
    layer = make_layer(dict(use_forget_gate=True))
    x = torch.randn(2, 8, HID)
    ref = layer(x)[0]
    out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def require_decode():
    try:
        PaTHAttention(hidden_size=16, num_heads=2, backend=None).prefill(torch.zeros(1, 1, 16))
    except pathattn.BackendUnavailableError:
        pytest.skip("prefill / decode are unavailable in this build")


@pytest.mark.parametrize("cfg", CONFIGS)
def test_prefill_and_steps_equal_forward(cfg):
    require_decode()
    layer = make_layer(cfg, backend=None).eval()
    B, P, T = 2, 7, 16
    x = torch.randn(B, T, HID)
    full, _, _ = layer(x)
    y_pre, _, state = layer(x[:, :P], use_cache=True)
    assert isinstance(state, PaTHAttentionState)
    steps = [layer(x[:, t:t + 1], past_key_values=state, use_cache=True)[0] for t in range(P, T)]
    y = torch.cat([y_pre] + steps, 1)
    assert rel_l2(y.numpy(), full.detach().numpy()) < 1e-4


def test_prefill_left_padded_then_steps():
    require_decode()
    cfg = dict(use_forget_gate=True, use_qk_norm=True, conv_size=4)
    layer = make_layer(cfg, backend=None).eval()
    lens, steps = [3, 8], 5
    seqs = [torch.randn(1, L + steps, HID) for L in lens]
    fulls = [layer(s)[0] for s in seqs]
    P = max(lens)
    x = torch.zeros(2, P, HID)
    mask = torch.zeros(2, P, dtype=torch.long)
    for i, (s, L) in enumerate(zip(seqs, lens)):
        x[i, P - L:] = s[0, :L]
        mask[i, P - L:] = 1
    y_pre, state = layer.prefill(x, attention_mask=mask)
    outs = [layer.step(torch.cat([s[:, L + t:L + t + 1] for s, L in zip(seqs, lens)]), state) for t in range(steps)]
    for i, (f, L) in enumerate(zip(fulls, lens)):
        assert rel_l2(y_pre[i, P - L:].numpy(), f[0, :L].detach().numpy()) < 1e-4
        dec = torch.cat([o[i] for o in outs], 0)
        assert rel_l2(dec.numpy(), f[0, L:].detach().numpy()) < 1e-4


def test_step_argument_errors():
    require_decode()
    layer = make_layer({}, backend=None).eval()
    _, state = layer.prefill(torch.randn(1, 4, HID))
    with pytest.raises(ValueError, match=r"^hidden_states: expected \[N, 1, hidden\]"):
        layer.step(torch.randn(1, 2, HID), state)
