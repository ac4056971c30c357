"""Data-dependent score-bias position schemes: each attention layer computes its bias from its own input
(`PositionScheme.per_layer`), here forgetting attention (`forgetting`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .biases import DecayBias
from .positions_base import POSITION_SCHEMES, PositionScheme


if TYPE_CHECKING:
    from .configuration import PlugformerConfig


@POSITION_SCHEMES.register("forgetting")
class ForgettingAttention(PositionScheme):
    """Forgetting attention (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", §2): in
    every layer a forget gate f_t = σ(w_h · x_t + b_h) per head of the layer's input x_t, and the score of query i on
    key j ≤ i gets D_ij = F_i − F_j = Σ_{j < l ≤ i} log f_l, with F_t = Σ_{l ≤ t} log f_l along the row. ALiBi is the
    case of a constant gate per head (log f = −m_h).

    The gate is `forget_proj` (hidden_size → num_attention_heads, with a bias) in each attention layer (the paper's
    code: `fgate_proj`), initialised as every linear layer (normal(initializer_range) weights, zero bias), as the
    paper's code does for this data-dependent gate (its T_min/T_max bias initialisation serves its data-independent
    gates), so f ≈ 0.5 at the start. Its logits are kept in the KV cache beside each token's values
    (`positions_base.TokenStates`); every forward sums log f (fp32 at least) over the slots the kernel sees, so a
    cached step computes the D of the full forward. The bias reaches the kernels as a `DecayBias` (F of the keys and of
    the queries; each block of rows takes the differences).

    Padding, packing and windows need nothing more: D_ij sums the gates of the tokens after key j up to query i,
    which, for any key the mask lets the query see, are tokens of the query's own text (left or right padding lies
    outside it, other packed documents are masked, a sliding-window cache keeps every slot after its first). F is not
    restarted per document: the differences are the same, only larger numbers are subtracted.

    Bidirectional (an encoder; differs from the paper, which is causal): a key after the query gets the decay of the
    tokens after the query up to the key, −(F_i − F_j) (`DecayBias`: −|F_i − F_j| for every key).
    """

    has_bias = True
    bias_type = DecayBias
    per_layer = True
    # one output per query head, split with the heads as q_proj is: each rank computes its own heads' gates
    layer_tp_plan = {"forget_proj": "colwise"}

    @classmethod
    def build_layer(cls, attention: nn.Module, config: PlugformerConfig) -> None:
        attention.forget_proj = nn.Linear(config.hidden_size, config.num_attention_heads, bias=True)

    @classmethod
    def token_states(cls, attention, hidden_states):
        return attention.forget_proj(hidden_states)  # (B, T, H): the gates' logits

    @classmethod
    def layer_bias(cls, states, query_start, query_length):
        log_gates = nn.functional.logsigmoid(states.to(torch.promote_types(states.dtype, torch.float32)))  # (B, H, K)
        decay = log_gates.cumsum(dim=-1)  # (B, H, K): F at each key slot
        query_slots = torch.arange(query_length, device=states.device) + query_start  # (Q,)
        return torch.cat([decay, decay.index_select(-1, query_slots)], dim=-1)  # (B, H, K + Q)

    def bias(self, query_slots, key_slots):
        raise ValueError(
            f"position_scheme={self.name!r} has no bias of slots alone: each layer computes it from its "
            "input (forget gates of the hidden states)"
        )

    def bias_values(self, query_offset, query_length, key_offset, key_length, position_ids):
        raise ValueError(
            f"position_scheme={self.name!r} is computed by each attention layer from its input "
            "(PositionScheme.per_layer), not by the stack"
        )
