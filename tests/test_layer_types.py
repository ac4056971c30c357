"""`layer_types`: per-layer attention kinds (`"sliding_attention"` / `"full_attention"`), as transformers' field.

The reference is transformers' `Qwen3ForCausalLM` with `use_sliding_window=True` (its `max_window_layers` makes the
first layers full and the rest sliding, or `layer_types` given outright), weights copied; then the shared suite's
checks rerun with mixed layers, where each kind's mask, cache slots and score bias must be its own.
"""

from __future__ import annotations

import pytest
import test_combinations as shared
import torch
from conftest import build, modifier_combinations, tiny_config
from tolerances import model_tolerance
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache

from plugformer import PlugformerConfig, PlugformerForCausalLM, PlugformerForConditionalGeneration


WINDOW = 3
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def qwen3_twin(kernel: str = "eager", **window):
    """A tiny Qwen3 with sliding layers and the plugformer model with its weights (the module names are the same)."""
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=True,
        sliding_window=WINDOW,
        **window,
    )
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(Qwen3Config(**fields, attn_implementation=kernel)).eval()
    config = tiny_config(
        "scaled_dot",
        "rope",
        use_qk_norm=True,
        num_hidden_layers=3,
        rope_parameters=fields["rope_parameters"],
        sliding_window=reference.config.sliding_window,
        layer_types=reference.config.layer_types,
    )
    model = build(config, kernel)
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


QWEN3_LAYOUTS = {"max_window_layers": {"max_window_layers": 1}, "explicit": {"layer_types": MIXED}}


@pytest.mark.parametrize("layout", list(QWEN3_LAYOUTS))
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_layer_types_match_qwen3_with_sliding_layers(kernel, layout, tokens):
    reference, model = qwen3_twin(kernel, **QWEN3_LAYOUTS[layout])
    kinds = set(reference.config.layer_types)
    assert kinds == {"sliding_attention", "full_attention"} and model.config.layer_types == reference.config.layer_types
    with torch.no_grad():
        expected, got = reference(tokens).logits, model(tokens, use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=model_tolerance(model.config, expected), rtol=0)  # two fp32 models
    # the kinds matter: every layer full (or every layer sliding) gives other logits
    for kind in kinds:
        other = build(PlugformerConfig(**{**model.config.to_dict(), "layer_types": [kind] * 3}), kernel)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (other(tokens, use_cache=False).logits - expected).abs().max() > 1e-3


@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_layer_types_cached_decoding_equals_qwen3_full_forward(kernel, cache_class, tokens):
    """Prefill 5 tokens, then one at a time past the window: the sliding layers' cache keeps only the window, the
    full layers' everything, and the logits equal Qwen3's uncached full forward."""
    reference, model = qwen3_twin(kernel, layer_types=MIXED)
    with torch.no_grad():
        expected = reference(tokens).logits
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=tokens.shape[1])
    assert [layer.is_sliding for layer in cache.layers] == [kind == "sliding_attention" for kind in MIXED]
    steps = []
    with torch.no_grad():
        out = model(tokens[:, :5], cache=cache, use_cache=True)
        steps.append(out.logits)
        for t in range(5, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    if cache_class == "dynamic":
        assert [layer.keys.shape[2] for layer in out.cache.layers] == [WINDOW - 1, tokens.shape[1], WINDOW - 1]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=model_tolerance(model.config, expected), rtol=0)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_layer_types_generate_equals_qwen3(cache_implementation, tokens):
    """With a static cache `generate` builds one mask per kind of `layer_types` and passes them as a dict."""
    reference, model = qwen3_twin("sdpa", layer_types=MIXED)
    prompt = tokens[:1, :4]
    options = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8, cache_implementation=cache_implementation)
    expected = reference.generate(prompt, **options)
    assert torch.equal(model.generate(prompt, **options), expected)


def test_a_dict_of_masks_must_cover_every_kind(tokens):
    model = build(tiny_config(**MIXED_FIELDS))
    with pytest.raises(ValueError, match=r"attention_mask is a dict of \['full_attention'\].*'sliding_attention'"):
        model(tokens, attention_mask={"full_attention": None})


# The shared suite's checks with mixed layers, on every (score, scheme) of the default run and eager/sdpa: a score-bias
# scheme must size each kind's bias by that kind's cache slots.
MIXED_FIELDS = {"num_hidden_layers": 3, "sliding_window": WINDOW, "layer_types": MIXED}


@pytest.mark.parametrize("score,scheme,kernel", modifier_combinations(**MIXED_FIELDS))
def test_shared_checks_with_mixed_layer_types(score, scheme, kernel, tokens, monkeypatch, tmp_path):
    shared.run_checks_with_fields(MIXED_FIELDS, score, scheme, kernel, tokens, monkeypatch, tmp_path, backward=False)


def test_layer_types_default_from_sliding_window():
    assert tiny_config().layer_types == ["full_attention"] * 2
    assert tiny_config(sliding_window=4).layer_types == ["sliding_attention"] * 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"sliding_window": 4, "layer_types": ["sliding_attention"]},
            r"layer_types has 1 entries.*num_hidden_layers=2",
        ),
        (
            {"sliding_window": 4, "layer_types": ["sliding_attention", "chunked_attention"]},
            r"layer_types=.*'chunked_attention'.*\['full_attention', 'sliding_attention', 'linear_attention'\]",
        ),
        ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types=.*sliding_window=None"),
    ],
)
def test_layer_types_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_layer_types_save_load_round_trip(tokens, tmp_path):
    model = build(tiny_config(**MIXED_FIELDS))
    model.save_pretrained(tmp_path)
    loaded = PlugformerForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.layer_types == MIXED
    assert [layer.attention_type for layer in loaded.model.layers] == MIXED
    assert [layer.self_attn.window_kwargs for layer in loaded.model.layers] == [
        {"sliding_window": WINDOW},
        {},
        {"sliding_window": WINDOW},
    ]


def test_a_seq2seq_decoder_deeper_than_its_encoder_slides_every_layer(tokens):
    """`layer_types` counts the encoder's layers; the decoder's self-attention layers (here more of them) take the one
    kind a seq2seq model allows, and its cached decoding equals the full forward."""
    config = tiny_config(
        is_encoder_decoder=True,
        sliding_window=3,
        num_hidden_layers=1,
        num_decoder_layers=2,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    model = PlugformerForConditionalGeneration(config).eval()
    with torch.no_grad():
        full = model(tokens, decoder_input_ids=tokens[:, :6]).logits
        out = model(tokens, decoder_input_ids=tokens[:, :3], use_cache=True)
        steps = [out.logits]
        for t in range(3, 6):
            out = model(
                tokens, decoder_input_ids=tokens[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True
            )
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=model_tolerance(model.config, full), rtol=0)
    with pytest.raises(ValueError, match=r"mixes kinds, which is_encoder_decoder=True does not support"):
        tiny_config(
            is_encoder_decoder=True,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
            pad_token_id=0,
        )
