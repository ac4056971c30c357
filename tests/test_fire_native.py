"""FIRE's bias inside the C kernel (`kernels_fire_native`, `csrc/fire.c`): output and every gradient (q, k, v, c, L and
f_θ's four tensors) against the materialised softmax with FIRE's bias in float64, an fp32 training step on sdpa against
eager, and which calls the `fire_native` path takes (fp32 causal training without a mask) and leaves to `query_bias`
(a padding mask, fp64, bf16)."""

from __future__ import annotations

import copy
import ctypes
import itertools

import pytest
import torch
from c_drivers import build_driver
from conftest import assert_same_training_step, build, left_padded, tiny_config, training_step, training_step_by_kernel
from test_query_bias_kernel import fire_tolerances
from test_sdpa_paths import count_path_calls
from tolerances import assert_same_step, unit_roundoff

import plugformer.kernels_fire_native as fire_native
from plugformer.biases import QueryPositionBias
from plugformer.kernels_sdpa import SDPA_PATHS
from plugformer.positions_base import POSITION_SCHEMES
from plugformer.positions_bias import FireBias


PARAMETERS = ("distance_scale", "threshold_scale", "mlp_in.weight", "mlp_in.bias", "mlp_out.weight", "mlp_out.bias")


@pytest.fixture(autouse=True)
def built():
    if fire_native.native_fire() is None:
        pytest.skip("no C compiler builds csrc/fire.c here")


def fire_scheme(threshold: float) -> FireBias:
    """FIRE of the tiny preset (4 heads) in fp32, c = 0.5, L = `threshold`, θ drawn from N(0, 1) (kinks inside
    [0, 1], where the inputs lie)."""
    torch.manual_seed(0)
    fire = POSITION_SCHEMES.get("fire")(tiny_config(scheme="fire"))
    with torch.no_grad():
        fire.distance_scale.fill_(0.5)
        fire.threshold_scale.fill_(threshold / fire.initial_threshold)
        for parameter in (*fire.mlp_in.parameters(), *fire.mlp_out.parameters()):
            parameter.normal_()
    return fire


def reference(fire, query, key, value, positions, scaling):
    """softmax(s·q·kᵀ + FIRE's bias + causal mask) v, fp64, from `fire.bias_values` (f_θ's input by `mlp_inputs`)."""
    length, groups = query.shape[2], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scaling + fire.bias_values(0, length, 0, length, positions)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ value


@pytest.mark.parametrize(
    ("length", "dim", "kv_heads", "threshold", "shared"),
    [(16, 16, 2, 2.0, False), (40, 32, 4, 8.0, True), (600, 16, 1, 100.0, False)],
    ids=["one-tile", "two-tiles-shared-positions", "key-chunks-mqa"],
)
def test_output_and_every_gradient_equal_the_materialised_softmax(length, dim, kv_heads, threshold, shared):
    """Rows before and past L (a small threshold), per-row positions (the second row's start 5 later) or one set for
    the batch, GQA and MQA: output and the gradients of q, k, v and every FIRE parameter equal autograd through the
    materialised softmax in float64 from the same fp32 inputs, within fp32 rounding (`fire_tolerances`' bound for
    fp32). 600 tokens take the backward over ten chunks of keys and three groups of query tiles."""
    fire = fire_scheme(threshold)
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, length, dim, generator=generator).requires_grad_()
    key, value = (torch.randn(2, kv_heads, length, dim, generator=generator).requires_grad_() for _ in range(2))
    upstream = torch.randn(2, 4, length, dim, generator=generator)
    positions = torch.arange(length)[None] if shared else torch.stack([torch.arange(length), torch.arange(length) + 5])
    output = fire_native.FireNativeAttention.apply(query, key, value, *fire.piecewise_tables(positions, length), 0.3)
    grads = torch.autograd.grad(output, (query, key, value, *fire.bias_parameters()), upstream)

    exact = copy.deepcopy(fire).double()
    inputs = [tensor.detach().double().requires_grad_() for tensor in (query, key, value)]
    expected = reference(exact, *inputs, positions, 0.3)
    expected_grads = torch.autograd.grad(expected, (*inputs, *exact.bias_parameters()), upstream.double())
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    atol = fire_tolerances(exact, *inputs, upstream.double().transpose(1, 2), allowed, 0, positions, 0.3)
    atol = {name: bound * unit_roundoff(torch.float32) / unit_roundoff(torch.float64) for name, bound in atol.items()}
    torch.testing.assert_close(output.double(), expected, atol=atol["output"], rtol=0)
    for name, grad, want in zip(("query", "key", "value", *PARAMETERS), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), want, atol=atol[name], rtol=0, msg=name)


