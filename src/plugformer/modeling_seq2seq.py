"""The encoder-decoder model: [`PlugformerSeq2SeqModel`] (the two stacks) and [`PlugformerForConditionalGeneration`]
(with the LM head), T5's layout on plugformer's stacks. `modeling` re-exports both, so `auto_map` entries naming
`modeling.PlugformerForConditionalGeneration` keep loading."""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
)
from transformers.utils import ModelOutput, can_return_tuple

from .compat import (
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    renamed_cache_kwarg,
    slice_logits_to_keep,
)
from .configuration import PlugformerConfig
from .generation import PlugformerGenerationMixin
from .inputs import check_labels
from .losses import head_logits, token_cross_entropy
from .pretrained import PlugformerPreTrainedModel
from .stack import (
    PlugformerModel,
)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: the decoder reads `[start, y_1 .. y_{n-1}]` to predict `[y_1 .. y_n]` (-100 becomes pad)."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == -100, pad_token_id)


class PlugformerSeq2SeqModel(PlugformerPreTrainedModel):
    """The encoder-decoder stacks without the LM head: the base model of [`PlugformerForConditionalGeneration`]
    (returns the decoder's `last_hidden_state`, the cache and the encoder's outputs).

    T5's layout: the head adds `lm_head` beside `encoder` and `decoder` rather than nesting them under a prefix, so
    both classes have the same parameter names and each loads the other's checkpoint (and every seq2seq checkpoint
    saved before this class existed loads unchanged). As T5's, the head is its own `base_model`.
    """

    # The decoder reads the encoder's embedding: its own `nn.Embedding` whose weight is tied to the encoder's (a
    # parameter tie, as transformers' models declare theirs: one module in both stacks made transformers, at load,
    # take the encoder's embedding for an initialised tie target, so a checkpoint without it loaded, unreported, with
    # the weight left on the meta device). Tied whatever `tie_word_embeddings` says, which is about the LM head only
    # (`get_expanded_tied_weights_keys`).
    _tied_weights_keys = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight"}
    # Each stack brings the config's plan for its own layers; the decoder's cross-attention, which only the seq2seq
    # classes have, splits its heads the same way.
    _tp_plan = {
        "decoder.layers.*.cross_attn.q_proj": "colwise",
        "decoder.layers.*.cross_attn.k_proj": "colwise",
        "decoder.layers.*.cross_attn.v_proj": "colwise",
        "decoder.layers.*.cross_attn.o_proj": "rowwise",
        "decoder.layers.*.cross_attn.score": "embedding_rowwise",
    }

    def __init__(self, config: PlugformerConfig):
        super().__init__(config)
        self._build_stacks(config)
        self.post_init()

    def _build_stacks(self, config: PlugformerConfig) -> None:
        if not config.is_encoder_decoder or config.pad_token_id is None:
            raise ValueError(
                f"{type(self).__name__} needs is_encoder_decoder=True and a pad_token_id, got is_encoder_decoder="
                f"{config.is_encoder_decoder}, pad_token_id={config.pad_token_id}"
            )
        self.encoder = PlugformerModel(config, is_causal=False)
        self.decoder = PlugformerModel(
            config, is_causal=True, cross_attention=True, num_layers=config.num_decoder_layers
        )

    def post_init(self) -> None:
        super().post_init()
        # transformers gives a model that is its own base model the config's tensor-parallel plan; that plan is one
        # stack's (`layers.*`), which each stack brings under its own prefix (`encoder.layers.*`): here it names nothing
        stack_plan = self.config.base_model_tp_plan or {}
        self._tp_plan = {name: style for name, style in (self._tp_plan or {}).items() if name not in stack_plan}

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        """transformers' `{tied parameter: source}`, plus the decoder's embedding tied to the encoder's even without
        `tie_word_embeddings` (which unties the LM head only)."""
        tied = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        return {**tied, **PlugformerSeq2SeqModel._tied_weights_keys}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = self.decoder.embed_tokens = value

    def encode_decode(
        self,
        input_ids,
        attention_mask,
        decoder_input_ids,
        decoder_attention_mask,
        encoder_outputs,
        cache,
        inputs_embeds,
        decoder_inputs_embeds,
        use_cache,
        **kwargs,
    ):
        """`(encoder_outputs, decoder_outputs)`: the encoder run unless its outputs are given, then the decoder."""
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        elif not isinstance(encoder_outputs, ModelOutput):  # a tuple (last_hidden_state, hidden_states, attentions)
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            cache=cache,
            use_cache=use_cache,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            **kwargs,
        )
        return encoder_outputs, decoder_outputs

    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        decoder_inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        r"""Arguments as in [`PlugformerForConditionalGeneration.forward`] (without `labels` and `logits_to_keep`)."""
        encoder_outputs, decoder_outputs = self.encode_decode(
            input_ids,
            attention_mask,
            decoder_input_ids,
            decoder_attention_mask,
            encoder_outputs,
            cache,
            inputs_embeds,
            decoder_inputs_embeds,
            use_cache,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class PlugformerForConditionalGeneration(PlugformerSeq2SeqModel, PlugformerGenerationMixin):
    """Encoder-decoder transformer (Vaswani et al. 2017): a bidirectional encoder, a causal decoder whose blocks add
    cross-attention to the encoder output, one embedding shared by both and the LM head.

    Needs `config.is_encoder_decoder=True` and a `pad_token_id`; `decoder_start_token_id` defaults to the pad id
    (T5's convention). The decoder has `config.num_decoder_layers` blocks (default: `num_hidden_layers`). Positions
    apply to self-attention in both stacks; cross-attention uses the configured score function without positions.
    """

    _tied_weights_keys = {
        "decoder.embed_tokens.weight": "encoder.embed_tokens.weight",
        "lm_head.weight": "encoder.embed_tokens.weight",
    }
    _tp_plan = {"lm_head": "colwise_gather_output", **PlugformerSeq2SeqModel._tp_plan}

    def __init__(self, config: PlugformerConfig):
        PlugformerPreTrainedModel.__init__(self, config)
        self._build_stacks(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        if self.generation_config is not None and self.generation_config.decoder_start_token_id is None:
            self.generation_config.decoder_start_token_id = self.decoder_start_token_id

    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        decoder_inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, source_length)`): Source token ids.
            attention_mask (`torch.Tensor` of shape `(batch_size, source_length)`, *optional*): Source padding.
            decoder_input_ids (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*): Decoder
                inputs; built from `labels` by shifting right when not given.
            decoder_attention_mask (`torch.Tensor`, *optional*): Decoder padding (with the cached length).
            encoder_outputs (`BaseModelOutput`, *optional*): A precomputed encoder output (`generate` passes it).
            cache (`EncoderDecoderCache`, *optional*): Decoder self-attention keys/values and the encoder's
                cross-attention keys/values (computed once).
            labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*): Target ids, -100 ignored.
            logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0): As in [`PlugformerForCausalLM`].
        """
        check_labels(labels, self.config.vocab_size)  # before the decoder inputs are shifted out of them
        num_items = kwargs.pop("num_items_in_batch", None)  # Trainer's divisor under gradient accumulation
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.decoder_start_token_id)
        encoder_outputs, decoder_outputs = self.encode_decode(
            input_ids,
            attention_mask,
            decoder_input_ids,
            decoder_attention_mask,
            encoder_outputs,
            cache,
            inputs_embeds,
            decoder_inputs_embeds,
            use_cache,
            **kwargs,
        )
        logits = head_logits(self, slice_logits_to_keep(decoder_outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits, labels, num_items)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )

    @property
    def decoder_start_token_id(self) -> int:
        start = self.config.decoder_start_token_id
        return self.config.pad_token_id if start is None else start
