"""The package layout is the architecture: the checkpoint's code flat at the root, tools in subpackages whose
imports point one way (model <- runtime <- data <- evaluation <- training <- integrations <- bench <- experiments
<- cli); import cycles are tests/test_project.py's.

`save_pretrained` copies `modeling.py` (and `decomposable.py`) with every module they import into each checkpoint,
and transformers' remote-code loader follows flat relative imports only; so the root holds that closure and the
entry points, nothing else.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "plugformer"
ENTRY_POINTS = {"plugformer", "plugformer.__main__", "plugformer.cli"}  # the public names, the command table
CHECKPOINT_FILES = ("modeling", "decomposable")  # the modules `save_pretrained` copies, with their imports
LAYERS = ("model", "runtime", "data", "evaluation", "training", "integrations", "bench", "experiments", "cli")


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = module_files()


def type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def imports_of(name: str) -> list[tuple[str, int, bool]]:
    """(imported plugformer module, line, at module level) for every import outside `if TYPE_CHECKING:`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if type_checking_block(child):
                continue
            nested = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                for alias in child.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                    if target in MODULES:
                        found.append((target, child.lineno, top))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top) for alias in child.names if alias.name in MODULES)
            visit(child, nested)

    visit(ast.parse(path.read_text()), True)
    return found


def layer(name: str) -> int:
    """The layer index of a module: the package root (but its entry points) is the model."""
    if name in ("plugformer.cli", "plugformer.__main__"):
        return LAYERS.index("cli")
    parts = name.split(".")
    if name == "plugformer" or MODULES[name].parent == PACKAGE:
        return LAYERS.index("model")
    if parts[1] not in LAYERS:
        raise AssertionError(f"{name}: subpackage {parts[1]!r} has no place in LAYERS {LAYERS}")
    return LAYERS.index(parts[1])


def test_every_import_points_down_the_layers():
    upward = sorted(
        {
            f"{name}:{line} imports {target} ({LAYERS[layer(target)]} is above {LAYERS[layer(name)]})"
            for name in MODULES
            if name != "plugformer"  # the package's public names may come from anywhere
            for target, line, _ in imports_of(name)
            if layer(target) > layer(name)
        }
    )
    assert not upward, "\n".join(upward)


def checkpoint_closure() -> set[str]:
    closure, todo = set(), [f"plugformer.{name}" for name in CHECKPOINT_FILES]
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        todo += [target for target, _, _ in imports_of(name) if target != "plugformer"]
    return closure


def test_the_root_holds_the_checkpoint_closure_and_the_entry_points_only():
    root = {name for name in MODULES if name.count(".") == 1 and MODULES[name].parent == PACKAGE}
    closure = checkpoint_closure()
    assert closure <= root, f"checkpoint files outside the root (remote code would not find them): {closure - root}"
    assert root - closure <= ENTRY_POINTS, f"tools at the package root: {sorted(root - closure - ENTRY_POINTS)}"


@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_checkpoint_files_import_each_other_flat_and_relative(name):
    for target, line, _ in imports_of(f"plugformer.{name}"):
        source = MODULES[f"plugformer.{name}"].read_text().splitlines()[line - 1]
        assert target.count(".") == 1 and "from ." in source and "from .." not in source, (
            f"{name}.py:{line} imports {target} by a path remote code cannot follow: {source.strip()}"
        )


def test_a_saved_checkpoint_carries_the_closure_and_no_trainer_shim(tmp_path):
    """The files `save_pretrained` copies are the closure above, and none of them imports or defines a trainer shim:
    the shims for `Trainer`, TRL and accelerate are tooling (`training/trainer_options.py`), not checkpoint code."""
    from conftest import build, tiny_config

    build(tiny_config()).save_pretrained(tmp_path)
    copied = {path.stem: ast.parse(path.read_text()) for path in tmp_path.glob("*.py")}
    assert {f"plugformer.{name}" for name in copied} <= checkpoint_closure()
    assert {"modeling", "compat"} <= set(copied)
    trainer = re.compile(r"(^|\.)(trl|accelerate|trainer\w*)(\.|$)|Trainer|TrainingArguments|trainer_option", re.I)
    found = []
    for name, tree in copied.items():
        for node in ast.walk(tree):  # imports anywhere, e.g. inside a function
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                found += [f"{name}.py:{node.lineno} imports {m}" for m in modules if trainer.search(m)]
        for node in tree.body:  # the module's own names
            targets = getattr(node, "targets", [node.target] if isinstance(node, ast.AnnAssign) else [])
            defined = [node.name] if hasattr(node, "name") else [ast.unparse(target) for target in targets]
            found += [f"{name}.py:{node.lineno} defines {d}" for d in defined if trainer.search(d)]
    assert not found, f"trainer shims travel with the checkpoint: {found}"
