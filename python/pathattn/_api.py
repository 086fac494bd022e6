"""pathattn._api: the public op functions: argument checks, output allocation and dispatch.

numpy arrays go straight to the extension (pathattn._pathattn); torch tensors go through the registered
custom ops (pathattn._torch_ops, bound by enable_torch) so that autograd and torch.compile see one opaque op.
"""
import collections
import math
import numbers

import numpy as np

from . import _pathattn as _C
from ._cache import prefill_k_cache

# Backend names accepted by every `backend=` argument, and the codes of pathattn::Backend.
BACKENDS = {"auto": 0, "automatic": 0, "oracle": 1, "cpu": 2, "cuda": 3}
NAN = float("nan")

PathGrads = collections.namedtuple("PathGrads", ["dq", "dk", "dv", "dw", "dbeta", "dg"])
PathGrads.__doc__ = """Gradients returned by parallel_path_attn_bwd: dq [B,T,HQ,K], dk [B,T,H,K], dv [B,T,H,V]
in the dtype of q; dw [B,T,H,K], dbeta [B,T,H] (None when w, beta are None) and dg [B,T,HQ] (None when g
is None) in the dtype of w / beta / g."""


class _NoTorch:  # stands in for torch.Tensor until enable_torch binds the torch side
    pass


# The torch side, bound by enable_torch (module globals, so torch.compile traces through the dispatch).
TorchTensor = _NoTorch
_torch_ops = None


def enable_torch():
    """Imports torch and pathattn._torch_ops (registering torch.ops.pathattn.*); torch tensors are accepted
    from then on."""
    global TorchTensor, _torch_ops
    if _torch_ops is None:
        from . import _torch_ops as ops

        TorchTensor = ops.Tensor
        _torch_ops = ops


def backend_code(backend):
    """Maps None / 'auto' / 'oracle' / 'cpu' / 'cuda' to the pathattn::Backend code."""
    if backend is None:
        return 0
    if isinstance(backend, str):
        code = BACKENDS.get(backend.lower())
        if code is not None:
            return code
    raise ValueError(f"backend: expected None, 'auto', 'oracle', 'cpu' or 'cuda', got {backend!r}")


def array_kind(name, x):
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, TorchTensor):
        return "torch"
    raise TypeError(f"{name}: expected a numpy.ndarray or torch.Tensor, got {type(x).__module__}.{type(x).__qualname__}")


def check_same_kind(kind, name, x, optional=True):
    if x is None:
        if optional:
            return
        raise TypeError(f"{name}: expected a {'numpy.ndarray' if kind == 'numpy' else 'torch.Tensor'}, got None")
    k = array_kind(name, x)
    if k != kind:
        raise TypeError(f"{name}: expected a {'numpy.ndarray' if kind == 'numpy' else 'torch.Tensor'} like q, "
                        f"got a {'numpy.ndarray' if k == 'numpy' else 'torch.Tensor'}")


def float_arg(name, x):
    """None stays None (the default); otherwise a finite real number, returned as float."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a float or None, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x}")
    return x


def bool_arg(name, x):
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")


def check_ndim(name, x, ndim, doc):
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {doc}, got {x.ndim} {list(x.shape)}")


def int_list(name, xs):
    """A list / tuple of Python or numpy integers as a list of ints; anything else (a float such as 2.5 or
    2.0, a bool) is a TypeError naming the argument, never silently truncated."""
    for x in xs:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral, np.integer)):
            raise TypeError(f"{name}: expected integers [0, l_0, l_0 + l_1, ..., T], got {x!r} "
                            f"({type(x).__name__})")
    return [int(x) for x in xs]


def numpy_cu_seqlens(cu_seqlens):
    """cu_seqlens for the numpy path: None, an int32 / int64 numpy array, or a list / tuple of ints."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, (list, tuple)):
        try:
            return np.asarray(int_list("cu_seqlens", cu_seqlens), dtype=np.int64)
        except OverflowError:
            raise ValueError("cu_seqlens: an entry does not fit int64") from None
    if not isinstance(cu_seqlens, np.ndarray):
        raise TypeError(f"cu_seqlens: expected a numpy.ndarray of int32 / int64 or a list of ints, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (np.int32, np.int64) or not cu_seqlens.dtype.isnative:
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    return cu_seqlens


def check_numpy_layout(name, x, writable=False):
    """numpy arrays the extension cannot take as they are: a non-native byte order (DLPack has none), and a
    read-only array where the op writes. Reported here, naming the argument."""
    if x is None or not isinstance(x, np.ndarray):
        return
    if not x.dtype.isnative:
        raise TypeError(f"{name}: dtype {x.dtype.str} is not in this machine's byte order; convert it first, "
                        f"e.g. {name}.astype({name}.dtype.newbyteorder('='))")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name}: the array is read-only, but the op writes to it")


