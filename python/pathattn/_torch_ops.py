"""pathattn._torch_ops: the torch custom ops and the torch side of parallel_path_attn (pathattn._api binds it).

    torch.ops.pathattn.path_attn_fwd(q, k, v, w?, beta?, g?, cu_seqlens?, scale, gate_scale, use_cache,
                                     backend, deterministic, validate=False) -> (o, lse, k_cache)
    torch.ops.pathattn.path_attn_bwd(do, q, k, v, w?, beta?, g?, cu_seqlens?, o, lse, scale, gate_scale,
                                     backend, deterministic, validate=False) -> (dq, dk, dv, dw, dbeta, dg)

and the w preparation op's pair w_conv_norm_fwd / w_conv_norm_bwd (at the end of this file; pathattn.nn uses it).
All have fake (meta) implementations, so torch.compile traces them without graph breaks; each forward
has a registered autograd formula (its backward op): the attention op differentiable in q, k, v, w, beta and g,
the w op in x, weight and bias. Tensors
cross into C++ through DLPack without copies; a CUDA call runs on torch's current stream. Absent optional
outputs are returned as empty tensors (k_cache without use_cache; dw, dbeta, dg without w, beta, g).
"""
import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _pathattn as _C
from ._cache import prefill_k_cache


def _float_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _arg(x):
    """Detached view of x; copied only if its last dimension is not contiguous (the kernels need it)."""
    if x is None:
        return None
    x = x.detach()
    if x.dim() > 0 and x.size(-1) > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _host(cu):
    # The library reads cu_seqlens in host memory (a few bytes).
    return None if cu is None else cu.detach().to("cpu")


def _stream(x):
    return torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0


def _device_guard(x):
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _empty0(like, dtype):
    return torch.empty((0,), dtype=dtype, device=like.device)


