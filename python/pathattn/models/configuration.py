"""PaTHConfig: the configuration of a PaTH attention language model, with flash-linear-attention's keys and
model_type ("path_attn"), so a config.json written by either package loads in the other."""
try:
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers before 4.57 spells it PretrainedConfig
    from transformers import PretrainedConfig as _BaseConfig


def default_intermediate_size(hidden_size, hidden_ratio):
    """fla's rule: 2/3 * hidden_size * hidden_ratio rounded up to a multiple of 256."""
    n = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((n + 255) // 256)


class PaTHConfig(_BaseConfig):
    """Configuration of PaTHModel / PaTHForCausalLM (keys and defaults of fla's PaTHAttentionConfig).

    Architecture: vocab_size, hidden_size, num_hidden_layers, num_heads, num_kv_heads (None = num_heads),
    hidden_ratio / intermediate_size (the SwiGLU MLP width; None derives it as fla does), hidden_act
    ("swish"), norm_eps, use_forget_gate (PaTH-FoX), use_w_shortconv, use_low_rank_w, tie_word_embeddings.
    Kept for fla compatibility and read as fla's unfused path: fuse_norm, fuse_swiglu, fuse_cross_entropy,
    fuse_linear_cross_entropy (kernel choices with the same math), elementwise_affine (fla's blocks ignore
    it too). use_l2warp changes the training loss and attnres_block_size the architecture; neither is
    implemented here, and setting them raises.
    """

    model_type = "path_attn"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, hidden_size=2048, num_hidden_layers=24, num_heads=32, num_kv_heads=None, hidden_ratio=4,
                 intermediate_size=None, hidden_act="swish", initializer_range=0.02, elementwise_affine=True,
                 norm_eps=1e-6, use_cache=True, pad_token_id=None, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False, fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True,
                 fuse_linear_cross_entropy=False, use_l2warp=False, vocab_size=32000, use_forget_gate=False,
                 use_w_shortconv=True, use_low_rank_w=True, attnres_block_size=None, **kwargs):
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if hidden_size % num_heads != 0 or num_heads % kv != 0:
            raise ValueError(f"num_heads: hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}), "
                             f"itself a multiple of num_kv_heads ({kv})")
        if hidden_act != "swish":
            raise ValueError(f"hidden_act: only 'swish' (SwiGLU) is implemented, got {hidden_act!r}")
        if use_l2warp:
            raise ValueError("use_l2warp: the l2-warp training loss is not implemented; set it to False")
        if attnres_block_size is not None:
            raise ValueError("attnres_block_size: attention residuals are not implemented; set it to None")
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.elementwise_affine = elementwise_affine
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        self.fuse_norm = fuse_norm
        self.fuse_swiglu = fuse_swiglu
        self.fuse_cross_entropy = fuse_cross_entropy
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.use_l2warp = use_l2warp
        self.vocab_size = vocab_size
        self.use_forget_gate = use_forget_gate
        self.use_w_shortconv = use_w_shortconv
        self.use_low_rank_w = use_low_rank_w
        self.attnres_block_size = attnres_block_size
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
