"""Checkpoints written before a parameter changed shape load into today's shapes, through transformers' own weight
conversions (`register_checkpoint_conversion_mapping`, keyed by model_type `plugformer`), which `from_pretrained`
applies while it reads a checkpoint. `pretrained` registers them when it is imported, so a checkpoint loaded with
`trust_remote_code=True` has them too.

| parameter | was | now | why |
|---|---|---|---|
| `positions.distance_scale`, `positions.threshold_scale` (FIRE's c and L) | 0-d | `(1,)` | FSDP2 refuses 0-d parameters |
"""

from __future__ import annotations

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightConverter


ONE_ELEMENT = ("positions.distance_scale", "positions.threshold_scale")


class OneElement(ConversionOps):
    """A one-number tensor of any shape as shape `(1,)`; its own reverse, so a save keeps `(1,)`."""

    @torch.no_grad()
    def convert(self, input_dict: dict, source_patterns: list[str], target_patterns: list[str], **kwargs) -> dict:
        (name, tensors), *others = input_dict.items()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        if others or tensor.numel() != 1:
            raise ValueError(f"{name}: expected one tensor of one number, got shape {tuple(tensor.shape)}")
        return {target_patterns[0]: tensor.reshape(1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return self


def register_legacy_conversions() -> None:
    """Registers the conversions for model_type `plugformer` (again: a remote-code copy of this module may run too)."""
    converters = [WeightConverter(name, name, [OneElement()]) for name in ONE_ELEMENT]
    register_checkpoint_conversion_mapping("plugformer", converters, overwrite=True)
