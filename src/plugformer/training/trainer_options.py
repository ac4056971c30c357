"""The `TrainingArguments` options transformers 5.23.0 renamed (`gradient_checkpointing`/`_kwargs` to
`activation_checkpointing`/`_kwargs`; 5.24 keeps the old fields as deprecated aliases, 5.19 knows only them). The
shipped configs and the CLI use the new names; either name works on every supported release. These shims are the
trainer's: they live here, outside the model files a checkpoint carries (the model's own shims are `compat.py`'s).
"""

from __future__ import annotations

import dataclasses
import functools


__all__ = [
    "RENAMED_TRAINER_OPTIONS",
    "accept_renamed_trainer_options",
    "renamed_trainer_flags",
    "renamed_trainer_options",
    "trainer_option_aliases",
]

# the trainer options 5.23.0 renamed: {new name: the name before}
RENAMED_TRAINER_OPTIONS = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


@functools.cache
def trainer_option_aliases() -> dict[str, str]:
    """{name: the field the installed trainer reads} for the renamed trainer options: before 5.23.0 the new names
    stand for the old fields (which are all there is); from 5.23.0 the old names, deprecated aliases there, for the
    new fields, so that the command line overrides a YAML whichever name each gives (transformers itself lets a
    set new name win over the old one: `gradient_checkpointing: true` on the command line was silently ignored under
    a YAML's `activation_checkpointing: false`)."""
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    if set(RENAMED_TRAINER_OPTIONS) <= fields:
        return {old: new for new, old in RENAMED_TRAINER_OPTIONS.items()}
    return {new: old for new, old in RENAMED_TRAINER_OPTIONS.items() if old in fields}


def renamed_trainer_options(values: dict) -> dict:
    """`values` (a YAML's keys) with the renamed trainer options under the names the installed trainer reads
    (`trainer_option_aliases`); where a YAML gives both names the new one wins, as transformers 5.24 resolves them.
    `values` itself where it names none of them."""
    aliases = trainer_option_aliases()
    if not any(name in values for name in aliases):
        return values
    renamed = {key: value for key, value in values.items() if key not in aliases}
    for new, old in RENAMED_TRAINER_OPTIONS.items():
        given = new if new in values else old if old in values else None
        if given is not None:
            renamed[aliases.get(given, given)] = values[given]
    return renamed


def renamed_trainer_flags(argv: list[str]) -> list[str]:
    """`argv` with the renamed trainer options' flags (`--name value`, `--name=value`, `--name-with-dashes`, and
    `--no_gradient_checkpointing` from 5.23.0, where TRL's default of true gives it) under the names the installed
    trainer reads; both names on one command line are one option given twice, which the stage commands refuse."""
    aliases = trainer_option_aliases()
    flags = {f"--{spelling}": field for name, field in aliases.items() for spelling in (name, name.replace("_", "-"))}
    negations = {
        f"--no{sep}{old.replace('_', sep)}": aliases[old]
        for old in RENAMED_TRAINER_OPTIONS.values()
        if old in aliases
        for sep in "_-"
    }
    renamed = []
    for token in argv:
        flag, equals, value = token.partition("=")
        if flag in flags:
            renamed.append(f"--{flags[flag]}{equals}{value}")
        elif token in negations:
            renamed += [f"--{negations[token]}", "false"]
        else:
            renamed.append(token)
    return renamed


def accept_renamed_trainer_options(parser) -> None:
    """Lists the new trainer option names in `parser`'s `--help` (an `HfArgumentParser` over a `TrainingArguments`
    class, e.g. `trl.TrlParser`) as aliases of the old options where the installed release has only those (before
    5.23.0), and makes them parse there. From 5.23.0 transformers lists both names itself."""
    aliases = {new: old for new, old in trainer_option_aliases().items() if new in RENAMED_TRAINER_OPTIONS}
    for action in list(parser._actions):
        new = next((name for name, old in aliases.items() if action.dest == old), None)
        if new is None or f"--{action.dest}" not in action.option_strings:  # not e.g. `--no_gradient_checkpointing`
            continue
        for option in (f"--{new}", f"--{new.replace('_', '-')}"):
            if option not in parser._option_string_actions:
                action.option_strings.append(option)
                parser._option_string_actions[option] = action
        if action.help:
            action.help += f" (`--{new}`: its name from transformers 5.23)"
