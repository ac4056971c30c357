"""PlugformerConfig: validation with clear errors, presets, serialisation, kernel resolution."""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, build, tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

import plugformer
from plugformer import POSITION_SCHEMES, PRESETS, PlugformerConfig, PlugformerForCausalLM
from plugformer.configuration import VARIANT_REGISTRIES


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(attention_score="no_such_score"), r"attention_score='no_such_score' is not one of \['dot', 'scaled_dot'"),
        (dict(position_scheme="xpos"), r"position_scheme='xpos' is not one of \['none', 'sinusoidal'"),
        (dict(norm_type="batchnorm"), r"norm_type='batchnorm' is not one of"),
        (dict(norm_placement="peri"), r"norm_placement='peri' is not one of \['pre', 'post', 'sandwich'\]"),
        (dict(ffn_type="moe"), r"ffn_type='moe' is not one of \['mlp', 'glu'\]"),
        (dict(hidden_act="swish2"), r"hidden_act='swish2' is not one of"),
        (dict(hidden_size=30, num_attention_heads=4), r"hidden_size=30 is not divisible by num_attention_heads=4"),
        (
            dict(num_attention_heads=4, num_key_value_heads=3),
            r"num_key_value_heads=3 must divide num_attention_heads=4",
        ),
        (dict(num_hidden_layers=0), r"num_hidden_layers=0 must be a positive integer"),
        (dict(vocab_size=-5), r"vocab_size=-5 must be a positive integer"),
        (dict(attention_dropout=1.0), r"attention_dropout=1.0 must lie in \[0.0, 1.0\)"),
        (
            dict(position_scheme="t5_bias", relative_attention_num_buckets=32, relative_attention_max_distance=16),
            r"relative_attention_num_buckets=32 must not exceed relative_attention_max_distance=16",
        ),
        (dict(position_scheme="rope", head_dim=7), r"head_dim=7 .* must be even"),
        (
            dict(
                position_scheme="sinusoidal", hidden_size=33, head_dim=3, num_attention_heads=11, num_key_value_heads=1
            ),
            r"needs an even hidden_size, got 33",
        ),
        (
            dict(position_scheme="t5_bias", relative_attention_num_buckets=2),
            r"relative_attention_num_buckets=2 must be >= 4",
        ),
        (dict(rope_parameters={"rope_type": "magic"}), r"rope_type'\]='magic' is not one of \['default', 'linear'"),
        (dict(eos_token_id=128), r"eos_token_id=128 is outside the vocabulary \[0, 128\)"),
    ],
)
def test_invalid_values_fail_at_construction_naming_field_value_and_choices(overrides, message):
    with pytest.raises(ValueError, match=message):
        PlugformerConfig.from_preset("tiny", **overrides)


@pytest.mark.parametrize("field,value", [("hidden_size", "32"), ("num_attention_heads", 2.5), ("hidden_dropout", "0")])
def test_wrong_types_raise_type_error_naming_the_field(field, value):
    with pytest.raises(TypeError, match=field):
        PlugformerConfig.from_preset("tiny", **{field: value})


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"preset='huge' is not one of \['tiny', 'small', 'gpt2-small', 'llama'\]"):
        PlugformerConfig.from_preset("huge")


def count_parameters(config: PlugformerConfig) -> int:
    with torch.device("meta"):  # shapes only: the llama preset would take seconds to initialise
        model = PlugformerForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def test_presets_have_their_advertised_sizes():
    assert count_parameters(PlugformerConfig.from_preset("tiny")) < 50_000
    assert 10e6 <= count_parameters(PlugformerConfig.from_preset("small")) <= 30e6
    # GPT-2 small: 124,439,808 parameters with the tied head (Radford et al. 2019, the HF checkpoint)
    assert count_parameters(PlugformerConfig.from_preset("gpt2-small")) == 124_439_808
    assert 0.9e9 <= count_parameters(PlugformerConfig.from_preset("llama")) <= 1.3e9


def test_preset_overrides_win():
    config = PlugformerConfig.from_preset("small", position_scheme="alibi", num_hidden_layers=2)
    assert (config.position_scheme, config.num_hidden_layers, config.hidden_size) == ("alibi", 2, 384)
    assert PRESETS["small"]["num_hidden_layers"] == 6  # presets are not mutated


def test_attention_block_has_four_d_squared_weights():
    """d = 512, h = 8, d_k = d_v = 64: W_Q, W_K, W_V, W_O are each d × d, 4·d² = 1,048,576 weights, no biases."""
    config = PlugformerConfig(hidden_size=512, num_attention_heads=8, num_hidden_layers=1, vocab_size=16)
    assert config.head_dim == 64
    with torch.device("meta"):
        attention = PlugformerForCausalLM(config).model.layers[0].self_attn
    assert sum(p.numel() for p in attention.parameters()) == 4 * 512**2 == 1_048_576


def test_derived_defaults():
    config = PlugformerConfig(hidden_size=96, num_attention_heads=6)
    assert (config.head_dim, config.num_key_value_heads) == (16, 6)
    assert config.intermediate_size == 256  # 8/3 · 96 = 256, a multiple of 64 (SwiGLU)
    assert PlugformerConfig(hidden_size=96, num_attention_heads=6, ffn_type="mlp").intermediate_size == 384


