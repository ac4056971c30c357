"""Project-level promises: CI runs the README's test command, shipped YAML loads, the CLI and demo work."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import plugformer
from plugformer.cli import COMMANDS
from plugformer.cli import main as cli_main
from plugformer.experiments import demo
from plugformer.runtime.arguments import load_yaml, parse_arguments


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
    printed = capsys.readouterr()
    lines = [line for line in printed.out.splitlines() if line.startswith("  ")]  # asked for: stdout, as argparse
    assert [line.split()[0] for line in lines] == list(COMMANDS)  # "extrapolateperplexity" before
    assert printed.err == ""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["no-such-command"])
    assert exit_info.value.code == 2 and "usage: plugformer" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"plugformer {plugformer.__version__}"


def test_info_prints_the_kernel_matrix(capsys):
    cli_main(["info"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + len(plugformer.ATTENTION_SCORES.names()) * len(plugformer.POSITION_SCHEMES.names())
    assert re.match(
        r"additive\s+rope\s+yes\s+-\s+-", next(line for line in lines if line.startswith("additive        rope"))
    )


def test_demo_learns_the_corpus_and_generates_through_the_pipeline(tmp_path):
    result = demo.main(
        [
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "60",
            "--train_sentences",
            "800",
            "--eval_sentences",
            "64",
            "--hidden_size",
            "64",
            "--num_hidden_layers",
            "2",
            "--vocab_size",
            "300",
        ]
    )
    # ≈ ln(300) at initialisation; 60 steps learn the sentence templates
    assert result["final_eval_loss"] < result["initial_eval_loss"] - 2.0
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "tokenizer.json").exists()
    for prompt, completion in result["completions"].items():
        assert completion.startswith(prompt) and len(completion) > len(prompt)


PACKAGE = ROOT / "src" / "plugformer"
MAX_MODULE_LINES = 500  # a module a reader can hold whole; split by concern past this


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The plugformer modules `path` imports anywhere in its body (a function-level import dodges no cycle), leaving
    out `if TYPE_CHECKING:` blocks, which never run."""
    import ast

    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            candidates = [f"{source}.{alias.name}" for alias in node.names] + [source]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate not in modules and "." in candidate:
                candidate = candidate.rpartition(".")[0]
            if candidate in modules and candidate != name:
                found.add(candidate)
    return found


def test_no_module_exceeds_the_size_limit():
    sizes = {module_name(p): len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


def test_the_package_has_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imported_modules(path, set(paths)) for name, path in paths.items()}
    done, cycles = set(), []

    def visit(name: str, trail: list[str]) -> None:  # depth-first; a module met again on the trail closes a cycle
        if name in trail:
            cycles.append([*trail[trail.index(name) :], name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


README = ROOT / "README.md"


def test_readme_tables_are_generated_from_the_registries():
    """The README's `variants` and `kernels` blocks are what `plugformer info --readme README.md` writes: a variant
    registered or a kernel record changed without regenerating them fails here."""
    from plugformer.runtime.markers import read_block
    from plugformer.runtime.readme_tables import COMMAND, blocks

    for name, text in blocks().items():
        assert read_block(README, name) == text.strip("\n"), (
            f"README.md's {name!r} block is out of date: run `{COMMAND}`"
        )


def test_info_rewrites_only_the_generated_blocks(tmp_path, capsys):
    from plugformer.runtime.readme_tables import blocks

    text = "# x\n\n<!-- variants:begin -->\nold\n<!-- variants:end -->\nkept\n<!-- kernels:begin -->\n<!-- kernels:end -->\n"
    readme = tmp_path / "README.md"
    readme.write_text(text, encoding="utf-8")
    cli_main(["info", "--readme", str(readme)])
    generated = blocks()
    assert readme.read_text(encoding="utf-8") == (
        f"# x\n\n<!-- variants:begin -->\n{generated['variants']}\n<!-- variants:end -->\nkept\n"
        f"<!-- kernels:begin -->\n{generated['kernels']}\n<!-- kernels:end -->\n"
    )
    capsys.readouterr()
    cli_main(["info", "--markdown"])
    assert capsys.readouterr().out.count(":begin -->") == 2


DOCUMENTS = [README, ROOT / "examples/README.md", ROOT / "tests/README.md", *sorted(ROOT.glob("model_cards/**/*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_the_guides_resolves(document):
    """A page moved or renamed leaves no dead link in the README or the pages it links to (anchors not checked)."""
    text = re.sub(r"```.*?```", "", document.read_text(encoding="utf-8"), flags=re.S)
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (document.parent / t).exists()]
    assert missing == [], f"{document.relative_to(ROOT)} links to missing files: {missing}"


# the brief's fixed layout, plus what git and CI need
TOP_LEVEL = {"pyproject.toml", "README.md", "src", "configs", "tests", "examples", "model_cards", ".ci", ".gitignore",
             "MANIFEST.in"}  # fmt: skip


def test_the_repository_root_holds_only_the_fixed_layout():
    """Nothing else is committed at the top level (a figure a command wrote to the working directory once was)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist has no history to list)")
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert {path.split("/")[0] for path in listed.splitlines()} <= TOP_LEVEL


def test_the_readme_is_a_guide_of_at_most_400_lines():
    """Measured figures live in model_cards/, walkthroughs in examples/README.md, test notes in tests/README.md."""
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 400


def test_the_readme_opening_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves "my-model" in the working directory
    opening = README.read_text(encoding="utf-8").split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.+?)\n```", opening, re.S)
    exec(compile(code, "README.md (opening example)", "exec"), {})
    assert (tmp_path / "my-model" / "config.json").exists()


def readme_code(section: str) -> list[str]:
    """The python blocks of the README section titled `section`, in order."""
    text = README.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.+?)\n```", text, re.S)


def test_the_readme_example_variant_runs_and_passes_its_reference_test(monkeypatch):
    """'Adding a variant' as printed: the class registers (in this test only), its reference test passes, eager and sdpa
    agree on it, its bias reaches the logits, and the generated tables pick it up."""
    import test_positions
    import torch
    from conftest import build, tiny_config

    from plugformer import POSITION_SCHEMES
    from plugformer.runtime.readme_tables import blocks
    from plugformer.runtime.variants import summary

    monkeypatch.setattr(POSITION_SCHEMES, "_table", dict(POSITION_SCHEMES._table))  # restored after the test
    variant_code, test_code = readme_code("Adding a variant")
    before = set(POSITION_SCHEMES)
    exec(compile(variant_code, "README.md (Adding a variant)", "exec"), {})
    (name,) = set(POSITION_SCHEMES) - before
    tests = dict(vars(test_positions))  # the reference test runs beside its file's helpers
    exec(compile(test_code, "README.md (Adding a variant)", "exec"), tests)
    (reference_test,) = [
        tests[key] for key in tests if key.startswith(f"test_{name}_") and key not in vars(test_positions)
    ]
    reference_test()
    tokens = torch.tensor([[5, 9, 9, 2, 7, 7, 3, 11]])
    with torch.no_grad():
        eager = build(tiny_config("scaled_dot", name), "eager")(tokens).logits
        torch.testing.assert_close(
            build(tiny_config("scaled_dot", name), "sdpa")(tokens).logits, eager, atol=1e-5, rtol=0
        )
        assert not torch.allclose(build(tiny_config("scaled_dot", "none"), "eager")(tokens).logits, eager)
    tables = blocks()
    assert f"| `{name}` | {summary(POSITION_SCHEMES.get(name))} |" in tables["variants"].replace("\\|", "|")
    assert f"`{name}`" in tables["kernels"]
