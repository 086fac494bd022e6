"""pathattn.models: PaTH attention language models for Hugging Face transformers (the `hf` extra).

PaTHConfig, PaTHModel and PaTHForCausalLM use flash-linear-attention's config keys, model_type
("path_attn") and state_dict names, so checkpoints move between the two packages unchanged. Importing this
module registers them with AutoConfig, AutoModel and AutoModelForCausalLM under model_type "path_attn", the
name fla registers too: the package imported (or registered, register_auto_classes()) last answers for it.
"""
try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("pathattn.models needs transformers: pip install 'pathattn[hf]'") from e

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import DenseAttentionState, PagedAttentionState, PaTHCache
from .configuration import PaTHConfig
from .modeling import PaTHBlock, PaTHForCausalLM, PaTHModel, PaTHPreTrainedModel

# fla's class names, for code written against fla.models
PaTHAttentionConfig = PaTHConfig
PaTHAttentionModel = PaTHModel
PaTHAttentionForCausalLM = PaTHForCausalLM



def register_auto_classes():
    """Makes AutoConfig answer model_type "path_attn" with PaTHConfig, and AutoModel / AutoModelForCausalLM
    build PaTHModel / PaTHForCausalLM from it. Runs at import; call it again to take the name back from a
    package imported later that registered it (fla does)."""
    AutoConfig.register(PaTHConfig.model_type, PaTHConfig, exist_ok=True)
    AutoModel.register(PaTHConfig, PaTHModel, exist_ok=True)
    AutoModelForCausalLM.register(PaTHConfig, PaTHForCausalLM, exist_ok=True)


register_auto_classes()

__all__ = ["DenseAttentionState", "PagedAttentionState", "PaTHAttentionConfig", "PaTHAttentionForCausalLM",
           "PaTHAttentionModel", "PaTHBlock", "PaTHCache", "PaTHConfig", "PaTHForCausalLM", "PaTHModel",
           "PaTHPreTrainedModel", "register_auto_classes"]
