"""Command-line arguments as dataclasses: dataclass defaults < YAML file (`--config`) < command line.

Unknown keys, in the YAML or on the command line, are errors that name the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from transformers import HfArgumentParser

from .yaml_text import MAX_YAML_BYTES, read_yaml  # noqa: F401 (the YAML reader lives there; importable from here)


T = TypeVar("T")


# the shipped YAMLs: package data (src/plugformer/configs links to the repository's configs/; a wheel holds a copy)
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config_path(path: str | Path, flag: str = "--config") -> str:
    """`path` if it exists; else a relative `configs/...` path is looked up among the shipped YAMLs, which travel
    inside the package (so `--config configs/demo.yaml` works from any directory, in a clone or after a wheel
    install); else a FileNotFoundError naming `flag` (the option that gave the path: `--stage_configs` for a
    template filled in) and saying where it looked; a `ValueError` naming `flag` for a folder or a file this user
    cannot read.

    >>> config_path("configs/demo.yaml").endswith("demo.yaml")
    True
    """
    given = Path(path)
    if given.is_dir():
        raise ValueError(f"{flag} {path}: a folder, not a YAML file")
    if given.is_file() and not os.access(given, os.R_OK):
        raise ValueError(f"{flag} {path}: not readable by this user; give a readable YAML file")
    if given.is_file():
        return str(path)
    parts = given.parts
    shipped = SHIPPED_CONFIGS.joinpath(*parts[1:]) if len(parts) > 1 and parts[0] == "configs" else None
    if shipped is not None and shipped.is_file():
        return str(shipped)
    where = f"{Path.cwd()}" + (f" or among the shipped configs in {SHIPPED_CONFIGS}" if shipped else "")
    raise FileNotFoundError(
        f"{flag} {path}: no such file (looked in {where}); the shipped YAMLs are named "
        "configs/<stage>/<name>.yaml and configs/demo.yaml (accelerate's: `plugformer accelerate-config`)"
    )


def stage_config(template: str, stage: str) -> str:
    """`template` with `{stage}` filled in (`--stage_configs configs/{stage}/tiny.yaml`), or a `ValueError` naming
    the flag for any other placeholder (`{stgae}`, `{0}`, an unmatched brace), which `str.format` raised as a bare
    `KeyError`/`IndexError` traceback.

    >>> stage_config("configs/{stage}/tiny.yaml", "sft")
    'configs/sft/tiny.yaml'
    """
    try:
        return template.format(stage=stage)
    except (KeyError, IndexError, ValueError, AttributeError) as error:
        raise ValueError(
            f"--stage_configs {template!r}: {type(error).__name__} {error} in its placeholders; the "
            "only placeholder is {stage} (e.g. configs/{stage}/tiny.yaml)"
        ) from None


def load_yaml(path: str | Path, allowed: set[str], classes: tuple[type, ...] = ()) -> dict:
    """The mapping in `path`, refusing keys outside `allowed` and values whose type the dataclass fields of
    `classes` do not take (`check_yaml_types`)."""
    values = read_yaml(path) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(values).__name__}")
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    check_yaml_types(path, values, classes)
    return values


def check_yaml_types(
    path: str | Path, values: dict, classes: tuple[type, ...], aliases: dict[str, str] | None = None
) -> None:
    """Raises `ValueError` naming the file, key, value and expected type for a YAML value that the field's type does
    not take. argparse converts only string defaults, with the field's `type`: `max_steps: "10"` became 10,
    `bf16: "yes"` True, `learning_rate: "abc"` an argparse usage dump naming no file, while a string for a list
    (`stages: grpo`, `data_files: a.jsonl`) stayed a string and was iterated letter by letter, and `num_generations:
    2.5` or `save_strategy: no` (YAML 1.1 reads `no` as false) reached transformers/TRL unchecked. A YAML value is
    typed: it must be the field's type (an int where a float is expected is fine); command-line strings are
    converted as before. `aliases` ({key: field}) are keys checked as the field they stand for.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class A:
    ...     steps: int = 1
    >>> check_yaml_types("a.yaml", {"steps": "10"}, (A,))
    Traceback (most recent call last):
    ...
    ValueError: --config a.yaml: steps: '10' is a YAML str; expected int
    """
    hints = {}
    for cls in classes:
        try:
            resolved = typing.get_type_hints(cls)
        except Exception:  # a forward reference that does not resolve: that class's fields go unchecked
            resolved = {}
        hints.update({f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.name in resolved})
    hints.update({key: hints[field] for key, field in (aliases or {}).items() if field in hints and key not in hints})
    for key, value in values.items():
        if key in hints and not _matches(value, hints[key]):
            hint = " (YAML reads unquoted yes/no/on/off as booleans: quote it)" if isinstance(value, bool) else ""
            raise ValueError(
                f"--config {path}: {key}: {value!r} is a YAML {_yaml_type(value)}; expected "
                f"{_type_name(hints[key])}{hint}"
            )


def _origin(hint) -> tuple[Any, tuple]:
    origin = typing.get_origin(hint)
    return (typing.Union if origin is types.UnionType else origin), typing.get_args(hint)


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a field's type hint; a hint not understood here accepts anything."""
    origin, args = _origin(hint)
    if hint is Any:
        return True
    if origin is typing.Union:
        return any(_matches(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if origin in (list, tuple, set):
        return isinstance(value, list) and all(_matches(item, args[0]) for item in value) if args else True
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return isinstance(value, str)  # an enum's value is given by name; transformers checks the name
    return True


def _type_name(hint: Any) -> str:
    origin, args = _origin(hint)
    if origin is typing.Union:
        names = dict.fromkeys(_type_name(arg) for arg in args)  # enums and str both read "str"
        return " or ".join(names)
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if hint is type(None):
        return "null"
    if origin in (list, tuple, set):
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "str"
    return getattr(hint, "__name__", str(hint))


def _yaml_type(value: Any) -> str:
    return {type(None): "null", list: "list", dict: "mapping"}.get(type(value), type(value).__name__)


# the rule every command follows, shown at the end of its --help (`merge_repeated_flags`)
REPEATED_FLAGS_RULE = (
    "An option that takes a list accumulates when repeated (`--grid a=1,2 --grid b=x` is `--grid a=1,2 b=x`); any "
    "other option given twice is refused. Options are never abbreviated (`--max_step` is not `--max_steps`)."
)
# the stage commands: the same rule; a key of the --config YAML given again on the command line is no repeat
STAGE_FLAGS_RULE = (
    "An option that takes a list accumulates when repeated (`--data_files a --data_files b` is `--data_files a b`); "
    "any other option given twice is refused. The command line wins over the --config YAML. Options are never "
    "abbreviated (`--max_step` is not `--max_steps`)."
)


def override_flags(*parts: list[str]) -> list[str]:
    """The command lines `parts` joined, each flag once: a flag of a later part replaces the same flag of an earlier
    part, with its values (the tokens up to the next `--flag`), where the earlier one stood. For the command lines
    plugformer composes from a base and overrides (compare's runs, tests), which the stage commands would refuse
    as a repeat (`STAGE_FLAGS_RULE`). A flag repeated within one part is kept twice: that is a repeat to refuse.
    `--name=value` and `--name value`, `--max-steps` and `--max_steps` are the same flag.

    >>> override_flags(["--max_steps", "3", "--data_files", "a", "b"], ["--max-steps=9", "--data_files", "c"])
    ['--max-steps=9', '--data_files', 'c']
    >>> override_flags(["--seed", "1"], ["--seed", "2"], ["--seed", "3"])
    ['--seed', '3']
    """
    joined: list[list[str]] = []  # one entry per flag (its token and values), or per stray token
    owner: dict[str, int] = {}  # flag -> index in `joined` of its latest occurrence from an earlier part
    for part in parts:
        seen: dict[str, int] = {}
        for entry in _flag_entries(list(part)):
            name = _flag_name(entry[0])
            if name is not None and name in owner:
                seen[name] = owner.pop(name)
                joined[seen[name]] = entry  # replaces the earlier part's occurrence in place
            else:
                joined.append(entry)
                if name is not None:
                    seen[name] = len(joined) - 1
        owner.update(seen)
    return [token for entry in joined for token in entry]


def _flag_entries(argv: list[str]) -> list[list[str]]:
    """`argv` cut into `[--flag, values...]` entries (a token before any flag, and everything after `--`, alone)."""
    entries: list[list[str]] = []
    for index, token in enumerate(argv):
        if token == "--":
            entries += [[item] for item in argv[index:]]
            break
        if token.startswith("--") or not entries or _flag_name(entries[-1][0]) is None:
            entries.append([token])
        else:
            entries[-1].append(token)
    return entries


def _flag_name(token: str) -> str | None:
    """`--max-steps=9` -> `max_steps`; None for a token that is not a flag."""
    if not token.startswith("--") or token == "--":
        return None
    return token[2:].partition("=")[0].replace("-", "_")


def merge_repeated_flags(parser, argv: list[str], prog: str, extra: tuple[str, ...] = ("--config",)) -> list[str]:
    """`argv` with the values of a repeated list option (`nargs` `+` or `*`) gathered after its first occurrence;
    raises `ValueError` naming both occurrences when any other option (or one of `extra`, options the parser reads
    itself) is given twice. argparse keeps only the last occurrence: `--grid attention_score=a,b --grid
    position_scheme=rope` dropped the attention-score axis, `--max_steps 1 ... --max_steps 9` trained 9.

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--grid", nargs="+"); _ = parser.add_argument("--seed")
    >>> merge_repeated_flags(parser, ["--grid", "a=1", "--seed", "3", "--grid=b=2", "c=3"], "demo")
    ['--grid', 'a=1', 'b=2', 'c=3', '--seed', '3']
    >>> merge_repeated_flags(parser, ["--seed", "3", "--seed=4"], "demo")
    Traceback (most recent call last):
    ...
    ValueError: demo: --seed given twice (--seed 3, then --seed=4); give it once
    """
    actions = {name: action for action in parser._actions for name in action.option_strings}
    merged: list = []  # strings, and for a list option the list of its values (joined below)
    first: dict[str, tuple[str, list | None]] = {}  # dest -> (how it was first written, its values if a list)
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            merged += argv[index:]
            break
        name, equals, inline = token.partition("=")
        action = actions.get(name) if token.startswith("--") else None
        if action is None and name not in extra:
            merged.append(token)
            index += 1
            continue
        dest = action.dest if action is not None else name
        if isinstance(action, (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)):
            merged.append(token)  # argparse accumulates these itself (`convert --set a=1 --set b=2`)
            index += 1
            continue
        if action is not None and action.nargs in ("+", "*"):
            end = index + 1
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
            values = ([inline] if equals else []) + argv[index + 1 : end]
            if dest in first:
                first[dest][1].extend(values)
            else:
                first[dest] = (name, values)
                merged += [name, values]
            index = end
            continue
        written = _as_written(argv, index, action)
        if dest in first:
            raise ValueError(f"{prog}: {name} given twice ({first[dest][0]}, then {written}); give it once")
        first[dest] = (written, None)
        merged.append(token)
        index += 1
    return [item for entry in merged for item in (entry if isinstance(entry, list) else [entry])]


def _as_written(argv: list[str], index: int, action) -> str:
    """The option at `argv[index]` with its value, as the user wrote it (for a message)."""
    token = argv[index]
    following = argv[index + 1] if index + 1 < len(argv) else "--"
    if "=" in token or following.startswith("--") or (action is not None and action.nargs == 0):
        return token
    return f"{token} {following}"


# numeric options with a range, by field name, wherever they appear (a command's own, TrainingArguments, TRL's):
# name -> (lowest, highest, whether the lowest is excluded); None: unbounded
NUMBER_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "learning_rate": (0.0, None, False),
    "max_grad_norm": (0.0, None, False),  # 0 turns clipping off (transformers); NaN turned it off silently
    "weight_decay": (0.0, None, False),
    "adam_epsilon": (0.0, None, False),
    "adam_beta1": (0.0, 1.0, False),
    "adam_beta2": (0.0, 1.0, False),
    "warmup_ratio": (0.0, 1.0, False),
    "factors": (0.0, None, True),
    "temperature": (0.0, None, True),
    "dpi": (0.0, None, True),  # matplotlib's "dpi must be positive" named no flag
    "seed": (0, 2**32 - 1, False),  # numpy's "Seed must be between 0 and 2**32 - 1" (set_seed) named no flag
    "seeds": (0, 2**32 - 1, False),  # compare's and extrapolate's, one run each
}


def check_numbers(*arguments) -> None:
    """Raises `ValueError` naming the flag for a numeric option of the dataclass instances (or argparse namespaces)
    `arguments` that is not finite (`--learning_rate inf` trained to an all-NaN model and exited 0, `--max_grad_norm
    nan` turned clipping off), or outside its range in `NUMBER_RANGES`; lists are checked item by item. Every command
    calls it on what it parsed, before any work.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class A:
    ...     learning_rate: float = float("inf")
    >>> check_numbers(A())
    Traceback (most recent call last):
    ...
    ValueError: --learning_rate inf: expected a finite number
    """
    for instance in arguments:
        if isinstance(instance, argparse.Namespace):  # an argparse command's options (plot)
            values = vars(instance)
        elif dataclasses.is_dataclass(instance):
            values = {field.name: getattr(instance, field.name, None) for field in dataclasses.fields(instance)}
        else:
            continue
        for name, value in values.items():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, bool) or not isinstance(item, (int, float)):
                    continue
                if not math.isfinite(item):
                    raise ValueError(f"--{name} {item!r}: expected a finite number")
                low, high, open_low = NUMBER_RANGES.get(name, (None, None, False))
                if (low is not None and (item < low or (open_low and item == low))) or (
                    high is not None and item > high
                ):
                    shown = [f"{bound:g}" if isinstance(bound, float) else str(bound) for bound in (low, high)]
                    bounds = (
                        f"{'>' if open_low else '>='} {shown[0]}" if high is None else f"in [{shown[0]}, {shown[1]}]"
                    )
                    raise ValueError(f"--{name} {item!r}: expected a value {bounds}")