def test_config_round_trips_through_auto_config(tmp_path):
    config = tiny_config("additive", "t5_bias", norm_placement="post", norm_type="layernorm", ffn_type="mlp")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is PlugformerConfig
    without_path = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert without_path(loaded) == without_path(config)


def test_auto_map_names_every_registered_head():
    """Each Auto class maps to the registered class, by a module a checkpoint holds (`modeling`, `modeling_seq2seq`)."""
    import importlib

    config = tiny_config()
    classes = {"AutoConfig": PlugformerConfig} | {auto.__name__: cls for auto, cls in plugformer.AUTO_CLASSES.items()}
    assert set(config.auto_map) == set(classes)
    for auto, entry in config.auto_map.items():
        module, _, name = entry.partition(".")
        assert getattr(importlib.import_module(f"plugformer.{module}"), name) is classes[auto], entry


def test_kernel_defaults_to_sdpa_and_to_eager_for_additive():
    assert PlugformerForCausalLM(tiny_config("scaled_dot")).config._attn_implementation == "sdpa"
    assert PlugformerForCausalLM(tiny_config("additive")).config._attn_implementation == "eager"


@pytest.mark.parametrize("kernel", ["sdpa", "flex_attention"])
def test_explicit_fused_kernel_for_additive_raises(kernel, tmp_path):
    build(tiny_config("additive", "alibi")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"attention_score='additive' is not a dot product.*{kernel}"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=kernel)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not a dot product"):
        model.set_attn_implementation(kernel)


def test_a_saved_config_carries_no_kernel_choice(tmp_path):
    """transformers 5.25 ignores `_attn_implementation` in a loaded config.json (5.24 applied it): a checkpoint that
    never holds it loads alike on both, with the kernel chosen at load (compat.py)."""
    model = build(tiny_config("scaled_dot", "rope"), "eager")
    model.save_pretrained(tmp_path)
    assert not [key for key in (tmp_path / "config.json").read_text().split('"') if "attn_implementation" in key]
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    assert AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").config._attn_implementation == (
        "eager"
    )


def test_kernel_switches_at_run_time():
    model = build(tiny_config("multiplicative", "t5_bias"), "eager")
    for kernel in ("sdpa", "eager"):
        model.set_attn_implementation(kernel)
        assert model.config._attn_implementation == kernel


def test_combination_matrix_lists_every_pair():
    rows = plugformer.combination_matrix()
    assert len(rows) == len(plugformer.ATTENTION_SCORES.names()) * len(plugformer.POSITION_SCHEMES.names())
    kernels = {(score, scheme): ks for score, scheme, ks in rows}
    assert kernels[("additive", "rope")] == ["eager"]
    assert kernels[("multiplicative", "t5_bias")] == ["eager", "sdpa", "flex_attention"]


def test_registry_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        plugformer.ATTENTION_SCORES.register("dot")(type("Another", (), {}))


def variant_classes():
    return [registry.get(name) for registry in VARIANT_REGISTRIES for name in registry]


def test_every_variant_owns_only_real_fields_and_none_twice():
    owners = {}
    for variant in variant_classes():
        for field in variant.config_fields:
            assert field in PlugformerConfig.__dataclass_fields__, (variant.__name__, field)
            assert field not in owners, (field, owners.get(field), variant.__name__)
            owners[field] = variant.__name__
    assert owners["rope_parameters"] == "RotaryPositions" and owners["additive_chunk_size"] == "AdditiveScore"


@pytest.mark.parametrize("score", plugformer.ATTENTION_SCORES.names())
@pytest.mark.parametrize("scheme", plugformer.POSITION_SCHEMES.names())
def test_config_asks_the_chosen_variants_and_no_others(score, scheme, monkeypatch):
    """Symmetric validation: the chosen score, scheme and projection (the default, standard) check their own fields
    through `validate_config`; the only other hooks called are the refusals of owners whose fields the chosen ones do
    not own."""
    validated, refused = [], []
    for variant in variant_classes():
        monkeypatch.setattr(variant, "validate_config", classmethod(lambda cls, config: validated.append(cls.name)))
        monkeypatch.setattr(variant, "refuse_unused_config", classmethod(lambda cls, config: refused.append(cls.name)))
    tiny_config(score, scheme)
    assert sorted(validated) == sorted([score, scheme, "standard"])
    assert sorted(refused) == sorted(["latent"] + ([] if scheme == "rope" else ["rope"]))


