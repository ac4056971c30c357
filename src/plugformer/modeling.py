"""The plugformer transformer: one code path, variants plugged in from the registries.

    embeddings (+ position `embed`) -> blocks [attention (+ `rotary`, + score `prepare`, + `bias`), FFN] -> norm -> head

Module and parameter names follow transformers' Llama (`model.layers.N.self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, `lm_head`) so PEFT targets, TP plans and weight converters carry over.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import find_packed_sequence_indices, packed_sequence_mask_function
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPast,
    MaskedLMOutput,
    TokenClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput, can_return_tuple, logging
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .biases import RelativeBias
from .capabilities import ALL_ATTENTION_FUNCTIONS, KERNELS, unsupported_reason
from .compat import (
    FLEX_PADDING_VERIFIED,
    ActivationCheckpointingNames,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutputWithPast,
    create_bidirectional_mask,
    create_causal_mask,
    renamed_cache_kwarg,
    slice_logits_to_keep,
)
from .configuration import PlugformerConfig
from .generation import PlugformerGenerationMixin
from .inputs import check_inputs, check_labels, embed_ids
from .layers import FEED_FORWARDS, NORM_PLACEMENTS, NORMS
from .positions import POSITION_SCHEMES, PositionScheme, apply_rotary
from .scores import ATTENTION_SCORES, AttentionScore


logger = logging.get_logger(__name__)

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


class PlugformerAttention(nn.Module):
    """Multi-head self-attention with GQA/MQA; the score function and the kernel are plugged in.

    Order (fixed): project -> rotate (RoPE) -> score `prepare_query`/`prepare_key` -> cache update -> kernel
    (+ position bias).
    """

    def __init__(self, config: PlugformerConfig, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.is_causal = is_causal
        tp_size = getattr(getattr(config, "distributed_config", None), "tp_size", 1)  # set by from_pretrained(tp_plan=)
        if config.num_key_value_heads % tp_size:
            # Tensor parallelism gives each rank whole heads (`STACK_TP_PLAN`); a key/value head split over ranks would
            # leave each a fraction of d_k (transformers' Llama fails there with a shape error). Replicating the heads
            # instead would change the group arithmetic of every kernel and the cache layout. The query heads, a
            # multiple of the key/value heads, split whenever these do.
            raise ValueError(
                f"num_key_value_heads={config.num_key_value_heads} cannot be split over tp_size={tp_size} tensor-"
                f"parallel ranks: each rank must hold whole key/value heads; use a tp_size that divides "
                f"{config.num_key_value_heads}, or a model with more key/value heads"
            )
        q_width, kv_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=config.attention_bias)
        self.score = ATTENTION_SCORES.get(config.attention_score)(config)
        self._kernel, self._checked_implementation = None, None  # the record of the kernel last checked

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        return projected.view(*projected.shape[:-1], -1, self.head_dim).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)

    @property
    def scaling(self) -> float:
        """The score's softmax scale, passed as `scaling=self.scaling`: vLLM's transformers backend reads the scale off
        the module from that expression in `forward`'s source (a literal or `self.<attr>` only)."""
        return self.score.scaling

    def checked_kernel(self) -> str:
        """`config._attn_implementation`, refused by the kernel table if it cannot compute this attention (one set by
        hand on the config, or by an engine such as vLLM, skips `from_pretrained`'s check); checked once per
        implementation."""
        implementation = self.config._attn_implementation
        if implementation != self._checked_implementation and not torch.compiler.is_compiling():
            self._check_kernel(implementation)
        return implementation

    def _check_kernel(self, implementation: str) -> None:
        kernel = KERNELS.get(implementation)
        reason = kernel.unsupported_reason(self.config)
        if reason is not None:
            raise ValueError(reason)
        self._kernel, self._checked_implementation = kernel, implementation

    def kernel_kwargs(self, query, key, position_bias, kwargs) -> dict:
        """The kernel's keyword arguments besides `scaling`: dropout, the position bias in the form the kernel takes,
        the score's own (e.g. the additive energy vector) and the caller's."""
        if position_bias is not None:
            # The layers get the bias values (H, Q + K − 1) as a plain tensor: (reentrant) gradient checkpointing
            # sees it as an input.
            position_bias = RelativeBias(position_bias, query.shape[2], key.shape[2])
            # (while torch.compile / torch.export trace, `checked_kernel` records nothing: read the table here)
            implementation = self.config._attn_implementation
            kernel = self._kernel if implementation == self._checked_implementation else KERNELS.get(implementation)
            if kernel.bias == "dense":  # a registered kernel that adds a (B, H, Q, K) tensor
                position_bias = position_bias.dense().expand(query.shape[0], -1, -1, -1)
            elif kernel.bias == "alibi":  # a kernel adding ALiBi itself (vLLM's, with the slopes): no bias to pass
                position_bias = None
        return {
            "dropout": self.attention_dropout if self.training else 0.0,
            "position_bias": position_bias,
            **self.score.kernel_kwargs(),
            # sdpa obeys an `is_causal` kwarg over the module's flag, and transformers' generic code passes
            # config.is_causal; each attention's direction is fixed when built (a seq2seq encoder and its
            # cross-attention share the decoder's config).
            **kwargs,
            "is_causal": self.is_causal,
        }

    def merge_heads(self, attn_output: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The kernel's output as (B, Q, H·D): transformers' kernels return (B, Q, H, D), vLLM's (B·Q tokens, H·D)."""
        return attn_output.reshape(query.shape[0], query.shape[2], -1).contiguous()

    @renamed_cache_kwarg
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self.split_heads(self.q_proj(hidden_states))  # (B, H, T, D)
        key = self.split_heads(self.k_proj(hidden_states))  # (B, H_kv, T, D)
        value = self.split_heads(self.v_proj(hidden_states))  # (B, H_kv, T, D)
        if position_embeddings is not None:
            query, key = apply_rotary(query, key, *position_embeddings)
        query, key = self.score.prepare_query(query), self.score.prepare_key(key)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if position_bias is not None and position_bias.shape[0] != query.shape[1]:
            # Tensor parallelism, a bias computed for all H heads (ALiBi's slopes are a buffer no plan splits): this
            # rank holds the query heads [rank·H_local, (rank + 1)·H_local) that the column-parallel q_proj left it.
            local_heads = query.shape[1]
            first = self.q_proj.weight.device_mesh.get_local_rank() * local_heads
            position_bias = position_bias[first : first + local_heads]  # (H, Q + K − 1) -> (H_local, Q + K − 1)
        # plugformer's own `AttentionInterface` (`capabilities`); transformers' `set_attn_implementation` and vLLM's
        # transformers backend look for this very lookup, and one call of it with `scaling=self.<attr>`, in `forward`
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.checked_kernel(), self.score.eager_kernel)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, scaling=self.scaling,
            **self.kernel_kwargs(query, key, position_bias, kwargs),
        )  # fmt: skip
        return self.o_proj(self.merge_heads(attn_output, query)), attn_weights


