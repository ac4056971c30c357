"""The variant axes as data, read by the README's generated tables (`readme_tables`) and the bench's variant rows.

- `AXES`: each config field whose value names a registered class, with its registry. A registered class describes
  itself in the first paragraph of its docstring (`summary`): one markdown sentence or two with the formula and
  the paper (or the reference model), as the shipped classes do. The fields it owns (`config_fields`) are listed
  beside it.
- `ATTENTION_MODIFIERS`: config fields that change the attention of whichever score and scheme are chosen, each with
  the values the bench rows and the kernel table switch it on with (`modifier_fields` adds the fields a value needs
  beside it and repeats a per-layer pattern over the layers); each is described by its entry in `PlugformerConfig`'s
  docstring (`field_summary`). Unlike a registered variant, a new field is added here by hand.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..configuration import PlugformerConfig
from ..layers import FEED_FORWARDS, NORM_PLACEMENTS, NORMS
from ..positions import POSITION_SCHEMES
from ..registry import Registry
from ..scores import ATTENTION_SCORES


AXES: dict[str, Registry[Any]] = {
    "attention_score": ATTENTION_SCORES,
    "position_scheme": POSITION_SCHEMES,
    "norm_type": NORMS,
    "norm_placement": NORM_PLACEMENTS,
    "ffn_type": FEED_FORWARDS,
}

# field -> the values it is switched on with, one bench row each (the README shows them; the kernel table asks each)
ATTENTION_MODIFIERS: dict[str, tuple[Any, ...]] = {
    "use_qk_norm": (True,),
    "attn_logit_softcapping": (50.0,),  # Gemma 2's attention cap
    "use_attention_sinks": (True,),
    "sliding_window": (256,),  # every layer sliding
    "layer_types": (["sliding_attention", "full_attention"],),  # alternating, as Gemma 2's (a pattern: PER_LAYER)
    "use_gated_attention": (True,),
    "exclusive_self_attention": (True,),
    "value_residual": ("fixed", "learned"),
    "attention_projection": ("latent",),  # multi-head latent attention (DeepSeek-V2/V3)
}
# Fields whose value has one entry per layer: a modifier's value is a pattern, repeated over the layers.
PER_LAYER = ("layer_types",)
# What a modifier's values need set beside them: sliding layers need a window.
REQUIRED_FIELDS: dict[str, dict[str, Any]] = {"layer_types": {"sliding_window": 256}}


def modifier_fields(field: str, value: Any, num_hidden_layers: int) -> dict[str, Any]:
    """The config fields that set modifier `field` to `value` in a model of `num_hidden_layers` layers: the fields it
    needs (`REQUIRED_FIELDS`), then `field`, a per-layer pattern repeated (and cut) to one entry per layer."""
    if field in PER_LAYER:
        value = [value[index % len(value)] for index in range(num_hidden_layers)]
    return {**REQUIRED_FIELDS.get(field, {}), field: value}


def modifier_label(field: str, value: Any) -> str:
    """`field=value` as the bench rows name a modifier's value (a per-layer pattern marked as repeated), after the
    fields it needs."""
    required = [f"{name}={needed!r}" for name, needed in REQUIRED_FIELDS.get(field, {}).items()]
    return ", ".join([*required, f"{field}={value!r}" + (" repeated" if field in PER_LAYER else "")])


def summary(variant: type) -> str:
    """The first paragraph of `variant`'s own docstring (not one it inherits), on one line."""
    doc = variant.__dict__.get("__doc__")
    if not doc or not doc.strip():
        raise ValueError(
            f"{variant.__name__} has no docstring of its own: its first paragraph describes it in the "
            "README's variant table"
        )
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def field_summary(field: str) -> str:
    """The text of `field`'s entry in `PlugformerConfig`'s docstring (`field (`type`, ...): text`), on one line."""
    lines = inspect.cleandoc(PlugformerConfig.__doc__).splitlines()
    for index, line in enumerate(lines):
        if line.lstrip().startswith(f"{field} (") and "): " in line:
            indent = len(line) - len(line.lstrip())
            entry = [line.split("): ", 1)[1]]
            for more in lines[index + 1 :]:
                if not more.strip() or len(more) - len(more.lstrip()) <= indent:
                    break
                entry.append(more.strip())
            return " ".join(entry)
    raise ValueError(f"{field!r} has no entry in PlugformerConfig's docstring")
