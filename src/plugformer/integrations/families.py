"""transformers model families `plugformer convert` imports: per `model_type`, the plugformer config of a source
config and the renaming of its weights (`CONVERTERS`). A family plugformer cannot reproduce exactly is refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedConfig

from ..configuration import PlugformerConfig


logger = logging.getLogger(__name__)
StateDict = dict[str, torch.Tensor]


def _special_tokens(source: PreTrainedConfig) -> dict[str, Any]:
    """The special ids; ones outside the vocabulary (transformers only warns about those) are dropped, logged."""
    tokens = {}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(source, name, None)
        ids = value if isinstance(value, list) else [value]
        if any(i is not None and not 0 <= i < source.vocab_size for i in ids):
            logger.warning(
                "%s=%s is outside the vocabulary of %d tokens; not carried over", name, value, source.vocab_size
            )
            value = None
        tokens[name] = value
    return tokens


def llama_config(source: PreTrainedConfig, rope_parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Llama is plugformer's default architecture: scaled dot product, RoPE, RMSNorm before each block, SwiGLU.
    `rope_parameters`: the source's as its model applies them (by default Llama's reading, `llama_rope_parameters`)."""
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=getattr(source, "head_dim", None),  # SmolLM3's and Phi-3's: hidden_size / num_attention_heads
        hidden_act=getattr(source, "hidden_act", None) or source.hidden_activation,  # Gemma's name
        max_position_embeddings=source.max_position_embeddings,
        rope_parameters=llama_rope_parameters(source) if rope_parameters is None else rope_parameters,
        rms_norm_eps=source.rms_norm_eps,
        attention_bias=getattr(source, "attention_bias", False),  # Mistral and Phi-3 have no such field (nor biases)
        mlp_bias=getattr(source, "mlp_bias", False),  # nor do Qwen3 and Mistral
        attention_dropout=source.attention_dropout,
        tie_word_embeddings=source.tie_word_embeddings,
        initializer_range=source.initializer_range,
        attention_score="scaled_dot",
        position_scheme="rope",
        norm_type="rmsnorm",
        norm_placement="pre",
        ffn_type="glu",
        **_special_tokens(source),
    )


def qwen3_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Qwen3 is Llama with QK-norm, an MLP without biases and, with `use_sliding_window`, sliding layers where its
    `layer_types` says (transformers derives them from `max_window_layers`)."""
    return {**llama_config(source), "use_qk_norm": True, **sliding_layers(source)}


def sliding_layers(source: PreTrainedConfig) -> dict[str, Any]:
    """`sliding_window` and `layer_types` as the source's attention applies them: its window on the layers its
    `layer_types` marks sliding (every layer where it has no such field, as Mistral and Phi-3), none without one."""
    window = getattr(source, "sliding_window", None)
    kinds = getattr(source, "layer_types", None)
    if kinds is not None and "sliding_attention" not in kinds:
        window = None  # SmolLM3 keeps a window its full-attention layers ignore
    return {"sliding_window": window, "layer_types": None if kinds is None else list(kinds)}


def mistral_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Mistral is Llama with a sliding window in every layer (`sliding_window`, none when it is null)."""
    return {**llama_config(source), **sliding_layers(source)}


def smollm3_config(source: PreTrainedConfig) -> dict[str, Any]:
    """SmolLM3 is Llama with NoPE layers: `no_rope_layers` (1 rotates, 0 does not; plugformer's field of the same
    meaning) and, with `use_sliding_window`, sliding layers where its `layer_types` says."""
    return {**llama_config(source), "no_rope_layers": list(source.no_rope_layers), **sliding_layers(source)}


def phi3_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Phi-3 (and Phi-4-mini) is Llama with fused projections (`phi3_weights` splits them), a sliding window in every
    layer when set, and a RoPE that rotates `partial_rotary_factor` of each head (its leading dimensions), which
    plugformer's RoPE does the same way: its `rope_parameters` are kept whole."""
    return {
        **llama_config(source, rope_parameters=dict(source.rope_parameters)),
        "hidden_dropout": source.resid_pdrop,
        **sliding_layers(source),
    }


