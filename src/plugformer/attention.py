"""Self- and cross-attention of a plugformer block: the projections, then the plugged-in parts in a fixed order.

    project (-> QK-norm) -> rotate (the position scheme's `rotary`) -> score `prepare_query`/`prepare_key` -> cache
    update -> score `prepare_value` -> kernel (+ the position bias) -> score `prepare_output` (-> exclusive
    self-attention) -> merge heads (-> output gate) -> o_proj

The projections are the `attention_projection`'s (`projections`): it builds them, rotates, and orders the cache
update around `prepare_key` (a latent cache is updated before the keys are expanded from it).

The cache holds keys exactly as the kernel consumes them, so cached decoding equals the full forward; it holds the
projected values, which `prepare_value` (a function of each key slot's own values) turns into the kernel's. The kernel is
looked up in plugformer's own `AttentionInterface` (`capabilities`) and checked against the kernel table.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache

from .capabilities import ALL_ATTENTION_FUNCTIONS, KERNELS, KernelSpec
from .compat import TENSOR_PARALLEL_VERIFIED, renamed_cache_kwarg
from .configuration import VARIANT_REGISTRIES, PlugformerConfig, layer_type
from .kernels import repeat_kv
from .layers import VALUE_RESIDUALS, RMSNorm
from .positions import POSITION_SCHEMES, TokenStates
from .projections import ATTENTION_PROJECTIONS
from .scores import ATTENTION_SCORES


def exclude_own_values(
    output: torch.Tensor, own_values: torch.Tensor, groups: int, batch: int, length: int
) -> torch.Tensor:
    """Exclusive self-attention (Zhai 2026, "Exclusive Self Attention"): z_i = y_i − (y_i·v̂_i) v̂_i with v̂_i =
    v_i / ‖v_i‖, each head's output less its component along the token's own value, which equals
    y_i − (y_i·v_i / ‖v_i‖²) v_i; a zero v_i leaves y_i as it is (`F.normalize`'s eps), and the projection is computed
    in fp32 at least.

    `output`: the heads after the score's `prepare_output`, `(B, Q, H_out, D)` (vLLM's kernel: `(B·Q, H·D)`);
    `own_values`: the queries' own values as the kernel read them, `(B, H_kv, Q, D)`, query head h reading key/value
    head h // `groups` (`kernels.repeat_kv`'s order). Output head j is taken to hold query head j's output: all of
    them where `prepare_output` is the identity; differential attention's head j pairs query heads j and j + H/2, which
    read the same value. Returns `(B, Q, H_out, D)`.
    """
    dtype = torch.promote_types(output.dtype, torch.float32)
    heads = output.reshape(batch, length, -1, own_values.shape[-1]).to(dtype)  # (B, Q, H_out, D)
    per_query_head = repeat_kv(own_values, groups)[:, : heads.shape[2]]  # (B, H_out, Q, D): each head's own value
    unit = nn.functional.normalize(per_query_head.transpose(1, 2).to(dtype), dim=-1)  # (B, Q, H_out, D)
    return (heads - (heads * unit).sum(-1, keepdim=True) * unit).to(output.dtype)


def check_tensor_parallel(config: PlugformerConfig) -> None:
    """Raises a `ValueError` if tensor parallelism (`from_pretrained(tp_plan=...)`, which sets
    `config.distributed_config.tp_size`) cannot compute `config`'s attention exactly: a score or position scheme that
    declares `tensor_parallel = False`, key/value heads the ranks cannot share out whole, or a transformers release
    whose plans are not verified (`compat.TENSOR_PARALLEL_VERIFIED`)."""
    tp_size = getattr(getattr(config, "distributed_config", None), "tp_size", 1)
    for registry in VARIANT_REGISTRIES:
        name = getattr(config, registry.axis)
        if tp_size > 1 and not registry.get(name).tensor_parallel:
            raise ValueError(
                f"{registry.axis}={name!r} cannot run with tensor parallelism (tp_size={tp_size}): its parameters are "
                "not sharded per head (or it combines heads that other ranks hold), so each rank would compute or "
                "train with the wrong heads' share; train it without tp_plan"
            )
    if tp_size > 1 and config.value_residual and not VALUE_RESIDUALS.get(config.value_residual).tensor_parallel:
        raise ValueError(
            f"value_residual={config.value_residual!r} cannot train with tensor parallelism (tp_size={tp_size}): its "
            "lambdas are not sharded, and each rank's gradient would cover its own heads only; use 'fixed' or train "
            "it without tp_plan"
        )
    if tp_size > 1 and config.use_attention_sinks:
        # the sinks (one logit per query head) are not in the tensor-parallel plan: each rank would hold every head's
        # sink beside its share of the heads, and the first forward failed with a shape error
        raise ValueError(
            f"use_attention_sinks=True cannot run with tensor parallelism (tp_size={tp_size}): the sinks, one per "
            "query head, are not sharded with the heads; load the model without tp_plan"
        )
    if config.num_key_value_heads % tp_size:
        # Tensor parallelism gives each rank whole heads (`base_model_tp_plan`); a key/value head split over ranks would
        # leave each a fraction of d_k (transformers' Llama fails there with a shape error). Replicating the heads
        # instead would change the group arithmetic of every kernel and the cache layout. The query heads, a
        # multiple of the key/value heads, split whenever these do.
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} cannot be split over tp_size={tp_size} tensor-"
            f"parallel ranks: each rank must hold whole key/value heads; use a tp_size that divides "
            f"{config.num_key_value_heads}, or a model with more key/value heads"
        )
    if tp_size > 1 and not TENSOR_PARALLEL_VERIFIED:  # after the variants' own refusals, which hold on any release
        raise ValueError(
            f"tensor parallelism (tp_size={tp_size}) needs transformers>=5.24 with plugformer (installed: "
            f"{transformers.__version__}): on 5.19 its plans shard plugformer's models wrongly (compat.py); "
            "use tp_size=1 or upgrade transformers"
        )


class PlugformerAttention(nn.Module):
    """Multi-head self-attention with GQA/MQA; the score function and the kernel are plugged in.

    Order (fixed): project -> rotate (RoPE) -> score `prepare_query`/`prepare_key` -> cache update -> score
    `prepare_value` -> kernel (+ position bias) -> score `prepare_output` (-> exclusive self-attention) -> o_proj.
    """

    takes_positions = True  # whether a `per_layer` position scheme computes its bias here (not in cross-attention)

    def __init__(self, config: PlugformerConfig, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        # Gemma 2's logit cap, read once here as transformers' Gemma 2 reads it (a config read is a share of a small
        # model's decoding step); the kernel table refuses the kernels that cannot apply it
        self.attn_logit_softcapping = config.attn_logit_softcapping
        self.is_causal = is_causal
        check_tensor_parallel(config)
        # gated attention (`use_gated_attention`, Qwen3-Next): the standard q_proj also yields each head's output gate
        self.gated = config.use_gated_attention
        # exclusive self-attention (`exclusive_self_attention`): each output less its own value's component (`forward`;
        # cross-attention's keys are other tokens', and its own forward has no such step)
        self.exclusive = config.exclusive_self_attention
        # q_proj, k_proj, v_proj, o_proj, or multi-head latent attention's modules (`attention_projection`)
        self.projection = ATTENTION_PROJECTIONS.get(config.attention_projection)
        self.projection.build(self, config)
        self.scaling_factor = self.projection.scaling_factor(config)
        # QK-norm (`use_qk_norm`): Qwen3's RMSNorm over each head's d_k, one gain shared by the heads, on the projected
        # queries and keys before RoPE (transformers' modeling_qwen3.py, `q_norm`/`k_norm`); any score follows it
        self.q_norm = RMSNorm(config, self.head_dim) if config.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(config, self.head_dim) if config.use_qk_norm else nn.Identity()
        self.uses_qk_norm = config.use_qk_norm  # without it, `qk_norm` skips the Identity's module call per step
        # gpt-oss's attention sinks (`use_attention_sinks`): one learned logit per query head (`sinks`, its name)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads)) if config.use_attention_sinks else None
        self.score = ATTENTION_SCORES.get(config.attention_score)(config, layer_idx)
        # The score's softmax scale, fixed by the config, passed as `scaling=self.scaling`: vLLM's transformers backend
        # reads the scale off the module from that expression in `forward`'s source (a literal or `self.<attr>` only).
        # An attribute, not a property: two calls per layer fewer in a small model's decoding step.
        self.scaling = self.score.scaling * self.scaling_factor
        # the score hooks this score overrides (`AttentionScore.hooks`): the others, the identity, are not called
        self.score_hooks = self.score.hooks()
        # value residual learning (`value_residual`): every layer after the first mixes in the first layer's values
        mixes = config.value_residual is not None and layer_idx > 0
        self.value_residual = VALUE_RESIDUALS.get(config.value_residual)(config) if mixes else None
        # the kind of bias object the kernels get (`biases`): a `RelativeBias` per distance, FIRE's per query position
        scheme = POSITION_SCHEMES.get(config.position_scheme)
        self.bias_type = scheme.bias_type
        # a bias constant beyond a distance (T5 buckets, clamped distances) or linear in it (ALiBi) says so: sdpa
        # exploits it (`kernels_banded`, `kernels_alibi`)
        distance = scheme.constant_bias_distance(config)
        self.bias_options = {} if distance is None else {"constant_beyond": distance}
        if scheme.linear_bias_slopes(config) is not None:
            self.bias_options["linear"] = True
        # a scheme each layer computes from its own input (`per_layer`: forgetting attention) adds its modules here
        self.layer_positions = scheme if scheme.per_layer and self.takes_positions else None
        if self.layer_positions is not None:
            scheme.build_layer(self, config)
        # `no_rope_layers` (SmolLM3's field): 0 makes this a NoPE layer, which skips the rotation
        self.use_rope = bool(config.no_rope_layers[layer_idx]) if config.no_rope_layers is not None else True
        self._kernel, self._checked_implementation = None, None  # the record of the kernel last checked
        # `sliding_window`, in the layers `layer_types` marks sliding: eager, sdpa and flex get it through the mask;
        # transformers' flash kernels as an argument (as Mistral and Qwen3 pass it), a window of `sliding_window − 1`
        # keys on each side of the query. transformers' bidirectional sliding mask lets a query see keys up to
        # `sliding_window` away: one more for an encoder.
        self.layer_type = layer_type(config, layer_idx)
        window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.window_kwargs = {} if window is None else {"sliding_window": window + (0 if is_causal else 1)}

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        return projected.view(*projected.shape[:-1], -1, self.head_dim).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)

    def project_value(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.split_heads(self.v_proj(hidden_states))  # (B, T, H_kv·D) -> (B, H_kv, T, D)

    def project_query(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries `(B, H, T, D)` (QK-normed) and, with `use_gated_attention`, the output gate's logits
        `(B, T, H·D)`: transformers' `qwen3_next` lays `q_proj`'s output out per head, its D query columns then its D
        gate columns (so a column-parallel q_proj leaves each rank its heads' queries and gates)."""
        projected = self.q_proj(hidden_states)
        gate = None
        if self.gated:
            per_head = projected.view(*projected.shape[:-1], -1, 2 * self.head_dim)  # (B, T, H, 2·D)
            query, gate = per_head.chunk(2, dim=-1)  # (B, T, H, D) each
            projected, gate = query.flatten(-2), gate.flatten(-2)  # (B, T, H·D) each
        query = self.split_heads(projected)
        return (self.q_norm(query) if self.uses_qk_norm else query), gate

    def qk_norm(self, norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """`norm` (`q_norm` or `k_norm`) applied to `(B, H, T, D)` heads with `use_qk_norm`, else the heads."""
        return norm(heads) if self.uses_qk_norm else heads

    def output(
        self,
        attn_output: torch.Tensor,
        query: torch.Tensor,
        gate: torch.Tensor | None,
        score: nn.Module | None = None,
        own_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The kernel's output through the score's `prepare_output` (`score`: `self.score`, looked up by the caller),
        less each head's component along the queries' `own_values` (B, H_kv, Q, D) with exclusive self-attention
        (`exclude_own_values`), merged to `(B, Q, H·D)`, gated (Qwen3-Next's `output · sigmoid(gate)`), then
        `o_proj`."""
        score = self.score if score is None else score
        if "prepare_output" in self.score_hooks:
            attn_output = score.prepare_output(attn_output)
        if own_values is not None:  # after a normalising `prepare_output` (differential's): no rounding amplified
            groups = self.num_key_value_groups
            attn_output = exclude_own_values(attn_output, own_values, groups, query.shape[0], query.shape[2])
        # transformers' kernels return (B, Q, H, D), vLLM's (B·Q tokens, H·D)
        merged = attn_output.reshape(query.shape[0], query.shape[2], -1).contiguous()  # (B, Q, H·D)
        if gate is not None:
            merged = merged * torch.sigmoid(gate)
        return self.o_proj(merged)

    def checked_kernel(self) -> KernelSpec:
        """The record of the config's kernel (`KERNELS.of`), refused by the kernel table if it cannot compute this
        attention (one set by hand on the config, or by an engine such as vLLM, skips `from_pretrained`'s check);
        checked once per implementation. While torch.compile / torch.export trace, nothing is checked or recorded."""
        kernel = KERNELS.of(self.config)
        if self._kernel is not None and kernel.name == self._checked_implementation:
            return self._kernel
        if not torch.compiler.is_compiling():
            kernel.check(self.config)
            self._kernel, self._checked_implementation = kernel, kernel.name
        return kernel

    def kernel_kwargs(self, kernel: KernelSpec, score: nn.Module, query, key, position_bias, kwargs) -> dict:
        """The kernel's keyword arguments besides `scaling`: dropout, the position bias in the form `kernel`'s record
        takes (`KernelSpec.position_bias`), `score`'s own (e.g. the additive energy vector) and the caller's."""
        if position_bias is not None:
            # The layers get the bias values as a plain tensor: (reentrant) gradient checkpointing sees it as an input.
            bias = self.bias_type(position_bias, query.shape[2], key.shape[2], **self.bias_options)
            position_bias = kernel.position_bias(bias, batch=query.shape[0])
        softcap = self.attn_logit_softcapping
        return {
            "dropout": self.attention_dropout if self.training else 0.0,
            "position_bias": position_bias,
            **({} if softcap is None else {"softcap": softcap}),
            **({} if self.sinks is None else {"s_aux": self.sinks}),
            **(score.kernel_kwargs() if "kernel_kwargs" in self.score_hooks else {}),
            **self.window_kwargs,
            # sdpa obeys an `is_causal` kwarg over the module's flag, and transformers' generic code passes
            # config.is_causal; each attention's direction is fixed when built (a seq2seq encoder and its
            # cross-attention share the decoder's config).
            **kwargs,
            "is_causal": self.is_causal,
        }

    @renamed_cache_kwarg
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        first_values: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rotary = position_embeddings if self.use_rope else None
        score = self.score  # looked up once for its hooks below: a module attribute costs a share of a decoding step
        # queries (B, H, T, D), the key and value states to cache, the output gate (B, T, H·D) or None
        query, key, value, gate = self.projection.project(self, hidden_states, rotary)
        if self.value_residual is not None:  # mixed per token, before the cache: it holds the values attended with
            value = self.value_residual(value, first_values)
        hooks = self.score_hooks  # the score's hooks that are not the identity
        if "prepare_query" in hooks:
            query = score.prepare_query(query)
        # the current tokens' own values (B, H_kv, Q, D), from this forward's states: the cache's layout plays no part
        own_values = self.projection.token_values(self, key, value) if self.exclusive else None
        states = None
        if self.layer_positions is not None:  # its per-token states, from this layer's input, cached beside the values
            states = TokenStates(self.layer_positions.token_states(self, hidden_states), cache, self.layer_idx)
        key, value = self.projection.keys_and_values(self, key, value, cache if states is None else states)
        if states is not None:  # (B, H_kv, K, D) and the states (B, H, K) of every key slot: this layer's bias values
            position_bias = self.layer_positions.layer_bias(states.states, states.query_start, query.shape[2])
        if "prepare_value" in hooks:  # a function of each slot's own values: the same for the current tokens'
            value = score.prepare_value(value)  # (B, H_kv, K, value_width·D)
            own_values = None if own_values is None else score.prepare_value(own_values)
        head_axis = self.bias_type.head_axis
        if position_bias is not None and position_bias.shape[head_axis] != query.shape[1]:
            # Tensor parallelism, a bias computed for all H heads (ALiBi's slopes are a buffer no plan splits): this
            # rank holds the query heads [rank·H_local, (rank + 1)·H_local) that the column-parallel q_proj left it.
            local_heads = query.shape[1]
            first = self.q_proj.weight.device_mesh.get_local_rank() * local_heads
            position_bias = position_bias.narrow(head_axis, first, local_heads)  # H -> H_local heads
        # plugformer's own `AttentionInterface` (`capabilities`); transformers' `set_attn_implementation` and vLLM's
        # transformers backend look for this very lookup, and one call of it with `scaling=self.<attr>`, in `forward`
        kernel = self.checked_kernel()
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(kernel.name, score.eager_kernel)
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            **self.kernel_kwargs(kernel, score, query, key, position_bias, kwargs),
        )
        return self.output(attn_output, query, gate, score, own_values), attn_weights


class PlugformerCrossAttention(PlugformerAttention):
    """Encoder-decoder attention: queries from the decoder, keys and values from the encoder output, scored by the
    configured score function (additive = Bahdanau's setup). No position scheme applies (as in T5 and Bart). The
    encoder's keys and values are computed once and kept in the cross-attention half of an `EncoderDecoderCache`.
    """

    takes_positions = False

    def __init__(self, config: PlugformerConfig, layer_idx: int):
        super().__init__(config, layer_idx, is_causal=False)
        self.layer_type, self.window_kwargs = "full_attention", {}  # every encoder key (the window is self-attention's)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, gate = self.project_query(hidden_states)  # (B, H, T, D), gate (B, T, H·D) or None
        query = self.score.prepare_query(query)  # (B, H, T, ·)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            key, value = layer.keys, layer.values
        else:
            key = self.qk_norm(self.k_norm, self.split_heads(self.k_proj(encoder_hidden_states)))  # (B, H_kv, S, D)
            key = self.score.prepare_key(key)  # (B, H_kv, S, ·)
            value = self.project_value(encoder_hidden_states)  # (B, H_kv, S, D)
            if cache is not None:
                key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        value = self.score.prepare_value(value)  # (B, H_kv, S, value_width·D)
        kernel = self.checked_kernel()
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(kernel.name, self.score.eager_kernel)
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            **self.kernel_kwargs(kernel, self.score, query, key, None, kwargs),
        )
        return self.output(attn_output, query, gate, self.score), attn_weights
