"""GPU tests (skipped without a CUDA device and a CUDA build): parity with flash-linear-attention itself
(op outputs and every gradient; an fla PaTHAttention layer's state_dict loaded into ours), opcheck and
torch.compile on CUDA tensors, decode on the GPU (the models' generate() with the paged cache too), zero-copy of
CUDA tensors.

Bars (issue 4): relative L2 <= 5e-3 on o and <= 2e-2 on every gradient against fla's parallel_path_attn
(bf16, T = 2048, K = 128, GQA 4:1, gate on); the loaded layer's output within 5e-3 of fla's.
To run fla's side, install the fla-core wheel on the GPU machine (pip install flash-linear-attention)."""
import pytest

torch = pytest.importorskip("torch")

import pathattn  # noqa: E402
from conftest import rel_l2, same_greedy_tokens  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and pathattn.backend_available("cuda")),
                                reason="needs a CUDA device and a pathattn build with the CUDA backend")


def rl2(a, b):
    return rel_l2(a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy())


def fla_op():
    pytest.importorskip("fla")
    try:
        from fla.ops.path_attn.parallel import parallel_path_attn as f
    except ImportError:
        from fla.ops import parallel_path_attn as f
    return f


def gpu_inputs(B=2, T=2048, HQ=8, H=2, K=128, V=128, gate=True, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(B, T, HQ, K, device=dev, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype)
    v = torch.randn(B, T, H, V, device=dev, generator=gen).to(dtype)
    w = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1)
    beta = 1.5 + 0.5 * torch.rand(B, T, H, device=dev, generator=gen)
    g = torch.log(0.95 + 0.05 * torch.rand(B, T, HQ, device=dev, generator=gen)) if gate else None
    return {"q": q, "k": k, "v": v, "w": w, "beta": beta, "g": g}


def fwd_bwd(fn, x, do):
    xs = {n: (None if t is None else t.detach().clone().requires_grad_(True)) for n, t in x.items()}
    o, _ = fn(xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], xs["g"])
    o.backward(do)
    return o, {n: t.grad for n, t in xs.items() if t is not None}


@pytest.mark.parametrize("gate", [True, False])
def test_parity_with_fla(gate):
    fla_fn = fla_op()
    x = gpu_inputs(gate=gate)
    do = torch.rand(2, 2048, 8, 128, device="cuda").to(torch.bfloat16)
    o_ref, g_ref = fwd_bwd(fla_fn, x, do)
    o, grads = fwd_bwd(pathattn.parallel_path_attn, x, do)
    errs = {"o": rl2(o, o_ref), **{"d" + n: rl2(grads[n], g_ref[n]) for n in g_ref}}
    print(f"[fla parity] gate={gate} " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert errs["o"] <= 5e-3
    for n in g_ref:
        assert errs["d" + n] <= 2e-2, n


def test_use_cache_parity_with_fla():
    fla_fn = fla_op()
    x = gpu_inputs(B=1, T=512)
    o_ref, kc_ref = fla_fn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")), use_cache=True)
    o, kc = pathattn.parallel_path_attn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")), use_cache=True)
    # Both caches are rounded to bf16 (k's dtype, as fla returns it); compare each with the fp64 truth.
    x64 = {n: t.double().cpu() for n, t in x.items()}
    _, kc64 = pathattn.parallel_path_attn(*(x64[n] for n in ("q", "k", "v", "w", "beta", "g")), use_cache=True,
                                          backend="oracle")
    e_ours, e_fla = rl2(kc, kc64), rl2(kc_ref, kc64)
    print(f"[fla use_cache] o vs fla {rl2(o, o_ref):.2e}; k_cache vs fp64: ours {e_ours:.2e}, fla {e_fla:.2e}")
    assert rl2(o, o_ref) <= 5e-3
    assert e_ours <= 4e-3 and e_ours <= e_fla


def test_cuda_matches_cpu_oracle_bf16():
    x = gpu_inputs(B=1, T=300, HQ=4, H=1, K=64, V=64, dtype=torch.bfloat16)
    o, _ = pathattn.parallel_path_attn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))
    xc = {n: t.double().cpu() for n, t in x.items()}
    o64, _ = pathattn.parallel_path_attn(*(xc[n] for n in ("q", "k", "v", "w", "beta", "g")), backend="oracle")
    assert rl2(o, o64) < 4e-3


