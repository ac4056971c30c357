"""The tensor-parallel plan follows the modules a config builds: every rule names a module or parameter of the built
model, for every attention projection (the latent one has no `k_proj`/`v_proj`) and every feed-forward (`mlp` has no
`gate_proj`), read from their registries. Needs no process group: the plan is only read here."""

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
