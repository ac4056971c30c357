"""Project-level promises: CI runs the README's test command, shipped YAML loads, the CLI and demo work."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import plugformer
from plugformer import demo
from plugformer.arguments import load_yaml, parse_arguments
from plugformer.cli import COMMANDS
from plugformer.cli import main as cli_main


ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    commands = readme_commands()
    assert readme.index("```bash") < readme.index("\n## ")  # before any section
    assert "plugformer pipeline --config configs/pipeline/tiny.yaml" in commands[0] and "pytest" in commands[1]
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[1] in ci_lines


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_demo_yaml_loads(path):
    """(configs/<stage>/, configs/accelerate/ and configs/pipeline/ are loaded by tests/test_training.py)"""
    values = load_yaml(path, {f.name for f in dataclasses.fields(demo.DemoArguments)})
    arguments = parse_arguments(demo.DemoArguments, ["--config", str(path)], prog="test")
    assert all(getattr(arguments, key) == value for key, value in values.items())


def test_command_line_overrides_yaml_and_unknown_keys_fail(tmp_path):
    config = tmp_path / "demo.yaml"
    config.write_text("max_steps: 7\nposition_scheme: rope\n")
    arguments = parse_arguments(demo.DemoArguments, ["--config", str(config), "--max_steps", "9"], prog="t")
    assert (arguments.max_steps, arguments.position_scheme) == (9, "rope")
    config.write_text("max_step: 7\n")
    with pytest.raises(ValueError, match=r"unknown keys \['max_step'\]"):
        parse_arguments(demo.DemoArguments, ["--config", str(config)], prog="t")
    with pytest.raises(ValueError, match="unknown arguments"):
        parse_arguments(demo.DemoArguments, ["--max_stepz", "3"], prog="t")


def test_help_keeps_every_command_name_apart_from_its_description(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in lines] == list(COMMANDS)  # "extrapolateperplexity" before


def test_info_prints_the_kernel_matrix(capsys):
    cli_main(["info"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(plugformer.ATTENTION_SCORES.names()) * len(plugformer.POSITION_SCHEMES.names())
    assert re.match(
        r"additive\s+rope\s+yes\s+-\s+-", next(line for line in lines if line.startswith("additive        rope"))
    )


def test_demo_learns_the_corpus_and_generates_through_the_pipeline(tmp_path):
    result = demo.main([
        "--output_dir", str(tmp_path), "--max_steps", "60", "--train_sentences", "800", "--eval_sentences", "64",
        "--hidden_size", "64", "--num_hidden_layers", "2", "--vocab_size", "300",
    ])  # fmt: skip
    # ≈ ln(300) at initialisation; 60 steps learn the sentence templates
    assert result["final_eval_loss"] < result["initial_eval_loss"] - 2.0
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()
    for prompt, completion in result["completions"].items():
        assert completion.startswith(prompt) and len(completion) > len(prompt)
