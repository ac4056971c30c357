"""The field checks of `PlugformerConfig` that read no variant's own fields: choices, sizes, layer kinds, caps.
Each raises a `ValueError` naming the field, its value and what is allowed."""

from typing import TYPE_CHECKING

from transformers.activations import ACT2FN

from .layers import FEED_FORWARDS, NORM_PLACEMENTS, NORMS, VALUE_RESIDUALS
from .positions import POSITION_SCHEMES
from .projections import ATTENTION_PROJECTIONS
from .registry import choice, in_range, positive
from .scores import ATTENTION_SCORES


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


# transformers' names of the kinds a layer can be (`layer_types`): softmax attention or a Gated DeltaNet.
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def check_choices(config: "PlugformerConfig") -> None:
    """Each variant field names a registered class (and `hidden_act` an activation), else a `ValueError` listing
    the choices."""
    choice("attention_score", config.attention_score, ATTENTION_SCORES.names())
    choice("position_scheme", config.position_scheme, POSITION_SCHEMES.names())
    choice("attention_projection", config.attention_projection, ATTENTION_PROJECTIONS.names())
    choice("norm_type", config.norm_type, NORMS.names())
    choice("norm_placement", config.norm_placement, NORM_PLACEMENTS.names())
    choice("ffn_type", config.ffn_type, FEED_FORWARDS.names())
    choice("hidden_act", config.hidden_act, sorted(ACT2FN))
    if config.value_residual is not None:
        choice("value_residual", config.value_residual, [None, *VALUE_RESIDUALS.names()])


def check_sizes(config: "PlugformerConfig") -> None:
    """Sizes positive, heads divisible, rates and epsilons in range, caps and scales finite and positive."""
    positive(
        config,
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_decoder_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "relative_attention_num_buckets",
        "relative_attention_max_distance",
        "max_relative_distance",
        "additive_chunk_size",
        "sliding_window",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    )
    if config.head_dim is None and config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not divisible by num_attention_heads={config.num_attention_heads}; "
            "choose a divisor or set head_dim explicitly"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} must divide num_attention_heads="
            f"{config.num_attention_heads} (each key/value head serves a whole group of query heads)"
        )
    for field in ("attention_dropout", "hidden_dropout"):
        in_range(config, field, 0.0, 1.0)
    for field in ("rms_norm_eps", "layer_norm_eps", "initializer_range"):
        in_range(config, field, 1e-12, 1.0, closed_high=True)
    check_caps(config)


def check_layer_types(config: "PlugformerConfig") -> None:
    """Derives `layer_types` from `sliding_window` when absent (transformers' Mistral-style every-layer window),
    then checks it: one of `LAYER_TYPES` per layer, and sliding layers only with a window to slide."""
    if config.layer_types is None:
        kind = "full_attention" if config.sliding_window is None else "sliding_attention"
        config.layer_types = [kind] * config.num_hidden_layers
        return
    if not isinstance(config.layer_types, list) or any(kind not in LAYER_TYPES for kind in config.layer_types):
        raise ValueError(f"layer_types={config.layer_types!r} must be a list of {list(LAYER_TYPES)}, one per layer")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types has {len(config.layer_types)} entries; it needs one per layer (num_hidden_layers="
            f"{config.num_hidden_layers})"
        )
    if config.is_encoder_decoder and len(set(config.layer_types)) > 1:
        raise ValueError(
            f"layer_types={config.layer_types!r} mixes kinds, which is_encoder_decoder=True does not support (its "
            "decoder layers have no entries): make every layer the same kind"
        )
    if config.sliding_window is None and "sliding_attention" in config.layer_types:
        raise ValueError(
            f"layer_types={config.layer_types!r} has sliding layers but sliding_window=None; set the window size "
            "or make every layer 'full_attention'"
        )


def check_caps(config: "PlugformerConfig") -> None:
    """The logit caps and the embedding scale finite and positive; an attention cap and sinks on dot products only."""
    for field in ("final_logit_softcapping", "embedding_multiplier"):
        value = getattr(config, field)
        if value is not None and not 0 < value < float("inf"):
            none = " or None (no capping)" if field == "final_logit_softcapping" else " (1.0: unscaled)"
            raise ValueError(f"{field}={value!r} must be a finite positive number{none}")
    cap = config.attn_logit_softcapping
    if cap is not None and not 0 < cap < float("inf"):
        raise ValueError(f"attn_logit_softcapping={cap!r} must be a finite positive number or None (no capping)")
    if cap is not None and not ATTENTION_SCORES.get(config.attention_score).dot_product:
        raise ValueError(
            f"attn_logit_softcapping={cap!r} caps dot-product logits, which attention_score="
            f"{config.attention_score!r} has not; use a score whose `dot_product` is true, or None"
        )
    if config.use_attention_sinks and not ATTENTION_SCORES.get(config.attention_score).dot_product:
        raise ValueError(
            f"use_attention_sinks=True is applied by the dot-product kernels, not by attention_score="
            f"{config.attention_score!r}'s own; use a score whose `dot_product` is true, or False"
        )
