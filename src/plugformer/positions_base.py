"""The position-scheme contract: the `POSITION_SCHEMES` table, the `PositionScheme` base class whose hooks every scheme
answers, and `none` (no positions at all). The schemes themselves live in one module per family, `positions_absolute`,
`positions_rotary` and `positions_bias`; import them through `positions`, which registers them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .biases import QueryBiasRecipe, RelativeBias
from .registry import ConfigHooks, Registry


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


POSITION_SCHEMES: Registry[PositionScheme] = Registry("position_scheme")


class PositionScheme(ConfigHooks, nn.Module):
    """Base class: no position information at all (the hooks all return `None`).

    Class attributes:
        has_bias (`bool`): whether the scheme adds a score bias (`bias_values`; the stack skips the call otherwise,
            flash kernels refuse such schemes).
        bias_type (`type`): the kind of bias object (`biases.BIAS_KINDS`) the kernels get from `bias_values`: a
            `RelativeBias` (per distance) by default; kernels whose record does not list its `kind` refuse the scheme.
        tp_plan (`dict[str, str]`): tensor-parallel styles of this scheme's own modules and parameters, keyed relative
            to the scheme (the config's `base_model_tp_plan` adds them under `positions.`). A learned per-head table
            is split on its head dimension, so the stack's bias values hold only the heads of this rank; a bias
            computed for all heads (ALiBi's fixed slopes, a buffer no plan reaches) is sliced by each attention layer.

        tensor_parallel (`bool`): whether tensor parallelism computes this scheme exactly. A scheme whose per-head
            parameters no plan shards (each rank would hold every head's copy and train only its own heads' entries,
            so the copies drift apart) says `False` and is refused under `tp_plan`.
        per_layer (`bool`): whether each attention layer computes this scheme's bias from its own input (forgetting
            attention's gates), through `build_layer`, `token_states` and `layer_bias`, instead of the stack once per
            forward through `bias_values`.
        layer_tp_plan (`dict[str, str]`): tensor-parallel styles of the modules `build_layer` adds, keyed relative to
            the attention (the config's `base_model_tp_plan` adds them under `layers.*.self_attn.`: `stack_tp_plan`).

    The config hooks (`config_fields`, `validate_config`, ...) are those of every variant (`registry.ConfigHooks`).

    Attributes:
        token_scale (`float`): multiplies the token embeddings, looked up from `input_ids` or passed as
            `inputs_embeds` alike (as transformers' Marian decoder does), before `embed()` is added.
    """

    has_bias = False
    bias_type = RelativeBias
    tp_plan: dict[str, str] = {}
    tensor_parallel = True
    per_layer = False
    layer_tp_plan: dict[str, str] = {}
    token_scale = 1.0

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        # Encoders see keys on both sides of the query; by default the config says which this stack is.
        self.bidirectional = not config.is_causal if bidirectional is None else bidirectional

    @classmethod
    def stack_tp_plan(cls) -> dict[str, str]:
        """`tp_plan` and `layer_tp_plan` keyed relative to the stack, under `positions.` and `layers.*.self_attn.`."""
        plans = ((cls.tp_plan, "positions."), (cls.layer_tp_plan, "layers.*.self_attn."))
        return {f"{prefix}{name}": style for plan, prefix in plans for name, style in plan.items()}

    @classmethod
    def max_length(cls, config: PlugformerConfig) -> int | None:
        """The longest sequence this scheme can encode, or `None` when any length works."""
        return None

    @classmethod
    def linear_bias_slopes(cls, config: PlugformerConfig) -> torch.Tensor | None:
        """The per-head slopes m_h `(H,)` when this scheme's bias is ALiBi's linear −m_h · |i − j| and nothing else,
        else `None`. An engine that adds that bias itself from the slopes (vLLM's attention, kernel record
        `bias="alibi"`) computes exactly the schemes that answer here."""
        return None

    @classmethod
    def constant_bias_distance(cls, config: PlugformerConfig) -> int | None:
        """A distance W from which this scheme's bias is one value per head on each side of the query (every farther
        distance looks up the same parameter), or `None`. The sdpa kernel scores the keys beyond it with the fused
        causal kernel (`biases.RelativeBias.constant_beyond`)."""
        return None

    def embed(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def rotary(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    # The score bias, in three roles: `distance_bias` is the hook a bias of distance alone implements; `bias_values`
    # (or, in training on some kernels, its lazy stand-in `bias_recipe`) is what the stack hands the kernels once per
    # forward; `bias` is the dense tensor of any slots, to inspect and to test against (the model never calls it).

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor | None:
        """The hook of a bias of key slot − query slot alone: `distances` `(M,)` -> the float score bias `(H, M)` at
        those distances. The base class derives `bias_values` and `bias` from it."""
        return None

    def bias_values(
        self, query_offset: int, query_length: int, key_offset: int, key_length: int, position_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The values of the `bias_type` object the kernels get, for queries at slots `query_offset + i` (i < Q) whose
        positions are `position_ids` `(B or 1, Q)`, over keys at slots `key_offset + j` (j < K); `None` without a bias.
        By default the `RelativeBias` values `(H, Q + K − 1)` from `distance_bias`, from the last query's distance to
        the first key up (the positions are not needed)."""
        if not self.has_bias:
            return None
        lowest = key_offset - (query_offset + query_length - 1)  # the last query's distance to the first key
        return self.distance_bias(torch.arange(query_length + key_length - 1, device=position_ids.device) + lowest)

    def bias_recipe(
        self,
        query_offset: int,
        query_length: int,
        key_offset: int,
        key_length: int,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> QueryBiasRecipe | None:
        """A `QueryBiasRecipe` standing in for `bias_values(...).to(dtype)` (same arguments), for a kernel that computes
        the bias a block of rows at a time in training (`capabilities.KernelSpec.bias_recipe`); `None` (the default)
        when the scheme has none, or nothing needs a gradient: the stack then computes the values."""
        return None

    def bias(self, query_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor | None:
        """The dense score bias `(1, H, Q, K)` of queries at `query_slots` (Q,), taken as their positions, over keys at
        `key_slots` (K,); `None` without a bias. For plots and reference tests."""
        if not self.has_bias:
            return None
        distance = relative_distances(query_slots, key_slots)  # (Q, K)
        return self.distance_bias(distance.flatten()).view(-1, *distance.shape)[None]  # (1, H, Q, K)

    def reset_parameters(self, config: PlugformerConfig) -> None:
        """(Re)initialises parameters and buffers the generic `_init_weights` does not know; uses
        `transformers.initialization`, which leaves weights loaded from a checkpoint untouched."""

    # The hooks of a `per_layer` scheme, called by each attention layer (with itself as `attention`) in its forward:
    # `token_states` after the projections, the cache update through `TokenStates`, `layer_bias` before the kernel.

    @classmethod
    def build_layer(cls, attention: nn.Module, config: PlugformerConfig) -> None:
        """Adds the modules a `per_layer` scheme needs in every attention layer to `attention` (saved with it, as
        `layers.N.self_attn.<name>`)."""

    @classmethod
    def token_states(cls, attention: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """A `per_layer` scheme's numbers per token and query head, `(B, T, H)`, from the layer's input
        `hidden_states` `(B, T, hidden)`: the KV cache keeps them beside the token's values (`TokenStates`)."""
        raise NotImplementedError(f"position_scheme={cls.name!r} computes no bias per layer")

    @classmethod
    def layer_bias(cls, states: torch.Tensor, query_start: int | torch.Tensor, query_length: int) -> torch.Tensor:
        """A `per_layer` scheme's bias values (of its `bias_type`) from the `token_states` `(B, H, K)` of every key
        slot the kernel sees, in slot order, the queries at key slots `query_start + i` (i < `query_length`)."""
        raise NotImplementedError(f"position_scheme={cls.name!r} computes no bias per layer")


class TokenStates:
    """Carries a `per_layer` scheme's `token_states` through the KV cache beside the values, standing in for the cache
    in the attention projection's `keys_and_values` for one forward of one layer.

    Its `update` appends each token's states to its value state as more channels, per key/value head (query head h
    with the value head it reads: with GQA each value head carries its group's), updates the cache, and splits them
    off again: the values the cache returns are the projection's, `states` then covers every key slot the kernel sees,
    and every cache (dynamic, static, sliding-window, beam reordering, cropping, a latent cache's rotated key part)
    keeps them exactly as it keeps the values. Without a cache, `states` are the current tokens'.

    Args:
        states (`torch.Tensor` of shape `(B, T, H)`): the current tokens' states.
        cache (`Cache`, *optional*): the layer's cache.
        layer_idx (`int`): the layer.

    Attributes:
        states (`torch.Tensor` of shape `(B, H, K)`): the states of every key slot, after `update`.
        query_start (`int` or 0-d `torch.Tensor`): the key slot of the first query among them (the cached tokens'
            count, less those a sliding window dropped), read before the update as the mask reads it.
    """

    def __init__(self, states: torch.Tensor, cache, layer_idx: int):
        self.cache, self.layer_idx = cache, layer_idx
        self.states = states.transpose(1, 2)  # (B, T, H) -> (B, H, T)
        query_length = states.shape[1]
        self.query_start = 0
        if cache is not None:
            self.query_start = cache.get_query_offset(layer_idx) - cache.get_mask_sizes(query_length, layer_idx)[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The cache's `update` with the states as extra value channels; returns the keys and the values alone."""
        if self.cache is None:  # in the values' dtype, as a cache would keep them: one path, cached or not
            self.states = self.states.to(value_states.dtype)
            return key_states, value_states
        batch, heads, length = self.states.shape
        groups = value_states.shape[1]  # value heads (1 for a latent cache): each carries heads / groups states
        carried = self.states.reshape(batch, groups, heads // groups, length).transpose(2, 3)  # (B, H_v, T, H / H_v)
        width = value_states.shape[-1]
        key_states, value_states = self.cache.update(
            key_states, torch.cat([value_states, carried.to(value_states.dtype)], dim=-1), layer_idx, *args, **kwargs
        )  # (B, H_v, K, width + H / H_v)
        carried = value_states[..., width:]
        self.states = carried.transpose(2, 3).reshape(batch, heads, -1)  # (B, H_v, K, H / H_v) -> (B, H, K)
        return key_states, value_states[..., :width]


@POSITION_SCHEMES.register("none")
class NoPositions(PositionScheme):
    """No positions: attention is permutation-equivariant except for the causal mask (NoPE)."""


def relative_distances(query_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """(Q,), (K,) -> (Q, K) of key slot − query slot (negative = the key lies in the past)."""
    return key_slots[None, :] - query_slots[:, None]
