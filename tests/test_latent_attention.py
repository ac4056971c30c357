"""Multi-head latent attention (`attention_projection="latent"`) against transformers' DeepseekV3 with every layer
dense: the same logits and greedy tokens, weights copied by name; the latent cache against the full one."""

from __future__ import annotations

import pytest
import torch
from tolerances import model_tolerance
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, StaticCache

from plugformer import PlugformerConfig, PlugformerForCausalLM, supported_kernels
from plugformer.compat import CACHE_NAMED_CACHE


YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "mscale": 0.8, "mscale_all_dim": 0.9,
        "original_max_position_embeddings": 16}  # fmt: skip
LATENT = dict(q_lora_rank=16, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)


def deepseek(rope_interleave=True, rope_parameters=None, **overrides) -> DeepseekV3ForCausalLM:
    """A tiny DeepseekV3 whose layers are all dense (`first_k_dense_replace` = layers: no MoE); weights of std 0.1,
    so a wrong rotation, scale or norm moves the logits by far more than the tolerance."""
    sizes = {**LATENT, **overrides}
    config = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_interleave=rope_interleave,
        attention_bias=True,
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 1000.0},
        **sizes,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # the norms start at 1: random gains show a norm applied in the wrong place
        for name, parameter in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def plugformer_twin(source: DeepseekV3ForCausalLM, kernel: str, **overrides) -> PlugformerForCausalLM:
    """The same model in plugformer, weights loaded by their DeepseekV3 names."""
    s = source.config
    config = PlugformerConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters=dict(s.rope_parameters),
        rms_norm_eps=s.rms_norm_eps,
        attention_bias=s.attention_bias,
        tie_word_embeddings=False,
        attention_projection="latent",
        q_lora_rank=s.q_lora_rank,
        kv_lora_rank=s.kv_lora_rank,
        qk_rope_head_dim=s.qk_rope_head_dim,
        qk_nope_head_dim=s.qk_nope_head_dim,
        v_head_dim=s.v_head_dim,
        rope_interleave=s.rope_interleave,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    config._attn_implementation = kernel
    model = PlugformerForCausalLM(config).eval()
    model.load_state_dict(source.state_dict(), strict=True)
    return model


def left_padded(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    return tokens.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(rope_interleave=False),
        dict(q_lora_rank=None),
        dict(rope_parameters=YARN),
    ],
    ids=["interleaved", "rotate-half", "direct-queries", "yarn-mscale"],
)
def test_logits_equal_deepseek_v3(variant, kernel, tokens):
    source = deepseek(**variant)
    source.set_attn_implementation(kernel)
    model = plugformer_twin(source, kernel)
    ids, mask = left_padded(tokens)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, position_ids=position_ids).logits
        actual = model(ids, attention_mask=mask).logits
    atol = model_tolerance(model.config, expected)  # two fp32 models: `model_tolerance`
    torch.testing.assert_close(actual[0], expected[0], atol=atol, rtol=0)
    torch.testing.assert_close(actual[1, 4:], expected[1, 4:], atol=atol, rtol=0)


def test_softmax_scale_is_deepseek_v3s():
    model = plugformer_twin(deepseek(rope_parameters=YARN), "eager")
    mscale = 0.1 * 0.9 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert model.model.layers[0].self_attn.scaling == pytest.approx((12 + 8) ** -0.5 * mscale**2)


