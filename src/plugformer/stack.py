"""`PlugformerModel`, the bare stack: embeddings (+ the position scheme's `embed`) -> blocks -> final norm.

Besides the stack itself: the masks it builds (causal, bidirectional, packed documents), the positions it derives
from the mask or the cache, and the check of its cache and padding against the kernel's record
(`KernelSpec.check_inputs`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import find_packed_sequence_indices, packed_sequence_mask_function
from transformers.utils import logging
from transformers.utils.import_utils import is_tracing
from transformers.utils.output_capturing import capture_outputs

from .biases import QueryBiasRecipe
from .block import PlugformerDecoderLayer, dropout_if_active
from .capabilities import KERNELS
from .compat import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
    renamed_cache_kwarg,
)
from .configuration import PlugformerConfig
from .inputs import check_inputs, embed_ids
from .layers import NORM_PLACEMENTS, NORMS
from .linear_attention import LINEAR_ATTENTION, padding_mask
from .positions import POSITION_SCHEMES, PositionScheme
from .pretrained import PlugformerPreTrainedModel


logger = logging.get_logger(__name__)


class CausalConfigView:
    """`config` as transformers' causal mask builders read it, with `is_causal=True`; every other attribute is the
    config's own at the time it is read (e.g. `_attn_implementation` after `set_attn_implementation`)."""

    is_causal = True

    def __init__(self, config: PlugformerConfig):
        self.config = config

    def __getattr__(self, name: str):  # only names the view itself lacks
        if name == "config":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.config, name)


def position_ids_from_mask(
    attention_mask: torch.Tensor | None, past_length: int | torch.Tensor, query_length: int, device: torch.device
) -> torch.Tensor:
    """Positions of the current tokens: counted over the non-padding tokens of a 2-D mask (so a left-padded row
    starts at 0, as the same text alone would), else `past_length + arange(query_length)`. Shape `(B or 1, Q)`."""
    if attention_mask is not None and attention_mask.ndim == 2:
        counts = attention_mask if attention_mask.dtype == torch.long else attention_mask.long()
        if query_length == 1:  # a decoding step: the last count is the row's sum (one op fewer than the cumsum)
            return (counts.sum(-1, keepdim=True) - 1).clamp_(min=0)  # (B, 1)
        positions = counts.cumsum(-1) - 1
        return positions.clamp(min=0)[:, -query_length:]
    return (torch.arange(query_length, device=device) + past_length)[None]


def document_mask_function(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    batch: int,
    query_length: int,
):
    """The mask function keeping packed documents apart, or `None` when each row holds one document.

    A document starts wherever `position_ids` do not step by 1 (transformers' `find_packed_sequence_indices`), and
    `packed_sequence_mask_function` blocks the keys of every other document. transformers reads packing only without
    a mask and without a cache, but plugformer makes a cache whenever `use_cache` (in training too) and collators may
    pass an all-ones mask: the documents attended to each other. Here packing is read from the caller's
    `position_ids` whenever the keys are exactly these queries (a decoding step, with cached keys, has none), in the
    rows the mask leaves whole: a row with padding is one document, as in transformers (`generate()` gives pads
    position 1, which would otherwise start a "document" at every pad and cut the tokens before a hole off the rest).
    Within a document slot distances are document distances, so relative biases need nothing more.
    """
    if position_ids is None:
        return None
    if cache is not None:
        kv_length = cache.get_mask_sizes(query_length, 0)[0]
    elif attention_mask is not None and attention_mask.ndim == 2:
        kv_length = attention_mask.shape[-1]
    else:
        kv_length = query_length
    if kv_length != query_length:
        return None
    documents = find_packed_sequence_indices(position_ids.expand(batch, -1))  # (B, Q): each token's document
    if documents is not None and attention_mask is not None and attention_mask.ndim == 2:
        documents = documents * attention_mask.bool().all(dim=-1, keepdim=True)  # a padded row: one document
        if not is_tracing(documents) and not documents[:, -1].any():
            return None
    return None if documents is None else packed_sequence_mask_function(documents)


