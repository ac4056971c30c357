"""The stage YAMLs and trainer flags on every supported transformers (5.19-5.25): 5.23 renamed `TrainingArguments`'
`gradient_checkpointing`/`_kwargs` to `activation_checkpointing`/`_kwargs`; the shipped configs and the CLI use the
new names, which `plugformer.training.trainer_options` maps to the old fields where the installed release has only
those."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import transformers
import yaml

from plugformer.experiments.grid import route
from plugformer.training import STAGES, parse_stage_arguments
from plugformer.training import trainer_options as compat


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [(stage, path) for stage in STAGES for path in sorted((ROOT / "configs" / stage).glob("*.yaml"))]
HAS_NEW_NAMES = "activation_checkpointing" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}


def checkpointing(training_args) -> tuple:
    """(on/off, kwargs) of activation checkpointing as the installed trainer reads it; on 5.24 the deprecated old
    fields mirror the new ones, and must agree."""
    if HAS_NEW_NAMES:
        assert training_args.gradient_checkpointing == training_args.activation_checkpointing
        assert training_args.gradient_checkpointing_kwargs == training_args.activation_checkpointing_kwargs
        return training_args.activation_checkpointing, training_args.activation_checkpointing_kwargs
    assert not hasattr(training_args, "activation_checkpointing")
    return training_args.gradient_checkpointing, training_args.gradient_checkpointing_kwargs


def test_the_aliases_are_those_of_the_installed_release():
    """Before 5.23 the new names stand for the old fields; from 5.23 the old names for the new ones."""
    new_to_old = {
        "activation_checkpointing": "gradient_checkpointing",
        "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
    }
    expected = {old: new for new, old in new_to_old.items()} if HAS_NEW_NAMES else new_to_old
    assert compat.trainer_option_aliases() == expected


@pytest.mark.parametrize("stage,path", SHIPPED, ids=[f"{stage}/{path.name}" for stage, path in SHIPPED])
def test_every_shipped_stage_yaml_parses_and_its_checkpointing_reaches_the_trainer_args(stage, path, tmp_path):
    values = yaml.safe_load(path.read_text())
    _, _, training_args = parse_stage_arguments(stage, ["--config", str(path), "--output_dir", str(tmp_path)])
    assert isinstance(training_args, STAGES[stage].config_type())
    if "activation_checkpointing" in values:
        assert checkpointing(training_args) == (values["activation_checkpointing"], None)


def test_the_shipped_configs_say_activation_checkpointing():
    """Each stage YAML that sets checkpointing uses the new name (TRL's configs default to it on)."""
    named = {str(path.relative_to(ROOT)) for _, path in SHIPPED if "activation_checkpointing" in path.read_text()}
    assert {f"configs/{stage}/tiny.yaml" for stage in STAGES if stage != "pretrain"} <= named
    assert not [path for _, path in SHIPPED if "gradient_checkpointing" in yaml.safe_load(path.read_text())]


@pytest.mark.parametrize("stage", ["pretrain", "sft", "grpo"])
@pytest.mark.parametrize(
    "flag", ["--activation_checkpointing", "--activation-checkpointing", "--gradient_checkpointing"]
)
def test_the_command_line_flag_overrides_the_yaml(stage, flag, tmp_path):
    """`configs/<stage>/tiny.yaml` (checkpointing off where it says so) with the flag on the command line, under
    either name (the old one is a deprecated alias on 5.24, the field on 5.19)."""
    config = ROOT / "configs" / stage / "tiny.yaml"
    base = ["--config", str(config), "--output_dir", str(tmp_path)]
    assert checkpointing(parse_stage_arguments(stage, base)[2])[0] is False
    kwargs = {"--activation-checkpointing": "--activation-checkpointing-kwargs"}.get(flag, f"{flag}_kwargs")
    argv = [*base, flag, "true", kwargs, '{"use_reentrant": false}']
    assert checkpointing(parse_stage_arguments(stage, argv)[2]) == (True, {"use_reentrant": False})


def test_a_yaml_with_either_name_reaches_the_trainer_args(tmp_path):
    """The new name in a YAML, the old one, and both (the new one wins, as 5.24 resolves them)."""
    for values, expected in [
        ({"activation_checkpointing": True}, True),
        ({"gradient_checkpointing": True}, True),
        ({"activation_checkpointing": False, "gradient_checkpointing": True}, False),
        ({"activation_checkpointing": True, "gradient_checkpointing": False}, True),
    ]:
        path = tmp_path / "sft.yaml"
        path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "bf16": False, **values}))
        assert checkpointing(parse_stage_arguments("sft", ["--config", str(path)])[2])[0] is expected, values


def test_a_yaml_value_of_the_wrong_type_is_refused_under_the_new_name(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("output_dir: out\nactivation_checkpointing: 'no'\n")
    with pytest.raises(ValueError, match=r"activation_checkpointing: 'no' is a YAML str; expected bool"):
        parse_stage_arguments("sft", ["--config", str(path)])


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_lists_the_new_names(stage, capsys):
    with pytest.raises(SystemExit):
        parse_stage_arguments(stage, ["--help"])
    shown = capsys.readouterr().out
    assert "--activation_checkpointing " in shown and "--activation_checkpointing_kwargs " in shown


def test_compare_routes_the_new_name_to_every_trainer_stage():
    argv = route({"activation_checkpointing": "false"}, ["pretrain", "sft"])
    assert argv["pretrain"] == argv["sft"] == ["--activation_checkpointing", "false"]


def test_the_command_line_overrides_the_yaml_whichever_name_each_uses(tmp_path):
    """transformers 5.24 lets a set new name win over the old one, so `--gradient_checkpointing true` under a YAML's
    `activation_checkpointing: false` was ignored there; the command line wins on every release, the last flag
    given wins, `=` and TRL's `--no_gradient_checkpointing` included; both names on one command line are one option
    given twice: refused."""
    path = tmp_path / "sft.yaml"
    for yaml_value, flags, expected in [
        (False, ["--gradient_checkpointing", "true"], True),
        (True, ["--gradient-checkpointing=false"], False),
        (True, ["--no_gradient_checkpointing"], False),
        (False, ["--activation_checkpointing=true"], True),
    ]:
        path.write_text(
            yaml.safe_dump({"output_dir": str(tmp_path / "out"), "bf16": False, "activation_checkpointing": yaml_value})
        )
        assert checkpointing(parse_stage_arguments("sft", ["--config", str(path), *flags])[2])[0] is expected, flags
    for flags in (
        ["--activation_checkpointing", "true", "--gradient_checkpointing", "false"],
        ["--activation_checkpointing", "true", "--no_gradient_checkpointing"],
    ):
        # named by the field the installed transformers has: the new one, which the old name aliases (5.23 on), or the
        # old one, given second here (5.19)
        refusal = (
            r"--activation_checkpointing given twice .*--gradient_checkpointing is --activation_checkpointing"
            if "gradient_checkpointing" in compat.trainer_option_aliases()
            else r"--(no_)?gradient_checkpointing given twice \(--activation_checkpointing true, then --"
        )
        with pytest.raises(ValueError, match=refusal):
            parse_stage_arguments("sft", ["--config", str(path), *flags])
