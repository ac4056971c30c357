"""The blockwise sdpa kernel for a bias computed from the queries' positions (FIRE's `QueryPositionBias`, handed over
as a `biases.QueryBiasRecipe`) in training: no `(B, H, Q, K)` bias is kept. Forgetting attention's `DecayBias` is
its own recipe (its rows are differences of its values, the gradient of a block's rows reaches them by autograd).

With the bias values computed once per forward under autograd, autograd keeps them (B', H, Q, K), and SDPA, handed
rows that require grad as its mask, takes its math path (scores and weights kept per layer). Here each block of query rows computes its bias rows from the positions without autograd and
runs the fused kernel with them as its mask (`kernels.block_output`); the backward computes each block's rows again,
under autograd from detached copies of the scheme's parameters, takes the score gradient dS of the block
(`kernels.block_gradients`, the softmax backward from the recomputed weights) as their gradient, and autograd of that
recomputation gives the parameters' gradients (θ, c and L for FIRE). FIRE's f_θ thus runs three times per layer and
block (forward, recomputation, its backward), which its evaluation by pieces (`piecewise`) makes cheap. One autograd
Function for all blocks (not one per block, which zeroes a full-size gradient per sliced input) and in-place updates
in `block_gradients` keep the backward fast (BENCHMARKS.md, "Design measurements").
"""

from __future__ import annotations

import torch
from torch import nn

from .biases import QueryPositionBias
from .kernels import (
    _allowed_keys,
    bias_block_rows,
    block_gradients,
    block_output,
    causal_keys,
    mask_blocks_the_future,
    symbolic_sizes,
)


def query_bias_applies(query, key, value, attention_mask, dropout: float, position_bias, is_causal: bool) -> bool:
    """Whether `query_bias_attention` computes this call of the sdpa kernel: a bias with a recipe (a
    `QueryPositionBias` given as one, a `DecayBias`) whose parameters need a gradient, autograd on, outside
    torch.compile / export tracing (the backward calls autograd) and at concrete sizes; any mask, dropout and
    direction. Otherwise `kernels.sdpa_attention_forward` asks the bias for its rows, which the recipe computes under
    autograd: the same numbers, with the rows kept."""
    if getattr(position_bias, "recipe", None) is None:  # (a `RelativeBias` has none)
        return False
    if torch.compiler.is_compiling() or symbolic_sizes(query, key):
        return False
    return position_bias.recipe.requires_grad