def check_numpy_dtype(name, x):
    if x.dtype.kind not in "fiu" and x.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected dtype float32, float64 or float16, got {x.dtype}")


def _common_args(q, k, v, w, beta, g, scale, gate_scale, backend):
    kind = array_kind("q", q)
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
        check_numpy_layout(name, x)
    check_same_kind(kind, "k", k, optional=False)
    check_same_kind(kind, "v", v, optional=False)
    if (w is None) != (beta is None):
        raise ValueError(f"{'beta' if w is not None else 'w'}: w and beta must be given together "
                         "(both None means plain causal attention)")
    check_same_kind(kind, "w", w)
    check_same_kind(kind, "beta", beta)
    check_same_kind(kind, "g", g)
    check_ndim("q", q, 4, "[B, T, HQ, K]")
    check_ndim("k", k, 4, "[B, T, H, K]")
    check_ndim("v", v, 4, "[B, T, H, V]")
    return kind, float_arg("scale", scale), float_arg("gate_scale", gate_scale), backend_code(backend)


def parallel_path_attn(q, k, v, w, beta, g=None, scale=None, cu_seqlens=None, use_cache=False, *,
                       gate_scale=None, deterministic=False, return_lse=False, backend=None, validate=False):
    """PaTH attention, flash-linear-attention's ``parallel_path_attn`` (same signature, layout, results).

    Args:
        q: [B, T, HQ, K] float (bf16 / fp16 / fp32 with torch; fp32 / fp16 / fp64 with numpy).
        k: [B, T, H, K], dtype of q.   v: [B, T, H, V], dtype of q.
        w: [B, T, H, K]: Householder directions, used as given.
        beta: [B, T, H]: H_t = I - beta_t w_t w_t^T.
        g: optional [B, T, HQ]: the raw per-step log forget gate (the op takes the cumsum).
        w, beta and g each take any float dtype q may have (bf16 / fp16 / fp32; fp64 on the CPU backends),
        independently of q and of each other: the model's dtype or fp32, as fla passes them. The op computes
        in fp32 (fp64 for float64 q on the CPU) whatever their dtype; their gradients come back in it.
        scale: logit scale, default K ** -0.5. The gate is multiplied by it too (fla's convention).
        cu_seqlens: optional [N + 1] int32 / int64 cumulative sequence lengths (B must be 1).
        use_cache: also return k_cache [B, T, H, K] (dtype of k): every key transported to the end of
            its sequence, H_{T-1} ... H_{j+1} k_j, the state a decoder continues from.
    Keyword-only extras:
        gate_scale: multiplier of the gate (default: scale; 1.0 is the FoX paper's convention).
        deterministic: bitwise reproducible backward on CUDA (CPU backends always are).
        return_lse: also return lse [B, T, HQ] float32 (natural log; not differentiable).
        backend: None / 'auto' (cuda for CUDA tensors, cpu otherwise), 'cpu', 'oracle' (fp64 brute
            force) or 'cuda'.
        validate: also scan the inputs first (host arrays only) and raise ValueError naming the argument
            and index of a non-finite value, a beta outside [0, 2] or a w row whose norm is not 1 (within
            1e-2). Off by default: the scan reads every input once more.
    Returns:
        (o, k_cache), or (o, k_cache, lse) with return_lse. o is [B, T, HQ, V] in the dtype of v;
        k_cache is None unless use_cache.

    torch tensors are differentiable in q, k, v, w, beta and g; numpy callers use parallel_path_attn_bwd.
    Errors: ValueError / TypeError naming the argument; UnsupportedError (a NotImplementedError) for a
    head dim the backend lacks; BackendUnavailableError (a RuntimeError) for a backend not in this build.
    """
    kind, scale, gate_scale, code = _common_args(q, k, v, w, beta, g, scale, gate_scale, backend)
    use_cache = bool_arg("use_cache", use_cache)
    deterministic = bool_arg("deterministic", deterministic)
    return_lse = bool_arg("return_lse", return_lse)
    validate = bool_arg("validate", validate)
    if kind == "torch":
        return _torch_ops.forward(q, k, v, w, beta, g, scale, cu_seqlens, use_cache, gate_scale, deterministic,
                                  return_lse, code, validate)
    cu = numpy_cu_seqlens(cu_seqlens)
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)):
        if x is not None:
            check_numpy_dtype(name, x)
    s = NAN if scale is None else scale
    gs = NAN if gate_scale is None else gate_scale
    _C.check_inputs(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu, scale=s, gate_scale=gs, backend=code,
                    chunk_size=0)  # before any output is allocated
    B, T, HQ, _ = q.shape
    fdt = np.float64 if q.dtype == np.float64 else np.float32
    o = np.empty((B, T, HQ, v.shape[3]), dtype=v.dtype)
    lse = np.empty((B, T, HQ), dtype=fdt) if return_lse else None
    k_cache = None
    if use_cache:
        k_cache = prefill_k_cache(q, k, v, w, beta, g, cu, o, lse, s, gs, code, 0, validate)
    else:
        _C.fwd(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu, o=o, lse=lse, scale=s, gate_scale=gs, backend=code,
               num_threads=0, chunk_size=0, validate=validate, stream=0)
    return (o, k_cache, lse) if return_lse else (o, k_cache)


