"""Score-bias position schemes: an additive bias on the attention scores that depends on key slot − query slot only,
fixed (`alibi`) or learned per head and shared by all layers (`t5_bias`, `clamped_bias`, `kerple_log`), or also on
the query's position (`fire`, learned, shared by all layers)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import initialization as init

from .biases import QueryBiasRecipe, QueryPositionBias
from .piecewise import relu_mlp, relu_mlp_pieces
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

    @classmethod
    def linear_bias_slopes(cls, config):
        return alibi_slopes(config.num_attention_heads)

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

    @classmethod
    def constant_bias_distance(cls, config):
        """The first distance from which every farther one falls in the last bucket of its side, for a causal and a
        bidirectional stack alike: T5's logarithmic buckets reach the last one before
        `relative_attention_max_distance` (113 of 128 for a decoder's 32 buckets), and every distance less is a band
        the sdpa kernel computes by blocks."""
        buckets, max_distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
        distances = torch.arange(max_distance + 1, device="cpu")  # the last is in the last bucket (the clamp)
        first = []
        for bidirectional, signs in ((False, (-1,)), (True, (-1, 1))):
            for sign in signs:
                bucket = t5_relative_position_bucket(sign * distances, bidirectional, buckets, max_distance)
                first.append(int((bucket == bucket[-1]).nonzero()[0]))  # buckets only grow with the distance
        return max(first)

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

    @classmethod
    def constant_bias_distance(cls, config):
        return config.max_relative_distance  # the clamp

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


@POSITION_SCHEMES.register("fire")
class FireBias(PositionScheme):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers",
    §3): the bias of query i on key j ≤ i is f_θ(ψ(i − j) / ψ(max(L, i))), ψ(x) = log(c·x + 1), with f_θ an MLP
    (1 → `mlp_width` → ReLU → one output per head) and c, L learned; shared by all layers.

    Dividing by ψ of the query's position puts every distance a query sees in [0, 1] at any length (the paper's
    "progressive interpolation"): past the training length f_θ is asked for inputs it was trained on. The bias
    depends on the query's position, not on i − j only, so it reaches the kernels as a `QueryPositionBias`, computed
    per batch row: i is the query's position (`position_ids`: a left-padded row, or a decoding step, gets the
    positions the same text alone, or the full forward, has), i − j the slot distance (the position distance within
    a row's text: padding and other packed documents are masked).

    Parametrisation: c = |`distance_scale`|, initialised to 0.1; L = |`threshold_scale`| · 512, the scale
    initialised to 1 (a multiplier moves L by a useful step at a usual learning rate); ε = 1e-6 keeps the normaliser
    positive. The initial c and L follow the paper's appendix code as recalled when this was written (the paper was
    not at hand: re-check them). θ starts at torch's `nn.Linear` default, U(±1/√fan_in) (our choice:
    transformers' normal(initializer_range) would start every head near 0). f_θ's output bias adds a constant per
    head to all of a row's scores, which the softmax ignores, so it gets no gradient (kept: with attention sinks it
    counts). ψ and the division run in fp32 at least (bf16 holds integers exactly only up to 256).

    Bidirectional (an encoder; differs from the paper, which is causal): a key after the query gets the negative
    input −ψ(j − i) / ψ(max(L, j)), normalised by the later of the two positions as the causal form is (there the
    query is always the later one), so inputs lie in [−1, 1] and f_θ tells the directions apart.
    """

    has_bias = True
    bias_type = QueryPositionBias
    # f_θ's output layer is one unit per head and no plan shards it: each rank would train its heads' rows only
    tensor_parallel = False
    mlp_width = 32
    initial_distance_scale = 0.1
    initial_threshold = 512.0
    eps = 1e-6

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        # one-element vectors, not 0-d: FSDP2's `fully_shard` refuses 0-d parameters (a checkpoint saved with 0-d
        # ones loads: `legacy_weights` converts them)
        self.distance_scale = nn.Parameter(torch.empty(1))  # c = |distance_scale|
        self.threshold_scale = nn.Parameter(torch.empty(1))  # L = |threshold_scale| · initial_threshold
        self.mlp_in = nn.Linear(1, self.mlp_width)
        self.mlp_out = nn.Linear(self.mlp_width, self.num_heads)
        self.reset_parameters(config)

    def threshold(self) -> torch.Tensor:
        """L, the learned threshold below which positions are normalised by L itself (a one-element tensor)."""
        return self.threshold_scale.abs() * self.initial_threshold

    def bias_parameters(self) -> tuple[torch.Tensor, ...]:
        """c's and L's raw scales, then θ: the tensors the bias is a function of, in the order `fire_bias` takes them
        as `parameters`."""
        return (
            self.distance_scale,
            self.threshold_scale,
            self.mlp_in.weight,
            self.mlp_in.bias,
            self.mlp_out.weight,
            self.mlp_out.bias,
        )

    def mlp_inputs(self, query_positions: torch.Tensor, behind: torch.Tensor, parameters=None) -> torch.Tensor:
        """The normalised distances `(B or 1, Q, K)` f_θ reads, for queries at `query_positions` `(B or 1, Q)` over keys
        `behind` `(Q, K)` = query slot − key slot before them (negative: after them; masked in a causal stack);
        `parameters` as in `fire_bias`."""
        distance_scale, threshold_scale = (self.bias_parameters() if parameters is None else parameters)[:2]
        dtype = torch.promote_types(distance_scale.dtype, torch.float32)
        scale, threshold = distance_scale.abs().to(dtype), (threshold_scale.abs() * self.initial_threshold).to(dtype)
        later = query_positions[:, :, None].to(dtype)  # (B', Q, 1): the query's position i
        if self.bidirectional:
            later = later + (-behind).clamp(min=0).to(dtype)  # a key after the query: its position j
            sign = torch.where(behind < 0, -1.0, 1.0).to(dtype)
        else:
            sign = 1.0
        distance = behind.abs() if self.bidirectional else behind.clamp(min=0)  # future keys: 0 keeps ψ finite
        normaliser = torch.log1p(scale * torch.maximum(later, threshold)) + self.eps  # ψ(max(L, i))
        return sign * torch.log1p(scale * distance.to(dtype)) / normaliser  # (B', Q, K)

    def piecewise_tables(self, query_positions: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        """The bias of causal self-attention over `length` tokens from slot 0 as f_θ(psi[i − j]·inv_norm[b, i]) by
        pieces, for `kernels_fire_native`: psi `(N,)` = ψ(d), inv_norm `(B or 1, N)` = 1 / (ψ(max(L, i)) + ε) at the
        queries' positions, and `piecewise.relu_mlp_pieces`' kinks `(U,)`, slope and intercept `(H, U + 1)`, fp32 at
        least, under autograd from the parameters (`mlp_inputs`' formula, the division as a product)."""
        distance_scale, threshold_scale, *theta = self.bias_parameters()
        dtype = torch.promote_types(distance_scale.dtype, torch.float32)
        scale, threshold = distance_scale.abs().to(dtype), (threshold_scale.abs() * self.initial_threshold).to(dtype)
        psi = torch.log1p(scale * torch.arange(length, device=query_positions.device, dtype=dtype))  # (N,)
        later = torch.maximum(query_positions.to(dtype), threshold)  # (B', N)
        inv_norm = 1.0 / (torch.log1p(scale * later) + self.eps)
        kinks, slope, intercept = relu_mlp_pieces(*theta, dtype)
        return psi, inv_norm, kinks, slope, intercept

    def fire_bias(self, query_positions: torch.Tensor, behind: torch.Tensor, parameters=None) -> torch.Tensor:
        """f_θ of `mlp_inputs`, as the bias `(B or 1, H, Q, K)` in θ's dtype; from `parameters` (tensors in the order
        of `bias_parameters`, e.g. the detached copies a kernel's backward recomputes a block from) instead of the
        module's own when given. f_θ is evaluated as the piecewise-linear function it is (`piecewise.relu_mlp`): no
        (B, Q, K, width) hidden layer."""
        parameters = self.bias_parameters() if parameters is None else parameters
        inputs = self.mlp_inputs(query_positions, behind, parameters)  # (B', Q, K)
        return relu_mlp(inputs, *parameters[2:]).to(parameters[2].dtype)  # (B', H, Q, K)

    def bias(self, query_slots, key_slots):
        """The bias `(1, H, Q, K)` of queries at `query_slots`, taken for their positions, over keys at `key_slots`."""
        behind = query_slots[:, None] - key_slots[None, :]  # (Q, K)
        return self.fire_bias(query_slots[None], behind)

    def bias_values(self, query_offset, query_length, key_offset, key_length, position_ids):
        device = position_ids.device
        query_slots = torch.arange(query_length, device=device) + query_offset  # (Q,)
        key_slots = torch.arange(key_length, device=device) + key_offset  # (K,)
        return self.fire_bias(position_ids, query_slots[:, None] - key_slots[None, :])  # (B', H, Q, K)

    def bias_recipe(self, query_offset, query_length, key_offset, key_length, position_ids, dtype):
        if not any(parameter.requires_grad for parameter in self.bias_parameters()):
            return None  # frozen: the values need no gradient, so nothing a backward would recompute
        device = position_ids.device
        query_slots = torch.arange(query_length, device=device) + query_offset  # (Q,)
        key_slots = torch.arange(key_length, device=device) + key_offset  # (K,)
        # per score besides the bias: f_θ's input, its piece (int64) and the 2H slopes and intercepts it looks up
        return QueryBiasRecipe(
            self.fire_bias,
            self.bias_parameters(),
            position_ids,
            query_slots,
            key_slots,
            self.num_heads,
            dtype,
            width=2 * self.num_heads + 3,
            tables=self.piecewise_tables,
        )

    def reset_parameters(self, config):
        init.constant_(self.distance_scale, self.initial_distance_scale)
        init.constant_(self.threshold_scale, 1.0)
        for layer in (self.mlp_in, self.mlp_out):
            bound = 1 / math.sqrt(layer.in_features)
            init.uniform_(layer.weight, -bound, bound)
            init.uniform_(layer.bias, -bound, bound)