class QueryBiasAttention(torch.autograd.Function):
    """Attention of every query row, one block of rows at a time, with the bias rows a `QueryBiasRecipe` computes.

    Forward, per block `(start, stop, keys)` of `blocks`: its rows (B', H, r, keys) without autograd, then
    `kernels.block_output` with them (the fused kernel with the rows as its float mask; with attention dropout, the
    block's weights and a seeded keep mask). Kept: the inputs and output, the mask, and the recipe (positions and
    parameters, no score-sized tensor).

    Backward, per block: dQ, dK, dV and dS by hand (`kernels.block_gradients`), dK and dV added into one buffer each
    (autograd would zero and add a full-size gradient per block of a sliced input); the rows recomputed from
    `parameters` detached (so the graph is this block's only), dS summed over the batch when the rows are shared by it,
    and `torch.autograd.grad` of the rows with dS gives each parameter's gradient, summed over the blocks.
    """

    @staticmethod
    def forward(ctx, query, key, value, attention_mask, recipe, blocks, is_causal, scaling, dropout, *parameters):
        output = query.new_empty((*query.shape[:3], value.shape[-1]))  # (B, H, Q, D_v): values may be wider
        seeds = []
        for start, stop, keys in blocks:
            allowed = _allowed_keys(attention_mask, is_causal, query.shape[2], start, stop, keys, query.device)
            with torch.no_grad():
                bias = QueryPositionBias(recipe.rows(start, stop, keys), stop - start, keys)  # (B', H, r, keys)
            output[:, :, start:stop], seed = block_output(
                query[:, :, start:stop],
                key[:, :, :keys],
                value[:, :, :keys],
                bias,
                allowed,
                (0, stop - start),
                scaling,
                dropout,
            )
            seeds.append(seed)
        ctx.save_for_backward(query, key, value, output, attention_mask)
        ctx.recipe, ctx.blocks, ctx.is_causal, ctx.scaling, ctx.dropout, ctx.seeds = (
            recipe,
            blocks,
            is_causal,
            scaling,
            dropout,
            seeds,
        )
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, attention_mask = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        accumulate = torch.promote_types(query.dtype, torch.float32)
        grad_query = torch.empty_like(query)
        grad_key, grad_value = (torch.zeros(t.shape, dtype=accumulate, device=t.device) for t in (key, value))
        wanted = ctx.needs_input_grad[9:]  # the parameters'
        leaves = [
            parameter.detach().requires_grad_(need)
            for parameter, need in zip(ctx.recipe.parameters, wanted, strict=True)
        ]
        inputs = [leaf for leaf in leaves if leaf.requires_grad]
        sums = [None] * len(inputs)
        for (start, stop, keys), seed in zip(ctx.blocks, ctx.seeds, strict=True):
            allowed = _allowed_keys(attention_mask, ctx.is_causal, query.shape[2], start, stop, keys, query.device)
            with torch.enable_grad():
                rows = ctx.recipe.rows(start, stop, keys, leaves)  # (B', H, r, keys)
            bias = QueryPositionBias(rows.detach(), stop - start, keys)
            block = slice(start, stop)
            d_query, d_key, d_value, d_scores = block_gradients(
                query[:, :, block],
                key[:, :, :keys],
                value[:, :, :keys],
                bias,
                allowed,
                (0, stop - start),
                ctx.scaling,
                output[:, :, block],
                grad_output[:, :, block],
                ctx.dropout,
                seed,
            )
            grad_query[:, :, block] = d_query
            grad_key[:, :, :keys] += d_key
            grad_value[:, :, :keys] += d_value
            if not inputs:
                continue
            if rows.shape[0] == 1:  # rows shared by the batch; blocked entries have zero weight, so zero d_scores
                d_scores = d_scores.sum(dim=0, keepdim=True)  # (1, H, r, keys)
            found = torch.autograd.grad(rows, inputs, d_scores.to(rows.dtype), allow_unused=True)
            sums = [
                total if grad is None else grad if total is None else total + grad
                for total, grad in zip(sums, found, strict=True)
            ]
        found = iter(sums)
        grad_parameters = [next(found) if leaf.requires_grad else None for leaf in leaves]
        grads = grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype)
        return *grads, None, None, None, None, None, None, *grad_parameters


def query_bias_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    position_bias: QueryPositionBias,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA with a recipe's bias, by blocks of query rows in one `QueryBiasAttention` (where `query_bias_applies`;
    the `query_bias` path of `kernels_sdpa.SDPA_PATHS`).

    Blocks as in `kernels.sdpa_relative_bias_forward`: a causal block skips the keys after its last query
    (`causal_keys`; with a mask, when `mask_blocks_the_future`); a block holds the larger of its (B, H, r, K) weights
    and the recipe's (B', r, K, width) intermediate within `kernels.BIAS_BLOCK_BYTES`.

    Returns the output `(B, H, Q, D)`.
    """
    batch, heads, query_length, _ = query.shape
    key_length = key.shape[2]
    recipe = position_bias.recipe
    per_score = max(batch * heads, recipe.shape[0] * max(recipe.width, recipe.num_heads))
    block = bias_block_rows(1, per_score, key_length, max(query.element_size(), 4))
    skip_future = is_causal and query_length > 1
    skip_future = skip_future and (
        attention_mask is None or mask_blocks_the_future(attention_mask, query_length, key_length)
    )
    blocks = []
    for start in range(0, query_length, block):
        stop = min(start + block, query_length)
        blocks.append((start, stop, causal_keys(query_length, key_length, stop) if skip_future else key_length))
    return QueryBiasAttention.apply(
        query, key, value, attention_mask, recipe, tuple(blocks), is_causal, scaling, dropout, *recipe.parameters
    )
