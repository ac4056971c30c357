"""Real model families' attention and position settings through `convert`: each family built tiny with the non-size
fields its published checkpoints use (rope types and their parameters, windows, caps, NoPE layers, partial rotation,
sinks), converted with equal logits and greedy tokens or refused by name; the result saves, loads back, builds on the
meta device and (slow) loads with `trust_remote_code` where plugformer is not installed.

Adding a family to `convert` = one row in `FAMILIES` (or `REFUSED`)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from plugformer import PlugformerForCausalLM
from plugformer.cli import main as cli_main
from plugformer.integrations.convert import convert


# sizes only: every other field is the family's published value (or transformers' default, which is it)
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# a long-context rope's original length, shortened with the sizes so that the 12-token inputs cross it
ORIGINAL = 8
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}  # fmt: skip
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": ORIGINAL}  # fmt: skip


def llama3():
    """Llama 3.1/3.2: the `llama3` rope (frequencies rescaled by wavelength), theta 5e5, tied head (3.2 1B)."""
    return LlamaForCausalLM(
        LlamaConfig(**SIZES, rope_parameters=dict(LLAMA3_ROPE), rms_norm_eps=1e-5, tie_word_embeddings=True)
    )


def qwen3(rope_parameters: dict | None = None):
    """Qwen3 (0.6B's fields): QK-norm, theta 1e6, tied head; with YaRN as its model cards extend the context."""
    rope = rope_parameters or {"rope_type": "default", "rope_theta": 1000000.0}
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16, rope_parameters=dict(rope), tie_word_embeddings=True))


def deepseek_v3():
    """DeepSeek-V3's attention: multi-head latent attention, interleaved rope, its YaRN with `mscale_all_dim`; its
    layers all dense (`first_k_dense_replace` = every layer: the expert layers are refused, `test_convert`)."""
    config = DeepseekV3Config(
        **{**SIZES, "num_key_value_heads": 4},
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        rope_parameters=dict(DEEPSEEK_V3_YARN),
        tie_word_embeddings=False,
    )
    return DeepseekV3ForCausalLM(config)


def mistral():
    """Mistral 7B v0.1: a sliding window in every layer (4096 there; 4 here, shorter than the inputs)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4, rope_parameters=rope, tie_word_embeddings=False))


def gemma2(query_pre_attn_scalar: int = 16):
    """Gemma 2 (2B's fields): sandwich norms, embeddings times sqrt(hidden_size), attention logits capped at 50 and
    head logits at 30, GeGLU, every other layer sliding (window 4 here); `query_pre_attn_scalar` = head_dim (2B, 9B)
    or hidden_size / heads (27B: another than head_dim)."""
    config = Gemma2Config(
        **{**SIZES, "num_hidden_layers": 3}, head_dim=16, sliding_window=4, query_pre_attn_scalar=query_pre_attn_scalar
    )
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"] and config.final_logit_softcapping == 30
    return Gemma2ForCausalLM(config)


def phi3():
    """Phi-4-mini: Phi-3's fused projections, a quarter of each head left unrotated, tied head."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return Phi3ForCausalLM(Phi3Config(**SIZES, rope_parameters=rope, tie_word_embeddings=True, sliding_window=None))


def phi3_longrope():
    """Phi-3.5-mini / Phi-4-mini long context: `longrope` short and long factors (one per rotated frequency)."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": ORIGINAL,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
    }
    config = Phi3Config(
        **SIZES,
        rope_parameters=rope,
        original_max_position_embeddings=ORIGINAL,
        tie_word_embeddings=True,
        sliding_window=None,
    )
    return Phi3ForCausalLM(config)


def smollm3():
    """SmolLM3: every fourth layer NoPE (`no_rope_layers`), theta 2e6, tied head."""
    config = SmolLM3Config(
        **{**SIZES, "num_hidden_layers": 4},
        rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
        no_rope_layer_interval=4,
        tie_word_embeddings=True,
    )
    assert config.no_rope_layers == [1, 1, 1, 0]
    return SmolLM3ForCausalLM(config)


def gpt2():
    """GPT-2: learned positions, LayerNorm, GELU, biases, tied head (its defaults are the published fields)."""
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1)
    )


def gpt_oss():
    return GptOssForCausalLM(
        GptOssConfig(
            **{**SIZES, "intermediate_size": 64},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        )
    )


def phi2():
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4}
    return PhiForCausalLM(PhiConfig(**SIZES, rope_parameters=rope))


FAMILIES = {
    "llama3": llama3,
    "qwen3": qwen3,
    "qwen3_yarn": lambda: qwen3(QWEN3_YARN),
    "deepseek_v3_yarn_mla": deepseek_v3,
    "mistral_sliding": mistral,
    "gemma2_softcaps_sandwich": gemma2,
    "gemma2_27b_query_scale": lambda: gemma2(query_pre_attn_scalar=24),
    "phi3_partial_rotary": phi3,
    "phi3_longrope": phi3_longrope,
    "smollm3_nope": smollm3,
    "gpt2": gpt2,
}
# what convert cannot reproduce, and the words its refusal must say
REFUSED = {
    "gpt_oss": (gpt_oss, "mixture of 4 experts"),
    "phi2": (phi2, "computed in parallel"),
}


def source_model(build) -> torch.nn.Module:
    """`build()` seeded, with its norm gains moved off their initial value so that a norm read wrongly shows."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(source model, converted model, the converted folder) of one family."""
    folder = tmp_path_factory.mktemp(request.param)
    source = source_model(FAMILIES[request.param])
    source.save_pretrained(folder / "source")
    model = convert(folder / "source", folder / "converted")  # its memory check builds it on the meta device
    return source, model, folder / "converted"


def test_a_real_family_converts_to_the_same_logits_and_greedy_tokens(converted, tokens):
    source, model, _ = converted
    with torch.no_grad():
        expected, actual = source(tokens).logits, model(tokens).logits
    assert expected.abs().max() > 0.1  # logits of a size where a wrong scale or rotation shows
    assert (actual - expected).abs().max() <= 1e-5
    prompt = tokens[:, :5]
    assert torch.equal(
        model.generate(prompt, max_new_tokens=8, do_sample=False),
        source.generate(prompt, max_new_tokens=8, do_sample=False),
    )


def test_a_converted_family_saves_loads_back_and_builds_on_the_meta_device(converted, tokens):
    _, model, folder = converted
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is PlugformerForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, atol=0, rtol=0)
    with torch.device("meta"):
        empty = PlugformerForCausalLM(loaded.config)
    assert all(parameter.is_meta for parameter in empty.parameters())


@pytest.mark.slow  # a second Python process per family (~18 s each)
def test_a_converted_family_loads_with_trust_remote_code_without_the_package(converted, tokens, tmp_path):
    from test_hf_integration import assert_same_without_the_package

    _, model, folder = converted
    assert_same_without_the_package(model, folder, tokens, tmp_path)


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_family_convert_cannot_reproduce_is_refused_in_one_line_naming_why(family, tmp_path, capsys):
    build, reason = REFUSED[family]
    source_model(build).save_pretrained(tmp_path / "source")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    printed = capsys.readouterr().err  # the source's save_pretrained progress bar comes first
    assert "Traceback" not in printed
    error = printed.strip().splitlines()[-1]
    assert error.startswith("plugformer: error:") or error.startswith("ValueError")
    assert reason in error
    assert not (tmp_path / "out").exists()
