"""pathattn: PaTH attention (Householder-transport position encoding) for numpy and PyTorch.

The op (docs/spec.md), in flash-linear-attention's layout and conventions::

    o, k_cache = pathattn.parallel_path_attn(q, k, v, w, beta, g=None, scale=None,
                                             cu_seqlens=None, use_cache=False)

works on numpy arrays (CPU) and torch tensors (CPU and CUDA, with autograd and torch.compile). Also:

- ``parallel_path_attn_bwd``: the backward as a plain function (numpy or torch, no autograd);
- ``prefill`` / ``decode_step`` / ``PathCache``: inference with a cache of transported keys;
- ``PagedCache`` / ``paged_prefill`` / ``paged_decode``: serving with a paged cache of lazily transported keys
  (request slots joining and leaving, steps capturable in a CUDA graph);
- ``pathattn.nn.PaTHAttention`` (torch): the layer, loading flash-linear-attention state_dicts;
- ``pathattn.models`` (torch + transformers): PaTHConfig, PaTHModel, PaTHForCausalLM, checkpoint-compatible
  with flash-linear-attention's PaTH models;
- ``torch.ops.pathattn.path_attn_fwd`` / ``path_attn_bwd``: the registered torch custom ops.

torch is optional: it is imported (and the custom ops registered) only if it is installed, unless the
environment variable PATHATTN_NO_TORCH=1 is set.
"""
import importlib.util as _ilu
import os as _os

from ._pathattn import BackendUnavailableError, UnsupportedError, build_info
from ._api import set_workspace_limit, workspace_limit
from ._api import (
    BACKENDS,
    PathGrads,
    backend_available,
    parallel_path_attn,
    parallel_path_attn_bwd,
    parallel_path_attention,
)
from .decode import PathCache, decode_step, prefill
from .paged import PAGED_MAX_PENDING, PagedCache, PoolExhaustedError, paged_decode, paged_prefill

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "PAGED_MAX_PENDING",
    "PagedCache",
    "PathCache",
    "PathGrads",
    "UnsupportedError",
    "backend_available",
    "build_info",
    "decode_step",
    "parallel_path_attn",
    "parallel_path_attn_bwd",
    "paged_decode",
    "paged_prefill",
    "parallel_path_attention",
    "PoolExhaustedError",
    "prefill",
    "set_workspace_limit",
    "workspace_limit",
]

HAS_TORCH = False
if _os.environ.get("PATHATTN_NO_TORCH", "0") != "1" and _ilu.find_spec("torch") is not None:
    from . import _api as _api_module

    _api_module.enable_torch()  # registers torch.ops.pathattn.*
    HAS_TORCH = True


def __getattr__(name):
    # `pathattn.nn` needs torch and `pathattn.models` transformers; import them on first use so numpy-only
    # users never pay for them.
    if name in ("nn", "models"):
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module 'pathattn' has no attribute {name!r}")
