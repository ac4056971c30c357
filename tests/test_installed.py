"""The package where users install it: the shipped YAMLs are package data found from any folder (as are the native
kernels' C sources), and a built wheel, installed in a fresh virtual environment, runs a stage from another folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import pytest

from plugformer.runtime.arguments import SHIPPED_CONFIGS, config_path


ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path.relative_to(ROOT).as_posix() for path in ROOT.glob("configs/**/*.yaml"))


def test_the_package_ships_every_config_of_the_repository():
    """`src/plugformer/configs` is the top-level `configs/` (a link), so the package data cannot drift from it."""
    packaged = sorted(
        f"configs/{path.relative_to(SHIPPED_CONFIGS).as_posix()}" for path in SHIPPED_CONFIGS.glob("**/*.yaml")
    )
    assert packaged == SHIPPED and len(SHIPPED) > 20


def test_the_package_data_holds_the_native_kernels_sources():
    """Every C source and header `plugformer.native` builds at first use is package data (a wheel without them would
    quietly keep the torch path)."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["plugformer"]
    sources = [
        path.relative_to(ROOT / "src" / "plugformer").as_posix()
        for path in (ROOT / "src" / "plugformer" / "csrc").glob("*.[ch]")
    ]
    assert sources and all(any(fnmatch(source, pattern) for pattern in patterns) for source in sources)


@pytest.mark.parametrize(
    "name", ["configs/pretrain/tiny.yaml", "configs/demo.yaml", "configs/accelerate/cpu_zero3.yaml"]
)
def test_shipped_configs_are_found_from_another_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Path(config_path(name)).read_text() == (ROOT / name).read_text()
    with pytest.raises(FileNotFoundError, match=r"configs/nope.yaml: no such file"):
        config_path("configs/nope.yaml")
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_text("own: 1\n")
    assert config_path(name) == name  # the user's own file of that name wins


def test_compare_default_stage_configs_resolve_outside_the_checkout(tmp_path, monkeypatch):
    """`compare` (and `extrapolate`, which runs it) checks its `--stage_configs` before training: the default
    `configs/{stage}/tiny.yaml` is found from any folder."""
    from plugformer.experiments import compare

    monkeypatch.chdir(tmp_path)
    seen = {}

    def stop(args, directory, options, seed):  # the first training run: the configs were found
        seen["ok"] = True
        raise SystemExit(0)

    monkeypatch.setattr(compare, "train_run", stop)
    with pytest.raises(SystemExit):
        compare.main(["--output_dir", str(tmp_path / "out"), "--grid", "position_scheme=rope,alibi", "--seeds", "0"])
    assert seen == {"ok": True}


def build_wheel(folder: Path) -> Path:
    """`pip wheel` of a copy of the source tree."""
    source = copy_source(folder)
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*command, "-w", str(folder / "wheels")], check=True, capture_output=True, timeout=300)
    return next((folder / "wheels").glob("plugformer-*.whl"))


def copy_source(folder: Path) -> Path:
    """A copy of the source tree to build from (a build writes build/ and *.egg-info beside the sources)."""
    source = folder / "source"
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "outputs", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"
    )
    shutil.copytree(ROOT, source, symlinks=True, ignore=ignore)
    return source


def test_the_sdist_holds_everything_the_tests_read(tmp_path):
    """The sdist ships tests/, so it ships what they read too: configs/, examples/, model_cards/, .ci/run and
    .ci/matrix.py (tests/README.md runs it)."""
    import tarfile

    from setuptools import build_meta

    source = copy_source(tmp_path)
    previous = Path.cwd()
    os.chdir(source)
    try:
        name = build_meta.build_sdist(str(tmp_path / "dist"))
    finally:
        os.chdir(previous)
    with tarfile.open(tmp_path / "dist" / name) as archive:
        packed = {member.split("/", 1)[1] for member in archive.getnames() if "/" in member}
    wanted = {
        path.relative_to(source).as_posix()
        for folder in ("configs", "examples", "model_cards", "tests")
        for path in (source / folder).rglob("*")
        if path.is_file() and ".hypothesis" not in path.parts
    } | {".ci/run", ".ci/matrix.py", "README.md"}
    # (tests/.hypothesis is hypothesis' local example database, made by a test run: a cache, not a source)
    assert wanted - packed == set()
    assert not [name for name in packed if ".hypothesis/" in name or "__pycache__" in name]  # caches, not sources


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_environment_runs_a_stage_from_another_folder(tmp_path):
    """The newcomer's route: build the wheel, install it in a new virtual environment (the heavy dependencies come
    from this environment through a .pth line, so nothing is downloaded), then from an empty folder run
    `plugformer --version`, `--help`, and `train pretrain --config configs/pretrain/tiny.yaml` (two steps)."""
    wheel = build_wheel(tmp_path)
    assert {
        "plugformer/configs/demo.yaml",
        "plugformer/configs/pretrain/tiny.yaml",
        "plugformer/csrc/additive.c",
        "plugformer/csrc/band.c",
        "plugformer/csrc/parallel.h",
    } <= set(zipfile.ZipFile(wheel).namelist())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # a path, not a site dir
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(venv / "bin" / "plugformer"), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )

    where = subprocess.check_output(
        [python, "-c", "import plugformer; print(plugformer.__file__)"], cwd=work, env=env, text=True
    )
    assert Path(where.strip()).is_relative_to(venv)
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("plugformer ")
    assert "commands:" in run("--help").stdout
    micro = [
        "--max_steps",
        "2",
        "--train_examples",
        "48",
        "--dev_examples",
        "8",
        "--hidden_size",
        "32",
        "--num_hidden_layers",
        "1",
        "--per_device_train_batch_size",
        "8",
        "--vocab_size",
        "300",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--output_dir",
        "pretrain",
    ]
    trained = run("train", "pretrain", "--config", "configs/pretrain/tiny.yaml", *micro)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (work / "pretrain" / "model.safetensors").is_file()
    # the README's accelerate form: the YAML the installed package prints, from a folder without any configs/
    accelerate_yaml = Path(run("accelerate-config", "cpu_2proc").stdout.strip())
    assert accelerate_yaml.is_relative_to(venv) and accelerate_yaml.is_file()
    launched = subprocess.run(
        [
            python,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(accelerate_yaml),
            "-m",
            "plugformer",
            "train",
            "pretrain",
            "--config",
            "configs/pretrain/tiny.yaml",
            *micro[:-1],
            "pretrain_2proc",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert json.loads((work / "pretrain_2proc" / "run_info.json").read_text())["world_size"] == 2
