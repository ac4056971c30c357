"""`value_residual`: value residual learning (Zhou et al. 2024, ResFormer), V_n' = λ1·V_n + λ2·V_1.

The formula is checked by hand: each layer's own values V_n and the first layer's V_1 are recomputed here from the
layers' inputs and weights (v_proj of the normed block input), and the values each kernel gets must be λ1·V_n + λ2·V_1
(layer 1: V_1 itself). Then the shared suite's checks with the mix on, seq2seq, gradient checkpointing and the
tensor-parallel refusal.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import test_combinations as shared
import torch
from conftest import build, modifier_combinations, tiny_config
from tolerances import gradient_tolerance, model_tolerance, tolerance

from plugformer import PlugformerForConditionalGeneration
from plugformer.attention import check_tensor_parallel


LAMBDAS = (0.3, 1.7)  # distinct, so a swapped mix or a missing term shows


def kernel_values(model, tokens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the values each layer's kernel got, each layer's block input) of a forward without a cache."""
    got, inputs = [], []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
        score = layer.self_attn.score
        score.prepare_value = functools.partial(
            lambda original, v: got.append(v.detach()) or original(v), score.prepare_value
        )
        layer.self_attn.score_hooks |= {"prepare_value"}  # attention calls the hooks named there (the identity too)
    with torch.no_grad():
        model(tokens, use_cache=False)
    return got, inputs


def own_values(layer, hidden_states) -> torch.Tensor:
    """V_n = (norm(h) W_V) split into heads `(B, H_kv, T, D)`, for a pre-norm block, computed here."""
    normed = layer.input_layernorm(hidden_states)
    projected = normed @ layer.self_attn.v_proj.weight.T  # (B, T, H_kv·D)
    batch, length = projected.shape[:2]
    return projected.view(batch, length, -1, layer.self_attn.head_dim).transpose(1, 2)


@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_value_residual_follows_the_papers_formula(mode, tokens):
    model = build(tiny_config(value_residual=mode, num_hidden_layers=3))
    lambdas = (0.5, 0.5)
    if mode == "learned":
        lambdas = LAMBDAS
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.self_attn.value_residual.value_lambdas.copy_(torch.tensor(LAMBDAS))
    got, inputs = kernel_values(model, tokens)
    with torch.no_grad():
        first = own_values(model.model.layers[0], inputs[0])
        # the norm and the projection, computed twice in fp32: the projection's terms |norm(h)|·|W_V| summed over
        # the hidden size, through the norm's steps and the mix's product and sum
        layer = model.model.layers[0]
        terms = (layer.input_layernorm(inputs[0]).abs() @ layer.self_attn.v_proj.weight.abs().T).max().item()
        atol = tolerance(torch.float32, magnitude=terms, length=model.config.hidden_size, steps=4)
        torch.testing.assert_close(got[0], first, atol=atol, rtol=0)  # the first layer attends with its own
        for n in (1, 2):
            own = own_values(model.model.layers[n], inputs[n])
            expected = lambdas[0] * own + lambdas[1] * first
            torch.testing.assert_close(got[n], expected, atol=atol, rtol=0)  # λ's sum at most 1: the same bound
            assert (got[n] - own).abs().max() > 1e-3  # the mix changes the values


def test_value_residual_is_off_by_default_and_validated():
    assert tiny_config().value_residual is None
    assert not any("value_lambdas" in name for name, _ in build(tiny_config()).named_parameters())
    with pytest.raises(ValueError, match=r"value_residual='mean' is not one of \[None, 'fixed', 'learned'\]"):
        tiny_config(value_residual="mean")


def test_learned_value_residual_is_refused_under_tensor_parallelism(monkeypatch):
    from plugformer import attention

    monkeypatch.setattr(attention, "TENSOR_PARALLEL_VERIFIED", True)  # the variant's answer, on any release
    for mode, refused in (("learned", True), ("fixed", False)):
        config = tiny_config(value_residual=mode)
        config.distributed_config = SimpleNamespace(tp_size=2)
        if refused:
            with pytest.raises(ValueError, match=r"value_residual='learned' cannot train with tensor parallelism"):
                check_tensor_parallel(config)
        else:
            check_tensor_parallel(config)


@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_value_residual_survives_reentrant_gradient_checkpointing(mode, tokens):
    """The first layer's values reach the later blocks as a positional input: reentrant checkpointing (which gives
    gradients to its inputs only) yields the gradients of the plain backward."""
    model = build(tiny_config(value_residual=mode, num_hidden_layers=3)).train()
    model(tokens, labels=tokens, use_cache=False).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model(tokens, labels=tokens, use_cache=False).loss.backward()
    atol = gradient_tolerance(model.config, expected, tokens.shape[1])  # recomputed blocks: another order
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("score,scheme,kernel", modifier_combinations(value_residual="learned"))
def test_shared_checks_with_value_residual(score, scheme, kernel, tokens, monkeypatch, tmp_path):
    shared.run_checks_with_fields(dict(value_residual="learned"), score, scheme, kernel, tokens, monkeypatch, tmp_path)


@pytest.mark.parametrize("mode", ["fixed", "learned"])
def test_value_residual_in_seq2seq_decodes_as_the_full_forward(mode, tokens):
    """Each stack mixes with its own first layer; the decoder's cache holds the mixed values."""
    torch.manual_seed(0)
    config = tiny_config(value_residual=mode, is_encoder_decoder=True, pad_token_id=0)
    model = PlugformerForConditionalGeneration(config).eval()
    with torch.no_grad():
        full = model(tokens, decoder_input_ids=tokens[:, :6], use_cache=False).logits
        out = model(tokens, decoder_input_ids=tokens[:, :3], use_cache=True)
        steps = [out.logits]
        for t in range(3, 6):
            out = model(tokens, decoder_input_ids=tokens[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=model_tolerance(model.config, full), rtol=0)