@pytest.mark.parametrize("K,V", [(16, 16), (32, 64)])
def test_small_head_dims_on_cuda_match_cpu(K, V):
    # Head dims 16 and 32 run at 64 on zero-padded copies inside the op: against the cpu backend, o and every
    # gradient, with GQA and the gate.
    x = gpu_inputs(B=2, T=300, HQ=4, H=2, K=K, V=V)
    do = torch.randn(2, 300, 4, V, device="cuda").to(torch.bfloat16)
    o, grads = fwd_bwd(pathattn.parallel_path_attn, x, do)
    cpu = lambda *a: pathattn.parallel_path_attn(*a, backend="cpu")  # noqa: E731
    xc = {n: None if t is None else t.double().cpu() for n, t in x.items()}
    o_ref, g_ref = fwd_bwd(cpu, xc, do.double().cpu())
    assert o.shape == o_ref.shape and rl2(o, o_ref) <= 5e-3
    for n in g_ref:
        assert grads[n].shape == g_ref[n].shape
        assert rl2(grads[n], g_ref[n]) <= 2e-2, n


def test_workspace_limit_slices_give_the_same_results():
    # A 1-byte limit runs every call in (batch row, kv head) slices; deterministic gradients and the forward
    # are bitwise those of one unsliced call.
    x = gpu_inputs(B=2, T=700, HQ=4, H=2, K=64, V=64, gate=True, seed=3)
    do = torch.rand(2, 700, 4, 64, device="cuda").to(torch.bfloat16)

    def run():
        xs = {n: (None if t is None else t.detach().clone().requires_grad_(True)) for n, t in x.items()}
        o, _ = pathattn.parallel_path_attn(xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], xs["g"],
                                           deterministic=True)
        o.backward(do)
        return o, {n: t.grad for n, t in xs.items() if t is not None}
    try:
        pathattn.set_workspace_limit(-1)
        o_full, g_full = run()
        pathattn.set_workspace_limit(1)
        o_sl, g_sl = run()
    finally:
        pathattn.set_workspace_limit(0)
    assert torch.equal(o_full, o_sl)
    for n in g_full:
        assert torch.equal(g_full[n], g_sl[n]), n


def test_cuda_rejects_float32_clearly():
    # The CUDA kernels are built for bf16 / fp16 q, k, v (README, python/README.md); fp32 must be refused
    # with an error naming q, never computed silently in another precision.
    x = gpu_inputs(B=1, T=64, HQ=2, H=1, K=64, V=64, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=r"^q: dtype float32"):
        pathattn.parallel_path_attn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))