@torch.library.custom_op("pathattn::path_attn_fwd", mutates_args=())
def path_attn_fwd(q: Tensor, k: Tensor, v: Tensor, w: Optional[Tensor], beta: Optional[Tensor],
                  g: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, gate_scale: float,
                  use_cache: bool, backend: int, deterministic: bool,
                  validate: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """PaTH attention forward: o [B,T,HQ,V] (dtype of v), lse [B,T,HQ] float32, k_cache [B,T,H,K] (dtype
    of k; empty unless use_cache). `deterministic` only travels to the backward."""
    q, k, v, w, beta, g = (_arg(x) for x in (q, k, v, w, beta, g))
    B, T, HQ, _ = q.shape
    o = torch.empty((B, T, HQ, v.shape[3]), dtype=v.dtype, device=q.device)
    lse = torch.empty((B, T, HQ), dtype=_float_dtype(q), device=q.device)
    cu = _host(cu_seqlens)
    with _device_guard(q):
        if use_cache:
            k_cache = prefill_k_cache(q, k, v, w, beta, g, cu, o, lse, scale, gate_scale, backend, _stream(q),
                                      validate)
        else:
            _C.fwd(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=cu, o=o, lse=lse, scale=scale, gate_scale=gate_scale,
                   backend=backend, num_threads=0, chunk_size=0, validate=validate, stream=_stream(q))
            k_cache = _empty0(k, k.dtype)
    return o, lse, k_cache


@path_attn_fwd.register_fake
def _path_attn_fwd_fake(q, k, v, w, beta, g, cu_seqlens, scale, gate_scale, use_cache, backend, deterministic,
                        validate=False):
    B, T, HQ, _ = q.shape
    o = q.new_empty((B, T, HQ, v.shape[3]), dtype=v.dtype)
    lse = q.new_empty((B, T, HQ), dtype=_float_dtype(q))
    k_cache = k.new_empty(k.shape) if use_cache else k.new_empty((0,))
    return o, lse, k_cache


@torch.library.custom_op("pathattn::path_attn_bwd", mutates_args=())
def path_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, w: Optional[Tensor], beta: Optional[Tensor],
                  g: Optional[Tensor], cu_seqlens: Optional[Tensor], o: Tensor, lse: Tensor, scale: float,
                  gate_scale: float, backend: int, deterministic: bool,
                  validate: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PaTH attention backward: dq, dk, dv (dtype of q), dw, dbeta, dg (dtype of w, beta, g; empty float32
    (float64 for float64 q) when w / beta / g are None)."""
    do, q, k, v, w, beta, g, o, lse = (_arg(x) for x in (do, q, k, v, w, beta, g, o, lse))
    fdt = _float_dtype(q)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    dw = torch.empty(w.shape, dtype=w.dtype, device=q.device) if w is not None else None
    dbeta = torch.empty(beta.shape, dtype=beta.dtype, device=q.device) if beta is not None else None
    dg = torch.empty(g.shape, dtype=g.dtype, device=q.device) if g is not None else None
    with _device_guard(q):
        _C.bwd(q=q, k=k, v=v, w=w, beta=beta, g=g, cu_seqlens=_host(cu_seqlens), o=o, lse=lse, do=do, dq=dq, dk=dk,
               dv=dv, dw=dw, dbeta=dbeta, dg=dg, scale=scale, gate_scale=gate_scale, backend=backend, num_threads=0,
               chunk_size=0, deterministic=deterministic, validate=validate, stream=_stream(q))
    return (dq, dk, dv, dw if dw is not None else _empty0(q, fdt), dbeta if dbeta is not None else _empty0(q, fdt),
            dg if dg is not None else _empty0(q, fdt))


@path_attn_bwd.register_fake
def _path_attn_bwd_fake(do, q, k, v, w, beta, g, cu_seqlens, o, lse, scale, gate_scale, backend, deterministic,
                        validate=False):
    fdt = _float_dtype(q)
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape, dtype=q.dtype)
    dv = v.new_empty(v.shape, dtype=q.dtype)
    dw = w.new_empty(w.shape) if w is not None else q.new_empty((0,), dtype=fdt)
    dbeta = beta.new_empty(beta.shape) if beta is not None else q.new_empty((0,), dtype=fdt)
    dg = g.new_empty(g.shape) if g is not None else q.new_empty((0,), dtype=fdt)
    return dq, dk, dv, dw, dbeta, dg


def _setup_context(ctx, inputs, output):
    q, k, v, w, beta, g, cu_seqlens, scale, gate_scale, use_cache, backend, deterministic = inputs[:12]
    o, lse, k_cache = output
    ctx.save_for_backward(q, k, v, w, beta, g, cu_seqlens, o, lse)
    ctx.scale, ctx.gate_scale, ctx.backend, ctx.deterministic = scale, gate_scale, backend, deterministic
    ctx.validate = inputs[12] if len(inputs) > 12 else False
    ctx.has = (w is not None, beta is not None, g is not None)
    # lse and k_cache are outputs for inference; gradients flow through o only.
    ctx.mark_non_differentiable(lse, k_cache)


def _backward(ctx, do, dlse, dk_cache):
    q, k, v, w, beta, g, cu_seqlens, o, lse = ctx.saved_tensors
    dq, dk, dv, dw, dbeta, dg = torch.ops.pathattn.path_attn_bwd(
        do, q, k, v, w, beta, g, cu_seqlens, o, lse, ctx.scale, ctx.gate_scale, ctx.backend, ctx.deterministic,
        ctx.validate)
    has_w, has_beta, has_g = ctx.has
    return (dq, dk, dv, dw if has_w else None, dbeta if has_beta else None, dg if has_g else None,
            None, None, None, None, None, None, None)


path_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_devices(q, named):
    for name, x in named:
        if x is not None and x.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} like q, got one on {x.device}")


def _cu_tensor(cu_seqlens):
    if cu_seqlens is None or isinstance(cu_seqlens, Tensor):
        return cu_seqlens
    if isinstance(cu_seqlens, (list, tuple)):
        from ._api import int_list  # (at call time: _api imports this module)
        return torch.tensor(int_list("cu_seqlens", cu_seqlens), dtype=torch.int64)
    raise TypeError(f"cu_seqlens: expected a torch.Tensor of int32 / int64, got {type(cu_seqlens).__name__}")


def _scales(q, scale, gate_scale):
    # Resolved here (not left to the C++ default) so the op's float arguments are ordinary numbers.
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    if gate_scale is None:
        gate_scale = scale
    return scale, gate_scale


def forward(q, k, v, w, beta, g, scale, cu_seqlens, use_cache, gate_scale, deterministic, return_lse, code,
            validate=False):
    cu_seqlens = _cu_tensor(cu_seqlens)
    _check_devices(q, (("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g)))
    scale, gate_scale = _scales(q, scale, gate_scale)
    o, lse, k_cache = torch.ops.pathattn.path_attn_fwd(q, k, v, w, beta, g, cu_seqlens, scale, gate_scale,
                                                       use_cache, code, deterministic, validate)
    k_cache = k_cache if use_cache else None
    return (o, k_cache, lse) if return_lse else (o, k_cache)


def backward(q, k, v, w, beta, g, o, lse, do, scale, cu_seqlens, gate_scale, deterministic, code, validate=False):
    cu_seqlens = _cu_tensor(cu_seqlens)
    _check_devices(q, (("k", k), ("v", v), ("w", w), ("beta", beta), ("g", g), ("o", o), ("lse", lse),
                       ("do", do)))
    scale, gate_scale = _scales(q, scale, gate_scale)
    dq, dk, dv, dw, dbeta, dg = torch.ops.pathattn.path_attn_bwd(do, q, k, v, w, beta, g, cu_seqlens, o, lse,
                                                                 scale, gate_scale, code, deterministic, validate)
    return (dq, dk, dv, dw if w is not None else None, dbeta if beta is not None else None,
            dg if g is not None else None)



# -- the w preparation op (include/pathattn/w_conv_norm.h) ---------------------------------------------------------
#    torch.ops.pathattn.w_conv_norm_fwd(x, weight?, bias?, cu_seqlens?, head_dim, activation, eps, backend) -> out
#    torch.ops.pathattn.w_conv_norm_bwd(dout, x, weight?, bias?, cu_seqlens?, head_dim, activation, eps, backend)
#        -> (dx, dweight, dbias)   (dweight / dbias empty when weight / bias are None)

# Whether this build has the CUDA backend: read once here so the layer's choice of path is a constant to torch.compile.
CUDA_BUILT = "cuda" in _C.build_info()
# What the CUDA kernels of the op take (cuda_backend.h); the layer falls back to the unfused ops elsewhere.
W_CONV_NORM_CUDA_HEAD_DIMS = (16, 32, 64, 128, 256)
W_CONV_NORM_CUDA_MAX_WIDTH = 4


@torch.library.custom_op("pathattn::w_conv_norm_fwd", mutates_args=())
def w_conv_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], cu_seqlens: Optional[Tensor],
                    head_dim: int, activation: bool, eps: float, backend: int) -> Tensor:
    """out [B, T, D] in x's dtype: per-head L2 norm of act(causal depthwise conv(x)); weight [D, W], bias [D]."""
    x, weight, bias = (_arg(t) for t in (x, weight, bias))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with _device_guard(x):
        _C.w_conv_norm_fwd(x=x, weight=weight, bias=bias, cu_seqlens=_host(cu_seqlens), out=out, head_dim=head_dim,
                           activation=activation, eps=eps, backend=backend, num_threads=0, stream=_stream(x))
    return out


@w_conv_norm_fwd.register_fake
def _w_conv_norm_fwd_fake(x, weight, bias, cu_seqlens, head_dim, activation, eps, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("pathattn::w_conv_norm_bwd", mutates_args=())
def w_conv_norm_bwd(dout: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], head_dim: int, activation: bool, eps: float,
                    backend: int) -> Tuple[Tensor, Tensor, Tensor]:
    """dx (x's dtype), dweight, dbias (weight's / bias's dtype; empty when absent)."""
    dout, x, weight, bias = (_arg(t) for t in (dout, x, weight, bias))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight = torch.empty(weight.shape, dtype=weight.dtype, device=x.device) if weight is not None else None
    dbias = torch.empty(bias.shape, dtype=bias.dtype, device=x.device) if bias is not None else None
    with _device_guard(x):
        _C.w_conv_norm_bwd(x=x, weight=weight, bias=bias, cu_seqlens=_host(cu_seqlens), dout=dout, dx=dx,
                           dweight=dweight, dbias=dbias, head_dim=head_dim, activation=activation, eps=eps,
                           backend=backend, num_threads=0, stream=_stream(x))
    fdt = _float_dtype(x)
    return dx, dweight if dweight is not None else _empty0(x, fdt), dbias if dbias is not None else _empty0(x, fdt)


@w_conv_norm_bwd.register_fake
def _w_conv_norm_bwd_fake(dout, x, weight, bias, cu_seqlens, head_dim, activation, eps, backend):
    fdt = _float_dtype(x)
    return (x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,), dtype=fdt),
            bias.new_empty(bias.shape) if bias is not None else x.new_empty((0,), dtype=fdt))


