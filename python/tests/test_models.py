"""pathattn.models on the CPU (skipped without transformers): the config's keys and round trip, the Auto
classes, flash-linear-attention's state_dict names and shapes, the forward against a hand-built stack of
pathattn.nn layers, training (loss, gradient checkpointing), generate() against a full-recompute argmax
loop (PathCache, the dense fallback, the paged cache, padding, beam search), decode logits against the forward,
the paged cache against the PathCache (tokens and logits, its pages growing), and save / load round trips. The
checkpoint exchange with fla's own classes needs a GPU: test_gpu.py."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

import pathattn  # noqa: E402
from pathattn.models import (DenseAttentionState, PagedAttentionState, PaTHCache, PaTHConfig,  # noqa: E402
                             PaTHForCausalLM, PaTHModel, register_auto_classes)
from pathattn.nn import PaTHAttention, PaTHAttentionState  # noqa: E402
from conftest import rel_l2, same_greedy_tokens  # noqa: E402

VOCAB = 61

# What fla 0.6.0's PaTHAttentionConfig(...).to_dict() holds besides transformers' own keys.
FLA_CONFIG_KEYS = {
    "hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "hidden_ratio", "intermediate_size",
    "hidden_act", "initializer_range", "elementwise_affine", "norm_eps", "use_cache", "pad_token_id",
    "bos_token_id", "eos_token_id", "tie_word_embeddings", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy",
    "fuse_linear_cross_entropy", "use_l2warp", "vocab_size", "use_forget_gate", "use_w_shortconv",
    "use_low_rank_w", "attnres_block_size", "model_type",
}

# config.json as fla 0.6.0 writes it for PaTHAttentionConfig(hidden_size=64, num_hidden_layers=2, num_heads=4,
# vocab_size=50) (the transformers_version line dropped).
FLA_CONFIG_JSON = """{
  "attnres_block_size": null, "bos_token_id": 1, "elementwise_affine": true, "eos_token_id": 2,
  "fuse_cross_entropy": true, "fuse_linear_cross_entropy": false, "fuse_norm": true, "fuse_swiglu": true,
  "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 64, "initializer_range": 0.02,
  "intermediate_size": null, "model_type": "path_attn", "norm_eps": 1e-06, "num_heads": 4,
  "num_hidden_layers": 2, "num_kv_heads": null, "pad_token_id": null, "tie_word_embeddings": false,
  "use_cache": true, "use_forget_gate": false, "use_l2warp": false, "use_low_rank_w": true,
  "use_w_shortconv": true, "vocab_size": 50, "architectures": ["PaTHAttentionForCausalLM"]
}"""

CONFIGS = {
    "mha": dict(),
    "gqa_gate": dict(num_kv_heads=2, use_forget_gate=True, use_low_rank_w=False),
    "noconv_mqa": dict(num_kv_heads=1, use_w_shortconv=False, use_forget_gate=True, intermediate_size=96),
}


def small_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=VOCAB, hidden_ratio=2,
                initializer_range=0.2)
    base.update(kw)
    return PaTHConfig(**base)


def perturb(m):
    with torch.no_grad():  # non-trivial norms and biases (the init leaves them at 1 and 0)
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    return perturb(PaTHForCausalLM(small_config(**kw)))


def fla_state_dict_shapes(cfg):
    """The state_dict of fla's PaTHAttentionForCausalLM(cfg): names and shapes, from fla 0.6.0's modules
    (PaTHAttentionBlock, PaTHAttention, GatedMLP, RMSNorm)."""
    hid, nh = cfg.hidden_size, cfg.num_heads
    kv = nh if cfg.num_kv_heads is None else cfg.num_kv_heads
    kvd = kv * (hid // nh)
    inter = cfg.intermediate_size
    if inter is None:
        inter = 256 * ((int(hid * cfg.hidden_ratio * 2 / 3) + 255) // 256)
    s = {"model.embeddings.weight": (cfg.vocab_size, hid)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "attn_norm.weight"] = (hid,)
        s.update({p + "attn.q_proj.weight": (hid, hid), p + "attn.k_proj.weight": (kvd, hid),
                  p + "attn.v_proj.weight": (kvd, hid)})
        if cfg.use_low_rank_w:
            s.update({p + "attn.w_proj.0.weight": (32, hid), p + "attn.w_proj.1.weight": (kvd, 32)})
        else:
            s[p + "attn.w_proj.weight"] = (kvd, hid)
        if cfg.use_w_shortconv:
            s[p + "attn.w_conv1d.weight"] = (kvd, 1, 3)
        s.update({p + "attn.bt_proj.weight": (kv, hid), p + "attn.bt_proj.bias": (kv,)})
        if cfg.use_forget_gate:
            s.update({p + "attn.g_proj.weight": (nh, hid), p + "attn.g_proj.bias": (nh,)})
        s[p + "attn.o_proj.weight"] = (hid, hid)
        s[p + "mlp_norm.weight"] = (hid,)
        s.update({p + "mlp.gate_proj.weight": (inter, hid), p + "mlp.up_proj.weight": (inter, hid),
                  p + "mlp.down_proj.weight": (hid, inter)})
    s["model.norm.weight"] = (hid,)
    s["lm_head.weight"] = (cfg.vocab_size, hid)
    return s


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}


# -- config ---------------------------------------------------------------------------------------------------

def test_config_has_flas_keys_and_round_trips(tmp_path, ours_registered):
    cfg = small_config(num_kv_heads=2, use_forget_gate=True, norm_eps=1e-5, tie_word_embeddings=True)
    d = cfg.to_dict()
    assert FLA_CONFIG_KEYS <= set(d), FLA_CONFIG_KEYS - set(d)
    assert d["model_type"] == "path_attn"
    cfg.save_pretrained(tmp_path)
    back = PaTHConfig.from_pretrained(tmp_path)
    for key in FLA_CONFIG_KEYS:
        assert getattr(back, key) == getattr(cfg, key), key
    auto = AutoConfig.from_pretrained(tmp_path)
    assert type(auto) is PaTHConfig and auto.num_kv_heads == 2 and auto.use_forget_gate


def test_config_written_by_fla_loads(tmp_path, ours_registered):
    (tmp_path / "config.json").write_text(FLA_CONFIG_JSON)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert type(cfg) is PaTHConfig
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads, cfg.vocab_size) == (64, 2, 4, 50)
    assert cfg.num_kv_heads is None and cfg.norm_eps == 1e-6 and cfg.use_low_rank_w and cfg.use_w_shortconv


@pytest.mark.parametrize("kw, arg", [(dict(hidden_act="powlu"), "hidden_act"), (dict(use_l2warp=True), "use_l2warp"),
                                     (dict(attnres_block_size=2), "attnres_block_size"),
                                     (dict(num_heads=5), "num_heads"), (dict(num_kv_heads=3), "num_heads")])
def test_config_rejects_what_is_not_implemented(kw, arg):
    with pytest.raises(ValueError, match=arg):
        small_config(**kw)


@pytest.fixture
def ours_registered():
    """The Auto classes answer "path_attn" with ours, also after a test imported fla (which registers it)."""
    register_auto_classes()


def test_auto_classes_resolve_to_ours(ours_registered):
    cfg = small_config()
    assert type(AutoConfig.for_model("path_attn", hidden_size=64, num_heads=4)) is PaTHConfig
    assert type(AutoModelForCausalLM.from_config(cfg)) is PaTHForCausalLM
    assert type(AutoModel.from_config(cfg)) is PaTHModel
    assert type(pathattn.models.PaTHConfig()) is PaTHConfig  # lazy attribute of the package


# -- state_dict layout --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_names_and_shapes_are_flas(name):
    m = make_model(**CONFIGS[name])
    assert shapes(m.state_dict()) == fla_state_dict_shapes(m.config)


def test_state_dict_matches_fla_model_on_meta_device():
    """Where fla's modeling module imports (it needs triton but runs none of it here), build its model on the
    meta device and compare names and shapes directly."""
    PaTHAttentionConfig, PaTHAttentionForCausalLM = fla_classes()
    for kw in CONFIGS.values():
        cfg = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=VOCAB, hidden_ratio=2, **kw)
        with torch.device("meta"):
            theirs = PaTHAttentionForCausalLM(PaTHAttentionConfig(**cfg))
        assert shapes(make_model(**kw).state_dict()) == shapes(theirs.state_dict())


def test_register_auto_classes_takes_the_name_back():
    fla_classes()  # fla's import registered "path_attn" for its own classes
    from fla.models.path_attn import PaTHAttentionConfig
    AutoConfig.register("path_attn", PaTHAttentionConfig, exist_ok=True)
    assert type(AutoConfig.for_model("path_attn")) is PaTHAttentionConfig
    register_auto_classes()
    assert type(AutoConfig.for_model("path_attn")) is PaTHConfig


def fla_classes():
    try:
        from fla.models.path_attn import PaTHAttentionConfig, PaTHAttentionForCausalLM
    except Exception as e:  # fla absent, or its import needs what this machine lacks
        pytest.skip(f"fla's PaTH model classes do not import here: {type(e).__name__}: {e}")
    return PaTHAttentionConfig, PaTHAttentionForCausalLM


def test_checkpoints_move_between_fla_and_ours(tmp_path):
    """save_pretrained by fla's class, from_pretrained by ours and back, with no missing, unexpected or
    mismatched key and every tensor unchanged (fla's forward needs a GPU: test_gpu.py compares logits)."""
    FlaConfig, FlaLM = fla_classes()
    for kw in CONFIGS.values():
        cfg = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=VOCAB, hidden_ratio=2, **kw)
        theirs = FlaLM(FlaConfig(**cfg))
        theirs.save_pretrained(tmp_path / "fla")
        ours, info = PaTHForCausalLM.from_pretrained(tmp_path / "fla", output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        ours = perturb(ours)
        ours.save_pretrained(tmp_path / "ours")
        back, info = FlaLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        for k, v in ours.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k


def test_tied_embeddings_share_the_weight():
    m = make_model(tie_word_embeddings=True)
    assert m.lm_head.weight is m.model.embeddings.weight


# -- forward --------------------------------------------------------------------------------------------------

def rms(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def hand_built_logits(model, ids, attention_mask=None):
    """The same network from pathattn.nn.PaTHAttention layers and plain torch, fed model's weights."""
    cfg, sd = model.config, model.state_dict()
    h = F.embedding(ids, sd["model.embeddings.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = PaTHAttention(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                             use_forget_gate=cfg.use_forget_gate, use_low_rank_w=cfg.use_low_rank_w,
                             use_w_shortconv=cfg.use_w_shortconv)
        attn.load_state_dict({k[len(p + "attn."):]: v for k, v in sd.items() if k.startswith(p + "attn.")},
                             strict=True)
        a, _, _ = attn(rms(h, sd[p + "attn_norm.weight"], cfg.norm_eps), attention_mask=attention_mask)
        h = h + a
        x = rms(h, sd[p + "mlp_norm.weight"], cfg.norm_eps)
        mlp = F.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["model.norm.weight"], cfg.norm_eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_hand_built_stack(name):
    m = make_model(**CONFIGS[name])
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        ref = hand_built_logits(m, ids)
        for use_cache in (False, True):  # the training forward and the prefill
            out = m(ids, use_cache=use_cache)
            cache = out.cache if "cache" in out else out.past_key_values
            assert isinstance(cache, PaTHCache) == use_cache
            assert out.logits.shape == (2, 23, VOCAB)
            assert torch.allclose(out.logits, ref, rtol=1e-5, atol=1e-5), (use_cache, (out.logits - ref).abs().max())


def test_padding_mask_equals_unpadded_sequences():
    m = make_model(**CONFIGS["gqa_gate"])
    a, b = torch.randint(0, VOCAB, (1, 13)), torch.randint(0, VOCAB, (1, 8))
    ids = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 5:], mask[1, 5:] = b[0], 1  # left padding
    with torch.no_grad():
        got = m(ids, attention_mask=mask).logits
        ref_a, ref_b = m(a).logits, m(b).logits
        assert torch.allclose(got, hand_built_logits(m, ids, attention_mask=mask), rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[0], ref_a[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(got[1, 5:], ref_b[0], rtol=1e-5, atol=1e-5)


def test_hidden_states_and_logits_to_keep():
    m = make_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        full = m(ids, output_hidden_states=True)
        last = m(ids, logits_to_keep=1)
    assert len(full.hidden_states) == m.config.num_hidden_layers + 1
    assert torch.allclose(last.logits[:, 0], full.logits[:, -1], rtol=1e-6, atol=1e-6)


# -- training -------------------------------------------------------------------------------------------------

def test_loss_is_shifted_cross_entropy_and_decreases():
    m = make_model(**CONFIGS["gqa_gate"]).train()
    ids = torch.randint(0, VOCAB, (4, 16))
    out = m(ids, labels=ids)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, ref, rtol=1e-6)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = m(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def grads_of(m, ids):
    m.zero_grad()
    m(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients():
    m = make_model(**CONFIGS["gqa_gate"]).train()
    ids = torch.randint(0, VOCAB, (2, 20))
    plain = grads_of(m, ids)
    getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
    assert m.model.gradient_checkpointing
    calls = []
    inner = m.model._gradient_checkpointing_func
    m.model._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or inner(*a, **k)
    ckpt = grads_of(m, ids)
    assert len(calls) == m.config.num_hidden_layers  # every block ran under the checkpoint
    for n in plain:
        assert torch.allclose(ckpt[n], plain[n], rtol=1e-5, atol=1e-7), n


# -- generation -----------------------------------------------------------------------------------------------

def argmax_loop(m, ids, steps):
    """Greedy decoding by recomputing the full forward for every new token."""
    with torch.no_grad():
        for _ in range(steps):
            nxt = m(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


# The cache kinds PaTHCache makes: the CPU default (the PathCache), the dense fallback, the paged cache (f32 key
# pages: the fp32 accuracy of the others; test_generate_paged_equals_path_cache takes f16 ones).
KINDS = {"path": (dict(), PaTHAttentionState), "dense": (dict(dense=True), DenseAttentionState),
         "paged": (dict(paged=True, page_size=4, pending=4, key_dtype=torch.float32), PagedAttentionState)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_greedy_equals_argmax_loop(name, kind):
    m = make_model(**CONFIGS[name])
    ids = torch.randint(3, VOCAB, (2, 7))
    cache = PaTHCache(**KINDS[kind][0])
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                     eos_token_id=None, pad_token_id=0, past_key_values=cache)
    assert torch.equal(got, argmax_loop(m, ids, 9))
    assert all(type(s) is KINDS[kind][1] for s in cache.layers), cache


def test_sampling_with_cache_equals_without():
    m = make_model(**CONFIGS["noconv_mqa"])
    ids = torch.randint(3, VOCAB, (3, 5))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True, top_k=0, eos_token_id=None,
              pad_token_id=0)
    torch.manual_seed(5)
    with_cache = m.generate(ids, **kw)
    torch.manual_seed(5)
    assert torch.equal(with_cache, m.generate(ids, use_cache=False, **kw))


def test_generate_left_padded_batch():
    m = make_model(**CONFIGS["gqa_gate"])
    a, b = torch.randint(3, VOCAB, (1, 9)), torch.randint(3, VOCAB, (1, 4))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got[0, 9:], argmax_loop(m, a, 6)[0, 9:])
    assert torch.equal(got[1, 9:], argmax_loop(m, b, 6)[0, 4:])


def test_beam_search_with_cache_equals_without():
    m = make_model(**CONFIGS["gqa_gate"])
    ids = torch.randint(3, VOCAB, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, num_beams=3, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    assert torch.equal(m.generate(ids, **kw), m.generate(ids, use_cache=False, **kw))


def test_beam_search_with_paged_cache_equals_without():
    # 12 tokens at pending 4: the beams' slots are copied (reorder_cache) with tokens pending and after flushes.
    m = make_model(**CONFIGS["gqa_gate"])
    ids = torch.randint(3, VOCAB, (2, 6))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, num_beams=3, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    cache = PaTHCache(paged=True, page_size=4, pending=4, key_dtype=torch.float32)
    got = m.generate(ids, past_key_values=cache, **kw)
    assert all(isinstance(s, PagedAttentionState) for s in cache.layers)
    assert torch.equal(got, m.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_logits_equal_forward(name):
    """Prompt through the cache, then one token at a time (and a 3-token chunk): the logits of one forward."""
    m = make_model(**CONFIGS[name])
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits
        for kind in ("path", "dense", "paged"):
            opts, state_type = KINDS[kind]
            cache = PaTHCache(**opts)
            parts = [m(ids[:, :8], cache=cache, use_cache=True).logits]
            for t in range(8, 12):
                parts.append(m(ids[:, t:t + 1], cache=cache).logits)
            parts.append(m(ids[:, 12:], cache=cache).logits)
            got = torch.cat(parts, dim=1)
            assert cache.get_seq_length() == 15
            assert all(type(s) is state_type for s in cache.layers), cache
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (kind, (got - ref).abs().max())


def test_decode_falls_back_to_dense_when_the_backend_refuses(monkeypatch):
    m = make_model(**CONFIGS["gqa_gate"])
    ids = torch.randint(3, VOCAB, (2, 7))
    want = argmax_loop(m, ids, 6)

    def refuse(*a, **k):
        raise pathattn.UnsupportedError("q: decode refused for the test")

    monkeypatch.setattr(pathattn.decode, "decode_step", refuse)
    cache = PaTHCache()
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                     eos_token_id=None, pad_token_id=0, cache=cache)
    assert torch.equal(got, want)
    assert all(isinstance(s, DenseAttentionState) for s in cache.layers)


def test_cache_errors_name_the_argument():
    m = make_model()
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(TypeError, match="cache"):
        m(ids, cache=object())
    with pytest.raises(NotImplementedError, match="crop"):
        PaTHCache().crop(2)
    with pytest.raises(ValueError, match="output_attentions"):
        m(ids, output_attentions=True)
    for kw, err, arg in ((dict(dense=True, paged=True), ValueError, "paged"), (dict(paged=1), TypeError, "paged"),
                         (dict(dense=None), TypeError, "dense"), (dict(page_size=0), ValueError, "page_size"),
                         (dict(pending=pathattn.PAGED_MAX_PENDING + 1), ValueError, "pending"),
                         (dict(key_dtype=torch.bfloat16), TypeError, "key_dtype"),
                         (dict(max_length=-1), ValueError, "max_length")):
        with pytest.raises(err, match=arg):
            PaTHCache(**kw)


# -- the paged cache ------------------------------------------------------------------------------------------

def padded_prompts(lens):
    """Random prompts of the given lengths, left-padded into one batch: (ids [B, T], attention_mask [B, T])."""
    T = max(lens)
    ids = torch.zeros(len(lens), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, L in enumerate(lens):
        ids[i, T - L:] = torch.randint(3, VOCAB, (L,))
        mask[i, T - L:] = 1
    return ids, mask


def generate_with(m, ids, mask, cache, steps):
    out = m.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, eos_token_id=None,
                     pad_token_id=0, past_key_values=cache, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)  # [B, T + steps], [B, steps, vocab]


# Bars on the logits of generate() with the paged cache against the PathCache (relative L2 over every step). f32 key
# pages: fp32 arithmetic throughout in another order (lazy transport), measured 6.2e-7 .. 6.8e-7; the bar leaves
# 7x. f16 key pages: each flush rounds every cached key to f16 (unit roundoff u = 2^-11 = 4.9e-4), which moves each
# layer's attention output by a fraction of u (test_paged.py: 1.4e-4 .. 3.6e-4); the two layers' errors reach the
# logits through the residual stream with a gain of order one: measured 4.0e-4 .. 7.5e-4 (about u); the bar is 4u,
# test_paged.py's bar on the attention outputs.
PAGED_LOGITS_BAR = {torch.float32: 5e-6, torch.float16: 2e-3}


@pytest.mark.parametrize("key_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_paged_equals_path_cache(name, key_dtype):
    """Three left-padded prompts, 16 new tokens at pending 4 (flushes at every fourth step, a different token for
    each prompt) and pages of 4: the paged cache gives the PathCache's greedy tokens, logits within the bar.

    Every token equal, but where the PathCache's two best logits are closer than twice the bar times the step's
    largest |logit| (f16 pages: 4e-3 of it; f32: 1e-5): a tie that rounding may tip either way. A row is compared
    up to its first differing token (the contexts differ after it)."""
    m = make_model(**CONFIGS[name])
    lens, steps, pending = [9, 4, 13], 16, 4
    ids, mask = padded_prompts(lens)
    T, bar = ids.shape[1], PAGED_LOGITS_BAR[key_dtype]
    path = PaTHCache()
    want, ref = generate_with(m, ids, mask, path, steps)
    assert all(type(s) is PaTHAttentionState for s in path.layers)  # the CPU default
    cache = PaTHCache(paged=True, page_size=4, pending=pending, key_dtype=key_dtype)
    got, logits = generate_with(m, ids, mask, cache, steps)
    same = same_greedy_tokens(got, want, ref, T, 2 * bar)
    e = rel_l2(logits[same].numpy(), ref[same].numpy())
    print(f"[paged generate] {name}, key pages {key_dtype}: logits rel L2 vs PathCache {e:.2e}, tokens equal "
          f"{torch.equal(got, want)}")
    assert e < bar
    assert cache.max_length == T + steps - 1  # told by generate(): every page taken at the prompt
    for st in cache.layers:
        assert isinstance(st, PagedAttentionState) and st.cache.k_pages.dtype == key_dtype
        fed = [L + steps - 1 for L in lens]  # the last new token is never fed back
        assert st.lengths.tolist() == st.cache.host_lengths().tolist() == fed
        assert [st.cache.capacity(n) for n in range(3)] == [-(-L // 4) * 4 for L in fed]
        flushed = st.cache.flushed.tolist()  # at least three flushes since each prompt
        assert all(L - pending <= f <= L and f - L0 >= 3 * pending for f, L, L0 in zip(flushed, fed, lens)), flushed


def test_paged_cache_grows_past_its_pages():
    """A left-padded batch decoded through forward() beyond the cache's max_length: the shorter slot takes pages as
    tokens come (reserve), then the block table of both widens (a copy of the pool); logits equal the forward's."""
    m = make_model(**CONFIGS["gqa_gate"])
    ids, mask = padded_prompts([8, 5])
    ids = torch.cat([ids, torch.randint(3, VOCAB, (2, 12))], dim=1)
    mask = torch.cat([mask, torch.ones(2, 12, dtype=torch.long)], dim=1)
    cache = PaTHCache(paged=True, page_size=2, pending=3, key_dtype=torch.float32, max_length=9)
    with torch.no_grad():
        ref = m(ids, attention_mask=mask, use_cache=False).logits
        parts = [m(ids[:, :8], attention_mask=mask[:, :8], cache=cache, use_cache=True).logits]
        st = cache.layers[0]
        assert st.cache.max_pages == 5 and [st.cache.capacity(n) for n in range(2)] == [10, 6]
        parts += [m(ids[:, t:t + 1], cache=cache).logits for t in range(8, 20)]
    got = torch.cat(parts, dim=1)
    st = cache.layers[0]
    assert st.lengths.tolist() == st.cache.host_lengths().tolist() == [20, 17]
    assert st.cache.max_pages >= 10 and st.cache.capacity(0) >= 20 and st.cache.capacity(1) >= 17
    valid = mask.bool()
    assert torch.allclose(got[valid], ref[valid], rtol=1e-4, atol=1e-4), (got - ref)[valid].abs().max()


def test_paged_cache_leaves_float64_layers_to_the_path_cache():
    m = make_model(**CONFIGS["mha"]).double()
    ids = torch.randint(3, VOCAB, (2, 5))
    cache = PaTHCache(paged=True)
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                     eos_token_id=None, pad_token_id=0, past_key_values=cache)
    assert all(type(s) is PaTHAttentionState for s in cache.layers)  # the paged cache holds no float64
    assert torch.equal(got, argmax_loop(m, ids, 4))


# -- checkpoints ----------------------------------------------------------------------------------------------

def test_save_and_load_round_trip(tmp_path, ours_registered):
    m = make_model(**CONFIGS["gqa_gate"])
    ids = torch.randint(0, VOCAB, (2, 11))
    m.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "path_attn"
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is PaTHForCausalLM
    assert back.state_dict().keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    fresh = PaTHForCausalLM(m.config).eval()
    fresh.load_state_dict(m.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
        assert torch.equal(fresh(ids).logits, m(ids).logits)


def test_fla_named_checkpoint_loads_strictly(tmp_path):
    """A state_dict with fla's names and shapes (built from the fixture, random values) loads with strict=True
    and every tensor lands where its name says."""
    cfg = small_config(**CONFIGS["gqa_gate"])
    torch.manual_seed(3)
    sd = {k: torch.randn(s) for k, s in fla_state_dict_shapes(cfg).items()}
    m = PaTHForCausalLM(cfg)
    m.load_state_dict(sd, strict=True)
    assert torch.equal(m.model.layers[1].attn.g_proj.bias, sd["model.layers.1.attn.g_proj.bias"])
    assert torch.equal(m.model.layers[0].mlp.down_proj.weight, sd["model.layers.0.mlp.down_proj.weight"])