def test_opcheck_and_compile_on_cuda():
    x = gpu_inputs(B=1, T=64, HQ=4, H=2, K=64, V=64)
    xs = {n: t.detach().requires_grad_(True) for n, t in x.items()}
    args = (xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], xs["g"], None, 0.125, 0.125, False, 0, False)
    torch.library.opcheck(torch.ops.pathattn.path_attn_fwd.default, args)

    def f(q, k, v, w, beta, g):
        o, _ = pathattn.parallel_path_attn(q, k, v, w, beta, g)
        return o.float().square().sum()

    ref = f(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))
    out = torch.compile(f, fullgraph=True)(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_runs_on_current_stream():
    x = gpu_inputs(B=1, T=256, HQ=4, H=1, K=64, V=64)
    ref, _ = pathattn.parallel_path_attn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o, _ = pathattn.parallel_path_attn(*(x[n] for n in ("q", "k", "v", "w", "beta", "g")))
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_zero_copy_cuda():
    t = torch.zeros(2, 8, 4, 16, device="cuda")[:, ::2]
    d = pathattn._pathattn.describe(t)
    assert d["device"] == "cuda" and d["data"] == t.data_ptr() and d["stride"] == tuple(t.stride())


def test_decode_on_cuda_equals_forward():
    """Prefill 150 tokens on the GPU, then decode 50 more one at a time (the cache grows once on the way):
    every output against one fp64 oracle forward over all 200 tokens, and the device cache against the same
    calls on the CPU backend. bf16 inputs: the cuda backend takes bfloat16 / float16 q, k, v."""
    x = gpu_inputs(B=2, T=200, HQ=4, H=1, K=64, V=64)
    names = ("q", "k", "v", "w", "beta", "g")
    xc = {n: t.double().cpu() for n, t in x.items()}
    full, _ = pathattn.parallel_path_attn(*(xc[n] for n in names), backend="oracle")
    o_pre, cache = pathattn.prefill(*(x[n][:, :150] for n in names), capacity=160)
    assert cache.kc.device.type == "cuda" and cache.kc.dtype == torch.float32
    assert cache.vc.device.type == "cuda" and cache.vc.dtype == torch.float32
    assert cache.gc.device.type == "cuda" and cache.gc.dtype == torch.float64
    outs = [pathattn.decode_step(cache, *(x[n][:, t:t + 1] for n in names)) for t in range(150, 200)]
    assert cache.lengths.tolist() == [200, 200] and cache.capacity >= 200
    assert outs[0].device.type == "cuda" and outs[0].dtype == torch.bfloat16
    e = rl2(torch.cat([o_pre] + outs, 1), full)

    xh = {n: t.cpu() for n, t in x.items()}
    _, cache_c = pathattn.prefill(*(xh[n][:, :150] for n in names), backend="cpu")
    outs_c = [pathattn.decode_step(cache_c, *(xh[n][:, t:t + 1] for n in names)) for t in range(150, 200)]
    ek = rl2(cache.kc[:, :, :200], cache_c.kc[:, :, :200])
    eg = rl2(cache.gc[:, :, :200], cache_c.gc[:, :, :200])
    eo = rl2(torch.cat(outs, 1), torch.cat(outs_c, 1))
    print(f"[decode cuda] o vs oracle {e:.2e}; vs cpu decode: o {eo:.2e}, kc {ek:.2e}, gc {eg:.2e}")
    assert e <= 4e-3
    assert eo <= 4e-3 and ek <= 1e-5 and eg <= 1e-12


def test_fla_layer_state_dict_loads_and_matches():
    pytest.importorskip("fla.layers")  # flash-linear-attention (fla-core alone has no layers)
    from fla.layers import PaTHAttention as FlaPaTH

    from pathattn.nn import PaTHAttention

    torch.manual_seed(0)
    for cfg in (dict(), dict(use_forget_gate=True, num_kv_heads=2, use_low_rank_w=False)):
        ref = FlaPaTH(hidden_size=1024, num_heads=8, **cfg).cuda().to(torch.bfloat16)
        ours = PaTHAttention(hidden_size=1024, num_heads=8, **cfg).cuda().to(torch.bfloat16)
        ours.load_state_dict(ref.state_dict(), strict=True)
        x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
        e = rl2(ours(x)[0], ref(x)[0])
        print(f"[fla layer] {cfg or 'default'}: o rel L2 {e:.2e}")
        assert e <= 5e-3


# flash-linear-attention's PaTH op cases on the GPU with w and beta in the model's dtype (bf16; fp16 varlen)
# and an fp32 g: every output and gradient within its tolerances of the fp32 cpu backend on the same values,
# gradients in the dtype of their input (test_param_dtypes.py runs the same cases on the CPU).
from test_param_dtypes import FIXED, TOL_FIXED, VARLEN, err_ratio  # noqa: E402


def gpu_case(dtype, B, T, H, HQ, K, gate, beta_fn, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    return {
        "q": torch.randn(B, T, HQ, K, device=dev, generator=gen).to(dtype),
        "k": torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype),
        "v": torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype),
        "w": torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1).to(dtype),
        "beta": beta_fn((B, T, H), gen).to(dtype),
        "g": torch.log(0.95 + 0.05 * torch.rand(B, T, HQ, device=dev, generator=gen)) if gate else None,
    }


