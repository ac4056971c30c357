"""Reference tests of the position schemes: formulas from the papers and transformers' own implementations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build, decode_in_chunks, tiny_config
from tolerances import layer_tolerance, model_tolerance, tolerance
from transformers import DynamicCache, LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from plugformer import POSITION_SCHEMES
from plugformer.biases import DecayBias, RelativeBias
from plugformer.positions import (
    ForgettingAttention,
    alibi_slopes,
    apply_rotary,
    sinusoidal_table,
    t5_relative_position_bucket,
)


def scheme(name, **overrides):
    return POSITION_SCHEMES.get(name)(tiny_config(scheme=name, **overrides))


def test_every_registered_scheme_has_a_reference_test():
    """A scheme registers itself; its reference test here is named `test_<scheme>_...`."""
    tests = [name for name in globals() if name.startswith("test_")]
    missing = [scheme for scheme in POSITION_SCHEMES if not any(t.startswith(f"test_{scheme}_") for t in tests)]
    assert not missing, f"position schemes without a reference test in this file: {missing}"


# the schemes without a table of positions: they run past max_position_embeddings
UNBOUNDED = [name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).max_length(tiny_config()) is None]


def test_none_adds_nothing():
    positions = scheme("none")
    ids = torch.arange(5)[None]
    assert positions.embed(ids, torch.float32) is None
    assert positions.rotary(torch.zeros(1, 5, 32), ids) is None
    assert positions.bias(torch.arange(5), torch.arange(5)) is None


def test_sinusoidal_matches_vaswani_formula():
    d = 8
    table = sinusoidal_table(torch.arange(6)[None], d)[0]
    for pos in range(6):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sinusoidal_model_scales_token_embeddings_as_vaswani():
    """Block input = embedding · sqrt(d) + PE (§3.4), for embeddings the caller passes too (Marian's decoder)."""
    model = build(tiny_config(scheme="sinusoidal"))
    ids = torch.tensor([[5, 9, 9, 2]])
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(ids)
    d = model.config.hidden_size
    expected = model.model.embed_tokens.weight[ids[0]] * math.sqrt(d) + sinusoidal_table(torch.arange(4)[None], d)[0]
    torch.testing.assert_close(seen[0][0], expected)
    model(inputs_embeds=model.model.embed_tokens(ids))
    torch.testing.assert_close(seen[1][0], expected)


def test_learned_positions_look_up_rows_and_refuse_positions_past_the_table():
    positions = scheme("learned")
    ids = torch.tensor([[0, 3, 63]])
    torch.testing.assert_close(positions.embed(ids, torch.float32)[0], positions.embed_positions.weight[[0, 3, 63]])
    with pytest.raises(ValueError, match=r"max_position_embeddings=64.*position 64"):
        positions.embed(torch.tensor([[64]]), torch.float32)


def test_learned_model_rejects_inputs_longer_than_its_table():
    model = build(tiny_config(scheme="learned"))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 65, dtype=torch.long))


@pytest.mark.parametrize("name", UNBOUNDED)
def test_other_schemes_run_past_max_position_embeddings(name):
    model = build(tiny_config(scheme=name))
    with torch.no_grad():
        assert torch.isfinite(model(torch.ones(1, 80, dtype=torch.long)).logits).all()


def llama_rotary(config):
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
    )
    return LlamaRotaryEmbedding(llama)


PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


