"""`sliding_window` (Mistral's local attention in every layer): each query sees only the last `sliding_window` keys.

The reference is the same weights without the field, run with an explicit 4-D mask built here from the definition
(key j visible to query i iff i − W < j <= i; for an encoder |i − j| <= W, transformers' bidirectional sliding mask).
The combinations are read from the registries and the kernel table, as in the shared suite.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, projection_combinations, tiny_config, trainable_on_this_device
from tolerances import model_tolerance
from transformers import DynamicCache, StaticCache

from plugformer import POSITION_SCHEMES, PlugformerConfig, PlugformerForMaskedLM
from plugformer.compat import CACHE_NAMED_CACHE


WINDOW = 3
# flex_attention compiles a kernel per shape on CPU (seconds each): one scheme with a score bias, one without
_FLEX_SCHEMES = {
    next(s for s in POSITION_SCHEMES if POSITION_SCHEMES.get(s).has_bias),
    next(s for s in POSITION_SCHEMES if not POSITION_SCHEMES.get(s).has_bias),
}
SLIDING = [
    p
    for p in projection_combinations(representative=True, sliding_window=WINDOW)
    if p.values[2] != "flex_attention" or (p.values[0] == "scaled_dot" and p.values[1] in _FLEX_SCHEMES)
]
EAGER_SDPA = projection_combinations(kernels=("eager", "sdpa"), representative=True, sliding_window=WINDOW)
# cached flex decoding compiles a kernel per step length (60-95 s a row on the CPU): with -m slow; flex == eager on
# the full forward stays in the default run for the scheme with a bias
SLIDING_DECODING = [
    pytest.param(*p.values, id=p.id, marks=pytest.mark.slow) if p.values[2] == "flex_attention" else p for p in SLIDING
]
SLIDING_KERNELS = [
    pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
    if p.values[2] == "flex_attention" and not POSITION_SCHEMES.get(p.values[1]).has_bias
    else p
    for p in SLIDING
]


def window_mask(length: int, window: int, causal: bool = True) -> torch.Tensor:
    """(1, 1, T, T) bool: query i sees key j iff i − window < j <= i (causal), |i − j| <= window (bidirectional)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = (j <= i) & (j > i - window) if causal else (i - j).abs() <= window
    return allowed[None, None]


def without_window(model):
    """The same weights with `sliding_window=None` (full attention)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "window_kwargs"):
            module.window_kwargs = {}
        if hasattr(module, "attention_type"):
            module.attention_type = "full_attention"
    model.config.sliding_window = None
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    return model


def logits(model, tokens, **kwargs):
    with torch.no_grad():
        return model(tokens, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("score,scheme,kernel,projection", EAGER_SDPA)
def test_sliding_window_equals_an_explicit_window_mask(score, scheme, kernel, projection, tokens):
    model = build(tiny_config(score, scheme, projection, sliding_window=WINDOW), kernel)
    reference = without_window(model)
    expected = logits(reference, tokens, attention_mask=window_mask(tokens.shape[1], WINDOW).expand(2, 1, -1, -1))
    # the window against an explicit mask: fp32's rounding through the model (`model_tolerance`)
    torch.testing.assert_close(logits(model, tokens), expected, atol=model_tolerance(model.config, expected), rtol=0)
    # the window matters here: full attention differs
    assert (logits(reference, tokens) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("score,scheme,kernel,projection", SLIDING_KERNELS)
def test_sliding_window_kernels_match_eager(score, scheme, kernel, projection, tokens):
    config = tiny_config(score, scheme, projection, sliding_window=WINDOW)
    expected = logits(build(config, "eager"), tokens)
    atol = model_tolerance(config, expected)  # the kernel against eager
    torch.testing.assert_close(logits(build(config, kernel), tokens), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("score,scheme,kernel,projection", SLIDING_DECODING)
def test_sliding_window_cached_decoding_equals_full_forward(score, scheme, kernel, projection, cache_class, tokens):
    """Prefill 5 tokens, then one token at a time past the window: the cache keeps only the window (transformers'
    sliding layers), the logits equal the full forward's."""
    if kernel == "flex_attention" and cache_class == "static":
        pytest.skip("flex_attention refuses a static cache (its kernel record: static_cache=False)")
    model = build(tiny_config(score, scheme, projection, sliding_window=WINDOW), kernel)
    full = logits(model, tokens)
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=tokens.shape[1])
    assert all(layer.is_sliding for layer in cache.layers)
    steps = []
    with torch.no_grad():
        out = model(tokens[:, :5], cache=cache, use_cache=True)
        steps.append(out.logits)
        for t in range(5, tokens.shape[1]):
            out = model(tokens[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    if cache_class == "dynamic":
        assert out.cache.layers[0].keys.shape[2] == WINDOW - 1  # only the window is kept
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=model_tolerance(model.config, full), rtol=0)


@pytest.mark.parametrize("score,scheme,kernel,projection", EAGER_SDPA)
def test_sliding_window_left_padding_matches_unpadded(score, scheme, kernel, projection, tokens):
    model = build(tiny_config(score, scheme, projection, sliding_window=WINDOW), kernel)
    row = tokens[:1, :8]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], dim=1)
    alone = logits(model, row)
    torch.testing.assert_close(
        logits(model, padded, attention_mask=mask)[:, 3:], alone, atol=model_tolerance(model.config, alone), rtol=0
    )


