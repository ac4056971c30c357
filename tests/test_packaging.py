"""The packaging metadata (pyproject.toml, MANIFEST.in): an SPDX license with a setuptools that reads it, capped;
the Pythons allowed and their classifiers; an sdist that holds what tests/README.md tells its reader to run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
    listed = [
        c.rsplit(" ", 1)[1]
        for c in PYPROJECT["project"]["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
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
