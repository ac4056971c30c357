"""Score modifiers, config fields composing with the dot-product scores: each against a transformers reference model
or its formula computed here with plain torch, then the shared suite's checks rerun with the field set.

- `use_qk_norm`: Qwen3's per-head RMSNorm on q and k before RoPE (transformers' `Qwen3ForCausalLM`, same weights).
- `attn_logit_softcapping`: Gemma 2's c·tanh(logits / c) before the mask, on eager and flex; sdpa refuses it.
- `use_attention_sinks`: gpt-oss's learned sink logit per head (transformers' gpt-oss `eager_attention_forward`).
"""

from __future__ import annotations

import pytest
import test_combinations as shared
import torch
from conftest import build, tiny_config
from tolerances import model_tolerance, softmax_spread, tolerance
from transformers import Qwen3Config, Qwen3ForCausalLM

from plugformer import ATTENTION_SCORES, PlugformerForCausalLM, supported_kernels


def qwen3_twin(**overrides):
    """A tiny Qwen3 and the plugformer model with its weights (the module names are the same)."""
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
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
    torch.testing.assert_close(got, expected, atol=model_tolerance(model.config, expected), rtol=0)  # two fp32 models


def test_qk_norm_is_off_by_default_and_type_checked():
    assert not tiny_config().use_qk_norm
    assert "q_norm.weight" not in dict(build(tiny_config()).model.layers[0].self_attn.named_parameters())
    with pytest.raises(TypeError, match="use_qk_norm"):
        tiny_config(use_qk_norm="yes")


# The shared suite's checks (test_combinations), rerun with each modifier set, on every dot-product score and
# eager/sdpa, for the schemes that rotate (the order matters there), bias the scores and do neither.
MODIFIERS = {
    "qk_norm": {"use_qk_norm": True},
    "softcap": {"attn_logit_softcapping": 5.0},
    "sinks": {"use_attention_sinks": True},
}
SCHEMES = ("none", "rope", "alibi")
CHECKS = (shared.test_causality, shared.test_left_padding_matches_unpadded, shared.test_cached_decoding_equals_full_forward,
          shared.test_fused_kernels_match_eager, shared.test_backward_reaches_every_parameter)  # fmt: skip


def modified_combinations():
    """(modifier, score, scheme, kernel) for the kernels the table lets compute it; flex (seconds per compiled shape on
    CPU) for `scaled_dot` only."""
    params = []
    for modifier, fields in MODIFIERS.items():
        for score in [name for name in ATTENTION_SCORES.names() if ATTENTION_SCORES.get(name).dot_product]:
            for scheme in SCHEMES:
                for kernel in supported_kernels(tiny_config(score, scheme, **fields)):
                    if kernel in ("eager", "sdpa") or (kernel == "flex_attention" and score == "scaled_dot"):
                        # flex compiles per shape on the CPU (10-40 s a row): its rows run with -m slow; softcap on
                        # flex against the formula stays in the default run (test_softcap_matches_formula)
                        marks = pytest.mark.slow if kernel == "flex_attention" else ()
                        params.append(
                            pytest.param(
                                modifier, score, scheme, kernel, marks=marks, id=f"{modifier}-{score}-{scheme}-{kernel}"
                            )
                        )
    return params


@pytest.mark.parametrize("modifier,score,scheme,kernel", modified_combinations())
def test_shared_checks_with_modifier(modifier, score, scheme, kernel, tokens, monkeypatch, tmp_path):
    shared.run_checks_with_fields(MODIFIERS[modifier], score, scheme, kernel, tokens, monkeypatch, tmp_path)


@pytest.mark.parametrize("head", ["causal_lm", "seq2seq"])
def test_qk_norm_and_sink_parameters_are_counted(head):
    from plugformer import PlugformerForConditionalGeneration
    from plugformer.runtime.memory import parameter_count

    seq2seq = head == "seq2seq"
    config = tiny_config(
        use_qk_norm=True, use_attention_sinks=True, is_encoder_decoder=seq2seq, pad_token_id=0 if seq2seq else None
    )
    model = (PlugformerForConditionalGeneration if seq2seq else PlugformerForCausalLM)(config)
    assert parameter_count(config, head) == sum(p.numel() for p in model.parameters())


# --- attn_logit_softcapping (Gemma 2) ----------------------------------------------------------------------------


def sink_or_cap_tolerance(query, key, value, scaling, logits, allowed, steps):
    """`atol` of fp32 attention over `logits` `(B, H, Q, K')` (capped, or with a sink's column; `allowed` True where
    a key is seen) against the same in fp64 or in fp32 elsewhere (the weights: magnitude 1 in place of max|V|): the
    row's softmax over its keys (spread, exp and the division), the dot product's rounding in units of u
    (√D · scaling · max Σ_d |q_d k_d|; a cap's tanh passes it on with slope ≤ 1) and the score's own `steps`."""
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, 1)
    dot = query.shape[-1] ** 0.5 * scaling * (query.double().abs() @ key.abs().transpose(-1, -2)).max().item()
    spread = softmax_spread(logits, allowed) + dot + steps
    bound = tolerance(
        torch.float32, magnitude=value.abs().max().item(), length=logits.shape[-1], spread=spread, steps=2
    )
    weights = tolerance(torch.float32, length=logits.shape[-1], spread=spread, steps=2)
    return bound, weights


def capped_attention(query, key, value, scaling, cap, mask):
    """softmax(c·tanh(scaling·q·k / c) + mask) V in float64, one head per key head (Gemma 2's eager order)."""
    logits = (query.double() @ key.double().transpose(-1, -2)) * scaling
    logits = cap * torch.tanh(logits / cap) + mask
    return (logits.softmax(-1) @ value.double()).transpose(1, 2)  # (B, Q, H, D)