def option_values(argv: list[str]) -> list[tuple[str, str]]:
    """(`--option`, value) of each option given a value on the command line (`--x 1` or `--x=1`).

    >>> option_values(["--a", "1", "--b=x", "--flag", "--c", "-1"])
    [('--a', '1'), ('--b', 'x'), ('--c', '-1')]
    """
    pairs = []
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, equals, value = token.partition("=")
        if equals:
            pairs.append((name, value))
        elif index + 1 < len(argv) and not (argv[index + 1].startswith("--") and len(argv[index + 1]) > 2):
            pairs.append((name, argv[index + 1]))
    return pairs


def naming_the_option(error: Exception, argv: list[str]) -> ValueError | None:
    """`error`, raised by a library while it built its config from `argv` (transformers' or TRL's `__post_init__`:
    "invalid literal for int() with base 10: ''", "You provided -1", an `OverflowError` for `inf`), as a `ValueError`
    that names the option the message is about: the one given a non-finite number for an `OverflowError`, else the
    one whose value the message quotes. None when the message names a given option already, or no single one fits.

    >>> naming_the_option(ValueError("GRPO needs 2 generations. You provided -1."), ["--num_generations", "-1"])
    ValueError('--num_generations -1: GRPO needs 2 generations. You provided -1.')
    """
    given = option_values(argv)
    text = " ".join(str(error).split())
    if any(
        re.search(rf"{re.escape(name)}\b", text) or re.search(rf"\b{re.escape(name[2:])}\b", text) for name, _ in given
    ):
        return None
    if isinstance(error, OverflowError):
        fits = [
            (name, value) for name, value in given if value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan")
        ]
    else:
        fits = [(name, value) for name, value in given if quotes(text, value)]
    if len(fits) != 1:
        return None
    name, value = fits[0]
    return ValueError(f"{name} {value if value and value.isprintable() else repr(value)}: {text}")


