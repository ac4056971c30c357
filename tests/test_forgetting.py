"""Forgetting attention (`position_scheme="forgetting"`, Lin et al. 2025): the reference and what the shared suites
do not reach.

The score of query i on key j ≤ i gets D_ij = Σ_{j < l ≤ i} log f_l, f_l = σ(w_h · x_l + b_h) from each layer's input
x (`forget_proj`). At the paper's initialisation (zero bias, small weights) every gate is about 0.5, the same for
every token: the tests here draw the gates' weights and biases wide (f from about 0.1 to 0.999), so that a gate read
from the wrong token, layer or head, or summed over the wrong slots, changes the outputs.
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
from test_sdpa_paths import count_path_calls
from tolerances import assert_same_step, model_tolerance, softmax_spread, tolerance
from transformers import DynamicCache, StaticCache

from plugformer import (
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
)
from plugformer.attention import PlugformerAttention
from plugformer.capabilities import unsupported_reason
from plugformer.positions import ForgettingAttention, alibi_slopes


def with_wide_gates(model, seed: int = 1):
    """Gate weights normal(0, 0.5) and biases uniform in [−1, 4] in every layer (self-attention only)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                weight, bias = module.forget_proj.weight, module.forget_proj.bias
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
                bias.copy_(torch.rand(bias.shape, generator=generator) * 5 - 1)
    return model


def fox_model(kernel: str = "eager", score: str = "scaled_dot", **overrides) -> PlugformerForCausalLM:
    return with_wide_gates(build(tiny_config(score, "forgetting", **overrides), kernel))


def log_sigmoid(x: float) -> float:
    """log f for the gate's logit x, in Python floats: log(1 / (1 + e^−x))."""
    return math.log(1.0 / (1.0 + math.exp(-x)))


def test_eager_adds_the_papers_decay_written_out_in_float64():
    """Layer 0's eager weights (a float64 model) equal softmax(s·q·k + D + mask) with
    D_ij = Σ_{j < l ≤ i} log σ(w_h·x_l + b_h) summed here token by token in Python floats from the layer's input x; the
    left-padded row's text starts at slot 3 (its padding's gates must not count), and the heads share key/value heads
    2:1 (GQA)."""
    model = fox_model().double()
    tokens, mask = left_padded(length=9, pad=3)
    attention = model.model.layers[0].self_attn
    weights, hidden, query, key = first_layer_attention(model, tokens, mask)  # (B, H, Q, K), (B, T, hidden), ...
    with torch.no_grad():
        gate_logits = (hidden @ attention.forget_proj.weight.T + attention.forget_proj.bias).tolist()  # (B, T, H)
    heads = model.config.num_attention_heads
    for row, pad in enumerate((0, 3)):
        for head in range(heads):
            for i in range(pad, 9):
                scores = []
                for j in range(pad, i + 1):
                    decay = sum(log_sigmoid(gate_logits[row][t][head]) for t in range(j + 1, i + 1))
                    scores.append(attention.scaling * float(query[row, head, i] @ key[row, head, j]) + decay)
                top = max(scores)
                total = sum(math.exp(s - top) for s in scores)
                expected = [0.0] * pad + [math.exp(s - top) / total for s in scores] + [0.0] * (8 - i)
                # the model's float64 scores and bias, then eager's softmax, which runs in fp32 for every dtype
                atol = tolerance(torch.float32, length=len(scores), spread=softmax_spread(torch.tensor(scores)))
                torch.testing.assert_close(weights[row, head, i].tolist(), expected, atol=atol, rtol=0)
    # the gates are far from constant: the decay differs between tokens by more than anything rounding could hide
    assert max(map(max, gate_logits[0])) - min(map(min, gate_logits[0])) > 2


