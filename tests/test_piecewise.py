"""`piecewise.relu_mlp`: a one-input ReLU MLP (FIRE's f_θ) evaluated by its linear pieces equals the MLP itself,
values and every gradient, and handles the units with no kink (w = 0, or a kink beyond the float range)."""

from __future__ import annotations

import pytest
import torch
from tolerances import tolerance
from torch import nn

from plugformer.piecewise import relu_mlp, relu_mlp_pieces


def mlp_by_layers(inputs, weight_in, bias_in, weight_out, bias_out):
    """The reference: nn.functional's two linear layers and ReLU, as `(B, H, Q, K)`."""
    hidden = nn.functional.relu(nn.functional.linear(inputs[..., None], weight_in, bias_in))  # (B, Q, K, U)
    return nn.functional.linear(hidden, weight_out, bias_out).permute(0, 3, 1, 2)  # (B, H, Q, K)


def mlp_tolerances(inputs, weight_in, bias_in, weight_out, bias_out, grad_output) -> list[float]:
    """`atol` of the MLP's value and of its gradients (inputs, then each parameter; upstream `grad_output`
    `(B, H, Q, K)`) computed two ways in fp64 (linear pieces against layers): each sums terms |W2_hu| (|W1_u x| +
    |b1_u|) + |b2_h| over the units U (the pieces' intercepts and slopes too), the gradients those terms times
    |upstream| over the heads and units (inputs) or every position and head (parameters)."""
    with torch.no_grad():
        x, g = inputs.detach().abs()[..., None], grad_output.detach().abs().permute(0, 2, 3, 1)  # (B,Q,K,1), (B,Q,K,H)
        w1, b1, w2, b2 = (p.detach().abs() for p in (weight_in[:, 0], bias_in, weight_out, bias_out))
        hidden = x * w1 + b1 + 1  # (B, Q, K, U): a unit's terms, at least the 1 of its gate
        units, positions = w1.numel(), x.numel()
        bounds = [
            (hidden @ w2.T + b2).max().item(),  # the value, over the units
            ((g @ w2) * w1).sum(-1).max().item(),  # d/dx, over the heads and units
            ((g @ w2) * x).sum((0, 1, 2)).max().item(),  # d/dW1, over every position and head
            (g @ w2).sum((0, 1, 2)).max().item(),  # d/db1
            (g[..., :, None] * hidden[..., None, :]).sum((0, 1, 2)).max().item(),  # d/dW2
            g.sum((0, 1, 2)).max().item(),  # d/db2
        ]
    lengths = [units, w2.shape[0] * units, positions * w2.shape[0], positions * w2.shape[0], positions, positions]
    return [tolerance(torch.float64, magnitude=m, length=n, steps=4) for m, n in zip(bounds, lengths, strict=True)]


def drawn(units: int = 32, heads: int = 6, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(units, 1), (units,), (heads, units), (heads,)]
    return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]


def test_a_hand_worked_mlp_gives_its_pieces_and_values():
    """f(x) = 2·relu(x − 1) − relu(−2x + 1) + 3·relu(0·x + 0.5) + 0.25 (one head): kinks at 1 and 0.5 (the w = 0
    unit has none: +inf), so pieces x ≤ 0.5: slope 2, intercept 1.75 − 1 = 0.75; 0.5 < x ≤ 1: constant 1.75;
    x > 1: slope 2, intercept −0.25."""
    weight_in = torch.tensor([[1.0], [-2.0], [0.0]], dtype=torch.float64)
    bias_in = torch.tensor([-1.0, 1.0, 0.5], dtype=torch.float64)
    weight_out = torch.tensor([[2.0, -1.0, 3.0]], dtype=torch.float64)
    bias_out = torch.tensor([0.25], dtype=torch.float64)
    kinks, slope, intercept = relu_mlp_pieces(weight_in, bias_in, weight_out, bias_out, torch.float64)
    assert kinks.tolist() == [0.5, 1.0, float("inf")]
    assert slope[0, :3].tolist() == [2.0, 0.0, 2.0]
    assert intercept[0, :3].tolist() == [0.75, 1.75, -0.25]
    inputs = torch.tensor([[[-1.0, 0.0, 0.5, 0.75, 1.0, 2.5]]], dtype=torch.float64)  # (1, 1, 6)
    # by hand: 2·max(0, x − 1) − max(0, 1 − 2x) + 1.5 + 0.25
    expected = [2 * max(0.0, x - 1) - max(0.0, 1 - 2 * x) + 1.75 for x in inputs.flatten().tolist()]
    assert relu_mlp(inputs, weight_in, bias_in, weight_out, bias_out)[0, 0, 0].tolist() == expected


