"""pathattn.models on the CPU (skipped without transformers): the config's keys and round trip, the Auto
classes, flash-linear-attention's state_dict names and shapes, the forward against a hand-built stack of
pathattn.nn layers, training (loss, gradient checkpointing), generate() against a full-recompute argmax
loop (PathCache, the dense fallback, padding, beam search), decode logits against the forward, and
save / load round trips. The checkpoint exchange with fla's own classes needs a GPU: test_gpu.py."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

import pathattn  # noqa: E402
from pathattn.models import (DenseAttentionState, PaTHCache, PaTHConfig, PaTHForCausalLM, PaTHModel,  # noqa: E402
                             register_auto_classes)
from pathattn.nn import PaTHAttention  # noqa: E402

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


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dense", [False, True])
def test_generate_greedy_equals_argmax_loop(name, dense):
    m = make_model(**CONFIGS[name])
    ids = torch.randint(3, VOCAB, (2, 7))
    kw = dict(past_key_values=PaTHCache(dense=True)) if dense else {}
    got = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                     eos_token_id=None, pad_token_id=0, **kw)
    assert torch.equal(got, argmax_loop(m, ids, 9))
    if dense:
        assert all(isinstance(s, DenseAttentionState) for s in kw["past_key_values"].layers)


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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_logits_equal_forward(name):
    """Prompt through the cache, then one token at a time (and a 3-token chunk): the logits of one forward."""
    m = make_model(**CONFIGS[name])
    ids = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        ref = m(ids, use_cache=False).logits
        for dense in (False, True):
            cache = PaTHCache(dense=dense)
            parts = [m(ids[:, :8], cache=cache, use_cache=True).logits]
            for t in range(8, 12):
                parts.append(m(ids[:, t:t + 1], cache=cache).logits)
            parts.append(m(ids[:, 12:], cache=cache).logits)
            got = torch.cat(parts, dim=1)
            assert cache.get_seq_length() == 15
            kinds = {type(s) for s in cache.layers}
            assert (kinds == {DenseAttentionState}) == dense
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (dense, (got - ref).abs().max())


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