def test_a_constant_gate_is_alibi():
    """w = 0 and b_h = logit(e^−m_h) make log f_l = −m_h for every token: D_ij = −m_h (i − j), ALiBi's bias with its
    slopes (the paper's remark); the logits equal ALiBi's model with the same other weights (float64)."""
    alibi = build(tiny_config("scaled_dot", "alibi"), "eager").double()
    forgetting = build(tiny_config("scaled_dot", "forgetting"), "eager").double()
    missing, unexpected = forgetting.load_state_dict(alibi.state_dict(), strict=False)
    assert not unexpected and all("forget_proj" in name for name in missing)
    kept = torch.exp(-alibi_slopes(forgetting.config.num_attention_heads).double())  # f_h = e^−m_h
    with torch.no_grad():
        for layer in forgetting.model.layers:
            layer.self_attn.forget_proj.weight.zero_()
            layer.self_attn.forget_proj.bias.copy_(torch.log(kept) - torch.log1p(-kept))
        tokens = random_ids(2, 20)
        expected = alibi(tokens).logits
        torch.testing.assert_close(forgetting(tokens).logits, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("score", ["scaled_dot", "multiplicative"])
def test_sdpa_training_step_equals_eager_gates_included(score, small_blocks, monkeypatch):
    """sdpa computes each block's rows from F (`kernels_query_bias`), in its backward again, three 16-row blocks, with
    left padding: logits and every gradient equal eager's, and every layer's gate gets its gradient."""
    calls = count_path_calls(monkeypatch, "query_bias")
    eager = fox_model(score=score)
    tokens, mask = left_padded(length=40, pad=7)
    logits_eager, grads_eager = training_step(eager, tokens, mask)
    logits_sdpa, grads_sdpa = training_step(on_kernel(eager, "sdpa"), tokens, mask)
    assert len(calls) == eager.config.num_hidden_layers  # the blockwise path ran in every layer
    real = mask.bool()
    assert_same_step(eager.config, logits_sdpa[real], grads_sdpa, logits_eager[real], grads_eager, msg=score, tokens=40)
    for layer in range(eager.config.num_hidden_layers):
        for name in ("weight", "bias"):
            assert grads_eager[f"model.layers.{layer}.self_attn.forget_proj.{name}"].abs().sum() > 0


def test_sdpa_encoder_training_step_equals_eager(small_blocks):
    """Bidirectional (later keys: the decay of the tokens up to them, our choice) with padding, 16-row blocks."""
    assert_encoder_step_on_sdpa_equals_eager(tiny_config("scaled_dot", "forgetting", is_causal=False), with_wide_gates)


def test_sdpa_training_keeps_no_score_sized_tensor(small_blocks):
    """Saved-tensor hooks see every tensor autograd keeps for the backward: on sdpa none has a (Q, K) = (48, 48) pair
    of axes (the bias, its mask, SDPA's math-path scores); eager's do (the detector works)."""
    tokens = random_ids(2, 48)

    def kept_shapes(kernel: str) -> list[tuple[int, ...]]:
        model = on_kernel(fox_model(), kernel).train()
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            model(tokens, labels=tokens).loss.backward()
        return shapes

    def score_sized(shape):
        return any(shape[i : i + 2] == (48, 48) for i in range(len(shape) - 1))

    assert any(score_sized(shape) for shape in kept_shapes("eager"))
    assert not [shape for shape in kept_shapes("sdpa") if score_sized(shape)]


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_row_equals_the_text_alone(kernel, side):
    """The padding's gates never enter a real token's decay: the padded row's logits are those of its text alone."""
    model = on_kernel(fox_model(), kernel)
    tokens, mask = random_ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    text = slice(4, 12) if side == "left" else slice(0, 8)
    mask[1] = 0
    mask[1, text] = 1
    with torch.no_grad():
        batched = model(tokens, attention_mask=mask).logits
        alone = model(tokens[1:, text]).logits
    torch.testing.assert_close(batched[1:, text], alone, atol=model_tolerance(model.config, alone), rtol=0)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_packed_documents_equal_separate_forwards(kernel):
    """Documents packed in one row (position_ids restarting at 0) equal each document's own forward: F runs on across
    the documents, whose keys the mask hides from each other, so every visible D sums one document's gates."""
    model = on_kernel(fox_model(), kernel)
    tokens = random_ids(1, 30)
    lengths = (11, 4, 15)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(tokens, position_ids=position_ids).logits
        start = 0
        for n in lengths:
            alone = model(tokens[:, start : start + n]).logits
            torch.testing.assert_close(
                packed[:, start : start + n], alone, atol=model_tolerance(model.config, alone), rtol=0
            )
            start += n


def cached_logits(model, tokens, cache, chunks, mask=None) -> torch.Tensor:
    outputs, start = [], 0
    for size in chunks:
        stop = start + size
        mask_so_far = None if mask is None else mask[:, :stop]
        outputs.append(model(tokens[:, start:stop], attention_mask=mask_so_far, cache=cache, use_cache=True).logits)
        start = stop
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "sliding", "latent"])
def test_cached_chunks_equal_the_full_forward(kernel, cache_kind):
    """A prefill, a chunk and single steps with left padding, the mask growing with the cache: the gates of the cached
    tokens come back from the cache beside their values (a static cache's slots after the queries, a sliding window's
    dropped keys and a latent cache's layout included)."""
    latent = {"attention_projection": "latent", "use_latent_cache": True}
    overrides = {"sliding": {"sliding_window": 5}, "latent": latent}.get(cache_kind, {})
    model = on_kernel(fox_model(**overrides), kernel).eval()
    tokens, mask = left_padded(length=14, pad=4)
    with torch.no_grad():
        full = model(tokens, attention_mask=mask, use_cache=False).logits
        if cache_kind == "static":
            cache = StaticCache(config=model.config, max_cache_len=20)
        else:
            cache = DynamicCache(config=model.config)
        chunked = cached_logits(model, tokens, cache, (6, 3, 1, 1, 1, 2), mask)
    real = mask.bool()
    atol = model_tolerance(model.config, full, magnitude=max(full[real].abs().max().item(), 1.0))
    torch.testing.assert_close(chunked[real], full[real], atol=atol, rtol=0)


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_greedy_generation_with_a_cache_equals_without(cache_implementation):
    """generate() with its cache (each step's logits too) equals generate() recomputing every step from scratch, for
    a left-padded batch."""
    model = fox_model("sdpa", pad_token_id=0)
    tokens, mask = left_padded(length=7, pad=3)
    tokens = tokens.masked_fill(mask == 0, 0)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    cached = model.generate(tokens, attention_mask=mask, cache_implementation=cache_implementation, **settings)
    uncached = model.generate(tokens, attention_mask=mask, use_cache=False, **settings)
    assert torch.equal(cached.sequences, uncached.sequences)
    for mine, theirs in zip(cached.logits, uncached.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=model_tolerance(model.config, theirs[:, None]), rtol=0)


