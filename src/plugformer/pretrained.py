"""`PlugformerPreTrainedModel`: what every plugformer model class shares with transformers: weight initialisation of
the plugged-in parts, per-config kernel capability flags, output recording, and saving under a sharding wrapper."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import initialization as init
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.modeling_utils import PreTrainedModel
from transformers.utils.output_capturing import OutputRecorder

from .attention import PlugformerAttention, PlugformerCrossAttention
from .block import PlugformerDecoderLayer
from .capabilities import unsupported_reason
from .compat import ActivationCheckpointingNames
from .configuration import PlugformerConfig
from .layers import LearnedValueResidual
from .legacy_weights import register_legacy_conversions
from .linear_attention import PlugformerGatedDeltaNet
from .positions import PositionScheme
from .scores import AttentionScore


class MethodSignature(inspect.Signature):
    """A function's `inspect.Signature` that keeps the signature of its bound method once built.

    `inspect.signature(model.forward)` takes the function's stored signature and drops `self` through `replace`, a new
    `Signature` validated parameter by parameter, on every call: `generate()` asks once per decoding step, for a custom
    code model such as plugformer's (`GenerationMixin.prepare_inputs_for_generation`, "cache_position"). Signatures
    are immutable, so the same parameters give back the same object.
    """

    __slots__ = ("_replaced",)

    @classmethod
    def of(cls, function) -> MethodSignature:
        signature = inspect.signature(function)
        return cls(list(signature.parameters.values()), return_annotation=signature.return_annotation)

    def replace(self, **changes) -> inspect.Signature:
        cached = getattr(self, "_replaced", None)
        if cached is not None and cached[0] == changes:  # a tuple of the same `Parameter`s (`_signature_bound_method`)
            return cached[1]
        replaced = super().replace(**changes)
        self._replaced = changes, replaced
        return replaced


register_legacy_conversions()  # older checkpoints' parameter shapes, converted while from_pretrained reads them


class PlugformerPreTrainedModel(PreTrainedModel, ActivationCheckpointingNames):
    config: PlugformerConfig
    config_class = PlugformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PlugformerDecoderLayer"]
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": PlugformerDecoderLayer,
        "attentions": OutputRecorder(PlugformerAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(PlugformerCrossAttention, index=1, layer_name="cross_attn"),
    }

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None:
            # generate() reads `inspect.signature(self.forward)` every step for custom-code models (these are, being
            # registered for the Auto classes); stored once, it is not re-derived through the decorators' wrappers.
            # Stored on the innermost function, which `inspect.signature` reaches through `__wrapped__`: on a
            # `(*args, **kwargs)` wrapper it would also be what torch.compile binds that wrapper's frame by
            # (`follow_wrapped=False`), so a compiled top-level forward (vLLM's) found no `args` local
            # A `MethodSignature`: the bound method's signature (`self` dropped) is built once too
            inspect.unwrap(forward).__signature__ = MethodSignature.of(forward)

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
        """transformers' `save_pretrained`, also for a model whose class a wrapper replaced.

        FSDP2's `fully_shard` swaps the class for `FSDP<Name>`, defined in torch's `_fsdp_init`; transformers copies
        the code of `type(model).__module__` and names that class in `auto_map`, so the checkpoint would carry torch's
        files and load nowhere without plugformer. Here the checkpoint is written as plugformer's own class (the full
        `state_dict` gathered first if none is given: a collective, every rank calls it).

        The checkpoint carries the code of every class its `auto_map` names (`copy_auto_map_code`), not only the saved
        class's module and what that imports.
        """
        package = __name__.rpartition(".")[0]  # `plugformer`, or the checkpoint's `transformers_modules...`
        code_class = next(cls for cls in type(self).__mro__ if cls.__module__.rpartition(".")[0] == package)
        wrapped = type(self) is not code_class
        if wrapped and state_dict is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state_dict = get_model_state_dict(self, options=options)  # rank 0 gets it, the others {}
            kwargs["is_main_process"] = torch.distributed.get_rank() == 0
        if state_dict is not None:
            # a state dict gathered by a sharding wrapper (FSDP2's, accelerate's for ZeRO) holds the tied copies
            # (`lm_head.weight`) that a plain save leaves out
            state_dict = {key: value for key, value in state_dict.items() if key not in self.all_tied_weights_keys}
        if not wrapped:
            saved = super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        elif not kwargs.get("is_main_process", True):  # nothing to write; an empty state dict must not overwrite
            return None
        else:
            wrapper_class, self.__class__ = self.__class__, code_class
            try:
                saved = super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
            finally:
                self.__class__ = wrapper_class
        if kwargs.get("is_main_process", True) and self._auto_class is not None:
            copy_auto_map_code(save_directory, self.config.auto_map)
        return saved

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear / Embedding: normal(initializer_range); norms: ones, zeros
        if isinstance(module, (AttentionScore, PositionScheme)):
            module.reset_parameters(self.config)
        if isinstance(module, PlugformerGatedDeltaNet):
            module.reset_parameters()  # A_log, dt_bias (its Linear, Conv1d and norm: transformers' defaults above)
        if isinstance(module, LearnedValueResidual):
            init.constant_(module.value_lambdas, 0.5)  # the paper's λ1 = λ2 = 0.5
        if isinstance(module, PlugformerAttention) and module.sinks is not None:
            init.normal_(module.sinks, std=self.config.initializer_range)  # as gpt-oss's

    # Capability flags, per config: support depends on the config, not the class (additive scores are no dot product,
    # flash kernels take no score bias), so transformers, which reads these flags off the model instance, gets each
    # config's answer from the kernel table. An additive model says `_supports_sdpa=False` as a model without sdpa
    # does in transformers: no request resolves to eager, an explicit sdpa request (`from_pretrained`,
    # `set_attn_implementation`) raises. Read off the class, the flags are property objects (truthy): the class runs
    # sdpa/flex/flash for some configs. (tests/README.md, "Conformance".)
    @property
    def _supports_sdpa(self) -> bool:
        return unsupported_reason(self.config, "sdpa") is None

    @property
    def _supports_flex_attn(self) -> bool:
        return unsupported_reason(self.config, "flex_attention") is None

    @property
    def _supports_flash_attn(self) -> bool:
        return unsupported_reason(self.config, "flash_attention_2") is None

    # transformers asks these hooks whether a kernel can run this model; when no kernel was requested, a refusal of
    # sdpa falls back to eager, an explicit request of any kernel the table says cannot compute it raises.
    def _refuse_unsupported(self, kernel: str) -> None:
        reason = unsupported_reason(self.config, kernel)
        if reason is not None:
            raise ValueError(reason)

    # (first plugformer's reason, which names the field: transformers' own message for a False flag does not)
    def _sdpa_can_dispatch(self, is_init_check: bool = False) -> bool:
        self._refuse_unsupported("sdpa")
        return super()._sdpa_can_dispatch(is_init_check)

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        self._refuse_unsupported("flex_attention")
        return super()._flex_attn_can_dispatch(is_init_check)

    def _flash_attn_can_dispatch(self, flash_attn_version: int, is_init_check: bool = False) -> bool:
        self._refuse_unsupported(f"flash_attention_{flash_attn_version}")
        return super()._flash_attn_can_dispatch(flash_attn_version=flash_attn_version, is_init_check=is_init_check)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        implementation = super().get_correct_attn_implementation(requested_attention, is_init_check)
        self._refuse_unsupported(implementation)
        return implementation


def copy_auto_map_code(directory: str | os.PathLike, auto_map: dict) -> None:
    """Copies into a saved checkpoint the module of every class its `auto_map` names, with the modules those import
    relatively (transformers' own rule, `get_relative_import_files`).

    transformers copies only the saved class's module and its imports. The stack (`stack.PlugformerModel`) imports
    no head, so a bare model's checkpoint would name `modeling.PlugformerForCausalLM` and friends without carrying
    `modeling.py`; with the files copied here every entry loads with `trust_remote_code`. The modules are looked up
    beside this file, which is where they are under plugformer and inside a checkpoint loaded as remote code alike.
    """
    here = Path(__file__).parent
    for entry in auto_map.values():
        for reference in entry if isinstance(entry, (list, tuple)) else [entry]:
            if not isinstance(reference, str) or "--" in reference:  # None, or another repository's code
                continue
            source = here / f"{reference.split('.')[0]}.py"
            if not source.is_file():
                continue
            for needed in [source, *map(Path, get_relative_import_files(source))]:
                target = Path(directory) / needed.name
                if not target.exists():
                    shutil.copyfile(needed, target)