def phi3_weights(state: StateDict, config: PlugformerConfig, source: PreTrainedConfig) -> StateDict:
    """Phi-3 fuses q, k, v into `self_attn.qkv_proj` and gate, up into `mlp.gate_up_proj` (gate first): split."""
    head_dim = config.head_dim
    sizes = [config.num_attention_heads * head_dim] + [config.num_key_value_heads * head_dim] * 2
    renamed = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes, dim=0), strict=True):
                renamed[f"{prefix}{part}.weight"] = piece  # (H·D, d), (H_kv·D, d), (H_kv·D, d)
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            renamed[f"{prefix}gate_proj.weight"], renamed[f"{prefix}up_proj.weight"] = tensor.chunk(2, dim=0)
        else:
            renamed[name] = tensor
    return {name: tensor.contiguous() for name, tensor in renamed.items()}


def gemma2_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Gemma 2: Llama's blocks with a norm on each sublayer's output too (`norm_placement="sandwich"`), embeddings
    times sqrt(hidden_size), capped attention and head logits, GeGLU (`hidden_activation`), sliding layers where its
    `layer_types` says; its query scale `query_pre_attn_scalar`^-1/2 is folded into `q_proj` (`gemma2_weights`)."""
    if getattr(source, "use_bidirectional_attention", None):
        raise ValueError(
            "model_type='gemma2' with use_bidirectional_attention=True (an embedding model): plugformer "
            "converts Gemma 2's causal language models"
        )
    return {
        **llama_config(source, rope_parameters=dict(source.rope_parameters)),
        "norm_placement": "sandwich",
        "embedding_multiplier": source.hidden_size**0.5,
        "attn_logit_softcapping": source.attn_logit_softcapping,
        "final_logit_softcapping": source.final_logit_softcapping,
        **sliding_layers(source),
    }


GEMMA2_NORMS = {  # Gemma 2's name -> plugformer's (whose `post_attention_layernorm` sits before the MLP, as Llama's)
    "post_attention_layernorm": "post_self_attn_layernorm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
}


def gemma2_weights(state: StateDict, config: PlugformerConfig, source: PreTrainedConfig) -> StateDict:
    """Gemma 2's RMSNorms scale by (1 + w) where plugformer's scale by w; its scores by `query_pre_attn_scalar`^-1/2
    where plugformer's scaled dot product uses head_dim^-1/2: the queries take the ratio (no QK-norm comes between)."""
    query_scale = (config.head_dim / source.query_pre_attn_scalar) ** 0.5
    renamed = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        if leaf.endswith("norm"):
            tensor = tensor + 1
            name = f"{prefix}.{GEMMA2_NORMS.get(leaf, leaf)}.{kind}".lstrip(".")
        elif leaf == "q_proj":
            tensor = tensor * query_scale
        renamed[name] = tensor
    return renamed


def phi_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Phi-1 and Phi-2 run attention and the MLP in parallel on one LayerNorm's output and add both to the residual;
    plugformer's blocks are sequential: refused (Phi-3 and Phi-4-mini, `model_type` phi3, convert)."""
    raise ValueError(
        "model_type='phi' (Phi-1, Phi-2): its blocks add attention and the MLP computed in parallel from "
        "one LayerNorm, which plugformer's sequential blocks cannot reproduce; Phi-3 and later "
        "(model_type 'phi3') convert"
    )


def gpt_oss_config(source: PreTrainedConfig) -> dict[str, Any]:
    """gpt-oss: attention sinks and alternating sliding layers plugformer has, but every layer's MLP is a
    mixture of experts (with a clamped SwiGLU), which it has not: refused."""
    raise ValueError(
        f"model_type='gpt_oss': every layer's MLP is a mixture of {source.num_local_experts} experts, "
        "which plugformer has not (its MLPs are dense); its attention (sinks, sliding layers) is "
        "available as use_attention_sinks and sliding_window/layer_types on a new model"
    )


