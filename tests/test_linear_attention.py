"""`layer_types` entry `"linear_attention"`: Qwen3-Next's Gated DeltaNet (`linear_attention.PlugformerGatedDeltaNet`).

References: the paper's per-token recurrence, written out below in float64, for the chunked delta rule; transformers'
`Qwen3NextForCausalLM` (linear and full layers, a dense MLP in every layer) for the whole layer and its cache; the
converted checkpoint (`plugformer convert`) against its source. Then the cache (greedy tokens and logits with and
without, chunked prefill, a left-padded batch), saving and loading (with and without plugformer installed), training
and the refusals of what the layer cannot compute.
"""

from __future__ import annotations

import copy

import pytest
import test_combinations as shared
import test_conformance as conformance
import torch
from conftest import SCHEMES, SCORES, build, on_kernel, tiny_config
from test_hf_integration import assert_same_without_the_package
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM

from plugformer import POSITION_SCHEMES, PlugformerConfig, PlugformerForCausalLM, supported_kernels
from plugformer.cli import main as cli_main
from plugformer.integrations.convert import convert
from plugformer.integrations.families import qwen3_next_config, qwen3_next_weights
from plugformer.linear_attention import PlugformerGatedDeltaNet, chunked_gated_delta_rule


ATOL = 1e-5  # logits of two float32 models of the same weights
HYBRID = ["linear_attention", "full_attention", "linear_attention"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# widths that differ from each other, so a swapped reshape or split fails: 2 key heads serving 4 value heads
LINEAR = dict(
    linear_conv_kernel_dim=3,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def naive_gated_delta_rule(q, k, v, g, beta, state):
    """The paper's recurrence token by token (Yang et al. 2024, eq. 10): S_t = α_t S_{t-1} (I − β_t k_t k_tᵀ) +
    β_t v_t k_tᵀ, o_t = S_t q_t, with S (d_v × d_k) per head. q, k, v: (B, H, T, D); g = log α, beta: (B, H, T);
    state: (B, H, D_v, D_k). Returns the outputs (B, H, T, D_v) and the last S."""
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    outputs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        erase = eye - b_t * k_t[..., :, None] * k_t[..., None, :]  # I − β k kᵀ: (B, H, D_k, D_k)
        state = g[:, :, t, None, None].exp() * state @ erase + b_t * v_t[..., :, None] * k_t[..., None, :]
        outputs.append(state @ q[:, :, t, :, None])  # (B, H, D_v, 1)
    return torch.cat(outputs, dim=-1).transpose(-1, -2), state


def normalized(q, k):
    """Qwen3-Next's q and k before the rule: L2-normalised as x / sqrt(‖x‖² + 1e-6), q then scaled by 1/sqrt(d_k)."""
    unit = lambda x: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    return unit(q) / q.shape[-1] ** 0.5, unit(k)


@pytest.mark.parametrize("length", [1, 7, 16, 45, 64])
def test_chunked_rule_equals_the_paper_recurrence_in_float64(length):
    """Lengths below, at and between multiples of the block (16 here, so 45 and 64 take several blocks, 45 with a
    padded last one), from a random initial state."""
    generator = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    batch, heads, d_k, d_v = 2, 3, 5, 4
    q, k = normalized(rand(batch, heads, length, d_k), rand(batch, heads, length, d_k))
    v = rand(batch, heads, length, d_v)
    g = -torch.rand(batch, heads, length, generator=generator, dtype=torch.float64)  # log α ∈ (−1, 0]
    beta = torch.rand(batch, heads, length, generator=generator, dtype=torch.float64)
    state = rand(batch, heads, d_v, d_k)
    expected, expected_state = naive_gated_delta_rule(q, k, v, g, beta, state)
    # the chunked rule keeps M = Sᵀ (d_k × d_v)
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, state.transpose(-1, -2), chunk_size=16)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_state.transpose(-1, -2), expected_state, atol=1e-12, rtol=0)


