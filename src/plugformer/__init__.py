"""plugformer: transformers whose attention score function and position scheme you choose, native to 🤗 transformers.

`import plugformer` registers the config, models and tokenizer with transformers' Auto classes.
"""

# ruff: noqa: E402 (the imports follow `quiet_start`: Ctrl-C while they run is answered by it)
from .runtime.interrupts import quiet_start as _quiet_start


_quiet_start()  # the `plugformer` command only: Ctrl-C during the imports below is one line, not a traceback

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from .capabilities import KERNELS, KernelSpec, combination_matrix, register_attention_kernel, supported_kernels
from .configuration import PRESETS, PlugformerConfig
from .data.tokenization import PlugformerTokenizer, train_tokenizer
from .decomposable import DecomposableAttentionConfig, DecomposableAttentionForSequenceClassification
from .layers import FEED_FORWARDS, NORM_PLACEMENTS, NORMS
from .modeling import (  # importing it registers PEFT's default LoRA targets (LORA_TARGET_MODULES)
    LORA_TARGET_MODULES,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
    PlugformerModel,
    PlugformerPreTrainedModel,
    PlugformerSeq2SeqModel,
)
from .positions import POSITION_SCHEMES
from .projections import ATTENTION_PROJECTIONS
from .registry import Registry
from .scores import ATTENTION_SCORES


__version__ = "0.1.0"

# Auto classes: which model class serves which Auto class. Also written into every config's `auto_map`, so saved
# checkpoints load with `trust_remote_code=True` where plugformer is not installed.
AUTO_CLASSES = {
    AutoModel: PlugformerModel,
    AutoModelForCausalLM: PlugformerForCausalLM,
    AutoModelForMaskedLM: PlugformerForMaskedLM,
    AutoModelForSequenceClassification: PlugformerForSequenceClassification,
    AutoModelForTokenClassification: PlugformerForTokenClassification,
    AutoModelForSeq2SeqLM: PlugformerForConditionalGeneration,
}

AutoConfig.register(PlugformerConfig.model_type, PlugformerConfig, exist_ok=True)
PlugformerConfig.register_for_auto_class()
for _auto_class, _model_class in AUTO_CLASSES.items():
    _auto_class.register(PlugformerConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
AutoTokenizer.register(PlugformerConfig, fast_tokenizer_class=PlugformerTokenizer, exist_ok=True)

AutoConfig.register(DecomposableAttentionConfig.model_type, DecomposableAttentionConfig, exist_ok=True)
DecomposableAttentionConfig.register_for_auto_class()
AutoModelForSequenceClassification.register(
    DecomposableAttentionConfig, DecomposableAttentionForSequenceClassification, exist_ok=True
)
DecomposableAttentionForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
AutoTokenizer.register(DecomposableAttentionConfig, fast_tokenizer_class=PlugformerTokenizer, exist_ok=True)

__all__ = [
    "ATTENTION_PROJECTIONS",
    "ATTENTION_SCORES",
    "AUTO_CLASSES",
    "FEED_FORWARDS",
    "KERNELS",
    "LORA_TARGET_MODULES",
    "NORMS",
    "NORM_PLACEMENTS",
    "POSITION_SCHEMES",
    "PRESETS",
    "DecomposableAttentionConfig",
    "DecomposableAttentionForSequenceClassification",
    "KernelSpec",
    "PlugformerConfig",
    "PlugformerForCausalLM",
    "PlugformerForConditionalGeneration",
    "PlugformerForMaskedLM",
    "PlugformerForSequenceClassification",
    "PlugformerForTokenClassification",
    "PlugformerModel",
    "PlugformerPreTrainedModel",
    "PlugformerSeq2SeqModel",
    "PlugformerTokenizer",
    "Registry",
    "combination_matrix",
    "register_attention_kernel",
    "supported_kernels",
    "train_tokenizer",
]
