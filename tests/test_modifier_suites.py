"""The shared suites rerun with each of these attention modifiers set: per-layer attention types
(`layer_types`, mixed sliding and full layers), gated attention, value residuals and exclusive
self-attention, read from `variants.ATTENTION_MODIFIERS` (the README's and the bench's table) at the suites' sizes.
Each modifier's reference test lives in its own file (test_layer_types, test_gated_attention, test_value_residual,
test_exclusive_self_attention), with the causal suite's checks; here the encoder, packing and seq2seq suites, the
kernels besides eager and sdpa, and transformers' conformance checks meet them too. (The latent projection, an axis
of its own, is in every suite through `conftest.PROJECTIONS`.)
"""

from __future__ import annotations

import functools

import pytest
import test_combinations as combinations_suite
import test_conformance as conformance
import test_encoder as encoder_suite
import test_packing as packing_suite
import test_seq2seq as seq2seq_suite
from conftest import modifier_combinations, tiny_config

from plugformer import (
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
    supported_kernels,
)
from plugformer.runtime.variants import ATTENTION_MODIFIERS, modifier_fields


# the modifiers these suites rerun (exclusive self-attention's reference test: test_exclusive_self_attention)
RERUN_MODIFIERS = ("layer_types", "use_gated_attention", "value_residual", "exclusive_self_attention")
LAYERS, WINDOW = 3, 3  # a window shorter than the suites' 7-12 token inputs, so the sliding layers differ


def suite_fields(name: str) -> dict:
    """The config fields of modifier `name` at the suites' sizes, with its last value (`value_residual='learned'`:
    the fixed mix's code path, with λ learned)."""
    fields = {"num_hidden_layers": LAYERS, **modifier_fields(name, ATTENTION_MODIFIERS[name][-1], LAYERS)}
    return fields | ({"sliding_window": WINDOW} if "sliding_window" in fields else {})


MODIFIERS = {name: suite_fields(name) for name in RERUN_MODIFIERS}
SEQ2SEQ = dict(is_encoder_decoder=True, pad_token_id=seq2seq_suite.PAD, eos_token_id=seq2seq_suite.EOS)


def accepts(fields: dict) -> bool:
    try:
        PlugformerConfig.from_preset("tiny", **fields)
    except ValueError:
        return False
    return True


# a seq2seq model takes one attention kind for all its layers: mixed `layer_types` is refused there (tested below)
SEQ2SEQ_MODIFIERS = [name for name, fields in MODIFIERS.items() if accepts({**fields, **SEQ2SEQ})]


def modified(names=MODIFIERS, **overrides) -> list:
    """(modifier, score, scheme, kernel) on eager and sdpa (`modifier_combinations`: the rows outside the default run
    are `slow`)."""
    return [
        pytest.param(name, *p.values, id=f"{name}-{p.id}", marks=p.marks)
        for name in names
        for p in modifier_combinations(**MODIFIERS[name], **overrides)
    ]


def test_the_suites_rerun_modifiers_of_the_modifier_table():
    """Every modifier these suites rerun is a row of the modifier table, and the seq2seq reruns leave out only the mixed
    layer kinds, which a seq2seq config refuses naming the field."""
    assert set(RERUN_MODIFIERS) <= set(ATTENTION_MODIFIERS)
    assert set(MODIFIERS) - set(SEQ2SEQ_MODIFIERS) == {"layer_types"}
    with pytest.raises(ValueError, match=r"layer_types=.* mixes kinds, which is_encoder_decoder=True"):
        PlugformerConfig.from_preset("tiny", **MODIFIERS["layer_types"], **SEQ2SEQ)


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified(is_causal=False))
def test_encoder_suite_with_modifier(modifier, score, scheme, kernel, tokens, monkeypatch):
    monkeypatch.setattr(encoder_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    encoder_suite.test_every_token_sees_later_tokens(score, scheme, kernel, None, tokens)
    encoder_suite.test_padding_does_not_change_real_tokens(score, scheme, kernel, None, tokens)
    if kernel != "eager":
        encoder_suite.test_fused_kernels_match_eager_bidirectionally(score, scheme, kernel, None, tokens)
    encoder_suite.test_masked_lm_backward_reaches_every_parameter(score, scheme, kernel, None, tokens)


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified())
def test_packing_suite_with_modifier(modifier, score, scheme, kernel, monkeypatch):
    monkeypatch.setattr(packing_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    packing_suite.test_packed_documents_equal_each_document_alone(score, scheme, kernel, None)


source = seq2seq_suite.source  # the seq2seq suite's source batch, as a fixture here


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified(SEQ2SEQ_MODIFIERS, **SEQ2SEQ))
def test_seq2seq_suite_with_modifier(modifier, score, scheme, kernel, source, tokens, monkeypatch):
    monkeypatch.setattr(seq2seq_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    seq2seq_suite.test_cached_decoding_equals_uncached(score, scheme, kernel, source, tokens)
    if kernel != "eager":
        seq2seq_suite.test_fused_kernels_match_eager(score, scheme, kernel, source, tokens)


# transformers' conformance checks (test_conformance) on scaled_dot + rope with each modifier: the classes rerun here
# with this module's fixtures, which build their models with the modifier set
@pytest.fixture(scope="class", params=list(MODIFIERS))
def causal(request):
    return conformance.make(PlugformerForCausalLM, "scaled_dot", "rope", **MODIFIERS[request.param])


@pytest.fixture(scope="class", params=list(MODIFIERS))
def encoder(request):
    fields = {**MODIFIERS[request.param], **conformance.ENCODER}
    return {
        "masked": conformance.make(PlugformerForMaskedLM, "scaled_dot", "rope", **fields),
        "sequence": conformance.make(PlugformerForSequenceClassification, "scaled_dot", "rope", num_labels=3, **fields),
        "token": conformance.make(PlugformerForTokenClassification, "scaled_dot", "rope", num_labels=5, **fields),
    }


@pytest.fixture(scope="class", params=SEQ2SEQ_MODIFIERS)
def seq2seq(request):
    fields = {**MODIFIERS[request.param], **conformance.SEQ2SEQ}
    return conformance.make(PlugformerForConditionalGeneration, "scaled_dot", "rope", **fields)


class TestCausalLMConformanceWithModifier(conformance.TestCausalLM):
    pass


class TestEncoderHeadsConformanceWithModifier(conformance.TestEncoderHeads):
    pass


class TestSeq2SeqConformanceWithModifier(conformance.TestSeq2Seq):
    pass


def other_kernels() -> list:
    """(modifier, kernel) for each kernel here besides eager and sdpa (the suites above) that the kernel table says
    computes scaled_dot + rope with the modifier set: flex_attention on the CPU, the flash kernels where installed."""
    return [
        pytest.param(name, kernel, id=f"{name}-{kernel}")
        for name, fields in MODIFIERS.items()
        for kernel in supported_kernels(tiny_config("scaled_dot", "rope", **fields))
        if kernel not in ("eager", "sdpa")
    ]


@pytest.mark.parametrize("modifier,kernel", other_kernels())
def test_other_kernels_match_eager_with_modifier(modifier, kernel, tokens, monkeypatch):
    monkeypatch.setattr(combinations_suite, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    combinations_suite.test_fused_kernels_match_eager("scaled_dot", "rope", kernel, None, tokens)
