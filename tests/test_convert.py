"""Weight import from transformers' Llama, Qwen3 (with sliding layers) and GPT-2: identical logits, then variant switches."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from tolerances import model_tolerance
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from plugformer import PlugformerForCausalLM
from plugformer.cli import main as cli_main
from plugformer.integrations.convert import convert


def llama(tie: bool):
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def qwen3_sliding():
    """A Qwen3 whose `use_sliding_window` makes its last two layers sliding (`max_window_layers=1`): a window of 3
    shorter than the prompts, so the layer kinds decide the logits."""
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # Qwen3 starts its QK-norms at 1: move them, or a missed norm would go unseen
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model


def gpt2(tie: bool = True):
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=tie)
    return GPT2LMHeadModel(config)


def deepseek_v3(first_k_dense_replace: int = 2):
    """Multi-head latent attention with interleaved RoPE; every layer dense (no MoE) by default."""
    config = DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=first_k_dense_replace,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return DeepseekV3ForCausalLM(config)


@pytest.mark.parametrize(
    "reference",
    [lambda: llama(False), lambda: llama(True), qwen3_sliding, lambda: gpt2(True), lambda: gpt2(False), deepseek_v3],
    ids=["llama", "llama-tied", "qwen3-sliding", "gpt2", "gpt2-untied", "deepseek_v3"],
)
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_converted_model_gives_the_reference_logits(reference, kernel, tmp_path, tokens):
    torch.manual_seed(0)
    source = reference().eval()
    source.save_pretrained(tmp_path / "source")
    model = convert(tmp_path / "source", tmp_path / "converted")
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # left padding: both derive positions from the mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", attn_implementation=kernel).eval()
    assert type(loaded) is PlugformerForCausalLM
    source.set_attn_implementation(kernel)
    with torch.no_grad():
        expected = source(tokens, attention_mask=mask, position_ids=position_ids).logits
        actual = loaded(tokens, attention_mask=mask).logits
    atol = model_tolerance(loaded.config, expected)  # the converted model against its source: `model_tolerance`
    torch.testing.assert_close(actual[0], expected[0], atol=atol, rtol=0)
    torch.testing.assert_close(actual[1, 3:], expected[1, 3:], atol=atol, rtol=0)
    prompt = tokens[:1, :5]
    assert torch.equal(
        loaded.generate(prompt, max_new_tokens=6, do_sample=False),
        source.generate(prompt, max_new_tokens=6, do_sample=False),
    )
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == source.config.tie_word_embeddings
    assert model.config.position_scheme == ("learned" if source.config.model_type == "gpt2" else "rope")
    assert model.config.layer_types == getattr(source.config, "layer_types", ["full_attention"] * 2)
    latent = source.config.model_type == "deepseek_v3"
    assert model.config.attention_projection == ("latent" if latent else "standard")


def test_switching_the_position_scheme_keeps_every_other_weight(tmp_path, tokens, caplog):
    torch.manual_seed(0)
    source = gpt2()
    source.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="plugformer.integrations.convert"):
        model = convert(tmp_path, position_scheme="alibi", attention_score="multiplicative")
    assert "model.positions.embed_positions.weight" in caplog.text  # dropped: ALiBi has no position table
    assert "score.weight" in caplog.text  # new: the bilinear W, initialised as I/sqrt(d)
    torch.testing.assert_close(model.model.layers[1].mlp.up_proj.weight, source.transformer.h[1].mlp.c_fc.weight.t())
    model.train()
    model(tokens, labels=tokens).loss.backward()  # ready to fine-tune
    assert model.model.layers[0].self_attn.score.weight.grad is not None


def test_unsupported_checkpoints_are_refused(tmp_path):
    from transformers import BertConfig

    BertConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    ).save_pretrained(tmp_path)
    from plugformer.integrations.families import CONVERTERS

    with pytest.raises(ValueError, match=re.escape(f"model_type='bert' is not one of {list(CONVERTERS)}")):
        convert(tmp_path)


def test_deepseek_v3_with_expert_layers_is_refused(tmp_path):
    deepseek_v3(first_k_dense_replace=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"first_k_dense_replace=1 < num_hidden_layers=2: .* mixture-of-experts"):
        convert(tmp_path)


def test_convert_command(tmp_path, capsys):
    torch.manual_seed(0)
    llama(True).save_pretrained(tmp_path / "source")
    cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--set", "position_scheme=t5_bias"])
    assert "t5_bias" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.position_scheme == "t5_bias"


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_padding_holes_and_pad_rows_match_llama_under_generate_positions(kernel, tmp_path, tokens):
    """generate()'s `position_ids` (1 at every pad) beside a padding mask with a hole and left padding: every
    position's logits, pad rows included, are Llama's (a padding mask turns off packing read from positions)."""
    torch.manual_seed(0)
    source = llama(False).eval()
    source.save_pretrained(tmp_path / "source")
    convert(tmp_path / "source", tmp_path / "converted")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", attn_implementation=kernel).eval()
    source.set_attn_implementation(kernel)
    mask = torch.ones_like(tokens)
    mask[0, 1] = 0  # a hole after token 0
    mask[1, :3] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        expected = source(tokens, attention_mask=mask, position_ids=position_ids).logits
        actual = loaded(tokens, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(actual, expected, atol=model_tolerance(loaded.config, expected), rtol=0)


def test_a_llama_field_the_source_ignores_is_not_carried_over(tmp_path, tokens):
    """transformers' Llama ignores `partial_rotary_factor` with the default RoPE (it rotates all of
    head_dim); carried over, it made the converted model rotate half of each head (logits 1.25e-3 off)."""
    torch.manual_seed(0)
    source = llama(False)
    source.config.rope_parameters["partial_rotary_factor"] = 0.5
    source.eval().save_pretrained(tmp_path / "source")
    model = convert(tmp_path / "source")
    assert "partial_rotary_factor" not in model.config.rope_parameters
    with torch.no_grad():
        expected = source(tokens).logits  # `model_tolerance`: ~7e-6 here, rotating half of each head was 1.25e-3 off
        torch.testing.assert_close(model(tokens).logits, expected, atol=model_tolerance(model.config, expected), rtol=0)
    # another rope type shortens the frequencies by it while Llama rotates the whole head: refused
    source.config.rope_parameters.update(rope_type="linear", factor=2.0)
    source.config.save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5 with rope_type='linear'"):
        convert(tmp_path / "source")


def test_convert_command_imports_a_dense_deepseek_v3(tmp_path, capsys, tokens):
    torch.manual_seed(0)
    source = deepseek_v3().eval()
    source.save_pretrained(tmp_path / "source")
    cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out")])
    assert "saved PlugformerForCausalLM" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    config = loaded.config
    assert config.attention_projection == "latent" and config.rope_interleave and config.use_latent_cache
    with torch.no_grad():
        expected = source(tokens).logits
        torch.testing.assert_close(loaded(tokens).logits, expected, atol=model_tolerance(config, expected), rtol=0)


def test_a_convert_that_fails_after_its_claim_hands_the_folder_back_for_a_retry(tmp_path, llama_source, monkeypatch):
    import json

    from plugformer.runtime.run_folders import LOCK, RUN_RECORD, TAKEOVER

    output = tmp_path / "out"

    def disk_fills_after_the_config(self, folder, **kwargs):
        self.config.save_pretrained(folder)  # config.json is written, the weights are not
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(PlugformerForCausalLM, "save_pretrained", disk_fills_after_the_config)
        with pytest.raises(OSError, match="the disk is full"):
            convert(llama_source, output)
    # before: config.json, the record and (until exit) the lock stayed, and the retry was refused as another run's
    assert sorted(path.name for path in output.iterdir()) == [TAKEOVER]
    model = convert(llama_source, output)
    assert json.loads((output / RUN_RECORD).read_text()) == {"stage": "convert"} and not (output / LOCK).exists()
    reloaded = PlugformerForCausalLM.from_pretrained(output)
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
