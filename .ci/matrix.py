#!/usr/bin/env python3
"""The version matrix: one venv per combination of the supported ranges' ends, the quick test tier and one pipeline
stage in each, and a table of the results.

    python3 .ci/matrix.py                      # every combination, one after another
    python3 .ci/matrix.py lowest newest        # the named ones
    python3 .ci/matrix.py --list               # what each combination pins

Each venv is built under `--root` (default: the system's temp folder), torch first and pinned, then `pip install -e
".[test]"` with the combination's pins; the venv is removed afterwards unless `--keep`. A machine whose pip config
caps a version (`constraint = ...`) needs `PIP_CONSTRAINT=/dev/null` for the newest torch. Results are appended, one
JSON line per combination, to `--results` (default `<root>/plugformer-matrix.jsonl`). The default CI (`.ci/run`)
keeps its one environment; this runs by hand whenever a range moves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
# name -> (python, {distribution: version}); torch is installed first, the rest with `pip install -e ".[test]"`
COMBINATIONS: dict[str, tuple[str, dict[str, str]]] = {
    # the lowest of each range (torch 2.6 fails `import transformers` 5.19 on a machine without an accelerator)
    "lowest": ("3.11", {"torch": "2.7.0", "transformers": "5.19.0", "accelerate": "1.15.0", "trl": "1.16.0"}),
    # the newest of each range
    "newest": ("3.11", {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0", "trl": "1.16.0"}),
    "py3.12": ("3.12", {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0", "trl": "1.16.0"}),
    "py3.13": ("3.13", {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0", "trl": "1.16.0"}),
    "py3.14": ("3.14", {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0", "trl": "1.16.0"}),
}
DISTRIBUTIONS = ("torch", "transformers", "accelerate", "trl", "peft", "datasets", "tokenizers")
# one pipeline stage, cut short: trains the tokenizer and two optimizer steps of the tiny causal LM
STAGE = [
    "-m", "plugformer", "train", "pretrain", "--config", "configs/pretrain/tiny.yaml", "--max_steps", "2",
    "--train_examples", "2000", "--dev_examples", "64", "--eval_strategy", "no", "--save_strategy", "no",
    "--report_to", "none", "--logging_steps", "1",
]  # fmt: skip


def run(command: list[str], log, env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    """Runs `command` with its output appended to `log`; returns the exit status (124 on timeout)."""
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    try:
        return subprocess.run(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        log.write(f"\n(timed out after {timeout} s)\n")
        return 124


def find_python(version: str) -> str:
    """`pythonX.Y` on PATH (a pyenv shim only where it answers), or the newest pyenv build of it."""
    found = shutil.which(f"python{version}")
    if found is not None and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    builds = sorted(pyenv.glob(f"{version}.*/bin/python{version}")) if pyenv.is_dir() else []
    if not builds:
        raise FileNotFoundError(f"python{version} is not on PATH nor under {pyenv}")
    return str(builds[-1])


def check(name: str, root: Path, keep: bool, reuse: bool = False, tests: bool = True) -> dict:
    """Builds the venv of combination `name` (or reuses a built one), runs the quick tier and the stage; returns
    the result row."""
    python_version, pins = COMBINATIONS[name]
    venv = root / f"plugformer-matrix-{name}"
    log_path = root / f"plugformer-matrix-{name}.log"
    row: dict = {"combination": name, "python": python_version, "log": str(log_path)}
    python = str(venv / "bin" / "python")
    reuse = reuse and Path(python).exists()
    if not reuse:
        shutil.rmtree(venv, ignore_errors=True)
    started = time.monotonic()
    try:
        interpreter = find_python(python_version)
    except FileNotFoundError as error:  # e.g. no 3.14 build here: a row saying so, the other combinations still run
        return {**row, "install": f"not run: {error}", "minutes": 0.0}
    with log_path.open("a" if reuse else "w") as log:
        pip = [python, "-m", "pip", "install", "--retries", "0", "--disable-pip-version-check"]
        steps = [
            [interpreter, "-m", "venv", str(venv)],
            [*pip, f"torch=={pins['torch']}"],
            [*pip, "-e", ".[test]", *(f"{dist}=={version}" for dist, version in pins.items())],
        ]
        row["install"] = "ok" if reuse or all(run(step, log) == 0 for step in steps) else "failed"
        if row["install"] == "ok" and tests:
            versions = subprocess.run(
                [python, "-c", f"import importlib.metadata as m; print(*(m.version(d) for d in {DISTRIBUTIONS!r}))"],
                capture_output=True,
                text=True,
            ).stdout.split()
            row.update(zip(DISTRIBUTIONS, versions, strict=False))
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            env.pop("PYTHONPATH", None)  # the venv's editable install, not another checkout
            status = run([python, "-m", "pytest", "-m", "smoke", "-q", "-p", "no:cacheprovider"], log, env)
            log.flush()
            output = log_path.read_text(errors="replace").rsplit("-m pytest -m smoke", 1)[-1].splitlines()
            summary = [line for line in output if re.search(r"\d+ \w+.* in [\d.]+s", line)]
            row["smoke"] = (summary[-1].strip("= ") if summary else "no summary") + ("" if status == 0 else " (FAILED)")
            with tempfile.TemporaryDirectory() as output_dir:
                status = run([python, *STAGE, "--output_dir", output_dir], log, env, timeout=1800)
            row["pretrain"] = "ok" if status == 0 else f"failed (exit {status})"
    row["minutes"] = round((time.monotonic() - started) / 60, 1)
    if not keep:
        shutil.rmtree(venv, ignore_errors=True)
    return row


def table(rows: list[dict]) -> str:
    columns = ["combination", "python", *DISTRIBUTIONS[:4], "install", "smoke", "pretrain", "minutes"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(column, "-")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"combinations to run (default: all of {', '.join(COMBINATIONS)})")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()), help="where the venvs are built")
    parser.add_argument("--results", type=Path, help="JSON lines file the rows are appended to")
    parser.add_argument("--keep", action="store_true", help="keep each venv after its run")
    parser.add_argument("--reuse", action="store_true", help="run in an already built venv (kept by --keep)")
    parser.add_argument("--build-only", action="store_true", help="build the venvs (with --keep), run nothing")
    parser.add_argument("--list", action="store_true", help="print the combinations and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (python_version, pins) in COMBINATIONS.items():
            print(name, f"python{python_version}", *(f"{dist}=={version}" for dist, version in pins.items()))
        return 0
    unknown = sorted(set(args.names) - set(COMBINATIONS))
    if unknown:
        parser.error(f"unknown combinations {unknown}; allowed: {', '.join(COMBINATIONS)}")
    results = args.results or args.root / "plugformer-matrix.jsonl"
    rows = []
    for name in args.names or list(COMBINATIONS):
        rows.append(check(name, args.root, args.keep, args.reuse, tests=not args.build_only))
        with results.open("a") as handle:
            handle.write(json.dumps(rows[-1]) + "\n")
        print(table(rows[-1:]), flush=True)
    print(table(rows))
    if args.build_only:
        return 0 if all(row["install"] == "ok" for row in rows) else 1
    return 0 if all(row.get("pretrain") == "ok" and "FAILED" not in row.get("smoke", "") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
