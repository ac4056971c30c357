"""The grid of `plugformer compare`: `--grid` entries into variants (their cartesian product), and `--grid` / `--set`
values into each stage's command-line options (`route`), refusing the options compare sets per run itself."""

from __future__ import annotations

import dataclasses
import itertools

from ..runtime.arguments import override_flags


def parse_grid(entries: list[str]) -> dict[str, list[str]]:
    """`["a=1,2", "b=x"]` -> `{"a": ["1", "2"], "b": ["x"]}`.

    >>> parse_grid(["attention_score=dot,additive", "sft.learning_rate=1e-3"])
    {'attention_score': ['dot', 'additive'], 'sft.learning_rate': ['1e-3']}
    """
    grid = {}
    for entry in entries:
        key, separator, values = entry.partition("=")
        choices = [v.strip() for v in values.split(",") if v.strip()]
        if not separator or not key.strip() or not choices:
            raise ValueError(f"grid entry {entry!r}: expected KEY=V1,V2,...")
        if key.strip() in grid:
            raise ValueError(f"grid entry {entry!r}: {key.strip()!r} appears twice")
        grid[key.strip()] = choices
    return grid


def variants(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """The cartesian product of the grid, in the order given."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def variant_name(variant: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in variant.items()) or "baseline"


def stage_options(stage: str) -> set[str]:
    """Every option `plugformer train <stage>` accepts (either name of a renamed trainer option)."""
    from trl import ModelConfig

    from ..training import STAGES
    from ..training.trainer_options import trainer_option_aliases

    entry = STAGES[stage]
    classes = (entry.script_arguments, ModelConfig, entry.config_type())
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return names | {new for new, old in trainer_option_aliases().items() if old in names}


def route(settings: dict[str, str], stages: list[str]) -> dict[str, list[str]]:
    """Command-line options per stage for `settings` (grid values and `--set` values), each flag once: a key that
    names its stage (`sft.learning_rate`) wins there over the same key for every stage (`learning_rate`).
    `PlugformerConfig` fields go into the `config_overrides` of the stage that builds the model (the first without
    a parent that takes them: pretrain, seq2seq)."""
    from ..configuration import PlugformerConfig
    from ..training import STAGES

    config_fields = {f.name for f in dataclasses.fields(PlugformerConfig)}
    unknown = [stage for stage in stages if stage not in STAGES]  # STAGES[''] was a KeyError traceback
    if unknown:
        raise ValueError(f"--stages {' '.join(map(str, stages))}: unknown stage {unknown[0]!r}; stages: {list(STAGES)}")
    options = {stage: stage_options(stage) for stage in stages}
    # a stage that builds a PlugformerConfig (pretrain, seq2seq); nli builds a decomposable model, with flags of its own
    builder = next(
        (s for s in stages if s in STAGES and STAGES[s].parent is None and "config_overrides" in options[s]), None
    )
    argv = {stage: [] for stage in stages}
    named = {stage: [] for stage in stages}  # the options of keys that name their stage, applied over `argv`
    config_overrides = []
    for key, value in settings.items():
        stage, _, name = key.rpartition(".")
        targets = [stage] if stage else [s for s in stages if name in options[s]]
        if stage and (stage not in stages or name not in options[stage]):
            raise ValueError(f"{key}={value}: stage {stage!r} is not in stages={stages} or has no option {name!r}")
        if name == "config_overrides" and builder is not None and stage in ("", builder):
            # merged with the PlugformerConfig fields routed below: a second --config_overrides would replace the first
            config_overrides += [item.strip() for item in value.split(",") if item.strip()]
        elif targets:
            for target in targets:
                (named if stage else argv)[target] += [f"--{name}", value]
        elif name in config_fields and builder is not None:
            config_overrides.append(f"{name}={value}")
        else:
            raise ValueError(
                f"{key}={value}: no stage in {stages} has an option {name!r}, and it is not a "
                "PlugformerConfig field set at pretraining"
            )
    argv = {stage: override_flags(argv[stage], named[stage]) for stage in stages}
    if config_overrides:
        fields = [item.partition("=")[0].strip() for item in config_overrides]
        twice = sorted({field for field in fields if fields.count(field) > 1})
        if twice:
            raise ValueError(
                f"config_overrides {','.join(config_overrides)}: {twice} set more than once (a grid key "
                "and --set config_overrides, or twice); set each PlugformerConfig field once"
            )
        argv[builder] += ["--config_overrides", ",".join(config_overrides)]
    return argv


def parse_settings(entries: list[str]) -> dict[str, str]:
    """{KEY: VALUE} of `--set` entries; a key given twice is refused (the last one won silently)."""
    settings = {}
    for entry in entries:
        key, separator, value = entry.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"--set {entry!r}: expected KEY=VALUE")
        if key.strip() in settings:
            raise ValueError(
                f"--set {key.strip()} given twice (--set {key.strip()}={settings[key.strip()]}, then "
                f"--set {entry}); give it once"
            )
        settings[key.strip()] = value.strip()
    return settings


# Options that `compare` itself sets on every stage of every run (`train_run`). Set again by `--set` or a grid
# key, they would come after compare's own and win: every seed would then be one run (`--seed 7` after each
# `--seed N`, a spread of 0 and a "significant" p-value), or every run would share one folder.
CONTROLLED = {
    "seed": "--seeds",
    "output_dir": "--output_dir (runs live in <output_dir>/runs/<variant>-<hash>/seed<N>/<stage>)",
    "dataset_seed": "--dataset_seed (the same seed also picks the dev and test examples scored)",
    "model_name_or_path": "--stages (each stage starts from its parent's folder in the same run)",
    "reward_model_path": "--stages (rlhf uses the run's own reward stage)",
    "config": "--stage_configs",
    "resume_from_checkpoint": "--rerun false (an interrupted stage resumes from its newest checkpoint by itself)",
    "overwrite_output_dir": "--rerun true",
    # the corpus: the runs train on it and compare scores its held-out documents, so both read compare's own options
    "dataset_name": "compare's --dataset_name (with --data_files, --dataset_config, --streaming, --data_cache_dir)",
    "dataset_config": "compare's --dataset_config",
    "data_files": "compare's --data_files",
    "streaming": "compare's --streaming",
    "data_cache_dir": "compare's --data_cache_dir",
    "rename_columns": "compare's --rename_columns (classify's, nli's, seq2seq's own: --set <stage>.rename_columns)",
}
# with your corpus, the documents pretraining holds out are the ones compare scores: one size for both
HELD_OUT = {"dev_examples": "--dev_examples", "test_examples": "--test_examples"}


# the data of a stage with a task of its own (a classifier's labelled text, a seq2seq stage's pairs), named for its
# stage in --set (`classify.data_files=reviews.csv`): compare scores the split that stage's runs held out of it (their
# run_info.json), the same rows for every variant and seed
LABELLED_DATA = ("dataset_name", "dataset_config", "data_files", "rename_columns")
OWN_DATA_FORMATS = ("classification", "sentence_pair", "source_target")


def refuse_controlled(settings: dict[str, str], source: str) -> None:
    """Raises `ValueError` for a setting of an option that `compare` sets per run (see `CONTROLLED`), except a
    classification or seq2seq stage's data set for every run (`LABELLED_DATA`, in `--set` only: varied by the grid,
    the variants would be scored on different rows)."""
    from ..training import STAGES

    for key, value in settings.items():
        stage, _, name = key.rpartition(".")
        labelled = stage in STAGES and STAGES[stage].data_format in OWN_DATA_FORMATS and name in LABELLED_DATA
        if labelled and source == "--set":
            continue
        if labelled:
            raise ValueError(
                f"{source} {key}={value}: variants scored on different data cannot be paired; set "
                f"{stage}'s data for every run with --set {key}=..."
            )
        if name in CONTROLLED:
            raise ValueError(
                f"{source} {key}={value}: compare sets {name!r} itself for every run; use {CONTROLLED[name]} instead"
            )