class PlugformerModel(PlugformerPreTrainedModel):
    """The bare transformer stack returning `last_hidden_state` (and the cache).

    By default a decoder (`config.is_causal=True`) or an encoder (`False`); a seq2seq model builds one of each
    from the same config, the decoder with cross-attention (the seq2seq model ties its embedding to the encoder's).

    Args:
        config ([`PlugformerConfig`]): The configuration.
        is_causal (`bool`, *optional*): Overrides `config.is_causal` for this stack.
        cross_attention (`bool`, *optional*, defaults to `False`): Add encoder-decoder attention to every block.
        num_layers (`int`, *optional*): Number of blocks; defaults to `config.num_hidden_layers`.
    """

    def __init__(
        self,
        config: PlugformerConfig,
        is_causal: bool | None = None,
        cross_attention: bool = False,
        num_layers: int | None = None,
    ):
        super().__init__(config)
        self.is_causal = config.is_causal if is_causal is None else is_causal
        self.cross_attention = cross_attention
        # a stack without cross-attention returns transformers' `BaseModelOutputWithPast`, as Llama's (no
        # `cross_attentions` field to fill and check per step)
        self.output_class = BaseModelOutputWithPastAndCrossAttentions if cross_attention else BaseModelOutputWithPast
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.positions = POSITION_SCHEMES.get(config.position_scheme)(config, bidirectional=not self.is_causal)
        # whether the scheme adds vectors to the embeddings (overrides `embed`): a call fewer per step without
        self.adds_position_embeddings = type(self.positions).embed is not PositionScheme.embed
        self.hidden_dropout = config.hidden_dropout
        # `value_residual`: the blocks mix in the first block's values (read once: see `_use_cache`)
        self.mixes_first_values = bool(config.value_residual)
        num_layers = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(
            PlugformerDecoderLayer(config, i, self.is_causal, cross_attention) for i in range(num_layers)
        )
        final_norm = NORM_PLACEMENTS.get(config.norm_placement).final_norm
        self.norm = NORMS.get(config.norm_type)(config) if final_norm else nn.Identity()
        self.gradient_checkpointing = False
        self.post_init()

    def _new_cache(self) -> Cache:
        if self.cross_attention:  # self-attention keys grow per step; the encoder's are computed once
            decoder = self.config.get_text_config(decoder=True)  # sized by num_decoder_layers
            return EncoderDecoderCache(DynamicCache(config=decoder), DynamicCache(config=decoder))
        return DynamicCache(config=self.config)

    def _use_cache(self, use_cache: bool | None) -> bool:
        """`use_cache`, by default `config.use_cache`; off while gradient checkpointing trains (as transformers'
        `merge_with_config_defaults` decides, which is not used here: with `is_causal` a config field, it would set
        the config attribute twice per forward, a measurable share of a decoding step)."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            logger.warning_once(
                "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
            )
            return False
        return bool(use_cache)

    def _self_attention_masks(self, inputs_embeds, attention_mask, cache, position_ids, kinds=None) -> dict:
        """The self-attention mask of each attention kind among the layers (`layer_types`; `kinds`, when the caller
        has them), by kind, as transformers' Qwen3 and Gemma build them: the sliding-window masks size themselves by
        the sliding cache layers `DynamicCache(config=...)` makes from the same fields, the full ones by the full
        layers."""
        batch, query_length = inputs_embeds.shape[:2]
        # one query (a decoding step) is one document: nothing to keep apart
        documents = (
            None
            if position_ids is None or query_length == 1
            else document_mask_function(position_ids, attention_mask, cache, batch, query_length)
        )
        kinds = {layer.attention_type for layer in self.layers} if kinds is None else kinds
        if not self.is_causal:  # packed documents are kept apart in both directions (masked-LM packing)
            functions = {
                "full_attention": create_bidirectional_mask,
                "sliding_attention": create_bidirectional_sliding_window_mask,
            }
            return {
                kind: functions[kind](
                    config=self.config,
                    inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask,
                    and_mask_function=documents,
                )
                for kind in kinds
            }
        # no `position_ids`: transformers' own packing detection (without mask and cache only) is `documents`' job
        arguments = dict(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            and_mask_function=documents,
        )
        if not self.config.is_causal:
            # a seq2seq decoder shares its encoder's config (is_causal=False), for which transformers' causal mask
            # builders return a bidirectional mask: they read a view that is causal, the shared config stays as it is
            arguments["config"] = CausalConfigView(self.config)
        functions = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: functions[kind](**arguments) for kind in kinds}

    def _token_embeddings(self, input_ids: torch.LongTensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """The token embeddings `(B, T, hidden)`, looked up from `input_ids` unless given, times the scheme's
        `token_scale` and the config's `embedding_multiplier`."""
        if inputs_embeds is None:
            inputs_embeds = embed_ids(
                self.embed_tokens, input_ids, "decoder_input_ids" if self.cross_attention else "input_ids"
            )
        if self.positions.token_scale != 1.0:  # sinusoidal positions (Vaswani's sqrt(d)); no extra op otherwise
            # on both paths, as transformers' Marian decoder does ("in case user passes embeds"): the embeddings of
            # `get_input_embeddings()(ids)` give the same output as the ids, and generate() continued from
            # `inputs_embeds` (embeddings first, then ids) sees one scale throughout
            inputs_embeds = inputs_embeds * self.positions.token_scale
        if self.config.embedding_multiplier != 1.0:  # in the embeddings' dtype, as Gemma rounds its sqrt(hidden_size)
            inputs_embeds = inputs_embeds * torch.tensor(self.config.embedding_multiplier, dtype=inputs_embeds.dtype)
        return inputs_embeds

    def _checked_cache(self, cache: Cache | None, use_cache: bool, attention_mask: torch.Tensor | None) -> Cache | None:
        """`cache`, a new one when `use_cache` asks for one in a causal stack (an encoder has nothing to decode);
        refused, with the padding of `attention_mask`, where the kernel's record says it would compute wrong outputs
        (`KernelSpec.check_inputs`: flex with a static cache)."""
        if use_cache and cache is None and self.is_causal:
            cache = self._new_cache()
        KERNELS.of(self.config).check_inputs(cache, attention_mask)
        return cache

    def _encoder_mask(
        self,
        inputs_embeds: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None,
    ):
        """The cross-attention mask over the encoder output `encoder_hidden_states` (its padding)."""
        return create_bidirectional_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=encoder_attention_mask,
            encoder_hidden_states=encoder_hidden_states,
        )

    def _add_absolute_positions(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The first hidden states `(B, T, hidden)`: the embeddings plus the scheme's `embed` (if any), then dropout."""
        hidden_states = inputs_embeds
        absolute = self.positions.embed(position_ids, inputs_embeds.dtype)
        if absolute is not None:
            hidden_states = hidden_states + absolute
        return dropout_if_active(hidden_states, self.hidden_dropout, self.training)

    def _position_bias(
        self, cache: Cache | None, position_ids: torch.Tensor, query_length: int, dtype: torch.dtype, layer_idx: int
    ) -> torch.Tensor | QueryBiasRecipe | None:
        """The values of the score bias over the cache slots the kernel will see in layer `layer_idx` (same sizes as
        its mask), shared by the layers of its attention kind: those of the scheme's `bias_type` (a `RelativeBias` per
        distance, `(H, Q + K − 1)`; FIRE's `QueryPositionBias` from the queries' `position_ids`, `(B or 1, H, Q, K)`),
        or, in training on a kernel whose record says `bias_recipe`, the scheme's `QueryBiasRecipe` for them."""
        if not self.positions.has_bias:
            return None
        if cache is None:
            query_offset, (kv_length, kv_offset) = 0, (query_length, 0)
        else:
            query_offset = cache.get_query_offset(layer_idx)
            kv_length, kv_offset = cache.get_mask_sizes(query_length, layer_idx)
        if KERNELS.of(self.config).bias_recipe and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # training on a kernel that computes the bias per block of rows, in its backward too: no (B, H, Q, K)
            # values are kept (traced graphs keep the values: the kernel's backward calls autograd)
            recipe = self.positions.bias_recipe(query_offset, query_length, kv_offset, kv_length, position_ids, dtype)
            if recipe is not None:
                return recipe
        values = self.positions.bias_values(query_offset, query_length, kv_offset, kv_length, position_ids)
        return values.to(dtype)

    @renamed_cache_kwarg
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        encoder_hidden_states: torch.FloatTensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        validate_inputs: bool = True,
        **kwargs,
    ) -> BaseModelOutputWithPast | BaseModelOutputWithPastAndCrossAttentions:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): Token ids.
            attention_mask (`torch.Tensor` of shape `(batch_size, past + sequence_length)`, *optional*): 1 for
                tokens to attend to, 0 for padding; or ready masks by kind of `config.layer_types` (a `dict`, as
                `generate` builds them with a static cache).
            position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): Absolute
                positions; derived from `attention_mask` when not given.
            cache (`Cache`, *optional*): Keys and values of earlier tokens (`DynamicCache`, `StaticCache`, ...;
                an `EncoderDecoderCache` for a decoder with cross-attention).
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`, *optional*):
                Embeddings to use instead of `input_ids`.
            use_cache (`bool`, *optional*): Return the updated cache (causal stacks only); defaults to
                `config.use_cache`.
            encoder_hidden_states (`torch.FloatTensor` of shape `(batch_size, source_length, hidden_size)`,
                *optional*): The encoder output cross-attention reads (stacks built with `cross_attention=True`).
            encoder_attention_mask (`torch.Tensor` of shape `(batch_size, source_length)`, *optional*): Padding
                mask of the encoder output.
            validate_inputs (`bool`, *optional*, defaults to `True`): Run the input checks below. `generate()`
                turns them off after its first step, whose outputs make the next step's inputs (see
                `PlugformerGenerationMixin`).

        Raises:
            `ValueError` / `TypeError` naming the argument, before any work, for malformed inputs (see
            `check_inputs`): ids outside the vocabulary, empty inputs, masks or positions of another shape, masks
            with values other than 0 and 1 or a row of zeros, non-integer ids or positions, NaN or infinite
            `inputs_embeds`.
        """
        if encoder_hidden_states is not None and not self.cross_attention:
            raise ValueError("encoder_hidden_states given to a stack built without cross_attention")
        # `generate` with a static cache builds the masks itself, one per kind of `layer_types` (as Qwen3 takes them)
        prepared_masks = attention_mask if isinstance(attention_mask, dict) else None
        attention_mask = None if prepared_masks is not None else attention_mask
        layers = self.layers
        first_layers = {}  # the first layer of each attention kind, whose cache slots size that kind's bias
        for i, layer in enumerate(layers):
            first_layers.setdefault(layer.attention_type, i)
        if prepared_masks is not None and not first_layers.keys() <= prepared_masks.keys():
            raise ValueError(
                f"attention_mask is a dict of {sorted(prepared_masks)}; it needs a mask for each of the "
                f"layers' kinds {sorted(first_layers)} (config.layer_types), or pass a 2-D padding "
                "mask"
            )
        if validate_inputs:
            check_inputs(
                self,
                input_ids,
                inputs_embeds,
                attention_mask,
                position_ids,
                cache,
                encoder_hidden_states,
                encoder_attention_mask,
            )
        inputs_embeds = self._token_embeddings(input_ids, inputs_embeds)
        use_cache = self._use_cache(use_cache)
        cache = self._checked_cache(cache, use_cache, attention_mask)
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        # from the caller's position_ids (the packing), before they are derived from the mask
        masks = prepared_masks or self._self_attention_masks(
            inputs_embeds, attention_mask, self_cache, position_ids, first_layers.keys() - {LINEAR_ATTENTION}
        )
        if LINEAR_ATTENTION in first_layers and prepared_masks is None:  # the current tokens' padding, or None
            masks[LINEAR_ATTENTION] = padding_mask(attention_mask, inputs_embeds.shape[1])
        query_length = inputs_embeds.shape[1]
        if position_ids is None:
            # the cached length counts only without a 2-D mask (`position_ids_from_mask`)
            padded = attention_mask is not None and attention_mask.ndim == 2
            past_length = self_cache.get_seq_length() if self_cache is not None and not padded else 0
            position_ids = position_ids_from_mask(attention_mask, past_length, query_length, inputs_embeds.device)
        encoder_mask = (
            None
            if encoder_hidden_states is None
            else self._encoder_mask(inputs_embeds, encoder_hidden_states, encoder_attention_mask)
        )
        positions = self.positions
        shared = positions.has_bias and not positions.per_layer  # (a `per_layer` scheme's bias is each layer's own)
        biases = (
            {
                kind: self._position_bias(self_cache, position_ids, query_length, inputs_embeds.dtype, i)
                for kind, i in first_layers.items()
            }
            if shared
            else None
        )
        hidden_states = inputs_embeds
        if self.adds_position_embeddings or (self.hidden_dropout and self.training):  # (else nothing to add or drop)
            hidden_states = self._add_absolute_positions(inputs_embeds, position_ids)
        rotary = positions.rotary(hidden_states, position_ids)
        cross_cache = cache if isinstance(cache, EncoderDecoderCache) else None
        # `value_residual`: the first block's values, which every later block mixes into its own (Zhou et al. 2024)
        first_values = layers[0].attention_values(hidden_states) if self.mixes_first_values else None
        for layer in layers:
            kind = layer.attention_type
            hidden_states = layer(
                hidden_states,
                None if biases is None else biases[kind],
                encoder_hidden_states,
                first_values,
                attention_mask=masks[kind],
                encoder_attention_mask=encoder_mask,
                position_ids=position_ids,
                cache=self_cache,
                cross_cache=cross_cache,
                use_cache=use_cache,
                position_embeddings=rotary,
                **kwargs,
            )
        return self.output_class(last_hidden_state=self.norm(hidden_states), cache=cache)


# what a head needs of the config's stack layout (each head calls one of these before building)
def require_single_stack(config: PlugformerConfig, head: str) -> None:
    if config.is_encoder_decoder:
        raise ValueError(
            f"{head} is a single stack, but is_encoder_decoder=True (which makes generate() and trainers look for an "
            "encoder): use PlugformerForConditionalGeneration, or build the config with is_encoder_decoder=False"
        )


def require_decoder(config: PlugformerConfig, head: str) -> None:
    require_single_stack(config, head)
    if not config.is_causal:
        raise ValueError(
            f"{head} predicts each next token, but is_causal=False lets every position attend to the tokens it "
            "predicts: use PlugformerForMaskedLM for a bidirectional encoder, or build the config with is_causal=True"
        )


def require_encoder(config: PlugformerConfig, head: str) -> None:
    require_single_stack(config, head)
    if config.is_causal:
        raise ValueError(
            f"{head} needs a bidirectional encoder, but is_causal=True: build the config with is_causal=False "
            "(e.g. PlugformerConfig.from_preset('small', is_causal=False))"
        )
