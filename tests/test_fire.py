"""FIRE (`position_scheme="fire"`) in the kernels: the bias a kernel adds is the paper's formula, per batch row.

FIRE's bias depends on the query's position (its normaliser ψ(max(L, i))), so it reaches the kernels as a
`biases.QueryPositionBias`. The shared suites run it with the initial L = 512, past every test sequence, where the
normaliser is constant and the bias depends on the distance only; the tests here move L to 2 (and c to 0.5), so
most queries lie past L and a wrong query position (a slot instead of a position_id, a row's instead of another's)
changes the outputs. The formula's entries themselves are checked in test_positions.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from bias_kind_checks import (
    assert_built_in_kernels_take,
    assert_encoder_step_on_sdpa_equals_eager,
    assert_same_logits_on,
    first_layer_attention,
    recording_kernels,
)
from conftest import build, left_padded, on_kernel, random_ids, tiny_config, training_step
from test_positions import fire_by_hand, fire_tolerance
from tolerances import assert_same_step, model_tolerance, softmax_spread, tolerance
from transformers import DynamicCache

from plugformer import PlugformerForCausalLM
from plugformer.attention import PlugformerAttention
from plugformer.biases import QueryPositionBias
from plugformer.capabilities import unsupported_reason


THRESHOLD, SCALE = 2.0, 0.5


def with_small_threshold(model):
    """L = 2, c = 0.5: queries past position 2 are normalised by their own position."""
    fire = model.model.positions
    with torch.no_grad():
        fire.threshold_scale.fill_(THRESHOLD / fire.initial_threshold)
        fire.distance_scale.fill_(SCALE)
    return model


def fire_model(kernel: str = "eager", score: str = "scaled_dot", **overrides) -> PlugformerForCausalLM:
    return with_small_threshold(build(tiny_config(score, "fire", **overrides), kernel))


def test_eager_adds_the_papers_bias_of_each_rows_positions():
    """Layer 0's eager weights equal softmax(s·q·k + b(i, j) + mask) worked out here, b from the formula in Python
    floats at each row's positions: the left-padded row's query i sits at position i − 3."""
    model = fire_model()
    tokens, mask = left_padded(length=9, pad=3)
    attention = model.model.layers[0].self_attn
    weights, _, query, key = first_layer_attention(model, tokens, mask)  # (B, H, Q, K), (B, H, T, D) twice: GQA 2:1
    fire = model.model.positions
    heads = model.config.num_attention_heads
    for row, pad in enumerate((0, 3)):
        for i in range(pad, 9):
            keys = range(pad, i + 1)  # the real keys up to the query
            bias = torch.tensor([fire_by_hand(fire, i - pad, j - pad) for j in keys]).T  # (H, keys)
            products = torch.einsum("hd,hkd->hkd", query[row, :, i], key[row, :, pad : i + 1])  # (H, keys, D)
            scores = products.sum(-1) * attention.scaling + bias
            expected = torch.zeros(heads, 9)
            expected[:, pad : i + 1] = torch.softmax(scores, dim=-1)
            # a weight p_j moves by p_j (δs_j − Σ_k p_k δs_k), at most 2·max|δs|, where the scores differ by the dot
            # product's rounding (terms scale·Σ_d |q_d k_d| over D) and FIRE's bias's against Python floats
            # (`fire_tolerance`); then each side's own softmax of weights at most 1 over the row's keys
            dot = tolerance(
                torch.float32,
                magnitude=attention.scaling * products.abs().sum(-1).max().item(),
                length=products.shape[-1],
            )
            fire_bias = max(fire_tolerance(fire, i - pad, j - pad) for j in keys)
            softmax = tolerance(torch.float32, length=len(keys), spread=softmax_spread(scores), steps=2)
            torch.testing.assert_close(weights[row, :, i], expected, atol=softmax + 2 * (dot + fire_bias), rtol=0)


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
def test_sdpa_training_step_equals_eager_gradients_to_theta_c_and_l_included(score, small_blocks):
    """sdpa computes each block's rows from the positions, in its backward again (`kernels_query_bias`), three 16-row
    blocks: logits and every gradient equal eager's, and c, L and θ get theirs."""
    eager = fire_model(score=score)
    tokens, mask = left_padded(length=40, pad=7)
    logits_eager, grads_eager = training_step(eager, tokens, mask)
    logits_sdpa, grads_sdpa = training_step(on_kernel(eager, "sdpa"), tokens, mask)
    real = mask.bool()
    # fp32's rounding through the model's layers and longest reduction, times max|logits| and the largest gradient
    # (`tolerances.assert_same_step`)
    assert_same_step(eager.config, logits_sdpa[real], grads_sdpa, logits_eager[real], grads_eager, msg=score, tokens=40)
    # (not mlp_out.bias: a constant per head on every score, which the softmax ignores; its gradient is 0)
    for name in ("distance_scale", "threshold_scale", "mlp_in.weight", "mlp_in.bias", "mlp_out.weight"):
        assert grads_eager[f"model.positions.{name}"].abs().sum() > 0, name


