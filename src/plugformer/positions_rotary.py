"""Rotary positions (`rope`): queries and keys rotated by position-dependent angles, with every rope type transformers
ships; and `apply_rotary`, which the attention calls with the scheme's `(cos, sin)`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.utils import logging

from .positions_base import POSITION_SCHEMES, PositionScheme


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


logger = logging.get_logger(__name__)


@POSITION_SCHEMES.register("rope")
class RotaryPositions(PositionScheme):
    """Rotary position embedding (Su et al. 2021) with every rope type transformers ships (`rope_parameters`);
    `rope_parameters["partial_rotary_factor"]` rotates a fraction of each head (as Phi), `no_rope_layers` picks NoPE
    layers (one 0/1 per layer, 0 = no positions there; SmolLM3's field).

    Same layout as transformers' Llama: frequencies repeated over the two halves of the head dimension and
    `rotate_half`, so weights converted from Llama give identical logits.
    """

    config_fields = ("rope_parameters", "no_rope_layers")
    unused_fields_refused = True

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
        cls._check_no_rope_layers(config)

    @classmethod
    def _check_no_rope_layers(cls, config: PlugformerConfig) -> None:
        """`no_rope_layers` as SmolLM3's: one 0 (NoPE) or 1 (rotary) per layer of every stack."""
        layers = config.no_rope_layers
        if layers is None:
            return
        lengths = {config.num_hidden_layers, config.num_decoder_layers or config.num_hidden_layers}
        if len(lengths) > 1 or len(layers) not in lengths or any(flag not in (0, 1) for flag in layers):
            sizes = f"num_hidden_layers={config.num_hidden_layers}, num_decoder_layers={config.num_decoder_layers}"
            raise ValueError(
                f"no_rope_layers={layers!r} must hold one 0 (no positions) or 1 (rotary) per layer: "
                f"{config.num_hidden_layers} values ({sizes}; both stacks must have that many layers)"
            )

    @classmethod
    def refuse_unused_config(cls, config):
        """`rope_parameters` under a scheme that does not rotate: a RoPE type or scaling key (`factor`, ...) is refused,
        since whoever set it expects an effect (a longer context for `learned`, which then fails past
        `max_position_embeddings`); a bare `rope_theta` other than the default only warns: transformers fills
        `{"rope_type": "default", "rope_theta": ...}` into every config it writes, and presets carry a theta (`llama`
        with another `position_scheme`)."""
        if config.no_rope_layers is not None:
            raise ValueError(
                f"no_rope_layers={config.no_rope_layers!r} chooses the layers with rotary positions, but position_scheme="
                f"{config.position_scheme!r} has none and would ignore it; drop no_rope_layers, or use "
                f"position_scheme={cls.name!r}"
            )
        rope = config.rope_parameters
        if not isinstance(rope, dict):
            return
        scaling = sorted(set(rope) - {"rope_type", "rope_theta", "type"})
        if rope.get("rope_type", rope.get("type", "default")) != "default" or scaling:
            raise ValueError(
                f"rope_parameters={rope!r} configure rotary positions, but position_scheme={config.position_scheme!r} "
                f"has none and would ignore them; drop rope_parameters, or use position_scheme={cls.name!r}"
            )
        if rope.get("rope_theta", config.default_theta) != config.default_theta:
            logger.warning_once(
                f"rope_parameters['rope_theta']={rope['rope_theta']} is ignored: position_scheme="
                f"{config.position_scheme!r} has no rotary positions"
            )

    @classmethod
    def _check_frequencies(cls, config: PlugformerConfig, rotary: int) -> None:
        """Computes the frequencies once: the other parameters of transformers' rope types have rules of their own
        that it only logs or does not check (dynamic NTK raises the base to d/(d-2), undefined for 2 rotated
        dimensions; longrope's attention factor divides by log(original_max_position_embeddings))."""
        config.validate_rope()  # first transformers' check of the required keys, with its clearer message
        try:
            # on the CPU whatever device is current: a model built on the meta device (`from_pretrained`, the memory
            # check) validates its config too, and meta frequencies hold no values to check
            with torch.device("cpu"):
                inv_freq, scaling = cls.frequency_function(config.rope_parameters["rope_type"])(config, device="cpu")
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
        low, high = torch.aminmax(position_ids)
        low, high = int(low), int(high)
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
