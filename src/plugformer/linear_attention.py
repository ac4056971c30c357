"""Linear attention layers (`layer_types` entry `"linear_attention"`): the Gated DeltaNet of Qwen3-Next.

Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule") keeps,
per value head, a fast-weight state S (d_v × d_k) in place of the growing key/value cache. Token t decays it by
α_t = exp(g_t) and writes its value at its key with the delta rule's step β_t:

    S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,        o_t = S_t q_t

with q and k L2-normalised per head and q scaled by 1/sqrt(d_k). Module names, parameter layout and numerics follow
transformers' `Qwen3NextGatedDeltaNet` (`models/qwen3_next/modeling_qwen3_next.py`), so Qwen3-Next checkpoints load
as they are: `in_proj_qkvz` and `in_proj_ba` project the block input, a causal depthwise `conv1d` (kernel
`linear_conv_kernel_dim`, then `hidden_act`) mixes the last few tokens' q, k, v channels, `A_log` and `dt_bias` give
the decay g_t = −exp(A_log) · softplus(a_t + dt_bias), β_t = sigmoid(b_t), and the output passes a gated RMSNorm
(`norm`, gate silu(z)) and `out_proj`.

The state and the convolution's last inputs live in transformers' linear-attention cache layers, which
`DynamicCache(config=...)` builds for these layers from `config.layer_types` (`cache_utils.LinearAttentionLayer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
from transformers.utils.import_utils import is_tracing

from .positions import POSITION_SCHEMES
from .registry import positive


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


LINEAR_ATTENTION = "linear_attention"  # the `layer_types` entry of these layers (transformers' name)
CHUNK_SIZE = 64  # tokens per block of the chunked delta rule (flash-linear-attention's and transformers' choice)
L2_EPS = 1e-6  # inside the square root of the q, k L2 norm, as flash-linear-attention's `l2norm` and Qwen3-Next


# the layers' config fields (transformers' Qwen3-Next names), None until `complete_linear_attention` fills them in
LINEAR_ATTENTION_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                           "linear_num_key_heads", "linear_num_value_heads")  # fmt: skip


def complete_linear_attention(config: PlugformerConfig) -> None:
    """Checks the `linear_*` fields and refuses what `"linear_attention"` layers cannot compute, naming the field
    (`ValueError`); fills in the fields' defaults where such layers exist. Without them the fields must stay None
    (they would be ignored). Called by `PlugformerConfig.__post_init__`."""
    set_fields = [name for name in LINEAR_ATTENTION_FIELDS if getattr(config, name) is not None]
    if LINEAR_ATTENTION not in config.layer_types:
        if set_fields:
            raise ValueError(
                f"{set_fields[0]}={getattr(config, set_fields[0])!r} configures 'linear_attention' "
                f"layers, but layer_types={config.layer_types!r} has none: add some or leave it None"
            )
        return
    if config.is_encoder_decoder or not config.is_causal:
        field = "is_encoder_decoder=True" if config.is_encoder_decoder else "is_causal=False"
        raise ValueError(
            f"layer_types has 'linear_attention' layers, whose recurrent state reads each token's past "
            f"only, but {field}: use them in a causal single-stack model"
        )
    if config.value_residual is not None:
        raise ValueError(
            f"value_residual={config.value_residual!r} mixes the first layer's attention values into "
            "the others, which 'linear_attention' layers (in layer_types) have not: set it to None"
        )
    if POSITION_SCHEMES.get(config.position_scheme).has_bias:  # (a `per_layer` scheme's too)
        unbiased = [name for name in POSITION_SCHEMES if not POSITION_SCHEMES.get(name).has_bias]
        raise ValueError(
            f"position_scheme={config.position_scheme!r} adds a score bias, which the "
            f"'linear_attention' layers in layer_types have no scores to take: use one of {unbiased}"
        )
    positive(config, *LINEAR_ATTENTION_FIELDS)
    defaults = (4, config.head_dim, config.head_dim, config.num_key_value_heads, config.num_attention_heads)
    for name, value in zip(LINEAR_ATTENTION_FIELDS, defaults, strict=True):
        if getattr(config, name) is None:
            setattr(config, name, value)
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_key_heads={config.linear_num_key_heads} must divide linear_num_value_heads="
            f"{config.linear_num_value_heads} (each key head serves a whole group of value heads)"
        )


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(‖x‖² + eps) over the last dimension (flash-linear-attention's form, which Qwen3-Next applies)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def chunked_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence, one block of `chunk_size` tokens at a time (the paper's chunkwise form).

    With the state transposed, M = Sᵀ (d_k × d_v), a token's update reads M_t = α_t M_{t-1} + k_t u_tᵀ with the
    correction u_t = β_t (v_t − α_t M_{t-1}ᵀ k_t). Inside a block that starts from M_0, with γ_t the product of the
    block's α up to t, the corrections solve a unit lower-triangular system,

        (I + A) U = β ⊙ V − (β γ ⊙ K) M_0,      A[t, s] = β_t (γ_t / γ_s) k_t·k_s for s < t,

    and then O = (γ ⊙ Q) M_0 + (Q Kᵀ ⊙ D) U with D[t, s] = γ_t / γ_s for s ≤ t, and the block hands on
    M_C = γ_C M_0 + ((γ_C / γ) ⊙ K)ᵀ U. Computed in float32 at least.

    Args:
        query (`torch.Tensor` of shape `(batch_size, num_heads, seq_len, k_head_dim)`): Queries, L2-normalised and
            scaled.
        key (`torch.Tensor` of shape `(batch_size, num_heads, seq_len, k_head_dim)`): Keys, L2-normalised.
        value (`torch.Tensor` of shape `(batch_size, num_heads, seq_len, v_head_dim)`): Values.
        log_decay (`torch.Tensor` of shape `(batch_size, num_heads, seq_len)`): g_t = log α_t ≤ 0.
        beta (`torch.Tensor` of shape `(batch_size, num_heads, seq_len)`): The write strength β_t in [0, 1].
        initial_state (`torch.Tensor` of shape `(batch_size, num_heads, k_head_dim, v_head_dim)`, *optional*): M
            before the first token; zeros by default.
        chunk_size (`int`, *optional*, defaults to 64): Tokens per block (fewer when the sequence is shorter).

    Returns:
        `tuple(torch.Tensor, torch.Tensor)`: the outputs `(batch_size, num_heads, seq_len, v_head_dim)` in the dtype
        of `value`, and the final state M `(batch_size, num_heads, k_head_dim, v_head_dim)` in float32 at least.
    """
    dtype = torch.promote_types(value.dtype, torch.float32)
    batch, heads, length, k_dim = key.shape
    v_dim = value.shape[-1]
    chunk = min(chunk_size, length)
    pad = -length % chunk  # padded tokens: zero keys and β = 0 write nothing, g = 0 decays nothing
    q, k, v = (F.pad(x.to(dtype), (0, 0, 0, pad)) for x in (query, key, value))
    g, b = (F.pad(x.to(dtype), (0, pad)) for x in (log_decay, beta))
    blocks = (length + pad) // chunk
    q, k, v = (x.reshape(batch, heads, blocks, chunk, -1) for x in (q, k, v))  # (B, H, N, C, D)
    g, b = (x.reshape(batch, heads, blocks, chunk) for x in (g, b))  # (B, H, N, C)

    log_gamma = g.cumsum(-1)  # (B, H, N, C): log γ_t within each block
    # log(γ_t / γ_s) for s ≤ t; above the diagonal -inf, so exp gives 0 (and never overflows)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = (log_gamma[..., :, None] - log_gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (B,H,N,C,C)
    beta_k = k * b[..., None]  # (B, H, N, C, Dk)
    system = (beta_k @ k.transpose(-1, -2)) * ratio.tril(-1)  # A: (B, H, N, C, C), strictly lower
    identity = torch.eye(chunk, dtype=dtype, device=q.device)
    # (I + A)⁻¹ applied to β V and to β γ K: the block's corrections are then fixed up for M_0 by one product
    solved_v = torch.linalg.solve_triangular(system + identity, v * b[..., None], upper=False, unitriangular=True)
    solved_k = torch.linalg.solve_triangular(
        system + identity, beta_k * log_gamma.exp()[..., None], upper=False, unitriangular=True
    )  # (B, H, N, C, Dk)
    scores = (q @ k.transpose(-1, -2)) * ratio  # (B, H, N, C, C): Q Kᵀ ⊙ D
    q_decayed = q * log_gamma.exp()[..., None]  # γ ⊙ Q
    k_to_end = k * (log_gamma[..., -1:] - log_gamma).exp()[..., None]  # (γ_C / γ) ⊙ K
    block_decay = log_gamma[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1): γ_C

    state = torch.zeros(batch, heads, k_dim, v_dim, dtype=dtype, device=q.device)
    if initial_state is not None:
        state = initial_state.to(dtype)
    outputs = []
    for n in range(blocks):
        corrections = solved_v[:, :, n] - solved_k[:, :, n] @ state  # U: (B, H, C, Dv)
        outputs.append(q_decayed[:, :, n] @ state + scores[:, :, n] @ corrections)  # (B, H, C, Dv)
        state = block_decay[:, :, n] * state + k_to_end[:, :, n].transpose(-1, -2) @ corrections  # (B, H, Dk, Dv)
    output = torch.cat(outputs, dim=2)[:, :, :length]  # (B, H, T, Dv)
    return output.to(value.dtype), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu of its gate z: w · x / rms(x) · silu(z) (Qwen3-Next's
    `Qwen3NextRMSNormGated`; its gain starts at 1, unlike Qwen3-Next's zero-centred block norms)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        normed = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        gated = (self.weight * normed.to(input_dtype)) * F.silu(gate.float())
        return gated.to(input_dtype)


def padding_mask(attention_mask: torch.Tensor | None, query_length: int) -> torch.Tensor | None:
    """The `(B, T)` padding mask of the current tokens for a linear-attention layer, or `None` when nothing is padded:
    a decoding step (a generated token is never a pad) or a mask of ones (as transformers'
    `create_recurrent_attention_mask`)."""
    if attention_mask is None or attention_mask.ndim != 2 or query_length == 1:
        return None
    if not is_tracing(attention_mask) and bool(attention_mask.all()):
        return None
    return attention_mask[:, -query_length:]


def refuse_packed_documents(position_ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Raises a `ValueError` if `position_ids` restart inside a row's tokens (packed documents): the recurrent state
    would carry one document into the next, which the attention layers' document masks prevent."""
    if position_ids is None or position_ids.shape[-1] < 2 or is_tracing(position_ids):
        return
    steps = position_ids[:, 1:] - position_ids[:, :-1]  # (B or 1, T − 1)
    restarts = steps != 1
    if mask is not None:  # pads take any position (generate() gives them 1): only steps between real tokens count
        restarts = restarts & mask[:, 1:].bool() & mask[:, :-1].bool()
    if bool(restarts.any()):
        raise ValueError(
            "layer_types has 'linear_attention' layers, whose recurrent state would run from one packed document "
            "into the next (position_ids restart inside a row); pass one document per row, padded"
        )


class PlugformerGatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Yang et al. 2024) in transformers' Qwen3-Next layout: `in_proj_qkvz`,
    `in_proj_ba`, `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`.

    Args:
        config ([`PlugformerConfig`]): Reads `hidden_size`, `linear_num_key_heads`, `linear_num_value_heads`,
            `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`, `hidden_act` (after the
            convolution) and `rms_norm_eps` (the gated norm).
        layer_idx (`int`): Index of the layer, its slot in the cache.
    """

    layer_type = LINEAR_ATTENTION

    def __init__(self, config: PlugformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_head_dim, self.v_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.k_head_dim
        self.value_dim = self.num_v_heads * self.v_head_dim
        self.heads_per_key = self.num_v_heads // self.num_k_heads  # value heads sharing one query/key head
        tp_size = getattr(getattr(config, "distributed_config", None), "tp_size", 1)
        if tp_size > 1:  # no plan shards these modules: every rank would hold and train all of them
            raise ValueError(
                f"layer_types has 'linear_attention' layers, which cannot run with tensor parallelism "
                f"(tp_size={tp_size}): load the model without tp_plan"
            )
        hidden = config.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        conv_channels = 2 * self.key_dim + self.value_dim  # q, k, v
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_channels, conv_channels, self.conv_kernel_size, groups=conv_channels, bias=False)
        self.act = ACT2FN[config.hidden_act]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """dt_bias = 1 and A drawn from U(0.01, 16), as transformers' Qwen3-Next initialises them (through
        `transformers.initialization`, which leaves weights `from_pretrained` loaded as they are)."""
        init.ones_(self.dt_bias)
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def split_projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k `(B, T, H_k·D_k)`, v, z `(B, T, H_v·D_v)`, b, a `(B, T, H_v)` from the two input projections, laid out
        per key head as Qwen3-Next's: `[q, k, v…, z…]` and `[b…, a…]`, each with its `heads_per_key` value heads."""
        batch, length = hidden_states.shape[:2]
        per_value = self.heads_per_key * self.v_head_dim
        qkvz = self.in_proj_qkvz(hidden_states).view(batch, length, self.num_k_heads, -1)  # (B, T, H_k, ·)
        q, k, v, z = qkvz.split([self.k_head_dim, self.k_head_dim, per_value, per_value], dim=-1)
        ba = self.in_proj_ba(hidden_states).view(batch, length, self.num_k_heads, -1)  # (B, T, H_k, 2·H_v/H_k)
        b, a = ba.split([self.heads_per_key, self.heads_per_key], dim=-1)
        q, k, v, z, b, a = (x.reshape(batch, length, -1) for x in (q, k, v, z, b, a))
        return q, k, v, z, b, a

    def convolve(self, mixed: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """The causal depthwise convolution of `mixed` `(B, C, T)` and `hidden_act`; the cache keeps the last
        `linear_conv_kernel_dim` inputs, which lead the next call's. Returns `(B, C, T)`."""
        length = mixed.shape[-1]
        if cache is not None:  # the cached inputs, then these (padded with zeros to the kernel at the first call)
            mixed = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        padded = F.pad(mixed, (self.conv_kernel_size - 1, 0))  # zeros before the first token
        return self.act(self.conv1d(padded)[..., -length:])

    def cached_state(self, cache: Cache | None) -> torch.Tensor | None:
        """The recurrent state `cache` holds for this layer (`None`: no cache, or nothing cached yet); refused for a
        cache without a linear-attention layer here, e.g. `DynamicCache()` built without the config."""
        if cache is None:
            return None
        layers = getattr(cache, "layers", [])
        if self.layer_idx >= len(layers) or not isinstance(layers[self.layer_idx], LinearAttentionCacheLayerMixin):
            raise ValueError(
                f"cache has no linear-attention layer at index {self.layer_idx}, which layer_types makes "
                "'linear_attention': build it with DynamicCache(config=model.config) (or StaticCache)"
            )
        return cache.get_recurrent_state(self.layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """Mixes the tokens of `hidden_states` `(B, T, hidden)`, continuing the state in `cache` if any.

        `attention_mask` is the `(B, T)` padding mask of these tokens or `None` (`padding_mask`): a pad's input is
        zeroed, as Qwen3-Next does, and also writes nothing and decays nothing (β = 0, g = 0), so the state after a
        pad is the state before it. Returns the output `(B, T, hidden)` and `None` (no attention weights)."""
        refuse_packed_documents(position_ids, attention_mask)
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
        batch, length = hidden_states.shape[:2]
        state = self.cached_state(cache)
        q, k, v, z, b, a = self.split_projections(hidden_states)
        mixed = self.convolve(torch.cat([q, k, v], dim=-1).transpose(1, 2), cache)  # (B, C, T)
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (x.view(batch, length, self.num_k_heads, self.k_head_dim).transpose(1, 2) for x in (q, k))  # (B,Hk,T,Dk)
        q, k = (x.repeat_interleave(self.heads_per_key, dim=1) for x in (q, k))  # (B, H_v, T, D_k): the value heads'
        v = v.view(batch, length, self.num_v_heads, self.v_head_dim).transpose(1, 2)  # (B, H_v, T, D_v)
        dtype = torch.promote_types(q.dtype, torch.float32)
        q = l2_normalize(q.to(dtype)) * self.k_head_dim**-0.5
        k = l2_normalize(k.to(dtype))
        beta = b.sigmoid()  # (B, T, H_v)
        log_decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, H_v); float: A finite
        if attention_mask is not None:  # differs from Qwen3-Next, which leaks a pad's decay into the state
            real = attention_mask[..., None].bool()  # (B, T, 1)
            beta, log_decay = beta * real, log_decay * real
        output, state = chunked_gated_delta_rule(
            q, k, v, log_decay.transpose(1, 2), beta.transpose(1, 2), initial_state=state
        )  # (B, H_v, T, D_v)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        output = self.norm(output.transpose(1, 2), z.view(batch, length, self.num_v_heads, self.v_head_dim))
        return self.out_proj(output.reshape(batch, length, self.value_dim)), None  # (B, T, H_v·D_v) -> (B, T, d)
