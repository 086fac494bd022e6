"""pathattn._cache: the arrays of a decode cache and the prefill that fills them, for numpy arrays and torch
tensors; shared by pathattn.decode, the op's use_cache (pathattn._api) and the torch custom op.
"""
import numpy as np

from . import _pathattn as _C


def _is_numpy(x):
    return isinstance(x, np.ndarray)


def _float_dtype(q):
    """The dtype of lse and of the cache: float64 for float64 inputs, else float32."""
    if _is_numpy(q):
        return np.float64 if q.dtype == np.float64 else np.float32
    import torch

    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _empty(like, shape, dtype):
    if _is_numpy(like):
        return np.empty(shape, dtype=dtype)
    import torch

    return torch.empty(shape, dtype=dtype, device=like.device)


def _zeros(like, shape, dtype):
    if _is_numpy(like):
        return np.zeros(shape, dtype=dtype)
    import torch

    return torch.zeros(shape, dtype=dtype, device=like.device)


def _plain(x):
    """What the extension receives: numpy arrays as they are, torch tensors detached (no copy)."""
    return x if x is None or _is_numpy(x) else x.detach()


def _stream(x):
    if _is_numpy(x) or x.device.type != "cuda":
        return 0
    import torch

    return torch.cuda.current_stream(x.device).cuda_stream


def _host_lengths(cu):
    """Sequence lengths from cu_seqlens (host numpy int64), or None when cu is malformed (the C++ side then
    reports the problem, naming cu_seqlens)."""
    if cu is None:
        return None
    c = cu if _is_numpy(cu) else cu.detach().cpu().numpy()
    if c.ndim != 1 or c.shape[0] < 2 or c.dtype.kind not in "iu":
        return None
    return np.maximum(np.diff(c.astype(np.int64)), 0)


def _cache_arrays(q, k, v, g, num_seqs, capacity):
    """Allocates kc [N,H,C,K], vc [N,H,C,V], gc [N,HQ,C] float64 (or None) on q's device (the GPU for CUDA
    tensors), and lengths [N] (host int64 always: the C++ side reads and updates it on the host)."""
    H, K, V, HQ = k.shape[2], k.shape[3], v.shape[3], q.shape[2]
    fdt = _float_dtype(q)
    kc = _zeros(q, (num_seqs, H, capacity, K), fdt)
    vc = _zeros(q, (num_seqs, H, capacity, V), fdt)
    gdt = np.float64 if _is_numpy(q) else __import__("torch").float64  # G_j grows with j: always fp64
    gc = _zeros(q, (num_seqs, HQ, capacity), gdt) if g is not None else None
    lengths = np.zeros((num_seqs,), dtype=np.int64)
    return kc, vc, gc, lengths


def _run_prefill(q, k, v, w, beta, g, cu, o, lse, scale, gate_scale, code, capacity_extra, validate=False):
    """Prefill into a fresh cache with capacity max_len + capacity_extra. Returns (kc, vc, gc, lengths)."""
    lens = _host_lengths(cu)
    if cu is None:
        num_seqs, max_len = q.shape[0], q.shape[1]
    elif lens is None:
        num_seqs, max_len = 1, 1  # malformed cu_seqlens: the C++ validation rejects it before any write
    else:
        num_seqs, max_len = len(lens), int(lens.max()) if len(lens) else 0
    cap = max(int(max_len) + int(capacity_extra), 1)
    kc, vc, gc, lengths = _cache_arrays(q, k, v, g, num_seqs, cap)
    if cu is not None and not _is_numpy(cu):
        cu = cu.detach().cpu()
    _C.prefill(q=_plain(q), k=_plain(k), v=_plain(v), w=_plain(w), beta=_plain(beta), g=_plain(g), cu_seqlens=cu,
               o=o, lse=lse, kc=kc, vc=vc, gc=gc, lengths=lengths, scale=scale, gate_scale=gate_scale, backend=code,
               num_threads=0, chunk_size=0, validate=validate, stream=_stream(q))
    return kc, vc, gc, lengths


def prefill_k_cache(q, k, v, w, beta, g, cu, o, lse, scale, gate_scale, code, stream, validate=False):
    """The forward with use_cache=True: writes o (and lse) and returns k_cache [B, T, H, K] in k's dtype,
    each key transported to the end of its sequence (fla's k_cache)."""
    kc, _, _, _ = _run_prefill(q, k, v, w, beta, g, cu, o, lse, scale, gate_scale, code, 0, validate)
    B, T, H, K = k.shape
    if cu is None:
        out = kc[:, :, :T].transpose(0, 2, 1, 3) if _is_numpy(kc) else kc[:, :, :T].transpose(1, 2)
    else:
        # Packed sequences: token t of the packed axis is position pos[t] of sequence seq[t].
        lens = _host_lengths(cu)
        seq = np.repeat(np.arange(len(lens)), lens)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if len(lens) else np.zeros(0, np.int64)
        pos = np.arange(T) - starts[seq]
        if _is_numpy(kc):
            out = kc[seq, :, pos][None]
        else:
            import torch

            si = torch.as_tensor(seq, device=kc.device)
            pi = torch.as_tensor(pos, device=kc.device)
            out = kc[si, :, pi][None]
    if _is_numpy(out):
        return np.ascontiguousarray(out, dtype=k.dtype)
    return out.to(k.dtype).contiguous()
