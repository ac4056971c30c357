"""Absolute position schemes, added to the token embeddings: `sinusoidal` (fixed) and `learned` (GPT-2's `wpe`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from .positions_base import POSITION_SCHEMES, PositionScheme


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


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
    """Fixed sinusoids added to the token embeddings (Vaswani et al. 2017, §3.5); computed on the fly, so any length
    works.

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
        self.config = config
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
            unbounded = [
                name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).max_length(self.config) is None
            ]
            raise ValueError(
                f"position_scheme='learned' has max_position_embeddings={limit} positions, but position {position} "
                f"was requested; use a scheme without a table of positions ({', '.join(unbounded)}) to go past it, or "
                "shorten the input"
            ) from None
