"""Command-line arguments as dataclasses: dataclass defaults < YAML file (`--config`) < command line.

Unknown keys, in the YAML or on the command line, are errors that name the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

import yaml
from transformers import HfArgumentParser


T = TypeVar("T")


# the source checkout this package runs from (a clone or an editable install): where the shipped configs/ live
CHECKOUT = Path(__file__).resolve().parents[2]


def config_path(path: str | Path) -> str:
    """`path` if it exists; a relative path that does not is looked up in the checkout's own folder (so
    `--config configs/demo.yaml` works from any directory); else a FileNotFoundError saying where it looked.

    >>> config_path("configs/demo.yaml").endswith("demo.yaml")
    True
    """
    given = Path(path)
    if given.is_file():
        return str(path)
    shipped = CHECKOUT / given
    if not given.is_absolute() and shipped.is_file() and (CHECKOUT / "configs").is_dir():
        return str(shipped)
    where = f"{Path.cwd()}" + ("" if given.is_absolute() else f" or {CHECKOUT}")
    raise FileNotFoundError(f"--config {path}: no such file (looked in {where}); the shipped YAMLs are in the "
                            "repository's configs/ folder")  # fmt: skip


def load_yaml(path: str | Path, allowed: set[str]) -> dict:
    """The mapping in `path`, refusing keys outside `allowed`."""
    with open(path, encoding="utf-8") as handle:
        values = yaml.safe_load(handle) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    return values


def parse_arguments(cls: type[T], argv: list[str], prog: str) -> T:
    """Parses `argv` into `cls`, with `--config file.yaml` supplying defaults that the command line overrides."""
    parser = HfArgumentParser(cls, prog=prog, allow_abbrev=False)  # `--layer` must not silently mean `--layers`
    parser.add_argument("--config", type=str, default=None, help="YAML file of option: value pairs")
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        parser.set_defaults(**load_yaml(config_path(known.config), {f.name for f in dataclasses.fields(cls)}))
    # returns (instance, namespace holding --config, unparsed strings)
    outputs = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if outputs[-1]:
        raise ValueError(f"{prog}: unknown arguments {outputs[-1]}")
    return outputs[0]
