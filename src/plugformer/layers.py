"""Norms, their placement around each sublayer, feed-forward blocks and value residuals: one registered class per
config value (`norm_type`, `norm_placement`, `ffn_type`, `value_residual`)."""

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
VALUE_RESIDUALS: Registry[nn.Module] = Registry("value_residual")


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
        output_norm (`bool`): whether each sublayer's output has a norm of its own (the block builds it and passes
            it to `residual` as `output_norm`; `None` otherwise).
    """

    final_norm = True
    output_norm = False

    @staticmethod
    def residual(
        hidden_states: torch.Tensor, sublayer: Callable, norm: nn.Module, output_norm: nn.Module | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def sublayer_input(hidden_states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """What `residual` feeds the sublayer."""
        raise NotImplementedError


@NORM_PLACEMENTS.register("pre")
class PreNorm(NormPlacement):
    """x + F(norm(x)) (GPT-2, Llama); a final norm closes the stack."""

    final_norm = True

    @staticmethod
    def residual(hidden_states, sublayer, norm, output_norm=None):
        return hidden_states + sublayer(norm(hidden_states))

    @staticmethod
    def sublayer_input(hidden_states, norm):
        return norm(hidden_states)


@NORM_PLACEMENTS.register("post")
class PostNorm(NormPlacement):
    """norm(x + F(x)): the original "Add & Norm" (Vaswani et al. 2017); the last block's norm is the final one."""

    final_norm = False

    @staticmethod
    def residual(hidden_states, sublayer, norm, output_norm=None):
        return norm(hidden_states + sublayer(hidden_states))

    @staticmethod
    def sublayer_input(hidden_states, norm):
        return hidden_states


@NORM_PLACEMENTS.register("sandwich")
class SandwichNorm(PreNorm):
    """x + norm'(F(norm(x))): a pre-norm block whose sublayer outputs are normed again before the residual add
    (Gemma 2's `post_attention_layernorm` and `post_feedforward_layernorm`; Ding et al. 2021, CogView's "sandwich
    LayerNorm"); a final norm closes the stack."""

    output_norm = True

    @staticmethod
    def residual(hidden_states, sublayer, norm, output_norm=None):
        return hidden_states + output_norm(sublayer(norm(hidden_states)))


@FEED_FORWARDS.register("mlp")
class MLP(nn.Module):
    """down(act(up(x))): the original position-wise FFN (GELU in GPT-2/BERT).

    Class attributes:
        tp_plan (`dict[str, str]`): tensor-parallel styles of its modules (the config's `base_model_tp_plan` adds them
            under `layers.*.mlp.`): up by output columns, down by input rows, one all-reduce after it (Megatron-LM).
    """

    tp_plan = {"up_proj": "colwise", "down_proj": "rowwise"}

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

    tp_plan = {"gate_proj": "colwise", **MLP.tp_plan}

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ValueResidual(nn.Module):
    """Value residual learning (Zhou et al. 2024, "Value Residual Learning For Alleviating Attention Concentration in
    Transformers"): layer n ≥ 2 attends with V_n' = λ1·V_n + λ2·V_1, its values mixed with the first layer's.

    Class attributes:
        tensor_parallel (`bool`): whether tensor parallelism computes it exactly (each rank mixes its own heads).
    """

    tensor_parallel = True

    def __init__(self, config: PlugformerConfig):
        super().__init__()

    def lambdas(self) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        raise NotImplementedError

    def forward(self, values: torch.Tensor, first_values: torch.Tensor) -> torch.Tensor:
        own, first = self.lambdas()
        return own * values + first * first_values  # (B, H_kv, T, D)


@VALUE_RESIDUALS.register("fixed")
class FixedValueResidual(ValueResidual):
    """V_n' = ½·V_n + ½·V_1 in every layer after the first: the paper's ResFormer (λ1 = λ2 = 0.5)."""

    def lambdas(self):
        return 0.5, 0.5


@VALUE_RESIDUALS.register("learned")
class LearnedValueResidual(ValueResidual):
    """V_n' = λ1·V_n + λ2·V_1 with λ1, λ2 learned per layer, from 0.5 each: the paper's Learnable-ResFormer (as
    modded-nanogpt's value-embedding lambdas). Not under tensor parallelism: no plan shards two scalars, and each
    rank's gradient would cover its own heads only."""

    tensor_parallel = False

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self.value_lambdas = nn.Parameter(torch.full((2,), 0.5))

    def lambdas(self):
        return self.value_lambdas[0], self.value_lambdas[1]