# flash-linear-attention exports the op under both names.
parallel_path_attention = parallel_path_attn


def parallel_path_attn_bwd(q, k, v, w, beta, o, lse, do, g=None, scale=None, cu_seqlens=None, *,
                           gate_scale=None, deterministic=False, backend=None, validate=False):
    """Backward of parallel_path_attn as a plain function (numpy arrays or torch tensors; no autograd).

    Args:
        q, k, v, w, beta, g, scale, cu_seqlens, gate_scale, backend: exactly as given to the forward.
        o: [B, T, HQ, V] and lse: [B, T, HQ] float32, the forward's outputs (forward with return_lse=True).
        do: [B, T, HQ, V], dtype of v: the gradient of the loss with respect to o.
        deterministic: bitwise reproducible gradients on CUDA (CPU backends always are).
        validate: as in parallel_path_attn; do is scanned for non-finite values too.
    Returns:
        PathGrads(dq, dk, dv, dw, dbeta, dg), a named tuple: dq [B,T,HQ,K], dk [B,T,H,K], dv [B,T,H,V] in
        the dtype of q (accumulated in fp32 or better); dw [B,T,H,K], dbeta [B,T,H], dg [B,T,HQ] in the
        dtype of w, beta, g, dw / dbeta None when w / beta are None, dg None when g is.
        With GQA the kv-head gradients are summed over each group's query heads; dg is the gradient
        with respect to the raw g (not its cumsum).
    """
    kind, scale, gate_scale, code = _common_args(q, k, v, w, beta, g, scale, gate_scale, backend)
    check_same_kind(kind, "o", o, optional=False)
    check_same_kind(kind, "lse", lse, optional=False)
    check_same_kind(kind, "do", do, optional=False)
    deterministic = bool_arg("deterministic", deterministic)
    validate = bool_arg("validate", validate)
    if kind == "torch":
        return PathGrads(*_torch_ops.backward(q, k, v, w, beta, g, o, lse, do, scale, cu_seqlens, gate_scale,
                                              deterministic, code, validate))
    cu = numpy_cu_seqlens(cu_seqlens)
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g), ("o", o),
                    ("lse", lse), ("do", do)):
        if x is not None:
            check_numpy_dtype(name, x)
            check_numpy_layout(name, x)
    _C.check_inputs(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu, scale=NAN if scale is None else scale,
                    gate_scale=NAN if gate_scale is None else gate_scale, backend=code,
                    chunk_size=0)  # before the gradients are allocated
    dq = np.empty(q.shape, dtype=q.dtype)
    dk = np.empty(k.shape, dtype=q.dtype)
    dv = np.empty(v.shape, dtype=q.dtype)
    dw = np.empty(w.shape, dtype=w.dtype) if w is not None else None
    dbeta = np.empty(beta.shape, dtype=beta.dtype) if beta is not None else None
    dg = np.empty(g.shape, dtype=g.dtype) if g is not None else None
    _C.bwd(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv, dw=dw,
           dbeta=dbeta, dg=dg, scale=NAN if scale is None else scale,
           gate_scale=NAN if gate_scale is None else gate_scale, backend=code, num_threads=0, chunk_size=0,
           deterministic=deterministic, validate=validate, stream=0)
    return PathGrads(dq, dk, dv, dw, dbeta, dg)