@pytest.mark.parametrize("kernel", ["eager", "flex_attention"])
def test_softcap_matches_formula(kernel):
    from plugformer.capabilities import ALL_ATTENTION_FUNCTIONS
    from plugformer.kernels import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    query, key, value = (4 * torch.randn(1, 2, 6, 8, generator=generator) for _ in range(3))  # logits ≫ the cap
    causal = torch.full((6, 6), float("-inf")).triu(1)
    expected = capped_attention(query, key, value, 0.5, 3.0, causal)
    config = tiny_config(attn_logit_softcapping=3.0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.config = 1, True, config
    module.eval()
    function = eager_attention_forward if kernel == "eager" else ALL_ATTENTION_FUNCTIONS[kernel]
    mask = causal[None, None] if kernel == "eager" else None  # flex: causal through is_causal... built below
    if kernel == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 6, 6, device="cpu")
    out, _ = function(module, query, key, value, mask, scaling=0.5, softcap=3.0)
    logits = 3.0 * torch.tanh(query.double() @ key.double().transpose(-1, -2) * 0.5 / 3.0)
    # the cap's tanh, division and product: 3 steps of a score of size ≤ 3 (in units of u: 9)
    atol, _ = sink_or_cap_tolerance(query, key, value, 0.5, logits, causal == 0, steps=3 * 3.0)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    uncapped = capped_attention(query, key, value, 0.5, 1e9, causal)
    assert (uncapped - expected).abs().max() > 0.1  # the cap matters at these logits


def test_softcap_is_refused_by_kernels_that_cannot_apply_it():
    config = tiny_config(attn_logit_softcapping=30.0)
    assert PlugformerForCausalLM(config).config._attn_implementation == "eager"  # not sdpa, which would drop it
    for kernel in ("sdpa", "flash_attention_2"):
        with pytest.raises(ValueError, match=rf"attn_implementation='{kernel}' cannot cap .*softcapping=30.0"):
            build(config, kernel)(torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="attn_implementation='sdpa' cannot cap"):
        build(config).set_attn_implementation("sdpa")


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        (dict(attn_logit_softcapping=0.0), ValueError, r"attn_logit_softcapping=0.0 must be a finite positive number"),
        (dict(attn_logit_softcapping=-1), ValueError, r"attn_logit_softcapping=-1 must be a finite positive"),
        (dict(attn_logit_softcapping=float("inf")), ValueError, r"attn_logit_softcapping=inf must be a finite"),
        (dict(attn_logit_softcapping=True), TypeError, r"'attn_logit_softcapping' with value True"),
        (dict(attn_logit_softcapping=5.0, score="additive"), ValueError, r"caps dot-product logits.*'additive'"),
    ],
)
def test_softcap_values_are_checked(overrides, error, message):
    with pytest.raises(error, match=message):
        tiny_config(**overrides)


# --- use_attention_sinks (gpt-oss) --------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_sinks_match_gpt_oss_eager_attention(kernel):
    """plugformer's kernels with `s_aux` against transformers' gpt-oss eager function (GQA 4/2, causal)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    from plugformer.kernels import eager_attention_forward
    from plugformer.kernels_sdpa import sdpa_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 6, 8, generator=generator)
    key, value = (torch.randn(2, 2, 6, 8, generator=generator) for _ in range(2))
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    mask = torch.full((6, 6), torch.finfo(torch.float32).min).triu(1)[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.config = 2, sinks, tiny_config(use_attention_sinks=True)
    module.is_causal = True
    module.eval()
    expected, expected_weights = gpt_oss_eager(module, query, key, value, mask, scaling=8**-0.5)
    assert (expected_weights.sum(-1) < 0.999).all()  # the sink absorbed weight in every row
    # both fp32: the rows' softmax over the keys and the sink's column (a sink logit rounds once)
    logits = query.double() @ key.double().repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5
    logits = torch.cat([logits, sinks.double().view(1, 4, 1, 1).expand(2, 4, 6, 1)], dim=-1)
    allowed = torch.cat([torch.ones(6, 6, dtype=torch.bool).tril(), torch.ones(6, 1, dtype=torch.bool)], dim=-1)
    atol, weights_atol = sink_or_cap_tolerance(query, key, value, 8**-0.5, logits, allowed, steps=1)
    if kernel == "eager":
        out, weights = eager_attention_forward(module, query, key, value, mask, scaling=8**-0.5, s_aux=sinks)
        torch.testing.assert_close(weights, expected_weights, atol=weights_atol, rtol=0)
    else:  # the boolean mask transformers builds for sdpa, and none (is_causal)
        out, _ = sdpa_forward(module, query, key, value, mask == 0, scaling=8**-0.5, s_aux=sinks)
        unmasked, _ = sdpa_forward(module, query, key, value, None, scaling=8**-0.5, s_aux=sinks)
        torch.testing.assert_close(unmasked, expected, atol=atol, rtol=0)
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)


def test_sinks_are_learned_and_refused_where_not_computed(tokens):
    config = tiny_config(use_attention_sinks=True)
    model = build(config)
    sinks = model.model.layers[0].self_attn.sinks
    assert sinks.shape == (4,) and sinks.abs().max() > 0  # initialised (normal, initializer_range)
    assert PlugformerForCausalLM(config).config._attn_implementation == "sdpa"
    for kernel in ("flex_attention", "flash_attention_2"):
        with pytest.raises(ValueError, match=rf"attn_implementation='{kernel}' cannot add attention sinks"):
            build(config, kernel)(tokens)
    with pytest.raises(ValueError, match=r"use_attention_sinks=True .* attention_score='additive'"):
        tiny_config("additive", use_attention_sinks=True)
