"""`attention_score="stick_breaking"` (Tan et al. 2024, arXiv 2410.17980): the kernel in float64 against the paper's
formula written out as loops (GQA, a position bias, padding, packed documents, cached rows), the model in float64
(padded and packed rows equal each text alone), half precision, and the refusals. The shared suites (causal
combinations, conformance, packing, sliding window, ...) take it from the registry; test_scores holds its formula
among the other scores'.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import build, tiny_config

from plugformer import KERNELS, PlugformerForCausalLM, supported_kernels
from plugformer.biases import RelativeBias
from plugformer.capabilities import unsupported_reason
from plugformer.kernels_stick_breaking import stick_breaking_attention_forward


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def reference(query, key, value, scaling, visible=None, own=None, bias=None) -> torch.Tensor:
    """The paper's formula in Python floats: for query i of head h (key/value head h // groups), over the keys j it
    sees before its own slot (`visible[b][i][j]`, by default all; `own[i]`, by default i), β_ij = σ(z_ij) with
    z_ij = scaling · q_i·k_j (+ `bias[h][i][j]`), A_ij = β_ij ∏_{k seen, j<k<i} (1 − β_ik), o_i = Σ_j A_ij v_j.
    Returns (B, Q, H, D_v) in float64."""
    batch, heads, queries, _ = query.shape
    groups = heads // key.shape[1]
    out = torch.zeros(batch, queries, heads, value.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            q, k, v = query[b, h].tolist(), key[b, h // groups].tolist(), value[b, h // groups].tolist()
            for i in range(queries):
                slot = i if own is None else own[i]
                seen = [j for j in range(slot) if visible is None or visible[b][i][j]]
                z = {j: scaling * sum(x * y for x, y in zip(q[i], k[j], strict=True)) for j in seen}
                if bias is not None:
                    z = {j: value + bias[h][i][j] for j, value in z.items()}
                for j in seen:
                    weight = sigmoid(z[j])
                    for later in seen:
                        if later > j:
                            weight *= 1 - sigmoid(z[later])
                    out[b, i, h] += weight * torch.tensor(v[j], dtype=torch.float64)
    return out


def leaves(batch=1, heads=4, kv_heads=2, length=6, dim=3, seed=0, scale=1.5):
    generator = torch.Generator().manual_seed(seed)
    query = scale * torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
    key = scale * torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, length, dim + 1, generator=generator, dtype=torch.float64)  # D_v ≠ D_k
    return query, key, value


def module(groups: int = 2) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=groups, training=False, is_causal=True)


def float_mask(allowed: torch.Tensor) -> torch.Tensor:
    """An eager (additive) mask `(B, 1, Q, K)` from booleans: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)


def test_kernel_matches_the_formula_with_grouped_heads_and_a_position_bias():
    """Causal, no mask (the first query of a prompt sees no earlier key: its output is zero), 4 query heads over 2
    key/value heads, values wider than the keys, and a relative bias b[h, j − i + Q − 1] added to z before σ."""
    query, key, value = leaves()
    scaling = 3**-0.5
    values = torch.randn(4, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)  # (H, Q + K − 1)
    bias = RelativeBias(values, 6, 6)
    dense = bias.dense()[0].tolist()  # (H, Q, K)
    out, weights = stick_breaking_attention_forward(module(), query, key, value, None, scaling, position_bias=bias)
    expected = reference(query, key, value, scaling, bias=dense)
    torch.testing.assert_close(out, expected, atol=1e-13, rtol=0)
    assert out[:, 0].abs().max() == 0 and weights.triu().abs().max() == 0  # the own key and later ones: no share
    without = reference(query, key, value, scaling)
    assert (expected - without).abs().max() > 1e-2  # the bias is no no-op here


def test_padding_keys_take_no_share_and_break_nothing():
    """Left padding: each real query of the padded row equals the formula on the row's real tokens alone (a padding key
    in the stick, taking a share and contributing its (1 − β), would change every weight before it)."""
    query, key, value = leaves(batch=2)
    pad = 2  # row 1 starts with two padding slots
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    real_keys = torch.ones(2, 6, dtype=torch.bool)
    real_keys[1, :pad] = False
    allowed = causal[None, None] & real_keys[:, None, None, :]  # (B, 1, Q, K), as transformers' eager mask
    out, _ = stick_breaking_attention_forward(module(), query, key, value, float_mask(allowed), 0.5)
    torch.testing.assert_close(out[:1], reference(query[:1], key[:1], value[:1], 0.5), atol=1e-13, rtol=0)
    alone = reference(query[1:, :, pad:], key[1:, :, pad:], value[1:, :, pad:], 0.5)
    torch.testing.assert_close(out[1:, pad:], alone, atol=1e-13, rtol=0)
    assert torch.isfinite(out).all() and out[1, :pad].abs().max() == 0  # padding queries see nothing
    breaking = reference(query[1:], key[1:], value[1:], 0.5, visible=[[[True] * 6] * 6])  # pads part of the stick
    assert (breaking[:, pad:] - alone).abs().max() > 1e-3


