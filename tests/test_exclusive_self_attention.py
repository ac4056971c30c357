"""`exclusive_self_attention`: exclusive self-attention (Zhai 2026, "Exclusive Self Attention"), each head's output
less its component along the token's own value, z_i = y_i − (y_i·v_i / ‖v_i‖²) v_i.

The formula is checked by hand in float64 on a GQA layer: its queries, keys and values recomputed here from the
layer's input and weights, the softmax attention y, then z written out as loops and passed through o_proj. Then its
placement (self-attention only, after a score's output step), the latent projection's values and cache, the numerics
of a zero value, and the shared suite's checks with the field set (test_modifier_suites reruns the encoder, packing,
seq2seq and conformance suites with it).
"""

from __future__ import annotations

import pytest
import test_combinations as shared
import torch
from conftest import build, decode_in_chunks, modifier_combinations, tiny_config
from tolerances import layer_tolerance, model_tolerance
from transformers import DynamicCache, StaticCache

import plugformer.attention
from plugformer import PlugformerForConditionalGeneration
from plugformer.attention import exclude_own_values


def layer_input_and_output(model, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first block's input, its self-attention's output) of a forward without a cache."""
    seen = {}
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda module, args: seen.setdefault("input", args[0].detach()))
    layer.self_attn.register_forward_hook(lambda module, args, output: seen.setdefault("output", output[0].detach()))
    with torch.no_grad():
        model(tokens, use_cache=False)
    return seen["input"], seen["output"]


def reference_layer(attention, normed: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of `normed` (B, T, d) with the layer's weights, then z_i = y_i − (y_i·v_i / ‖v_i‖²) v_i
    per query head h with v_i of key/value head h // (H / H_kv), written out as loops, then o_proj; float64."""
    batch, length, _ = normed.shape
    heads, kv_heads, dim = 4, 2, attention.head_dim
    query = (normed @ attention.q_proj.weight.T).view(batch, length, heads, dim)
    key = (normed @ attention.k_proj.weight.T).view(batch, length, kv_heads, dim)
    value = (normed @ attention.v_proj.weight.T).view(batch, length, kv_heads, dim)
    out = torch.zeros(batch, length, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            m = h // (heads // kv_heads)
            for i in range(length):
                scores = torch.stack([query[b, i, h] @ key[b, j, m] for j in range(i + 1)]) * dim**-0.5
                y = (scores.softmax(-1)[:, None] * value[b, : i + 1, m]).sum(0)
                v = value[b, i, m]
                out[b, i, h] = y - (y @ v) / (v @ v) * v
    return out.reshape(batch, length, heads * dim) @ attention.o_proj.weight.T


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_exclusive_self_attention_follows_the_formula_in_float64(kernel, tokens):
    model = build(tiny_config("scaled_dot", "none", exclusive_self_attention=True), kernel).double()
    hidden, got = layer_input_and_output(model, tokens)
    layer = model.model.layers[0]
    with torch.no_grad():
        normed = layer.input_layernorm(hidden)
        expected = reference_layer(layer.self_attn, normed)
    # float64 throughout, but eager's softmax, which runs in fp32 whatever its input (as transformers' eager kernels)
    atol = layer_tolerance(layer.self_attn, normed, torch.float32 if kernel == "eager" else torch.float64)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    plain = build(tiny_config("scaled_dot", "none"), kernel).double()  # the same weights: no parameter is added
    assert plain.state_dict().keys() == model.state_dict().keys()
    assert (layer_input_and_output(plain, tokens)[1] - got).abs().max() > 1e-3


def test_each_output_is_orthogonal_to_its_own_value_and_a_zero_value_is_safe():
    generator = torch.Generator().manual_seed(0)
    output = torch.randn(2, 5, 4, 8, generator=generator)  # (B, Q, H, D)
    values = torch.randn(2, 2, 5, 8, generator=generator)  # (B, H_kv, Q, D)
    values[0, 1, 3] = 0  # a zero value: the output stays as it is
    excluded = exclude_own_values(output, values, 2, 2, 5)
    own = values.transpose(1, 2).repeat_interleave(2, dim=2)  # (B, Q, H, D): head h reads key/value head h // 2
    torch.testing.assert_close((excluded * own).sum(-1), torch.zeros(2, 5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(excluded[0, 3, 2:], output[0, 3, 2:], atol=0, rtol=0)
    half = exclude_own_values(output.bfloat16(), values.bfloat16(), 2, 2, 5)  # computed in fp32, returned in bf16
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    flat = exclude_own_values(output.reshape(10, 32), values, 2, 2, 5)  # vLLM's (B·Q, H·D) kernel output
    torch.testing.assert_close(flat, excluded, atol=0, rtol=0)


def test_self_attention_only_after_the_scores_output_step(tokens, monkeypatch):
    """Each self-attention excludes (a seq2seq model's encoder and decoder layers), no cross-attention does; with
    differential attention after its difference and norm: the first token, which attends to itself alone, keeps a
    clean zero instead of normalised rounding noise, so cached decoding equals the full forward."""
    calls = []
    original = plugformer.attention.exclude_own_values
    monkeypatch.setattr(
        plugformer.attention,
        "exclude_own_values",
        lambda output, *args: calls.append(output.shape) or original(output, *args),
    )
    config = tiny_config(exclusive_self_attention=True, is_encoder_decoder=True, pad_token_id=0)
    torch.manual_seed(0)
    with torch.no_grad():
        PlugformerForConditionalGeneration(config).eval()(tokens, decoder_input_ids=tokens[:, :5])
    assert calls == [(2, 12, 4, 8)] * 2 + [(2, 5, 4, 8)] * 2  # 2 encoder, 2 decoder self-attention layers
    calls.clear()
    model = build(tiny_config("differential", "rope", exclusive_self_attention=True))
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
    assert calls[0] == (2, 12, 2, 16)  # H/2 differential heads of 2·D: after `prepare_output`
    cached = decode_in_chunks(model, tokens, [1] * 12, DynamicCache(config=model.config))
    torch.testing.assert_close(cached, full, atol=model_tolerance(model.config, full), rtol=0)


@pytest.mark.parametrize("latent_cache", [False, True], ids=["expanded-cache", "latent-cache"])
def test_latent_attention_excludes_each_heads_expanded_value(latent_cache, tokens):
    """Multi-head latent attention has a value per token and head, expanded from the token's latent
    (`LatentProjection.token_values`): cached decoding (dynamic and static caches, expanded or latent) equals the full
    forward, and the field changes the output."""
    fields = dict(attention_projection="latent", num_key_value_heads=4, use_latent_cache=latent_cache)
    model = build(tiny_config(exclusive_self_attention=True, **fields))
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        plain = build(tiny_config(**fields))(tokens, use_cache=False).logits
    assert (plain - full).abs().max() > 1e-3
    atol = model_tolerance(model.config, full)
    torch.testing.assert_close(
        decode_in_chunks(model, tokens, [5, 1, 6], DynamicCache(config=model.config)), full, atol=atol, rtol=0
    )
    static = StaticCache(config=model.config, max_cache_len=16)
    torch.testing.assert_close(decode_in_chunks(model, tokens, [5, 1, 1, 5], static), full, atol=atol, rtol=0)


def test_exclusive_self_attention_is_off_by_default_and_type_checked():
    assert not tiny_config().exclusive_self_attention
    assert build(tiny_config()).model.layers[0].self_attn.exclusive is False
    with pytest.raises(TypeError, match="exclusive_self_attention"):
        tiny_config(exclusive_self_attention="yes")


@pytest.mark.parametrize("score,scheme,kernel", modifier_combinations(exclusive_self_attention=True))
def test_shared_checks_with_exclusive_self_attention(score, scheme, kernel, tokens, monkeypatch, tmp_path):
    shared.run_checks_with_fields(
        dict(exclusive_self_attention=True), score, scheme, kernel, tokens, monkeypatch, tmp_path
    )
