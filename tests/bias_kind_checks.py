"""Checks shared by the tests of the position schemes whose bias reaches the kernels as a kind of its own
(`biases.BIAS_KINDS`): FIRE's `query_position` (test_fire.py) and forgetting attention's `decay` (test_forgetting.py)."""

from __future__ import annotations

import contextlib
import copy

import torch
from conftest import left_padded, on_kernel, training_step
from tolerances import assert_same_step, model_tolerance

import plugformer.kernels as kernels
from plugformer import PlugformerConfig, PlugformerForMaskedLM, register_attention_kernel
from plugformer.biases import QueryPositionBias
from plugformer.capabilities import KERNELS, unsupported_reason


def first_layer_attention(model, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Layer 0's attention weights `(B, H, Q, K)` for `tokens` (`output_attentions`: an eager model), and what it
    computed them from: its input `(B, T, hidden)`, its queries and keys `(B, H, T, D)` projected again here, each
    key/value head repeated for its group of query heads."""
    attention = model.model.layers[0].self_attn
    inputs = []
    hook = attention.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    try:
        with torch.no_grad():
            weights = model(tokens, attention_mask=mask, output_attentions=True).attentions[0]  # (B, H, Q, K)
            hidden = inputs[0]  # (B, T, hidden): what the attention projects
            query = attention.split_heads(attention.q_proj(hidden))  # (B, H, T, D)
            key = attention.split_heads(attention.k_proj(hidden))  # (B, H_kv, T, D)
            key = key.repeat_interleave(attention.num_key_value_groups, dim=1)  # (B, H, T, D)
    finally:
        hook.remove()
    return weights, hidden, query, key


def assert_built_in_kernels_take(config: PlugformerConfig, kind: str) -> None:
    """eager, sdpa and flex list the bias `kind` and take `config`, whose position scheme makes it; flash, which takes
    no additive score bias, refuses it."""
    for name in ("eager", "sdpa", "flex_attention"):
        assert kind in KERNELS.get(name).bias_kinds and unsupported_reason(config, name) is None, name
    assert "takes no additive score bias" in unsupported_reason(config, "flash_attention_2")


def assert_same_logits_on(reference, kernel: str) -> None:
    """`reference` and its copy on `kernel` (`on_kernel`) give the same logits for the real tokens of a left-padded
    batch: fp32's rounding through the model, the real tokens' max|logits| (`model_tolerance`)."""
    tokens, mask = left_padded()
    with torch.no_grad():
        expected = reference(tokens, attention_mask=mask).logits
        got = on_kernel(reference, kernel)(tokens, attention_mask=mask).logits
    real = mask.bool()
    atol = model_tolerance(reference.config, expected, magnitude=max(expected[real].abs().max().item(), 1.0))
    torch.testing.assert_close(got[real], expected[real], atol=atol, rtol=0)


def assert_encoder_step_on_sdpa_equals_eager(config: PlugformerConfig, prepare) -> None:
    """A masked LM of `config` (bidirectional: keys after the query too), its weights set by `prepare(model)`, trained
    one step on a left-padded batch of 40 tokens, a third of them labelled: sdpa's logits and every gradient equal
    eager's (`assert_same_step`). Run under the `small_blocks` fixture, sdpa's kernels work in 16-row blocks."""
    torch.manual_seed(0)
    eager = prepare(PlugformerForMaskedLM(copy.deepcopy(config)))
    eager.set_attn_implementation("eager")
    tokens, mask = left_padded(length=40, pad=5)
    labels = tokens.masked_fill((mask == 0) | (torch.arange(40) % 3 == 0), -100)
    (logits, grads), (reference_logits, reference_grads) = (
        training_step(on_kernel(eager, kernel), tokens, mask, labels) for kernel in ("sdpa", "eager")
    )
    real = mask.bool()
    assert_same_step(config, logits[real], grads, reference_logits[real], reference_grads, msg="sdpa", tokens=40)


@contextlib.contextmanager
def recording_kernels(prefix: str, **records):
    """Registers a kernel `<prefix>_<label>` for each of `records` (`register_attention_kernel`'s keywords), each
    recording the `position_bias` it gets (the list yielded) and running sdpa with its dense `(B, H, Q, K)` rows;
    unregisters them on leaving."""
    received = []

    def recording_sdpa(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        received.append(position_bias)
        dense = position_bias if torch.is_tensor(position_bias) else position_bias.dense()
        bias = QueryPositionBias(dense, *dense.shape[-2:])  # rows per batch row, as FIRE's kind holds them
        return kernels.sdpa_attention_forward(module, query, key, value, attention_mask, position_bias=bias, **kwargs)

    try:
        for label, record in records.items():
            register_attention_kernel(f"{prefix}_{label}", recording_sdpa, **record)
        yield received
    finally:
        for label in records:
            KERNELS._table.pop(f"{prefix}_{label}", None)
