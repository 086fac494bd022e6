"""pathattn.paged: serving-side decoding with a paged cache of lazily transported keys (docs/design.md, "The
decode cache's next format"; the C++ API is include/pathattn/paged.h), for torch tensors (CPU and CUDA) and
numpy arrays.

``PagedCache`` owns a pool of pages shared by its request slots, a block table per slot and the slots'
metadata (lengths, flush points, pending tokens), all on the cache's device; a page allocator on the host
hands pages to slots (``paged_prefill`` / ``PagedCache.insert``, ``PagedCache.reserve``) and takes them back
(``PagedCache.evict``). ``paged_decode`` runs T tokens of every slot; with ``validate=False`` it reads nothing on
the host, so a step can be captured in a CUDA graph and replayed. Inference only: nothing is differentiable.
"""
import numbers
import threading

import numpy as np

from . import _api
from . import _pathattn as _C
from ._cache import _empty, _float_dtype, _host_lengths, _is_numpy, _plain, _stream

PAGED_MAX_PENDING = _C.PAGED_MAX_PENDING


class PoolExhaustedError(RuntimeError):
    """The page pool has fewer free pages than an insert or reserve needs (evict a slot, or make the pool
    larger)."""


def _int_arg(name, x, lo=None):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x}")
    return x


def _torch():
    import torch

    return torch


def _is_torch_dtype(dt):
    if _api.TorchTensor is _api._NoTorch:
        return False
    return isinstance(dt, _torch().dtype)


