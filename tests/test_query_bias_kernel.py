"""FIRE's blockwise sdpa kernel in training (`kernels_query_bias`): each block of query rows computes its bias from the
positions, and again in its backward, so no (B, H, Q, K) bias is kept.

The reference is the plain eager computation in fp64: FIRE's whole bias from `bias_values` under autograd, added to
q·kᵀ·s, the mask, a softmax, the values; its gradients by autograd. The model-level tests compare a training step
with the stack's dense values (the path before this kernel: `bias_recipe` returning None) in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded, tiny_config
from test_fire import with_small_threshold
from test_sdpa_paths import count_path_calls
from tolerances import assert_same_step, attention_tolerances

import plugformer.kernels as kernels
from plugformer import PlugformerForCausalLM, PlugformerForMaskedLM
from plugformer.biases import QueryPositionBias
from plugformer.kernels_query_bias import query_bias_applies
from plugformer.kernels_sdpa import SDPA_PATHS
from plugformer.positions import POSITION_SCHEMES
from plugformer.positions_bias import FireBias


HEADS, KV_HEADS, DIM = 4, 2, 8  # GQA: two query heads per key/value head
NAMES = (
    "query",
    "key",
    "value",
    "distance_scale",
    "threshold_scale",
    "mlp_in.weight",
    "mlp_in.bias",
    "mlp_out.weight",
    "mlp_out.bias",
)  # the tensors whose gradients the tests compare, in `(q, k, v, *fire.bias_parameters())`'s order


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kernels, "BIAS_BLOCK_BYTES", 1)  # 16-row blocks


class Attention:
    """What the kernel reads of the attention module."""

    def __init__(self, is_causal: bool):
        self.is_causal = is_causal


def fire_scheme(bidirectional: bool) -> FireBias:
    """FIRE in fp64 with L = 2, c = 0.5 (most queries past L: the query position matters) and random θ."""
    torch.manual_seed(0)
    fire = POSITION_SCHEMES.get("fire")(tiny_config(scheme="fire"), bidirectional=bidirectional).double()
    with torch.no_grad():
        fire.distance_scale.fill_(0.5)
        fire.threshold_scale.fill_(2.0 / fire.initial_threshold)
        for parameter in (*fire.mlp_in.parameters(), *fire.mlp_out.parameters()):
            parameter.normal_()
    return fire


def reference(fire, query, key, value, allowed, query_offset, positions, scaling):
    """softmax(s·q·kᵀ + FIRE's bias + mask) v in plain torch, (B, H, Q, D); a row without keys gives zeros."""
    bias = fire.bias_values(query_offset, query.shape[2], 0, key.shape[2], positions)  # (B', H, Q, K)
    key_heads = key.repeat_interleave(HEADS // KV_HEADS, dim=1)  # (B, H, K, D)
    value_heads = value.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.matmul(query, key_heads.transpose(2, 3)) * scaling + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, value_heads)


def fire_tolerances(fire, query, key, value, upstream, allowed, query_offset, positions, scaling, kept=1.0):
    """`atol` of the kernel's output and gradients (upstream `upstream` `(B, Q, H, D)`) against `reference`, both
    fp64: `attention_tolerances` with FIRE's dense bias and `allowed`, the values scaled by 1 / `kept` (dropout);
    a parameter θ of the bias gets Σ_h Σ_ij ds_hij ∂b_hij/∂θ, so its error is at most the bias's bound (a head's
    pairs) times the heads that share θ (all of them for c, L and f_θ's first layer, one for its second) times
    max|∂b/∂θ|: from f_θ(x) = Σ_u W2_hu relu(W1_u x + b1_u) + b2_h, relu(·) for W2, 1 for b2, |W2|·|x| for W1, |W2|
    for b1, and |f_θ'(x)| · |∂x/∂c| (∂x/∂L) for c (L), by forward-mode autograd through `mlp_inputs`."""
    from torch.autograd import forward_ad

    bias = fire.bias_values(query_offset, query.shape[2], 0, key.shape[2], positions).detach()
    atol = attention_tolerances(query, key, value, upstream.transpose(1, 2), scaling, bias, allowed, torch.float64)
    atol = {name: bound / kept for name, bound in atol.items()}
    slots = torch.arange(query.shape[2]) + query_offset
    behind = slots[:, None] - torch.arange(key.shape[2])[None, :]  # (Q, K)
    parameters = [parameter.detach() for parameter in fire.bias_parameters()]
    slopes = []
    for index in (0, 1):  # ∂x/∂c, ∂x/∂L
        with forward_ad.dual_level():
            dual = list(parameters)
            dual[index] = forward_ad.make_dual(parameters[index], torch.ones_like(parameters[index]))
            slopes.append(forward_ad.unpack_dual(fire.mlp_inputs(positions, behind, dual)).tangent.abs())
    weight_in, bias_in, weight_out = parameters[2][:, 0], parameters[3], parameters[4]
    x = fire.mlp_inputs(positions, behind, parameters).detach()  # (B', Q, K)
    hidden = x[..., None] * weight_in + bias_in  # (B', Q, K, U)
    derivative = ((hidden > 0) * weight_in) @ weight_out.T  # (B', Q, K, H): f_θ'(x)
    largest = derivative.abs().amax(-1)
    heads, out = weight_out.shape[0], weight_out.abs().max().item()
    sensitivity = {
        "distance_scale": heads * (largest * slopes[0]).max().item(),
        "threshold_scale": heads * (largest * slopes[1]).max().item(),
        "mlp_in.weight": heads * out * x.abs().max().item(),
        "mlp_in.bias": heads * out,
        "mlp_out.weight": hidden.clamp(min=0).max().item(),
        "mlp_out.bias": 1.0,
    }
    return atol | {name: atol["bias"] * size for name, size in sensitivity.items()}


def case(name: str):
    """(is_causal, query_offset, key_length, positions (B or 1, Q), allowed (B, 1, Q, K), mask given to the kernel)."""
    length = 40
    if name == "decode":  # 5 new queries after 35 cached keys, the second row left-padded by 6
        query_offset, queries = 35, 5
        positions = torch.stack([torch.arange(35, 40), torch.arange(29, 34)])
        real = torch.ones(2, length, dtype=torch.bool)
        real[1, :6] = False
    elif name == "packed":  # one row, three documents: the positions restart
        query_offset, queries = 0, length
        positions = torch.cat([torch.arange(15), torch.arange(20), torch.arange(5)])[None]
        real = torch.ones(1, length, dtype=torch.bool)
    else:  # the second row left-padded by 7
        query_offset, queries = 0, length
        positions = torch.stack([torch.arange(length), (torch.arange(length) - 7).clamp(min=0)])
        real = torch.ones(2, length, dtype=torch.bool)
        real[1, :7] = False
    causal = name != "encoder"
    query_slots, key_slots = torch.arange(queries) + query_offset, torch.arange(length)
    allowed = real[:, None, None, :].expand(-1, 1, queries, -1)
    if causal:
        allowed = allowed & (key_slots[None, :] <= query_slots[:, None])
    if name == "packed":
        document = torch.cat([torch.zeros(15), torch.ones(20), torch.full((5,), 2)])
        allowed = allowed & (document[:, None] == document[None, :])
    if name == "shared":  # no padding: one set of positions for both rows, no mask (the kernel's own causal one)
        positions, allowed = positions[:1], allowed.expand(2, -1, -1, -1) | True
        return causal, query_offset, length, positions, allowed & (key_slots <= query_slots[:, None]), None
    return causal, query_offset, length, positions, allowed, allowed


@pytest.mark.parametrize("name", ["causal", "shared", "packed", "decode", "encoder"])
def test_outputs_and_every_gradient_equal_the_eager_computation_in_fp64(name, small_blocks):
    causal, query_offset, key_length, positions, allowed, mask = case(name)
    fire = fire_scheme(bidirectional=not causal)
    batch, queries = allowed.shape[0], allowed.shape[2]
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(batch, HEADS, queries, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
    key, value = (
        torch.randn(batch, KV_HEADS, key_length, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    scaling, upstream = DIM**-0.5, torch.randn(batch, queries, HEADS, DIM, generator=generator, dtype=torch.float64)
    recipe = fire.bias_recipe(query_offset, queries, 0, key_length, positions, torch.float64)
    bias = QueryPositionBias(recipe, queries, key_length)
    assert query_bias_applies(query, key, value, mask, 0.0, bias, causal)
    output, _ = SDPA_PATHS["query_bias"](Attention(causal), query, key, value, mask, scaling, 0.0, bias, causal)
    expected = reference(fire, query, key, value, allowed, query_offset, positions, scaling).transpose(1, 2)
    atol = fire_tolerances(fire, query, key, value, upstream, allowed, query_offset, positions, scaling)
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    inputs = (query, key, value, *fire.bias_parameters())
    got = torch.autograd.grad((output * upstream).sum(), inputs)
    want = torch.autograd.grad((expected * upstream).sum(), inputs)
    for label, mine, theirs in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(mine, theirs, atol=atol[label], rtol=0, msg=label)
    # c, L and θ do get a gradient here (L not in decoding: every query there lies past L = 2)
    for label, grad in zip(NAMES[3:6], want[3:6], strict=True):
        assert grad.abs().sum() > 1e-6 or (name, label) == ("decode", "threshold_scale"), label


def train_step(model, tokens, mask, position_ids=None):
    """One training step's logits and every parameter's gradient."""
    model.train().zero_grad()
    labels = tokens if mask is None else tokens.masked_fill(mask == 0, -100)
    out = model(tokens, attention_mask=mask, position_ids=position_ids, labels=labels)
    out.loss.backward()
    return out.logits.detach().float(), {
        name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None
    }


def fire_lm(kind: str, dtype: torch.dtype):
    config = tiny_config("scaled_dot", "fire", is_causal=kind != "encoder")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (PlugformerForMaskedLM if kind == "encoder" else PlugformerForCausalLM)(config)
    return with_small_threshold(model).to(dtype)


def inputs(kind: str):
    """(tokens, attention mask or None, position_ids or None): left padding, or packed documents (no mask: the
    stack masks across the restarts of position_ids)."""
    if kind == "packed":
        tokens = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
        positions = torch.cat([torch.arange(15), torch.arange(25)])[None].expand(2, -1)
        return tokens, None, positions
    tokens, mask = left_padded(length=40, pad=7)
    return tokens, mask, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["causal", "packed", "encoder"])
def test_a_training_step_equals_the_path_with_the_dense_bias(kind, dtype, small_blocks, monkeypatch):
    """Logits and every gradient (θ, c, L included) as with the stack's dense values, which SDPA took as a float
    mask requiring grad (its math path). bf16: within twice the dense path's own distance from fp32, plus 2 ulp."""
    tokens, mask, positions = inputs(kind)
    calls = count_path_calls(monkeypatch, "query_bias")
    blockwise = train_step(fire_lm(kind, dtype), tokens, mask, positions)
    assert len(calls) == 2  # the new path ran, in both layers
    monkeypatch.setattr(FireBias, "bias_recipe", lambda self, *args: None)
    dense = train_step(fire_lm(kind, dtype), tokens, mask, positions)
    real = slice(None) if mask is None else mask.bool()
    if dtype == torch.float32:
        # fp32's rounding through the model's layers and longest reduction, times max|logits| and the largest
        # gradient (`tolerances.assert_same_step`)
        config = tiny_config("scaled_dot", "fire", is_causal=kind != "encoder")
        assert_same_step(config, blockwise[0][real], blockwise[1], dense[0][real], dense[1], msg=kind, tokens=40)
        return
    exact = train_step(fire_lm(kind, torch.float32), tokens, mask, positions)
    ulp = torch.finfo(torch.bfloat16).eps
    for name in ("logits", *exact[1]):
        mine, theirs, truth = (
            (run[0][real] if name == "logits" else run[1][name]) for run in (blockwise, dense, exact)
        )
        scale = truth.abs().max().item()
        if name.endswith("mlp_out.bias"):  # a constant per head on a row's scores: its gradient is 0 but for rounding,
            scale = exact[1][name.replace("bias", "weight")].abs().max().item()  # on the scale of the weight's
        assert (mine - truth).abs().max() <= 2 * (theirs - truth).abs().max() + 2 * ulp * scale, name


def test_autograd_keeps_no_score_sized_tensor(small_blocks):
    """Saved-tensor hooks see every tensor autograd keeps for the backward: none has a (Q, K) = (48, 48) pair of axes
    (the bias (B', H, Q, K), f_θ's hidden (B', Q, K, 32), SDPA's math-path scores); eager's do (the detector works)."""
    tokens = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(0))

    def kept_shapes(kernel: str) -> list[tuple[int, ...]]:
        model = fire_lm("causal", torch.float32)
        model.set_attn_implementation(kernel)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            model.train()(tokens, labels=tokens).loss.backward()
        return shapes

    def score_sized(shape):
        return any(shape[i : i + 2] == (48, 48) for i in range(len(shape) - 1))

    assert any(score_sized(shape) for shape in kept_shapes("eager"))
    assert not [shape for shape in kept_shapes("sdpa") if score_sized(shape)]


def test_attention_dropout_drops_the_weights_of_a_seeded_keep_mask():
    """With attention dropout (one block): O = (P ⊙ Z / (1 − p)) v, Z drawn from a generator seeded by a draw from
    torch's default generator (as `LearnedBiasAttention`'s); output and gradients as the eager computation with that
    Z."""
    _, _, key_length, positions, allowed, mask = case("causal")
    fire, dropout = fire_scheme(bidirectional=False), 0.3
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, HEADS, key_length, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
    key, value = (
        torch.randn(2, KV_HEADS, key_length, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    bias = QueryPositionBias(fire.bias_recipe(0, key_length, 0, key_length, positions, torch.float64), 40, 40)
    torch.manual_seed(5)
    output, _ = SDPA_PATHS["query_bias"](Attention(True), query, key, value, mask, DIM**-0.5, dropout, bias, True)
    torch.manual_seed(5)
    seed = int(torch.randint(2**62, (), device="cpu"))
    keep = torch.empty(2, HEADS, 40, 40, dtype=torch.float64)
    keep = keep.bernoulli_(1.0 - dropout, generator=torch.Generator().manual_seed(seed)) / (1.0 - dropout)
    bias_values = fire.bias_values(0, 40, 0, 40, positions)  # (2, H, Q, K)
    key_heads, value_heads = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (key, value))
    scores = (torch.matmul(query, key_heads.transpose(2, 3)) * DIM**-0.5 + bias_values).masked_fill(
        ~allowed, -torch.inf
    )
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    expected = torch.matmul(weights * keep, value_heads).transpose(1, 2)  # (B, Q, H, D)
    upstream = torch.ones_like(expected)  # output.sum()
    atol = fire_tolerances(fire, query, key, value, upstream, allowed, 0, positions, DIM**-0.5, kept=1.0 - dropout)
    torch.testing.assert_close(output, expected, atol=atol["output"], rtol=0)
    inputs = (query, key, value, *fire.bias_parameters())
    for label, mine, theirs in zip(
        NAMES, torch.autograd.grad(output.sum(), inputs), torch.autograd.grad(expected.sum(), inputs), strict=True
    ):
        torch.testing.assert_close(mine, theirs, atol=atol[label], rtol=0, msg=label)


def test_the_dense_values_serve_inference_and_a_frozen_bias():
    """Without autograd, or with FIRE's parameters frozen, nothing is recomputed in a backward: the stack computes the
    values once per forward for all layers, as before (`bias_recipe` None, `query_bias_applies` false)."""
    fire, positions = fire_scheme(bidirectional=False), torch.arange(8)[None]
    query, key = torch.zeros(1, HEADS, 8, DIM), torch.zeros(1, KV_HEADS, 8, DIM)
    bias = QueryPositionBias(fire.bias_recipe(0, 8, 0, 8, positions, torch.float32), 8, 8)
    with torch.no_grad():
        assert not query_bias_applies(query, key, key, None, 0.0, bias, True)
    fire.requires_grad_(False)
    assert fire.bias_recipe(0, 8, 0, 8, positions, torch.float32) is None
