"""PaTHModel and PaTHForCausalLM: a pre-norm decoder of pathattn.nn.PaTHAttention layers and SwiGLU MLPs,
with flash-linear-attention's module names (model.embeddings, model.layers.N.{attn_norm, attn, mlp_norm,
mlp.{gate_proj, up_proj, down_proj}}, model.norm, lm_head), so its state_dicts load strictly either way.
Training (padding masks, packed cu_seqlens, gradient checkpointing) runs the op's forward and backward;
generate() prefills a PaTHCache (fp32 PathCache or paged layers) and decodes one token per step
(pathattn.models.cache).
"""
import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..nn import PaTHAttention
from ..nn import RMSNorm as _HeadNorm  # the layer's per-head q / k norm
from .cache import PaTHCache, layer_step
from .configuration import PaTHConfig, default_intermediate_size

try:  # transformers 5: initialisers that leave weights loaded from a checkpoint alone
    from transformers import initialization as _init
except ImportError:
    _init = nn.init

# transformers renamed the outputs' past_key_values field to cache; fill whichever this version has
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a weight in the model's dtype, computed in float32."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        xf = x.double() if x.dtype == torch.float64 else x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases (fla's GatedMLP, hidden_act swish)."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PaTHBlock(nn.Module):
    """x + attn(attn_norm(x)), then h + mlp(mlp_norm(h)) (fla's PaTHAttentionBlock without attnres)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = PaTHAttention(hidden_size=config.hidden_size, num_heads=config.num_heads,
                                  num_kv_heads=config.num_kv_heads, use_forget_gate=config.use_forget_gate,
                                  use_low_rank_w=config.use_low_rank_w, use_w_shortconv=config.use_w_shortconv,
                                  layer_idx=layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        inter = config.intermediate_size
        if inter is None:
            inter = default_intermediate_size(config.hidden_size, config.hidden_ratio)
        self.mlp = GatedMLP(config.hidden_size, inter)

    def forward(self, hidden_states, attention_mask=None, cu_seqlens=None, state=None, use_cache=False, cache=None):
        """hidden_states [B, T, hidden] -> (hidden_states, the layer's decode state or None).

        state None and use_cache: the prompt (prefill), returning a new state, of the kind `cache` (the model's
        PaTHCache) chooses. state given: T tokens after it, one decode step each. Otherwise the training forward
        (attention_mask [B, T] or cu_seqlens)."""
        h = self.attn_norm(hidden_states)
        if state is not None:
            outs = []
            for t in range(h.shape[1]):
                y, state = layer_step(self.attn, h[:, t:t + 1], state)
                outs.append(y)
            h = torch.cat(outs, dim=1)
        elif use_cache and cache is not None:
            h, state = cache.prefill_layer(self.attn, h, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        elif use_cache:
            h, state = self.attn.prefill(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        else:
            h, _, _ = self.attn(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        h = hidden_states + h
        return h + self.mlp(self.mlp_norm(h)), state


class PaTHPreTrainedModel(PreTrainedModel):
    config_class = PaTHConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PaTHBlock"]
    _is_stateful = True  # transformers then refuses decoding strategies that roll the cache back

    def _init_weights(self, module):
        """fla's initialisation: normal(0, initializer_range) weights, zero biases, unit norms."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Embedding)):
            _init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, _HeadNorm)):
            _init.ones_(module.weight)


