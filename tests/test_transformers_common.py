"""transformers' own common model tests on plugformer's causal, encoder and seq2seq heads: 0 failures, skips stated.

Slow (minutes per configuration on a CPU) and needs transformers' test files, which are not part of this repository:
set `TRANSFORMERS_SOURCE` to a transformers git mirror, source tree or sdist of the installed version (see
`tests/run_transformers_common_tests.py`), and `TRANSFORMERS_TESTS_PATH` to a folder holding the tests' own
requirement `parameterized` if this environment lacks it (`pip install --target DIR parameterized`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest


@pytest.mark.slow
def test_transformers_common_model_tests_pass(tmp_path):
    source = os.environ.get("TRANSFORMERS_SOURCE")
    if not source or not Path(source).exists():
        pytest.skip("TRANSFORMERS_SOURCE (a transformers mirror, tree or sdist) is not set")
    extra = [path for path in os.environ.get("TRANSFORMERS_TESTS_PATH", "").split(os.pathsep) if path]
    if importlib.util.find_spec("parameterized") is None and not extra:
        pytest.skip("transformers' tests need `parameterized` (set TRANSFORMERS_TESTS_PATH)")
    spec = importlib.util.spec_from_file_location(
        "runner", Path(__file__).with_name("run_transformers_common_tests.py")
    )
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    report = tmp_path / "report.json"
    status = runner.main(["--source", source, "--report", str(report), *(f"--path={path}" for path in extra)])
    classes = json.loads(report.read_text())["classes"]
    assert classes and status == 0, {name: row["failures"] for name, row in classes.items() if row["failed"]}