def qwen3_next_config(source: PreTrainedConfig) -> dict[str, Any]:
    """Qwen3-Next with a dense MLP in every layer: its full-attention layers (gated, QK-normed attention) and its
    linear-attention layers (Gated DeltaNet, `linear_attn`) as its `layer_types` places them. Mixture-of-experts
    layers have no plugformer equivalent: refused."""
    other = [i for i, kind in enumerate(source.layer_types) if kind not in ("full_attention", "linear_attention")]
    if other:
        raise ValueError(
            f"layer_types of Qwen3-Next has {source.layer_types[other[0]]!r} layers {other}; plugformer "
            "converts only 'full_attention' and 'linear_attention' layers"
        )
    sparse = [i for i in range(source.num_hidden_layers) if i not in source.mlp_only_layers]
    if sparse and source.num_experts > 0:
        raise ValueError(
            f"mlp_only_layers={source.mlp_only_layers} leaves layers {sparse} mixture-of-experts; "
            "plugformer converts Qwen3-Next only with a dense MLP in every layer"
        )
    # unlike Llama's, Qwen3-Next's RoPE honours `partial_rotary_factor` (a quarter of each head by default): kept whole
    config = llama_config(source, rope_parameters=dict(source.rope_parameters))
    return {**config, "use_qk_norm": True, "use_gated_attention": True, **_qwen3_next_linear_fields(source)}


def _qwen3_next_linear_fields(source: PreTrainedConfig) -> dict[str, Any]:
    """`layer_types` and the Gated DeltaNet's fields (same names in both configs), where linear layers exist."""
    if "linear_attention" not in source.layer_types:
        return {}
    fields = (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    )
    return {"layer_types": list(source.layer_types), **{name: getattr(source, name) for name in fields}}


def qwen3_next_weights(state: StateDict, config: PlugformerConfig, source: PreTrainedConfig) -> StateDict:
    """The same module names; Qwen3-Next's RMSNorms scale by (1 + w) where plugformer's scale by w, except the
    Gated DeltaNet's gated norm (`linear_attn.norm`), which scales by w in both."""
    return {name: tensor + 1 if _qwen3_next_zero_centred(name) else tensor for name, tensor in state.items()}


def _qwen3_next_zero_centred(name: str) -> bool:
    """Whether Qwen3-Next's parameter `name` is the gain of a (1 + w) RMSNorm."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def llama_rope_parameters(source: PreTrainedConfig) -> dict[str, Any]:
    """The source's `rope_parameters` as transformers' Llama applies them. Its default RoPE ignores
    `partial_rotary_factor` (`LlamaRotaryEmbedding.compute_default_rope_parameters` rotates all of `head_dim`), so the
    field is not carried over (plugformer would rotate that share only: logits 1.25e-3 off). The other rope types'
    init functions shorten the frequencies by it while Llama's attention still rotates the whole head: refused."""
    rope = dict(source.rope_parameters)
    factor = rope.pop("partial_rotary_factor", None)
    if factor is None or factor == 1.0:
        return rope
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_parameters partial_rotary_factor={factor} with rope_type={rope_type!r}: transformers' "
            "Llama computes that share of the frequencies but rotates the whole head, which convert "
            "cannot reproduce; remove the field from the source's config.json"
        )
    logger.warning(
        "partial_rotary_factor=%s not carried over: transformers' Llama ignores it with rope_type 'default' "
        "(it rotates all of head_dim), and so does the converted model",
        factor,
    )
    return rope


def llama_weights(state: StateDict, config: PlugformerConfig, source: PreTrainedConfig) -> StateDict:
    """Module names are the same (`model.layers.N.self_attn.q_proj`, ...): nothing to rename."""
    return dict(state)


def deepseek_v3_config(source: PreTrainedConfig) -> dict[str, Any]:
    """DeepSeek-V3 with dense layers only: Llama's blocks with multi-head latent attention (`attention_projection=
    "latent"`, its latent cache as the source's); mixture-of-experts layers have no plugformer equivalent."""
    if source.first_k_dense_replace < source.num_hidden_layers:
        raise ValueError(
            f"first_k_dense_replace={source.first_k_dense_replace} < num_hidden_layers={source.num_hidden_layers}: "
            "the layers after the first k are mixture-of-experts, which plugformer has not; only all-dense DeepSeek-V3 "
            "checkpoints convert"
        )
    # DeepseekV3's RoPE rotates the whole `qk_rope_head_dim` (its `head_dim`): its rope_parameters as they are
    return {
        **llama_config(source, rope_parameters=dict(source.rope_parameters)),
        "attention_projection": "latent",
        "q_lora_rank": source.q_lora_rank,
        "kv_lora_rank": source.kv_lora_rank,
        "qk_rope_head_dim": source.qk_rope_head_dim,
        "qk_nope_head_dim": source.qk_nope_head_dim,
        "v_head_dim": source.v_head_dim,
        "rope_interleave": bool(source.rope_interleave),
        "use_latent_cache": True,
    }


