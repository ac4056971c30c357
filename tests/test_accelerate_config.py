"""`plugformer accelerate-config [NAME]`: the shipped accelerate YAMLs by name, from any working directory, and the
refusals that point there instead of a checkout-relative `configs/accelerate/...`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from plugformer.cli import main as cli_main
from plugformer.runtime.launch import ACCELERATE_CONFIGS, accelerate_config, accelerate_config_names


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path.stem for path in (ROOT / "configs" / "accelerate").glob("*.yaml"))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        cli_main(argv)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def test_the_shipped_names_are_the_repository_yamls():
    assert SHIPPED and accelerate_config_names() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_each_name_prints_an_existing_absolute_file_from_any_directory(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # outside the checkout: `configs/accelerate/...` resolves to nothing here
    code, out, err = run_cli(["accelerate-config", name], capsys)
    assert code == 0 and err == ""
    path = Path(out.strip())
    assert path.is_absolute() and path.is_file() and path.name == f"{name}.yaml"
    assert path.read_text() == (ROOT / "configs" / "accelerate" / f"{name}.yaml").read_text()
    assert accelerate_config(f"{name}.yaml") == path  # the file name is taken too


def test_without_a_name_it_lists_every_yaml_and_its_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["accelerate-config"], capsys)
    rows = [line.split() for line in out.splitlines()]
    assert code == 0 and [row[0] for row in rows] == SHIPPED
    assert all(Path(row[1]).is_file() for row in rows)


@pytest.mark.parametrize("name", ["no_such_topology", "../sft/tiny", "accelerate/cpu_2proc"])
def test_an_unknown_name_is_refused_in_one_line_listing_the_names(name, capsys):
    code, _, err = run_cli(["accelerate-config", name], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"accelerate config {name!r}" in err and "cpu_2proc" in err and "zero3" in err


def test_more_than_one_name_is_refused(capsys):
    code, _, err = run_cli(["accelerate-config", "cpu_2proc", "fsdp2"], capsys)
    assert code == 2 and "takes one NAME" in err


def test_no_refusal_suggests_a_checkout_relative_accelerate_config():
    """No string in src/ but a docstring names `configs/accelerate/...`, which `accelerate launch --config_file`
    reads relative to the working directory: messages say `plugformer accelerate-config NAME` instead."""
    offenders = []
    for path in sorted((ROOT / "src" / "plugformer").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        offenders += [
            f"{path.relative_to(ROOT)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "configs/accelerate" in node.value
            and id(node) not in docstrings
        ]
    assert offenders == []


def test_the_package_data_holds_the_yamls():
    assert ACCELERATE_CONFIGS.is_dir() and {p.stem for p in ACCELERATE_CONFIGS.glob("*.yaml")} == set(SHIPPED)
