"""The stage table: a stage is one registered record, and everything that runs stages reads it.

A stage registered here, in the test only, is picked up by the pipeline (its order and requirements), the CLI, the
data loader, data-parallel splitting and the model card with no other edit; no module outside a stage's own module
compares a string with a stage's name.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from plugformer.cli import main as cli_main
from plugformer.data.formats import FORMAT_COLUMNS
from plugformer.experiments.parallel import split_batch
from plugformer.experiments.pipeline import PipelineArguments, requirements, stage_argv
from plugformer.training import STAGES, parse_stage_arguments, register_stage
from plugformer.training.cards import StageCard
from plugformer.training.common import write_card
from plugformer.training.data import stage_data


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "plugformer"
README = ROOT / "README.md"


@pytest.fixture
def stage_table(monkeypatch):
    """The stage table, restored after the test: stages registered in a test stay in it."""
    monkeypatch.setattr(STAGES, "_table", dict(STAGES._table))
    return STAGES


def continued_pretraining() -> object:
    """A real stage: pretraining continued on plain text from the SFT model, with pretrain's own trainer."""
    return dataclasses.replace(
        STAGES["pretrain"],
        name="continued_pretrain",
        parent="sft",
        description="pretraining continued on plain text from the SFT model (Trainer)",
        card=StageCard("pretraining continued on plain text after SFT", "Trainer"),
    )


@pytest.mark.parametrize("name", list(STAGES))
def test_every_shipped_stage_record_is_complete(name):
    stage = STAGES[name]
    assert stage.name == name and stage.description and stage.card.summary and stage.card.trainer
    assert stage.parent is None or list(STAGES).index(stage.parent) < list(STAGES).index(name)  # default order runs
    assert stage.data_format in FORMAT_COLUMNS
    for needed in stage.inputs:
        assert needed.default in needed.sources and set(needed.sources) <= set(STAGES)
        assert needed.option in {f.name for f in dataclasses.fields(PipelineArguments)}
    assert (ROOT / "configs" / name / "tiny.yaml").is_file()
    assert Path(inspect.getfile(stage.train)) == PACKAGE / "training" / "stages" / f"{name}.py"  # in its own module


def test_a_stage_name_registers_once(stage_table):
    with pytest.raises(ValueError, match="stage 'sft' is already registered"):
        register_stage(dataclasses.replace(STAGES["sft"]))
    with pytest.raises(ValueError, match="unknown stage 'ppo'; stages: \\['pretrain', 'sft'"):
        STAGES.get_stage("ppo")


def test_importing_the_stage_table_imports_no_trainer():
    code = "import sys, plugformer.training as t; print(len(t.STAGES), 'trl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(STAGES)), "False"]


def assert_stage_is_picked_up(name: str, tmp_path: Path, capsys) -> None:
    """The pipeline, the CLI, the data loader, the parallel runner and the card read the record of `name`."""
    stage = STAGES[name]
    # the pipeline: by default after the stages registered before it; its parent and inputs are required first
    args = PipelineArguments(output_dir=str(tmp_path / "run"), stage_configs=str(tmp_path / "{stage}.yaml"))
    assert args.stages[-1] == name
    assert requirements(args)[name] == {stage.parent, *(i.default for i in stage.inputs)} - {None}
    (tmp_path / f"{name}.yaml").write_text("max_steps: 1\n")
    argv = stage_argv(args, name)
    assert argv[argv.index("--model_name_or_path") + 1] == str(tmp_path / "run" / stage.parent)
    early = PipelineArguments(stages=[name, *STAGES], stage_configs=args.stage_configs)
    with pytest.raises(ValueError, match=f"'{stage.parent}' must come before '{name}'"):
        stage_argv(early, name)
    # the CLI: listed by `plugformer train --help`, its arguments parsed into its trainer's config
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    assert re.search(rf"^  {name}\s+{re.escape(stage.description)}$", capsys.readouterr().out, re.M)
    training_args = parse_stage_arguments(name, argv)[2]  # (its --output_dir: the pipeline's folder of the stage)
    assert isinstance(training_args, stage.config_type())
    # the data loader: the rows of its format, checked as its format's
    script_args = stage.script_arguments(train_examples=3, dev_examples=2, test_examples=0)
    data = stage_data(stage, script_args)
    assert set(FORMAT_COLUMNS[stage.data_format]) <= set(data["train"].column_names) and len(data["dev"]) == 2
    # `plugformer pipeline --jobs N` splits its batch as its record says
    assert split_batch(name, 4, 2) == (2 if stage.data_parallel else 1)
    # the model card: its record's summary, trainer and pipeline tag
    from conftest import build, tiny_config

    model = build(tiny_config())
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m), args=training_args)
    Path(trainer.args.output_dir).mkdir(parents=True)
    write_card(trainer, stage, {"stage": name, "world_size": 1, "train_seconds": 1.0}, script_args)
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert f"{stage.card.summary} — produced by the `{name}` stage" in card
    # (the trainer, then its config's loss where it has one: `cards.loss_text`)
    assert f"`{name}` ({stage.card.trainer}" in card and f"pipeline_tag: {stage.card.pipeline_tag}" in card


def test_a_stage_registered_in_one_place_is_picked_up_everywhere(stage_table, tmp_path, capsys):
    register_stage(continued_pretraining())
    assert_stage_is_picked_up("continued_pretrain", tmp_path, capsys)


def stage_name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each comparison of a string with one of `names` in `source`: `x == "sft"`,
    `x in ("reward", "dpo")`, `"pretrain" in stages`, ..."""

    def constants(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {value for element in node.elts for value in constants(element)}
        return set()

    return sorted(
        (node.lineno, name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare)
        for operand in (node.left, *node.comparators)
        for name in constants(operand) & names
    )


def test_the_scan_finds_the_comparisons_it_forbids():
    source = 'if stage == "rlhf" or stage in ("reward", "dpo"):\n    x = {"sft": 1}["sft"]\nok = "pretrain" in stages\n'
    assert stage_name_comparisons(source, set(STAGES)) == [(1, "dpo"), (1, "reward"), (1, "rlhf"), (3, "pretrain")]


# string comparisons that look like a stage's name and are not one: TRL's logged metric "reward"
NOT_STAGE_NAMES = {"training/selection.py": {"reward"}}


def test_no_module_outside_a_stages_own_module_compares_a_stage_name():
    own = {Path(inspect.getfile(stage.train)) for stage in STAGES.values()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in own:
            where = str(path.relative_to(PACKAGE))
            names = set(STAGES) - NOT_STAGE_NAMES.get(where, set())
            found += [f"{where}:{line}: {name!r}" for line, name in stage_name_comparisons(path.read_text(), names)]
    assert found == [], "read the stage's record (plugformer.training.stage_table) instead of testing its name"


def readme_code(section: str) -> list[str]:
    """The python blocks of the README section titled `section`, in order."""
    text = README.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.+?)\n```", text, re.S)


def test_the_readme_example_stage_registers_and_is_picked_up_everywhere(stage_table, tmp_path, capsys):
    """'Adding a stage' as printed: its record registers (in this test only) and every reader picks it up."""
    before = set(STAGES)
    for code in readme_code("Adding a stage"):
        exec(compile(code, "README.md (Adding a stage)", "exec"), {})
    (name,) = set(STAGES) - before
    assert_stage_is_picked_up(name, tmp_path, capsys)