def test_rope_partial_rotary_factor_matches_phi():
    """`rope_parameters["partial_rotary_factor"]` (transformers' key, as Phi, GLM and GPT-NeoX's `rotary_pct`): only the
    first fraction of head_dim rotates. Reference: transformers' Phi, whose attention rotates `q[..., :rotary_ndims]`
    with the Llama layout (`rotate_half`) and passes the rest through; and the pass-through checked directly."""
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
    from transformers.models.phi.modeling_phi import apply_rotary_pos_emb as phi_apply_rotary

    rope = scheme("rope", rope_parameters=PARTIAL)  # head_dim 8 -> 2 rotated dimensions
    phi_config = PhiConfig(hidden_size=32, num_attention_heads=4, rope_parameters=dict(PARTIAL))
    phi_rope = PhiRotaryEmbedding(phi_config)
    positions = torch.tensor([[0, 1, 5, 63, 200]])
    query, key = torch.randn(2, 1, 4, 5, 8).unbind(0)  # (B, H, T, D)
    cos, sin = rope.rotary(query.transpose(1, 2), positions)
    assert cos.shape == (1, 5, 2)
    phi_cos, phi_sin = phi_rope(query, positions)
    # the rotated pair's angles p·θ_0 = p are exact (θ_0 = base^0 = 1): cos's own rounding only, a few ulps
    torch.testing.assert_close(cos, phi_cos, atol=tolerance(torch.float32, steps=2), rtol=0)
    rotated_q, rotated_k = apply_rotary(query, key, cos, sin)
    phi_q, phi_k = phi_apply_rotary(query[..., :2], key[..., :2], phi_cos, phi_sin)
    # x0·cos − x1·sin: terms |x0| + |x1|, through cos's and sin's rounding, two products and the sum
    atol = tolerance(torch.float32, magnitude=torch.cat([query, key])[..., :2].abs().sum(-1).max().item(), steps=4)
    torch.testing.assert_close(rotated_q, torch.cat([phi_q, query[..., 2:]], -1), atol=atol, rtol=0)
    torch.testing.assert_close(rotated_k, torch.cat([phi_k, key[..., 2:]], -1), atol=atol, rtol=0)
    # by hand: the pair (x0, x1) turns by angle p · theta_0 = p (theta_0 = base^0); the other dimensions are untouched
    angle = positions[0].float()
    x0, x1 = query[..., 0], query[..., 1]
    torch.testing.assert_close(rotated_q[..., 0], x0 * angle.cos() - x1 * angle.sin(), atol=atol, rtol=0)
    torch.testing.assert_close(rotated_q[..., 1], x1 * angle.cos() + x0 * angle.sin(), atol=atol, rtol=0)
    assert torch.equal(rotated_q[..., 2:], query[..., 2:])


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_rope_partial_rotary_factor_decodes_with_a_cache_as_the_full_forward(kernel):
    model = build(tiny_config(scheme="rope", rope_parameters=PARTIAL), kernel)
    tokens = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        eager = build(tiny_config(scheme="rope", rope_parameters=PARTIAL), "eager")(tokens, use_cache=False).logits
    cached = decode_in_chunks(model, tokens, [4, 1, 1, 1, 1, 1], DynamicCache(config=model.config))
    # cached against full, the kernel against eager: fp32's rounding through the model (`model_tolerance`)
    torch.testing.assert_close(cached, full, atol=model_tolerance(model.config, full), rtol=0)
    torch.testing.assert_close(full, eager, atol=model_tolerance(model.config, full), rtol=0)
    legacy = tiny_config(scheme="rope", partial_rotary_factor=0.25)  # Phi's top-level key, as transformers converts it
    assert legacy.rope_parameters["partial_rotary_factor"] == 0.25


