"""pathattn.decode: inference with PaTH attention (docs/spec.md, decode), for numpy arrays and torch tensors.

``prefill`` runs the forward over prompts and returns a ``PathCache`` of keys transported to each prompt's
end; ``decode_step`` appends one token per sequence, updating the cached keys in place with the rank-one
Householder step, and returns its output. The cache is kept in float32 (float64 for float64 inputs), not
in the model's dtype, so long generations do not drift. For CUDA tensors the cache lives on their device
(kc, vc float32, gc float64) and the cuda backend fills and updates it there; lengths stay a host array. Decoding is inference only: nothing here is
differentiable.

Threads: a PathCache may be shared between threads; its steps are serialised by a lock (each decode_step is
atomic, their order is the order the lock is taken). Torch CUDA steps from different streams are ordered too:
a step waits for the previous step's stream. Separate caches share nothing.
"""
import threading

import numpy as np

from . import _api
from . import _pathattn as _C
from ._cache import _empty, _float_dtype, _host_lengths, _is_numpy, _plain, _run_prefill, _stream, _zeros


class PathCache:
    """Decode state of N independent sequences (docs/spec.md, decode).

    Attributes (numpy arrays or torch tensors on the inputs' device, float32 or float64):
        kc [N, H, C, K]: cached keys, transported to the sequence's last token.
        vc [N, H, C, V]: cached values.   gc [N, HQ, C] or None: inclusive gate cumsums G_j.
        lengths [N] (numpy int64, host): tokens cached per sequence.
        scale, gate_scale: the forward's scales (NaN means the default), reused by every step.
        backend: the backend code the steps run on.
    C (``capacity``) grows automatically (doubling) when a step needs room.
    Steps (decode_step, reserve) from several threads are serialised by the cache's lock.
    """

    def __init__(self, kc, vc, gc, lengths, scale, gate_scale, backend):
        self.kc, self.vc, self.gc, self.lengths = kc, vc, gc, lengths
        self.scale, self.gate_scale, self.backend = scale, gate_scale, backend
        self._lock = threading.RLock()
        self._stream = None  # the torch CUDA stream of the last step

    @property
    def num_seqs(self):
        return self.kc.shape[0]

    @property
    def capacity(self):
        return self.kc.shape[2]

    def keys(self, n):
        """Transported keys of sequence n: [H, lengths[n], K]."""
        return self.kc[n, :, : int(self.lengths[n])]

    def values(self, n):
        return self.vc[n, :, : int(self.lengths[n])]

    def reserve(self, capacity):
        """Grows every slot to hold at least `capacity` tokens (copies the cached ones)."""
        with self._lock:
            self._reserve(capacity)

    def _reserve(self, capacity):
        cap = self.capacity
        if capacity <= cap:
            return
        N, H, _, K = self.kc.shape
        V = self.vc.shape[3]
        kc = _zeros(self.kc, (N, H, capacity, K), self.kc.dtype)
        vc = _zeros(self.vc, (N, H, capacity, V), self.vc.dtype)
        kc[:, :, :cap] = self.kc
        vc[:, :, :cap] = self.vc
        if self.gc is not None:
            gc = _zeros(self.gc, (N, self.gc.shape[1], capacity), self.gc.dtype)
            gc[:, :, :cap] = self.gc
            self.gc = gc
        self.kc, self.vc = kc, vc

    def __repr__(self):
        return (f"PathCache(num_seqs={self.num_seqs}, capacity={self.capacity}, "
                f"lengths={self.lengths.tolist()}, gate={self.gc is not None})")


