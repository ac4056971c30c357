"""One transformer block: self-attention (and a seq2seq decoder's cross-attention) and the feed-forward block, each
wrapped by the configured norm placement."""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention import PlugformerAttention, PlugformerCrossAttention
from .compat import renamed_cache_kwarg
from .configuration import PlugformerConfig, layer_type
from .layers import FEED_FORWARDS, NORM_PLACEMENTS, NORMS
from .linear_attention import LINEAR_ATTENTION, PlugformerGatedDeltaNet


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
        # the token mixer: softmax attention (`self_attn`), or a Gated DeltaNet (`linear_attn`, Qwen3-Next's name)
        if layer_type(config, layer_idx) == LINEAR_ATTENTION:
            self.linear_attn = PlugformerGatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = PlugformerAttention(config, layer_idx, is_causal)
        self.attention_type = self.mixer.layer_type  # transformers' attribute: which mask and bias it takes
        self.mlp = FEED_FORWARDS.get(config.ffn_type)(config)
        norm = NORMS.get(config.norm_type)
        self.input_layernorm = norm(config)  # around attention (before it when pre, after the add when post)
        self.post_attention_layernorm = norm(config)  # around the feed-forward block
        if cross_attention:
            self.cross_attn = PlugformerCrossAttention(config, layer_idx)
            self.cross_attn_layernorm = norm(config)
        self.placement = NORM_PLACEMENTS.get(config.norm_placement)
        # a second norm on each sublayer's output (sandwich): Gemma 2's post_attention_layernorm and
        # post_feedforward_layernorm (plugformer's `post_attention_layernorm` is the one before the feed-forward block)
        outputs = self.placement.output_norm
        self.post_self_attn_layernorm = norm(config) if outputs else None
        self.post_cross_attn_layernorm = norm(config) if outputs and cross_attention else None
        self.post_feedforward_layernorm = norm(config) if outputs else None
        self.hidden_dropout = config.hidden_dropout

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: `self_attn` or, in a `"linear_attention"` layer, `linear_attn`."""
        return self._modules.get("self_attn") or self._modules["linear_attn"]

    def attention_values(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The values `(B, H_kv, T, D)` this block's self-attention projects from the block input `hidden_states`
        (`value_residual`: the stack takes the first block's for every later one)."""
        return self.self_attn.project_value(self.placement.sublayer_input(hidden_states, self.input_layernorm))

    @renamed_cache_kwarg
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_bias: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        first_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        cross_cache: EncoderDecoderCache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        # `position_bias`, `encoder_hidden_states` and `first_values` are positional: they need their gradients under
        # reentrant checkpointing.
        dropout = self.hidden_dropout if self.training else 0.0  # 0: no dropout call per sublayer (`dropout_if_active`)

        def attend(x: torch.Tensor) -> torch.Tensor:
            out, _ = self.mixer(
                x,
                position_embeddings=position_embeddings,
                position_bias=position_bias,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                first_values=first_values,
                **kwargs,
            )
            return dropout_if_active(out, dropout, True) if dropout else out

        def attend_to_encoder(x: torch.Tensor) -> torch.Tensor:
            out, _ = self.cross_attn(
                x, encoder_hidden_states, attention_mask=encoder_attention_mask, cache=cross_cache, **kwargs
            )
            return dropout_if_active(out, dropout, True) if dropout else out

        placement = self.placement
        hidden_states = placement.residual(hidden_states, attend, self.input_layernorm, self.post_self_attn_layernorm)
        if encoder_hidden_states is not None:
            hidden_states = placement.residual(
                hidden_states, attend_to_encoder, self.cross_attn_layernorm, self.post_cross_attn_layernorm
            )
        mlp = self.mlp
        feed_forward = (lambda x: dropout_if_active(mlp(x), dropout, True)) if dropout else mlp
        return placement.residual(
            hidden_states, feed_forward, self.post_attention_layernorm, self.post_feedforward_layernorm
        )
