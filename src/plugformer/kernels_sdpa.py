"""plugformer's `sdpa` entry point, the function every `attn_implementation="sdpa"` call goes through (the kernel
table's `sdpa` record, `capabilities`), and the table of its CPU paths.

`sdpa_forward` sends a call with attention sinks to `kernels_sinks.sdpa_sinks_forward` and one without a bias to
transformers' SDPA. A call with a bias takes the first record of `SDPA_PATHS` whose `applies` rule holds, in the
order declared there:

| path | module | takes |
|---|---|---|
| `relative_native` | `kernels_relative_native` | a relative bias in fp32, wholly in C (where `csrc/band.c` is built) |
| `banded_bias` | `kernels_banded` | a bias constant beyond a distance (T5's buckets, clamped distances) |
| `linear_bias` | `kernels_alibi` | a bias linear in the distance (ALiBi) |
| `relative_bias` | `kernels_relative` | any other relative bias (KERPLE) in fp32 or fp64 |
| `fire_native` | `kernels_fire_native` | a recipe with piecewise tables (FIRE's) in fp32, wholly in C |
| `query_bias` | `kernels_query_bias` | a bias recipe in training (FIRE's; forgetting attention's `DecayBias`) |

The first five take causal training or prefill only (no mask, no dropout, Q = K: `kernels.fused_causal_call`); each
module's `*_applies` says the rest. Every other call takes the blockwise kernel, `kernels.sdpa_attention_forward`,
which computes them all. A new path is one `SdpaPath` record in `SDPA_PATHS` (or, from outside,
`SDPA_PATHS.register(path, before=...)`) and its reference test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass

import torch
from torch import nn

from .biases import RelativeBias
from .kernels import sdpa_attention_forward, transformers_sdpa
from .kernels_alibi import linear_bias_applies, linear_bias_attention
from .kernels_banded import banded_bias_applies, banded_bias_attention
from .kernels_fire_native import fire_native_applies, fire_native_attention
from .kernels_query_bias import query_bias_applies, query_bias_attention
from .kernels_relative import relative_bias_applies, relative_bias_attention
from .kernels_relative_native import native_relative_applies, native_relative_attention
from .kernels_sinks import sdpa_sinks_forward


@dataclass(frozen=True)
class SdpaPath:
    """One CPU path of plugformer's `sdpa` kernel: a rule and the kernel that computes the calls it accepts.

    Args:
        name (`str`):
            The path's key in `SDPA_PATHS`.
        applies (`Callable[..., bool]`):
            `applies(query, key, value, attention_mask, dropout, position_bias, is_causal)`: whether `forward`
            computes this call (query `(B, H, Q, D)`, key and value `(B, H_kv, K, D)`, `is_causal` resolved).
        forward (`Callable[..., torch.Tensor]`):
            `forward(module, query, key, value, attention_mask, scaling, dropout, position_bias, is_causal)`: the
            attention output `(B, H, Q, D)`.

    A profile (`plugformer bench`) names the path `plugformer::<name>`.
    """

    name: str
    applies: Callable[..., bool]
    forward: Callable[..., torch.Tensor]

    @property
    def profiler_name(self) -> str:
        return f"plugformer::{self.name}"

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        dropout: float,
        position_bias,
        is_causal: bool,
    ) -> tuple[torch.Tensor, None]:
        """`forward` as the sdpa kernel returns it: `(output (B, Q, H, D), None)` (no attention weights)."""
        with torch.profiler.record_function(self.profiler_name):  # so a profile (`plugformer bench`) names the path
            output = self.forward(module, query, key, value, attention_mask, scaling, dropout, position_bias, is_causal)
        return output.transpose(1, 2).contiguous(), None  # (B, Q, H, D)


class SdpaPaths(MutableMapping):
    """The sdpa CPU paths by name, in the order `sdpa_forward` tries them: the first whose `applies` holds computes
    the call. Setting an existing name replaces its record in place (so `monkeypatch.setitem` swaps a path for a
    test), a new name goes last; `register` inserts before a named path."""

    def __init__(self, *paths: SdpaPath):
        self._paths: dict[str, SdpaPath] = {}
        for path in paths:
            self.register(path)

    def register(self, path: SdpaPath, *, before: str | None = None) -> SdpaPath:
        """Adds `path`, tried just before the path named `before` (defaults to last); a duplicate name raises."""
        if path.name in self._paths:
            raise ValueError(f"sdpa path {path.name!r} is already registered; the paths are {list(self)}")
        if before is not None and before not in self._paths:
            raise ValueError(f"before={before!r} is not an sdpa path; the paths are {list(self)}")
        self[path.name] = path
        if before is not None:  # move every path from `before` on behind the new one
            names = list(self._paths)
            for name in names[names.index(before) : -1]:
                self._paths[name] = self._paths.pop(name)
        return path

    def select(self, query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool):
        """The first path whose `applies` holds for this call, or `None` (the blockwise kernel then computes it)."""
        for path in self._paths.values():
            if path.applies(query, key, value, attention_mask, dropout, position_bias, is_causal):
                return path
        return None

    def __getitem__(self, name: str) -> SdpaPath:
        if name not in self._paths:
            raise KeyError(f"{name!r} is not an sdpa path; the paths are {list(self)}")
        return self._paths[name]

    def __setitem__(self, name: str, path: SdpaPath) -> None:
        if not isinstance(path, SdpaPath) or path.name != name:
            raise ValueError(f"sdpa path {name!r} must be an `SdpaPath` named {name!r}, got {path!r}")
        self._paths[name] = path

    def __delitem__(self, name: str) -> None:
        del self._paths[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def replace(self, name: str, **changes) -> SdpaPath:
        """Puts a copy of the path `name` with `changes` (`dataclasses.replace`) in its place; returns the old one."""
        old = self[name]
        self[name] = dataclasses.replace(old, **changes)
        return old


# The declared order: the C kernel first where it applies, but for a bias constant beyond a distance over
# `kernels_relative_native.BANDED_FROM` tokens or more, which the banded kernel takes next (its far keys' fused
# backward wins there); the banded and linear-bias kernels before the general relative one, which would also take
# their biases; FIRE's bias in C before the recipe kernel, which takes every recipe the others do not.
SDPA_PATHS = SdpaPaths(
    SdpaPath("relative_native", native_relative_applies, native_relative_attention),
    SdpaPath("banded_bias", banded_bias_applies, banded_bias_attention),
    SdpaPath("linear_bias", linear_bias_applies, linear_bias_attention),
    SdpaPath("relative_bias", relative_bias_applies, relative_bias_attention),
    SdpaPath("fire_native", fire_native_applies, fire_native_attention),
    SdpaPath("query_bias", query_bias_applies, query_bias_attention),
)


def sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """plugformer's `sdpa` (`capabilities`): `kernels_sinks.sdpa_sinks_forward` with attention sinks (`s_aux`),
    transformers' SDPA without a bias, else the first of `SDPA_PATHS` that applies, else the blockwise kernel
    (`kernels.sdpa_attention_forward`).

    Returns `(output (B, Q, H, D), None)`: no attention weights (use eager for `output_attentions`).
    """
    if s_aux is not None:
        return sdpa_sinks_forward(
            module, query, key, value, attention_mask, scaling, dropout, position_bias, s_aux, **kwargs
        )
    if position_bias is None:  # transformers' SDPA, without the calls that look for a bias (every Llama-like step)
        return transformers_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    is_causal = kwargs.pop("is_causal", None)
    is_causal = module.is_causal if is_causal is None else is_causal  # sdpa obeys the kwarg over the module's flag
    path = SDPA_PATHS.select(query, key, value, attention_mask, dropout, position_bias, is_causal)
    if path is not None:
        return path(module, query, key, value, attention_mask, scaling, dropout, position_bias, is_causal)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling, dropout, position_bias, is_causal=is_causal, **kwargs
    )
