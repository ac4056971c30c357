"""`plugformer accelerate-config [NAME]`: the shipped accelerate YAMLs by name, from any directory.

`accelerate launch --config_file PATH` reads PATH itself, relative to the working directory, so the repository's
`configs/accelerate/cpu_2proc.yaml` works only from a checkout's root; the copies inside the installed package have
no stable path (a wheel puts them in site-packages). This command prints that path, for the shell to substitute:

    accelerate launch --config_file "$(plugformer accelerate-config cpu_2proc)" -m plugformer train sft ...
"""

from __future__ import annotations

from pathlib import Path

from .arguments import SHIPPED_CONFIGS


ACCELERATE_CONFIGS = SHIPPED_CONFIGS / "accelerate"
USAGE = "usage: plugformer accelerate-config [NAME]  (no NAME: list the shipped accelerate YAMLs)"


def accelerate_config_names() -> list[str]:
    """The names of the shipped accelerate YAMLs (`cpu_2proc`, `fsdp2`, ...), sorted."""
    return sorted(path.stem for path in ACCELERATE_CONFIGS.glob("*.yaml") if path.is_file())


def accelerate_config(name: str) -> Path:
    """The absolute path of the shipped accelerate YAML `name` (with or without `.yaml`).

    Args:
        name (`str`): One of `accelerate_config_names()`, e.g. `"cpu_2proc"`.

    Raises:
        `ValueError`: `name` is not a shipped YAML; the message lists the names.

    >>> accelerate_config("cpu_2proc").name
    'cpu_2proc.yaml'
    """
    stem = name.removesuffix(".yaml")
    names = accelerate_config_names()
    # a bare name only: "../sft/tiny" must not reach another folder's YAML
    if stem not in names:
        raise ValueError(f"accelerate config {name!r}: no such shipped YAML; choose one of {', '.join(names)}")
    return (ACCELERATE_CONFIGS / f"{stem}.yaml").resolve()


def launch_hint(name: str) -> str:
    """The `accelerate launch` form that reads the shipped YAML `name` from any directory (for refusal messages).

    >>> launch_hint("cpu_2proc")
    'accelerate launch --config_file "$(plugformer accelerate-config cpu_2proc)" -m plugformer train ...'
    """
    return f'accelerate launch --config_file "$(plugformer accelerate-config {name})" -m plugformer train ...'


def main(argv: list[str]) -> None:
    """Prints the path of the shipped accelerate YAML `argv[0]`, or, without a name, each name and its path."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return
    if len(argv) > 1:
        raise ValueError(f"accelerate-config takes one NAME, got {len(argv)} arguments {argv}; {USAGE}")
    if argv:
        print(accelerate_config(argv[0]))
        return
    width = max(map(len, accelerate_config_names()), default=0) + 2
    for name in accelerate_config_names():
        print(f"{name:{width}s}{accelerate_config(name)}")
