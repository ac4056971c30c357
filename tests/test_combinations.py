"""The shared suite: every valid (attention_score × position_scheme × kernel) for each attention projection, plus MHA
and MQA.

A new score function, position scheme or attention projection is picked up here without edits (the parameters come
from the registries and `capabilities`).
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from conftest import (
    build,
    combinations,
    decode_in_chunks,
    projection_combinations,
    tiny_config,
    trainable_on_this_device,
)
from tolerances import model_tolerance
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from plugformer.compat import FLEX_PADDING_VERIFIED


ALL = projection_combinations()


def assert_same_logits(actual, expected, config):
    """`actual` logits `(B, N, V)` equal `expected`, two fp32 forwards through `config` that round differently (kernel
    against eager, cached against full, padded against alone): within `model_tolerance`, SAFETY · u · (the layers'
    rounded stages + √(longest reduction)) · max(max|expected|, 1)."""
    torch.testing.assert_close(actual, expected, atol=model_tolerance(config, expected), rtol=0)


def full_logits(model, tokens, **kwargs):
    with torch.no_grad():
        return model(tokens, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("score,scheme,kernel,projection", ALL)
def test_shapes_and_outputs(score, scheme, kernel, projection, tokens):
    config = tiny_config(score, scheme, projection)
    model = build(config, kernel)
    with torch.no_grad():
        out = model(tokens, use_cache=True, output_hidden_states=True)
    assert out.logits.shape == (2, 12, config.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert out.cache.get_seq_length() == 12
    keys = out.cache.layers[0].keys
    assert keys.shape[:3] == (2, config.num_key_value_heads, 12)


@pytest.mark.parametrize("score,scheme,kernel,projection", ALL)
def test_causality(score, scheme, kernel, projection, tokens):
    """Changing tokens after position t leaves logits up to t unchanged."""
    model = build(tiny_config(score, scheme, projection), kernel)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 17) % 125 + 3
    before, after = full_logits(model, tokens), full_logits(model, changed)
    assert_same_logits(after[:, :7], before[:, :7], model.config)
    assert (after[:, 7:] - before[:, 7:]).abs().max() > 1e-3


@pytest.mark.parametrize("score,scheme,kernel,projection", ALL)
def test_left_padding_matches_unpadded(score, scheme, kernel, projection, tokens):
    model = build(tiny_config(score, scheme, projection), kernel)
    lengths = (12, 8)
    padded = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for row, length in enumerate(lengths):
        padded[row, 12 - length :] = tokens[row, :length]
        mask[row, 12 - length :] = 1
    batched = full_logits(model, padded, attention_mask=mask)
    for row, length in enumerate(lengths):
        alone = full_logits(model, tokens[row : row + 1, :length])
        assert_same_logits(batched[row : row + 1, 12 - length :], alone, model.config)


@pytest.mark.parametrize("score,scheme,kernel,projection", ALL)
def test_cached_decoding_equals_full_forward(score, scheme, kernel, projection, tokens):
    """Token by token and chunked prefill, with dynamic and static caches (relative biases need true positions)."""
    model = build(tiny_config(score, scheme, projection), kernel)
    reference = full_logits(model, tokens)
    if kernel == "flex_attention":
        # Compiled flex builds one kernel per (query, key) shape on CPU (~4 s each): prefill, one step, a chunk.
        cached = decode_in_chunks(model, tokens, [6, 1, 5], DynamicCache(config=model.config))
        assert_same_logits(cached, reference, model.config)
        # refused: transformers' flex mask misreads static caches (its kernel record: `static_cache=False`)
        with pytest.raises(ValueError, match=r"flex_attention.*StaticCache"):
            decode_in_chunks(model, tokens, [6, 6], StaticCache(config=model.config, max_cache_len=16))
        return
    one_by_one = decode_in_chunks(model, tokens, [1] * 12, DynamicCache(config=model.config))
    assert_same_logits(one_by_one, reference, model.config)
    chunked = decode_in_chunks(model, tokens, [5, 4, 3], DynamicCache(config=model.config))
    assert_same_logits(chunked, reference, model.config)
    static = StaticCache(config=model.config, max_cache_len=16)
    static_logits = decode_in_chunks(model, tokens, [5, 1, 1, 1, 4], static)
    assert_same_logits(static_logits, reference, model.config)


@pytest.mark.parametrize("score,scheme,kernel,projection", [p for p in ALL if p.values[2] != "eager"])
def test_fused_kernels_match_eager(score, scheme, kernel, projection, tokens):
    config = tiny_config(score, scheme, projection)
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0  # left padding in one row, so masks and biases combine
    eager = full_logits(build(config, "eager"), tokens, attention_mask=mask)
    if kernel == "flex_attention" and not FLEX_PADDING_VERIFIED:  # transformers before 5.24: refused, loudly
        with pytest.raises(ValueError, match=r"'flex_attention' with padding .* computes wrong outputs"):
            full_logits(build(config, kernel), tokens, attention_mask=mask)
        return
    fused = full_logits(build(config, kernel), tokens, attention_mask=mask)
    assert_same_logits(fused[:1], eager[:1], config)
    assert_same_logits(fused[1:, 4:], eager[1:, 4:], config)


@pytest.mark.parametrize("score,scheme,kernel,projection", ALL)
def test_backward_reaches_every_parameter(score, scheme, kernel, projection, tokens):
    if not trainable_on_this_device(kernel):
        pytest.skip(f"{kernel} has no backward on CPU in torch {torch.__version__}")
    # 20 tokens reach every T5 bucket and clamped distance of the tiny preset (max distances 16 and 8)
    long_tokens = torch.cat([tokens, tokens[:, :8]], dim=1)
    model = build(tiny_config(score, scheme, projection), kernel).train()
    model(long_tokens, labels=long_tokens).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "score,scheme,kernel,projection", [p for p in ALL if p.values[2] == "sdpa" or p.values[0] == "additive"]
)
def test_loss_decreases_on_tiny_batch(score, scheme, kernel, projection, tokens):
    model = build(tiny_config(score, scheme, projection), kernel).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # ln(128) ≈ 4.85 at the start; memorising 24 tokens brings it well below half
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("score,scheme,kernel,projection", [p for p in ALL if p.values[2] == "eager"])
def test_save_load_round_trip(score, scheme, kernel, projection, tokens, tmp_path):
    model = build(tiny_config(score, scheme, projection), kernel)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel).eval()
    assert type(loaded) is type(model)
    torch.testing.assert_close(full_logits(loaded, tokens), full_logits(model, tokens), atol=0, rtol=0)


@pytest.mark.parametrize("num_key_value_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("score,scheme,kernel", combinations(kernels=("eager", "sdpa")))
def test_head_sharing_variants(score, scheme, kernel, num_key_value_heads, tokens):
    """Multi-head (4 kv heads) and multi-query (1): cache == full forward, sdpa == eager, gradients flow. A score that
    needs another head layout (differential pairs key/value heads) refuses it, naming the field and itself."""
    try:
        config = tiny_config(score, scheme, num_key_value_heads=num_key_value_heads)
    except ValueError as error:
        assert f"num_key_value_heads={num_key_value_heads}" in str(error) and f"attention_score={score!r}" in str(error)
        pytest.skip(f"refused: {error}")
    model = build(config, kernel)
    reference = full_logits(model, tokens)
    if kernel != "eager":
        assert_same_logits(reference, full_logits(build(config, "eager"), tokens), config)
    cached = decode_in_chunks(model, tokens, [6, 1, 1, 4], DynamicCache(config=model.config))
    assert_same_logits(cached, reference, model.config)
    model.train()
    model(tokens, labels=tokens).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("score,scheme,kernel,projection", projection_combinations(kernels=("eager", "sdpa")))
def test_packed_documents_match_each_document_alone(score, scheme, kernel, projection, tokens):
    """TRL's packing passes position_ids restarting per document and no attention mask; documents stay apart."""
    model = build(tiny_config(score, scheme, projection), kernel)
    first, second = tokens[0, :7], tokens[1, :5]
    packed = torch.cat([first, second])[None]
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
    logits = full_logits(model, packed, position_ids=position_ids)
    assert_same_logits(logits[:, :7], full_logits(model, first[None]), model.config)
    assert_same_logits(logits[:, 7:], full_logits(model, second[None]), model.config)