def test_packed_documents_restart_the_stick():
    """Two documents in one row (a block-diagonal causal mask, as packing builds): each attends as it does alone; the
    first document's keys neither take a share of the second's stick nor break it."""
    query, key, value = leaves(length=7)
    documents = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    allowed = torch.ones(7, 7, dtype=torch.bool).tril() & (documents[:, None] == documents[None, :])
    out, _ = stick_breaking_attention_forward(module(), query, key, value, float_mask(allowed[None, None]), 0.5)
    for part in (slice(0, 3), slice(3, 7)):
        alone = reference(query[:, :, part], key[:, :, part], value[:, :, part], 0.5)
        torch.testing.assert_close(out[:, part], alone, atol=1e-13, rtol=0)


def test_cached_rows_equal_the_full_forward_rows():
    """A decoding step: one query over the cached keys with no mask (a dynamic cache: its own key is the last), and a
    chunk of two queries in a static cache of 9 slots (the mask blocks the empty slots after them)."""
    query, key, value = leaves(length=6)
    full, _ = stick_breaking_attention_forward(module(), query, key, value, None, 0.5)
    step, _ = stick_breaking_attention_forward(module(), query[:, :, 5:], key, value, None, 0.5)
    torch.testing.assert_close(step, full[:, 5:], atol=1e-14, rtol=0)
    slots = 9
    padded_key = torch.cat([key, torch.zeros(1, 2, slots - 6, 3, dtype=torch.float64)], dim=2)  # empty slots
    padded_value = torch.cat([value, torch.zeros(1, 2, slots - 6, 4, dtype=torch.float64)], dim=2)
    allowed = torch.arange(slots)[None, :] <= torch.tensor([4, 5])[:, None]  # queries at slots 4 and 5
    chunk, _ = stick_breaking_attention_forward(
        module(), query[:, :, 4:], padded_key, padded_value, float_mask(allowed[None, None]), 0.5
    )
    torch.testing.assert_close(chunk, full[:, 4:], atol=1e-14, rtol=0)


@pytest.mark.parametrize("scheme", ["none", "alibi"])
def test_padded_and_packed_rows_of_the_model_equal_each_text_alone_in_float64(scheme, tokens):
    """The whole model in float64: a left-padded row and two packed documents (restarting position_ids) give the
    logits of each text alone, to fp64 rounding."""
    model = build(tiny_config("stick_breaking", scheme)).double()
    with torch.no_grad():
        alone = [model(tokens[row : row + 1, :length], use_cache=False).logits for row, length in ((0, 12), (1, 8))]
        padded = torch.zeros(2, 12, dtype=torch.long)
        mask = torch.zeros(2, 12, dtype=torch.long)
        padded[0], mask[0] = tokens[0], 1
        padded[1, 4:], mask[1, 4:] = tokens[1, :8], 1
        batched = model(padded, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(batched[:1], alone[0], atol=1e-10, rtol=0)
        torch.testing.assert_close(batched[1:, 4:], alone[1], atol=1e-10, rtol=0)
        first, second = tokens[0, :7], tokens[1, :5]
        position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
        packed = model(torch.cat([first, second])[None], position_ids=position_ids, use_cache=False).logits
        torch.testing.assert_close(packed[:, :7], model(first[None], use_cache=False).logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(packed[:, 7:], model(second[None], use_cache=False).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_logits_beyond_the_half_precision_range_stay_finite(dtype):
    """Logits of ±10^5 (σ saturates to 0 or 1, log(1 − β) to −10^5): the log-space sums stay finite, and the half
    precision output matches the float64 one to the dtype's rounding."""
    query, key, value = leaves(length=8, scale=1.0)
    query = 200 * query / query.norm(dim=-1, keepdim=True)
    key = 200 * key / key.norm(dim=-1, keepdim=True)  # |q·k| up to 4·10^4, times scaling 2.5
    expected, _ = stick_breaking_attention_forward(module(), query, key, value, None, 2.5)
    half, _ = stick_breaking_attention_forward(module(), query.to(dtype), key.to(dtype), value.to(dtype), None, 2.5)
    assert torch.isfinite(half).all()
    atol = 16 * torch.finfo(dtype).eps * value.abs().max().item()
    torch.testing.assert_close(half.double(), expected, atol=atol, rtol=0)


def test_only_eager_computes_it_and_bidirectional_models_are_refused():
    config = tiny_config("stick_breaking", "rope")
    assert supported_kernels(config, available_only=False) == ["eager"]
    for kernel in [name for name in KERNELS if name != "eager"] + ["vllm"]:
        reason = unsupported_reason(config, kernel)
        assert "attention_score='stick_breaking' is not a dot product of query and key in a softmax" in reason, kernel
    model = PlugformerForCausalLM(copy.deepcopy(config))
    assert model.config._attn_implementation == "eager"  # chosen automatically
    with pytest.raises(ValueError, match=r"attention_score='stick_breaking'.*attn_implementation='sdpa'"):
        model.set_attn_implementation("sdpa")
    for fields, field in (
        ({"is_causal": False}, "is_causal=False"),
        ({"is_encoder_decoder": True, "pad_token_id": 0}, "is_encoder_decoder=True"),
        ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping=30.0"),
        ({"use_attention_sinks": True}, "use_attention_sinks=True"),
    ):
        with pytest.raises(ValueError, match=rf"{field}.*attention_score='stick_breaking'"):
            tiny_config("stick_breaking", "rope", **fields)


def test_attention_dropout_drops_weights_in_training_only(tokens):
    model = build(tiny_config("stick_breaking", "none", attention_dropout=0.5))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, model(tokens).logits)
        model.train()
        assert not torch.equal(model(tokens).logits, model(tokens).logits)
