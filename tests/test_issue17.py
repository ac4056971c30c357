"""Regressions of issue 17 (transformers' common model tests and outside clients) and issue 18 item 3: each test
failed before its fix."""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, SCORES, build, tiny_config
from tolerances import model_tolerance

from plugformer import POSITION_SCHEMES


@pytest.mark.parametrize("score", SCORES)
def test_sinusoidal_inputs_embeds_equal_input_ids_and_generate_alike(score):
    """The sqrt(d) token scale applies to `inputs_embeds` too: embeddings of the ids give the ids' logits, and
    generation continued from `inputs_embeds` picks the tokens generation from the ids picks."""
    model = build(tiny_config(score, "sinusoidal"))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        from_ids = model(input_ids=ids).logits
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
        torch.testing.assert_close(from_embeds, from_ids, atol=model_tolerance(model.config, from_ids), rtol=0)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        continued = model.generate(
            inputs_embeds=model.get_input_embeddings()(ids), max_new_tokens=4, do_sample=False
        )  # returns the new tokens only
    assert torch.equal(continued, generated[:, ids.shape[1] :])


def test_sequence_classification_takes_a_cache_by_its_deprecated_name():
    """`past_key_values=` is the deprecated alias of `cache` on every head that keeps one (it was ignored here)."""
    from transformers.cache_utils import DynamicCache

    from plugformer import PlugformerForSequenceClassification

    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(tiny_config(pad_token_id=0, num_labels=3)).eval()
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        output = model(ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and output.cache is cache


@pytest.mark.parametrize("scheme", ["none", "alibi"])
@pytest.mark.parametrize("training", [False, True])
def test_additive_attention_weights_stay_in_the_graph(scheme, training):
    """The weights eager returns for additive scores are those the output is computed from: a gradient reaches them
    (they were a padded copy cut off from the graph), and the output equals the one without weights."""
    model = build(tiny_config("additive", scheme, additive_chunk_size=3))
    model.train(training)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits
    output = model(ids, output_attentions=True)
    torch.testing.assert_close(output.logits, reference, atol=model_tolerance(model.config, reference), rtol=0)
    attentions = output.attentions[0]
    attentions.retain_grad()
    output.logits.sum().backward()
    assert attentions.grad is not None and attentions.grad.abs().sum() > 0


def test_config_signature_shows_the_fields():
    """Tools that build a config from `inspect.signature` (transformers' tester) see the fields, not `**kwargs`."""
    import inspect

    from plugformer import PlugformerConfig

    parameters = inspect.signature(PlugformerConfig.__init__).parameters
    assert {"attention_score", "position_scheme", "hidden_size", "use_cache"} <= set(parameters)
    assert parameters["attention_score"].default == "scaled_dot"


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


def test_config_keeps_transformers_bookkeeping_kwargs(tmp_path):
    """What transformers passes or writes (labels, dtype, legacy names, generation settings, custom attributes)
    still loads."""
    from plugformer import PlugformerConfig

    config = tiny_config(
        num_labels=3,
        problem_type="single_label_classification",
        torch_dtype="float32",
        output_attentions=True,
        name_or_path="x",
        my_own_note="kept",
    )
    config.save_pretrained(tmp_path)
    loaded = PlugformerConfig.from_pretrained(tmp_path, attn_implementation="eager")
    assert loaded.num_labels == 3 and loaded.my_own_note == "kept"
    unnamed = lambda c: {k: v for k, v in c.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert unnamed(loaded) == unnamed(config)


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32])
def test_an_all_zero_mask_row_is_refused(dtype):
    """A sequence with nothing to attend to has no defined softmax: refused, naming the argument and the row."""
    from plugformer import PlugformerForConditionalGeneration

    model = build(tiny_config())
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=dtype)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask row 1 is all zeros"):
        model(ids, attention_mask=mask)
    seq2seq = PlugformerForConditionalGeneration(tiny_config(is_encoder_decoder=True, pad_token_id=0)).eval()
    with pytest.raises(ValueError, match=r"^attention_mask row 1 is all zeros"):
        seq2seq(ids, attention_mask=mask, decoder_input_ids=ids[:, :2])
    with pytest.raises(ValueError, match=r"decoder_attention_mask row 1 is all zeros"):
        seq2seq(ids, decoder_input_ids=ids, decoder_attention_mask=mask)


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_capability_flags_follow_the_config(score, scheme):
    """`_supports_sdpa` / `_supports_flex_attn` / `_supports_flash_attn` answer for the model's config (the kernel
    table), so transformers and its tests skip what the config cannot run; an explicit request of such a kernel
    raises, the default resolves to eager; a supported sdpa can be set at run time."""
    from plugformer import ATTENTION_SCORES, KERNELS, PlugformerForCausalLM

    torch.manual_seed(0)
    model = PlugformerForCausalLM(tiny_config(score, scheme))
    config = model.config
    for flag, kernel in (
        ("_supports_sdpa", "sdpa"),
        ("_supports_flex_attn", "flex_attention"),
        ("_supports_flash_attn", "flash_attention_2"),
    ):
        assert getattr(model, flag) is (KERNELS.get(kernel).unsupported_reason(config) is None), flag
    dot_product = ATTENTION_SCORES.get(score).dot_product
    assert model.config._attn_implementation == ("sdpa" if dot_product else "eager")
    if dot_product:
        model.set_attn_implementation("eager")
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
    else:
        with pytest.raises(ValueError, match=f"attention_score={score!r}"):
            model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "eager"


