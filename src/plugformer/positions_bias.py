"""Score-bias position schemes: an additive bias on the attention scores that depends on key slot − query slot only,
fixed (`alibi`) or learned per head and shared by all layers (`t5_bias`, `clamped_bias`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import initialization as init

from .positions_base import POSITION_SCHEMES, PositionScheme


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric head slopes of ALiBi (Press et al. 2022, §3): for n a power of two, 2^(-8i/n), i = 1..n.

    Otherwise the slopes of the closest lower power of two, then every other slope of twice that many heads.
    """
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * i / closest) for i in range(1, closest + 1)]
    extra = [2 ** (-4 * i / closest) for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes + extra, dtype=torch.float32)


@POSITION_SCHEMES.register("alibi")
class AlibiPositions(PositionScheme):
    """ALiBi: a fixed linear penalty −m_h · |i − j| on the score of query i and key j (Press et al. 2022)."""

    has_bias = True

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.slopes = nn.Buffer(alibi_slopes(self.num_heads), persistent=False)

    def distance_bias(self, distances):
        return -self.slopes[:, None] * distances.abs().float()  # (H, M)

    def reset_parameters(self, config):
        init.copy_(self.slopes, alibi_slopes(self.num_heads))


def t5_relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucketing of key − query distances (Raffel et al. 2020, §2.1): half the buckets are exact small
    distances, the rest grow logarithmically up to `max_distance`; beyond it everything shares the last bucket.
    With `bidirectional`, half the buckets serve keys after the query. Future keys of a causal model share bucket 0.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log-spaced buckets for max_exact <= distance < max_distance; the clamp keeps log() finite for small ones
    log_ratio = torch.log(distance.float().clamp(min=max_exact) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


# A learned (distances or buckets, H) table under tensor parallelism: split by columns, i.e. by head ("embedding_colwise"
# shards dim 1), and looked up in this rank's shard ("local_params" runs the embedding's forward on local tensors),
# which gives the bias of exactly the heads whose queries the column-parallel q_proj left on this rank.
HEAD_TABLE_TP_PLAN = {
    "relative_attention_bias.weight": "embedding_colwise",
    "relative_attention_bias": "local_params",
}


@POSITION_SCHEMES.register("t5_bias")
class T5BucketBias(PositionScheme):
    """A learned scalar per head per T5 distance bucket (Raffel et al. 2020, §2.1), shared by all layers (as in T5)."""

    has_bias = True
    tp_plan = HEAD_TABLE_TP_PLAN
    config_fields = ("relative_attention_num_buckets", "relative_attention_max_distance")

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.relative_attention_bias = nn.Embedding(self.num_buckets, self.num_heads)

    @classmethod
    def validate_config(cls, config):
        buckets, distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
        if buckets > distance:
            raise ValueError(
                f"relative_attention_num_buckets={buckets} must not exceed relative_attention_max_distance={distance} "
                "(T5 buckets cover distances up to the max distance)"
            )
        if buckets < 4:
            raise ValueError(
                f"relative_attention_num_buckets={buckets} must be >= 4 (half exact, half logarithmic buckets, for "
                "each direction of an encoder)"
            )

    def distance_bias(self, distances):
        buckets = t5_relative_position_bucket(distances, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).T  # (M, H) -> (H, M)


@POSITION_SCHEMES.register("clamped_bias")
class ClampedDistanceBias(PositionScheme):
    """A learned scalar per head per relative distance, distances clamped to ±`max_relative_distance` (the
    scalar-bias form of Shaw et al. 2018), shared by all layers.

    `max_relative_distance + 1` values per head for a causal model (twice that for an encoder), whatever the sequence
    length.
    """

    has_bias = True
    tp_plan = HEAD_TABLE_TP_PLAN
    config_fields = ("max_relative_distance",)

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.max_distance = config.max_relative_distance
        num_distances = 2 * self.max_distance + 1 if self.bidirectional else self.max_distance + 1
        self.relative_attention_bias = nn.Embedding(num_distances, self.num_heads)

    def distance_bias(self, distances):  # key − query
        if self.bidirectional:
            index = distances.clamp(-self.max_distance, self.max_distance) + self.max_distance
        else:
            # How far back the key lies; future keys are masked, clamping them to 0 just keeps indices valid.
            index = (-distances).clamp(0, self.max_distance)
        return self.relative_attention_bias(index).T  # (M, H) -> (H, M)


def inverse_softplus(value: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = value (> 0): log(expm1(value))."""
    return torch.log(torch.expm1(value))


@POSITION_SCHEMES.register("kerple_log")
class KerpleLogBias(PositionScheme):
    """KERPLE's logarithmic bias −r1_h · log(1 + r2_h · |i − j|) with r1, r2 > 0 learned per head, shared by all
    layers (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", the
    logarithmic variant).

    The paper requires r1, r2 > 0; here they are kept positive by a softplus parametrisation (r = softplus(raw)),
    differs from the paper's code, which clamps the parameters after each step. Initialised to r1 = 1 and r2 = ALiBi's
    head slopes (our choice, so that heads start at different scales).
    """

    has_bias = True
    # r1, r2 are (H,) parameters no plan shards: under tensor parallelism each rank would train its heads' entries only
    tensor_parallel = False

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.bias_scale = nn.Parameter(torch.empty(self.num_heads))  # softplus -> r1, (H,)
        self.bias_rate = nn.Parameter(torch.empty(self.num_heads))  # softplus -> r2, (H,)
        self.reset_parameters(config)

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2), each `(H,)` and positive."""
        return nn.functional.softplus(self.bias_scale), nn.functional.softplus(self.bias_rate)

    def distance_bias(self, distances):
        r1, r2 = self.coefficients()
        return -r1[:, None] * torch.log1p(r2[:, None] * distances.abs().float())  # (H, M)

    def reset_parameters(self, config):
        init.copy_(self.bias_scale, inverse_softplus(torch.ones(self.num_heads)))
        init.copy_(self.bias_rate, inverse_softplus(alibi_slopes(self.num_heads)))