@pytest.mark.parametrize("use_latent_cache", [False, True], ids=["full-cache", "latent-cache"])
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_cached_greedy_generation_equals_deepseek_v3(kernel, use_latent_cache, tokens):
    source = deepseek()
    source.set_attn_implementation(kernel)
    model = plugformer_twin(source, kernel, use_latent_cache=use_latent_cache)
    ids, mask = left_padded(tokens[:, :8])
    arguments = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    expected = source.generate(ids, **arguments)
    assert torch.equal(model.generate(ids, **arguments), expected)
    for row in range(2):  # a left-padded row decodes as the same text alone
        alone = ids[row : row + 1, 4 if row else 0 :]
        assert torch.equal(
            model.generate(alone, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0],
            expected[row, 4 if row else 0 :],
        )


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_latent_cache_decodes_as_the_full_cache_and_holds_the_latent(cache, tokens):
    source = deepseek()
    full = plugformer_twin(source, "sdpa")
    latent = plugformer_twin(source, "sdpa", use_latent_cache=True)
    config = latent.config
    caches = {}
    for name, model in (("full", full), ("latent", latent)):
        kv = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(model.config, max_cache_len=24)
        caches[name] = kv
        out = model.generate(tokens[:, :8], cache=kv, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        caches[name + "_tokens"] = out
    assert torch.equal(caches["full_tokens"], caches["latent_tokens"])
    keys, values = caches["latent"].layers[0].keys, caches["latent"].layers[0].values
    assert keys.shape[1:2] + keys.shape[3:] == (1, config.kv_lora_rank)  # (B, 1, K, kv_lora_rank)
    assert values.shape[1:2] + values.shape[3:] == (1, config.qk_rope_head_dim)
    full_keys = caches["full"].layers[0].keys
    assert full_keys.shape[1:2] + full_keys.shape[3:] == (4, config.qk_nope_head_dim + config.qk_rope_head_dim)


def test_latent_cache_bytes_per_token_match_deepseek_v3s():
    """Bytes per token and layer: the latent (kv_lora_rank) and the shared RoPE key (qk_rope_head_dim), as in
    transformers' DeepseekV3 cache, against every head's keys and values in the full cache."""
    source = deepseek()
    measured = {}
    for name, model in (
        ("deepseek", source),
        ("full", plugformer_twin(source, "eager")),
        ("latent", plugformer_twin(source, "eager", use_latent_cache=True)),
    ):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            # transformers' DeepseekV3 takes the cache by its name of the installed release (5.24: `cache`)
            model(
                torch.arange(3, 13)[None],
                **{"cache" if CACHE_NAMED_CACHE else "past_key_values": cache},
                use_cache=True,
            )
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        measured[name] = sum(t.numel() * t.element_size() for t in tensors) / 10  # per token
    layers, fp32 = 2, 4
    latent_bytes = layers * (LATENT["kv_lora_rank"] + LATENT["qk_rope_head_dim"]) * fp32
    full_bytes = layers * 4 * (LATENT["qk_nope_head_dim"] + LATENT["qk_rope_head_dim"] + LATENT["v_head_dim"]) * fp32
    assert measured == {"deepseek": latent_bytes, "full": full_bytes, "latent": latent_bytes}


def test_kernels_and_engines_that_cannot_attend_with_latent_heads_are_refused():
    config = PlugformerConfig.from_preset("tiny", attention_projection="latent")
    assert supported_kernels(config, available_only=False) == ["eager", "sdpa", "flex_attention"]  # v ≠ q·k width
    with pytest.raises(ValueError, match=r"attn_implementation='vllm' attends with num_key_value_heads heads"):
        from plugformer.capabilities import KERNELS

        KERNELS.get("vllm").check(config)
    equal = PlugformerConfig.from_preset("tiny", attention_projection="latent", v_head_dim=12)
    assert "flash_attention_2" in supported_kernels(equal, available_only=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=2), r"num_key_value_heads=2 groups key/value heads, which attention_projection="),
        (dict(use_qk_norm=True), r"use_qk_norm=True normalises each head's projected queries and keys, which"),
        (dict(is_encoder_decoder=True), r"attention_projection='latent' is not supported with is_encoder_decoder"),
        (dict(head_dim=6, qk_rope_head_dim=4), r"head_dim=6 must equal qk_rope_head_dim=4"),
        (dict(position_scheme="alibi", rope_interleave=True), r"rope_interleave=True lays out rotated pairs"),
        (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), r"partial_rotary_factor'\]=0.5"),
        (dict(kv_lora_rank=0), r"kv_lora_rank=0 must be a positive integer"),
    ],
    ids=["gqa", "qk-norm", "seq2seq", "head-dim", "interleave-without-rope", "partial-rotary", "rank"],
)
def test_conflicting_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        PlugformerConfig.from_preset("tiny", attention_projection="latent", **overrides)


def test_a_presets_grouped_key_value_heads_give_way_to_the_latent():
    """GQA is the standard projection's field: the tiny preset's 2 key/value heads are dropped, one per query head."""
    config = PlugformerConfig.from_preset("tiny", attention_projection="latent")
    assert (config.num_key_value_heads, config.num_attention_heads) == (4, 4)
    assert (config.head_dim, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank) == (4, 8, 8, 32)


@pytest.mark.parametrize("field", ["q_lora_rank", "kv_lora_rank", "v_head_dim", "rope_interleave", "use_latent_cache"])
def test_latent_fields_are_refused_without_the_latent_projection(field):
    with pytest.raises(ValueError, match=rf"{field}=.* configures multi-head latent attention"):
        PlugformerConfig.from_preset("tiny", **{field: True if field in ("rope_interleave", "use_latent_cache") else 8})


def test_tensor_parallelism_is_refused():
    from plugformer.attention import check_tensor_parallel

    config = PlugformerConfig.from_preset("tiny", attention_projection="latent")
    config.distributed_config = type("Distributed", (), {"tp_size": 2})()
    with pytest.raises(ValueError, match=r"attention_projection='latent' cannot run with tensor parallelism"):
        check_tensor_parallel(config)
