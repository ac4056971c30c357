"""Score modifiers, config fields composing with the dot-product scores: each against a transformers reference model
or its formula computed here with plain torch, then the shared suite's checks rerun with the field set.

- `use_qk_norm`: Qwen3's per-head RMSNorm on q and k before RoPE (transformers' `Qwen3ForCausalLM`, same weights).
"""

from __future__ import annotations

import functools

import pytest
import test_combinations as shared
import torch
from conftest import build, combinations, tiny_config
from transformers import Qwen3Config, Qwen3ForCausalLM

from plugformer import ATTENTION_SCORES, PlugformerForCausalLM


def qwen3_twin(**overrides):
    """A tiny Qwen3 and the plugformer model with its weights (the module names are the same)."""
    fields = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(Qwen3Config(**fields, attn_implementation="eager")).eval()
    with torch.no_grad():  # Qwen3 starts its norms at 1: move them, or a missed norm would go unseen
        for name, parameter in reference.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    config = tiny_config("scaled_dot", "rope", use_qk_norm=True, rope_parameters=fields["rope_parameters"], **overrides)
    model = PlugformerForCausalLM(config).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_qk_norm_matches_qwen3(kernel, tokens):
    reference, model = qwen3_twin()
    model.set_attn_implementation(kernel)
    with torch.no_grad():
        expected, got = reference(tokens).logits, model(tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_qk_norm_is_off_by_default_and_type_checked():
    assert not tiny_config().use_qk_norm
    assert "q_norm.weight" not in dict(build(tiny_config()).model.layers[0].self_attn.named_parameters())
    with pytest.raises(TypeError, match="use_qk_norm"):
        tiny_config(use_qk_norm="yes")


# The shared suite's checks (test_combinations), rerun with each modifier set, on every dot-product score and
# eager/sdpa, for the schemes that rotate (the order matters there), bias the scores and do neither.
MODIFIERS = {"qk_norm": {"use_qk_norm": True}}
SCHEMES = ("none", "rope", "alibi")
CHECKS = (shared.test_causality, shared.test_left_padding_matches_unpadded, shared.test_cached_decoding_equals_full_forward,
          shared.test_fused_kernels_match_eager, shared.test_backward_reaches_every_parameter)  # fmt: skip


def modified_combinations():
    params = []
    for modifier, fields in MODIFIERS.items():
        for param in combinations(kernels=("eager", "sdpa"), **fields):
            score, scheme, kernel = param.values
            if scheme in SCHEMES and ATTENTION_SCORES.get(score).dot_product:
                params.append(pytest.param(modifier, score, scheme, kernel, id=f"{modifier}-{param.id}"))
    return params


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified_combinations())
def test_shared_checks_with_modifier(modifier, score, scheme, kernel, tokens, monkeypatch, request):
    monkeypatch.setattr(shared, "tiny_config", functools.partial(tiny_config, **MODIFIERS[modifier]))
    for check in CHECKS:
        if check is shared.test_fused_kernels_match_eager and kernel == "eager":
            continue
        arguments = {"score": score, "scheme": scheme, "kernel": kernel, "tokens": tokens}
        if check is shared.test_left_padding_matches_unpadded:
            arguments["request"] = request
        check(**arguments)
    shared.test_save_load_round_trip(score, scheme, kernel, tokens, request.getfixturevalue("tmp_path"))


@pytest.mark.parametrize("head", ["causal_lm", "seq2seq"])
def test_qk_norm_parameters_are_counted(head):
    from plugformer import PlugformerForConditionalGeneration
    from plugformer.memory import parameter_count

    seq2seq = head == "seq2seq"
    config = tiny_config(use_qk_norm=True, is_encoder_decoder=seq2seq, pad_token_id=0 if seq2seq else None)
    model = (PlugformerForConditionalGeneration if seq2seq else PlugformerForCausalLM)(config)
    assert parameter_count(config, head) == sum(p.numel() for p in model.parameters())
