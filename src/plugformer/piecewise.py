"""A ReLU MLP of one scalar input evaluated as the piecewise-linear function it is (FIRE's f_θ).

f(x) = W₂ relu(w x + b) + b₂, with w, b `(U,)` and W₂ `(H, U)`, is linear between its kinks −b_u / w_u: on each
piece one set of units is active, so f_h(x) = slope_h[p]·x + intercept_h[p] for x on piece p. Evaluated that way a
score costs a binary search among the U kinks and two table lookups per head, where the MLP computes U hidden units
per score and keeps them for its backward (timed in BENCHMARKS.md, "Design measurements").

The numbers are the MLP's up to rounding (slope and intercept sum the active units in another order); at a kink the
gradient is one of the two sides', a subgradient as relu's own at 0 is.
"""

from __future__ import annotations

import torch


def relu_mlp_pieces(weight_in, bias_in, weight_out, bias_out, dtype: torch.dtype):
    """The pieces of f(x) = W₂ relu(w x + b) + b₂ (`nn.Linear(1, U)`, ReLU, `nn.Linear(U, H)`).

    Args:
        weight_in (`torch.Tensor` of shape `(U, 1)`), bias_in (`(U,)`), weight_out (`(H, U)`), bias_out (`(H,)`):
            the two layers' parameters.
        dtype (`torch.dtype`): the dtype the pieces are computed in.

    Returns:
        `(kinks (U,), slope (H, U + 1), intercept (H, U + 1))`: the kinks sorted (+inf for a unit constant in x,
        w = 0 or −b/w beyond the dtype's range); piece p holds the x with kinks[p − 1] < x ≤ kinks[p]. slope and
        intercept carry autograd to the four parameters; the kinks and which units are active on a piece do not
        (they change the function only where it is continuous).
    """
    w, b = weight_in[:, 0].to(dtype), bias_in.to(dtype)  # (U,)
    with torch.no_grad():
        kinks = -b / w
        kinks = torch.where(torch.isfinite(kinks), kinks, torch.inf).sort().values  # (U,)
        # one point inside each piece says which units are active there: before the first kink, between two, after
        # the last finite one (pieces past a +inf kink are never reached)
        after = torch.where(torch.isfinite(kinks), kinks + 1, torch.inf)
        first = torch.where(torch.isfinite(kinks[:1]), kinks[:1] - 1, 0.0)
        inner = torch.where(torch.isfinite(kinks[1:]), (kinks[1:] + kinks[:-1]) / 2, after[:-1])
        points = torch.cat([first, inner, after[-1:]])  # (U + 1,)
        active = (points[:, None] * w + b > 0).to(dtype)  # (U + 1, U): unit u active on piece p
    weight_out = weight_out.to(dtype)
    slope = (weight_out * w) @ active.T  # (H, U + 1)
    intercept = (weight_out * b) @ active.T + bias_out.to(dtype)[:, None]
    return kinks, slope, intercept


class PiecewiseLinear(torch.autograd.Function):
    """f(x) per head from its pieces: slope[h, p]·x + intercept[h, p], p the piece of x.

    Inputs: x `(B, Q, K)`, slope and intercept `(H, P)`, kinks `(P − 1,)` sorted (`relu_mlp_pieces`), all one dtype.
    Returns `(B, H, Q, K)`. Kept for the backward: x and the piece of each entry (no `(.., H)` tensor); the tables'
    gradients are the output gradient (times x, for the slope) summed per piece.
    """

    @staticmethod
    def forward(ctx, inputs, slope, intercept, kinks):
        heads = slope.shape[0]
        piece = torch.searchsorted(kinks, inputs)  # (B, Q, K)
        table = torch.cat([slope, intercept])  # (2H, P)
        output = inputs.new_empty((inputs.shape[0], heads, *inputs.shape[1:]))  # (B, H, Q, K)
        for row in range(inputs.shape[0]):  # index_select (flat indices) is ~3x faster than indexing by a 2-d tensor
            picked = table.index_select(1, piece[row].flatten()).view(2 * heads, *inputs.shape[1:])  # (2H, Q, K)
            torch.addcmul(picked[heads:], picked[:heads], inputs[row], out=output[row])
        ctx.save_for_backward(inputs, piece, slope)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        inputs, piece, slope = ctx.saved_tensors
        heads, pieces = slope.shape
        grad_inputs = torch.empty_like(inputs) if ctx.needs_input_grad[0] else None
        grad_slope, grad_intercept = (grad_output.new_zeros(heads, pieces) for _ in range(2))
        for row in range(inputs.shape[0]):
            flat = piece[row].flatten()  # (Q·K,)
            grads = grad_output[row].reshape(heads, -1)  # (H, Q·K)
            if grad_inputs is not None:  # df/dx = the slope of x's piece, per head
                torch.sum(grads * slope.index_select(1, flat), 0, out=grad_inputs[row].view(-1))
            grad_intercept.index_add_(1, flat, grads)
            grad_slope.index_add_(1, flat, grads * inputs[row].reshape(1, -1))
        return grad_inputs, grad_slope, grad_intercept, None


def relu_mlp(inputs, weight_in, bias_in, weight_out, bias_out) -> torch.Tensor:
    """W₂ relu(w x + b) + b₂ of every entry of `inputs` `(B, Q, K)`, as `(B, H, Q, K)` in the inputs' dtype promoted to
    fp32 at least (autocast does not round it), by its pieces (see the module docstring)."""
    dtype = torch.promote_types(inputs.dtype, torch.float32)
    with torch.autocast(inputs.device.type, enabled=False):
        kinks, slope, intercept = relu_mlp_pieces(weight_in, bias_in, weight_out, bias_out, dtype)
        return PiecewiseLinear.apply(inputs.to(dtype), slope, intercept, kinks)