def _wcn_setup_context(ctx, inputs, output):
    x, weight, bias, cu_seqlens, head_dim, activation, eps, backend = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.head_dim, ctx.activation, ctx.eps, ctx.backend = head_dim, activation, eps, backend


def _wcn_backward(ctx, dout):
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dweight, dbias = torch.ops.pathattn.w_conv_norm_bwd(dout, x, weight, bias, cu_seqlens, ctx.head_dim,
                                                            ctx.activation, ctx.eps, ctx.backend)
    return (dx, dweight if weight is not None else None, dbias if bias is not None else None,
            None, None, None, None, None)


w_conv_norm_fwd.register_autograd(_wcn_backward, setup_context=_wcn_setup_context)


def w_conv_norm(x, weight, bias, head_dim, cu_seqlens, activation, eps, code):
    """The torch side of pathattn.nn.w_conv_norm (arguments checked there); weight [D, W] or [D, 1, W]."""
    if weight is not None and weight.dim() == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"weight: expected [D, W] or nn.Conv1d's depthwise [D, 1, W], got {list(weight.shape)}")
        weight = weight[:, 0, :]
    _check_devices(x, (("weight", weight), ("bias", bias)))
    return torch.ops.pathattn.w_conv_norm_fwd(x, weight, bias, _cu_tensor(cu_seqlens), head_dim, activation, eps,
                                              code)