def test_padding_free_position_ids_equal_separate_sequences():
    """Packed sequences with restarting `position_ids` and no mask (transformers' padding-free format) attend only
    within their own sequence, on every kernel each config supports (additive: eager)."""
    import copy

    from plugformer import POSITION_SCHEMES, PlugformerForCausalLM, supported_kernels

    first, second = torch.randint(3, 128, (2, 1, 5), generator=torch.Generator().manual_seed(0)).unbind(0)
    second = second[:, :4]
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    for score in SCORES:
        for scheme in POSITION_SCHEMES.names():
            config = tiny_config(score, scheme)
            for kernel in supported_kernels(config):
                if kernel == "flex_attention":  # compiled per shape: seconds each; covered by test_combinations
                    continue
                config = copy.deepcopy(config)
                config._attn_implementation = kernel
                torch.manual_seed(0)
                model = PlugformerForCausalLM(config).eval()
                with torch.no_grad():
                    packed = model(torch.cat([first, second], 1), position_ids=position_ids, use_cache=False).logits
                    atol = model_tolerance(config, packed)  # packed against alone
                    torch.testing.assert_close(packed[:, :5], model(first).logits, atol=atol, rtol=0)
                    torch.testing.assert_close(packed[:, 5:], model(second).logits, atol=atol, rtol=0)


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


PEFT_WITHOUT_THE_PACKAGE = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert not any(name.split(".")[0] == "plugformer" for name in sys.modules)
peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2))
trainable = sorted({name.split(".")[-4] for name, p in peft_model.named_parameters() if p.requires_grad})
print("TARGETS", ",".join(trainable))
"""


def test_peft_default_targets_with_remote_code_alone(tmp_path):
    """A checkpoint loaded by `trust_remote_code` without plugformer installed registers PEFT's default LoRA targets
    from its own code files: `LoraConfig(task_type="CAUSAL_LM")` without `target_modules` finds them."""
    import os
    import subprocess
    import sys

    from test_hf_integration import HIDE_PLUGFORMER

    from plugformer import LORA_TARGET_MODULES

    build(tiny_config("multiplicative", "alibi")).save_pretrained(tmp_path / "model")
    (tmp_path / "lora_defaults.py").write_text(HIDE_PLUGFORMER + PEFT_WITHOUT_THE_PACKAGE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, str(tmp_path / "lora_defaults.py"), str(tmp_path / "model")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    targets = next(line for line in result.stdout.splitlines() if line.startswith("TARGETS ")).split()[1]
    assert sorted(targets.split(",")) == sorted(LORA_TARGET_MODULES)