def attention_by_hand(attn, hidden, cos=None, sin=None):
    """Causal self-attention of one PlugformerAttention (scaled_dot, GQA) in plain torch: (B, T, hidden) -> same."""
    batch, length, _ = hidden.shape
    heads, kv_heads, dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    q = (hidden @ attn.q_proj.weight.T).view(batch, length, heads, dim).transpose(1, 2)
    k = (hidden @ attn.k_proj.weight.T).view(batch, length, kv_heads, dim).transpose(1, 2)
    v = (hidden @ attn.v_proj.weight.T).view(batch, length, kv_heads, dim).transpose(1, 2)
    if cos is not None:  # Llama layout: x * cos + rotate_half(x) * sin
        half = dim // 2
        turn = lambda x: torch.cat([-x[..., half:], x[..., :half]], -1)  # noqa: E731
        q, k = q * cos[:, None] + turn(q) * sin[:, None], k * cos[:, None] + turn(k) * sin[:, None]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, heads * dim)
    return out @ attn.o_proj.weight.T


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_rope_no_rope_layers_make_nope_layers(kernel):
    """`no_rope_layers=[1, 0]` (SmolLM3's field): layer 0 rotates, layer 1 attends without positions; each layer's
    attention is recomputed by hand from its input (rotation angles from the RoFormer formula)."""
    model = build(tiny_config(scheme="rope", no_rope_layers=[1, 0]), kernel)
    tokens = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    seen = {}
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(
            lambda module, args, kwargs, output, index=index: seen.__setitem__(index, (args[0], output[0])),
            with_kwargs=True,
        )
    with torch.no_grad():
        model(tokens, use_cache=False)
        dim = model.config.head_dim
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
        angles = torch.arange(7).float()[:, None] * inv_freq  # (T, D/2)
        cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
        for index, rotated in ((0, True), (1, False)):
            hidden, output = seen[index]
            expected = attention_by_hand(model.model.layers[index].self_attn, hidden, *((cos, sin) if rotated else ()))
            atol = layer_tolerance(model.model.layers[index].self_attn, hidden)  # two fp32 computations of a layer
            torch.testing.assert_close(output, expected, atol=atol, rtol=0)
        # layer 1 with the rotation would differ: the flag acts
        rotated_1 = attention_by_hand(model.model.layers[1].self_attn, seen[1][0], cos, sin)
        assert (rotated_1 - seen[1][1]).abs().max() > 1e-4
        full = model(tokens, use_cache=False).logits
    cached = decode_in_chunks(model, tokens, [3, 1, 1, 1, 1], DynamicCache(config=model.config))
    torch.testing.assert_close(cached, full, atol=model_tolerance(model.config, full), rtol=0)


def test_rope_no_rope_layers_are_checked():
    with pytest.raises(ValueError, match=r"no_rope_layers=\[1\] must hold one 0 .* per layer: 2 values"):
        tiny_config(scheme="rope", no_rope_layers=[1])
    with pytest.raises(ValueError, match=r"no_rope_layers=\[1, 2\]"):
        tiny_config(scheme="rope", no_rope_layers=[1, 2])
    with pytest.raises(ValueError, match=r"no_rope_layers=\[1, 0\].*position_scheme='alibi' has none"):
        tiny_config(scheme="alibi", no_rope_layers=[1, 0])


def test_kerple_log_matches_the_papers_formula():
    """KERPLE-log (Chi et al. 2022): bias(i, j) = −r1 · log(1 + r2 · |i − j|), r1, r2 > 0 per head, worked out here
    per entry with `math.log` from the positive coefficients the parameters stand for."""
    kerple = scheme("kerple_log")
    with torch.no_grad():  # move away from the initialisation: heads differ in both coefficients
        kerple.bias_scale.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
        kerple.bias_rate.copy_(torch.tensor([-3.0, -0.5, 1.0, 0.25]))
    r1 = [math.log1p(math.exp(x)) for x in kerple.bias_scale.tolist()]  # softplus
    r2 = [math.log1p(math.exp(x)) for x in kerple.bias_rate.tolist()]
    queries, keys = torch.arange(3, 9), torch.arange(12)
    bias = kerple.bias(queries, keys)[0]  # (H, Q, K)
    expected = torch.tensor(
        [
            [[-r1[h] * math.log(1 + r2[h] * abs(i - j)) for j in keys.tolist()] for i in queries.tolist()]
            for h in range(4)
        ]
    )
    # fp32 against Python floats: r1 · log(1 + r2·d) through the softplus (exp, log1p), the product, the sum, the
    # log and the product: a relative u each of terms of size max(|bias|, r1) (a log's absolute error is relative)
    atol = tolerance(torch.float32, magnitude=max(expected.abs().max().item(), max(r1)), steps=6)
    torch.testing.assert_close(bias, expected, atol=atol, rtol=0)
    # the per-distance values a kernel gets expand to the same matrix
    values = kerple.bias_values(3, 6, 0, 12, torch.arange(3, 9)[None])
    torch.testing.assert_close(RelativeBias(values, 6, 12).dense()[0], expected, atol=atol, rtol=0)


