"""Which kernels can run which (attention_score, position_scheme) combination, in one place.

`eager` (plugformer's own kernels) runs everything and returns attention weights. The fused kernels compute
softmax(scaling · q·k + bias + mask) v: they serve every score that is a dot product of the prepared query and key
(`dot`, `scaled_dot`, `multiplicative` with W folded into the query) and take position biases as an additive float
term (sdpa folds it into its mask, flex adds it in `score_mod`). Flash kernels take no bias. `additive` scoring
is not a dot product and runs on eager only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .positions import POSITION_SCHEMES
from .scores import ATTENTION_SCORES


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


KERNELS = ("eager", "sdpa", "flex_attention")


def unsupported_reason(config: PlugformerConfig, kernel: str) -> str | None:
    """Why `kernel` cannot compute `config`'s attention exactly, or `None` if it can."""
    if kernel == "eager":
        return None
    score = ATTENTION_SCORES.get(config.attention_score)
    if not score.dot_product:
        return (
            f"attention_score={config.attention_score!r} is not a dot product of query and key, so "
            f"attn_implementation={kernel!r} cannot compute it; use attn_implementation='eager' (chosen "
            "automatically when no implementation is requested)"
        )
    if "flash" in kernel and POSITION_SCHEMES.get(config.position_scheme).has_bias:
        return (
            f"attn_implementation={kernel!r} takes no additive score bias, which "
            f"position_scheme={config.position_scheme!r} needs; use 'sdpa', 'flex_attention' or 'eager'"
        )
    return None


def supported_kernels(config: PlugformerConfig) -> list[str]:
    """The kernels among `KERNELS` that compute `config`'s attention exactly."""
    return [kernel for kernel in KERNELS if unsupported_reason(config, kernel) is None]


def combination_matrix() -> list[tuple[str, str, list[str]]]:
    """Every (attention_score, position_scheme) pair with the kernels that run it."""
    from .configuration import PlugformerConfig

    rows = []
    for score in ATTENTION_SCORES:
        for scheme in POSITION_SCHEMES:
            config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme)
            rows.append((score, scheme, supported_kernels(config)))
    return rows