def test_a_training_step_on_sdpa_equals_eager_and_runs_in_c(monkeypatch):
    """FIRE with L = 2 (most queries past it), heads 16 wide (GQA): the fp32 sdpa training step takes `fire_native`
    once per layer and equals the eager kernel's logits and gradients."""
    monkeypatch.setattr(FireBias, "initial_threshold", 2.0)
    config = tiny_config("scaled_dot", "fire", hidden_size=64)  # 4 heads of 16, 2 key/value heads
    ids = torch.randint(3, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    calls, fallback = count_path_calls(monkeypatch, "fire_native"), count_path_calls(monkeypatch, "query_bias")
    assert_same_training_step(training_step_by_kernel(config, ids), config)
    assert len(calls) == config.num_hidden_layers and not fallback


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_keep_the_query_bias_path(dtype, monkeypatch):
    """fp64 and bf16 models (the bias in their dtype) are refused: the `query_bias` path computes them."""
    model = build(tiny_config("scaled_dot", "fire", hidden_size=64), "sdpa").to(dtype)
    calls, fallback = count_path_calls(monkeypatch, "fire_native"), count_path_calls(monkeypatch, "query_bias")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    model.train()(ids, labels=ids).loss.backward()
    assert not calls and len(fallback) == model.config.num_hidden_layers


def test_a_left_padded_batch_is_refused_and_takes_the_query_bias_path(monkeypatch):
    """With a padding mask (a left-padded row, whose positions start later) the C kernel, which has no mask, refuses
    the call: `query_bias` computes it, and the step equals eager's on the real tokens."""
    monkeypatch.setattr(FireBias, "initial_threshold", 2.0)
    config = tiny_config("scaled_dot", "fire", hidden_size=64)
    tokens, mask = left_padded(length=20, pad=5)
    calls, fallback = count_path_calls(monkeypatch, "fire_native"), count_path_calls(monkeypatch, "query_bias")
    (eager_logits, eager_grads), (logits, grads) = (
        training_step(build(config, kernel), tokens, mask) for kernel in ("eager", "sdpa")
    )
    assert not calls and len(fallback) == config.num_hidden_layers
    real = mask.bool()  # the padding queries' logits are no text's
    assert_same_step(config, logits[real], grads, eager_logits[real], eager_grads, tokens=20)


def recipe_call(length: int = 32, dim: int = 16, offset: int = 0):
    """The arguments of an sdpa call with FIRE's recipe: `(query, key, value, mask, dropout, bias, is_causal)`."""
    fire = fire_scheme(2.0)
    positions = torch.arange(length)[None] + offset
    recipe = fire.bias_recipe(offset, length, 0, length + offset, positions, torch.float32)
    query = torch.randn(1, 4, length, dim)
    key = value = torch.randn(1, 2, length + offset, dim)
    return [query, key, value, None, 0.0, QueryPositionBias(recipe, length, length + offset), True]


def test_the_rule_takes_causal_fp32_calls_from_slot_0_only():
    """The rule holds for causal fp32 self-attention from slot 0, heads 16 wide, and refuses a cache offset, attention
    dropout, a non-causal call, a mask, heads 8 wide and stored values (no recipe); the table asks it before
    `query_bias`."""
    applies = SDPA_PATHS["fire_native"].applies
    assert applies(*recipe_call())
    assert not applies(*recipe_call(offset=3))
    assert not applies(*recipe_call(dim=8))
    for index, refused in ((4, 0.1), (6, False), (3, torch.ones(1, 1, 32, 32, dtype=torch.bool))):
        call = recipe_call()
        call[index] = refused
        assert not applies(*call)
    call = recipe_call()
    call[5] = QueryPositionBias(call[5].dense().detach(), 32, 32)
    assert not applies(*call)
    names = list(SDPA_PATHS)
    assert names.index("fire_native") == names.index("query_bias") - 1


CROSSINGS_DRIVER = r"""
#include "fire.c"
void find_crossings(const float *psi_rev, int64_t n, float inv, const float *kinks, int64_t count, const int64_t *hints,
                    int64_t *crossed) {
    crossings(psi_rev, n, inv, kinks, count, hints, crossed);
}
"""


@pytest.fixture(scope="module")
def find_crossings(tmp_path_factory):
    """`csrc/fire.c`'s `crossings`, built into a driver with the kernels' flags."""
    library = build_driver(tmp_path_factory.mktemp("crossings"), CROSSINGS_DRIVER)
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.find_crossings.argtypes = [pointer, size, ctypes.c_float, pointer, size, pointer, pointer]
    return library.find_crossings


@pytest.mark.parametrize(
    ("length", "scale", "hints"),
    list(itertools.product((1, 7, 300), (0.5, 1e-9), ("none", "exact", "zero", "past-the-end", "random"))),
)
def test_the_crossings_searched_from_any_hint_are_the_first_distances_past_each_kink(
    find_crossings, length, scale, hints
):
    """Per kink, the first distance d whose x = psi[d]·inv (the fp32 product) exceeds it, n where none does: from no
    hint, the right one, hints at 0 or past the end and random ones; kinks on a distance's x (that distance stays on
    the left), below every x, +inf, and psi flat (c = 1e-9: long runs of one value)."""
    generator = torch.Generator().manual_seed(length)
    psi = torch.log1p(scale * torch.arange(length, dtype=torch.float32))
    inv = 0.37
    x = psi * inv
    kinks = torch.cat([x[torch.randint(0, length, (6,), generator=generator)], torch.rand(6, generator=generator)])
    kinks = torch.cat([kinks, torch.tensor([-1.0, float("inf")])]).sort().values
    expected = torch.tensor([int((x <= kink).sum()) for kink in kinks])  # x only grows: the count at or below
    hint = {
        "none": None,
        "exact": expected,
        "zero": torch.zeros_like(expected),
        "past-the-end": torch.full_like(expected, length + 5),
        "random": torch.randint(-3, length + 3, expected.shape, generator=generator),
    }[hints]
    crossed = torch.full_like(expected, -7)
    psi_rev = psi.flip(0).contiguous()
    find_crossings(
        psi_rev.data_ptr(),
        length,
        inv,
        kinks.data_ptr(),
        len(kinks),
        None if hint is None else hint.data_ptr(),
        crossed.data_ptr(),
    )
    assert torch.equal(crossed, expected)