def prefill(q, k, v, w, beta, g=None, scale=None, cu_seqlens=None, *, gate_scale=None, capacity=None,
            return_lse=False, backend=None, validate=False):
    """Runs the forward over prompts and returns (o, cache) [or (o, cache, lse) with return_lse].

    Arguments are those of parallel_path_attn (numpy arrays or torch tensors, same shapes and dtypes).
    Sequence n of the batch (batch row n, or varlen sequence n of cu_seqlens) becomes cache slot n.
    capacity: tokens each slot can hold before decode_step has to grow the cache (default: the longest
    prompt + 256).
    validate: as in parallel_path_attn.
    """
    kind, scale, gate_scale, code = _api._common_args(q, k, v, w, beta, g, scale, gate_scale, backend)
    return_lse = _api.bool_arg("return_lse", return_lse)
    validate = _api.bool_arg("validate", validate)
    if kind == "numpy":
        cu_seqlens = _api.numpy_cu_seqlens(cu_seqlens)
    elif cu_seqlens is not None and not isinstance(cu_seqlens, _api.TorchTensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))
                                 or capacity < 0):
        raise ValueError(f"capacity: expected a non-negative int or None, got {capacity!r}")
    s = _api.NAN if scale is None else scale
    gs = _api.NAN if gate_scale is None else gate_scale
    if kind == "numpy":
        _C.check_inputs(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu_seqlens, scale=s, gate_scale=gs,
                        backend=code, chunk_size=0)  # before any output is allocated
    B, T, HQ, _ = q.shape
    o = _empty(q, (B, T, HQ, v.shape[3]), v.dtype)
    lse = _empty(q, (B, T, HQ), _float_dtype(q)) if return_lse else None
    if capacity is None:
        extra = 256
    else:
        lens = _host_lengths(cu_seqlens)
        longest = T if cu_seqlens is None else (int(lens.max()) if lens is not None and len(lens) else 0)
        extra = max(int(capacity) - longest, 0)
    kc, vc, gc, lengths = _run_prefill(q, k, v, w, beta, g, cu_seqlens, o, lse, s, gs, code, extra, validate)
    cache = PathCache(kc, vc, gc, lengths, s, gs, code)
    return (o, cache, lse) if return_lse else (o, cache)


def decode_step(cache, q, k, v, w, beta, g=None, *, return_lse=False):
    """One token for every sequence of the cache: returns o [N, 1, HQ, V] (and lse [N, 1, HQ]).

    q [N, 1, HQ, K], k [N, 1, H, K], v [N, 1, H, V] (one dtype), w [N, 1, H, K] and beta [N, 1, H],
    g [N, 1, HQ] exactly when the cache was prefilled with a gate (w, beta, g: any float dtype, as in the
    forward). Every cached key is first
    transported by the new token's Householder step, then k, v, G are appended, then the token attends
    to the whole cache: o = softmax_j(scale q . kc_j + gate_scale (G_new - G_j)) v_j.
    """
    if not isinstance(cache, PathCache):
        raise TypeError(f"cache: expected a pathattn.PathCache (from pathattn.prefill), got {type(cache).__name__}")
    kind = _api.array_kind("q", q)
    kinds = "numpy" if _is_numpy(cache.kc) else "torch"
    if kind != kinds:
        raise TypeError(f"q: the cache holds {kinds} arrays but q is a {kind} array")
    _api.check_same_kind(kind, "k", k, optional=False)
    _api.check_same_kind(kind, "v", v, optional=False)
    _api.check_same_kind(kind, "w", w)
    _api.check_same_kind(kind, "beta", beta)
    _api.check_same_kind(kind, "g", g)
    return_lse = _api.bool_arg("return_lse", return_lse)
    _api.check_ndim("q", q, 4, "[N, 1, HQ, K]")
    _api.check_ndim("v", v, 4, "[N, 1, H, V]")
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
        _api.check_numpy_layout(name, x)
    with cache._lock:  # one step at a time (see the module's docstring)
        for name, x in (("cache.kc", cache.kc), ("cache.vc", cache.vc), ("cache.gc", cache.gc),
                        ("cache.lengths", cache.lengths)):
            _api.check_numpy_layout(name, x, writable=True)
        if not _is_numpy(q) and q.device.type == "cuda":
            import torch

            cur = torch.cuda.current_stream(q.device)
            if cache._stream is not None and cache._stream != cur:
                cur.wait_stream(cache._stream)  # the previous step ran on another stream
            cache._stream = cur
        if int(_max_len(cache.lengths)) >= cache.capacity:
            cache._reserve(max(2 * cache.capacity, cache.capacity + 64))
        N, _, HQ, _ = q.shape
        o = _empty(q, (N, 1, HQ, v.shape[3]), v.dtype)
        lse = _empty(q, (N, 1, HQ), _float_dtype(q)) if return_lse else None
        _C.decode(q=_plain(q), k=_plain(k), v=_plain(v), w=_plain(w), beta=_plain(beta), g=_plain(g), o=o, lse=lse,
                  kc=cache.kc, vc=cache.vc, gc=cache.gc, lengths=cache.lengths, scale=cache.scale,
                  gate_scale=cache.gate_scale, backend=cache.backend, num_threads=0, stream=_stream(q))
    return (o, lse) if return_lse else o


def _max_len(lengths):
    return lengths.max() if len(lengths) else 0
