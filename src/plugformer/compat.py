"""The transformers versions plugformer supports (`>=5.19,<5.26`) differ in the names below; this is the only model
module that knows. Each shim tests for the feature, not the version, and says which release changed it. On 5.24 every name
is transformers' own object (no wrapper, no per-call work), but `renamed_cache_kwarg`, which hands transformers'
`deprecate_kwarg` only the calls that use the old name.

- 5.24.0 renamed the KV cache from `past_key_values` to `cache`: the output field (`BaseModelOutputWithPast.cache`),
  the mask builders' argument (`create_causal_mask(cache=)`) and what `generate()` passes to `forward`. plugformer
  is written in the new names; before 5.24 its outputs also answer `.cache`, its forwards take `past_key_values`.
- 5.23.0 renamed `gradient_checkpointing_enable`/`_disable` to `activation_checkpointing_enable`/`_disable`
  (`ActivationCheckpointingNames`). The same release renamed the `TrainingArguments` fields; that shim is the
  trainer's, not the model's, and lives in `training/trainer_options.py`, outside the code a checkpoint carries.
- After 5.19, `replace_layer_number_by_wildcard` moved from `transformers.distributed.tensor_parallel` to
  `distributed.parallel_utils` (where 5.24 has it); only `tests/test_tensor_parallel.py` imports it, from either.
- 5.21.0 added `modeling_utils.slice_logits_to_keep`, and `PreTrainedConfig.__post_init__` stopped assigning
  `base_model_tp_plan` (before, it added `embed_tokens` to the plan of a config with tied embeddings).

5.25.0 requires `kernels>=0.19.1,<0.20` (a dependency, no longer optional) and changes four things here:
- Hub kernels are on by default: `from_pretrained(use_kernels=None)` kernelizes every layer that names a Hub kernel
  (Llama's RMSNorm, ...), fetching it, unless `USE_HUB_KERNELS` is false, which it now reads at each call (before:
  `use_kernels=False` by default, and the variable only read at import, when `kernels` is installed). plugformer's
  own layers name none; the `ACT2FN` activations its MLPs hold (as Llama's do) name one, a kernel of the same
  function where the Hub has one for the device (on CPU none: a checkpoint loads with nothing fetched). Its tests and
  commands load transformers' reference models: its offline defaults (`runtime.offline`) and `tests/conftest.py` set
  `USE_HUB_KERNELS=NO`; a user's `USE_HUB_KERNELS=YES` opts in.
- `create_bidirectional_mask` (and the sliding variant) take `position_ids` and keep packed documents apart, as
  `create_causal_mask` already did without a mask and a cache. plugformer passes no `position_ids` to the mask
  builders and keeps documents apart itself (`stack.document_mask_function`, with a mask and a cache too), so the
  masks are the same; passing both would only repeat the same `and` of document ids.
- `PreTrainedConfig` ignores `_attn_implementation` found in a loaded `config.json` (5.24 applied it). plugformer
  never writes it there (`save_pretrained` drops it) and reads the kernel from `config._attn_implementation` as
  transformers set it at load (`capabilities.KERNELS.of`), so only a hand-edited `config.json` loads differently:
  pass `attn_implementation=` to `from_pretrained` instead.
- T5's relative bias through the attention interface: `models/t5/modeling_t5.py` is identical in 5.24 and 5.25
  (5.24 already passes it to `ALL_ATTENTION_FUNCTIONS`); plugformer reads only its `_relative_position_bucket`, in
  tests, and its parameter layout, for memory estimates.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import transformers
from packaging.version import Version
from transformers import masking_utils, modeling_outputs, modeling_utils
from transformers.utils.deprecation import deprecate_kwarg


__all__ = [
    "FLEX_PADDING_VERIFIED",
    "TENSOR_PARALLEL_VERIFIED",
    "ActivationCheckpointingNames",
    "BaseModelOutputWithPast",
    "BaseModelOutputWithPastAndCrossAttentions",
    "CausalLMOutputWithPast",
    "Seq2SeqLMOutput",
    "Seq2SeqModelOutput",
    "SequenceClassifierOutputWithPast",
    "create_bidirectional_mask",
    "create_bidirectional_sliding_window_mask",
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "renamed_cache_kwarg",
    "slice_logits_to_keep",
]

CACHE_NAMED_CACHE = "cache" in modeling_outputs.BaseModelOutputWithPast.__dataclass_fields__  # 5.24.0 and later
# transformers' flex attention with a padding mask gives wrong outputs on 5.19 (plugformer's encoder differs by O(1)
# from the unpadded text; transformers' own LlamaModel returns NaN there) and right ones on 5.24; 5.20-5.23 are not
# verified. Where it is not verified, plugformer refuses flex with padding (its kernel record, `capabilities`).
FLEX_PADDING_VERIFIED = Version(transformers.__version__).release >= (5, 24)
# Tensor parallelism: 5.24's plans shard plugformer's per-head score parameters and gather the LM head's output as its
# tests check; on 5.19 the same runs fail (the LM head's output twice as wide, an additive score's weights unsharded)
# and a seq2seq plan lacks the decoder embedding's rule; 5.20-5.23 are not verified. Where it is not verified,
# plugformer refuses tp_size > 1 (`attention.check_tensor_parallel`).
TENSOR_PARALLEL_VERIFIED = Version(transformers.__version__).release >= (5, 24)


def _pass_cache_as_past_key_values(builder: Callable) -> Callable:
    """`builder(cache=...)` for a mask builder that takes `past_key_values` (before 5.24.0)."""
    if "cache" in inspect.signature(builder).parameters:
        return builder

    @functools.wraps(builder)
    def build(*args, cache=None, **kwargs):
        return builder(*args, past_key_values=cache, **kwargs)

    return build


create_causal_mask = _pass_cache_as_past_key_values(masking_utils.create_causal_mask)
create_bidirectional_mask = _pass_cache_as_past_key_values(masking_utils.create_bidirectional_mask)
create_sliding_window_causal_mask = _pass_cache_as_past_key_values(masking_utils.create_sliding_window_causal_mask)
create_bidirectional_sliding_window_mask = _pass_cache_as_past_key_values(
    masking_utils.create_bidirectional_sliding_window_mask
)


def _answering_cache(output_class: type) -> type:
    """`output_class` taking and answering `cache` for an output class whose field is `past_key_values` (before
    5.24.0); generate() reads and passes on `past_key_values`, plugformer's code and its callers `cache`."""
    if CACHE_NAMED_CACHE:
        return output_class

    def __init__(self, *args, cache=None, **kwargs):
        if cache is not None:
            kwargs["past_key_values"] = cache
        output_class.__init__(self, *args, **kwargs)

    namespace = {
        "__init__": __init__,
        "cache": property(lambda self: self.past_key_values),
        "__module__": __name__,
        "__qualname__": output_class.__qualname__,
        "__doc__": output_class.__doc__,
    }
    return type(output_class.__name__, (output_class,), namespace)


