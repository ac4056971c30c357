"""`use_gated_attention`: Qwen3-Next's sigmoid output gate, computed from the hidden state by a q_proj twice as wide.

The reference is transformers' `Qwen3NextForCausalLM` with every layer full attention and a dense MLP
(`layer_types`, `mlp_only_layers`), weights copied (its zero-centred RMSNorm gains are 1 + w in plugformer's): logits,
cached greedy generation, a left-padded batch, eager and sdpa; then the shared suite's checks with the gate on.
"""

from __future__ import annotations

import pytest
import test_combinations as shared
import torch
from conftest import build, modifier_combinations, tiny_config
from tolerances import model_tolerance
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from plugformer import PlugformerForCausalLM


ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def plugformer_weights(state: dict) -> dict:
    """Qwen3-Next's state dict in plugformer's names: the same modules; its RMSNorms scale by (1 + w)."""
    return {name: tensor + 1 if name.endswith("norm.weight") else tensor for name, tensor in state.items()}


def qwen3_next_twin(kernel: str = "eager"):
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
        tie_word_embeddings=False,
        rope_parameters=ROPE,
        layer_types=["full_attention"] * 2,
        mlp_only_layers=[0, 1],
    )
    torch.manual_seed(0)
    reference = Qwen3NextForCausalLM(Qwen3NextConfig(**fields, attn_implementation=kernel)).eval()
    with torch.no_grad():  # Qwen3-Next starts its norm gains at 0 (a scale of 1): move them, so a missed one shows
        for name, parameter in reference.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(-0.5, 0.5)
    config = tiny_config(
        "scaled_dot",
        "rope",
        use_qk_norm=True,
        use_gated_attention=True,
        rope_parameters=ROPE,
        head_dim=8,
        tie_word_embeddings=False,
    )
    model = build(config, kernel)
    model.load_state_dict(plugformer_weights(reference.state_dict()), strict=True)
    return reference, model


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_gated_attention_matches_qwen3_next(kernel, tokens):
    reference, model = qwen3_next_twin(kernel)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        expected = reference(tokens, attention_mask=mask).logits
        got = model(tokens, attention_mask=mask, use_cache=False).logits
    atol = model_tolerance(model.config, expected)  # two fp32 models: `model_tolerance`
    torch.testing.assert_close(got[0], expected[0], atol=atol, rtol=0)
    torch.testing.assert_close(got[1, 3:], expected[1, 3:], atol=atol, rtol=0)
    prompt = tokens[:1, :4]
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8))


def test_the_gate_layout_and_sigmoid_matter(tokens):
    """Each head's query then its gate (not all queries then all gates), and sigmoid(gate) applied: a model with the
    two halves laid out the other way, or without the gate, gives other logits."""
    reference, model = qwen3_next_twin()
    with torch.no_grad():
        expected = reference(tokens).logits
        weight = model.model.layers[0].self_attn.q_proj.weight  # (H·2·D, d)
        per_head = weight.view(4, 2, 8, -1)  # (H, query|gate, D, d)
        swapped = per_head.transpose(0, 1).reshape_as(weight).clone()  # all queries, then all gates
        weight.copy_(swapped)
        assert (model(tokens, use_cache=False).logits - expected).abs().max() > 1e-3
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(2, 5, 32)
    query, gate = attention.project_query(hidden)
    assert query.shape == (2, 4, 5, 8) and gate.shape == (2, 5, 32)
    projected = attention.q_proj(hidden).view(2, 5, 4, 2, 8)  # (B, T, H, query|gate, D)
    torch.testing.assert_close(gate, projected[..., 1, :].reshape(2, 5, 32))
    merged = torch.randn(2, 5, 4, 8)  # a kernel output (B, Q, H, D)
    expected_out = attention.o_proj(merged.reshape(2, 5, 32) * torch.sigmoid(gate))
    torch.testing.assert_close(attention.output(merged, query, gate), expected_out)


def test_gated_attention_is_off_by_default_and_type_checked():
    assert not tiny_config().use_gated_attention
    assert build(tiny_config()).model.layers[0].self_attn.q_proj.out_features == 32
    assert build(tiny_config(use_gated_attention=True)).model.layers[0].self_attn.q_proj.out_features == 64
    with pytest.raises(TypeError, match="use_gated_attention"):
        tiny_config(use_gated_attention="yes")


@pytest.mark.parametrize("score,scheme,kernel", modifier_combinations(use_gated_attention=True))
def test_shared_checks_with_gated_attention(score, scheme, kernel, tokens, monkeypatch, tmp_path):
    shared.run_checks_with_fields(dict(use_gated_attention=True), score, scheme, kernel, tokens, monkeypatch, tmp_path)


@pytest.mark.parametrize("head", ["masked_lm", "seq2seq"])
def test_gated_attention_in_encoders_and_seq2seq(head, tokens):
    """The gate reads each attention's own queries' hidden states: an encoder and a seq2seq model (its decoder's
    self- and cross-attention gated) train, and the seq2seq's cached decoding equals its full forward."""
    from plugformer import PlugformerForConditionalGeneration, PlugformerForMaskedLM

    seq2seq = head == "seq2seq"
    head_fields = {"is_encoder_decoder": True, "pad_token_id": 0} if seq2seq else {"is_causal": False}
    config = tiny_config(use_gated_attention=True, **head_fields)
    torch.manual_seed(0)
    model = (PlugformerForConditionalGeneration if seq2seq else PlugformerForMaskedLM)(config)
    extra = {"decoder_input_ids": tokens[:, :6]} if seq2seq else {}
    model(tokens, labels=tokens[:, :6] if seq2seq else tokens, **extra).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "q_proj" in n)
    if seq2seq:
        model.eval()
        with torch.no_grad():
            full = model(tokens, decoder_input_ids=tokens[:, :6], use_cache=False).logits
            out = model(tokens, decoder_input_ids=tokens[:, :3], use_cache=True)
            steps = [out.logits]
            for t in range(3, 6):
                out = model(tokens, decoder_input_ids=tokens[:, t : t + 1], cache=out.cache, use_cache=True)
                steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=model_tolerance(model.config, full), rtol=0)


def test_gated_attention_converts_from_qwen3_next(tmp_path, tokens):
    from plugformer.integrations.convert import convert

    reference, _ = qwen3_next_twin()
    reference.save_pretrained(tmp_path / "source")
    model = convert(tmp_path / "source", tmp_path / "converted")
    assert model.config.use_gated_attention and model.config.use_qk_norm
    loaded = PlugformerForCausalLM.from_pretrained(tmp_path / "converted").eval()
    with torch.no_grad():
        expected = reference(tokens).logits  # the converted model against its source: `model_tolerance`
        torch.testing.assert_close(
            loaded(tokens).logits, expected, atol=model_tolerance(loaded.config, expected), rtol=0
        )


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"layer_types": ["linear_attention", "full_attention"], "mlp_only_layers": [0]},
            r"mlp_only_layers=\[0\] leaves layers \[1\]",
        ),
        ({"layer_types": ["full_attention"] * 2, "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] leaves layers \[0\]"),
    ],
)
def test_qwen3_next_layers_plugformer_has_not_are_refused(fields, message, tmp_path):
    """Mixture-of-experts layers, beside linear-attention layers too (which convert: test_linear_attention)."""
    from plugformer.integrations.convert import convert

    Qwen3NextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        **fields,
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        convert(tmp_path)
