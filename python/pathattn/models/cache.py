"""PaTHCache: the generation state of a PaTH language model, one entry per layer.

Each layer's entry is a pathattn.nn.PaTHAttentionState (the PathCache of pathattn.decode, stepped by the
op's decode backend) or, as the fallback, a DenseAttentionState: the same transported keys, values and gate
sums as plain torch tensors, stepped with torch operations (the rank-one key update and a masked softmax).
A layer moves to the dense form when the decode backend refuses a step (UnsupportedError or
BackendUnavailableError, e.g. more cached tokens than the CUDA decode handles), or from the start when the
cache is made with PaTHCache(dense=True).
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .._pathattn import BackendUnavailableError, UnsupportedError
from ..nn import PaTHAttentionState


@dataclass
class DenseAttentionState:
    """One layer's decode state as torch tensors (N sequences, capacity C; layout of pathattn.PathCache).

    conv_state [N, kv_dim, W-1] or None; kc [N, H, C, K] and vc [N, H, C, V] float32 (float64 for a float64
    model), kc_j already transported to the sequence's last token; gc [N, HQ, C] float64 inclusive gate sums
    or None; lengths [N] int64 on the cache's device; scale and gate_scale as floats.
    """
    conv_state: Optional[torch.Tensor]
    kc: torch.Tensor
    vc: torch.Tensor
    gc: Optional[torch.Tensor]
    lengths: torch.Tensor
    scale: float
    gate_scale: float

    @classmethod
    def from_path_state(cls, state):
        """Takes over a PaTHAttentionState's arrays (no copy of the cached keys)."""
        c = state.cache
        K = c.kc.shape[3]
        scale = 1.0 / math.sqrt(K) if math.isnan(c.scale) else float(c.scale)
        gate_scale = scale if math.isnan(c.gate_scale) else float(c.gate_scale)
        lengths = torch.as_tensor(c.lengths, dtype=torch.long).to(c.kc.device)
        return cls(state.conv_state, c.kc, c.vc, c.gc, lengths, scale, gate_scale)

    def _grow(self, need):
        C = self.kc.shape[2]
        if need <= C:
            return
        extra = max(need, 2 * C) - C
        pad = lambda x: torch.cat([x, x.new_zeros(x.shape[:2] + (extra,) + x.shape[3:])], dim=2)
        self.kc, self.vc = pad(self.kc), pad(self.vc)
        if self.gc is not None:
            self.gc = pad(self.gc)

    def step(self, q, k, v, w, beta, g):
        """One token per sequence (docs/spec.md, section 6): q [N,1,HQ,K], k [N,1,H,K], v [N,1,H,V],
        w [N,1,H,K] (unit rows), beta [N,1,H], g [N,1,HQ] or None -> o [N,1,HQ,V] in v's dtype."""
        N, _, HQ, _ = q.shape
        H = k.shape[2]
        dt = self.kc.dtype
        wt, bt = w[:, 0].to(dt), beta[:, 0].to(dt)  # [N, H, K], [N, H]
        # 1. transport every cached key by the new token's H_t = I - beta w w^T (empty rows stay zero)
        proj = torch.einsum("nhck,nhk->nhc", self.kc, wt)
        self.kc = self.kc - (bt[:, :, None] * proj)[..., None] * wt[:, :, None, :]
        # 2. append k, v and G at each sequence's own length
        self._grow(int(self.lengths.max()) + 1)
        n = torch.arange(N, device=self.kc.device)
        pos = self.lengths
        self.kc[n, :, pos] = k[:, 0].to(dt)
        self.vc[n, :, pos] = v[:, 0].to(dt)
        if self.gc is not None:
            prev = self.gc[n, :, (pos - 1).clamp(min=0)] * (pos > 0).to(self.gc.dtype)[:, None]
            g_new = prev + g[:, 0].to(self.gc.dtype)  # [N, HQ]
            self.gc[n, :, pos] = g_new
        self.lengths = self.lengths + 1
        # 3. attend over the cache; query head h reads kv head h / (HQ / H)
        kr = self.kc.repeat_interleave(HQ // H, dim=1)
        vr = self.vc.repeat_interleave(HQ // H, dim=1)
        s = self.scale * torch.einsum("nhk,nhck->nhc", q[:, 0].to(dt), kr)
        if self.gc is not None:
            s = s + (self.gate_scale * (g_new[:, :, None] - self.gc)).to(dt)
        C = self.kc.shape[2]
        valid = torch.arange(C, device=s.device)[None, :] < self.lengths[:, None]  # [N, C]
        p = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
        o = torch.einsum("nhc,nhcv->nhv", p, vr)
        return o[:, None].to(v.dtype)

    def reorder(self, idx):
        self.kc, self.vc, self.lengths = self.kc[idx], self.vc[idx], self.lengths[idx]
        if self.gc is not None:
            self.gc = self.gc[idx]
        if self.conv_state is not None:
            self.conv_state = self.conv_state[idx]


def dense_layer_step(attn, x, state):
    """pathattn.nn.PaTHAttention.step with the cache held as a DenseAttentionState (x [N, 1, hidden])."""
    q, k, v, w, beta, g = attn._project(x)
    if attn.use_w_shortconv:
        w, state.conv_state = attn.w_conv1d(w, cache=state.conv_state, output_final_state=True)
    return attn._out(state.step(q, k, v, attn._w_heads(w), beta, g))


def layer_step(attn, x, state):
    """One decode step of one layer; moves the layer to the dense form if the decode backend refuses it.
    Returns (y [N, 1, hidden], the layer's state, possibly a new object)."""
    if isinstance(state, PaTHAttentionState):
        conv = state.conv_state
        try:
            return attn.step(x, state), state
        except (UnsupportedError, BackendUnavailableError):
            state.conv_state = conv  # the step failed before its cache write; undo its convolution update
            state = DenseAttentionState.from_path_state(state)
    return dense_layer_step(attn, x, state), state


class PaTHCache:
    """Generation state of a PaTH model: per layer a PaTHAttentionState or a DenseAttentionState.

    Made empty by the model on its first forward with use_cache=True (or by the caller, PaTHCache(dense=True)
    for the torch fallback everywhere), filled by the prompt's forward, advanced by each later forward.
    get_seq_length() is the number of positions seen (padding included, as transformers counts them).
    Beam search reorders it (reorder_cache); a transported key cannot be carried back, so it cannot be cropped.
    """

    is_compileable = False

    def __init__(self, dense=False):
        self.dense = bool(dense)
        self.layers = []
        self._seen = 0

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i] if i < len(self.layers) else None

    def set_layer(self, i, state):
        """Stores layer i's state (a prompt's state becomes dense here when the cache is dense)."""
        if self.dense and isinstance(state, PaTHAttentionState):
            state = DenseAttentionState.from_path_state(state)
        while len(self.layers) <= i:
            self.layers.append(None)
        self.layers[i] = state

    def advance(self, num_tokens):
        self._seen += int(num_tokens)

    def get_seq_length(self, layer_idx=0):
        return self._seen

    def get_max_cache_shape(self, layer_idx=0):
        return -1  # grows without bound

    def reorder_cache(self, beam_idx):
        """Beam search: sequence n of the cache becomes sequence beam_idx[n] of the old one."""
        for st in self.layers:
            if isinstance(st, DenseAttentionState):
                st.reorder(beam_idx.to(st.kc.device))
            elif st is not None:
                c = st.cache
                idx = beam_idx.to(c.kc.device)
                c.kc, c.vc = c.kc[idx], c.vc[idx]
                if c.gc is not None:
                    c.gc = c.gc[idx]
                c.lengths = c.lengths[beam_idx.cpu().numpy()]
                if st.conv_state is not None:
                    st.conv_state = st.conv_state[idx]

    def crop(self, max_length):
        raise NotImplementedError("PaTHCache.crop: the cached keys are transported to the last token and cannot "
                                  "be carried back; decoding strategies that roll back the cache are not supported")

    def __repr__(self):
        kinds = ["dense" if isinstance(s, DenseAttentionState) else "path" for s in self.layers]
        return f"PaTHCache(seen={self._seen}, layers={kinds})"