def qwen3_next_fields(**overrides) -> dict:
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=ROPE,
        layer_types=HYBRID,
        mlp_only_layers=[0, 1, 2],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **LINEAR,
    )
    return fields | overrides


def randomized(reference: Qwen3NextForCausalLM) -> Qwen3NextForCausalLM:
    """Norm gains (zero-centred in Qwen3-Next), decays and steps moved off their starting values, so a missed
    conversion shows."""
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                parameter.uniform_(-0.5, 0.5)
            if name.endswith("conv1d.weight"):
                parameter.normal_(0, 0.5)
    return reference


def qwen3_next_twin(kernel: str = "eager"):
    """transformers' Qwen3-Next with linear and full layers and plugformer's model of the same fields and weights."""
    torch.manual_seed(0)
    reference = randomized(Qwen3NextForCausalLM(Qwen3NextConfig(**qwen3_next_fields(), attn_implementation="eager")))
    model = build(PlugformerConfig(**qwen3_next_config(reference.config)), kernel)
    model.load_state_dict(qwen3_next_weights(reference.state_dict(), model.config, reference.config), strict=True)
    return reference.eval(), model


def long_tokens(length: int = 80, batch: int = 2, seed: int = 5) -> torch.Tensor:
    """Ids avoiding the special ones, longer than a block of the chunked rule (64)."""
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_hybrid_model_matches_qwen3_next(kernel):
    """Logits within 1e-5 over 80 tokens (two blocks), a left-padded row included, and equal greedy tokens."""
    reference, model = qwen3_next_twin(kernel)
    assert isinstance(model.model.layers[0].linear_attn, PlugformerGatedDeltaNet)
    assert not hasattr(model.model.layers[0], "self_attn") and hasattr(model.model.layers[1], "self_attn")
    ids = long_tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1, 5:], expected[1, 5:], atol=ATOL, rtol=0)
    prompt = ids[:1, :6]
    generated = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False))