BaseModelOutputWithPast = _answering_cache(modeling_outputs.BaseModelOutputWithPast)
BaseModelOutputWithPastAndCrossAttentions = _answering_cache(modeling_outputs.BaseModelOutputWithPastAndCrossAttentions)
CausalLMOutputWithPast = _answering_cache(modeling_outputs.CausalLMOutputWithPast)
Seq2SeqLMOutput = _answering_cache(modeling_outputs.Seq2SeqLMOutput)
Seq2SeqModelOutput = _answering_cache(modeling_outputs.Seq2SeqModelOutput)
SequenceClassifierOutputWithPast = _answering_cache(modeling_outputs.SequenceClassifierOutputWithPast)


class _ActivationCheckpointingNames:
    """`activation_checkpointing_enable`/`_disable`, the names from 5.23.0, for the releases before (which call them
    `gradient_checkpointing_enable`/`_disable`, without `every_n_layers` or `offload`)."""

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False
    ):
        if every_n_layers != 1 or offload:
            raise ValueError(
                f"every_n_layers={every_n_layers} and offload={offload} need transformers>=5.23 (installed: "
                f"{transformers.__version__}); use every_n_layers=1, offload=False"
            )
        self.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs)

    def activation_checkpointing_disable(self):
        self.gradient_checkpointing_disable()


class _Nothing:
    """A base that adds nothing (5.23.0 and later have the names)."""


ActivationCheckpointingNames = (
    _Nothing
    if hasattr(modeling_utils.PreTrainedModel, "activation_checkpointing_enable")
    else _ActivationCheckpointingNames
)


def renamed_cache_kwarg(forward: Callable) -> Callable:
    """Lets `forward(cache=...)` also be called with `past_key_values=`: deprecated from 5.24.0 (transformers' own
    `deprecate_kwarg`, as its models carry it, for the calls that use it), the name `generate()` and every caller uses
    before (renamed silently)."""
    if CACHE_NAMED_CACHE:
        deprecated = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

        @functools.wraps(forward)
        def checked(*args, **kwargs):
            # only a call with the old name goes through transformers' wrapper, which formats its warning's subject on
            # every call (a share of a small model's decoding step, six calls deep)
            if "past_key_values" in kwargs:
                return deprecated(*args, **kwargs)
            return forward(*args, **kwargs)

        return checked

    @functools.wraps(forward)
    def renamed(*args, **kwargs):
        if "past_key_values" in kwargs:
            past_key_values = kwargs.pop("past_key_values")
            if kwargs.get("cache") is None:
                kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return renamed


def _slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers 5.24's `slice_logits_to_keep` (added in 5.21.0): the last `n` positions for an int (0 = all), the
    given positions for a 1-D or `(B, n)` integer tensor, the `True` positions (flattened) for a boolean `(B, T)`."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden_states[:, logits_to_keep, :]


slice_logits_to_keep = getattr(modeling_utils, "slice_logits_to_keep", _slice_logits_to_keep)


# transformers before 5.21.0 assigns `base_model_tp_plan` in `PreTrainedConfig.__post_init__`
ASSIGNS_TP_PLAN = Version(transformers.__version__).release < (5, 21)