def test_kerple_log_coefficients_stay_positive_and_learn():
    kerple = scheme("kerple_log")
    r1, r2 = kerple.coefficients()
    torch.testing.assert_close(r1, torch.ones(4))
    torch.testing.assert_close(r2, alibi_slopes(4))
    with torch.no_grad():
        kerple.bias_scale.fill_(-30.0)
        kerple.bias_rate.fill_(-30.0)
    assert (torch.stack(kerple.coefficients()) > 0).all()
    kerple.bias(torch.arange(4), torch.arange(4)).sum().backward()
    assert kerple.bias_scale.grad.abs().min() > 0 and kerple.bias_rate.grad.abs().min() > 0


def fire_with(c: float = -0.3, threshold: float = 3.5, bidirectional: bool = False, seed: int = 0):
    """A FIRE scheme moved away from its initialisation: c = |-0.3|, L = 3.5 (queries both below and above it), f_θ
    drawn from a seed."""
    fire = POSITION_SCHEMES.get("fire")(tiny_config(scheme="fire"), bidirectional=bidirectional)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fire.distance_scale.fill_(c)
        fire.threshold_scale.fill_(-threshold / fire.initial_threshold)  # |scale| · 512
        for parameter in (*fire.mlp_in.parameters(), *fire.mlp_out.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return fire


def fire_by_hand(fire, query_position: int, key_position: int) -> list[float]:
    """b(i, j) per head from the paper's formula, in Python floats: f_θ(ψ(i − j) / ψ(max(L, i))), ψ(x) = log(c·x + 1),
    f_θ(x) = W2 relu(W1 x + b1) + b2; for a key after the query (an encoder), −ψ(j − i) / ψ(max(L, j)) (our choice)."""
    c, threshold = abs(fire.distance_scale.item()), fire.threshold().item()
    i, j = query_position, key_position
    later, sign = (i, 1.0) if j <= i else (j, -1.0)
    x = sign * math.log(c * abs(i - j) + 1) / (math.log(c * max(threshold, later) + 1) + 1e-6)
    w1, b1 = fire.mlp_in.weight[:, 0].tolist(), fire.mlp_in.bias.tolist()
    hidden = [max(0.0, w * x + b) for w, b in zip(w1, b1, strict=True)]
    w2, b2 = fire.mlp_out.weight.tolist(), fire.mlp_out.bias.tolist()
    return [sum(w * h for w, h in zip(row, hidden, strict=True)) + b for row, b in zip(w2, b2, strict=True)]


def fire_tolerance(fire, query_position: int, key_position: int) -> float:
    """`atol` of FIRE's fp32 bias b(i, j) against `fire_by_hand`: the MLP's terms Σ_k |W2_hk| (|W1_k x| + |b1_k|) +
    |b2_h| (x's own rounding, from its two logs, the division and the ε, reaches b through |W1_k x|) summed by the
    MLP's width, through the six rounded steps of x and the hidden layer."""
    i, j = query_position, key_position
    c, threshold, later = abs(fire.distance_scale.item()), fire.threshold().item(), max(i, j)
    x = math.log(c * abs(i - j) + 1) / (math.log(c * max(threshold, later) + 1) + 1e-6)
    hidden = (fire.mlp_in.weight[:, 0] * x).abs() + fire.mlp_in.bias.abs()  # (width,)
    terms = fire.mlp_out.weight.abs() @ hidden + fire.mlp_out.bias.abs()  # (H,)
    return tolerance(torch.float32, magnitude=terms.max().item(), length=hidden.numel(), steps=6)


def test_forgetting_decay_matches_the_papers_formula_on_both_sides_of_the_query():
    """Forgetting attention (Lin et al. 2025, §2): from gate logits x_l (float64), the `DecayBias` of the layer's values
    gives query i on key j ≤ i D_ij = Σ_{j < l ≤ i} log σ(x_l) (summed here with `math.log`), and a later key (an
    encoder's, our choice) Σ_{i < l ≤ j} log σ(x_l); the queries at key slots 3..5 of 8 (a cache's offset). Its rows,
    dense tensor and single scores (flex's reads) agree."""
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 3, 8, generator=generator, dtype=torch.float64) * 2  # (B, H, K) gate logits
    values = ForgettingAttention.layer_bias(states, 3, 3)  # (B, H, K + Q)
    bias = DecayBias(values, 3, 8)
    dense = bias.dense()  # (B, H, Q, K)
    assert dense.shape == bias.shape == (2, 3, 3, 8)
    torch.testing.assert_close(torch.cat([bias.rows(0, 1), bias.rows(1, 3)], dim=2), dense, atol=0, rtol=0)
    torch.testing.assert_close(bias.rows(1, 3, keys=5), dense[:, :, 1:, :5], atol=0, rtol=0)
    for b in range(2):
        for h in range(3):
            for i in range(3):
                slot = 3 + i
                for j in range(8):
                    between = range(j + 1, slot + 1) if j <= slot else range(slot + 1, j + 1)
                    expected = sum(math.log(1 / (1 + math.exp(-float(states[b, h, t])))) for t in between)
                    assert math.isclose(float(dense[b, h, i, j]), expected, abs_tol=1e-12)
                    assert float(bias[b, h, i, j]) == float(dense[b, h, i, j])