@pytest.mark.parametrize("batch", [1, 3])
def test_values_and_every_gradient_equal_the_mlp_in_fp64(batch):
    parameters = drawn()
    inputs = torch.rand(batch, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 4 - 2
    inputs.requires_grad_()
    grad_output = torch.randn(batch, 6, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mine = relu_mlp(inputs, *parameters)
    reference = mlp_by_layers(inputs, *parameters)
    value, *gradients = mlp_tolerances(inputs, *parameters, grad_output)
    torch.testing.assert_close(mine, reference, atol=value, rtol=0)
    wanted = [inputs, *parameters]
    for got, expected, atol in zip(
        torch.autograd.grad(mine, wanted, grad_output),
        torch.autograd.grad(reference, wanted, grad_output),
        gradients,
        strict=True,
    ):
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_units_without_a_kink_are_constant_and_get_their_gradients():
    """w = 0 (relu(b) everywhere) and w = 1e-310 with b = 1 (−b/w overflows fp64 to −inf, taken as no kink): both
    act as the constant relu(b); the third unit's kink is at 0.2."""
    weight_in = torch.tensor([[0.0], [1e-310], [1.0]], dtype=torch.float64, requires_grad=True)
    bias_in = torch.tensor([0.7, 1.0, -0.2], dtype=torch.float64, requires_grad=True)
    weight_out = torch.tensor([[1.0, 2.0, -1.5], [0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    bias_out = torch.tensor([0.1, -0.3], dtype=torch.float64, requires_grad=True)
    kinks = relu_mlp_pieces(weight_in, bias_in, weight_out, bias_out, torch.float64)[0]
    assert kinks[0] == 0.2 and torch.isinf(kinks[1:]).all()
    inputs = torch.linspace(-3, 3, 13, dtype=torch.float64).view(1, 1, 13)
    parameters = [weight_in, bias_in, weight_out, bias_out]
    mine, reference = relu_mlp(inputs, *parameters), mlp_by_layers(inputs, *parameters)
    value, _, *gradients = mlp_tolerances(inputs, *parameters, torch.ones_like(reference))
    torch.testing.assert_close(mine, reference, atol=value, rtol=0)
    mine_grads = torch.autograd.grad(mine.sum(), parameters)
    for got, expected, atol in zip(
        mine_grads, torch.autograd.grad(reference.sum(), parameters), gradients, strict=True
    ):
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_a_float32_block_is_as_close_to_the_fp64_truth_as_the_mlp():
    """Large block (64 x 512 scores, 32 units, 6 heads): fp32 values and parameter gradients within the MLP's own fp32
    error of the fp64 result, times 4 (sums in another order)."""
    truth_parameters = drawn(seed=3)
    single = [parameter.detach().float().requires_grad_() for parameter in truth_parameters]
    inputs = torch.rand(1, 64, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    grad_output = torch.randn(1, 6, 64, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    truth = mlp_by_layers(inputs, *truth_parameters)
    truth_grads = torch.autograd.grad(truth, truth_parameters, grad_output)
    results = {}
    for name, function in (("pieces", relu_mlp), ("mlp", mlp_by_layers)):
        output = function(inputs.float(), *single)
        results[name] = [output, *torch.autograd.grad(output, single, grad_output.float())]
    for index, expected in enumerate([truth, *truth_grads]):
        error = {name: (result[index].double() - expected).abs().max().item() for name, result in results.items()}
        scale = expected.abs().max().item()
        assert error["pieces"] <= 4 * error["mlp"] + 1e-6 * scale, (index, error)


def test_autocast_does_not_round_the_pieces():
    parameters = [parameter.detach().float() for parameter in drawn(seed=6)]
    inputs = torch.rand(1, 5, 7, generator=torch.Generator().manual_seed(7))
    plain = relu_mlp(inputs, *parameters)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = relu_mlp(inputs, *parameters)
    assert inside.dtype == torch.float32
    torch.testing.assert_close(inside, plain, atol=0, rtol=0)