def test_residual_dropout_acts_in_training_only():
    """Residual dropout (a plain function in the block, no module) drops in training and is the identity in eval."""
    ids = torch.tensor([[5, 9, 2, 7]])
    model = build(tiny_config(scheme="none", hidden_dropout=0.5)).train()
    without = build(tiny_config(scheme="none", hidden_dropout=0.0))  # same seed: same weights
    assert not torch.equal(model(ids).logits, model(ids).logits)  # a fresh mask per pass
    model.eval()
    torch.testing.assert_close(model(ids).logits, without(ids).logits, rtol=0, atol=0)


def run_checks_with_fields(fields, score, scheme, kernel, tokens, monkeypatch, tmp_path, backward=True):
    """This suite's checks on one (score, scheme, kernel) of the standard projection with `fields` set on every config
    they build: how a config modifier's own tests (test_score_modifiers, test_gated_attention, ...) rerun it."""
    monkeypatch.setattr(sys.modules[__name__], "tiny_config", functools.partial(tiny_config, **fields))
    arguments = {"score": score, "scheme": scheme, "kernel": kernel, "projection": None, "tokens": tokens}
    test_causality(**arguments)
    test_left_padding_matches_unpadded(**arguments)
    test_cached_decoding_equals_full_forward(**arguments)
    if kernel != "eager":
        test_fused_kernels_match_eager(**arguments)
    test_save_load_round_trip(**arguments, tmp_path=tmp_path)
    if backward and trainable_on_this_device(kernel):  # flex has no CPU backward
        test_backward_reaches_every_parameter(**arguments)
