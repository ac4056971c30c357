"""Attention score functions: one registered class per `config.attention_score`.

A score function turns projected queries and keys into what a kernel consumes, and says which kernels can
compute it. Inside attention the order is fixed: project -> rotate (position) -> `prepare_query`/`prepare_key` (this
module) -> cache update -> `prepare_value` -> kernel -> `prepare_output` -> o_proj. Query and key preparation runs
*before* the cache update, so the cache holds keys exactly as the kernel consumes them and cached decoding equals the
full forward; `prepare_value` runs after it (the cache holds the projected values), `prepare_output` on the kernel's
output (the identity unless a score changes the output side).

- `dot`: e = q·k (scaling 1);
- `scaled_dot`: e = q·k / sqrt(d_k) (Vaswani et al. 2017);
- `multiplicative`: e = qᵀ W_h k with a learned W per head (Luong et al. 2015, "general"); computed as
  (W_hᵀ q)·k, so it runs on every dot-product kernel with scaling 1;
- `cosine`: e = g_h · q̂·k̂ with L2-normalised q, k and a learned scale per head (Henry et al. 2020, QK-norm);
  g is folded into the query, so it runs on every dot-product kernel with scaling 1;
- `additive`: e = v_hᵀ tanh(W1_h q + W2_h k) (Bahdanau et al. 2015); no dot product exists, so it runs on
  plugformer's chunked eager kernel only;
- `differential`: (softmax(Q1 K1ᵀ / sqrt(d_k)) − λ softmax(Q2 K2ᵀ / sqrt(d_k))) V per pair of heads, normed per head
  and scaled by 1 − λ_init (Ye et al. 2024, Differential Transformer); the values are 2·d_k wide, so it runs on the
  kernels that take wide values (eager, sdpa, flex);
- `stick_breaking`: A_ij = σ(z_ij) ∏_{j<k<i} (1 − σ(z_ik)), z = q·k / sqrt(d_k), over the keys before the query,
  without normalisation (Tan et al. 2024); no softmax, so it runs on its own eager kernel only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import initialization as init

from .kernels import eager_attention_forward
from .kernels_additive import additive_attention_forward
from .kernels_stick_breaking import stick_breaking_attention_forward
from .projections import ATTENTION_PROJECTIONS
from .registry import ConfigHooks, Registry


if TYPE_CHECKING:
    from .configuration import PlugformerConfig

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch build without torch.distributed: no parameter is ever a DTensor
    DTensor = ()


ATTENTION_SCORES: Registry[AttentionScore] = Registry("attention_score")


class AttentionScore(ConfigHooks, nn.Module):
    """Base class of the score functions.

    Parameters are per head, head dimension first: `(H, ...)` for those of the query heads, `(H_kv, ...)` for those of
    the key/value heads. Tensor parallelism relies on it: the plan shards every score parameter on dim 0
    (`configuration.STACK_TP_PLAN`), and the methods read them through `local`.

    Class attributes:
        dot_product (`bool`): the score is a (scaled) dot product of the prepared query and key, so transformers'
            fused kernels (`sdpa`, `flex_attention`, flash) compute it exactly.
        value_width (`int`, defaults to 1): the values the kernel gets (`prepare_value`) are `value_width · head_dim`
            wide; a kernel computes a score with `value_width > 1` only where its record declares `wide_values`
            (`capabilities.KernelSpec`).
        tensor_parallel (`bool`, defaults to `True`): whether tensor parallelism computes this score exactly; a score
            whose parameters are not per head, or that combines heads another rank may hold, says `False` and is
            refused under `tp_plan`.
        weights_sum_to_one (`bool`, defaults to `True`): whether each row of the attention weights its kernel returns
            sums to 1 (a softmax); `False` for a score that leaves part of each row unassigned (stick-breaking).
        causal_only (`bool`, defaults to `False`): whether the score is defined only over the keys before each query
            (stick-breaking), so that only a causal decoder-only model can use it: `validate_config` refuses it with
            `is_causal=False` (an encoder) or `is_encoder_decoder=True` (a bidirectional encoder, cross-attention).
        eager_kernel (`Callable`): the attention function used when `attn_implementation="eager"`.

    The output side has hooks too: `prepare_value` (after the cache update: the cache holds the projected values)
    and `prepare_output` (the kernel's output, before the heads are merged for `o_proj`); both are the identity here.

    The config hooks (`config_fields`, `validate_config`, ...) are those of every variant (`registry.ConfigHooks`).
    """

    dot_product = True
    value_width = 1
    tensor_parallel = True
    weights_sum_to_one = True
    causal_only = False
    eager_kernel: Callable = staticmethod(eager_attention_forward)

    @classmethod
    def validate_config(cls, config: PlugformerConfig) -> None:
        """Refuses a `causal_only` score in a model that is not causal and decoder-only; a score's own checks extend
        it (`super().validate_config(config)` first)."""
        if not cls.causal_only:
            return
        for field, value in (("is_encoder_decoder", True), ("is_causal", False)):
            if getattr(config, field) is value:
                raise ValueError(
                    f"{field}={value} is not supported with attention_score={config.attention_score!r} (allowed: "
                    f"{field}={not value}): its weights are defined over the keys before each query only "
                    "(`causal_only`), which a bidirectional encoder and a cross-attention over the source do not have"
                )

    def __init__(self, config: PlugformerConfig, layer_idx: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        projection = ATTENTION_PROJECTIONS.get(config.attention_projection)
        self.head_dim = projection.query_key_dim(config)  # d_k of the queries and keys the score gets
        self.value_head_dim = projection.value_dim(config)
        self.layer_idx = layer_idx  # the block's index (a score may depend on depth)

    @property
    def scaling(self) -> float:
        return 1.0

    @staticmethod
    def local(parameter: torch.Tensor) -> torch.Tensor:
        """`parameter` as this process computes with it: itself, or, under tensor parallelism (where the plan made it a
        `DTensor` split on its head dimension), this rank's heads, the same heads as the local queries and keys that
        the column-parallel q/k projections return. A view in autograd: the gradient reaches the shard."""
        return parameter.to_local() if isinstance(parameter, DTensor) else parameter

    def prepare_query(self, query: torch.Tensor) -> torch.Tensor:
        """(B, H, Q, D) -> the query the kernel consumes."""
        return query

    def prepare_key(self, key: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, K, D) -> the key the kernel consumes (and the cache stores)."""
        return key

    def prepare_value(self, value: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, K, D) -> the values the kernel consumes, (B, H_kv, K, `value_width`·D); applied after the cache
        update, so the cache holds the projected values."""
        return value

    def prepare_output(self, output: torch.Tensor) -> torch.Tensor:
        """The kernel's output (B, Q, H, `value_width`·D) -> (B, Q, ·, ·) whose merged last two dims (H·D) `o_proj`
        reads."""
        return output

    def kernel_kwargs(self) -> dict:
        """Extra keyword arguments for the kernel (e.g. the additive energy vector)."""
        return {}

    HOOKS = ("prepare_query", "prepare_key", "prepare_value", "prepare_output", "kernel_kwargs")

    @classmethod
    def hooks(cls) -> frozenset[str]:
        """The hooks among `HOOKS` this score overrides; attention calls only these (the others are the identity, or
        no keyword arguments: a call each per layer is a share of a small model's decoding step)."""
        return frozenset(name for name in cls.HOOKS if getattr(cls, name) is not getattr(AttentionScore, name))

    def reset_parameters(self, config: PlugformerConfig) -> None:
        """(Re)initialises this score's parameters; called from `_init_weights`. Uses `transformers.initialization`,
        which leaves weights loaded from a checkpoint untouched."""


@ATTENTION_SCORES.register("dot")
class DotScore(AttentionScore):
    """e = q·k, unscaled: logits grow with √d_k, which is why `scaled_dot` exists."""


@ATTENTION_SCORES.register("scaled_dot")
class ScaledDotScore(AttentionScore):
    """e = q·k / √d_k (Vaswani et al. 2017)."""

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5


@ATTENTION_SCORES.register("multiplicative")
class MultiplicativeScore(AttentionScore):
    """e = qᵀ W_h k with a learned (d_k, d_k) matrix W_h per query head (Luong et al. 2015, "general").

    W is folded into the query ((W_hᵀ q)·k), so the keys in the cache stay plain keys and any dot-product kernel
    runs it. Initialised to I / sqrt(d_k): training starts from scaled dot-product attention.
    """

    def __init__(self, config: PlugformerConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))

    def prepare_query(self, query):
        # (W_hᵀ q)_e = sum_d q_d W_h[d, e]
        return torch.einsum("bhqd,hde->bhqe", query, self.local(self.weight).to(query.dtype))

    def reset_parameters(self, config):
        eye = torch.eye(self.head_dim, device=self.weight.device, dtype=self.weight.dtype)
        init.copy_(self.weight, eye.expand_as(self.weight) * self.head_dim**-0.5)


@ATTENTION_SCORES.register("cosine")
class CosineScore(AttentionScore):
    """e = g_h · q̂·k̂, q̂ = q / ‖q‖, k̂ = k / ‖k‖, with a learned scale g per query head (Henry et al. 2020,
    "Query-Key Normalization for Transformers", eq. 2).

    The logits are bounded by |g|, so g sets the softmax temperature. g multiplies the normalised query and the cache
    stores normalised keys: a dot product with scaling 1, on any dot-product kernel. The paper learns one g,
    initialised to log2(L² − L) for L the 97.5th percentile of training lengths; differs here: one g per head, with
    L = `max_position_embeddings` (the longest sequence the model is configured for).
    """

    def __init__(self, config: PlugformerConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.scale = nn.Parameter(torch.empty(self.num_heads))

    def prepare_query(self, query):
        # normalised in fp32 (a half-precision sum of squares of a long vector overflows), then scaled per head
        unit = nn.functional.normalize(query.float(), dim=-1)  # (B, H, Q, D)
        return (unit * self.local(self.scale).float()[:, None, None]).to(query.dtype)

    def prepare_key(self, key):
        return nn.functional.normalize(key.float(), dim=-1).to(key.dtype)  # (B, H_kv, K, D)

    def reset_parameters(self, config):
        length = max(config.max_position_embeddings, 2)
        init.constant_(self.scale, math.log2(length * length - length))


@ATTENTION_SCORES.register("additive")
class AdditiveScore(AttentionScore):
    """e = v_hᵀ tanh(W1_h q + W2_h k), with W1, W2 (d_k, d_k) and v (d_k,) learned per head (Bahdanau et al. 2015).

    W1 belongs to each query head and W2 to each key/value head, so with GQA the cache stores the projected keys
    W2 k once per key/value head. The kernel (`kernels_additive.additive_attention_forward`) works through the queries
    in chunks, keeping the (B, H, chunk, K, d_k) tanh tensor within a fixed memory budget (on the CPU in fp32 a C
    kernel forms it pair by pair instead: `kernels_additive_native`).
    """

    dot_product = False
    eager_kernel: Callable = staticmethod(additive_attention_forward)
    config_fields = ("additive_chunk_size",)  # a positive int or None, as every size field (`PlugformerConfig`)

    def __init__(self, config: PlugformerConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.query_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self.key_weight = nn.Parameter(torch.empty(self.num_key_value_heads, self.head_dim, self.head_dim))
        self.energy = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.chunk_size = config.additive_chunk_size

    def prepare_query(self, query):
        return torch.einsum("bhqd,hda->bhqa", query, self.local(self.query_weight).to(query.dtype))  # (B, H, Q, A)

    def prepare_key(self, key):
        return torch.einsum("bhkd,hda->bhka", key, self.local(self.key_weight).to(key.dtype))  # (B, H_kv, K, A)

    def kernel_kwargs(self):
        return {"energy": self.local(self.energy), "chunk_size": self.chunk_size}

    def reset_parameters(self, config):
        # Unit-variance pre-activations for unit-variance q, k: tanh starts in its responsive range.
        std = self.head_dim**-0.5
        init.normal_(self.query_weight, std=std)
        init.normal_(self.key_weight, std=std)
        init.normal_(self.energy, std=std)


def differential_lambda_init(layer_idx: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for the l-th layer, l from 1 (Ye et al. 2024, §2): `layer_idx` = l − 1."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@ATTENTION_SCORES.register("differential")
class DifferentialScore(AttentionScore):
    """Differential attention (Ye et al. 2024, "Differential Transformer", §2): head pairs whose output is
    (1 − λ_init) · RMSNorm((softmax(q1·k1 / √d_k) − λ · softmax(q2·k2 / √d_k)) [v1, v2]), with a learned λ per layer;
    transformers' DiffLlama layout and names.

    Each of the H/2 differential heads is the difference of two softmax maps over one 2·d_k-wide value,

        head_j = (1 − λ_init) · RMSNorm((softmax(q1 k1ᵀ / sqrt(d_k)) − λ softmax(q2 k2ᵀ / sqrt(d_k))) [v1, v2]),
        λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init,

    with the learned (d_k,) vectors λ_q1, λ_k1, λ_q2, λ_k2 of the layer (shared by its heads) and λ_init from the depth
    (`differential_lambda_init`). The RMSNorm has no gain (transformers' DiffLlama `groupnorm`, eps `rms_norm_eps`).

    Layout, transformers' DiffLlama's (`modeling_diffllama.py`), so its checkpoints map by name (`self_attn.lambda_q1`
    -> `self_attn.score.lambda_q1`): query heads j and j + H/2 are the two maps of differential head j, with key/value
    heads m and m + H_kv/2 (m = j // groups), and its value is [v_m, v_{m + H_kv/2}]. `prepare_value` builds those
    values once per key/value head (B, H_kv, K, 2·d_k), so each map is one ordinary softmax(scaling·q·k) of its query
    head and any kernel that takes values wider than the keys computes both in one call (DiffLlama calls the kernel
    twice, with the two value halves: the same sums); `prepare_output` takes the difference, norm and scale, giving
    H/2 heads of 2·d_k for `o_proj`. Queries, keys, the cache and the position bias are those of H ordinary heads.

    Refused (`validate_config`): an odd `num_key_value_heads` (no pairs) and `attention_dropout` > 0 (the paper
    defines none for a difference of maps; DiffLlama refuses it too). Under tensor parallelism (`tensor_parallel`):
    the λ vectors are no per-head parameters and heads j, j + H/2 would sit on different ranks.
    """

    value_width = 2
    tensor_parallel = False
    lambda_std = 0.1  # DiffLlama's `lambda_std_dev` default: λ vectors start as N(0, 0.1²)

    def __init__(self, config: PlugformerConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.lambda_init = differential_lambda_init(layer_idx)
        self.lambda_q1 = nn.Parameter(torch.empty(self.head_dim))
        self.lambda_k1 = nn.Parameter(torch.empty(self.head_dim))
        self.lambda_q2 = nn.Parameter(torch.empty(self.head_dim))
        self.lambda_k2 = nn.Parameter(torch.empty(self.head_dim))
        self.groupnorm = nn.RMSNorm(2 * self.value_head_dim, eps=config.rms_norm_eps, elementwise_affine=False)

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def validate_config(cls, config):
        super().validate_config(config)
        if config.num_key_value_heads % 2:
            raise ValueError(
                f"attention_score='differential' pairs key/value heads m and m + H_kv/2 into one differential head: "
                f"num_key_value_heads={config.num_key_value_heads} must be even (and num_attention_heads with it)"
            )
        if config.attention_dropout:
            raise ValueError(
                f"attention_dropout={config.attention_dropout!r} is not supported with attention_score='differential' "
                "(allowed: 0.0): the paper defines no dropout for a difference of two softmax maps"
            )

    def prepare_value(self, value):
        first, second = value.chunk(2, dim=1)  # key/value heads m and m + H_kv/2: (B, H_kv/2, K, D) each
        return torch.cat([first, second], dim=-1).repeat(1, 2, 1, 1)  # (B, H_kv, K, 2·D): both maps' value

    def prepare_output(self, output):
        first, second = output.chunk(2, dim=2)  # the maps of query heads j and j + H/2: (B, Q, H/2, 2·D) each
        lambda_1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32)).to(output.dtype)
        lambda_2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32)).to(output.dtype)
        difference = first - (lambda_1 - lambda_2 + self.lambda_init) * second
        return (1 - self.lambda_init) * self.groupnorm(difference)  # (B, Q, H/2, 2·D)

    def reset_parameters(self, config):
        for parameter in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            init.normal_(parameter, mean=0.0, std=self.lambda_std)


@ATTENTION_SCORES.register("stick_breaking")
class StickBreakingScore(AttentionScore):
    """Stick-breaking attention (Tan et al. 2024, "Scaling Stick-Breaking Attention", §2): each key before the query
    takes β_ij = σ(q_i·k_j / √d_k) of what is left of a unit stick broken from the nearest key backwards, A_ij = β_ij ·
    ∏_{j<k<i} (1 − β_ik), and o_i = Σ_{j<i} A_ij v_j without normalisation; its own eager kernel only.

    The query's own key is left out (the paper's "for each token before the current"; the official code's default
    `attend_current=False`), so the first token's output is zero. What the stick keeps, 1 − Σ_j A_ij, is assigned to
    nothing, as the formula says; differs from the official code's tests, which add it times the current token's
    value, and from dolomite-engine's models, which add it times a bias per head (neither is done here). The
    kernel (`kernels_stick_breaking`) works in log space and lets only the keys the mask leaves visible break the stick:
    padding and other packed documents' keys take no share and break nothing, so padded rows and packed documents
    attend as they do alone, and cached decoding equals the full forward.

    Position schemes: the stick's order is itself positional, and the paper needs none (`position_scheme="none"`), but
    every scheme composes: a rotary scheme rotates q and k, an absolute one adds to the embeddings, and a
    score-bias scheme (ALiBi, T5 buckets, ...) adds its bias to z_ij before the sigmoid, shifting each break point.

    Refused: `is_causal=False` and `is_encoder_decoder=True` (`causal_only`: the stick is broken backwards from the
    query, which a bidirectional encoder's keys and a cross-attention's source have no place for). No softmax of a dot
    product (`dot_product` false): sdpa, flex, flash and engines' kernels refuse it by their records; so do logit
    soft-capping and attention sinks. The weights `output_attentions` returns sum to at most 1 per row
    (`weights_sum_to_one`).
    """

    dot_product = False
    weights_sum_to_one = False
    causal_only = True
    eager_kernel: Callable = staticmethod(stick_breaking_attention_forward)

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5