def check_gpu_against_cpu_fp32(x, do, tol, **kw):
    def grads(xx, d, **k2):
        xs = {n: (None if t is None else t.detach().clone().requires_grad_(True)) for n, t in xx.items()}
        o, _ = pathattn.parallel_path_attention(xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], xs["g"], **k2)
        o.backward(d)
        return o, {n: t.grad for n, t in xs.items() if t is not None}

    o, g = grads(x, do, **kw)
    kw_cpu = {n: (v.cpu() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    o_ref, g_ref = grads({n: (None if t is None else t.float().cpu()) for n, t in x.items()}, do.float().cpu(),
                         backend="cpu", **kw_cpu)
    errs = {"o": err_ratio(o_ref, o.cpu())}
    for n, gr in g.items():
        assert gr.dtype == x[n].dtype and gr.device.type == "cuda", n
        errs[n] = err_ratio(g_ref[n], gr.cpu())
    print("[fla op cases, cuda] " + " ".join(f"{'d' + n if n != 'o' else n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < tol[n], f"{n}: error ratio {e:.3e} >= {tol[n]}"


@pytest.mark.parametrize("B,T,H,HQ,K,gate", FIXED)
def test_fla_op_cases_bf16_params(B, T, H, HQ, K, gate):
    x = gpu_case(torch.bfloat16, B, T, H, HQ, K, gate,
                 lambda s, gen: 1.5 + 0.5 * torch.rand(s, device="cuda", generator=gen), B * 1000 + T)
    do = torch.rand(B, T, HQ, K, device="cuda").to(torch.bfloat16)
    check_gpu_against_cpu_fp32(x, do, TOL_FIXED, scale=K ** -0.5)


@pytest.mark.parametrize("H,HQ,K,gate,cu", VARLEN)
def test_fla_op_varlen_cases_fp16_params(H, HQ, K, gate, cu):
    x = gpu_case(torch.float16, 1, cu[-1], H, HQ, K, gate,
                 lambda s, gen: torch.rand(s, device="cuda", generator=gen).sigmoid(), cu[-1] + K)
    do = torch.randn(1, cu[-1], HQ, K, device="cuda").to(torch.float16)
    check_gpu_against_cpu_fp32(x, do, dict.fromkeys(TOL_FIXED, 0.005), scale=K ** -0.5,
                               cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"))


def test_fla_layer_with_our_op_patched_in(monkeypatch):
    """fla's own PaTHAttention layer with its parallel_path_attn(ention) replaced by ours: the layer's output and
    every gradient (input and parameters) against the same layer on fla's kernel, same weights and input."""
    pytest.importorskip("fla.layers")
    import sys

    from fla.layers import PaTHAttention as FlaPaTH

    torch.manual_seed(0)
    for cfg in (dict(), dict(use_forget_gate=True, num_kv_heads=2, use_low_rank_w=False)):
        layer = FlaPaTH(hidden_size=1024, num_heads=8, **cfg).cuda().to(torch.bfloat16)
        x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)

        def run():
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = layer(xi)[0]
            y.backward(dy)
            return y.detach(), [xi.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]

        y_ref, g_ref = run()
        mod = sys.modules[FlaPaTH.__module__]
        with monkeypatch.context() as m:
            patched = [n for n in ("parallel_path_attn", "parallel_path_attention") if hasattr(mod, n)]
            assert patched, "fla's layer module calls no parallel_path_attn(ention) this test knows"
            for n in patched:
                m.setattr(mod, n, pathattn.parallel_path_attention)
            y, g = run()
        eo = rl2(y, y_ref)
        eg = max(rl2(a, b) for a, b in zip(g, g_ref))
        print(f"[fla layer, our op patched in] {cfg or 'default'}: o {eo:.2e}, worst gradient {eg:.2e}")
        assert eo <= 5e-3
        assert eg <= 2e-2


# pathattn.models against flash-linear-attention's PaTH model classes (needs transformers and the
# flash-linear-attention wheel): a checkpoint saved by either loads strictly into the other and gives the
# same logits (bf16, hidden 512, two layers; bar: relative L2 <= 2e-2 on the logits).
MODEL_CASES = [dict(num_heads=4), dict(num_heads=8, num_kv_heads=2, use_forget_gate=True, use_low_rank_w=False)]


def fla_models():
    pytest.importorskip("transformers")
    pytest.importorskip("fla.models")
    from fla.models.path_attn import PaTHAttentionConfig, PaTHAttentionForCausalLM
    return PaTHAttentionConfig, PaTHAttentionForCausalLM


def perturbed(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():  # non-trivial norms and biases (both inits leave them at 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.cuda().to(torch.bfloat16).eval()


def no_key_problems(info):
    return not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


@pytest.mark.parametrize("case", MODEL_CASES)
def test_fla_model_checkpoints_load_both_ways(case, tmp_path):
    FlaConfig, FlaLM = fla_models()
    from pathattn.models import PaTHForCausalLM

    cfg = dict(hidden_size=512, num_hidden_layers=2, vocab_size=1000, initializer_range=0.05, **case)
    torch.manual_seed(0)
    theirs = perturbed(FlaLM(FlaConfig(**cfg)), 1)
    theirs.save_pretrained(tmp_path / "fla")
    ours, info = PaTHForCausalLM.from_pretrained(tmp_path / "fla", output_loading_info=True)
    assert no_key_problems(info), info
    ours = ours.cuda().to(torch.bfloat16).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ids = torch.randint(0, 1000, (2, 512), device="cuda")
    with torch.no_grad():
        e = rl2(ours(ids, use_cache=False).logits, theirs(ids, use_cache=False).logits)

    mine = perturbed(PaTHForCausalLM(ours.config), 2)
    mine.save_pretrained(tmp_path / "ours")
    back, info = FlaLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert no_key_problems(info), info
    back = back.cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        e2 = rl2(back(ids, use_cache=False).logits, mine(ids, use_cache=False).logits)
    print(f"[fla model] {case}: logits rel L2, fla checkpoint in ours {e:.2e}, ours in fla {e2:.2e}")
    assert e <= 2e-2 and e2 <= 2e-2


@pytest.mark.parametrize("dense", [False, True])
def test_model_decode_on_cuda_equals_forward(dense):
    """pathattn.models on the GPU without fla: a 200-token prompt through the cache, 16 decode steps, against
    one forward over all 216 tokens (bf16 logits; relative L2 <= 1e-2)."""
    pytest.importorskip("transformers")
    from pathattn.models import PaTHCache, PaTHConfig, PaTHForCausalLM

    torch.manual_seed(0)
    cfg = PaTHConfig(hidden_size=512, num_hidden_layers=2, num_heads=8, num_kv_heads=2, use_forget_gate=True,
                     vocab_size=1000, initializer_range=0.05)
    m = perturbed(PaTHForCausalLM(cfg), 3)
    ids = torch.randint(0, 1000, (2, 216), device="cuda")
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits
        cache = PaTHCache(dense=dense)
        parts = [m(ids[:, :200], cache=cache, use_cache=True).logits]
        parts += [m(ids[:, t:t + 1], cache=cache).logits for t in range(200, 216)]
    e = rl2(torch.cat(parts, 1), ref)
    print(f"[model decode cuda] dense={dense}: logits rel L2 {e:.2e}")
    assert e <= 1e-2


# Bars of the paged cache's generate() against the PathCache's, in units of the model dtype's unit roundoff u
# (bf16 2^-8, fp16 2^-11): every activation of either run is rounded to it, so two runs whose attention differs by
# anything (here the f16 rounding of the keys) differ in their logits by a few u. Measured with this model on the
# CPU backend (48 steps): bf16 9.1e-3 .. 9.4e-3 (2.4u), fp16 1.35e-3 .. 1.48e-3 (3.0u); the bar is 5u.
GENERATE_BAR = {torch.bfloat16: 5 * 2.0 ** -8, torch.float16: 5 * 2.0 ** -11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate", [False, True])
def test_model_generate_paged_on_cuda(gate, dtype):
    """generate() on the GPU with the paged cache (f16 key pages, pending 8: a flush every 8 steps; pages of 16)
    against the PathCache: three left-padded prompts (150, 37 and 90 tokens), 48 new tokens. The same greedy
    tokens, but at ties closer than twice the bar times the step's largest |logit| (bf16 logits tie often: their
    spacing is 2^-8 of their size); logits within GENERATE_BAR where the contexts agree. PaTHCache() on CUDA is
    paged exactly when pathattn.models.cache.PAGED_ON_CUDA is set."""
    pytest.importorskip("transformers")
    from pathattn.models import PagedAttentionState, PaTHCache, PaTHConfig, PaTHForCausalLM
    from pathattn.models.cache import PAGED_ON_CUDA

    torch.manual_seed(0)
    cfg = PaTHConfig(hidden_size=512, num_hidden_layers=2, num_heads=8, num_kv_heads=2, use_forget_gate=gate,
                     vocab_size=1000, initializer_range=0.05)
    m = perturbed(PaTHForCausalLM(cfg), 4).to(dtype)
    lens, steps = [150, 37, 90], 48
    T = max(lens)
    ids = torch.zeros(3, T, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, L in enumerate(lens):
        ids[i, T - L:] = torch.randint(3, 1000, (L,), device="cuda")
        mask[i, T - L:] = 1

    def generate(cache):
        out = m.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0, past_key_values=cache, output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits, 1).float()

    default, path, paged = PaTHCache(), PaTHCache(paged=False), PaTHCache(paged=True, pending=8)
    generate(default)
    want, ref = generate(path)
    got, logits = generate(paged)
    assert all(isinstance(s, PagedAttentionState) for s in paged.layers)
    assert all(isinstance(s, PagedAttentionState) == PAGED_ON_CUDA for s in default.layers)
    assert not any(isinstance(s, PagedAttentionState) for s in path.layers)
    bar = GENERATE_BAR[dtype]
    same = same_greedy_tokens(got, want, ref, T, 2 * bar)
    e = rl2(logits[same], ref[same])
    flushed = paged.layers[0].cache.flushed.tolist()
    print(f"[model generate cuda] {dtype}, gate={gate}: paged vs PathCache tokens equal {torch.equal(got, want)}, "
          f"logits rel L2 {e:.2e} (bar {bar:.2e}); flushed {flushed}")
    assert e <= bar
    assert all(f - L >= 40 for f, L in zip(flushed, lens))  # five flushes or more since each prompt


# -- the w preparation op (pathattn.nn.w_conv_norm) on the device against the CPU backend ------------------------------

def _wcn_case(D, W, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (0.6 * torch.randn(D, 1, W, generator=gen)).to(dtype) if W else None
    b = (0.3 * torch.randn(D, generator=gen)).to(dtype) if W and bias else None
    return weight, b


def _wcn_run(x, weight, bias, head_dim, cu, dout, activation=True):
    xs = x.detach().clone().requires_grad_(True)
    ps = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (weight, bias)]
    out = pathattn.nn.w_conv_norm(xs, ps[0], ps[1], head_dim=head_dim, cu_seqlens=cu, activation=activation)
    out.backward(dout)
    return out.detach(), xs.grad, ps[0].grad if ps[0] is not None else None, ps[1].grad if ps[1] is not None else None


WCN_GPU_CASES = [  # (B, T, D, head_dim, W, bias, cu_seqlens)
    (2, 333, 2048, 128, 3, False, None),
    (1, 700, 512, 64, 4, True, [0, 0, 1, 64, 65, 65, 400, 700]),
    (1, 129, 256, 256, 2, True, [0, 100, 129]),
    (3, 65, 96, 32, 3, False, None),
    (1, 90, 48, 16, 4, True, [0, 30, 31, 90]),
    (2, 77, 256, 64, 0, False, None),  # no convolution: the norm alone
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", WCN_GPU_CASES)
def test_w_conv_norm_cuda_matches_cpu(case, dtype):
    # Both compute in fp32 from the same inputs; they differ in fma contraction, rsqrt and sum order (a few fp32
    # roundings). bf16 outputs: at most a rounding flip, 2^-8 relative; fp32: 1e-5 of the tensor's scale (an output
    # near zero is a difference of unit-size terms). dweight / dbias are sums of T terms in different orders: rel L2
    # 1e-4 (bf16 weight: also a rounding flip).
    B, T, D, hd, W, bias, cu = case
    torch.manual_seed(T)
    x = torch.randn(B, T, D).to(dtype)
    dout = torch.randn(B, T, D).to(dtype)
    weight, b = _wcn_case(D, W, bias, dtype, seed=D)
    cu_t = torch.tensor(cu) if cu is not None else None
    ref = _wcn_run(x, weight, b, hd, cu_t, dout, activation=W > 0)
    dev = [t.cuda() if t is not None else None for t in (x, weight, b)]
    got = _wcn_run(dev[0], dev[1], dev[2], hd, cu_t.cuda() if cu_t is not None else None, dout.cuda(),
                   activation=W > 0)
    for g, r in zip(got[:2], ref[:2]):
        scale = r.abs().max().item() if r.numel() else 0.0
        tol = dict(rtol=2 ** -7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(g.cpu(), r, **tol)
    for g, r in zip(got[2:], ref[2:]):
        if r is not None:
            assert rl2(g, r) <= (4e-3 if dtype == torch.bfloat16 else 1e-4)


def test_w_conv_norm_cuda_backward_is_deterministic():
    torch.manual_seed(5)
    x = torch.randn(1, 4097, 1024, device="cuda").to(torch.bfloat16)
    dout = torch.randn_like(x)
    weight, b = _wcn_case(1024, 4, True, torch.float32, seed=1)
    cu = torch.tensor([0, 1000, 1000, 4097], device="cuda")
    a = _wcn_run(x, weight.cuda(), b.cuda(), 128, cu, dout)
    c = _wcn_run(x, weight.cuda(), b.cuda(), 128, cu, dout)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_w_conv_norm_cuda_opcheck_and_compile():
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 3, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.pathattn.w_conv_norm_fwd.default, (x, w, None, None, 128, True, 1e-6, 0))

    def f(x, w):
        return pathattn.nn.w_conv_norm(x, w, head_dim=128).float().square().sum()

    ref = f(x, w)
    out = torch.compile(f, fullgraph=True)(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_layer_on_cuda_with_op_close_to_unfused(monkeypatch):
    import pathattn.nn as pnn
    from pathattn.nn import PaTHAttention
    monkeypatch.setattr(pnn, "FUSED_W_ON_CUDA", True)  # the default; the comparison below turns it off
    torch.manual_seed(6)
    layer = PaTHAttention(hidden_size=1024, num_heads=8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)[0]
    y.float().square().sum().backward()
    gx, gw = x.grad.clone(), layer.w_conv1d.weight.grad.clone()
    x.grad = None
    layer.zero_grad()
    monkeypatch.setattr(PaTHAttention, "_fused_w", lambda self, w: False)
    ref = layer(x)[0]
    ref.float().square().sum().backward()
    # The op hands the attention bf16 w (one rounding at its end), the unfused path fp32 w after a bf16 convolution
    # output: both within bf16 rounding, as the attention op's own bf16 bars.
    assert rl2(y, ref) <= 5e-3
    assert rl2(gx, x.grad) <= 2e-2 and rl2(gw, layer.w_conv1d.weight.grad) <= 2e-2


# -- the paged cache (pathattn.PagedCache) ------------------------------------------------------------------------
_PAGED = ("q", "k", "v", "w", "beta", "g")


def _rows(x, rows, a, b):
    """Tokens a..b of the given batch rows, as one batch."""
    return {n: x[n][rows, a:b] for n in _PAGED}


@pytest.mark.parametrize("K", [64, 128])
def test_paged_decode_cuda_matches_cpu(K):
    """Three prompts of different lengths prefilled into a paged cache on the GPU and into one on the CPU backend
    (bf16 q, k, v; f16 key pages; page 16, pending 16), then 48 steps in which the slots flush at different steps;
    at step 24 slot 2 is evicted and a new prompt inserted there. Outputs and every cache array against the CPU's:
    the values, pending rows and metadata are copies (bitwise); the keys differ only where fp32 sums in another
    order round to another f16 (rare, one ulp: 2^-11 relative); the bf16 outputs by their rounding (2^-9)."""
    lens, steps, HQ, H = [37, 150, 1], 48, 8, 2
    x = gpu_inputs(B=4, T=max(lens) + steps, HQ=HQ, H=H, K=K, V=K, seed=11)
    xc = {n: t.cpu() for n, t in x.items()}
    caches = [pathattn.PagedCache(3, 64, 16, H, K, K, HQ, torch.bfloat16, dev, gate=True, pending=16)
              for dev in ("cuda", "cpu")]
    cu = [0] + [sum(lens[:i + 1]) for i in range(3)]
    outs = [[], []]
    for c, xs, out in zip(caches, (x, xc), outs):
        prompt = {n: torch.cat([xs[n][i:i + 1, :L] for i, L in enumerate(lens)], 1) for n in _PAGED}
        out.append(pathattn.paged_prefill(*(prompt[n] for n in _PAGED), c, cu_seqlens=cu, extra=steps))
    assert caches[0].k_pages.dtype == torch.float16 and caches[0].lengths.device.type == "cuda"
    pos = list(lens)
    for t in range(steps):
        if t == 24:  # slot 2 leaves; request 3 (a 20-token prompt, batch row 3) joins in its place
            for c, xs, out in zip(caches, (x, xc), outs):
                c.evict(2)
                out.append(c.insert(2, *(xs[n][3:4, :20] for n in _PAGED), extra=steps))
            pos[2] = 20
        rows = [0, 1, 3 if t >= 24 else 2]
        for c, xs, out in zip(caches, (x, xc), outs):
            step = {n: torch.cat([xs[n][r:r + 1, p:p + 1] for r, p in zip(rows, pos)], 0) for n in _PAGED}
            out.append(pathattn.paged_decode(*(step[n] for n in _PAGED), c))
        pos = [p + 1 for p in pos]
    gc, cc = caches
    assert gc.lengths.tolist() == cc.lengths.tolist() == [lens[0] + steps, lens[1] + steps, 20 + 24]
    assert gc.flushed.tolist() == cc.flushed.tolist()
    eo = rl2(torch.cat([o.flatten() for o in outs[0]]), torch.cat([o.flatten() for o in outs[1]]))
    ek = rl2(gc.k_pages, cc.k_pages)
    print(f"[paged cuda vs cpu] K={K}: o {eo:.2e}, k_pages {ek:.2e}, flushed {gc.flushed.tolist()}")
    for name in ("v_pages", "g_pages", "pend_k", "pend_w", "pend_beta", "block_table"):
        assert torch.equal(getattr(gc, name).cpu(), getattr(cc, name)), name
    assert eo <= 4e-3 and ek <= 1e-4


def test_paged_decode_cuda_graph_replay():
    """A step of a fixed batch (3 slots in use, 1 free) captured in a CUDA graph with validate=False and replayed
    100 times with new tokens copied into its static inputs (pending 16: six flushes on the way), against 100
    eager steps of the same tokens on a clone of the cache: the same kernels, so equal outputs and caches."""
    N, HQ, H, K, steps = 4, 8, 2, 128, 100
    lens = [100, 17, 64]
    cache = pathattn.PagedCache(N, 64, 16, H, K, K, HQ, torch.bfloat16, "cuda", gate=True, pending=16)
    p = gpu_inputs(B=3, T=100, HQ=HQ, H=H, K=K, V=K, seed=21)
    for i, L in enumerate(lens):
        cache.insert(i, *(p[n][i:i + 1, :L] for n in _PAGED), extra=steps)
    x = gpu_inputs(B=N, T=steps, HQ=HQ, H=H, K=K, V=K, seed=22)
    static = {n: x[n][:, :1].clone() for n in _PAGED}
    eager, scratch = cache.clone(), cache.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on a scratch copy
        for _ in range(2):
            pathattn.paged_decode(*(static[n] for n in _PAGED), scratch, validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = pathattn.paged_decode(*(static[n] for n in _PAGED), cache, validate=False)
    assert cache.lengths.tolist() == lens + [-1]  # capturing ran nothing
    replayed = []
    for t in range(steps):
        for n in _PAGED:
            static[n].copy_(x[n][:, t:t + 1])
        graph.replay()
        replayed.append(o_static.clone())
    stepped = [pathattn.paged_decode(*(x[n][:, t:t + 1] for n in _PAGED), eager, validate=False)
               for t in range(steps)]
    og, oe = torch.cat(replayed, 1), torch.cat(stepped, 1)
    print(f"[paged cuda graph] bitwise equal: {torch.equal(og, oe)}; flushed {cache.flushed.tolist()}")
    assert cache.lengths.tolist() == eager.lengths.tolist() == [L + steps for L in lens] + [-1]
    assert cache.flushed.tolist() == eager.flushed.tolist() and min(cache.flushed.tolist()[:3]) > max(lens)
    assert not og[3].any()  # the free slot
    torch.testing.assert_close(og, oe, rtol=1e-6, atol=1e-6)
    for name in ("k_pages", "v_pages", "g_pages", "pend_k", "pend_w", "pend_beta"):
        torch.testing.assert_close(getattr(cache, name), getattr(eager, name), rtol=1e-6, atol=1e-6, msg=name)
