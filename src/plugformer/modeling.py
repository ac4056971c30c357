"""The plugformer model classes transformers' Auto classes load: the heads on the stack (the seq2seq model lives in
`modeling_seq2seq` and is importable from here).

    embeddings (+ position `embed`) -> blocks [attention (+ `rotary`, + score `prepare`, + `bias`), FFN] -> norm -> head

The stack lives beside this module: `attention` (self- and cross-attention), `block` (one transformer block),
`pretrained` (the shared `PreTrainedModel` base) and `stack` (`PlugformerModel`); their classes are importable from
here. Every `auto_map` entry but the seq2seq one names this module (`modeling.PlugformerForCausalLM`, ...): saving
any head copies this file, and transformers follows its `from .x import` lines to copy the stack's files with it.

Module and parameter names follow transformers' Llama (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, `lm_head`) so PEFT targets, TP plans and weight converters carry over.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    MaskedLMOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput, can_return_tuple

from .attention import PlugformerAttention, PlugformerCrossAttention
from .block import PlugformerDecoderLayer, dropout_if_active
from .compat import (
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
    renamed_cache_kwarg,
    slice_logits_to_keep,
)
from .configuration import PlugformerConfig
from .generation import PlugformerGenerationMixin
from .inputs import check_labels
from .losses import fused_head_loss, head_logits, token_cross_entropy
from .modeling_seq2seq import PlugformerForConditionalGeneration, PlugformerSeq2SeqModel, shift_tokens_right
from .pretrained import PlugformerPreTrainedModel
from .stack import (
    PlugformerModel,
    document_mask_function,
    position_ids_from_mask,
    require_decoder,
    require_encoder,
    require_single_stack,
)


# the heads below, and the stack's names importable from here as before the split
__all__ = [
    "LORA_TARGET_MODULES",
    "PlugformerAttention",
    "PlugformerCrossAttention",
    "PlugformerDecoderLayer",
    "PlugformerForCausalLM",
    "PlugformerForConditionalGeneration",
    "PlugformerForMaskedLM",
    "PlugformerForSequenceClassification",
    "PlugformerForTokenClassification",
    "PlugformerModel",
    "PlugformerPreTrainedModel",
    "PlugformerSeq2SeqModel",
    "PlugformerTokenHead",
    "document_mask_function",
    "dropout_if_active",
    "last_token_indices",
    "position_ids_from_mask",
    "require_decoder",
    "require_encoder",
    "require_single_stack",
    "shift_tokens_right",
]


# PEFT picks default LoRA targets by `config.model_type`: a bare `LoraConfig()` adapts these projections. Registered on
# import of this module, which a checkpoint ships (`trust_remote_code`), so the defaults work without plugformer
# installed too. PEFT is optional there: transformers does not require the imports inside a `try`.
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
try:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
except ImportError:
    pass
else:
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(PlugformerConfig.model_type, LORA_TARGET_MODULES)


class PlugformerForCausalLM(PlugformerPreTrainedModel, PlugformerGenerationMixin):
    """The stack with a language-modelling head (tied to the input embedding when `tie_word_embeddings`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: PlugformerConfig):
        require_decoder(config, type(self).__name__)
        super().__init__(config)
        self.model = PlugformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        Args:
            labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): Targets for the
                next-token loss; shifted inside, -100 is ignored. With `model.fused_loss = True` (set by `plugformer
                train`), a training-mode forward computes the loss in chunks and returns `logits=None`.
            logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0): Compute logits for the last `n`
                positions only (0 = all), or for the given indices.

        Other arguments as in [`PlugformerModel.forward`].
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss = (
            None
            if labels is None
            else fused_head_loss(self, hidden_states, labels, logits_to_keep, shift=True, **kwargs)
        )  # None: unfused
        logits = None if loss is not None else head_logits(self, slice_logits_to_keep(hidden_states, logits_to_keep))
        if labels is not None and loss is None:
            check_labels(labels, self.config.vocab_size)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PlugformerTokenHead(PlugformerPreTrainedModel):
    """Shared forward of the heads that predict one label per token (masked LM, tagging): stack -> `head` -> cross
    entropy over the positions whose label is not -100. Subclasses build `self.model` and define `head`."""

    output_class: type[ModelOutput]

    def head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput | TokenClassifierOutput:
        r"""
        Args:
            labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): A label per token
                (the original id at masked positions for a masked LM; a tag id), -100 where there is none. No shift:
                every position predicts its own label.
        """
        kwargs.pop("use_cache", None)  # an encoder keeps no cache (callers such as generic loops may still pass it)
        num_items = kwargs.pop("num_items_in_batch", None)  # Trainer's divisor under gradient accumulation
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            **kwargs,
        )
        loss = fused_head_loss(self, outputs.last_hidden_state, labels, num_items_in_batch=num_items)  # as causal LMs'
        logits = None if loss is not None else self.head(outputs.last_hidden_state)
        if labels is not None and loss is None:
            check_labels(labels, self.config.vocab_size)
            loss = token_cross_entropy(logits, labels, num_items)
        return self.output_class(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class PlugformerForMaskedLM(PlugformerTokenHead):
    """BERT-style masked-token prediction on a bidirectional stack (`is_causal=False`); the head is tied to the
    input embedding when `tie_word_embeddings`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    output_class = MaskedLMOutput

    def __init__(self, config: PlugformerConfig):
        require_encoder(config, type(self).__name__)
        super().__init__(config)
        self.model = PlugformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def head(self, hidden_states):
        return head_logits(self, hidden_states)


def last_token_indices(
    input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, pad_token_id
) -> torch.Tensor | int:
    """Index of each row's last real token (left or right padding): from the mask, else from the pad id, else -1."""
    if attention_mask is not None and attention_mask.ndim == 2:
        mask = attention_mask
    elif input_ids is not None and pad_token_id is not None:
        mask = input_ids != pad_token_id
    else:
        return -1
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * mask.to(torch.long)).argmax(-1)


class PlugformerForSequenceClassification(PlugformerPreTrainedModel):
    """A linear `score` head on the last real token of each sequence (as transformers' decoder models pool).

    Serves encoders (`is_causal=False`) and decoders alike; with `num_labels=1` it is a regression head, the reward
    model TRL's `RewardTrainer` trains.
    """

    accepts_loss_kwargs = False  # its loss is a mean over examples: `Trainer` divides it by the accumulation steps

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = PlugformerModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        r"""
        Args:
            labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*): Class ids (cross-entropy), or
                targets for `num_labels=1` (mean squared error); `config.problem_type` decides as in transformers.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        if (
            attention_mask is None
            and input_ids is not None
            and self.config.pad_token_id is None
            and input_ids.shape[0] > 1
        ):
            raise ValueError(
                "A batch of several sequences needs an attention_mask or config.pad_token_id to find each last token"
            )
        logits = self.score(outputs.last_hidden_state)  # (B, T, num_labels)
        last = last_token_indices(input_ids, attention_mask, self.config.pad_token_id)
        pooled = logits[torch.arange(logits.shape[0], device=logits.device), last]  # (B, num_labels)
        loss = None
        if labels is not None:
            if self.config.num_labels > 1:  # class ids (regression with one label takes floats)
                check_labels(labels, self.config.num_labels, "num_labels")
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class PlugformerForTokenClassification(PlugformerTokenHead):
    """A linear `score` head on every token (tagging, NER); best on a bidirectional encoder."""

    output_class = TokenClassifierOutput

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = PlugformerModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def head(self, hidden_states):
        return self.score(self.dropout(hidden_states))
