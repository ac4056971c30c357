"""YaRN and the other scaled rope types through the paths that build a model on the meta device: `convert` (its memory
check), `AutoModelForCausalLM.from_pretrained` and `with torch.device("meta")`. The config check of the rotation
frequencies once read meta tensors there (`Tensor.item() cannot be called on meta tensors`)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from tolerances import model_tolerance
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from plugformer import PlugformerForCausalLM
from plugformer.integrations.convert import convert


# the published non-size fields of YaRN (Qwen3's and DeepSeek-V3's context extension), at a tiny original length so
# that positions 0..11 cross it
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 8}
DEEPSEEK_YARN = {**YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def llama_yarn():
    return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, rope_parameters=dict(YARN)))


def qwen3_yarn():
    model = Qwen3ForCausalLM(Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16, rope_parameters=dict(YARN)))
    with torch.no_grad():  # Qwen3 starts its QK-norms at 1: move them, or a missed norm would go unseen
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model


def deepseek_v3_yarn():
    """All-dense DeepSeek-V3 with its YaRN, including `mscale_all_dim` (a softmax temperature in its attention)."""
    config = DeepseekV3Config(
        **SIZES,
        num_key_value_heads=4,
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
        initializer_range=0.1,
        rope_parameters=dict(DEEPSEEK_YARN),
    )
    return DeepseekV3ForCausalLM(config)


@pytest.mark.parametrize("reference", [llama_yarn, qwen3_yarn, deepseek_v3_yarn], ids=["llama", "qwen3", "deepseek_v3"])
def test_a_yarn_checkpoint_converts_to_the_same_logits_and_loads_back(reference, tmp_path, tokens):
    torch.manual_seed(0)
    source = reference().eval()
    source.save_pretrained(tmp_path / "source")
    convert(tmp_path / "source", tmp_path / "converted")  # the memory check builds it on the meta device first
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()  # on the meta device again
    assert type(loaded) is PlugformerForCausalLM
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        expected, actual = source(tokens).logits, loaded(tokens).logits
    # two models that round differently (other kernels): the bound from the dtype and the model's shape
    torch.testing.assert_close(actual, expected, atol=model_tolerance(loaded.config, expected), rtol=0)
    prompt = tokens[:1, :5]
    assert torch.equal(
        loaded.generate(prompt, max_new_tokens=6, do_sample=False),
        source.generate(prompt, max_new_tokens=6, do_sample=False),
    )


ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.5, 2.0, 2.5],
        "long_factor": [1.0, 2.0, 3.0, 4.0],
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_every_rope_type_builds_on_the_meta_device_and_loads_back(rope_type, tmp_path, tokens):
    config = tiny_config(scheme="rope", rope_parameters=dict(ROPE_TYPES[rope_type]))
    with torch.device("meta"):
        empty = PlugformerForCausalLM(config)
    assert empty.lm_head.weight.is_meta
    torch.manual_seed(0)
    model = PlugformerForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, atol=0, rtol=0)