_available = {}


def backend_available(backend):
    """True if `backend` ('oracle', 'cpu', 'cuda') runs the forward in this build (probed once, tiny input).

    A backend that reports BackendUnavailableError (not compiled in, or not implemented yet) is False.
    The cuda probe needs torch with a visible GPU; without either it is False.
    """
    code = backend_code(backend)
    if code in _available:
        return _available[code]
    ok = True
    try:
        if code == 3:
            try:
                import torch
            except ImportError:
                torch = None
            if torch is None or TorchTensor is _NoTorch or not torch.cuda.is_available():
                ok = False
            else:
                x = torch.zeros((1, 1, 1, 64), device="cuda", dtype=torch.bfloat16)
                wv = torch.zeros((1, 1, 1, 64), device="cuda", dtype=torch.float32)
                bv = torch.zeros((1, 1, 1), device="cuda", dtype=torch.float32)
                parallel_path_attn(x, x, x, wv, bv, backend="cuda")
        else:
            x = np.zeros((1, 1, 1, 8), dtype=np.float32)
            parallel_path_attn(x, x, x, x, np.zeros((1, 1, 1), np.float32), backend=backend)
    except _C.BackendUnavailableError:
        ok = False
    except _C.UnsupportedError:
        pass  # the backend exists; it only lacks the probe's head dim
    _available[code] = ok
    return ok


def set_workspace_limit(nbytes):
    """Caps the workspace of the CUDA backend's forward / backward calls that follow (process-wide).

    The CUDA kernels keep per-token intermediates (the backward about 2.4 KB per token and head at K = 64,
    5 KB at K = 128); a call that would need more than the limit runs in slices of kv heads (then of batch
    rows), with the same results. 0 (the initial value) = the library's default, the larger of 512 MiB and the
    bytes of q, k, v; a negative value = no limit (one slice). At 32k tokens per call the default's slicing costs
    up to 7% of forward+backward time; a limit that lets two streams take slices of two kv heads each (768 MiB
    at K = 128, T = 4k) was 2.6% faster than the default and 3% faster than one slice on an H200.
    CPU backends ignore it.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        raise TypeError(f"nbytes: expected an int (bytes; 0 = default, < 0 = no limit), got {type(nbytes).__name__}")
    _C.set_workspace_limit(nbytes=int(nbytes))


def workspace_limit():
    """The workspace limit set by set_workspace_limit (0 = the library's default, < 0 = none)."""
    return _C.workspace_limit()
