"""`plugformer --help` lists every command of the CLI's table and every registered stage, read from them."""

from __future__ import annotations

import re

import pytest

from plugformer.cli import COMMANDS
from plugformer.cli import main as cli_main
from plugformer.training import STAGES


def top_level_help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_registered_stage(capsys):
    printed = top_level_help(capsys)
    stages = printed.split("stages of `plugformer train <stage>`", 1)[1]
    listed = re.findall(r"[\w-]+", stages.split(":", 1)[1])
    assert listed == list(STAGES)  # all 11, in the registry's order, not the 6 the train line once named
    assert len(STAGES) >= 11


def test_top_level_help_lists_every_command_with_its_description(capsys):
    printed = top_level_help(capsys)
    for name, (_, description) in COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(description)}$", printed, re.M), name


def test_a_stage_registered_later_appears_without_an_edit(capsys, monkeypatch):
    from plugformer.training import stage_table

    table = stage_table.StageTable()
    for stage in STAGES.values():
        table.register(stage)
    import dataclasses

    table.register(dataclasses.replace(STAGES["sft"], name="my_stage", description="a user's stage"))
    monkeypatch.setattr("plugformer.training.STAGES", table)
    assert "my_stage" in top_level_help(capsys)


def test_every_command_names_a_function_that_takes_its_arguments():
    """The table maps each name to what runs it ("module:function", imported when the command runs), no wrapper."""
    import importlib
    import inspect

    import plugformer.cli as cli

    for name, (target, _) in COMMANDS.items():
        if isinstance(target, str):
            module, _, function = target.partition(":")
            target = getattr(importlib.import_module(f"plugformer.{module}"), function)
        assert list(inspect.signature(target).parameters)[:1] == ["argv"], name
    wrappers = [name for name, value in vars(cli).items() if inspect.isfunction(value) and name.startswith("_")]
    assert wrappers == ["_usage", "_version"]