class PagedCache:
    """A paged decode cache for num_slots request slots (include/pathattn/paged.h).

    PagedCache(num_slots, num_pages, page_size, H, K, V, HQ, dtype, device=None, gate=False, pending=64,
               key_dtype=None, path=True, *, max_pages=None, scale=None, gate_scale=None, backend=None)

    dtype: the values' dtype, that of the steps' q, k, v: a torch dtype (torch tensors on `device`, default the
    CPU) or a numpy dtype (numpy arrays; device None or "cpu"). key_dtype: the key pages' dtype, float16
    (default) or float32, of the same kind. gate: the slots keep gate sums (every call passes g). pending: S,
    the tokens a slot keeps untransported between flushes (1 .. PAGED_MAX_PENDING). path=False: plain
    attention (no w, beta). max_pages: block table width, the most pages one slot may hold (default
    num_pages). scale, gate_scale, backend: as in parallel_path_attn, used by every call on this cache.

    Arrays (on the cache's device):
        k_pages [P, page, H, K] key_dtype   v_pages [P, page, H, V] dtype   g_pages [P, page, HQ] f64 or None
        block_table [num_slots, max_pages] int32 (-1: no page)   lengths, flushed [num_slots] int32 (-1: free)
        pend_k [num_slots, S, H, K] f32   pend_w [num_slots, S, H, K] f32, pend_beta [num_slots, S, H] f32
        (None with path=False)
    Steps (paged_prefill, paged_decode, insert, evict, reserve) from several threads are serialised by the
    cache's lock.
    """

    def __init__(self, num_slots, num_pages, page_size, H, K, V, HQ, dtype, device=None, gate=False, pending=64,
                 key_dtype=None, path=True, *, max_pages=None, scale=None, gate_scale=None, backend=None):
        num_slots = _int_arg("num_slots", num_slots, 1)
        num_pages = _int_arg("num_pages", num_pages, 1)
        page_size = _int_arg("page_size", page_size, 1)
        H, K, V, HQ = (_int_arg(n, x, 1) for n, x in (("H", H), ("K", K), ("V", V), ("HQ", HQ)))
        if HQ % H:
            raise ValueError(f"HQ: expected a multiple of H = {H}, got {HQ}")
        pending = _int_arg("pending", pending, 1)
        if pending > PAGED_MAX_PENDING:
            raise ValueError(f"pending: expected 1 .. {PAGED_MAX_PENDING}, got {pending}")
        max_pages = num_pages if max_pages is None else _int_arg("max_pages", max_pages, 1)
        gate = _api.bool_arg("gate", gate)
        path = _api.bool_arg("path", path)
        self.scale = _api.NAN if _api.float_arg("scale", scale) is None else float(scale)
        self.gate_scale = _api.NAN if _api.float_arg("gate_scale", gate_scale) is None else float(gate_scale)
        self.backend = _api.backend_code(backend)

        if _is_torch_dtype(dtype):
            torch = _torch()
            self._numpy = False
            dev = torch.device("cpu" if device is None else device)
            kdt = torch.float16 if key_dtype is None else key_dtype
            if kdt not in (torch.float16, torch.float32):
                raise TypeError(f"key_dtype: expected torch.float16 or torch.float32, got {kdt}")
            if dtype == torch.float64:
                raise TypeError("dtype: float64 is not supported by the paged cache (its key pages are float16 or "
                                "float32); use the dense PathCache (pathattn.prefill) for fp64")

            def full(shape, dt, value):
                return torch.full(shape, value, dtype=dt, device=dev)

            i32, f32, f64 = torch.int32, torch.float32, torch.float64
        else:
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise TypeError(f"dtype: expected a torch or numpy dtype, got {dtype!r}") from None
            if device not in (None, "cpu"):
                raise ValueError(f"device: numpy caches live in host memory (device None or 'cpu'), got {device!r}")
            self._numpy = True
            dtype = dt
            try:
                kdt = np.dtype(np.float16 if key_dtype is None else key_dtype)
            except TypeError:
                raise TypeError(f"key_dtype: expected numpy.float16 or numpy.float32, got {key_dtype!r}") from None
            if kdt not in (np.float16, np.float32):
                raise TypeError(f"key_dtype: expected numpy.float16 or numpy.float32, got {kdt}")
            if dtype == np.float64:
                raise TypeError("dtype: float64 is not supported by the paged cache (its key pages are float16 or "
                                "float32); use the dense PathCache (pathattn.prefill) for fp64")

            def full(shape, dt, value):
                return np.full(shape, value, dtype=dt)

            i32, f32, f64 = np.int32, np.float32, np.float64

        P, S = num_pages, pending
        self.k_pages = full((P, page_size, H, K), kdt, 0)
        self.v_pages = full((P, page_size, H, V), dtype, 0)
        self.g_pages = full((P, page_size, HQ), f64, 0) if gate else None
        self.block_table = full((num_slots, max_pages), i32, -1)
        self.lengths = full((num_slots,), i32, -1)
        self.flushed = full((num_slots,), i32, -1)
        self.pend_k = full((num_slots, S, H, K), f32, 0)
        self.pend_w = full((num_slots, S, H, K), f32, 0) if path else None
        self.pend_beta = full((num_slots, S, H), f32, 0) if path else None
        # The allocator (host): free pages (popped from the end: page 0 first) and each slot's pages in order;
        # a slot is in use from its prefill to its eviction.
        self._free = list(range(P - 1, -1, -1))
        self._pages = [[] for _ in range(num_slots)]
        self._used = [False] * num_slots
        self._lock = threading.RLock()
        self._stream = None  # the torch CUDA stream of the last step

    # -- shape and allocator state --------------------------------------------------------------------------
    @property
    def num_slots(self):
        return self.block_table.shape[0]

    @property
    def max_pages(self):
        return self.block_table.shape[1]

    @property
    def num_pages(self):
        return self.k_pages.shape[0]

    @property
    def page_size(self):
        return self.k_pages.shape[1]

    @property
    def pending(self):
        """S: the most tokens a slot keeps untransported (a flush every S steps)."""
        return self.pend_k.shape[1]

    @property
    def gate(self):
        return self.g_pages is not None

    @property
    def path(self):
        return self.pend_w is not None

    @property
    def device(self):
        return "cpu" if self._numpy else self.k_pages.device

    @property
    def free_pages(self):
        """Pages not held by any slot."""
        return len(self._free)

    def in_use(self, slot):
        """True from the slot's prefill (insert) to its eviction."""
        return self._used[self._slot_arg("slot", slot)]

    def pages(self, slot):
        """The pool pages slot holds, in token order (a copy of its block table row's host mirror)."""
        return list(self._pages[self._slot_arg("slot", slot)])

    def capacity(self, slot):
        """Tokens the slot's pages hold."""
        return len(self._pages[self._slot_arg("slot", slot)]) * self.page_size

    def host_lengths(self):
        """lengths as a host numpy int32 array (-1: free slot). For a CUDA cache this copies it from the device
        and so waits for the steps queued before."""
        if self._numpy:
            return self.lengths.copy()
        if self._stream is not None and self.lengths.device.type == "cuda":
            _torch().cuda.current_stream(self.lengths.device).wait_stream(self._stream)  # the last step's stream
        return self.lengths.cpu().numpy()

    # -- allocator ------------------------------------------------------------------------------------------
    def _slot_arg(self, name, slot):
        slot = _int_arg(name, slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{name}: expected a slot in [0, {self.num_slots}), got {slot}")
        return slot

    def _write_row(self, slot):
        """Writes the slot's block table row from its page list (-1 past its pages)."""
        row = np.full((self.max_pages,), -1, np.int32)
        row[:len(self._pages[slot])] = self._pages[slot]
        if self._numpy:
            self.block_table[slot] = row
        else:
            self.block_table[slot].copy_(_torch().from_numpy(row))

    def _grow(self, want):
        """want: {slot: tokens its pages must hold}. Takes the pages from the pool, all or none."""
        extra = {}
        for slot, tokens in want.items():
            n = -(-tokens // self.page_size) - len(self._pages[slot])
            if n > 0:
                if len(self._pages[slot]) + n > self.max_pages:
                    raise ValueError(f"n_tokens: slot {slot} would need {len(self._pages[slot]) + n} pages for "
                                     f"{tokens} tokens, more than max_pages = {self.max_pages}")
                extra[slot] = n
        total = sum(extra.values())
        if total > len(self._free):
            raise PoolExhaustedError(f"the page pool is exhausted: {total} more pages needed (slots "
                                     f"{sorted(extra)}), {len(self._free)} of {self.num_pages} free; evict a slot "
                                     f"or create the cache with more pages")
        for slot, n in extra.items():
            self._pages[slot] += [self._free.pop() for _ in range(n)]
            self._write_row(slot)

    def _release(self, slot):
        self._free += reversed(self._pages[slot])
        self._pages[slot] = []
        self._used[slot] = False
        self._write_row(slot)
        self.lengths[slot] = -1
        self.flushed[slot] = -1

    def reserve(self, slot, n_tokens):
        """Makes the block table rows of `slot` (an int, a list of ints, or None: every slot in use) cover
        n_tokens more tokens than they hold now, taking pages from the pool (all or none:
        PoolExhaustedError when the pool has too few). Reads the lengths (a copy from the device on CUDA)."""
        n_tokens = _int_arg("n_tokens", n_tokens, 0)
        with self._lock:
            if slot is None:
                slots = [s for s in range(self.num_slots) if self._used[s]]
            elif isinstance(slot, (list, tuple, range)):
                slots = [self._slot_arg("slot", s) for s in slot]
            else:
                slots = [self._slot_arg("slot", slot)]
            for s in slots:
                if not self._used[s]:
                    raise ValueError(f"slot: slot {s} is free (insert a prompt first)")
            lens = self.host_lengths()
            self._grow({s: int(lens[s]) + n_tokens for s in slots})

    def evict(self, slot):
        """Frees the slot: its pages go back to the pool, lengths and flushed become -1 (steps skip it)."""
        with self._lock:
            slot = self._slot_arg("slot", slot)
            if not self._used[slot]:
                raise ValueError(f"slot: slot {slot} is already free")
            self._release(slot)

    def insert(self, slot, q, k, v, w=None, beta=None, g=None, *, extra=0, return_lse=False, validate=False):
        """Prefills one prompt (q [1, L, HQ, K], ...) into the free `slot`: paged_prefill with slots=[slot]."""
        slot = self._slot_arg("slot", slot)
        return paged_prefill(q, k, v, w, beta, g, self, slots=[slot], extra=extra, return_lse=return_lse,
                             validate=validate)

    def clone(self):
        """A copy of the cache: its arrays (on the same device) and its allocator state."""
        with self._lock:
            c = PagedCache.__new__(PagedCache)
            c.__dict__.update(self.__dict__)
            for name in ("k_pages", "v_pages", "g_pages", "block_table", "lengths", "flushed", "pend_k", "pend_w",
                         "pend_beta"):
                x = getattr(self, name)
                setattr(c, name, None if x is None else x.copy() if self._numpy else x.clone())
            c._free = list(self._free)
            c._pages = [list(p) for p in self._pages]
            c._used = list(self._used)
            c._lock = threading.RLock()
            c._stream = None
            return c

    def widened(self, num_pages, max_pages):
        """A torch cache equal to this one with a pool of num_pages pages and a block table max_pages wide, both at
        least as large: the pages keep their indices, so the rows, the metadata and the allocator's state carry
        over (the new pages join the free list). This cache is not to be used after."""
        with self._lock:
            P, M = self.num_pages, self.max_pages
            c = PagedCache.__new__(PagedCache)
            c.__dict__.update(self.__dict__)
            for name in ("k_pages", "v_pages", "g_pages"):
                x = getattr(self, name)
                if x is not None:
                    y = x.new_zeros((num_pages,) + tuple(x.shape[1:]))
                    y[:P] = x
                    setattr(c, name, y)
            c.block_table = self.block_table.new_full((self.num_slots, max_pages), -1)
            c.block_table[:, :M] = self.block_table
            c._free = list(range(num_pages - 1, P - 1, -1)) + list(self._free)
            c._pages = [list(p) for p in self._pages]
            c._used = list(self._used)
            c._lock = threading.RLock()
            return c

    def slots_copied(self, idx):
        """A torch cache whose slot n is a copy of slot idx[n] of this one (beam search: a slot may be copied to
        several slots, each then owning its own pages, since a flush rewrites its slot's pages in place)."""
        torch = _torch()
        with self._lock:
            src = [self._pages[s] for s in idx]
            total = sum(len(p) for p in src)
            c = self.widened(max(self.num_pages, total), self.max_pages)
            # the pages of the new slots, in slot order from page 0; the old contents gathered into them
            gather = torch.tensor([p for ps in src for p in ps], dtype=torch.long, device=self.k_pages.device)
            for name in ("k_pages", "v_pages", "g_pages"):
                x = getattr(c, name)
                if x is not None:
                    x[:total] = getattr(self, name)[gather]
            rows = torch.as_tensor(idx, dtype=torch.long, device=self.lengths.device)
            for name in ("lengths", "flushed", "pend_k", "pend_w", "pend_beta"):
                x = getattr(self, name)
                if x is not None:
                    setattr(c, name, x[rows])
            c._pages, first = [], 0
            for ps in src:
                c._pages.append(list(range(first, first + len(ps))))
                first += len(ps)
            c._used = [self._used[s] for s in idx]
            c._free = list(range(c.num_pages - 1, total - 1, -1))
            table = np.full((c.num_slots, c.max_pages), -1, np.int32)
            for n, ps in enumerate(c._pages):
                table[n, :len(ps)] = ps
            c.block_table = torch.from_numpy(table).to(self.block_table.device)
            return c

    def _views(self):
        return dict(k_pages=self.k_pages, v_pages=self.v_pages, g_pages=self.g_pages, block_table=self.block_table,
                    lengths=self.lengths, flushed=self.flushed, pend_k=self.pend_k, pend_w=self.pend_w,
                    pend_beta=self.pend_beta)

    def _order_stream(self, q):
        """Torch CUDA: a step waits for the previous step's stream (not while a CUDA graph is captured: the
        capture orders its own work)."""
        if self._numpy or q.device.type != "cuda":
            return
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            return
        cur = torch.cuda.current_stream(q.device)
        if self._stream is not None and self._stream != cur:
            cur.wait_stream(self._stream)
        self._stream = cur

    def __repr__(self):
        used = [s for s in range(self.num_slots) if self._used[s]]
        return (f"PagedCache(num_slots={self.num_slots}, num_pages={self.num_pages}, page_size={self.page_size}, "
                f"pending={self.pending}, key_dtype={self.k_pages.dtype}, gate={self.gate}, path={self.path}, "
                f"slots_in_use={used}, free_pages={self.free_pages})")


def _check_cache_args(cache, q, k, v, w, beta, g):
    if not isinstance(cache, PagedCache):
        raise TypeError(f"cache: expected a pathattn.PagedCache, got {type(cache).__name__}")
    kind = _api.array_kind("q", q)
    kinds = "numpy" if cache._numpy else "torch"
    if kind != kinds:
        raise TypeError(f"q: the cache holds {kinds} arrays but q is a {kind} array")
    if (w is None) != (beta is None):
        raise ValueError(f"{'beta' if w is not None else 'w'}: w and beta must be given together "
                         "(both None means plain causal attention)")
    for name, x in (("k", k), ("v", v)):
        _api.check_same_kind(kind, name, x, optional=False)
    for name, x in (("w", w), ("beta", beta), ("g", g)):
        _api.check_same_kind(kind, name, x)
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
        _api.check_numpy_layout(name, x)
    _api.check_ndim("q", q, 4, "[N, T, HQ, K]")
    _api.check_ndim("k", k, 4, "[N, T, H, K]")
    _api.check_ndim("v", v, 4, "[N, T, H, V]")
    if kind == "torch":
        for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
            if x is not None and x.device != cache.device:
                raise ValueError(f"{name}: on {x.device}, but the cache is on {cache.device}")
    return kind


def paged_prefill(q, k, v, w, beta, g, cache, slots=None, cu_seqlens=None, *, extra=0, return_lse=False,
                  validate=False):
    """Runs the forward over prompts and writes sequence n into cache slot slots[n]: o [or (o, lse)].

    q, k, v, w, beta, g, cu_seqlens: as in parallel_path_attn (batch row n, or varlen sequence n of cu_seqlens,
    is sequence n); the cache's scale, gate_scale and backend apply. slots: a list / array of distinct free slots,
    one per sequence (default: slot n for sequence n). Each slot gets pages for its prompt plus `extra` tokens
    (all or none: PoolExhaustedError when the pool has too few); its keys are transported to the prompt's end
    (nothing pending). Other slots are untouched, so this inserts requests into a running batch.
    validate: as in parallel_path_attn (a scan of the inputs). Returns o [B, T, HQ, V] in v's dtype (lse
    [B, T, HQ] float32 with return_lse).
    """
    kind = _check_cache_args(cache, q, k, v, w, beta, g)
    extra = _int_arg("extra", extra, 0)
    return_lse = _api.bool_arg("return_lse", return_lse)
    validate = _api.bool_arg("validate", validate)
    if kind == "numpy":
        cu_seqlens = _api.numpy_cu_seqlens(cu_seqlens)
    elif cu_seqlens is not None:
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens = _torch().tensor(_api.int_list("cu_seqlens", cu_seqlens), dtype=_torch().int64)
        elif not isinstance(cu_seqlens, _api.TorchTensor):
            raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        cu_seqlens = cu_seqlens.detach().cpu()  # the library reads it in host memory
    # The forward's checks first: the sequence lengths below rely on a well-formed cu_seqlens.
    _C.check_inputs(q=_plain(q), k=_plain(k), v=_plain(v), w=_plain(w), beta=_plain(beta), g=_plain(g),
                    cu_seqlens=cu_seqlens, scale=cache.scale, gate_scale=cache.gate_scale, backend=cache.backend,
                    chunk_size=0)
    B, T, HQ, _ = q.shape
    lens = [T] * B if cu_seqlens is None else [int(x) for x in _host_lengths(cu_seqlens)]
    if slots is None:
        slot_list = list(range(len(lens)))
    else:
        if not _is_numpy(slots) and isinstance(slots, _api.TorchTensor):
            slots = slots.detach().cpu().numpy()
        if isinstance(slots, np.ndarray):
            if slots.ndim != 1 or slots.dtype.kind not in "iu":
                raise TypeError(f"slots: expected a 1-D integer array, got {slots.dtype} {list(slots.shape)}")
            slots = slots.tolist()
        if not isinstance(slots, (list, tuple, range)):
            raise TypeError(f"slots: expected a list of ints or an integer array, got {type(slots).__name__}")
        slot_list = [cache._slot_arg("slots", s) for s in slots]
    if len(slot_list) != len(lens):
        raise ValueError(f"slots: expected one slot per sequence ({len(lens)}), got {len(slot_list)}")
    if len(set(slot_list)) != len(slot_list):
        raise ValueError(f"slots: expected distinct slots, got {slot_list}")
    o = _empty(q, (B, T, HQ, v.shape[3]), v.dtype)
    lse = _empty(q, (B, T, HQ), _float_dtype(q)) if return_lse else None
    with cache._lock:
        for s in slot_list:
            if cache._used[s]:
                raise ValueError(f"slots: slot {s} is in use; evict it first")
        cache._grow({s: n + extra for s, n in zip(slot_list, lens)})
        for s in slot_list:
            cache._used[s] = True
        cache._order_stream(q)
        try:
            _C.paged_prefill(q=_plain(q), k=_plain(k), v=_plain(v), w=_plain(w), beta=_plain(beta), g=_plain(g),
                             cu_seqlens=cu_seqlens, o=o, lse=lse, **cache._views(),
                             slots=np.asarray(slot_list, dtype=np.int32), scale=cache.scale,
                             gate_scale=cache.gate_scale, backend=cache.backend, num_threads=0, chunk_size=0,
                             validate=validate, stream=_stream(q))
        except BaseException:
            for s in slot_list:  # a refused prefill leaves the slots free, their pages back in the pool
                cache._release(s)
            raise
    return (o, lse) if return_lse else o


def paged_decode(q, k, v, w, beta, g, cache, validate=True, *, return_lse=False):
    """T tokens for every slot of the cache (T = 1: one step; T > 1 equals T single steps): returns o
    [N, T, HQ, V] in v's dtype (and lse [N, T, HQ] float32 with return_lse).

    q [N, T, HQ, K], k [N, T, H, K], v [N, T, H, V] (one dtype), w [N, T, H, K] and beta [N, T, H] (None for a
    path=False cache), g [N, T, HQ] exactly when the cache has a gate; N = cache.num_slots. Free slots are
    skipped (their outputs zeros, lse -inf). Every slot in use must have pages for T more tokens
    (PagedCache.reserve). validate (default): the metadata is read on the host and checked first (a copy and a
    wait on the stream for CUDA); False reads nothing on the host, which a step captured in a CUDA graph needs,
    and a slot whose metadata is out of range then gets NaN outputs and is left untouched.
    """
    _check_cache_args(cache, q, k, v, w, beta, g)
    validate = _api.bool_arg("validate", validate)
    return_lse = _api.bool_arg("return_lse", return_lse)
    N, T, HQ, _ = q.shape
    with cache._lock:
        cache._order_stream(q)
        o = _empty(q, (N, T, HQ, v.shape[3]), v.dtype)
        lse = _empty(q, (N, T, HQ), np.float32 if _is_numpy(q) else _torch().float32) if return_lse else None
        _C.paged_decode(q=_plain(q), k=_plain(k), v=_plain(v), w=_plain(w), beta=_plain(beta), g=_plain(g), o=o,
                        lse=lse, **cache._views(), scale=cache.scale, gate_scale=cache.gate_scale, validate=validate,
                        backend=cache.backend, num_threads=0, stream=_stream(q))
    return (o, lse) if return_lse else o


__all__ = ["PAGED_MAX_PENDING", "PagedCache", "PoolExhaustedError", "paged_decode", "paged_prefill"]