def test_sdpa_encoder_training_step_equals_eager(small_blocks):
    """Bidirectional FIRE (keys after the query: the signed input, our choice) with padding, 16-row blocks."""
    assert_encoder_step_on_sdpa_equals_eager(tiny_config("scaled_dot", "fire", is_causal=False), with_small_threshold)


# flex compiles a kernel per shape on the CPU (~20 s for these three); (flex on this CPU returns wrong logits for
# 8 tokens with the tiny preset, with every position scheme, `none` too: no 8-token sequence here)
FLEX_SLOW = pytest.param("flex_attention", marks=pytest.mark.slow)


@pytest.mark.parametrize("kernel", ["eager", "sdpa", FLEX_SLOW])
def test_a_left_padded_row_equals_the_text_alone(kernel):
    model = on_kernel(fire_model(), kernel)
    tokens, mask = left_padded(length=12, pad=3)
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask).logits
        alone = model(tokens[1:, 3:]).logits
        first = model(tokens[:1]).logits
    # fp32's rounding through the model times max|logits| (`model_tolerance`)
    torch.testing.assert_close(batched[1:, 3:], alone, atol=model_tolerance(model.config, alone), rtol=0)
    torch.testing.assert_close(batched[:1], first, atol=model_tolerance(model.config, first), rtol=0)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_cached_chunks_equal_the_full_forward_with_left_padding(kernel):
    """A prefill, a chunk and single steps, the mask growing with the cache: each query keeps its row's position."""
    model = on_kernel(fire_model(), kernel).eval()
    tokens, mask = left_padded(length=14, pad=4)
    with torch.no_grad():
        full = model(tokens, attention_mask=mask).logits
        cache, logits, start = DynamicCache(config=model.config), [], 0
        for size in (6, 3, 1, 1, 1, 2):
            stop = start + size
            out = model(tokens[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True)
            logits.append(out.logits)
            start = stop
    real = mask.bool()
    # fp32's rounding through the model times the real tokens' max|logits|
    atol = model_tolerance(model.config, full, magnitude=max(full[real].abs().max().item(), 1.0))
    torch.testing.assert_close(torch.cat(logits, dim=1)[real], full[real], atol=atol, rtol=0)


def test_batched_greedy_generation_equals_each_prompt_alone():
    model = fire_model("sdpa", pad_token_id=0)
    prompts = [random_ids(1, 7, seed=1)[0], random_ids(1, 4, seed=2)[0]]
    batch = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        batch[row, 7 - len(prompt) :], mask[row, 7 - len(prompt) :] = prompt, 1
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    generated = model.generate(batch, attention_mask=mask, **settings)[:, 7:]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **settings)[0, len(prompt) :]
        assert torch.equal(generated[row], alone), row


@pytest.mark.parametrize("kernel", ["sdpa", FLEX_SLOW])
def test_runs_past_the_threshold_and_the_training_length(kernel):
    """300 tokens (max_position_embeddings 64, L = 2): finite, and equal to eager."""
    model = fire_model()
    tokens = random_ids(1, 300)
    with torch.no_grad():
        expected = model(tokens).logits
        assert torch.isfinite(expected).all()
        # fp32's rounding through the model over 300 keys times max|logits| (`model_tolerance`)
        atol = model_tolerance(model.config, expected)
        torch.testing.assert_close(on_kernel(model, kernel)(tokens).logits, expected, atol=atol, rtol=0)