def test_fire_matches_the_papers_formula():
    """FIRE (Li et al. 2023, §3): every causal entry of the (H, Q, K) bias worked out with `math.log` and the MLP
    written out by hand, for queries 0..7 around the threshold L = 3.5."""
    fire = fire_with()
    slots = torch.arange(8)
    bias = fire.bias(slots, slots)[0]  # (H, Q, K)
    for i in range(8):
        for j in range(i + 1):
            expected = torch.tensor(fire_by_hand(fire, i, j))
            torch.testing.assert_close(bias[:, i, j], expected, atol=fire_tolerance(fire, i, j), rtol=0)
    # below L every query is normalised by ψ(L): the bias of a distance is the same for queries 0..3
    torch.testing.assert_close(bias[:, 3, 1], bias[:, 2, 0])
    assert not torch.allclose(bias[:, 7, 5], bias[:, 2, 0])  # past L it depends on the query position


def test_fire_bias_values_follow_each_rows_positions():
    """The kernels' values (B, H, Q, K): query i of a row at its position_id, keys at slot distances. A row left-padded
    by 3 (positions = slots − 3) equals the same text alone; a decoding chunk (queries at slots 5..6 over 7 keys)
    equals those rows of the full bias."""
    fire = fire_with()
    positions = torch.stack([torch.arange(7), (torch.arange(7) - 3).clamp(min=0)])  # (2, Q): row 1 left-padded by 3
    values = fire.bias_values(0, 7, 0, 7, positions)  # (2, H, 7, 7)
    assert values.shape == (2, 4, 7, 7)
    alone = fire.bias(torch.arange(4), torch.arange(4))[0]  # the 4 real tokens alone
    torch.testing.assert_close(values[1, :, 3:, 3:].tril(), alone.tril())
    chunk = fire.bias_values(5, 2, 0, 7, positions[:1, 5:])  # (1, H, 2, 7)
    torch.testing.assert_close(chunk[0], values[0, :, 5:])


def test_fire_bidirectional_inputs_are_signed_and_normalised_by_the_later_position():
    fire = fire_with(bidirectional=True)
    slots = torch.arange(8)
    bias = fire.bias(slots, slots)[0]
    for i, j in [(0, 7), (2, 5), (5, 2), (6, 6), (7, 0)]:
        expected = torch.tensor(fire_by_hand(fire, i, j))
        torch.testing.assert_close(bias[:, i, j], expected, atol=fire_tolerance(fire, i, j), rtol=0)
    inputs = fire.mlp_inputs(slots[None], slots[:, None] - slots[None, :])[0]  # (Q, K)
    assert (inputs.triu(1) < 0).sum() == 28 and inputs.abs().max() <= 1  # every later key negative, all in [-1, 1]


