"""Gemma 2's block and scales as plugformer fields: the sandwich norm placement (a norm on each sublayer's input and
output), `embedding_multiplier` and `final_logit_softcapping`, each against the formula computed here by hand from
the model's own sublayers (Gemma 2 itself: `test_real_configs`; the fused loss: `test_fused_loss`)."""

from __future__ import annotations

import pytest
import torch
from conftest import build, tiny_config
from transformers import Gemma2Config, Gemma2ForCausalLM

from plugformer import PlugformerConfig
from plugformer.runtime.memory import parameter_count


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · g, written out."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float32's precision: the model's RMSNorm computes in float32 (as Llama's) in a float64 model."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def captured(module, store: dict, name: str):
    """Records `module`'s first positional input and its output (the first element of a tuple) under `name`."""

    def hook(_, args, output):
        store[name] = (args[0], output[0] if isinstance(output, tuple) else output)

    return module.register_forward_hook(hook)


def test_a_sandwich_block_norms_each_sublayer_input_and_output_and_the_scales_apply(tokens):
    config = tiny_config(
        num_hidden_layers=1, norm_placement="sandwich", embedding_multiplier=3.0, final_logit_softcapping=0.4
    )
    model = build(config).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    layer, seen = model.model.layers[0], {}
    for name in ("self_attn", "mlp"):
        captured(getattr(layer, name), seen, name)
    captured(model.model.norm, seen, "final_norm")
    with torch.no_grad():
        logits = model(tokens).logits
        h0 = model.model.embed_tokens(tokens) * 3.0
        attention_input, attention = seen["self_attn"]
        assert_close(attention_input, rms_norm(h0, layer.input_layernorm))
        h1 = h0 + rms_norm(attention, layer.post_self_attn_layernorm)
        mlp_input, mlp = seen["mlp"]
        assert_close(mlp_input, rms_norm(h1, layer.post_attention_layernorm))
        h2 = h1 + rms_norm(mlp, layer.post_feedforward_layernorm)
        assert_close(seen["final_norm"][0], h2)
        expected = model.lm_head(rms_norm(h2, model.model.norm))
        assert_close(logits, 0.4 * torch.tanh(expected / 0.4))
    assert logits.abs().max() < 0.4 < expected.abs().max()  # the cap acted


def test_the_pre_and_post_placements_build_no_output_norms():
    for placement in ("pre", "post"):
        layer = build(tiny_config(norm_placement=placement)).model.layers[0]
        assert layer.post_self_attn_layernorm is None and layer.post_feedforward_layernorm is None
        assert not any("post_self_attn" in name or "post_feedforward" in name for name, _ in layer.named_parameters())


def test_the_embedding_multiplier_is_rounded_to_the_embeddings_dtype_as_gemma_does():
    """Gemma multiplies by sqrt(hidden_size) as a tensor of the embeddings' dtype: 59.87 (Gemma 2 9B) is 59.75 in bf16."""
    model = build(tiny_config(embedding_multiplier=3584**0.5)).to(torch.bfloat16)
    embeddings = torch.randn(1, 3, model.config.hidden_size).to(torch.bfloat16)
    scaled = model.model._token_embeddings(None, embeddings)
    assert torch.tensor(3584**0.5, dtype=torch.bfloat16).item() == 59.75
    assert torch.equal(scaled, embeddings * torch.tensor(59.75, dtype=torch.bfloat16))


@pytest.mark.parametrize("field", ["final_logit_softcapping", "embedding_multiplier"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_a_scale_that_is_not_finite_and_positive_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} must be a finite positive number"):
        PlugformerConfig.from_preset("tiny", **{field: value})


def test_a_gemma2_shaped_model_counts_as_gemma2():
    """Four norms a block (the sandwich's two more), a tied head: the parameters of transformers' Gemma 2."""
    config = tiny_config(norm_placement="sandwich", hidden_act="gelu_pytorch_tanh", embedding_multiplier=8.0)
    reference = Gemma2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
    )
    with torch.device("meta"):
        expected = sum(parameter.numel() for parameter in Gemma2ForCausalLM(reference).parameters())
    assert parameter_count(config) == expected


def test_vllm_refuses_a_final_logit_cap_it_is_not_known_to_apply():
    from plugformer.integrations.vllm_plugin import refuse_unsupported_layers

    refuse_unsupported_layers(
        tiny_config(norm_placement="sandwich", embedding_multiplier=8.0)
    )  # in plugformer's modules
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0: vLLM computes the logits with its own head"):
        refuse_unsupported_layers(tiny_config(final_logit_softcapping=30.0))
