"""The bidirectional (BERT-style) use of the stack: every valid combination, plus the classification heads."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import projection_combinations, tiny_config, trainable_on_this_device
from tolerances import model_tolerance
from transformers import AutoModelForMaskedLM

from plugformer import (
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
)


ENCODERS = projection_combinations(all_flex=False, representative=True, is_causal=False)


def encoder(score, scheme, kernel="eager", head=PlugformerForMaskedLM, seed=0, projection=None, **overrides):
    config = copy.deepcopy(tiny_config(score, scheme, projection, is_causal=False, pad_token_id=0, **overrides))
    config._attn_implementation = kernel
    torch.manual_seed(seed)
    return head(config).eval()


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


@pytest.mark.parametrize("score,scheme,kernel,projection", ENCODERS)
def test_every_token_sees_later_tokens(score, scheme, kernel, projection, tokens):
    model = encoder(score, scheme, kernel, projection=projection)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 11) % 125 + 3
    before, after = logits(model, tokens), logits(model, changed)
    # earlier tokens see the last one (a causal model gives exactly 0 here); unscaled dot products with sinusoids
    # make attention so peaked that the effect can be small
    assert (after[:, :-1] - before[:, :-1]).abs().max() > 1e-6


@pytest.mark.parametrize("score,scheme,kernel,projection", ENCODERS)
def test_padding_does_not_change_real_tokens(score, scheme, kernel, projection, tokens):
    """Right padding (BERT's habit) and left padding both leave the real tokens' outputs unchanged."""
    model = encoder(score, scheme, kernel, projection=projection)
    alone = logits(model, tokens[:1, :8])
    for side in ("right", "left"):
        ids, mask = torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long)
        real = slice(0, 8) if side == "right" else slice(4, 12)
        ids[0, real], mask[0, real] = tokens[0, :8], 1
        # padded against alone: fp32's rounding through the model times max|logits| (`model_tolerance`)
        atol = model_tolerance(model.config, alone)
        torch.testing.assert_close(logits(model, ids, attention_mask=mask)[:, real], alone, atol=atol, rtol=0)


@pytest.mark.parametrize("score,scheme,kernel,projection", [p for p in ENCODERS if p.values[2] != "eager"])
def test_fused_kernels_match_eager_bidirectionally(score, scheme, kernel, projection, tokens):
    mask = torch.ones_like(tokens)
    mask[1, 9:] = 0
    eager = encoder(score, scheme, projection=projection)
    expected = logits(eager, tokens, attention_mask=mask)
    actual = logits(encoder(score, scheme, kernel, projection=projection), tokens, attention_mask=mask)
    # the kernel against eager: `model_tolerance`, the magnitude max|logits| of the real tokens
    real = max(expected[0].abs().max().item(), expected[1, :9].abs().max().item(), 1.0)
    atol = model_tolerance(eager.config, expected, magnitude=real)
    torch.testing.assert_close(actual[0], expected[0], atol=atol, rtol=0)
    torch.testing.assert_close(actual[1, :9], expected[1, :9], atol=atol, rtol=0)


@pytest.mark.parametrize("score,scheme,kernel,projection", ENCODERS)
def test_masked_lm_backward_reaches_every_parameter(score, scheme, kernel, projection, tokens):
    if not trainable_on_this_device(kernel):
        pytest.skip(f"{kernel} has no backward on CPU in torch {torch.__version__}")
    model = encoder(score, scheme, kernel, projection=projection).train()
    ids = torch.cat([tokens, tokens[:, :8]], dim=1)  # 20 tokens: every bucket / clamped distance in both directions
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    model(ids, labels=labels).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("score,scheme,kernel,projection", [p for p in ENCODERS if p.values[2] == "eager"])
def test_masked_lm_round_trips_through_auto_class(score, scheme, kernel, projection, tokens, tmp_path):
    model = encoder(score, scheme, projection=projection)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation=kernel).eval()
    assert type(loaded) is PlugformerForMaskedLM and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(logits(loaded, tokens), logits(model, tokens), atol=0, rtol=0)


def test_masked_lm_loss_is_cross_entropy_over_labelled_positions(tokens):
    model = encoder("scaled_dot", "alibi")
    labels = torch.full_like(tokens, -100)
    labels[0, 3], labels[1, 7] = tokens[0, 3], tokens[1, 7]
    out = model(tokens, labels=labels)
    expected = -(out.logits[0, 3].log_softmax(-1)[tokens[0, 3]] + out.logits[1, 7].log_softmax(-1)[tokens[1, 7]]) / 2
    torch.testing.assert_close(out.loss, expected)


def test_masked_lm_refuses_a_causal_config():
    with pytest.raises(ValueError, match="needs a bidirectional encoder, but is_causal=True"):
        PlugformerForMaskedLM(PlugformerConfig.from_preset("tiny"))


@pytest.mark.parametrize("is_causal", [False, True], ids=["encoder", "decoder"])
def test_sequence_classification_pools_the_last_real_token(is_causal, tokens):
    """Pooled logits equal the per-token logits at each row's last real token, whatever the padding side."""
    config = tiny_config("scaled_dot", "rope", is_causal=is_causal, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(config).eval()
    ids, mask = tokens.clone(), torch.ones_like(tokens)
    ids[0, 9:], mask[0, 9:] = 0, 0  # right-padded row: last real token at 8
    ids[1, :2], mask[1, :2] = 0, 0  # left-padded row: last real token at 11
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        per_token = model.score(out.hidden_states[-1])
    torch.testing.assert_close(out.logits, torch.stack([per_token[0, 8], per_token[1, 11]]))
    labels = torch.tensor([2, 0])
    expected = torch.nn.functional.cross_entropy(out.logits, labels)
    torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss, expected)


def test_reward_model_regression_head(tokens):
    """num_labels=1: one scalar per sequence and a mean-squared-error loss (TRL's RewardTrainer uses the scalar)."""
    config = tiny_config(num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(config)
    out = model(tokens, labels=torch.tensor([1.0, -1.0]))
    assert out.logits.shape == (2, 1)
    torch.testing.assert_close(out.loss, ((out.logits.squeeze(-1) - torch.tensor([1.0, -1.0])) ** 2).mean())


def test_token_classification_loss_and_shapes(tokens):
    model = encoder("additive", "t5_bias", head=PlugformerForTokenClassification, num_labels=5)
    labels = tokens % 5
    labels[:, :2] = -100
    out = model(tokens, labels=labels)
    assert out.logits.shape == (2, 12, 5)
    expected = torch.nn.functional.cross_entropy(out.logits[:, 2:].reshape(-1, 5), labels[:, 2:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


def test_causal_and_encoder_weights_are_interchangeable(tokens):
    """The same parameters serve both directions: a causal LM checkpoint initialises an encoder."""
    causal = PlugformerForCausalLM(tiny_config("scaled_dot", "alibi", pad_token_id=0))
    masked = encoder("scaled_dot", "alibi")
    masked.load_state_dict(causal.state_dict(), strict=True)
    # with one token there is nothing to the left or right: both directions must compute the same logits
    with torch.no_grad():
        torch.testing.assert_close(masked(tokens[:, :1]).logits, causal.eval()(tokens[:, :1]).logits)


def test_encoder_heads_ignore_use_cache():
    """Generic loops pass `use_cache`; an encoder keeps no cache and must not fail on a duplicate keyword."""
    from plugformer import PlugformerForMaskedLM

    torch.manual_seed(0)
    model = PlugformerForMaskedLM(PlugformerConfig.from_preset("tiny", is_causal=False)).eval()
    ids = torch.randint(3, 100, (1, 6))
    torch.testing.assert_close(model(ids, use_cache=True).logits, model(ids).logits)
