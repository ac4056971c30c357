"""Runs transformers' own common model tests against plugformer's heads (`tests/transformers_common_suite.py`).

transformers' test files are not part of this repository: they are taken at run time from a transformers source,
the installed version's:
- a bare git mirror (the `fetch` tool's copy: `git --git-dir=... show v5.24.0:tests/...`),
- a transformers source tree, or
- its sdist (`pip download transformers==5.24.0 --no-binary :all: --no-deps`), which holds `tests/test_*_common.py`
  but not `tests/generation/` or `tests/exporters/`; those mixins are then replaced by empty ones (the generation
  tests are not run; the report says so). A source tree may hold the sdist's `tests/` with a `tests/generation/`
  added from a git mirror of another version (see tests/README.md).

    python tests/run_transformers_common_tests.py --source PATH [--report FILE] [--mixin NAME] [-- pytest options]

`--mixin GenerationTesterMixin` runs only the tests that class defines (its parameterized expansions included).

Prints and writes per-configuration passed / failed / skipped counts, and exits 0 when nothing failed. Without a
source (`--source` or `TRANSFORMERS_SOURCE`), it says so and exits 0 ("skipped").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


HERE = Path(__file__).resolve().parent
NEEDED = ["tests/test_modeling_common.py", "tests/test_configuration_common.py"]
OPTIONAL = {  # file -> the stub written when the source lacks it
    "tests/__init__.py": "",
    "tests/generation/__init__.py": "",
    "tests/generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "tests/exporters/__init__.py": "",
    "tests/exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "tests/utils/__init__.py": "",
    "tests/utils/test_configuration_utils.py": "config_common_kwargs = {}\n",
}


def _version_ref() -> str:
    import transformers

    return f"v{transformers.__version__}"


def read_source(source: Path, name: str) -> str | None:
    """The text of `name` (a path inside the transformers repository) from `source`, or None if it lacks it."""
    if source.is_file() and source.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source) as archive:
            for member in archive.getmembers():
                if member.name.split("/", 1)[-1] == name:
                    return archive.extractfile(member).read().decode()
        return None
    if (source / "HEAD").is_file() and (source / "objects").is_dir():  # a bare git directory
        done = subprocess.run(
            ["git", "--git-dir", str(source), "show", f"{_version_ref()}:{name}"], capture_output=True, text=True
        )
        return done.stdout if done.returncode == 0 else None
    path = source / name
    return path.read_text() if path.is_file() else None


def prepare(source: Path, folder: Path) -> list[str]:
    """Writes transformers' test files and the plugformer suite into `folder/tests`; returns the stubbed files."""
    stubbed = []
    for name in NEEDED:
        text = read_source(source, name)
        if text is None:
            raise FileNotFoundError(f"{source} has no {name} (for transformers {_version_ref()})")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for name, stub in OPTIONAL.items():
        text = read_source(source, name)
        if text is None:
            text, _ = stub, stubbed.append(name)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    shutil.copy(HERE / "transformers_common_suite.py", folder / "tests" / "test_plugformer_common.py")
    return stubbed


def select_mixins(folder: Path, mixins: list[str]) -> None:
    """Writes a conftest that keeps only the tests defined by the classes named in `mixins`."""
    (folder / "tests" / "conftest.py").write_text(
        f"MIXINS = {set(mixins)!r}\n\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    kept = [item for item in items if getattr(item, 'function', None) is not None\n"
        "            and item.function.__qualname__.split('.')[0] in MIXINS]\n"
        "    config.hook.pytest_deselected(items=[item for item in items if item not in kept])\n"
        "    items[:] = kept\n"
    )


def counts(junit: Path) -> dict[str, dict[str, int]]:
    """Per test class (one per head and configuration): passed, failed (errors included), skipped (with reasons)."""
    import xml.etree.ElementTree as ElementTree

    table = collections.defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": {}})
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        row = table[case.get("classname").rsplit(".", 1)[-1]]
        if case.find("failure") is not None or case.find("error") is not None:
            row["failed"] += 1
            row["failures"].append(case.get("name"))
        elif case.find("skipped") is not None:
            row["skipped"] += 1
            row["skips"][case.get("name")] = case.find("skipped").get("message", "")
        else:
            row["passed"] += 1
    return dict(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        default=os.environ.get("TRANSFORMERS_SOURCE"),
        help="a transformers git mirror, source tree or sdist",
    )
    parser.add_argument("--report", help="write the counts as JSON here")
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        help="a folder with the tests' own requirements (`parameterized`), e.g. pip install --target",
    )
    parser.add_argument(
        "--mixin",
        action="append",
        default=[],
        help="run only the tests this mixin class defines (e.g. GenerationTesterMixin)",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if not args.source or not Path(args.source).exists():
        print("skipped: no transformers source (--source or TRANSFORMERS_SOURCE)")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        stubbed = prepare(Path(args.source), Path(folder))
        if args.mixin:
            select_mixins(Path(folder), args.mixin)
        junit = Path(folder) / "junit.xml"
        paths = [str(HERE.parent / "src"), folder, *args.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        command = [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_plugformer_common.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={junit}",
            *args.pytest_args,
        ]
        subprocess.run(command, cwd=folder, env=env)
        table = counts(junit)
    for name, row in sorted(table.items()):
        failed = f"  failed: {', '.join(row['failures'])}" if row["failures"] else ""
        print(f"{name:50s} passed {row['passed']:4d}  failed {row['failed']:3d}  skipped {row['skipped']:4d}{failed}")
    if stubbed:
        print(f"not from the source (empty stand-ins, their tests not run): {', '.join(stubbed)}")
    if args.report:
        Path(args.report).write_text(json.dumps({"stubbed": stubbed, "classes": table}, indent=1))
    return 1 if any(row["failed"] for row in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
