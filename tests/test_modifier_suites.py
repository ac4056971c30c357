"""The encoder and packing suites rerun with each of the third-wave attention modifiers set: per-layer attention
types (`layer_types`, mixed sliding and full layers), gated attention and value residuals. Each modifier's reference
test lives in its own file (test_layer_types, test_gated_attention, test_value_residual), with the causal suite's
checks; here the bidirectional masks, padding and packed documents meet them too.
"""

from __future__ import annotations

import functools

import pytest
import test_encoder as encoder_suite
import test_packing as packing_suite
from conftest import modifier_combinations, tiny_config


MODIFIERS = {
    "layer_types": {"num_hidden_layers": 3, "sliding_window": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gated": {"use_gated_attention": True},
    "value_residual": {"value_residual": "learned"},
}  # fmt: skip


def modified(**overrides) -> list:
    """(modifier, score, scheme, kernel) on eager and sdpa (`modifier_combinations`: the rows outside the default run
    are `slow`)."""
    return [pytest.param(name, *p.values, id=f"{name}-{p.id}", marks=p.marks)
            for name, fields in MODIFIERS.items()
            for p in modifier_combinations(**fields, **overrides)]  # fmt: skip


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified(is_causal=False))
def test_encoder_suite_with_modifier(modifier, score, scheme, kernel, tokens, monkeypatch, request):
    monkeypatch.setattr(encoder_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    encoder_suite.test_every_token_sees_later_tokens(score, scheme, kernel, None, tokens)
    encoder_suite.test_padding_does_not_change_real_tokens(score, scheme, kernel, None, tokens, request)
    if kernel != "eager":
        encoder_suite.test_fused_kernels_match_eager_bidirectionally(score, scheme, kernel, None, tokens)
    encoder_suite.test_masked_lm_backward_reaches_every_parameter(score, scheme, kernel, None, tokens)


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified())
def test_packing_suite_with_modifier(modifier, score, scheme, kernel, monkeypatch):
    monkeypatch.setattr(packing_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    packing_suite.test_packed_documents_equal_each_document_alone(score, scheme, kernel, None)
