"""Loading a saved model through an Auto class, refusing a checkpoint whose backbone tensors are missing or unknown.

transformers' `from_pretrained` initialises missing tensors freshly and drops unexpected ones, with a report in the
log: a checkpoint with one layer's tensors deleted loaded in `plugformer eval` and scored a perplexity. plugformer's
own loaders (the stages, eval, compare, extrapolate) refuse that in one line naming the tensors. A different head
(a reward stage built on a language model: `score.weight` new, `lm_head.weight` unused) is what a stage change
means and stays allowed; only tensors of the base model (`base_model_prefix`) count, every tensor of a model
that is its own base model (the seq2seq head).
"""

from __future__ import annotations

from pathlib import Path


def load_checked(auto_class, path: str | Path, **kwargs):
    """`auto_class.from_pretrained(path, **kwargs)`, raising `ValueError` when tensors of the base model are
    missing from the checkpoint, unexpected in it, or of another shape. With `ignore_mismatched_sizes=True` the
    caller changed a size on purpose (classify's new `num_labels`): only the tensors that depend on it (the head's)
    can be of another shape, and they are initialised anew."""
    model, info = auto_class.from_pretrained(path, output_loading_info=True, **kwargs)
    # a head's own layer (a reward model's `score`, new over a causal checkpoint) may be missing; a model that is its
    # own base model (the seq2seq head, as T5's) has no such layer: every tensor is checked
    own_base = getattr(model, "base_model", model) is model
    prefix = "" if own_base else f"{getattr(model, 'base_model_prefix', '') or ''}."
    problems = []
    kinds = (
        "missing_keys",
        "unexpected_keys",
        *(() if kwargs.get("ignore_mismatched_sizes") else ("mismatched_keys",)),
    )
    for kind in kinds:
        names = sorted(str(key if isinstance(key, str) else key[0]) for key in info.get(kind, ()))
        names = [name for name in names if prefix in ("", ".") or name.startswith(prefix)]
        if names:
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            problems.append(f"{kind.replace('_keys', '')}: {shown}")
    if problems:
        raise ValueError(
            f"{path}: the checkpoint does not match its model ({'; '.join(problems)}); a missing "
            "tensor would be freshly initialised and an unexpected one ignored: it is damaged or "
            "another model's"
        )
    return model
