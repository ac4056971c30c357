"""Norms, their placement around each sublayer, and feed-forward blocks: one registered class per config value
(`norm_type`, `norm_placement`, `ffn_type`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.activations import ACT2FN

from .registry import Registry


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


NORMS: Registry[nn.Module] = Registry("norm_type")
NORM_PLACEMENTS: Registry[NormPlacement] = Registry("norm_placement")
FEED_FORWARDS: Registry[nn.Module] = Registry("ffn_type")


@NORMS.register("layernorm")
class LayerNorm(nn.LayerNorm):
    """LayerNorm (Ba et al. 2016) with a learned gain and bias; `eps = config.layer_norm_eps`."""

    def __init__(self, config: PlugformerConfig):
        super().__init__(config.hidden_size, eps=config.layer_norm_eps)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / rms(x) · g, computed in fp32 (as Llama's); `eps = config.rms_norm_eps`."""

    def __init__(self, config: PlugformerConfig, size: int | None = None, eps: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size or config.hidden_size))  # a head's d_k for QK-norm
        self.variance_epsilon = config.rms_norm_eps if eps is None else eps  # `eps`: a latent norm's own (MLA)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)


class NormPlacement:
    """Where a block's norm sits relative to its residual connection.

    Class attributes:
        final_norm (`bool`): whether the stack ends with a norm before the head.
    """

    final_norm = True

    @staticmethod
    def residual(hidden_states: torch.Tensor, sublayer: Callable, norm: nn.Module) -> torch.Tensor:
        raise NotImplementedError


@NORM_PLACEMENTS.register("pre")
class PreNorm(NormPlacement):
    """x + F(norm(x)) (GPT-2, Llama); a final norm closes the stack."""

    final_norm = True

    @staticmethod
    def residual(hidden_states, sublayer, norm):
        return hidden_states + sublayer(norm(hidden_states))


@NORM_PLACEMENTS.register("post")
class PostNorm(NormPlacement):
    """norm(x + F(x)): the original "Add & Norm" (Vaswani et al. 2017); the last block's norm is the final one."""

    final_norm = False

    @staticmethod
    def residual(hidden_states, sublayer, norm):
        return norm(hidden_states + sublayer(hidden_states))


@FEED_FORWARDS.register("mlp")
class MLP(nn.Module):
    """down(act(up(x))): the original position-wise FFN (GELU in GPT-2/BERT)."""

    def __init__(self, config: PlugformerConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


@FEED_FORWARDS.register("glu")
class GatedMLP(MLP):
    """down(act(gate(x)) * up(x)) (Shazeer 2020): SwiGLU with `hidden_act="silu"` (Llama), GeGLU with "gelu"."""

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
