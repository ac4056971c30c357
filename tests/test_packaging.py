"""The packaging metadata (pyproject.toml, MANIFEST.in): an SPDX license with a setuptools that reads it, capped;
the Pythons allowed and their classifiers; an sdist that holds what tests/README.md tells its reader to run."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version


ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def setuptools_range() -> SpecifierSet:
    (requirement,) = [r for r in PYPROJECT["build-system"]["requires"] if re.match(r"setuptools\b", r)]
    return SpecifierSet(requirement.removeprefix("setuptools"))


def test_the_license_is_an_spdx_expression():
    # setuptools refuses the `{text = ...}` table from 2027-02-18; PEP 639's string form replaces it
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in PYPROJECT["project"]["classifiers"])  # PEP 639 forbids both


def test_the_build_needs_a_setuptools_that_reads_it_and_caps_the_next_major():
    allowed = setuptools_range()
    assert not allowed.contains("76.1") and allowed.contains("77.0")  # 77: the first with PEP 639 expressions
    upper = [s for s in allowed if s.operator == "<"]
    assert upper and Version(upper[0].version).minor == 0 and Version(upper[0].version).micro == 0  # a major


def test_the_python_classifiers_match_requires_python():
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    listed = [c.rsplit(" ", 1)[1] for c in PYPROJECT["project"]["classifiers"]
              if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]  # fmt: skip
    assert listed and all(allowed.contains(f"{version}.0") for version in listed)
    minors = [f"3.{minor}" for minor in range(8, 20) if allowed.contains(f"3.{minor}.0")]
    assert minors == listed  # each allowed minor is named, none beyond
    assert "3.14" in minors  # every dependency has 3.14 wheels (pyproject.toml's comment)


def test_the_manifest_ships_every_file_tests_readme_tells_users_to_run():
    readme = (ROOT / "tests" / "README.md").read_text()
    named = sorted(set(re.findall(r"\.ci/[\w.]+", readme)))
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert ".ci/matrix.py" in named
    for path in named:
        assert (ROOT / path).is_file() and path in manifest, path


def built_sdist(folder: Path) -> list[str]:
    """The names in an sdist built here by setuptools' own backend (no isolation, no network: about 3 s)."""
    script = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    built = subprocess.run([sys.executable, "-c", script, str(folder)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    with tarfile.open(folder / built.stdout.strip().splitlines()[-1]) as archive:
        return [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]


def test_the_sdist_holds_the_matrix_the_tests_and_the_shipped_configs(tmp_path):
    import setuptools

    if not setuptools_range().contains(setuptools.__version__):
        pytest.skip(f"setuptools {setuptools.__version__} is outside the build's range {setuptools_range()}")
    if not (ROOT / ".git").exists():
        pytest.skip("not a checkout: an sdist is built from one")
    names = set(built_sdist(tmp_path))
    assert {".ci/matrix.py", ".ci/run", "tests/README.md", "MANIFEST.in", "pyproject.toml"} <= names
    assert "configs/accelerate/cpu_2proc.yaml" in names
    assert not [name for name in names if "/.hypothesis/" in name or "__pycache__" in name]
