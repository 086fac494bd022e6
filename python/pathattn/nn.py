"""pathattn.nn: the PaTH attention layer for PyTorch (docs/spec.md), a drop-in for
flash-linear-attention's ``fla.layers.PaTHAttention``: same constructor arguments, same submodule and
parameter names and shapes (an fla state_dict loads with strict=True), same forward signature and return
value. Training, prefill and decode all apply the same w convolution, L2 normalisation and (optional)
per-head q/k RMSNorm.

    layer = PaTHAttention(hidden_size=512, num_heads=8)
    y, _, _ = layer(x)                                   # training: x [B, T, hidden]
    y, state = layer.prefill(prompt, attention_mask)     # inference: returns a PaTHAttentionState
    y_t = layer.step(x_t, state)                         # one token per sequence: x_t [N, 1, hidden]
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import decode as _decode
from ._api import backend_code, enable_torch, parallel_path_attn

enable_torch()  # the custom ops, also where PATHATTN_NO_TORCH skipped them at import
from . import _torch_ops  # noqa: E402  (registered by enable_torch)


def _acc(x):
    """x in the compute dtype of the layer's small tensors: float32, or float64 for a float64 model."""
    return x.double() if x.dtype == torch.float64 else x.float()


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution over time followed by SiLU, as fla's ShortConvolution.

    Parameters: weight [D, 1, W] (and bias [D] when bias=True), the nn.Conv1d layout fla uses, so its
    state_dict entries load unchanged. Computed in float32, returned in the input's dtype.
    """

    def __init__(self, hidden_size, kernel_size, bias=False, activation="silu", device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                         padding=kernel_size - 1, device=device, dtype=dtype)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None):
        """x [B, T, D] -> (y [B, T, D], state [N, D, W-1] or None).

        cache: [B, D, W-1], the W-1 inputs before x (oldest first), or None for a sequence start.
        cu_seqlens: packed sequences (B == 1); the convolution restarts at every sequence start.
        The returned state holds the last W-1 inputs of each sequence (zeros before a sequence's start).
        """
        B, T, D = x.shape
        W = self.kernel_size[0]
        xf = _acc(x)
        wt = self.weight[:, 0, :].to(xf.dtype)  # [D, W]; tap i multiplies x_{t - (W - 1 - i)}
        prev = cache.to(xf.dtype).transpose(1, 2) if cache is not None else xf.new_zeros((B, W - 1, D))
        xx = torch.cat([prev, xf], dim=1)  # [B, W - 1 + T, D]
        if cu_seqlens is not None:
            cu = cu_seqlens.to(device=x.device, dtype=torch.long)
            t = torch.arange(T, device=x.device)
            seq = torch.searchsorted(cu[1:], t, right=True)
            pos = t - cu[seq]  # position of token t inside its sequence
        y = xf.new_zeros((B, T, D))
        for i in range(W):
            tap = xx[:, i:i + T] * wt[:, i]
            if cu_seqlens is not None:
                tap = tap * (pos >= W - 1 - i).to(tap.dtype)[None, :, None]
            y = y + tap
        if self.bias is not None:
            y = y + self.bias.to(xf.dtype)
        if self.activation is not None:
            y = F.silu(y)
        state = self.final_state(x, cache, cu_seqlens) if output_final_state else None
        return y.to(x.dtype), state

    def final_state(self, x, cache=None, cu_seqlens=None):
        """The state forward(x, cache, output_final_state=True, cu_seqlens) returns, without the convolution:
        [N, D, W-1] in x's dtype, the last W-1 inputs of each sequence (zeros before its start)."""
        B, T, D = x.shape
        W = self.kernel_size[0]
        if cu_seqlens is None:
            prev = cache.to(x.dtype).transpose(1, 2) if cache is not None else x.new_zeros((B, W - 1, D))
            return torch.cat([prev, x], dim=1)[:, T:].transpose(1, 2)  # the last W - 1 rows of [prev, x]
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        j = torch.arange(W - 1, device=x.device)
        idx = cu[1:, None] - (W - 1) + j[None]  # [N, W - 1] packed indices
        valid = (idx >= cu[:-1, None]).to(x.dtype)
        return (x[0][idx.clamp(min=0)] * valid[..., None]).transpose(1, 2)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 (fla's RMSNorm(head_dim, dtype=float32))."""

    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=torch.float32):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        xf = _acc(x)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(xf.dtype)
        return y.to(x.dtype)


def l2_norm(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) over the last dimension, in float32 (float64 for float64 x)."""
    xf = _acc(x)
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


# Whether the layer hands CUDA tensors to the fused w op (w_conv_norm below) rather than to the unfused modules
# (ShortConvolution, l2_norm). On: it is the faster path (docs/design.md); off only to time or compare the two.
FUSED_W_ON_CUDA = True


def w_conv_norm(x, weight=None, bias=None, *, head_dim, cu_seqlens=None, activation=True, eps=1e-6, backend=None):
    """The PaTH layer's w preparation as one op (include/pathattn/w_conv_norm.h), differentiable in x, weight, bias.

    x [B, T, D] (D = heads * head_dim): z = causal depthwise convolution of x over time with weight [D, W] (or
    nn.Conv1d's [D, 1, W]; tap i multiplies x[t - (W - 1 - i)]) plus bias [D], restarting at every cu_seqlens
    boundary; a = SiLU(z) if activation else z; out = a / sqrt(sum a^2 + eps) over each head's head_dim channels.
    weight None: no convolution (the norm alone, after SiLU if activation). Computed in float32 (float64 for
    float64 x, and on the oracle backend), returned in x's dtype. This is ShortConvolution(activation="silu")
    followed by l2_norm, to rounding, in one pass over x each way. backend: None / 'cpu' / 'oracle' / 'cuda'.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x: expected 3 dimensions [B, T, D], got {x.dim()} {list(x.shape)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int, got {type(head_dim).__name__}")
    return _torch_ops.w_conv_norm(x, weight, bias, head_dim, cu_seqlens, bool(activation), float(eps),
                                  backend_code(backend))


@dataclass
class PaTHAttentionState:
    """Inference state of one PaTHAttention layer: the w convolution's last inputs and the PaTH cache.

    step() works with any state that has conv_state and attend() (pathattn.models keeps dense and paged ones)."""
    conv_state: Optional[torch.Tensor]  # [N, kv_dim, conv_size - 1] or None without the convolution
    cache: _decode.PathCache

    def attend(self, q, k, v, w, beta, g):
        """One token per sequence on the cache (pathattn.decode_step): q [N,1,HQ,K], k [N,1,H,K], v [N,1,H,V],
        w [N,1,H,K] unit rows, beta [N,1,H], g [N,1,HQ] or None -> o [N,1,HQ,V]."""
        return _decode.decode_step(self.cache, q, k, v, w, beta, g)


class PaTHAttention(nn.Module):
    """PaTH attention layer (fla.layers.PaTHAttention's arguments, names and conventions).

    Submodules: q_proj, k_proj, v_proj, o_proj (no bias); w_proj (Sequential(Linear(hidden, 32),
    Linear(32, kv_dim)) when use_low_rank_w, else Linear(hidden, kv_dim)); w_conv1d (ShortConvolution,
    width conv_size, SiLU) when use_w_shortconv; bt_proj (Linear(hidden, num_kv_heads) with bias);
    g_proj (Linear(hidden, num_heads) with bias) when use_forget_gate; maybe_q_norm / maybe_k_norm
    (per-head RMSNorm in float32 when use_qk_norm, else Identity).
    Extras (keyword-only): backend for the op (None = automatic), norm_eps, device, dtype.
    """

    def __init__(self, hidden_size=2048, num_heads=32, num_kv_heads=None, use_forget_gate=False,
                 use_qk_norm=False, layer_idx=None, use_low_rank_w=True, use_w_shortconv=True, conv_size=3,
                 conv_bias=False, *, backend=None, norm_eps=1e-5, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size % num_heads != 0 or num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads: hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}), "
                             f"itself a multiple of num_kv_heads ({self.num_kv_heads})")
        self.head_dim = hidden_size // num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.layer_idx = layer_idx
        self.backend = backend

        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False, **fk)
        self.k_proj = nn.Linear(hidden_size, self.kv_dim, bias=False, **fk)
        self.v_proj = nn.Linear(hidden_size, self.kv_dim, bias=False, **fk)
        if use_low_rank_w:
            self.w_proj = nn.Sequential(nn.Linear(hidden_size, 32, bias=False, **fk),
                                        nn.Linear(32, self.kv_dim, bias=False, **fk))
        else:
            self.w_proj = nn.Linear(hidden_size, self.kv_dim, bias=False, **fk)
        self.use_qk_norm = use_qk_norm
        if use_qk_norm:
            self.maybe_q_norm = RMSNorm(self.head_dim, eps=norm_eps, device=device)
            self.maybe_k_norm = RMSNorm(self.head_dim, eps=norm_eps, device=device)
        else:
            self.maybe_q_norm = nn.Identity()
            self.maybe_k_norm = nn.Identity()
        self.use_w_shortconv = use_w_shortconv
        if use_w_shortconv:
            self.w_conv1d = ShortConvolution(self.kv_dim, conv_size, bias=conv_bias, activation="silu", **fk)
        self.bt_proj = nn.Linear(hidden_size, self.num_kv_heads, bias=True, **fk)
        self.use_forget_gate = use_forget_gate
        if use_forget_gate:
            self.g_proj = nn.Linear(hidden_size, num_heads, bias=True, **fk)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False, **fk)

    # -- pieces shared by training, prefill and decode -----------------------------------------------
    def _project(self, x):
        """x [B, T, hidden] -> q [B,T,HQ,D], k, v [B,T,H,D], raw w [B,T,kv_dim], beta [B,T,H] f32, g or None."""
        B, T, _ = x.shape
        q = self.maybe_q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        k = self.maybe_k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        w = self.w_proj(x)
        beta = _acc(self.bt_proj(x)).sigmoid() * 2  # (0, 2): negative eigenvalues allowed
        g = F.logsigmoid(_acc(self.g_proj(x))) if self.use_forget_gate else None
        return q, k, v, w, beta, g

    def _w_heads(self, w):
        B, T, _ = w.shape
        return l2_norm(w.view(B, T, self.num_kv_heads, self.head_dim))

    def _fused_w(self, w):
        """Whether the library's w_conv_norm op takes w: host tensors always, CUDA ones (where FUSED_W_ON_CUDA) in a
        CUDA build for the head dims and widths its kernels have (elsewhere the unfused modules run)."""
        if w.device.type == "cpu":
            return True
        return (FUSED_W_ON_CUDA and w.device.type == "cuda" and _torch_ops.CUDA_BUILT and w.dtype != torch.float64
                and self.head_dim in _torch_ops.W_CONV_NORM_CUDA_HEAD_DIMS
                and (not self.use_w_shortconv or self.w_conv1d.kernel_size[0] <= _torch_ops.W_CONV_NORM_CUDA_MAX_WIDTH))

    def _prepare_w(self, w, cu_seqlens):
        """raw w [B, T, kv_dim] -> [B, T, H, head_dim]: the short convolution with SiLU (use_w_shortconv) and the L2
        norm per head, as one op (w_conv_norm, in w's dtype) where _fused_w, else as ShortConvolution + l2_norm."""
        B, T, _ = w.shape
        conv = self.w_conv1d if self.use_w_shortconv else None
        if not self._fused_w(w):
            if conv is not None:
                w, _ = conv(w, cu_seqlens=cu_seqlens)
            return self._w_heads(w)
        out = w_conv_norm(w, conv.weight if conv is not None else None, conv.bias if conv is not None else None,
                          head_dim=self.head_dim, cu_seqlens=cu_seqlens,
                          activation=conv is not None and conv.activation is not None, backend=self.backend)
        return out.view(B, T, self.num_kv_heads, self.head_dim)

    def _out(self, o):
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.hidden_size))

    @staticmethod
    def _unpad(attention_mask):
        """[B, T] 0/1 mask -> (flat indices of valid tokens, cu_seqlens int64)."""
        valid = attention_mask.bool()
        idx = valid.flatten().nonzero().squeeze(1)
        lens = valid.sum(1)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        return idx, cu

    @staticmethod
    def _pad(y, idx, B, T):
        out = y.new_zeros((B * T,) + tuple(y.shape[2:]))
        out[idx] = y[0]
        return out.view((B, T) + tuple(y.shape[2:]))

    # -- entry points --------------------------------------------------------------------------------
    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                use_cache=False, cu_seqlens=None, **kwargs):
        """fla's calling convention: returns (o, None, past_key_values).

        - past_key_values a PaTHAttentionState: one decode step (hidden_states [N, 1, hidden]).
        - use_cache (no state yet): prefill; returns the new PaTHAttentionState as the third element.
        - otherwise training / plain forward; attention_mask [B, T] (1 = token, 0 = padding) or
          cu_seqlens (packed sequences, B == 1) select variable lengths.
        """
        if isinstance(past_key_values, PaTHAttentionState):
            return self.step(hidden_states, past_key_values), None, past_key_values
        if use_cache:
            o, state = self.prefill(hidden_states, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
            return o, None, state
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: give either attention_mask or cu_seqlens, not both")
            B, T, _ = hidden_states.shape
            idx, cu = self._unpad(attention_mask)
            packed = hidden_states.reshape(B * T, -1)[idx][None]
            return self._pad(self._train(packed, cu), idx, B, T), None, None
        return self._train(hidden_states, cu_seqlens), None, None

    def _train(self, x, cu_seqlens):
        q, k, v, w, beta, g = self._project(x)
        w = self._prepare_w(w, cu_seqlens)
        o, _ = parallel_path_attn(q, k, v, w, beta, g, cu_seqlens=cu_seqlens, backend=self.backend)
        return self._out(o)

    @torch.no_grad()
    def prefill(self, hidden_states, attention_mask=None, cu_seqlens=None, capacity=None):
        """Runs the prompts and returns (o [B, T, hidden], PaTHAttentionState).

        attention_mask [B, T] (0 = padding, any side) or cu_seqlens (B == 1, packed) give each sequence's
        tokens; sequence n becomes slot n of the state, advanced by step().
        """
        def path_state(q, k, v, w, beta, g, cu_seqlens, conv_state):
            o, cache = _decode.prefill(q, k, v, w, beta, g, cu_seqlens=cu_seqlens, capacity=capacity,
                                       backend=self.backend)
            return o, PaTHAttentionState(conv_state, cache)

        return self._prefill_with(path_state, hidden_states, attention_mask, cu_seqlens)

    @torch.no_grad()
    def _prefill_with(self, make_state, hidden_states, attention_mask=None, cu_seqlens=None):
        """prefill() with the cache made by make_state(q, k, v, w, beta, g, cu_seqlens, conv_state) -> (o, state):
        q [B', T', HQ, K] ... as the op takes them (w prepared; B' = 1 and packed by cu_seqlens where a mask was
        given), conv_state [N, kv_dim, W-1] or None; o [B', T', HQ, V]. Returns (y [B, T, hidden], state)."""
        B, T, _ = hidden_states.shape
        idx = None
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: give either attention_mask or cu_seqlens, not both")
            idx, cu_seqlens = self._unpad(attention_mask)
            x = hidden_states.reshape(B * T, -1)[idx][None]
        else:
            x = hidden_states
        q, k, v, w, beta, g = self._project(x)
        # The convolution's state for step(); w itself exactly as the training forward makes it.
        conv_state = self.w_conv1d.final_state(w, cu_seqlens=cu_seqlens) if self.use_w_shortconv else None
        o, state = make_state(q, k, v, self._prepare_w(w, cu_seqlens), beta, g, cu_seqlens, conv_state)
        y = self._out(o)
        if idx is not None:
            y = self._pad(y, idx, B, T)
        return y, state

    @torch.no_grad()
    def step(self, hidden_states, state):
        """One token per sequence: hidden_states [N, 1, hidden] -> [N, 1, hidden]; advances `state` (its
        convolution state here, its cache by state.attend)."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"hidden_states: expected [N, 1, hidden] for a decode step, got {list(hidden_states.shape)}")
        q, k, v, w, beta, g = self._project(hidden_states)
        if self.use_w_shortconv:
            w, state.conv_state = self.w_conv1d(w, cache=state.conv_state, output_final_state=True)
        return self._out(state.attend(q, k, v, self._w_heads(w), beta, g))