def test_sliding_window_generate_equals_greedy_full_forwards(tokens):
    model = build(tiny_config(scheme="alibi", sliding_window=WINDOW), "sdpa")
    prompt = tokens[:1, :4]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    sequence = prompt
    for _ in range(6):
        next_token = logits(model, sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_sliding_window_encoder_equals_an_explicit_bidirectional_mask(kernel, tokens):
    config = tiny_config(scheme="t5_bias", is_causal=False, sliding_window=WINDOW)
    config._attn_implementation = kernel
    torch.manual_seed(0)
    model = PlugformerForMaskedLM(config).eval()
    reference = without_window(model)
    mask = window_mask(tokens.shape[1], WINDOW, causal=False).expand(2, 1, -1, -1)
    with torch.no_grad():
        expected = reference(tokens, attention_mask=mask).logits
        torch.testing.assert_close(model(tokens).logits, expected, atol=model_tolerance(config, expected), rtol=0)


@pytest.mark.parametrize(
    "score,scheme,kernel,projection", [p for p in EAGER_SDPA if trainable_on_this_device(p.values[2])][:4]
)
def test_sliding_window_save_load_round_trip(score, scheme, kernel, projection, tokens, tmp_path):
    model = build(tiny_config(score, scheme, projection, sliding_window=WINDOW), kernel)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation=kernel)
    assert loaded.config.sliding_window == WINDOW
    torch.testing.assert_close(logits(loaded, tokens), logits(model, tokens), atol=0, rtol=0)


@pytest.mark.parametrize("value", [0, -2])
def test_sliding_window_refuses_non_positive_values(value):
    with pytest.raises(ValueError, match=rf"sliding_window={value}.*positive"):
        tiny_config(sliding_window=value)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_sliding_window_in_seq2seq_windows_self_attention_and_keeps_every_encoder_key(kernel, tmp_path):
    """A seq2seq model (transformers' common tests set `sliding_window` on every config that has the field): the
    decoder's self-attention is local (its logits change past the window), cached generation equals the full
    forward, and `generate`'s cross-attention cache keeps all encoder keys (its sliding layers would keep the last
    `sliding_window`); saved and loaded, the same logits."""
    from plugformer import PlugformerForConditionalGeneration

    def seq2seq(**overrides):
        config = PlugformerConfig.from_preset(
            "tiny",
            is_encoder_decoder=True,
            is_causal=False,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            **overrides,
        )
        config._attn_implementation = kernel
        torch.manual_seed(0)
        return PlugformerForConditionalGeneration(config).eval()

    model, full = seq2seq(sliding_window=WINDOW), seq2seq()
    source = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        generated = model.generate(
            source,
            max_new_tokens=8,
            do_sample=False,
            min_new_tokens=8,
            return_dict_in_generate=True,
            output_logits=True,
        )
        decoder_ids = generated.sequences
        logits = model(source, decoder_input_ids=decoder_ids).logits
        cache = generated.cache if CACHE_NAMED_CACHE else generated.past_key_values  # the name before 5.24
        assert all(layer.keys.shape[-2] == source.shape[1] for layer in cache.cross_attention_cache.layers)
        cached = torch.stack(generated.logits, dim=1)  # (B, steps, V): each decoding step's logits
        # cached steps == the full forward, within fp32's rounding through both stacks (`model_tolerance`)
        atol = model_tolerance(model.config, logits)
        torch.testing.assert_close(cached, logits[:, :-1], atol=atol, rtol=0)
        assert not torch.allclose(logits, full(source, decoder_input_ids=decoder_ids).logits, atol=atol, rtol=0)
        model.save_pretrained(tmp_path)
        loaded = PlugformerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation=kernel).eval()
        torch.testing.assert_close(loaded(source, decoder_input_ids=decoder_ids).logits, logits, atol=0, rtol=0)
