"""Position schemes: one registered class per `config.position_scheme`.

The taxonomy follows where a scheme acts (x-transformers): added to the token embeddings (`sinusoidal`,
`learned`), rotating queries and keys (`rope`), or an additive bias on the attention scores (`alibi`, `t5_bias`,
`clamped_bias`). Every scheme answers the same three hooks and returns `None` where it has nothing to add, so the
model runs one code path:

- `embed(position_ids, dtype)` -> `(B, T, hidden)` added to the token embeddings, or `None`;
- `rotary(hidden_states, position_ids)` -> `(cos, sin)` each `(B, T, head_dim)`, or `None`;
- `distance_bias(distances)` -> float `(H, M)`: the score bias for keys `distances` slots after the query, or
  `None`. Every bias scheme here depends on key slot − query slot only, so the model hands the kernels a
  `RelativeBias`: (H, Q + K − 1) numbers standing for the (1, H, Q, K) bias, which a kernel expands one block of
  query rows at a time (`bias(query_slots, key_slots)` gives the dense tensor).

Relative biases are indexed by cache *slots* (query slot = tokens already cached + offset in the chunk, key
slot = index in the cache). With left padding the padding is masked, so slot differences are the true relative
distances; with a static cache the unused slots are masked the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .registry import Registry


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


POSITION_SCHEMES: Registry[PositionScheme] = Registry("position_scheme")


class PositionScheme(nn.Module):
    """Base class: no position information at all (the hooks all return `None`).

    Class attributes:
        has_bias (`bool`): whether `bias()` returns a score bias (the model skips the call otherwise; flash kernels
            refuse such schemes).
        uses_rope_parameters (`bool`): whether the scheme reads `config.rope_parameters` (the config refuses RoPE
            settings for a scheme that would ignore them).
        tp_plan (`dict[str, str]`): tensor-parallel styles of this scheme's own modules and parameters, keyed relative
            to the scheme (the config's `base_model_tp_plan` adds them under `positions.`). A learned per-head table
            is split on its head dimension, so the stack's bias values hold only the heads of this rank; a bias
            computed for all heads (ALiBi's fixed slopes, a buffer no plan reaches) is sliced by each attention layer.

    Attributes:
        token_scale (`float`): multiplies the token embeddings, looked up from `input_ids` or passed as
            `inputs_embeds` alike (as transformers' Marian decoder does), before `embed()` is added.
    """

    has_bias = False
    uses_rope_parameters = False
    tp_plan: dict[str, str] = {}
    token_scale = 1.0

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        # Encoders see keys on both sides of the query; by default the config says which this stack is.
        self.bidirectional = not config.is_causal if bidirectional is None else bidirectional

    @classmethod
    def validate_config(cls, config: PlugformerConfig) -> None:
        """Raises a `ValueError` naming the field if `config` cannot use this scheme."""

    @classmethod
    def max_length(cls, config: PlugformerConfig) -> int | None:
        """The longest sequence this scheme can encode, or `None` when any length works."""
        return None

    def embed(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def rotary(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor | None:
        """(M,) key slot − query slot -> the float score bias `(H, M)` at those distances, or `None`."""
        return None

    def bias(self, query_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor | None:
        """The dense score bias `(1, H, Q, K)` of queries at `query_slots` (Q,) over keys at `key_slots` (K,)."""
        if not self.has_bias:
            return None
        distance = relative_distances(query_slots, key_slots)  # (Q, K)
        return self.distance_bias(distance.flatten()).view(-1, *distance.shape)[None]  # (1, H, Q, K)

    def bias_by_distance(
        self, query_offset: int, query_length: int, key_offset: int, key_length: int, device: torch.device
    ) -> torch.Tensor | None:
        """The values `(H, Q + K − 1)` of the `RelativeBias` of queries at slots `query_offset + i` (i < Q) over keys at
        `key_offset + j` (j < K), or `None`."""
        if not self.has_bias:
            return None
        lowest = key_offset - (query_offset + query_length - 1)  # the last query's distance to the first key
        return self.distance_bias(torch.arange(query_length + key_length - 1, device=device) + lowest)

    def reset_parameters(self, config: PlugformerConfig) -> None:
        """(Re)initialises parameters and buffers the generic `_init_weights` does not know; uses
        `transformers.initialization`, which leaves weights loaded from a checkpoint untouched."""


@POSITION_SCHEMES.register("none")
class NoPositions(PositionScheme):
    """No positions: attention is permutation-equivariant except for the causal mask (NoPE)."""


def sinusoidal_table(position_ids: torch.Tensor, dim: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (Vaswani et al. 2017, §3.5).

    Args:
        position_ids (`torch.Tensor` of shape `(B, T)`): absolute positions.
        dim (`int`): the (even) model width d.
    Returns:
        `torch.Tensor` of shape `(B, T, dim)` in fp32, sine and cosine interleaved.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim))
    angles = position_ids.float()[..., None] * inv_freq  # (B, T, d/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, d): sin, cos, sin, cos, ...


@POSITION_SCHEMES.register("sinusoidal")
class SinusoidalPositions(PositionScheme):
    """Fixed sinusoids added to the token embeddings; computed on the fly, so any length works.

    The token embeddings are multiplied by sqrt(hidden_size) (Vaswani et al. 2017, §3.4; transformers' Marian
    `embed_scale`): each sinusoid pair has norm 1, so the table's norm is sqrt(hidden_size / 2), while embeddings
    initialised with std 0.02 have norm 0.02·sqrt(hidden_size) — unscaled, the positions drown the tokens.
    """

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.dim = config.hidden_size
        self.token_scale = math.sqrt(config.hidden_size)

    @classmethod
    def validate_config(cls, config):
        if config.hidden_size % 2:
            raise ValueError(f"position_scheme='sinusoidal' needs an even hidden_size, got {config.hidden_size}")

    def embed(self, position_ids, dtype):
        return sinusoidal_table(position_ids, self.dim).to(dtype)


@POSITION_SCHEMES.register("learned")
class LearnedPositions(PositionScheme):
    """A learned vector per absolute position, added to the token embeddings (GPT-2's `wpe`)."""

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    @classmethod
    def max_length(cls, config):
        return config.max_position_embeddings

    def embed(self, position_ids, dtype):
        # On an accelerator an index past the table is a device-side assert: check first (a data-dependent branch,
        # skipped while torch.compile traces). On the CPU the embedding's own bounds check raises: translate it.
        if position_ids.device.type != "cpu" and not torch.compiler.is_compiling() and position_ids.numel():
            self._refuse_past_the_table(int(position_ids.max()))
        try:
            return self.embed_positions(position_ids).to(dtype)
        except IndexError:
            self._refuse_past_the_table(int(position_ids.max()))
            raise

    def _refuse_past_the_table(self, position: int) -> None:
        limit = self.embed_positions.num_embeddings
        if position >= limit:
            raise ValueError(
                f"position_scheme='learned' has max_position_embeddings={limit} positions, but position {position} "
                "was requested; use a relative scheme (rope, alibi, t5_bias, clamped_bias) to go past it, or shorten "
                "the input"
            ) from None


@POSITION_SCHEMES.register("rope")
class RotaryPositions(PositionScheme):
    """Rotary position embedding (Su et al. 2021) with every rope type transformers ships (`rope_parameters`).

    Same layout as transformers' Llama: frequencies repeated over the two halves of the head dimension and
    `rotate_half`, so weights converted from Llama give identical logits.
    """

    uses_rope_parameters = True

    def __init__(self, config: PlugformerConfig, bidirectional: bool | None = None):
        super().__init__(config, bidirectional)
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = self._init_fn()(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
        # "dynamic" and "longrope" change their frequencies with the length seen: no table of fixed angles for them
        self.tabulated = "dynamic" not in self.rope_type and self.rope_type != "longrope"
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) of positions 0 .. N − 1, fp32

    @classmethod
    def validate_config(cls, config):
        # transformers checks the keys each rope type requires (raising) and the values (only logging): the values
        # this scheme reads are checked here, so a bad one fails now rather than as NaNs or a shape error later.
        rope = config.rope_parameters
        rope_type = rope["rope_type"]
        choices = ["default", *ROPE_INIT_FUNCTIONS]
        if rope_type not in choices:
            raise ValueError(f"rope_parameters['rope_type']={rope_type!r} is not one of {choices}")
        _check_rope_number(rope, "rope_theta", "a positive number (the frequency base)", lambda v: 0 < v < math.inf)
        _check_rope_number(
            rope, "partial_rotary_factor", "in (0, 1] (the rotated share of head_dim)", lambda v: 0 < v <= 1
        )
        _check_rope_number(rope, "factor", "a number >= 1 (the context-extension factor)", lambda v: 1 <= v < math.inf)
        fraction = rope.get("partial_rotary_factor", 1.0)
        rotary = int(config.head_dim * fraction)
        if rotary < 2 or rotary % 2:
            raise ValueError(
                f"position_scheme='rope' rotates pairs of dimensions: head_dim={config.head_dim} (× "
                f"partial_rotary_factor={fraction}) gives {rotary} rotated dimensions, which must be even and at least 2"
            )
        for key in ("short_factor", "long_factor"):  # longrope: one rescaling factor per rotated pair
            if key in rope and (not isinstance(rope[key], list) or len(rope[key]) != rotary // 2):
                raise ValueError(
                    f"rope_parameters['{key}']={rope[key]!r} must be a list of {rotary // 2} numbers, one per pair of "
                    f"rotated dimensions (head_dim={config.head_dim} × partial_rotary_factor={fraction})"
                )
        cls._check_frequencies(config, rotary)

    @classmethod
    def _check_frequencies(cls, config: PlugformerConfig, rotary: int) -> None:
        """Computes the frequencies once: the other parameters of transformers' rope types have rules of their own
        that it only logs or does not check (dynamic NTK raises the base to d/(d-2), undefined for 2 rotated
        dimensions; longrope's attention factor divides by log(original_max_position_embeddings))."""
        config.validate_rope()  # first transformers' check of the required keys, with its clearer message
        try:
            inv_freq, scaling = cls.frequency_function(config.rope_parameters["rope_type"])(config)
        except (ArithmeticError, RuntimeError, TypeError, ValueError, KeyError) as error:
            raise ValueError(
                f"rope_parameters={config.rope_parameters!r} give no rotation frequencies for head_dim="
                f"{config.head_dim}, max_position_embeddings={config.max_position_embeddings}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if inv_freq.shape != (rotary // 2,) or not torch.isfinite(inv_freq).all() or not math.isfinite(scaling):
            raise ValueError(
                f"rope_parameters={config.rope_parameters!r} give {tuple(inv_freq.shape)} frequencies (expected "
                f"{rotary // 2}, finite) and attention scaling {scaling} for head_dim={config.head_dim}"
            )

    @classmethod
    def frequency_function(cls, rope_type: str) -> Callable:
        """The function `(config, device=None, seq_len=None) -> (inv_freq, attention_scaling)` of `rope_type`."""
        return cls.default_inv_freq if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]

    def _init_fn(self) -> Callable:
        return self.frequency_function(self.rope_type)

    @staticmethod
    def default_inv_freq(config: PlugformerConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """theta_i = base^(-2i/d) for i < d/2 (RoFormer eq. 15); no attention scaling."""
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)), 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer positions `(...)` -> fp32 `(cos, sin)`, each `(..., d)`, of the rotation angles (times the rope
        type's attention scaling)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # (..., d/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (..., d)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    # (no `torch.no_grad()`: nothing here requires grad, and the context manager is a share of a decoding step)
    @dynamic_rope_update  # grows the frequencies for "dynamic"/"longrope" types past the trained length
    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # On the CPU a decoding step's angles are mostly op overhead (7 small ops): a gather from a table of the same
        # values takes half the time. Elsewhere the read of the largest position would be a device sync, and under
        # torch.compile or jit tracing a data-dependent branch, so the angles are computed.
        traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
        if self.tabulated and hidden_states.device.type == "cpu" and not traced:
            cos, sin = self._look_up(position_ids)  # (B, T, d)
        else:
            cos, sin = self.cos_sin(position_ids)  # (B, T, d)
        if cos.dtype != hidden_states.dtype:
            cos, sin = cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)
        return cos, sin

    def _look_up(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin(position_ids)` gathered from a table of `cos_sin(arange(N))`, grown to the next power of two
        when a position passes its end (the same elementwise values: the tests compare them bit for bit)."""
        low, high = (int(value) for value in torch.aminmax(position_ids))
        if low < 0:  # not a gather index; the angles are defined all the same
            return self.cos_sin(position_ids)
        if self._table is None or high >= self._table[0].shape[0]:
            length = max(64, 1 << high.bit_length())  # > high
            self._table = self.cos_sin(torch.arange(length, device=position_ids.device))  # each (N, d)
        cos, sin = self._table
        return cos[position_ids], sin[position_ids]

    def _apply(self, fn, recurse=True):
        self._table = None  # built again from the frequencies on their new device / in their new dtype
        return super()._apply(fn, recurse)

    def rotary(self, hidden_states, position_ids):
        return self(hidden_states, position_ids)

    def reset_parameters(self, config):
        inv_freq, self.attention_scaling = self._init_fn()(config, device=self.inv_freq.device)
        init.copy_(self.inv_freq, inv_freq)
        init.copy_(self.original_inv_freq, inv_freq)
        self._table = None


def _check_rope_number(rope: dict, key: str, allowed: str, accepts: Callable[[float], bool]) -> None:
    """`rope[key]`, when present, must be a number that `accepts` (NaN never is)."""
    if key not in rope:
        return
    value = rope[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"rope_parameters['{key}']={value!r} must be {allowed}")
    if not accepts(value):
        raise ValueError(f"rope_parameters['{key}']={value!r} must be {allowed}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates (B, H, T, D) queries and keys by (B, T, D') angles; with a partial rotary factor only the first D'
    dimensions rotate and the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D')
    if cos.shape[-1] == query.shape[-1]:
        # no pass-through part: a `cat` would copy into a new (B, H, T, D)-contiguous tensor, which makes the
        # kernel's transpose back to (B, T, H, D) a real copy kept alive for backward (Llama avoids it too)
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
    return _rotate_partially(query, cos, sin), _rotate_partially(key, cos, sin)


def _rotate_partially(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def relative_distances(query_slots: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    """(Q,), (K,) -> (Q, K) of key slot − query slot (negative = the key lies in the past)."""
    return key_slots[None, :] - query_slots[:, None]


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
    """A learned scalar per head per T5 distance bucket, shared by all layers (as in T5)."""

    has_bias = True
    tp_plan = HEAD_TABLE_TP_PLAN

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
    scalar-bias form of Shaw et al. 2018): `max_relative_distance + 1` values per head for a causal model (twice
    that for an encoder), whatever the sequence length. Shared by all layers.
    """

    has_bias = True
    tp_plan = HEAD_TABLE_TP_PLAN

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
