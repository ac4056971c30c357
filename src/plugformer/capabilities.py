"""The kernel axis as a table: what each attention kernel can compute, and the rule that refuses the rest.

A kernel is a registered `KernelSpec` record. Its fields say which scores it computes (any score, or a dot product
of the prepared query and key only), how a score bias reaches it (`bias`: a bias object of `biases` it expands itself,
of the kinds it lists; a dense `(B, H, Q, K)` tensor; nothing, because it adds ALiBi's linear bias from the scheme's
slopes itself; or no bias at all), what it cannot decode with (a static cache, padding), whether it returns attention
weights and whether it exists on this machine. As in transformers' T5, the model hands every kernel one
`position_bias=` and the record converts it (`KernelSpec.position_bias`, by `BIAS_DELIVERY`); the model and the tools
ask the table (`KERNELS.of(config)`, the one reader of `config._attn_implementation`), never a kernel's name:

| `attn_implementation` | scores | bias (kinds) | function |
|---|---|---|---|
| `eager` | any | relative, query_position, decay | the score's own kernel (`AttentionScore.eager_kernel`) |
| `sdpa` | dot product | relative, query_position, decay | `kernels_sdpa.sdpa_forward` (blockwise with a bias; sinks as a key column) |
| `flex_attention` | dot product | relative, query_position, decay | transformers' flex (`score_mod` reads `bias[b, h, i, j]`); uncompiled on the CPU (`kernels_flex`) |
| `flash_attention_{2,3,4}` | dot product | none | transformers' flash functions |
| `vllm_alibi` (registered by `plugformer.integrations.vllm_plugin`) | dot product | alibi | vLLM's attention built with ALiBi slopes |

Logit soft-capping (`attn_logit_softcapping`) runs where a record declares `softcap` (`eager`, `flex_attention`),
attention sinks (`use_attention_sinks`) where it declares `sinks` (`eager`, `sdpa`), a score whose values are wider than
its queries and keys (`AttentionScore.value_width`) where it declares `wide_values` (`eager`, `sdpa`,
`flex_attention`; flash-attn kernels take one head dim for q, k and v).

A kernel plugformer has no record of (registered with `transformers.AttentionInterface.register`, a Hub kernel, or
an engine's own such as vLLM's "vllm") is taken for what transformers' interface promises and no more: a dot
product without a bias. Configurations it cannot compute are refused with a `ValueError`, at
`from_pretrained`/`set_attn_implementation` and again at the first forward with it, never run with the bias or the
score silently dropped. `register_attention_kernel` adds a record (and the function to transformers' interface).

`ALL_ATTENTION_FUNCTIONS` here is plugformer's own `AttentionInterface` instance (transformers' documented way to
override a kernel for one model): `sdpa` maps to plugformer's, every other name to transformers' global table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available

from .biases import BIAS_KINDS
from .compat import FLEX_PADDING_VERIFIED
from .kernels_flex import flex_forward
from .kernels_sdpa import sdpa_forward
from .positions import POSITION_SCHEMES
from .projections import ATTENTION_PROJECTIONS
from .scores import ATTENTION_SCORES


if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from .biases import QueryPositionBias, RelativeBias
    from .configuration import PlugformerConfig


SCORE_SUPPORT = ("any", "dot_product")


def bias_object(bias: RelativeBias | QueryPositionBias, batch: int) -> RelativeBias | QueryPositionBias:
    """`bias="relative"`: the bias object itself; the kernel asks it for the rows it works on."""
    return bias


def dense_bias(bias: RelativeBias | QueryPositionBias, batch: int) -> torch.Tensor:
    """`bias="dense"`: the whole `(B, H, Q, K)` tensor, expanded over the batch (flex-style kernels index `bias[b]`)."""
    return bias.dense().expand(batch, -1, -1, -1)


def no_bias(bias: RelativeBias | QueryPositionBias, batch: int) -> None:
    """`bias="alibi"` (the kernel adds ALiBi itself, from the slopes its engine holds) and `bias="none"`: nothing."""
    return None


# How the scheme's bias reaches each kind of kernel as its `position_bias` (transformers' T5 passes one
# `position_bias=` to whichever kernel runs, and the kernel decides; here the record decides, so a kernel function
# written for transformers' interface gets the form it declared).
BIAS_DELIVERY = {"relative": bias_object, "dense": dense_bias, "alibi": no_bias, "none": no_bias}
BIAS_SUPPORT = tuple(BIAS_DELIVERY)


@dataclass(frozen=True)
class KernelSpec:
    """What one attention kernel can compute.

    Args:
        name (`str`): The `attn_implementation` value.
        scores (`str`): `"any"` (the kernel runs the score's own math: eager) or `"dot_product"` (softmax of
            scaling · q·k: every score whose `dot_product` is true).
        bias (`str`): `"relative"` (takes a bias object of `biases` as `position_bias`, of the `bias_kinds` it
            lists), `"dense"` (takes the `(B, H, Q, K)` tensor as `position_bias` and adds it to the scores: every
            kind), `"alibi"` (adds ALiBi's linear bias itself, from slopes the engine holds, and gets no
            `position_bias`: every scheme without `PositionScheme.linear_bias_slopes` refused) or `"none"` (no score
            bias: bias schemes refused). `BIAS_DELIVERY` converts the bias accordingly.
        function (`Callable`, *optional*): The attention function; `None` for `eager`, which is the score's own.
        softcap (`bool`, *optional*, defaults to `False`): Caps the logits as `softcap`·tanh(logits / `softcap`)
            before the mask and bias (Gemma 2's `attn_logit_softcapping`), given a `softcap=` keyword.
        sinks (`bool`, *optional*, defaults to `False`): Adds gpt-oss's learned sink logit per head as one more key
            column in the softmax, dropped after it (`use_attention_sinks`), given an `s_aux=` `(H,)` tensor.
        wide_values (`bool`, *optional*, defaults to `False`): Computes with values of another head dim than the
            queries' and keys' (a score's `value_width` above 1, e.g. differential attention's 2·d_k-wide values).
        sliding_window (`bool`, *optional*, defaults to `True`): Applies the attention mask plugformer builds, so a
            `sliding_window` (part of that mask) is computed; `False` for a kernel that masks by itself (an engine's,
            such as vLLM's, which windows only by its own settings) and for kernels without a record.
        windows_layer_types (`bool`, *optional*, defaults to `False`): Masks by itself, but slides a window of
            `sliding_window` keys (the query's included) in the causal layers `layer_types` marks sliding, as vLLM's
            Transformers backend builds each layer's attention from `config.layer_types`.
        attention_weights (`bool`, *optional*, defaults to `False`): Returns the weights (`output_attentions`).
        available (`Callable[[], bool]`, *optional*): Whether it runs on this machine (packages, device).
        bias_kinds (`tuple[str, ...]`, *optional*, defaults to `("relative",)`): With `bias="relative"`, the kinds of
            bias object it takes (`biases.BIAS_KINDS`): `"relative"` (`RelativeBias`, per distance; a kernel may read
            its per-distance values) and `"query_position"` (`QueryPositionBias`, per batch row: FIRE). A scheme
            whose `bias_type` is of another kind is refused.
        bias_recipe (`bool`, *optional*, defaults to `False`): In training, takes a `QueryPositionBias` whose values
            are a `biases.QueryBiasRecipe` (the queries' positions and the scheme's parameters) and computes the bias
            a block of query rows at a time, in its backward again: the stack then builds no `(B, H, Q, K)` values
            (`sdpa`: `kernels_query_bias`). The kernel's `rows` calls compute them otherwise (exact, with autograd).
        static_cache (`bool`, *optional*, defaults to `True`): Decodes with a static cache (`StaticCache`, whose
            length is a tensor updated in place). `False` for transformers' flex: its block mask reads the cache length
            after layer 0's update changed it and masks every chunk after the first at the wrong offset.
        padding (`bool`, *optional*, defaults to `True`): Computes rows with padding (a 2-D `attention_mask` with
            zeros) right. `False` for transformers' flex before 5.24 (`compat.FLEX_PADDING_VERIFIED`).
        head_shapes (`bool`, *optional*, defaults to `True`): Attends with the heads the attention hands it, of any
            count and width. `False` for an engine that sizes its own KV cache from the config's `num_key_value_heads`
            and `head_dim` (vLLM's) and for kernels without a record: an `attention_projection` whose
            `standard_heads` is false (multi-head latent attention) is refused there.
    """

    name: str
    scores: str
    bias: str
    function: Callable | None = None
    softcap: bool = False
    sinks: bool = False
    wide_values: bool = False
    sliding_window: bool = True
    windows_layer_types: bool = False
    attention_weights: bool = False
    available: Callable[[], bool] = field(default=lambda: True)
    bias_kinds: tuple[str, ...] = ("relative",)
    bias_recipe: bool = False
    static_cache: bool = True
    padding: bool = True
    head_shapes: bool = True

    def __post_init__(self):
        if self.scores not in SCORE_SUPPORT:
            raise ValueError(f"KernelSpec {self.name!r}: scores={self.scores!r} is not one of {list(SCORE_SUPPORT)}")
        if self.bias not in BIAS_SUPPORT:
            raise ValueError(f"KernelSpec {self.name!r}: bias={self.bias!r} is not one of {list(BIAS_SUPPORT)}")
        unknown = [kind for kind in self.bias_kinds if kind not in BIAS_KINDS]
        if unknown or isinstance(self.bias_kinds, str):
            raise ValueError(
                f"KernelSpec {self.name!r}: bias_kinds={self.bias_kinds!r} must be a tuple of {list(BIAS_KINDS)}"
            )

    def takes_bias(self, kind: str) -> bool:
        """Whether it adds a scheme's bias of `kind` (`biases.BIAS_KINDS`) given as `position_bias`."""
        return self.bias == "dense" or (self.bias == "relative" and kind in self.bias_kinds)

    def position_bias(
        self, bias: RelativeBias | QueryPositionBias, batch: int
    ) -> RelativeBias | QueryPositionBias | torch.Tensor | None:
        """The scheme's bias object in the form this kernel takes as `position_bias` (`BIAS_DELIVERY`), for a batch of
        `batch` rows."""
        return BIAS_DELIVERY[self.bias](bias, batch)

    def check(self, config: PlugformerConfig) -> None:
        """Raises a `ValueError` naming the field if this kernel cannot compute `config`'s attention exactly."""
        reason = self.unsupported_reason(config)
        if reason is not None:
            raise ValueError(reason)

    def check_inputs(self, cache: Cache | None, attention_mask: torch.Tensor | None) -> None:
        """Raises a `ValueError` for a cache or padding this kernel would compute wrong outputs with (`static_cache`,
        `padding`): fail loudly instead of decoding wrong tokens."""
        if not self.static_cache and getattr(cache, "is_compileable", False):
            raise ValueError(
                f"attn_implementation={self.name!r} cannot decode with a {type(cache).__name__} (its record says "
                "static_cache=False: it would mask wrong positions); use a DynamicCache (the default) or one of "
                f"{KERNELS.decoding_with_static_caches()} with the static cache"
            )
        padded = attention_mask is not None and attention_mask.ndim == 2
        if not self.padding and padded and not attention_mask.all():
            raise ValueError(
                f"attn_implementation={self.name!r} with padding (an attention_mask with zeros) computes wrong outputs "
                f"on transformers {transformers.__version__} (its record says padding=False); use one of "
                f"{KERNELS.taking_padding()}"
            )

    def unsupported_reason(self, config: PlugformerConfig) -> str | None:
        """Why this kernel cannot compute `config`'s attention exactly, or `None` if it can."""
        score = ATTENTION_SCORES.get(config.attention_score)
        if self.scores == "dot_product" and not score.dot_product:
            return (
                f"attention_score={config.attention_score!r} is not a dot product of query and key in a softmax, so "
                f"attn_implementation={self.name!r} cannot compute it; use attn_implementation='eager' (chosen "
                "automatically when no implementation is requested)"
            )
        if score.value_width != 1 and not self.wide_values:
            return (
                f"attention_score={config.attention_score!r} gives the kernel values {score.value_width}·head_dim wide, "
                f"which attn_implementation={self.name!r} does not take (one head dim for q, k and v); use one of "
                f"{KERNELS.taking_wide_values()}"
            )
        projection = ATTENTION_PROJECTIONS.get(config.attention_projection)
        if not projection.standard_heads and not self.head_shapes:
            return (
                f"attn_implementation={self.name!r} attends with num_key_value_heads heads of head_dim, which "
                f"attention_projection={config.attention_projection!r} does not produce; use one of "
                f"{KERNELS.taking_any_heads()}"
            )
        if projection.value_dim(config) != projection.query_key_dim(config) and not self.wide_values:
            return (
                f"attention_projection={config.attention_projection!r} gives the kernel values v_head_dim="
                f"{projection.value_dim(config)} wide and keys {projection.query_key_dim(config)} wide, which "
                f"attn_implementation={self.name!r} does not take (one head dim for q, k and v); use one of "
                f"{KERNELS.taking_wide_values()}"
            )
        if config.attn_logit_softcapping is not None and not self.softcap:
            return (
                f"attn_implementation={self.name!r} cannot cap the attention logits (attn_logit_softcapping="
                f"{config.attn_logit_softcapping!r}, Gemma 2's c·tanh(logits / c)); use one of {KERNELS.capping()}"
            )
        if config.use_attention_sinks and not self.sinks:
            return (
                f"attn_implementation={self.name!r} cannot add attention sinks (use_attention_sinks=True, gpt-oss's "
                f"learned logit per head); use one of {KERNELS.with_sinks()}"
            )
        windowed_by_layer_types = self.windows_layer_types and config.is_causal
        if config.sliding_window is not None and not (self.sliding_window or windowed_by_layer_types):
            return (
                f"attn_implementation={self.name!r} does not apply plugformer's attention mask, so it would drop "
                f"sliding_window={config.sliding_window!r}; use one of {KERNELS.windowing()}"
            )
        scheme = POSITION_SCHEMES.get(config.position_scheme)
        if self.bias == "alibi" and scheme.linear_bias_slopes(config) is None:
            linear = [
                name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).linear_bias_slopes(config) is not None
            ]
            return (
                f"attn_implementation={self.name!r} adds ALiBi's bias itself, which "
                f"position_scheme={config.position_scheme!r} does not have; it computes "
                f"{' or '.join(f'position_scheme={name!r}' for name in linear)} only"
            )
        if self.bias == "none" and scheme.has_bias:
            return (
                f"attn_implementation={self.name!r} takes no additive score bias, which "
                f"position_scheme={config.position_scheme!r} needs; use one of {KERNELS.taking_a_bias(scheme)}"
            )
        if self.bias == "relative" and scheme.has_bias and not self.takes_bias(scheme.bias_type.kind):
            return (
                f"attn_implementation={self.name!r} takes score biases of the kinds {list(self.bias_kinds)}, and the "
                f"bias of position_scheme={config.position_scheme!r} is of kind {scheme.bias_type.kind!r} "
                f"({scheme.bias_type.__name__}); use one of {KERNELS.taking_a_bias(scheme)}"
            )
        return None


class KernelTable:
    """The registered kernels by name; a name without a record gets the conservative record of a foreign kernel."""

    axis = "attn_implementation"

    def __init__(self):
        self._table: dict[str, KernelSpec] = {}

    def register(self, spec: KernelSpec) -> KernelSpec:
        if spec.name in self._table:
            raise ValueError(f"{self.axis}={spec.name!r} is already registered")
        self._table[spec.name] = spec
        return spec

    def get(self, name: str) -> KernelSpec:
        """The record of `name`; for an unregistered kernel, a dot product without a bias (what every kernel in
        transformers' interface computes)."""
        return self._table.get(name) or KernelSpec(
            name, scores="dot_product", bias="none", sliding_window=False, head_shapes=False
        )

    def of(self, config: PlugformerConfig) -> KernelSpec:
        """The record of the kernel `config` runs on: the one place plugformer reads `config._attn_implementation`
        (set by transformers at load and by `set_attn_implementation`, or by an engine such as vLLM by hand)."""
        name = config._attn_implementation
        return self._table.get(name) or self.get(name)  # (a registered kernel without a second call: once per layer)

    def names(self) -> list[str]:
        return list(self._table)

    def taking_a_bias(self, scheme: type | None = None) -> list[str]:
        """The kernels taking a scheme's bias given to them (not one computing a single scheme's own): that of
        `scheme` (a `PositionScheme` class), by default a `RelativeBias`."""
        kind = "relative" if scheme is None else scheme.bias_type.kind
        return [name for name, spec in self._table.items() if spec.takes_bias(kind)]

    def capping(self) -> list[str]:
        """The kernels that apply `attn_logit_softcapping`."""
        return [name for name, spec in self._table.items() if spec.softcap]

    def windowing(self) -> list[str]:
        """The kernels that apply a `sliding_window` (through plugformer's mask)."""
        return [name for name, spec in self._table.items() if spec.sliding_window]

    def taking_wide_values(self) -> list[str]:
        """The kernels that take values wider than the queries and keys (a score's `value_width` above 1)."""
        return [name for name, spec in self._table.items() if spec.wide_values]

    def taking_any_heads(self) -> list[str]:
        """The kernels that attend with heads of any count and width (`head_shapes`)."""
        return [name for name, spec in self._table.items() if spec.head_shapes]

    def with_sinks(self) -> list[str]:
        """The kernels that add `use_attention_sinks`' sink logits."""
        return [name for name, spec in self._table.items() if spec.sinks]

    def decoding_with_static_caches(self) -> list[str]:
        """The kernels that decode with a static cache."""
        return [name for name, spec in self._table.items() if spec.static_cache]

    def taking_padding(self) -> list[str]:
        """The kernels that compute padded rows right."""
        return [name for name, spec in self._table.items() if spec.padding]

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)


KERNELS = KernelTable()
ALL_ATTENTION_FUNCTIONS = AttentionInterface()

# eager, sdpa and flex take FIRE's per-row bias and forgetting attention's decay too: eager and sdpa add their rows
# (sdpa in training computes them per block, `kernels_query_bias`), flex's `score_mod` reads them per score
EVERY_BIAS_KIND = tuple(BIAS_KINDS)
KERNELS.register(
    KernelSpec(
        "eager",
        scores="any",
        bias="relative",
        bias_kinds=EVERY_BIAS_KIND,
        softcap=True,
        sinks=True,
        wide_values=True,
        attention_weights=True,
    )
)
KERNELS.register(
    KernelSpec(
        "sdpa",
        scores="dot_product",
        bias="relative",
        bias_kinds=EVERY_BIAS_KIND,
        function=sdpa_forward,
        sinks=True,
        wide_values=True,
        bias_recipe=True,
    )
)
KERNELS.register(
    KernelSpec(
        "flex_attention",
        scores="dot_product",
        bias="relative",
        bias_kinds=EVERY_BIAS_KIND,
        function=flex_forward,
        softcap=True,
        wide_values=True,
        static_cache=False,
        padding=FLEX_PADDING_VERIFIED,
    )
)
for _version, _available in (
    (2, is_flash_attn_2_available),
    (3, is_flash_attn_3_available),
    (4, is_flash_attn_4_available),
):
    KERNELS.register(
        KernelSpec(
            f"flash_attention_{_version}",
            scores="dot_product",
            bias="none",
            available=lambda check=_available: torch.cuda.is_available() and check(),
        )
    )
ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_forward
ALL_ATTENTION_FUNCTIONS["flex_attention"] = flex_forward  # uncompiled on the CPU (`kernels_flex`)


def register_attention_kernel(
    name: str,
    function: Callable,
    *,
    scores: str = "dot_product",
    bias: str = "none",
    bias_kinds: tuple[str, ...] = ("relative",),
    softcap: bool = False,
    sinks: bool = False,
    wide_values: bool = False,
    attention_weights: bool = False,
    static_cache: bool = True,
    padding: bool = True,
    head_shapes: bool = True,
    mask: str | None = "sdpa",
) -> KernelSpec:
    """Registers an attention function under `name` with what it can compute, for plugformer and transformers.

    Args:
        name (`str`): The `attn_implementation` value it is chosen by.
        function (`Callable`): transformers' attention signature, `(module, query, key, value, attention_mask, *,
            scaling, dropout, **kwargs) -> (output (B, Q, H, D), weights | None)`; with `bias="relative"` or
            `"dense"` it also gets `position_bias`.
        scores, bias, bias_kinds, softcap, sinks, wide_values, attention_weights, static_cache, padding, head_shapes:
            As in [`KernelSpec`].
        mask (`str`, *optional*, defaults to `"sdpa"`): The mask format it takes, that of a kernel in transformers'
            `AttentionMaskInterface` (`"sdpa"`: boolean, `"eager"`: additive float, `"flex_attention"`: a block
            mask); `None` if it masks by itself. transformers builds no mask at all for a kernel without one, so
            such a kernel is refused a `sliding_window`.

    Returns:
        `KernelSpec`: the record; configurations it does not declare are refused when the kernel is chosen.
    """
    spec = KERNELS.register(
        KernelSpec(
            name,
            scores=scores,
            bias=bias,
            bias_kinds=bias_kinds,
            function=function,
            softcap=softcap,
            sinks=sinks,
            wide_values=wide_values,
            sliding_window=mask is not None,
            attention_weights=attention_weights,
            static_cache=static_cache,
            padding=padding,
            head_shapes=head_shapes,
        )
    )
    AttentionInterface.register(name, function)
    if mask is not None:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask])
    return spec


def unsupported_reason(config: PlugformerConfig, kernel: str) -> str | None:
    """Why `kernel` cannot compute `config`'s attention exactly, or `None` if it can."""
    return KERNELS.get(kernel).unsupported_reason(config)


def supported_kernels(config: PlugformerConfig, available_only: bool = True) -> list[str]:
    """The registered kernels that compute `config`'s attention exactly (by default only those that run here)."""
    return [
        name
        for name in KERNELS
        if unsupported_reason(config, name) is None and (not available_only or KERNELS.get(name).available())
    ]


def combination_matrix() -> list[tuple[str, str, list[str]]]:
    """Every (attention_score, position_scheme) pair with the registered kernels that compute it (anywhere)."""
    from .configuration import PlugformerConfig

    rows = []
    for score in ATTENTION_SCORES:
        for scheme in POSITION_SCHEMES:
            config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme)
            rows.append((score, scheme, supported_kernels(config, available_only=False)))
    return rows