def test_configuration_tests_no_variant_name():
    """No `position_scheme != "rope"` and the like in configuration.py: behaviour comes from the variants' hooks."""
    import ast
    import inspect

    from plugformer import configuration

    names = {name for registry in VARIANT_REGISTRIES for name in registry}
    compared = [
        node.value
        for compare in ast.walk(ast.parse(inspect.getsource(configuration)))
        if isinstance(compare, ast.Compare)
        for node in ast.walk(compare)
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert compared == []


def test_an_attribute_assigned_then_saved_loads_back(tmp_path):
    """transformers' tools annotate configs with other models' names (GPT-2's `layer_norm_epsilon`): what is assigned
    saves and loads back, as on `LlamaConfig`, while the same name as a constructor argument is still taken for a typo
    of `layer_norm_eps`."""
    config = tiny_config()
    config.layer_norm_epsilon = 1e-3
    config.save_pretrained(tmp_path)
    loaded = PlugformerConfig.from_pretrained(tmp_path)
    assert loaded.layer_norm_epsilon == 1e-3 and loaded.layer_norm_eps == config.layer_norm_eps
    loaded.save_pretrained(tmp_path / "again")
    assert PlugformerConfig.from_pretrained(tmp_path / "again").layer_norm_epsilon == 1e-3
    assert AutoConfig.from_pretrained(tmp_path).layer_norm_epsilon == 1e-3
    with pytest.raises(ValueError, match=r"layer_norm_epsilon=.*did you mean 'layer_norm_eps'"):
        PlugformerConfig(layer_norm_epsilon=1e-3)


def test_rope_parameters_assigned_after_construction_are_honoured_or_refused():
    """As the constructor: under RoPE the assignment is checked and the next model uses it; under a scheme without
    rotation it is refused (the old value kept), never stored and ignored."""
    config = tiny_config("scaled_dot", "rope")
    config.rope_parameters = {"rope_type": "linear", "factor": 10.0, "rope_theta": 10000.0}
    assert PlugformerForCausalLM(config).model.positions.rope_type == "linear"
    with pytest.raises(ValueError, match=r"rope_type'\]='magic'"):
        config.rope_parameters = {"rope_type": "magic"}
    assert config.rope_parameters["rope_type"] == "linear"
    # the flag that turns the checks on (transformers' own from 5.24; plugformer's before) is never saved
    assert "_post_init_done" not in config.to_dict() and "_post_init_done" not in config.to_json_string()
    alibi = tiny_config("scaled_dot", "alibi")
    before = dict(alibi.rope_parameters)
    with pytest.raises(ValueError, match=r"rope_parameters=.*position_scheme='alibi' has none"):
        alibi.rope_parameters = {"rope_type": "linear", "factor": 10.0, "rope_theta": 10000.0}
    assert alibi.rope_parameters == before


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_a_forward_never_writes_the_shared_config(monkeypatch, kernel):
    """A seq2seq decoder shares its encoder's config (`is_causal=False`) and builds causal masks from a causal view
    of it: no forward assigns a config attribute (a concurrent call reading it would see the other direction)."""
    import copy

    from plugformer import PlugformerForConditionalGeneration

    config = copy.deepcopy(tiny_config(is_encoder_decoder=True, is_causal=False, pad_token_id=0, eos_token_id=1))
    config._attn_implementation = kernel
    model = PlugformerForConditionalGeneration(config).eval()
    assigned = []
    original = PlugformerConfig.__setattr__

    def recorded(self, name, value):
        if self is config:  # generate() edits copies of its own (`get_text_config`)
            assigned.append(name)
        original(self, name, value)

    monkeypatch.setattr(PlugformerConfig, "__setattr__", recorded)
    source = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=source, decoder_input_ids=source[:, :5])
        model.generate(source, max_new_tokens=3, do_sample=False)
    assert assigned == [] and config.is_causal is False


@pytest.mark.parametrize(
    ("key", "meant"),
    [("attention_scor", "attention_score"), ("positon_scheme", "position_scheme"), ("hiden_size", "hidden_size")],
)
def test_config_refuses_a_near_miss_of_a_field(key, meant, tmp_path):
    import json

    from plugformer import PlugformerConfig

    with pytest.raises(ValueError, match=rf"{key}=.*did you mean '{meant}'"):
        PlugformerConfig(**{key: "additive"})
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved[key] = saved.pop(meant)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"{key}=.*did you mean '{meant}'"):
        PlugformerConfig.from_pretrained(tmp_path)


# the schemes that do not own rope_parameters (every one but rope)
WITHOUT_ROTARY = [name for name in SCHEMES if "rope_parameters" not in POSITION_SCHEMES.get(name).config_fields]


@pytest.mark.parametrize("scheme", WITHOUT_ROTARY)
def test_rope_settings_on_a_scheme_without_rotary_positions_are_refused(scheme, tmp_path, caplog):
    from plugformer import PlugformerConfig

    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=rf"rope_parameters=.*position_scheme='{scheme}' has none"):
        tiny_config(scheme=scheme, rope_parameters=scaled)
    with pytest.raises(ValueError, match=r"rope_parameters="):
        tiny_config(scheme=scheme, rope_scaling={"rope_type": "dynamic", "factor": 2.0})  # the legacy name
    # what transformers writes into every config (the default fill) loads, and a preset's theta goes with its scheme
    tiny_config(scheme=scheme).save_pretrained(tmp_path)
    assert PlugformerConfig.from_pretrained(tmp_path).rope_parameters["rope_type"] == "default"
    assert PlugformerConfig.from_preset("llama", position_scheme=scheme).rope_parameters["rope_theta"] == 10000.0
    tiny_config(scheme=scheme, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})  # warns only