def quotes(text: str, value: str) -> bool:
    """Whether the message `text` quotes `value`, as given or as Python's `repr` writes it (a control character
    appears escaped, `'\\x01'`); an empty value as `''`."""
    if not value:
        return "''" in text
    return any(re.search(rf"(?<![\w.+-]){re.escape(form)}(?!\w|\.\d)", text) for form in {value, repr(value)[1:-1]})


def parse_arguments(cls: type[T], argv: list[str], prog: str) -> T:
    """Parses `argv` into `cls`, with `--config file.yaml` supplying defaults that the command line overrides.
    A repeated list option accumulates, any other repeated option is refused (`merge_repeated_flags`)."""
    # never abbreviated: `--layer` must not silently mean `--layers`
    parser = HfArgumentParser(cls, prog=prog, allow_abbrev=False, epilog=REPEATED_FLAGS_RULE)
    parser.add_argument("--config", type=str, default=None, help="YAML file of option: value pairs")
    argv = merge_repeated_flags(parser, list(argv), prog)
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        parser.set_defaults(**load_yaml(config_path(known.config), {f.name for f in dataclasses.fields(cls)}, (cls,)))
    # returns (instance, namespace holding --config, unparsed strings)
    outputs = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if outputs[-1]:
        raise ValueError(f"{prog}: unknown arguments {outputs[-1]}")
    check_numbers(outputs[0])
    return outputs[0]
