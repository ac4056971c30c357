"""The data a stage reads: its splits in the TRL format its record names, your data checked and named by content
(`data.user_data`), and the prompts with ground truth that dev selection and dev exact match score."""

from __future__ import annotations

from ..data.sources import load_stage_dataset
from ..data.validation import check_data_files, check_rows
from .stage_table import Stage


def stage_data(stage: Stage, script_args):
    """The splits of `stage` (its record), in the data format it names (`format_data`); what identifies your data
    (`sources.data_identity`) is kept on `script_args.data_identity` for `run_info.json`."""
    data = format_data(stage.data_format, script_args, f"stage {stage.name!r}")
    script_args.data_identity = getattr(data, "identity", None)
    return data


def evaluation_data(script_args):
    """Prompts with their ground truth, for dev selection and dev exact match (`format_data`); data whose ground
    truth is a worked `solution` (TRL's math datasets) gets its final answer as the `answer` (`with_answers`)."""
    return with_answers(format_data("prompt_answer", script_args, "stage 'evaluation'"))


def with_answers(data):
    """`data` with an `answer` column in every split, the final answer of its `solution` (`rewards.final_answer`:
    after the last `####`, else the last number) where it has none; the splits are replaced in place, so what
    identifies your data (`.identity`) stays."""
    from ..evaluation.rewards import final_answer

    for name, split in list(data.items()):
        if "answer" not in split.column_names and "solution" in split.column_names:
            data[name] = split.map(lambda row: {"answer": final_answer(row["solution"])})
    return data


def format_data(data_format: str, script_args, reader: str):
    """The splits of `data_format`; user data is checked first (files missing, empty, not UTF-8) and after loading
    (SFT's columns, null values in the columns the format needs, empty splits), each error naming the file or split
    and `reader`, what needs them."""
    if script_args.dataset_name is not None:
        check_data_files(script_args.dataset_name, script_args.data_files)
    data = load_stage_dataset(
        data_format,
        dataset_name=script_args.dataset_name,
        dataset_config=script_args.dataset_config,
        data_files=script_args.data_files,
        sizes=script_args.sizes(),
        seed=script_args.dataset_seed,
        direct_fraction=script_args.direct_answer_fraction,
        rename_columns=script_args.rename_columns,
        keep_duplicates=script_args.keep_duplicates,
        data_cache_dir=getattr(script_args, "data_cache_dir", None),
        held_out_fraction=getattr(script_args, "held_out_fraction", None),
    )
    if script_args.dataset_name is not None:
        source = f"--dataset_name {script_args.dataset_name}" + (
            f" --data_files {' '.join(script_args.data_files)}" if script_args.data_files else ""
        )
        check_rows(data_format, data, source, reader)
    return data