def test_fire_interpolates_past_the_training_length_and_learns_c_and_l():
    """FIRE's point: a query at any position maps the distances it sees into [0, 1] (ψ(i − j) ≤ ψ(max(L, i)))."""
    fire = fire_with(threshold=16.0)
    slots = torch.arange(1024)
    inputs = fire.mlp_inputs(slots[None], slots[:, None] - slots[None, :])[0].tril()  # 16× max_position_embeddings
    assert inputs.min() >= 0 and inputs.max() <= 1 and torch.isfinite(inputs).all()
    assert inputs[1023, 0].item() == pytest.approx(1.0, abs=1e-5)  # the first token, seen from any query past L
    fresh = POSITION_SCHEMES.get("fire")(tiny_config(scheme="fire"))
    assert fresh.distance_scale.item() == pytest.approx(0.1) and fresh.threshold().item() == 512.0
    fire.bias(torch.arange(12), torch.arange(12)).tril().sum().backward()
    grads = [fire.distance_scale.grad, fire.threshold_scale.grad, fire.mlp_in.weight.grad, fire.mlp_out.weight.grad]
    assert all(grad is not None and grad.abs().sum() > 0 for grad in grads)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ],
    ids=["default", "theta500", "linear", "llama3", "yarn", "dynamic"],
)
def test_rope_matches_transformers_llama(rope_parameters):
    config = tiny_config(scheme="rope", rope_parameters=rope_parameters)
    ours, reference = POSITION_SCHEMES.get("rope")(config), llama_rotary(config)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 4, 10, 8, generator=generator), torch.randn(2, 4, 10, 8, generator=generator)
    hidden = torch.zeros(2, 10, 32)
    for start in (3, 90):  # 90: past max_position_embeddings=64, where "dynamic" rescales its frequencies
        ids = torch.arange(start, start + 10)[None].expand(2, -1)
        expected = apply_rotary_pos_emb(query, key, *reference(hidden, ids))
        actual = apply_rotary(query, key, *ours.rotary(hidden, ids))
        torch.testing.assert_close(actual, expected)


def test_rope_scores_depend_on_relative_offset_only():
    rope = scheme("rope")
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 1, 8, generator=generator), torch.randn(1, 4, 1, 8, generator=generator)

    def score(m, n):
        q, _ = apply_rotary(query, query, *rope.rotary(torch.zeros(1, 1, 32), torch.tensor([[m]])))
        _, k = apply_rotary(key, key, *rope.rotary(torch.zeros(1, 1, 32), torch.tensor([[n]])))
        return (q * k).sum(-1)

    # angles up to 107 radians rounded to a relative u (their θ_i too) move the rotated entries by u·107·|x|: the
    # dot product's terms |q_d k_d| summed, times 107, through the rotation's products and sums
    magnitude = 107 * (query.abs() * key.abs()).sum(-1).max().item()
    torch.testing.assert_close(
        score(7, 3), score(107, 103), atol=tolerance(torch.float32, magnitude=magnitude, length=8, steps=4), rtol=0
    )
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)


def test_alibi_slopes_are_the_papers_geometric_sequence():
    # 8 heads: 2^-1 ... 2^-8 (Press et al. 2022, §3)
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then every other of the 8-head ones: 2^-1, 2^-3
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]))


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 8, 12, 16])
def test_alibi_slopes_match_bloom(num_heads):
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # (H, 1, 2): slope · key position
    torch.testing.assert_close(alibi_slopes(num_heads), bloom[:, 0, 1])


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = scheme("alibi")  # 4 heads: slopes 1/4, 1/16, 1/64, 1/256
    bias = alibi.bias(torch.tensor([5, 6]), torch.arange(7))  # two queries at slots 5, 6 over keys 0..6
    assert bias.shape == (1, 4, 2, 7)
    assert bias[0, 0, 0, 2].item() == pytest.approx(-0.25 * 3)
    assert bias[0, 1, 1, 0].item() == pytest.approx(-(1 / 16) * 6)
    assert bias[0, :, 1, 6].abs().sum().item() == 0.0


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16), (16, 20)])
def test_t5_buckets_match_transformers_t5(bidirectional, num_buckets, max_distance):
    distances = torch.arange(-300, 301)
    expected = T5Attention._relative_position_bucket(distances, bidirectional, num_buckets, max_distance)
    actual = t5_relative_position_bucket(distances, bidirectional, num_buckets, max_distance)
    assert torch.equal(actual, expected)


def test_t5_bias_looks_up_the_bucket_of_each_distance():
    t5 = scheme("t5_bias")  # causal, 8 buckets, max distance 16
    query_slots, key_slots = torch.tensor([20]), torch.arange(21)
    bias = t5.bias(query_slots, key_slots)
    buckets = T5Attention._relative_position_bucket(key_slots - 20, False, 8, 16)
    torch.testing.assert_close(bias[0, :, 0, :], t5.relative_attention_bias.weight[buckets].T)