def test_seq2seq_gates_self_attention_only_and_decodes_cached_as_full():
    """An encoder-decoder model: each self-attention layer of both stacks has its gate, cross-attention none (no
    position scheme applies there); greedy decoding with the cache equals it without."""
    config = tiny_config("scaled_dot", "forgetting", is_encoder_decoder=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = with_wide_gates(PlugformerForConditionalGeneration(config)).eval()
    names = [name for name, _ in model.named_parameters() if "forget_proj" in name]
    assert names and not [name for name in names if "cross_attn" in name]
    assert {name.split(".")[0] for name in names} == {"encoder", "decoder"}
    tokens = random_ids(2, 9)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(tokens, **settings), model.generate(tokens, use_cache=False, **settings))


def test_gates_save_and_load_per_layer(tmp_path):
    """Each layer's gate is saved in the safetensors checkpoint and loaded back by `from_pretrained`: nothing missing
    or unexpected, the same logits."""
    from safetensors.torch import load_file

    model = fox_model("sdpa")
    model.save_pretrained(tmp_path / "model")
    saved = load_file(tmp_path / "model" / "model.safetensors")
    for layer in range(model.config.num_hidden_layers):
        for name in ("weight", "bias"):
            key = f"model.layers.{layer}.self_attn.forget_proj.{name}"
            torch.testing.assert_close(saved[key], model.state_dict()[key], atol=0, rtol=0)
    loaded, info = PlugformerForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not any(info.values()), info
    tokens = random_ids(2, 10)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)


def test_the_kernel_table_gives_the_decay_to_the_kernels_that_take_its_kind():
    """eager, sdpa and flex list `decay`; flash and a kernel registered without it refuse the scheme naming the kind;
    one taking a dense bias gets the (B, H, Q, K) rows and matches eager."""
    config = tiny_config("scaled_dot", "forgetting")
    assert_built_in_kernels_take(config, "decay")
    reference = fox_model()
    with recording_kernels("decay_test", relative={"bias": "relative"}, dense={"bias": "dense"}) as received:
        reason = unsupported_reason(config, "decay_test_relative")
        assert "kinds ['relative']" in reason and "'decay'" in reason and "position_scheme='forgetting'" in reason
        assert_same_logits_on(reference, "decay_test_dense")
        assert received and all(bias.shape == (2, 4, 12, 12) for bias in received)


def test_the_gate_shards_with_the_heads_under_tensor_parallelism():
    """`forget_proj` (one output per query head) is split by rows as q_proj is: each rank computes its own heads'
    gates (the 2-process run is tests/test_tensor_parallel.py's)."""
    config = tiny_config("scaled_dot", "forgetting")
    assert config.base_model_tp_plan["layers.*.self_attn.forget_proj"] == "colwise"
    config.distributed_config = types.SimpleNamespace(tp_size=2)
    PlugformerAttention(config, 0)  # not refused


def test_the_scheme_has_no_bias_of_slots_alone():
    """The bias depends on the hidden states: asking the scheme for one of slots alone is refused, naming it."""
    scheme = ForgettingAttention(tiny_config("scaled_dot", "forgetting"))
    with pytest.raises(ValueError, match="position_scheme='forgetting'"):
        scheme.bias(torch.arange(3), torch.arange(3))
    with pytest.raises(ValueError, match="position_scheme='forgetting'"):
        scheme.bias_values(0, 3, 0, 3, torch.arange(3)[None])


def test_a_long_sequence_on_sdpa_equals_eager():
    """600 tokens with the initial gates (f ≈ 0.5): F falls to about −400 along the row, yet each block's rows on
    sdpa, their differences taken in fp32, equal eager's dense bias; finite throughout."""
    model = build(tiny_config("scaled_dot", "forgetting"), "eager")
    tokens = random_ids(1, 600)
    with torch.no_grad():
        expected = model(tokens).logits
        got = on_kernel(model, "sdpa")(tokens).logits
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=model_tolerance(model.config, expected), rtol=0)


@pytest.mark.slow  # a second Python process (~18 s here)
def test_saved_model_loads_with_trust_remote_code_without_the_package(tmp_path):
    """The checkpoint's copied code (positions_gate.py, biases.py with the decay kind) computes the same logits and
    greedy tokens in a process where plugformer cannot be imported."""
    from test_hf_integration import assert_same_without_the_package

    model = fox_model("sdpa")
    model.save_pretrained(tmp_path / "model")
    assert {"biases.py", "positions_gate.py"} <= {path.name for path in (tmp_path / "model").iterdir()}
    assert_same_without_the_package(model, tmp_path / "model", random_ids(2, 10), tmp_path)