def greedy(model, prompt, mask=None, use_cache=True):
    out = model.generate(
        prompt,
        attention_mask=mask,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        use_cache=use_cache,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def test_generate_with_cache_equals_without():
    """Greedy tokens and every step's logits, with the cache and without it (each step a full forward)."""
    _, model = qwen3_next_twin()
    prompt = long_tokens(9, batch=2)
    cached, cached_logits = greedy(model, prompt)
    uncached, uncached_logits = greedy(model, prompt, use_cache=False)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(cached_logits, uncached_logits, atol=ATOL, rtol=0)


def test_static_cache_and_beam_search_generate_as_qwen3_next():
    """A static cache (its linear-attention layers are the dynamic one's) gives the dynamic cache's tokens, and beam
    search (the cache reordered per beam) Qwen3-Next's, on a left-padded batch."""
    reference, model = qwen3_next_twin()
    prompts = long_tokens(9, batch=2)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    settings = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    dynamic = model.generate(prompts, **settings)
    assert torch.equal(model.generate(prompts, cache_implementation="static", **settings), dynamic)
    assert torch.equal(dynamic, reference.generate(prompts, **settings))
    assert torch.equal(
        model.generate(prompts, num_beams=3, **settings), reference.generate(prompts, num_beams=3, **settings)
    )


def test_chunked_prefill_and_decoding_steps_equal_the_full_forward():
    """A prompt fed in pieces of 70 (beyond a block), 1, 5 and 1 tokens through one cache: the full forward's
    logits, and the cache's length counts every token."""
    _, model = qwen3_next_twin()
    ids = long_tokens(77)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        pieces = []
        for start, stop in ((0, 70), (70, 71), (71, 76), (76, 77)):
            out = model(ids[:, start:stop], cache=cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0)
    assert int(cache.get_seq_length(0)) == int(cache.get_seq_length(1)) == 77


def test_left_padding_leaves_the_state_as_without_it():
    """A left-padded row's greedy tokens and logits equal the same prompt alone: the pads write nothing into the
    state (and decay nothing), in the prompt's forward and through the cached steps."""
    _, model = qwen3_next_twin()
    prompts = long_tokens(9, batch=2)
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    padded = prompts.clone()
    padded[1, :4] = 0  # the pad id
    batch_tokens, batch_logits = greedy(model, padded, mask)
    alone_tokens, alone_logits = greedy(model, prompts[1:, 4:])
    assert torch.equal(batch_tokens[1, 4:], alone_tokens[0])
    torch.testing.assert_close(batch_logits[1], alone_logits[0], atol=ATOL, rtol=0)
    with torch.no_grad():  # the recurrent state after the padded prompt is the state after the prompt alone
        states = []
        for ids, row_mask in ((padded[1:], mask[1:]), (prompts[1:, 4:], None)):
            cache = DynamicCache(config=model.config)
            model(ids, attention_mask=row_mask, cache=cache, use_cache=True)
            states.append(cache.layers[0].recurrent_states[0])
    torch.testing.assert_close(states[0], states[1], atol=1e-6, rtol=0)


def test_eager_and_sdpa_give_the_same_hybrid_model():
    """The linear layers take no kernel: the full layers' kernel choice changes nothing beyond rounding."""
    _, model = qwen3_next_twin("eager")
    ids = long_tokens(20)
    with torch.no_grad():
        torch.testing.assert_close(on_kernel(model, "sdpa")(ids).logits, model(ids).logits, atol=ATOL, rtol=0)


def test_training_step_reaches_every_parameter_of_the_layer():
    config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = build(config).train()
    ids = long_tokens(70)
    model(ids, labels=ids).loss.backward()
    layer = model.model.layers[0].linear_attn
    names = {name for name, _ in layer.named_parameters()}
    assert names == {
        "in_proj_qkvz.weight",
        "in_proj_ba.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    }
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_gradient_checkpointing_gives_the_same_gradients():
    config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    ids = long_tokens(20)
    grads = []
    for checkpointing in (False, True):
        model = build(config).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append(model.model.layers[0].linear_attn.in_proj_qkvz.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=0)


@pytest.fixture
def saved_hybrid(tmp_path):
    config = tiny_config(num_hidden_layers=3, layer_types=HYBRID, **LINEAR)
    model = build(config)
    model.save_pretrained(tmp_path / "saved")
    return tmp_path / "saved", model


def test_save_and_load_round_trip(saved_hybrid):
    directory, model = saved_hybrid
    assert (directory / "linear_attention.py").is_file()  # the checkpoint carries the layer's code
    loaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert loaded.config.layer_types == HYBRID and loaded.config.linear_num_value_heads == 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name  # A_log, dt_bias loaded, not re-initialised
    ids = long_tokens(12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.slow
def test_trust_remote_code_loads_the_hybrid_without_the_package(saved_hybrid, tmp_path):
    directory, model = saved_hybrid
    assert_same_without_the_package(model, directory, long_tokens(12), tmp_path)


def save_qwen3_next(directory, **overrides):
    torch.manual_seed(0)
    source = randomized(Qwen3NextForCausalLM(Qwen3NextConfig(**qwen3_next_fields(**overrides))).eval())
    source.save_pretrained(directory)
    return source


def test_convert_imports_a_hybrid_qwen3_next(tmp_path, capsys):
    """`plugformer convert`: the converted checkpoint's logits within 1e-5 of the source's, equal greedy tokens."""
    source = save_qwen3_next(tmp_path / "source")
    cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "converted")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert isinstance(loaded, PlugformerForCausalLM) and loaded.config.layer_types == HYBRID
    assert {name: getattr(loaded.config, name) for name in LINEAR} == LINEAR
    ids = long_tokens(70)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, atol=ATOL, rtol=0)
    prompt = ids[:1, :5]
    assert torch.equal(
        loaded.generate(prompt, max_new_tokens=8, do_sample=False),
        source.generate(prompt, max_new_tokens=8, do_sample=False),
    )


def test_convert_keeps_refusing_expert_layers(tmp_path):
    save_qwen3_next(
        tmp_path,
        mlp_only_layers=[0],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\] leaves layers \[1, 2\] mixture-of-experts"):
        convert(tmp_path)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"is_causal": False}, r"'linear_attention' layers, .* but is_causal=False"),
        ({"layer_types": ["linear_attention"] * 2, "is_encoder_decoder": True, "pad_token_id": 0},
         r"'linear_attention' layers, .* but is_encoder_decoder=True"),
        ({"value_residual": "fixed"}, r"value_residual='fixed' .* 'linear_attention' layers"),
        ({"position_scheme": "alibi"}, r"position_scheme='alibi' adds a score bias, .* use one of \["),
        ({"position_scheme": "forgetting"}, r"position_scheme='forgetting' adds a score bias"),
        ({"linear_num_key_heads": 3}, r"linear_num_key_heads=3 must divide linear_num_value_heads=4"),
        ({"linear_conv_kernel_dim": 0}, r"linear_conv_kernel_dim=0 must be a positive integer"),
        ({"layer_types": ["full_attention"] * 2, "linear_key_head_dim": 8},
         r"linear_key_head_dim=8 configures 'linear_attention' layers, but layer_types=.* has none"),
    ],
)  # fmt: skip
def test_what_the_layer_cannot_compute_is_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        PlugformerConfig.from_preset(
            "tiny", **{"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], **fields}
        )


def test_the_fields_default_from_the_attention_sizes_and_stay_unset_without_linear_layers():
    config = tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (
        config.num_key_value_heads,
        config.num_attention_heads,
    )
    assert config.linear_key_head_dim == config.linear_value_head_dim == config.head_dim
    assert config.linear_conv_kernel_dim == 4
    assert tiny_config().linear_conv_kernel_dim is None and "linear_attention" not in tiny_config().layer_types


def test_packed_documents_are_refused():
    """Positions restarting inside a row (packed documents) would run one document's state into the next."""
    model = build(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    ids = long_tokens(8)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"packed document into the next \(position_ids restart"):
        model(ids, position_ids=position_ids)


def test_a_cache_without_linear_attention_layers_is_refused():
    model = build(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(ValueError, match=r"cache has no linear-attention layer at index 0.*DynamicCache\(config="):
        model(long_tokens(5), cache=DynamicCache(), use_cache=True)


def test_tensor_parallelism_is_refused_for_the_layer():
    config = copy.deepcopy(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))

    class TwoRanks:
        tp_size = 2

    config.distributed_config = TwoRanks()
    with pytest.raises(ValueError, match=r"'linear_attention' layers, which cannot run with tensor parallelism"):
        PlugformerGatedDeltaNet(config, 0)


def test_vllm_plugin_refuses_linear_attention_layers():
    from plugformer.integrations.vllm_plugin import refuse_unsupported_layers

    refuse_unsupported_layers(tiny_config())
    with pytest.raises(ValueError, match=r"layer_types has 'linear_attention' layers \[0\].* vLLM"):
        refuse_unsupported_layers(tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))