def test_clamped_bias_has_one_scalar_per_head_per_clamped_distance():
    clamped = scheme("clamped_bias")  # causal, max_relative_distance 8 -> 9 distances
    assert clamped.relative_attention_bias.weight.shape == (9, 4)
    bias = clamped.bias(torch.tensor([30]), torch.arange(31))[0, :, 0]  # (H, K)
    table = clamped.relative_attention_bias.weight
    for key in range(31):
        torch.testing.assert_close(bias[:, key], table[min(30 - key, 8)])


def test_clamped_bias_for_an_encoder_covers_both_directions():
    clamped = POSITION_SCHEMES.get("clamped_bias")(tiny_config(scheme="clamped_bias", is_causal=False))
    assert clamped.relative_attention_bias.weight.shape == (17, 4)
    bias = clamped.bias(torch.tensor([10]), torch.tensor([0, 9, 10, 11, 30]))[0, :, 0]
    table = clamped.relative_attention_bias.weight
    for column, distance in enumerate([-8, -1, 0, 1, 8]):
        torch.testing.assert_close(bias[:, column], table[distance + 8])


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 32},
    ],
    ids=["default", "yarn"],
)
def test_rope_angle_table_gives_the_computed_angles_bit_for_bit(rope_parameters):
    """On the CPU the angles are gathered from a table of `cos_sin(arange(N))`, grown past its end on demand."""
    rope = scheme("rope", rope_parameters=rope_parameters)
    hidden = torch.zeros(2, 3, 32)
    for positions in (torch.tensor([[0, 5, 63], [7, 8, 9]]), torch.tensor([[64, 200, 3], [1, 2, 1000]])):
        cos, sin = rope.rotary(hidden, positions)
        expected_cos, expected_sin = rope.cos_sin(positions)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    assert rope._table[0].shape == (1024, 8)  # grown to the power of two past 1000
    cos, sin = rope.rotary(hidden, torch.tensor([[-3, 0, 2]]))  # not a gather index: computed
    torch.testing.assert_close(cos[0, 0], torch.cos(-3.0 * torch.cat([rope.inv_freq] * 2)) * rope.attention_scaling)


def test_rope_angle_table_follows_the_frequencies():
    rope = scheme("rope")
    positions = torch.tensor([[4, 70]])
    rope.rotary(torch.zeros(1, 2, 32), positions)
    rope.to(torch.float64)  # the frequencies change dtype: the table is built again from them
    assert rope._table is None
    cos, _ = rope.rotary(torch.zeros(1, 2, 32, dtype=torch.float64), positions)
    assert cos.dtype == torch.float64 and torch.equal(cos, rope.cos_sin(positions)[0].double())
    dynamic = scheme("rope", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    dynamic.rotary(torch.zeros(1, 2, 32), positions)
    assert not dynamic.tabulated and dynamic._table is None  # its frequencies change with the length seen


def test_a_traced_rope_computes_its_angles():
    """jit tracing records the computed angles: a table lookup would bake its data-dependent branch into the graph."""
    rope = scheme("rope")
    hidden = torch.zeros(1, 2, 32)
    traced = torch.jit.trace(rope, (hidden, torch.tensor([[1, 2]])))
    positions = torch.tensor([[500, 9000]])  # past any table the trace could have captured
    assert torch.equal(traced(hidden, positions)[0], rope.cos_sin(positions)[0])


def test_the_scheme_contract_has_one_method_per_bias_role():
    """`distance_bias` (the hook of a bias of distance alone), `bias_values` and its lazy stand-in `bias_recipe` (what
    the kernels get), `bias` (the dense tensor, to inspect), `layer_bias` (a per-layer scheme's); the class methods
    describe a bias to the kernel records. A new synonym needs a role of its own."""
    from plugformer.positions import PositionScheme

    roles = {"distance_bias", "bias_values", "bias_recipe", "bias", "layer_bias"}
    descriptions = {"has_bias", "bias_type", "linear_bias_slopes", "constant_bias_distance"}
    assert {name for name in vars(PositionScheme) if "bias" in name} == roles | descriptions
