"""The stick-breaking attention kernel (Tan et al. 2024, arXiv 2410.17980), with the signature of `kernels`
(transformers').

For query i and each key j before it, β_ij = σ(z_ij) with z_ij = scaling · q_i·k_j (+ the position bias) is the share
of what is left of a unit stick that key j takes, the stick broken from the nearest key backwards:

    A_ij = β_ij · ∏_{j<k<i} (1 − β_ik),        o_i = Σ_{j<i} A_ij v_j        (no normalisation: Σ_j A_ij ≤ 1)

computed in log space: log β = −softplus(−z), log(1 − β) = −softplus(z), the product a reverse cumulative sum of the
latter over the keys after j. Only the keys the attention mask lets query i see take part: a padding key, another
packed document's key or one outside a sliding window contributes neither its β nor its (1 − β) factor, so a padded
row or a packed document attends as it does alone. The query's own key (the latest key it sees) is left out, as in
the paper ("for each token before the current"; the official kernel's default `attend_current=False`).
"""

from __future__ import annotations

import torch
from torch import nn

from .biases import QueryPositionBias, RelativeBias
from .kernels import _allowed_keys, bias_rows, dense_products


def earlier_keys(
    attention_mask: torch.Tensor | None, is_causal: bool, query_length: int, key_length: int, device: torch.device
) -> torch.Tensor:
    """Boolean `(B or 1, 1, Q, K)`: the keys each query sees (`kernels._allowed_keys`) before its own slot, which is the
    latest key a causal mask lets it see (slot `K − Q + i` with a dynamic cache, the cache position with a static one,
    whose later empty slots the mask blocks). A row that sees no key (a padding query) keeps none."""
    allowed = _allowed_keys(attention_mask, is_causal, query_length, 0, query_length, key_length, device)
    if allowed is None:  # one query over every cached key, or an unmasked row: it sees them all
        allowed = torch.ones(1, 1, query_length, key_length, dtype=torch.bool, device=device)
    slots = torch.arange(key_length, device=device)
    own = torch.where(allowed, slots, -1).amax(dim=-1, keepdim=True)  # (B or 1, 1, Q, 1): the query's own slot
    return allowed & (slots < own)


def stick_breaking_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: RelativeBias | QueryPositionBias | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stick-breaking attention with materialised weights `A` (B, H, Q, K) (Tan et al. 2024, §2).

    The logits z_ij = `scaling` · q_i·k_j plus the `position_bias` of a score-bias scheme (which shifts each break
    point) are computed in fp32 (fp64 for fp64 inputs); `dropout` drops weights as eager's does. Returns the output
    (B, Q, H, D_v) and the weights, whose rows sum to at most 1 (what the stick keeps is assigned to no key).
    """
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    products, value = dense_products(module, query, key, value, compute_dtype)  # (B, H, Q, K), (B, H, K, D_v)
    logits = products * scaling
    bias = bias_rows(position_bias, slice(None))
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    is_causal = module.is_causal if kwargs.get("is_causal") is None else kwargs["is_causal"]
    earlier = earlier_keys(attention_mask, is_causal, query.shape[2], value.shape[2], query.device)  # (B|1, 1, Q, K)
    log_beta = -nn.functional.softplus(-logits)  # log σ(z)
    log_rest = torch.where(earlier, -nn.functional.softplus(logits), 0.0)  # log(1 − σ(z)); 0: the key is not there
    # Σ_{j<k} log(1 − β_ik): the inclusive reverse cumulative sum shifted one key left (no subtraction, no
    # cancellation), over the keys after j
    after = nn.functional.pad(log_rest.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))  # (B, H, Q, K)
    weights = torch.where(earlier, (log_beta + after).exp(), 0.0).to(value.dtype)  # (B, H, Q, K)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value)  # (B, H, Q, D_v)
    return output.transpose(1, 2).contiguous(), weights  # (B, Q, H, D_v)