class PaTHModel(PaTHPreTrainedModel):
    """Embeddings, num_hidden_layers PaTHBlocks and a final RMSNorm; returns BaseModelOutputWithPast."""

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([PaTHBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, cache=None, cu_seqlens=None,
                **kwargs):
        """input_ids [B, T] (or inputs_embeds [B, T, hidden]) -> last_hidden_state [B, T, hidden].

        attention_mask [B, T]: 1 for tokens, 0 for padding (either side). cu_seqlens: packed sequences (B == 1).
        cache / past_key_values: a PaTHCache to continue from (transformers' two names for it); with
        use_cache (default: config.use_cache under torch.no_grad outside training) the output carries the
        advanced cache. The cache path (prefill and decode) is inference only: it records no autograd graph.
        """
        if output_attentions:
            raise ValueError("output_attentions: PaTH layers do not return attention weights")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        if cache is None:
            cache = past_key_values
        if cache is not None and not isinstance(cache, PaTHCache):
            raise TypeError(f"cache: expected a pathattn.models.PaTHCache, got {type(cache).__name__}")
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if use_cache is None:  # the cache path is inference only (no autograd): off in training and under grad
            use_cache = self.config.use_cache and not self.training and not torch.is_grad_enabled()
        use_cache = (use_cache or cache is not None) and not checkpointing
        if use_cache and cache is None:
            cache = PaTHCache()
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask: expected [B, T] of 0 / 1, got shape {list(attention_mask.shape)}")
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: give either attention_mask or cu_seqlens, not both")
            if bool(attention_mask.all()):
                attention_mask = None  # no padding: the plain path
        if cache is not None and len(cache) > 0:
            attention_mask = cu_seqlens = None  # continuing sequences: the cache knows their lengths

        h = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        all_hidden = () if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden += (h,)
            if checkpointing:
                fn = partial(layer.__call__, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
                h, _ = self._gradient_checkpointing_func(fn, h)
            else:
                h, state = layer(h, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                 state=cache[i] if use_cache else None, use_cache=use_cache,
                                 cache=cache if use_cache else None)
                if use_cache:
                    cache.set_layer(i, state)
        h = self.norm(h)
        if output_hidden_states:
            all_hidden += (h,)
        if use_cache:
            cache.advance(h.shape[1])
        else:
            cache = None
        if not return_dict:
            return tuple(x for x in (h, cache, all_hidden) if x is not None)
        return BaseModelOutputWithPast(last_hidden_state=h, hidden_states=all_hidden, **{_CACHE_FIELD: cache})


class PaTHForCausalLM(PaTHPreTrainedModel, GenerationMixin):
    """PaTHModel plus lm_head; loss as fla's (labels shifted inside, -100 ignored); generate() via PaTHCache."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = PaTHModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # not transformers' DynamicCache: a PaTHCache (_prepare_cache_for_generation below)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        """generate()'s cache hook: makes the PaTHCache (unless the caller passed one as cache= or
        past_key_values=) and tells an empty one the most positions this run feeds it, max_cache_length (the
        prompt and the new tokens but the last), so that its paged layers take their pages at the prompt."""
        if generation_config.use_cache is False:
            return
        cache = model_kwargs.get("cache")
        if cache is None:
            cache = model_kwargs.get("past_key_values")
        if cache is None:
            cache = model_kwargs["past_key_values"] = PaTHCache()
        if isinstance(cache, PaTHCache) and len(cache) == 0 and cache.max_length is None:
            cache.max_length = int(max_cache_length)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, labels=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                logits_to_keep=0, num_items_in_batch=None, cache=None, cu_seqlens=None, **kwargs):
        """As PaTHModel.forward, plus: labels [B, T] (the token at each position; the loss predicts position
        t + 1 from t, -100 ignored), logits_to_keep (0: all positions; n: the last n), num_items_in_batch
        (divide the summed loss by it instead of averaging). Returns CausalLMOutputWithPast."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states, return_dict=True,
                         cache=cache if cache is not None else past_key_values, cu_seqlens=cu_seqlens)
        h = out.last_hidden_state
        if labels is None and isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        elif labels is None and isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            reduction = "mean" if num_items_in_batch is None else "sum"
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1),
                                   ignore_index=-100, reduction=reduction)
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        cache_out = getattr(out, _CACHE_FIELD)
        if not return_dict:
            rest = tuple(x for x in (logits, cache_out, out.hidden_states) if x is not None)
            return (loss,) + rest if loss is not None else rest
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                      **{_CACHE_FIELD: cache_out})