def test_the_kernel_table_gives_fire_to_the_kernels_that_take_its_kind(tmp_path):
    """eager, sdpa and flex list `query_position`; flash and a kernel registered without it refuse FIRE naming
    the kind; one registered with it gets the `QueryPositionBias`, one taking a dense bias the (B, H, Q, K) rows."""
    config = tiny_config("scaled_dot", "fire")
    assert_built_in_kernels_take(config, "query_position")
    reference = fire_model()
    records = {
        "relative": {"bias": "relative"},
        "dense": {"bias": "dense"},
        "both": {"bias": "relative", "bias_kinds": ("relative", "query_position")},
    }
    with recording_kernels("fire_test", **records) as received:
        reason = unsupported_reason(config, "fire_test_relative")
        assert "kinds ['relative']" in reason and "'query_position'" in reason and "position_scheme='fire'" in reason
        for label, kind in (("both", QueryPositionBias), ("dense", torch.Tensor)):
            received.clear()
            assert_same_logits_on(reference, f"fire_test_{label}")
            assert received and all(isinstance(bias, kind) for bias in received)
            if label == "dense":
                assert all(bias.shape == (2, 4, 12, 12) for bias in received)


def test_tensor_parallelism_is_refused():
    """f_θ's output layer (one unit per head) is in no TP plan: refused, naming the scheme."""
    config = tiny_config("scaled_dot", "fire")
    config.distributed_config = types.SimpleNamespace(tp_size=2)
    with pytest.raises(ValueError, match="position_scheme='fire' cannot run with tensor parallelism"):
        PlugformerAttention(config, 0)


@pytest.mark.slow  # a second Python process (~18 s here); test_hf_integration loads the same copied files by default
def test_saved_model_loads_with_trust_remote_code_without_the_package(tmp_path):
    """The checkpoint's copied code (biases.py with the new bias kind, positions_bias.py with FIRE) computes the same
    logits and greedy tokens in a process where plugformer cannot be imported."""
    from test_hf_integration import assert_same_without_the_package

    model = fire_model("sdpa")
    model.save_pretrained(tmp_path / "model")
    assert {"biases.py", "positions_bias.py"} <= {path.name for path in (tmp_path / "model").iterdir()}
    assert_same_without_the_package(model, tmp_path / "model", random_ids(2, 10), tmp_path)


def test_a_checkpoint_saved_with_0d_scales_loads_into_the_vectors(tmp_path):
    """c's and L's scales were 0-d parameters until FSDP2 refused them (tests/test_distributed_kernels.py): such a
    checkpoint loads, through the conversion `legacy_weights` registers with transformers, into the one-element
    vectors, with the same logits, and saves as vectors; the checkpoint carries that module for remote code."""
    from safetensors.torch import load_file, save_file

    model = fire_model("sdpa")
    model.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    saved = load_file(weights)
    scales = ("model.positions.distance_scale", "model.positions.threshold_scale")
    assert [saved[name].shape for name in scales] == [(1,), (1,)]
    save_file({name: t.reshape(()) if name in scales else t for name, t in saved.items()}, weights, {"format": "pt"})
    assert [load_file(weights)[name].shape for name in scales] == [(), ()]
    loaded, info = PlugformerForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    fire = loaded.model.positions
    assert fire.distance_scale.shape == fire.threshold_scale.shape == (1,)
    assert (fire.distance_scale.item(), fire.threshold().item()) == (SCALE, THRESHOLD)
    tokens = random_ids(2, 10)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)
    loaded.save_pretrained(tmp_path / "again")
    assert [load_file(tmp_path / "again" / "model.safetensors")[name].shape for name in scales] == [(1,), (1,)]
    assert "legacy_weights.py" in {path.name for path in (tmp_path / "model").iterdir()}


def test_the_bias_is_computed_once_per_forward_and_shared_by_the_layers(monkeypatch):
    """As T5's: f_θ runs once per forward, not once per layer (the layers get the same values)."""
    model = fire_model()
    calls = []
    original = type(model.model.positions).fire_bias
    monkeypatch.setattr(
        type(model.model.positions), "fire_bias", lambda self, *args: calls.append(1) or original(self, *args)
    )
    with torch.no_grad():
        model(random_ids(2, 8))
    assert len(calls) == 1 and model.config.num_hidden_layers == 2
    assert math.isclose(model.model.positions.threshold().item(), THRESHOLD)