# the shared suite's checks with a linear layer first, then full attention, at the suites' 2 layers
SUITE_FIELDS = {"layer_types": ["linear_attention", "full_attention"]}


def suite_combinations() -> list:
    """(score, scheme, kernel) for the shared checks: every score with RoPE and scaled_dot with every scheme the
    linear layers take (no score bias), on eager and sdpa where the full layer's pair runs on it; scaled_dot + rope
    by default, the rest `slow`."""
    params = []
    for score in SCORES:
        for scheme in SCHEMES:
            if POSITION_SCHEMES.get(scheme).has_bias or (score != "scaled_dot" and scheme != "rope"):
                continue
            for kernel in ("eager", "sdpa"):
                if kernel in supported_kernels(tiny_config(score, scheme, **SUITE_FIELDS)):
                    slow = (score, scheme) != ("scaled_dot", "rope")
                    params.append(
                        pytest.param(
                            score,
                            scheme,
                            kernel,
                            id=f"{score}-{scheme}-{kernel}",
                            marks=(pytest.mark.slow,) if slow else (),
                        )
                    )
    return params


@pytest.mark.parametrize("score,scheme,kernel", suite_combinations())
def test_shared_checks_with_a_linear_layer(score, scheme, kernel, tokens, monkeypatch, tmp_path):
    """Causality, left padding, cached decoding, fused kernels against eager, saving and the backward pass."""
    shared.run_checks_with_fields(SUITE_FIELDS, score, scheme, kernel, tokens, monkeypatch, tmp_path)


