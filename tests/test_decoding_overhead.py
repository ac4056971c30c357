"""What the decoding step caches or shortcuts to cost less per token gives what the long way gives.

Each shortcut is checked against the computation it replaces: the bound forward's signature that `generate()` reads
every step, the positions of a decoding step, and the `past_key_values` alias of every decorated forward.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import build, tiny_config
from transformers.cache_utils import DynamicCache

import plugformer
from plugformer.compat import CACHE_NAMED_CACHE
from plugformer.pretrained import MethodSignature
from plugformer.stack import position_ids_from_mask


@pytest.mark.parametrize("head", ["PlugformerForCausalLM", "PlugformerForConditionalGeneration", "PlugformerModel"])
def test_bound_forward_signature_is_built_once_and_is_the_forward_without_self(head, monkeypatch):
    forward = getattr(plugformer, head).forward

    class Holder:  # any instance binds the function as `model.forward` does
        pass

    bound = forward.__get__(Holder())
    first, second = inspect.signature(bound), inspect.signature(bound)
    assert second is first  # built once, not per decoding step
    monkeypatch.delattr(inspect.unwrap(forward), "__signature__")  # the signature read off the code itself
    fresh = inspect.signature(inspect.unwrap(forward))
    assert next(iter(fresh.parameters)) == "self"
    expected = fresh.replace(parameters=list(fresh.parameters.values())[1:])
    assert first == expected and list(first.parameters) == list(expected.parameters)


def test_method_signature_replace_answers_each_change():
    """The signature kept for the bound method is only handed back for the same change; others are computed."""

    def function(self, a: int, b=2) -> str:
        return str(a + b)

    signature = MethodSignature.of(function)
    parameters = tuple(signature.parameters.values())
    without_self = signature.replace(parameters=parameters[1:])
    assert list(without_self.parameters) == ["a", "b"]
    assert signature.replace(parameters=parameters[1:]) is without_self
    assert list(signature.replace(parameters=parameters[2:]).parameters) == ["b"]
    assert signature.replace(return_annotation=int).return_annotation is int
    assert signature.replace().return_annotation == "str"  # unchanged, not the cached one's
    assert list(signature.replace(parameters=parameters[1:]).parameters) == ["a", "b"]


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool, torch.float32])
def test_decoding_step_positions_are_the_last_cumulative_counts(dtype):
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 11, generator=generator) > 0.3).to(dtype)
    mask[0] = 0  # a row of padding only: position 0, as the clamp gives
    mask[1, :5] = 0  # left padding
    expected = (mask.long().cumsum(-1) - 1).clamp(min=0)  # every token's position, counted by hand
    for query_length in (1, 3, 11):
        positions = position_ids_from_mask(mask, 0, query_length, mask.device)
        assert positions.dtype == torch.long
        torch.testing.assert_close(positions, expected[:, -query_length:], rtol=0, atol=0)


def test_past_key_values_alias_renames_on_every_decorated_forward(tokens):
    """The alias passes through transformers' `deprecate_kwarg` (renamed, with its warning; before 5.24 renamed
    silently); `cache=` skips it."""
    model = build(tiny_config()).eval()
    layer, attention = model.model.layers[0], model.model.layers[0].self_attn
    hidden = torch.randn(tokens.shape[0], tokens.shape[1], model.config.hidden_size)
    rotary = model.model.positions.rotary(hidden, torch.arange(tokens.shape[1])[None])
    for module, arguments in ((layer, {"position_embeddings": rotary}), (attention, {"position_embeddings": rotary})):
        outputs = {}
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                outputs[name] = module(hidden, **arguments, **{name: cache})
            assert cache.get_seq_length() == tokens.shape[1]  # the cache was updated under either name
            renamed = [w for w in caught if "past_key_values" in str(w.message)]
            assert bool(renamed) == (name == "past_key_values" and CACHE_NAMED_CACHE)  # before 5.24: silently
        first, second = (out[0] if isinstance(out, tuple) else out for out in outputs.values())
        torch.testing.assert_close(first, second, rtol=0, atol=0)
