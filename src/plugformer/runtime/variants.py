"""The variant axes as data, read by the README's generated tables (`readme_tables`) and the bench's variant rows.

- `AXES`: each config field whose value names a registered class, with its registry. A registered class describes
  itself in the first paragraph of its docstring (`summary`): one markdown sentence or two with the formula and
  the paper (or the reference model), as the shipped classes do. The fields it owns (`config_fields`) are listed
  beside it.
- `ATTENTION_MODIFIERS`: config fields that change the attention of whichever score and scheme are chosen, each with
  the value the bench rows and the kernel table switch it on with; each is described by its entry in
  `PlugformerConfig`'s docstring (`field_summary`). Unlike a registered variant, a new field is added here by hand.
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

ATTENTION_MODIFIERS: dict[str, Any] = {
    "use_qk_norm": True,
    "attn_logit_softcapping": 50.0,  # Gemma 2's attention cap
    "use_attention_sinks": True,
    "sliding_window": 256,
    "use_gated_attention": True,
    "value_residual": "learned",
    "attention_projection": "latent",  # multi-head latent attention (DeepSeek-V2/V3)
}


def summary(variant: type) -> str:
    """The first paragraph of `variant`'s own docstring (not one it inherits), on one line."""
    doc = variant.__dict__.get("__doc__")
    if not doc or not doc.strip():
        raise ValueError(f"{variant.__name__} has no docstring of its own: its first paragraph describes it in the "
                         "README's variant table")  # fmt: skip
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