@pytest.fixture(scope="class")
def causal():
    """test_conformance's causal LM (its `causal` fixture) with a linear layer first."""
    return conformance.make(PlugformerForCausalLM, "scaled_dot", "rope", **SUITE_FIELDS)


class TestCausalLMConformanceWithLinearAttention(conformance.TestCausalLM):
    def test_attentions_hidden_states_and_their_gradients(self, causal):
        """Attention maps of the softmax-attention layers only (a linear layer has none; so in transformers'
        Qwen3-Next, whose `_can_record_outputs` records its attention class), hidden states of every layer."""
        config = causal.config
        output = conformance.eager_copy(causal)(conformance.ids(), output_attentions=True, output_hidden_states=True)
        attention_layers = config.layer_types.count("full_attention")
        conformance.assert_attention_maps(
            output.attentions,
            attention_layers,
            config.num_attention_heads,
            conformance.LENGTH,
            conformance.LENGTH,
            causal=True,
        )
        assert len(output.hidden_states) == config.num_hidden_layers + 1
        output.hidden_states[0].retain_grad()
        output.logits.sum().backward()
        assert output.hidden_states[0].grad is not None


@pytest.mark.parametrize(
    "kernel", [k for k in supported_kernels(tiny_config(**SUITE_FIELDS)) if k not in ("eager", "sdpa")]
)
def test_other_kernels_match_eager(kernel, tokens):
    """The kernels besides eager and sdpa (flex_attention on the CPU, flash where installed) in the full layer."""
    model = build(tiny_config(**SUITE_FIELDS))
    with torch.no_grad():
        expected = model(tokens).logits
        torch.testing.assert_close(on_kernel(model, kernel)(tokens).logits, expected, atol=ATOL, rtol=0)


def test_a_hybrid_model_trains_under_fsdp2_to_the_single_process_weights(saved_hybrid, tmp_path):
    """FSDP2 over 2 processes (each block, then the root, sharded: `tests/fsdp_worker.py`) trains the Gated DeltaNet
    layers to the weights one process reaches on the whole batch, with the same weights on both ranks."""
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file
    from test_fsdp import ENV, WORKER, free_port

    directory, _ = saved_hybrid
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    for command, output in (([*torchrun, str(WORKER)], "sharded"), ([sys.executable, str(WORKER), "--single"], "one")):
        result = subprocess.run(
            [*command, str(directory), str(tmp_path / output)], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
    first, second = json.loads((tmp_path / "sharded" / "worker.json").read_text())["digests"]
    assert first == second
    start, one = load_file(directory / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    sharded = load_file(tmp_path / "sharded" / "model.safetensors")
    linear = [name for name in one if ".linear_attn." in name]
    assert len(linear) == 7 * HYBRID.count("linear_attention")
    for name in one:
        torch.testing.assert_close(sharded[name], one[name], atol=1e-5, rtol=0, msg=name)
    assert all(not torch.equal(one[name], start[name]) for name in linear)  # every layer parameter trained
