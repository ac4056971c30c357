"""Attention projections: one registered class per `config.attention_projection`.

A projection maps the hidden states to the queries, keys and values of every head and back: it adds its modules to
the attention under transformers' names (so checkpoints and PEFT targets carry over), rotates the part of the queries
and keys that carries positions, and decides what the KV cache holds. Inside attention the order stays fixed:

    `project` (-> rotate) -> score `prepare_query` -> `keys_and_values` (score `prepare_key`, cache update) ->
    score `prepare_value` -> kernel -> score `prepare_output` -> `o_proj`

- `standard`: q, k, v, o projections per head (GQA/MQA by `num_key_value_heads`), QK-norm, RoPE over each head;
- `latent`: multi-head latent attention (DeepSeek-V2, Liu et al. 2024, §2.1; transformers' `DeepseekV3Attention`):
  queries through an optional low-rank latent, keys and values expanded from one shared compressed latent per token,
  plus a decoupled RoPE key part shared by the heads; the cache may hold that latent instead of the keys and values.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from .layers import RMSNorm
from .positions import POSITION_SCHEMES, apply_rotary
from .registry import ConfigHooks, Registry


if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from .configuration import PlugformerConfig


ATTENTION_PROJECTIONS: Registry[AttentionProjection] = Registry("attention_projection")


class AttentionProjection(ConfigHooks):
    """Base class of the attention projections: stateless, its modules live on the attention it builds them into.

    Class attributes:
        tensor_parallel (`bool`, defaults to `True`): whether its `tp_plan` shards its modules exactly; `False` is
            refused under `tp_plan`.
        standard_heads (`bool`, defaults to `True`): whether the kernel gets `num_key_value_heads` key/value heads of
            `head_dim` (the shapes an engine that sizes its own KV cache from the config, vLLM's, allocates);
            kernels whose record says `head_shapes=False` refuse the others.

    The config hooks (`config_fields`, `validate_config`, ...) are those of every variant (`registry.ConfigHooks`).
    """

    tensor_parallel = True
    standard_heads = True

    @classmethod
    def complete_config(cls, config: PlugformerConfig) -> None:
        """Fills the sizes this projection derives from others (called before `head_dim` gets its default)."""

    @classmethod
    def query_key_dim(cls, config: PlugformerConfig) -> int:
        """Width d_k of one head's query and key, as the score functions see them."""
        return config.head_dim

    @classmethod
    def value_dim(cls, config: PlugformerConfig) -> int:
        """Width of one head's value (before a score's `value_width`)."""
        return config.head_dim

    @classmethod
    def scaling_factor(cls, config: PlugformerConfig) -> float:
        """Multiplies the score's softmax scale."""
        return 1.0

    @staticmethod
    def build(attention: nn.Module, config: PlugformerConfig) -> None:
        """Adds the projection modules (`q_proj`, ..., `o_proj`) to `attention`."""
        raise NotImplementedError

    @classmethod
    def tp_plan(cls, config: PlugformerConfig) -> dict[str, str]:
        """transformers' tensor-parallel styles of the modules `build` adds for `config`, keyed by module name (the
        config's `base_model_tp_plan` adds them under `layers.*.self_attn.`): exactly the modules built."""
        raise NotImplementedError

    @staticmethod
    def project(attention: nn.Module, hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None):
        """(B, T, hidden) -> `(query (B, H, T, d_k), key state, value state, gate)`, the queries and keys rotated by
        `rotary` (`None`: no rotation); the key and value states are what `keys_and_values` turns into the kernel's;
        `gate`: the output gate's logits (B, T, H·d_v) with `use_gated_attention`, else `None`."""
        raise NotImplementedError

    @staticmethod
    def token_values(attention: nn.Module, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The states of `project` -> the current tokens' own projected values `(B, H_kv, T, d_v)`, those
        `keys_and_values` puts in the cache for them (`exclusive_self_attention` reads them): the value states."""
        return value

    @staticmethod
    def keys_and_values(attention: nn.Module, key: torch.Tensor, value: torch.Tensor, cache: Cache | None):
        """The states of `project` -> the keys the kernel consumes (score `prepare_key` applied) and the projected
        values, `(B, H_kv, K, d_k)` and `(B, H_kv, K, d_v)` over every cached slot; the cache updated."""
        if "prepare_key" in attention.score_hooks:
            key = attention.score.prepare_key(key)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx)
        return key, value


@ATTENTION_PROJECTIONS.register("standard")
class StandardProjection(AttentionProjection):
    """One query, key and value projection per head (Vaswani et al. 2017), grouped key/value heads (GQA/MQA) by
    `num_key_value_heads`; optional QK-norm; the position scheme rotates each whole head (or its first part)."""

    # GQA and QK-norm are this projection's: under another, a preset's `num_key_value_heads` is dropped (one key/value
    # head per query head) and a setting that would change nothing is refused
    config_fields = ("num_key_value_heads", "use_qk_norm")
    unused_fields_refused = True

    @classmethod
    def refuse_unused_config(cls, config):
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads={config.num_key_value_heads} groups key/value heads, which attention_projection="
                f"{config.attention_projection!r} does not (it expands keys and values for every query head); use "
                f"num_key_value_heads={config.num_attention_heads} or leave it unset"
            )
        if config.use_qk_norm:
            raise ValueError(
                f"use_qk_norm=True normalises each head's projected queries and keys, which attention_projection="
                f"{config.attention_projection!r} does not project; use False"
            )

    @staticmethod
    def build(attention, config):
        bias = config.attention_bias
        q_width, kv_width = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        # `use_gated_attention` (Qwen3-Next): each head's query columns, then its gate's
        attention.q_proj = nn.Linear(config.hidden_size, q_width * (2 if config.use_gated_attention else 1), bias=bias)
        attention.k_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        attention.v_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        attention.o_proj = nn.Linear(q_width, config.hidden_size, bias=bias)

    @classmethod
    def tp_plan(cls, config):
        # Megatron-LM's layout, as transformers' Llama: q, k, v split by output columns (whole heads per rank), o by
        # input rows, one all-reduce after it
        return {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}

    @staticmethod
    def project(attention, hidden_states, rotary):
        # `split_heads` inlined, one shape for queries, keys and values (as Llama's): a call is a share of a small
        # model's decoding step
        heads = (*hidden_states.shape[:-1], -1, attention.head_dim)
        if attention.gated:
            query, gate = attention.project_query(hidden_states)  # (B, H, T, D) QK-normed, gate (B, T, H·D)
        else:
            query, gate = attention.q_proj(hidden_states).view(heads).transpose(1, 2), None  # (B, H, T, D)
            query = attention.q_norm(query) if attention.uses_qk_norm else query
        key = attention.k_proj(hidden_states).view(heads).transpose(1, 2)  # (B, T, H_kv·D) -> (B, H_kv, T, D)
        if attention.uses_qk_norm:
            key = attention.k_norm(key)
        value = attention.v_proj(hidden_states).view(heads).transpose(1, 2)  # (B, T, H_kv·D) -> (B, H_kv, T, D)
        if rotary is not None:
            query, key = apply_rotary(query, key, *rotary)
        return query, key, value, gate


# DeepSeek's latent norms keep RMSNorm's default epsilon whatever `rms_norm_eps` says (transformers' DeepseekV3 builds
# `q_a_layernorm` and `kv_a_layernorm` without it, as DeepSeek's own model.py does)
LATENT_NORM_EPS = 1e-6


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weight layout, `rope_interleave`), each pair
    rotated by one frequency; the result lists the pairs' first coordinates, then their second (transformers'
    DeepseekV3 layout, kept so a latent cache holds its keys). `cos`, `sin`: (B, 1, T, d) = cat(angles, angles)."""
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]  # (B, 1, T, d/2): one angle per pair
    first, second = x[..., 0::2], x[..., 1::2]  # (B, ·, T, d/2) each
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


@ATTENTION_PROJECTIONS.register("latent")
class LatentProjection(AttentionProjection):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, §2.1; transformers' `DeepseekV3Attention`, its
    names): keys and values expanded per head from one compressed latent of `kv_lora_rank` per token, queries through
    a latent of `q_lora_rank`, and a decoupled RoPE key part of `qk_rope_head_dim` shared by the heads.

    Per token, with RMSNorm on both latents (`q_a_layernorm`, `kv_a_layernorm`):

        c_q = norm(q_a_proj x),  [q_nope, q_rope] = q_b_proj c_q     (or `q_proj` x when `q_lora_rank` is None)
        [c_kv, k_rope] = kv_a_proj_with_mqa x,  [k_nope, v] = kv_b_proj norm(c_kv)
        q = [q_nope, RoPE(q_rope)],  k = [k_nope, RoPE(k_rope)]  (k_rope the same for every head)

    so each head scores over `qk_nope_head_dim + qk_rope_head_dim` dims and reads `v_head_dim`-wide values. The score
    function sees those widths (`scaled_dot`: DeepseekV3's 1/sqrt(d_k), times YaRN's mscale² when `rope_parameters`
    set `mscale_all_dim`); `head_dim` is the rotated width, `qk_rope_head_dim` (transformers' DeepseekV3 config),
    so every RoPE type computes its frequencies for it. `rope_interleave` rotates interleaved pairs, as DeepSeek's
    checkpoints expect. `use_latent_cache` makes the KV cache hold (c_kv, RoPE(k_rope)), `kv_lora_rank +
    qk_rope_head_dim` numbers per token and layer (transformers' DeepseekV3 cache), expanded again at every step,
    instead of `num_attention_heads · (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)`.

    Refused: key/value heads other than the query heads (the latent expands to every head) and `use_qk_norm` (the
    latents are normalised), both the standard projection's fields; `use_gated_attention` and `value_residual` (both
    act on the standard q_proj and v_proj); a `partial_rotary_factor` (the RoPE part is rotated
    whole), a seq2seq model; tensor parallelism (`tensor_parallel`) and engines sizing their cache from `head_dim`.
    """

    config_fields = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "rope_interleave",
        "use_latent_cache",
    )
    unused_fields_refused = True
    tensor_parallel = False
    standard_heads = False

    @classmethod
    def complete_config(cls, config):
        # DeepSeek-V2's proportions (§2.1.3, §3.1.2): d_c = 4·d_h, d_h^R = d_h / 2, from d_h = hidden / heads
        per_head = config.hidden_size // config.num_attention_heads
        if config.qk_rope_head_dim is None:
            config.qk_rope_head_dim = config.head_dim if config.head_dim is not None else max(2, per_head // 2)
        if config.head_dim is not None and config.head_dim != config.qk_rope_head_dim:
            raise ValueError(
                f"head_dim={config.head_dim} must equal qk_rope_head_dim={config.qk_rope_head_dim} with "
                "attention_projection='latent' (the rotated width, as in transformers' DeepseekV3); leave head_dim unset"
            )
        config.head_dim = config.qk_rope_head_dim
        config.qk_nope_head_dim = config.qk_nope_head_dim or per_head
        config.v_head_dim = config.v_head_dim or per_head
        config.kv_lora_rank = config.kv_lora_rank or 4 * per_head

    @classmethod
    def validate_config(cls, config):
        if config.is_encoder_decoder:
            raise ValueError(
                "attention_projection='latent' is not supported with is_encoder_decoder=True (allowed: "
                "'standard'): cross-attention has no latent to cache"
            )
        for field, value, why in (
            ("use_gated_attention", config.use_gated_attention, "its gate is a second half of the standard q_proj"),
            ("value_residual", config.value_residual, "it mixes v_proj's values, which the latent expands per step"),
        ):
            if value not in (None, False):
                raise ValueError(
                    f"{field}={value!r} is not supported with attention_projection='latent' (allowed: "
                    f"{False if field == 'use_gated_attention' else None}): {why}"
                )
        rotates = "rope_parameters" in POSITION_SCHEMES.get(config.position_scheme).config_fields
        if config.rope_interleave and not rotates:
            raise ValueError(
                f"rope_interleave=True lays out rotated pairs, which position_scheme="
                f"{config.position_scheme!r} does not rotate; use False, or a rotary scheme"
            )
        factor = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0) if rotates else 1.0
        if factor != 1.0:
            raise ValueError(
                f"rope_parameters['partial_rotary_factor']={factor!r} is not supported with attention_projection="
                "'latent' (allowed: 1.0): qk_rope_head_dim is the rotated part of each head; size it instead"
            )

    @classmethod
    def refuse_unused_config(cls, config):
        for field in cls.config_fields:
            if getattr(config, field) not in (None, False):
                raise ValueError(
                    f"{field}={getattr(config, field)!r} configures multi-head latent attention, which attention_"
                    f"projection={config.attention_projection!r} does not use; drop it, or use "
                    "attention_projection='latent'"
                )

    @classmethod
    def query_key_dim(cls, config):
        return config.qk_nope_head_dim + config.qk_rope_head_dim

    @classmethod
    def value_dim(cls, config):
        return config.v_head_dim

    @classmethod
    def scaling_factor(cls, config):
        # YaRN's attention temperature for the whole softmax (DeepSeek-V2's `mscale_all_dim`; transformers'
        # DeepseekV3 `yarn_apply_mscale`): (0.1·mscale_all_dim·ln(factor) + 1)² when the context is extended
        rope = config.rope_parameters or {}
        factor, mscale_all_dim = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
        if rope.get("rope_type", "default") == "default" or not mscale_all_dim or factor <= 1:
            return 1.0
        return (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2

    @staticmethod
    def build(attention, config):
        heads, qk_dim = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:  # DeepSeek-V2-Lite: queries projected directly
            attention.q_proj = nn.Linear(config.hidden_size, heads * qk_dim, bias=False)
        else:
            attention.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            attention.q_a_layernorm = RMSNorm(config, config.q_lora_rank, eps=LATENT_NORM_EPS)
            attention.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        attention.kv_a_proj_with_mqa = nn.Linear(
            config.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=config.attention_bias
        )
        attention.kv_a_layernorm = RMSNorm(config, config.kv_lora_rank, eps=LATENT_NORM_EPS)
        attention.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        attention.o_proj = nn.Linear(heads * config.v_head_dim, config.hidden_size, bias=config.attention_bias)

    @classmethod
    def tp_plan(cls, config):
        # transformers' DeepseekV3 plan, less the query projection not built; refused under tensor parallelism all
        # the same (`tensor_parallel`), so a plan matching the modules, not a tested layout
        query = {"q_proj": "colwise"} if config.q_lora_rank is None else {"q_b_proj": "colwise"}
        return {**query, "kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise", "o_proj": "rowwise"}

    @staticmethod
    def project(attention, hidden_states, rotary):
        config = attention.config
        batch, length = hidden_states.shape[:2]
        if config.q_lora_rank is None:
            query = attention.q_proj(hidden_states)
        else:
            query = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden_states)))
        query = query.view(batch, length, config.num_attention_heads, -1).transpose(1, 2)  # (B, H, T, d_nope + d_rope)
        query_nope, query_rope = query.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
        latent, key_rope = attention.kv_a_proj_with_mqa(hidden_states).split(
            [config.kv_lora_rank, config.qk_rope_head_dim], dim=-1
        )  # (B, T, r), (B, T, d_rope)
        # one head each: a cache layer stores them as keys (B, 1, T, r) and values (B, 1, T, d_rope)
        latent = attention.kv_a_layernorm(latent)[:, None]
        key_rope = key_rope[:, None]
        if rotary is not None:
            if config.rope_interleave:
                cos, sin = rotary[0][:, None], rotary[1][:, None]  # (B, 1, T, d_rope)
                query_rope, key_rope = rotate_interleaved(query_rope, cos, sin), rotate_interleaved(key_rope, cos, sin)
            else:
                query_rope, key_rope = apply_rotary(query_rope, key_rope, *rotary)
        return torch.cat((query_nope, query_rope), dim=-1), latent, key_rope, None

    @staticmethod
    def token_values(attention, key, value):
        return LatentProjection.expand(attention, key, value)[1]  # (B, H, T, d_v) from the current latents

    @staticmethod
    def keys_and_values(attention, key, value, cache):
        latent, key_rope = key, value  # the states of `project`: (B, 1, T, r), (B, 1, T, d_rope)
        if cache is not None and attention.config.use_latent_cache:
            latent, key_rope = cache.update(latent, key_rope, attention.layer_idx)  # (B, 1, K, ·)
        key, value = LatentProjection.expand(attention, latent, key_rope)
        key = attention.score.prepare_key(key)
        if cache is not None and not attention.config.use_latent_cache:
            key, value = cache.update(key, value, attention.layer_idx)
        return key, value

    @staticmethod
    def expand(attention, latent: torch.Tensor, key_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents (B, 1, K, r) and rotated key parts (B, 1, K, d_rope) -> keys (B, H, K, d_nope + d_rope) and
        values (B, H, K, d_v) of every head."""
        config = attention.config
        batch, _, length, _ = latent.shape
        expanded = attention.kv_b_proj(latent).view(batch, length, config.num_attention_heads, -1).transpose(1, 2)
        key_nope, value = expanded.split([config.qk_nope_head_dim, config.v_head_dim], dim=-1)  # (B, H, K, ·)
        key = torch.cat((key_nope, key_rope.expand(-1, key_nope.shape[1], -1, -1)), dim=-1)  # (B, H, K, d_k)
        return key, value
