"""PaTHCache: the generation state of a PaTH language model, one entry per layer.

Each layer's entry is one of:
- a pathattn.nn.PaTHAttentionState: the dense fp32 PathCache of pathattn.decode, stepped by the op's decode
  backend (the default on the CPU);
- a PagedAttentionState: a pathattn.PagedCache whose slots are the batch's sequences, keys transported lazily and
  stored in float16 pages (the default on CUDA; docs/design.md, "The paged decode cache");
- a DenseAttentionState, the fallback: the PathCache's transported keys, values and gate sums as plain torch
  tensors, stepped with torch operations (the rank-one key update and a masked softmax). A PathCache layer moves
  to it when the decode backend refuses a step (UnsupportedError or BackendUnavailableError, e.g. more cached
  tokens than the CUDA decode handles), or from the start when the cache is made with PaTHCache(dense=True).
Every kind keeps the layer's short convolution state (conv_state) and is stepped by PaTHAttention.step.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .._pathattn import BackendUnavailableError, UnsupportedError
from ..nn import PaTHAttentionState
from ..paged import PAGED_MAX_PENDING, PagedCache, paged_decode, paged_prefill

# Whether PaTHCache(paged=None), the default, keeps the layers of a model on CUDA in paged form (the PathCache when
# off; PaTHCache's docstring says why). CPU layers keep the PathCache either way. Off until the paged kernels'
# GPU tests (test_gpu.py -k paged, tests/cuda/test_cuda_paged.cpp) have passed on a GPU; PaTHCache(paged=True)
# asks for it explicitly.
PAGED_ON_CUDA = False

# Room (tokens beyond the prompt) a paged layer's block table is made for when no max_length is known, as the
# PathCache's default capacity; a step past it widens the table (a copy of the pool).
PAGED_DEFAULT_ROOM = 256


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

    attend = step  # the name PaTHAttention.step calls

    def reorder(self, idx):
        self.kc, self.vc, self.lengths = self.kc[idx], self.vc[idx], self.lengths[idx]
        if self.gc is not None:
            self.gc = self.gc[idx]
        if self.conv_state is not None:
            self.conv_state = self.conv_state[idx]


class PagedAttentionState:
    """One layer's decode state in a pathattn.PagedCache (N slots: slot n is sequence n of the batch).

    conv_state [N, kv_dim, W-1] or None; cache: the PagedCache (float16 or float32 key pages, values in the model's
    dtype, pool of N * cache.max_pages pages so that every slot can fill its block table row); lengths: the slots'
    lengths as a host int64 array, kept here step by step so that a step reads nothing from the device (the first
    step after the cache is made or copied validates its metadata; later steps pass validate=False).
    """

    def __init__(self, conv_state, cache, lengths):
        self.conv_state = conv_state
        self.cache = cache
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._new_cache()

    def _new_cache(self):
        """After the cache is made, copied or given pages: the slots' capacities (host), a validating next step."""
        c = self.cache
        self._capacity = np.array([c.capacity(s) for s in range(c.num_slots)], dtype=np.int64)
        self._checked = False

    @classmethod
    def prefill(cls, q, k, v, w, beta, g, cu_seqlens, conv_state, *, extra, page_size, pending, key_dtype,
                backend):
        """Prompts into a new PagedCache (pathattn.paged_prefill): q [B, T, HQ, K], ... as the op takes them (B = 1
        and cu_seqlens for sequences of different lengths). extra: new tokens to take pages for at once (None: none
        yet, the block table sized for PAGED_DEFAULT_ROOM). Returns (o [B, T, HQ, V], state)."""
        B, T, HQ, K = q.shape
        H, V = k.shape[2], v.shape[3]
        if cu_seqlens is None:
            lens = [T] * B
        else:
            cu = [int(x) for x in cu_seqlens.tolist()]
            lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        N = len(lens)
        room = PAGED_DEFAULT_ROOM if extra is None else extra
        max_pages = max(1, -(-(max(lens) + room) // page_size))
        cache = PagedCache(N, N * max_pages, page_size, H, K, V, HQ, v.dtype, device=v.device, gate=g is not None,
                           pending=pending, key_dtype=key_dtype, max_pages=max_pages, backend=backend)
        o = paged_prefill(q, k, v, w, beta, g, cache, cu_seqlens=cu_seqlens, extra=extra or 0)
        return o, cls(conv_state, cache, lens)

    def attend(self, q, k, v, w, beta, g):
        """T tokens per slot (pathattn.paged_decode; q [N, T, HQ, K] ...) -> o [N, T, HQ, V]. Takes pages first
        where a slot's run out (reserve), and widens the block table where a row is full."""
        n = q.shape[1]
        need = self.lengths + n
        short = np.nonzero(need > self._capacity)[0].tolist()
        if short:
            c = self.cache
            if int(need.max()) > c.max_pages * c.page_size:  # a row is full: twice the width, a pool to fill it
                width = max(2 * c.max_pages, -(-int(need.max()) // c.page_size))
                self.cache = c = c.widened(c.num_slots * width, width)
            c.reserve(short, n)  # reads the lengths (a copy from the device on CUDA): once a page at most
            self._new_cache()
        o = paged_decode(q, k, v, w, beta, g, self.cache, validate=not self._checked)
        self._checked = True
        self.lengths = need
        return o

    def reorder(self, idx):
        idx = [int(i) for i in idx.tolist()]
        self.cache = self.cache.slots_copied(idx)
        self.lengths = self.lengths[idx]
        if self.conv_state is not None:
            self.conv_state = self.conv_state[torch.as_tensor(idx, device=self.conv_state.device)]
        self._new_cache()

    def __repr__(self):
        return f"PagedAttentionState(lengths={self.lengths.tolist()}, cache={self.cache!r})"


def layer_step(attn, x, state):
    """One decode step of one layer; moves a PathCache layer to the dense form if the decode backend refuses it.
    Returns (y [N, 1, hidden], the layer's state, possibly a new object)."""
    if isinstance(state, PaTHAttentionState):
        conv = state.conv_state
        try:
            return attn.step(x, state), state
        except (UnsupportedError, BackendUnavailableError):
            state.conv_state = conv  # the step failed before its cache write; undo its convolution update
            state = DenseAttentionState.from_path_state(state)
    return attn.step(x, state), state


class PaTHCache:
    """Generation state of a PaTH model: per layer a PaTHAttentionState, a PagedAttentionState or a
    DenseAttentionState.

    PaTHCache(dense=False, paged=None, *, page_size=16, pending=64, key_dtype=torch.float16, max_length=None)

    dense=True: the torch fallback everywhere (DenseAttentionState). paged: True, the PagedCache on every device;
    False, the PathCache; None (default), the PagedCache for layers on CUDA (PAGED_ON_CUDA) and the PathCache on the
    CPU. page_size, pending (the tokens a slot keeps untransported, a flush every `pending` steps; 1 ..
    PAGED_MAX_PENDING) and key_dtype (torch.float16 or torch.float32) shape the paged layers. A layer the paged
    cache cannot take (a float64 model, or a dtype / head dim its backend refuses) keeps the PathCache.
    max_length: the most positions the cache will reach (generate() sets it: prompt plus new tokens), so that a
    paged layer takes its pages at the prompt; without it they are taken as tokens come.

    Why paged on CUDA and dense on the CPU: the paged layer keeps keys in float16 pages and values in the model's
    16-bit dtype (the PathCache holds both in float32: half the bytes or less), and its step reads the cached keys
    once and rewrites them once every `pending` steps where the PathCache's step reads and rewrites them every step
    (docs/design.md, "The paged decode cache"). The price is the rounding of the keys to float16 at each flush: a
    relative error of 1e-4 .. 4e-4 in each layer's attention output (test_paged.py), a tenth of one bf16 rounding;
    greedy tokens then differ from the PathCache's only at near-ties (test_models.py; test_gpu.py on CUDA). On the CPU,
    where a model is mostly checked rather than served, the fp32 PathCache stays the default: its logits equal the
    model's forward to fp32 rounding. float32 key pages (key_dtype=torch.float32) are as exact.

    Made empty by the model on its first forward with use_cache=True (or by generate(), or by the caller), filled
    by the prompt's forward, advanced by each later forward. get_seq_length() is the number of positions seen
    (padding included, as transformers counts them). Beam search reorders it (reorder_cache); a transported key
    cannot be carried back, so it cannot be cropped.
    """

    is_compileable = False

    def __init__(self, dense=False, paged=None, *, page_size=16, pending=64, key_dtype=torch.float16,
                 max_length=None):
        if not isinstance(dense, bool):
            raise TypeError(f"dense: expected a bool, got {type(dense).__name__}")
        if paged is not None and not isinstance(paged, bool):
            raise TypeError(f"paged: expected True, False or None, got {type(paged).__name__}")
        if dense and paged:
            raise ValueError("paged: dense=True and paged=True ask for two kinds of cache; give one")
        for name, x, hi in (("page_size", page_size, 1 << 20), ("pending", pending, PAGED_MAX_PENDING)):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 1 <= x <= hi:
                raise ValueError(f"{name}: expected an int in [1, {hi}], got {x!r}")
        if key_dtype not in (torch.float16, torch.float32):
            raise TypeError(f"key_dtype: expected torch.float16 or torch.float32, got {key_dtype!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral)
                                       or max_length < 0):
            raise ValueError(f"max_length: expected a non-negative int or None, got {max_length!r}")
        self.dense = dense
        self.paged = paged
        self.page_size, self.pending, self.key_dtype = int(page_size), int(pending), key_dtype
        self.max_length = None if max_length is None else int(max_length)
        self.layers = []
        self._seen = 0

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i] if i < len(self.layers) else None

    def _paged_for(self, x):
        """Whether a layer prefilled from x (the prompt's hidden states) takes the paged form."""
        if self.dense or x.dtype == torch.float64:  # the paged cache holds no float64
            return False
        if self.paged is None:
            return PAGED_ON_CUDA and x.device.type == "cuda"
        return self.paged

    def prefill_layer(self, attn, x, attention_mask=None, cu_seqlens=None):
        """The prompt's pass through one layer (attn: a pathattn.nn.PaTHAttention; x [B, T, hidden], mask or
        cu_seqlens as its prefill takes them) -> (y [B, T, hidden], the layer's state in this cache's kind)."""
        if self._paged_for(x):
            extra = None if self.max_length is None else max(self.max_length - self._seen - x.shape[1], 0)

            def paged_state(q, k, v, w, beta, g, cu, conv_state):
                return PagedAttentionState.prefill(q, k, v, w, beta, g, cu, conv_state, extra=extra,
                                                   page_size=self.page_size, pending=self.pending,
                                                   key_dtype=self.key_dtype, backend=attn.backend)
            try:
                return attn._prefill_with(paged_state, x, attention_mask, cu_seqlens)
            except (UnsupportedError, BackendUnavailableError):
                pass  # the backend refuses these inputs in paged form: the PathCache below
        return attn.prefill(x, attention_mask=attention_mask, cu_seqlens=cu_seqlens)

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
            elif isinstance(st, PagedAttentionState):
                st.reorder(beam_idx)
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
        kinds = ["dense" if isinstance(s, DenseAttentionState) else "paged" if isinstance(s, PagedAttentionState)
                 else "path" for s in self.layers]
        return f"PaTHCache(seen={self._seen}, layers={kinds})"