def gpt2_config(source: PreTrainedConfig) -> dict[str, Any]:
    """GPT-2: learned absolute positions, LayerNorm before each block, GELU MLP, biases everywhere, tied head."""
    if source.scale_attn_by_inverse_layer_idx:
        raise ValueError("scale_attn_by_inverse_layer_idx=True (a per-layer score scale) has no plugformer equivalent")
    return dict(
        vocab_size=source.vocab_size,
        hidden_size=source.n_embd,
        intermediate_size=source.n_inner or 4 * source.n_embd,
        num_hidden_layers=source.n_layer,
        num_attention_heads=source.n_head,
        hidden_act=source.activation_function,
        max_position_embeddings=source.n_positions,
        layer_norm_eps=source.layer_norm_epsilon,
        attention_bias=True,
        mlp_bias=True,
        attention_dropout=source.attn_pdrop,
        hidden_dropout=source.resid_pdrop,
        tie_word_embeddings=source.tie_word_embeddings,
        initializer_range=source.initializer_range,
        attention_score="scaled_dot" if source.scale_attn_weights else "dot",
        position_scheme="learned",
        norm_type="layernorm",
        norm_placement="pre",
        ffn_type="mlp",
        **_special_tokens(source),
    )


def gpt2_weights(state: StateDict, config: PlugformerConfig, source: PreTrainedConfig) -> StateDict:
    """GPT-2's Conv1D layers store (in, out) matrices and fuse q, k, v: split and transpose into nn.Linear layout."""
    renamed = {
        "model.embed_tokens.weight": state["transformer.wte.weight"],
        "model.positions.embed_positions.weight": state["transformer.wpe.weight"],
        "model.norm.weight": state["transformer.ln_f.weight"],
        "model.norm.bias": state["transformer.ln_f.bias"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(config.num_hidden_layers):
        old, new = f"transformer.h.{i}.", f"model.layers.{i}."
        for norm_old, norm_new in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            for kind in ("weight", "bias"):
                renamed[f"{new}{norm_new}.{kind}"] = state[f"{old}{norm_old}.{kind}"]
        qkv_weight = state[f"{old}attn.c_attn.weight"].t().chunk(3, dim=0)  # (3·d, d) -> q, k, v each (d, d)
        qkv_bias = state[f"{old}attn.c_attn.bias"].chunk(3, dim=0)
        for name, weight, bias in zip(("q_proj", "k_proj", "v_proj"), qkv_weight, qkv_bias, strict=True):
            renamed[f"{new}self_attn.{name}.weight"], renamed[f"{new}self_attn.{name}.bias"] = weight, bias
        for conv, linear in (
            ("attn.c_proj", "self_attn.o_proj"),
            ("mlp.c_fc", "mlp.up_proj"),
            ("mlp.c_proj", "mlp.down_proj"),
        ):
            renamed[f"{new}{linear}.weight"] = state[f"{old}{conv}.weight"].t()
            renamed[f"{new}{linear}.bias"] = state[f"{old}{conv}.bias"]
    return {name: tensor.contiguous() for name, tensor in renamed.items()}


# model_type -> (the plugformer config fields of a source config, the source's weights renamed for that config)
WeightConverter = Callable[[StateDict, PlugformerConfig, PreTrainedConfig], StateDict]
CONVERTERS: dict[str, tuple[Callable[[PreTrainedConfig], dict], WeightConverter]] = {
    "llama": (llama_config, llama_weights),
    "qwen3": (qwen3_config, llama_weights),
    "qwen3_next": (qwen3_next_config, qwen3_next_weights),
    "mistral": (mistral_config, llama_weights),
    "smollm3": (smollm3_config, llama_weights),
    "phi3": (phi3_config, phi3_weights),
    "gemma2": (gemma2_config, gemma2_weights),
    "phi": (phi_config, llama_weights),
    "gpt_oss": (gpt_oss_config, llama_weights),
    "gpt2": (gpt2_config, gpt2_weights),
    "deepseek_v3": (deepseek_v3_config, llama_weights),  # the same module names (`self_attn.kv_b_proj`, ...)
}