class PlugformerCrossAttention(PlugformerAttention):
    """Encoder-decoder attention: queries from the decoder, keys and values from the encoder output, scored by the
    configured score function (additive = Bahdanau's setup). No position scheme applies (as in T5 and Bart). The
    encoder's keys and values are computed once and kept in the cross-attention half of an `EncoderDecoderCache`.
    """

    def __init__(self, config: PlugformerConfig, layer_idx: int):
        super().__init__(config, layer_idx, is_causal=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self.score.prepare_query(self.split_heads(self.q_proj(hidden_states)))  # (B, H, T, ·)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            key, value = layer.keys, layer.values
        else:
            key = self.score.prepare_key(self.split_heads(self.k_proj(encoder_hidden_states)))  # (B, H_kv, S, ·)
            value = self.split_heads(self.v_proj(encoder_hidden_states))  # (B, H_kv, S, D)
            if cache is not None:
                key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.checked_kernel(), self.score.eager_kernel)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask, scaling=self.scaling, **self.kernel_kwargs(query, key, None, kwargs)
        )  # fmt: skip
        return self.o_proj(self.merge_heads(attn_output, query)), attn_weights


def dropout_if_active(hidden_states: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout as a plain function, skipped when it cannot change anything: an `nn.Dropout` module call per sublayer
    is a measurable share of a small model's decoding step."""
    if p and training:
        return nn.functional.dropout(hidden_states, p, training=True)
    return hidden_states


class PlugformerDecoderLayer(GradientCheckpointingLayer):
    """Self-attention (and, in a seq2seq decoder, cross-attention) and a feed-forward block, each wrapped by the
    configured norm placement (pre or post)."""

    def __init__(self, config: PlugformerConfig, layer_idx: int, is_causal: bool = True, cross_attention: bool = False):
        super().__init__()
        self.self_attn = PlugformerAttention(config, layer_idx, is_causal)
        self.mlp = FEED_FORWARDS.get(config.ffn_type)(config)
        norm = NORMS.get(config.norm_type)
        self.input_layernorm = norm(config)  # around attention (before it when pre, after the add when post)
        self.post_attention_layernorm = norm(config)  # around the feed-forward block
        if cross_attention:
            self.cross_attn = PlugformerCrossAttention(config, layer_idx)
            self.cross_attn_layernorm = norm(config)
        self.placement = NORM_PLACEMENTS.get(config.norm_placement)
        self.hidden_dropout = config.hidden_dropout

    @renamed_cache_kwarg
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        cross_cache: EncoderDecoderCache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # `position_bias` and `encoder_hidden_states` are positional: they need their gradients under reentrant
        # checkpointing.
        def attend(x: torch.Tensor) -> torch.Tensor:
            out, _ = self.self_attn(
                x,
                position_embeddings=position_embeddings,
                position_bias=position_bias,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
            return dropout_if_active(out, self.hidden_dropout, self.training)

        def attend_to_encoder(x: torch.Tensor) -> torch.Tensor:
            out, _ = self.cross_attn(
                x, encoder_hidden_states, attention_mask=encoder_attention_mask, cache=cross_cache, **kwargs
            )
            return dropout_if_active(out, self.hidden_dropout, self.training)

        hidden_states = self.placement.residual(hidden_states, attend, self.input_layernorm)
        if encoder_hidden_states is not None:
            hidden_states = self.placement.residual(hidden_states, attend_to_encoder, self.cross_attn_layernorm)
        return self.placement.residual(
            hidden_states,
            lambda x: dropout_if_active(self.mlp(x), self.hidden_dropout, self.training),
            self.post_attention_layernorm,
        )


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
            inspect.unwrap(forward).__signature__ = inspect.signature(forward)

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
        """transformers' `save_pretrained`, also for a model whose class a wrapper replaced.

        FSDP2's `fully_shard` swaps the class for `FSDP<Name>`, defined in torch's `_fsdp_init`; transformers copies
        the code of `type(model).__module__` and names that class in `auto_map`, so the checkpoint would carry torch's
        files and load nowhere without plugformer. Here the checkpoint is written as plugformer's own class (the full
        `state_dict` gathered first if none is given: a collective, every rank calls it).
        """
        code_class = next(cls for cls in type(self).__mro__ if cls.__module__ == __name__)
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
            return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        if not kwargs.get("is_main_process", True):  # nothing to write; an empty state dict must not overwrite
            return None
        wrapper_class, self.__class__ = self.__class__, code_class
        try:
            return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        finally:
            self.__class__ = wrapper_class

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear / Embedding: normal(initializer_range); norms: ones, zeros
        if isinstance(module, (AttentionScore, PositionScheme)):
            module.reset_parameters(self.config)

    # Capability flags, per config: support depends on the config, not the class (additive scores are no dot product,
    # flash kernels take no score bias), so transformers, which reads these flags off the model instance, gets each
    # config's answer from the kernel table. An additive model says `_supports_sdpa=False` as a model without sdpa
    # does in transformers: no request resolves to eager, an explicit sdpa request (`from_pretrained`,
    # `set_attn_implementation`) raises. Read off the class, the flags are property objects (truthy): the class runs
    # sdpa/flex/flash for some configs. (README, "Conformance".)
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


def position_ids_from_mask(
    attention_mask: torch.Tensor | None, past_length: int | torch.Tensor, query_length: int, device: torch.device
) -> torch.Tensor:
    """Positions of the current tokens: counted over the non-padding tokens of a 2-D mask (so a left-padded row
    starts at 0, as the same text alone would), else `past_length + arange(query_length)`. Shape `(B or 1, Q)`."""
    if attention_mask is not None and attention_mask.ndim == 2:
        positions = attention_mask.long().cumsum(-1) - 1
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
    `position_ids` whenever the keys are exactly these queries (a decoding step, with cached keys, has none).
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
    return None if documents is None else packed_sequence_mask_function(documents)


def refuse_flex_with_static_cache(config: PlugformerConfig, cache: Cache | None) -> None:
    """Fail loudly instead of decoding wrong tokens.

    transformers 5.24's flex block mask captures a static cache's live length tensor as its query offset and
    evaluates it inside the kernel, after layer 0's `cache.update` has advanced it: every chunk after the first is
    masked with the wrong offset (its Llama shows the same). Dynamic caches return plain ints and are unaffected.
    """
    if config._attn_implementation == "flex_attention" and getattr(cache, "is_compileable", False):
        raise ValueError(
            f"attn_implementation='flex_attention' cannot decode with a {type(cache).__name__}: transformers' flex "
            "block mask reads the cache length after it changed and masks wrong positions; use a DynamicCache "
            "(the default) or attn_implementation='sdpa' with the static cache"
        )


def refuse_flex_with_padding(config: PlugformerConfig, attention_mask: torch.Tensor | None) -> None:
    """Before transformers 5.24 (`compat.FLEX_PADDING_VERIFIED`), flex attention with a padding mask is refused:
    5.19's flex block mask masks padded batches wrongly (transformers' own Llama returns NaN there)."""
    if (
        not FLEX_PADDING_VERIFIED
        and config._attn_implementation == "flex_attention"
        and attention_mask is not None
        and attention_mask.ndim == 2
        and not attention_mask.all()
    ):
        raise ValueError(
            f"attn_implementation='flex_attention' with padding (an attention_mask with zeros) computes wrong outputs "
            f"on transformers {transformers.__version__} (verified right from 5.24); use attn_implementation='sdpa' "
            "or 'eager', or transformers>=5.24"
        )


class PlugformerModel(PlugformerPreTrainedModel):
    """The bare transformer stack returning `last_hidden_state` (and the cache).

    By default a decoder (`config.is_causal=True`) or an encoder (`False`); a seq2seq model builds one of each
    from the same config, the decoder with cross-attention and the encoder's embedding.

    Args:
        config ([`PlugformerConfig`]): The configuration.
        is_causal (`bool`, *optional*): Overrides `config.is_causal` for this stack.
        cross_attention (`bool`, *optional*, defaults to `False`): Add encoder-decoder attention to every block.
        num_layers (`int`, *optional*): Number of blocks; defaults to `config.num_hidden_layers`.
        embed_tokens (`nn.Embedding`, *optional*): An embedding shared with another stack.
    """

    def __init__(
        self,
        config: PlugformerConfig,
        is_causal: bool | None = None,
        cross_attention: bool = False,
        num_layers: int | None = None,
        embed_tokens: nn.Embedding | None = None,
    ):
        super().__init__(config)
        self.is_causal = config.is_causal if is_causal is None else is_causal
        self.cross_attention = cross_attention
        self.embed_tokens = embed_tokens or nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.positions = POSITION_SCHEMES.get(config.position_scheme)(config, bidirectional=not self.is_causal)
        self.hidden_dropout = config.hidden_dropout
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

    def _self_attention_mask(self, inputs_embeds, attention_mask, cache, position_ids):
        if not self.is_causal:
            return create_bidirectional_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask
            )
        batch, query_length = inputs_embeds.shape[:2]
        documents = document_mask_function(position_ids, attention_mask, cache, batch, query_length)
        # no `position_ids`: transformers' own packing detection (without mask and cache only) is `documents`' job
        arguments = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                         and_mask_function=documents)  # fmt: skip
        if self.config.is_causal:
            return create_causal_mask(**arguments)
        # A seq2seq decoder shares its encoder's config (is_causal=False), and transformers' causal mask turns
        # bidirectional when config.is_causal is False: pin it for the call.
        self.config.is_causal = True
        try:
            return create_causal_mask(**arguments)
        finally:
            self.config.is_causal = False

    def _position_bias(self, cache: Cache | None, query_length: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The values `(H, Q + K − 1)` of the score bias over the cache slots the kernel will see (same sizes as the
        mask): a `RelativeBias` kept per distance, shared by the layers."""
        if not self.positions.has_bias:
            return None
        if cache is None:
            query_offset, (kv_length, kv_offset) = 0, (query_length, 0)
        else:
            query_offset, (kv_length, kv_offset) = cache.get_query_offset(0), cache.get_mask_sizes(query_length, 0)
        values = self.positions.bias_by_distance(query_offset, query_length, kv_offset, kv_length, device)
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
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`): Token ids.
            attention_mask (`torch.Tensor` of shape `(batch_size, past + sequence_length)`, *optional*): 1 for
                tokens to attend to, 0 for padding.
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
        if validate_inputs:
            check_inputs(
                self, input_ids, inputs_embeds, attention_mask, position_ids, cache, encoder_hidden_states,
                encoder_attention_mask,
            )  # fmt: skip
        if inputs_embeds is None:
            inputs_embeds = embed_ids(
                self.embed_tokens, input_ids, "decoder_input_ids" if self.cross_attention else "input_ids"
            )
        if self.positions.token_scale != 1.0:  # sinusoidal positions (Vaswani's sqrt(d)); no extra op otherwise
            # on both paths, as transformers' Marian decoder does ("in case user passes embeds"): the embeddings of
            # `get_input_embeddings()(ids)` give the same output as the ids, and generate() continued from
            # `inputs_embeds` (embeddings first, then ids) sees one scale throughout
            inputs_embeds = inputs_embeds * self.positions.token_scale
        use_cache = self._use_cache(use_cache)
        if use_cache and cache is None and self.is_causal:  # an encoder has nothing to decode
            cache = self._new_cache()
        refuse_flex_with_static_cache(self.config, cache)
        if not FLEX_PADDING_VERIFIED:  # transformers < 5.24 only: no check on a decoding step otherwise
            refuse_flex_with_padding(self.config, attention_mask)
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        query_length = inputs_embeds.shape[1]
        # from the caller's position_ids (the packing), before they are derived from the mask
        mask = self._self_attention_mask(inputs_embeds, attention_mask, self_cache, position_ids)
        if position_ids is None:
            past_length = self_cache.get_seq_length() if self_cache is not None else 0
            position_ids = position_ids_from_mask(attention_mask, past_length, query_length, inputs_embeds.device)
        encoder_mask = None
        if encoder_hidden_states is not None:
            encoder_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )  # fmt: skip
        position_bias = self._position_bias(self_cache, query_length, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = inputs_embeds
        absolute = self.positions.embed(position_ids, inputs_embeds.dtype)
        if absolute is not None:
            hidden_states = hidden_states + absolute
        hidden_states = dropout_if_active(hidden_states, self.hidden_dropout, self.training)
        rotary = self.positions.rotary(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                position_bias,
                encoder_hidden_states,
                attention_mask=mask,
                encoder_attention_mask=encoder_mask,
                position_ids=position_ids,
                cache=self_cache,
                cross_cache=cache if isinstance(cache, EncoderDecoderCache) else None,
                use_cache=use_cache,
                position_embeddings=rotary,
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.norm(hidden_states), cache=cache)


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
                next-token loss; shifted inside, -100 is ignored.
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
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
        loss = None
        if labels is not None:
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
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=False, **kwargs,
        )  # fmt: skip
        logits = self.head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            check_labels(labels, self.config.vocab_size)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().to(logits.device))
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
        return self.lm_head(hidden_states)


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
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )  # fmt: skip
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
            loss=loss, logits=pooled, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )  # fmt: skip


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
            config, is_causal=True, cross_attention=True, num_layers=config.num_decoder_layers,
            embed_tokens=self.encoder.embed_tokens,
        )  # fmt: skip

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = self.decoder.embed_tokens = value

    def encode_decode(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                      cache, inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs):  # fmt: skip
        """`(encoder_outputs, decoder_outputs)`: the encoder run unless its outputs are given, then the decoder."""
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        elif not isinstance(encoder_outputs, ModelOutput):  # a tuple (last_hidden_state, hidden_states, attentions)
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, attention_mask=decoder_attention_mask, inputs_embeds=decoder_inputs_embeds,
            cache=cache, use_cache=use_cache, encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask, **kwargs,
        )  # fmt: skip
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
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, cache,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs,
        )  # fmt: skip
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
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id, self.decoder_start_token_id)
        encoder_outputs, decoder_outputs = self.encode_decode(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, cache,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(slice_logits_to_keep(decoder_outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().to(logits.device))
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
