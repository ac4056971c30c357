"""The tensor-parallel plan follows the modules a config builds: every rule names a module or parameter of the built
model, for every attention projection (the latent one has no `k_proj`/`v_proj`) and every feed-forward (`mlp` has no
`gate_proj`), read from their registries. A config tensor parallelism cannot run (attention sinks, or a transformers
release whose plans compat does not vouch for) is refused at construction. Needs no process group: the plan is only
read here."""

from __future__ import annotations

import pytest

from plugformer import PlugformerConfig, PlugformerForCausalLM
from plugformer.layers import FEED_FORWARDS
from plugformer.projections import ATTENTION_PROJECTIONS


try:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
except ImportError:  # transformers 5.19 has it in `distributed.tensor_parallel` (compat.py)
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard


# each projection with the settings that change which modules it builds (latent: queries with or without a latent)
PROJECTION_SETTINGS = {
    "standard": [{}, {"use_gated_attention": True}],
    "latent": [{"q_lora_rank": None}, {"q_lora_rank": 16}],
}


def configs():
    for projection in ATTENTION_PROJECTIONS.names():
        for settings in PROJECTION_SETTINGS.get(projection, [{}]):  # a new projection: its defaults at least
            for ffn in FEED_FORWARDS.names():
                yield pytest.param(
                    {"attention_projection": projection, "ffn_type": ffn, **settings},
                    id="-".join([projection, ffn, *(f"{key}={value}" for key, value in settings.items())]),
                )


def model_names(model) -> set[str]:
    return {replace_layer_number_by_wildcard(name) for name, _ in (*model.named_modules(), *model.named_parameters())}


@pytest.mark.parametrize("fields", list(configs()))
def test_every_plan_rule_names_a_module_the_config_builds(fields):
    model = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", **fields))
    assert model.tp_plan, "no plan: transformers would shard nothing"
    unmatched = set(model.tp_plan) - model_names(model)
    assert not unmatched, sorted(unmatched)


def test_the_latent_plan_is_transformers_deepseek_v3_plan_for_the_modules_built():
    plan = PlugformerConfig.from_preset("tiny", attention_projection="latent", q_lora_rank=16).base_model_tp_plan
    attention = {rule: style for rule, style in plan.items() if ".self_attn." in rule}
    assert attention == {
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.score": "embedding_rowwise",
    }


def test_attention_sinks_under_tensor_parallelism_are_refused_at_load():
    from transformers.distributed import DistributedConfig

    from plugformer import PlugformerConfig, PlugformerForCausalLM

    config = PlugformerConfig.from_preset(
        "tiny",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_attention_sinks=True,
    )
    config.distributed_config = DistributedConfig(tp_size=2)  # what from_pretrained(tp_plan="auto") sets
    with pytest.raises(ValueError, match=r"use_attention_sinks=True cannot run with tensor parallelism \(tp_size=2\)"):
        PlugformerForCausalLM(config)


def test_tensor_parallel_is_refused_where_transformers_plans_are_not_verified(monkeypatch):
    """transformers 5.19's plans shard plugformer's models wrongly (its TP runs failed): tp_size > 1 is refused at
    construction, naming the release, wherever compat does not vouch for the plans."""
    from conftest import tiny_config
    from transformers.distributed import DistributedConfig

    from plugformer import PlugformerForCausalLM, attention

    monkeypatch.setattr(attention, "TENSOR_PARALLEL_VERIFIED", False)
    config = tiny_config("scaled_dot", "rope")
    config.distributed_config = DistributedConfig(tp_size=2)  # what from_pretrained(tp_plan=...) sets
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp_size=2\) needs transformers>=5.24"):
        PlugformerForCausalLM(config)
    config.distributed_config = DistributedConfig(tp_size=1)
    PlugformerForCausalLM(config)
