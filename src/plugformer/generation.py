"""`generate()` support shared by the generating heads."""

from __future__ import annotations

import inspect

from transformers.generation import GenerationMixin


class PlugformerGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` whose steps after the first skip the stack's input checks (`validate_inputs`).

    From the second step on, `generate()` feeds the model what it built itself from inputs the first step checked:
    the ids it sampled (from logits over the vocabulary), the padding mask extended by ones, positions counted from
    that mask. Checking them again costs a share of every decoding step: a few percent of a small model's step on
    the CPU, and a device sync per token on an accelerator. An id outside the vocabulary still cannot pass on the
    CPU, where the embedding's own bounds check raises the same error (`inputs.embed_ids`). (An assistant model in
    assisted generation is never told a step is the first: its inputs come from the main model's `generate()`.)
    """

    def prepare_inputs_for_generation(self, *args, is_first_iteration: bool | None = False, **kwargs) -> dict:
        inputs = super().prepare_inputs_for_generation(*args, is_first_iteration=is_first_iteration, **kwargs)
        inputs["validate_inputs"] = bool(is_first_iteration)
        return inputs

    # generate() reads this signature to tell a typo from a model argument: keep transformers' names
    prepare_inputs_for_generation.__signature__ = inspect.signature(GenerationMixin.prepare_inputs_for_generation)
