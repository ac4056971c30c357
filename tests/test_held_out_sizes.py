"""Held-out sizes scale with your data: the shipped configs' `--dev_examples 200 --test_examples 200` are caps, each
carved split holding at most 10% of the distinct rows, so a 300-row chat or preference file trains with the README's
own commands, records the sizes it used, and `plugformer eval` scores the same test rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from own_data import pretrained_folder, train_on_file
from test_training import write_jsonl

from plugformer.cli import main as cli_main
from plugformer.data.identity import held_out_sizes, row_keys, split_digest
from plugformer.data.sources import load_stage_dataset
from plugformer.evaluation.held_out import rows_digest


# tiny overrides of the shipped configs: a step or two, no generation-heavy scoring; the held-out sizes are left
# to the configs (200 each), which a 300-row file cannot give unscaled
QUICK = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
         "--max_length", "64", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
         "--exact_match_examples", "0", "--pass_at_k_samples", "0", "--dataloader_pin_memory", "false"]  # fmt: skip


def chats(count: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"{i} + 1 = {i + 1}\n#### {i + 1}"},
            ]
        }
        for i in range(count)
    ]


def pairs(count: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} + 2?", "chosen": f"{i} + 2 = {i + 2}\n#### {i + 2}", "rejected": f"#### {i + 3}"}
        for i in range(count)
    ]


def test_held_out_sizes_are_a_tenth_of_the_distinct_rows_capped_by_the_flags():
    assert held_out_sizes(300, {"test": 200, "dev": 200}, 0.1) == {"test": 30, "dev": 30}
    assert held_out_sizes(5000, {"test": 200, "dev": 200}, 0.1) == {"test": 200, "dev": 200}
    assert held_out_sizes(10, {"test": 200, "dev": 200}, 0.1) == {"test": 1, "dev": 1}
    assert held_out_sizes(9, {"test": 200, "dev": 0}, 0.1) == {"test": 0, "dev": 0}
    assert held_out_sizes(300, {"test": 200, "dev": 200}, 1.0) == {"test": 200, "dev": 200}


def test_scaled_sizes_count_distinct_rows_and_refuse_only_what_cannot_be_carved(tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chats(100) + chats(100))  # 100 distinct rows, each twice
    splits = load_stage_dataset(
        "conversation", "json", data_files=[str(data)], sizes={"dev": 200, "test": 200}, held_out_fraction=0.1
    )
    assert (len(splits["test"]), len(splits["dev"])) == (10, 10)
    assert splits.identity["held_out_sizes"] == {
        "test": 10,
        "dev": 10,
        "caps": {"test": 200, "dev": 200},
        "fraction": 0.1,
        "distinct_rows": 100,
    }
    small = write_jsonl(tmp_path / "small.jsonl", chats(9))
    with pytest.raises(
        ValueError,
        match=r"9 rows left in train cannot give --test_examples 200 .* at least 10 "
        r"distinct rows, or --test_examples 0$",
    ):
        load_stage_dataset(
            "conversation", "json", data_files=[str(small)], sizes={"dev": 200, "test": 200}, held_out_fraction=0.1
        )
    splits = load_stage_dataset(
        "conversation", "json", data_files=[str(small)], sizes={"dev": 0, "test": 0}, held_out_fraction=0.1
    )
    assert set(splits) == {"train"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return pretrained_folder(tmp_path_factory, "sizes")


def stage(name: str, output: Path, parent: Path, data: Path, *extra: str) -> dict:
    """`plugformer train <name>` with its shipped tiny config, as the README gives it, on `data`."""
    train_on_file(name, output, parent, data, "--bf16", "false", *QUICK, *extra)
    return json.loads((output / "run_info.json").read_text())


def test_the_readme_commands_train_on_300_rows_and_eval_scores_the_rows_held_out(pretrained, tmp_path, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", chats(300))
    info = stage("sft", tmp_path / "sft", pretrained, chat)
    assert "[data] held out 30 test (--test_examples 200), 30 dev (--dev_examples 200) of 300 distinct rows" in (
        capsys.readouterr().out
    )
    record = info["data"]
    assert (record["test_examples"], record["dev_examples"]) == (30, 30)
    assert record["held_out"]["test"]["rows"] == record["held_out"]["dev"]["rows"] == 30
    assert record["held_out_sizes"]["caps"] == {"test": 200, "dev": 200}
    expected = load_stage_dataset("conversation", "json", data_files=[str(chat)], sizes={"dev": 30, "test": 30})
    assert record["held_out"]["test"]["sha256"] == split_digest(row_keys(expected["test"]))
    cli_main(["eval", "--model", str(tmp_path / "sft"), "--output", str(tmp_path / "eval.json")])
    scores = json.loads((tmp_path / "eval.json").read_text())
    assert scores["examples"] == 30 and scores["data_sha256"] == rows_digest(expected["test"])

    preferences = write_jsonl(tmp_path / "pairs.jsonl", pairs(300))
    # dev selection by exact match needs an `answer` column, which preference pairs lack
    info = stage("dpo", tmp_path / "dpo", tmp_path / "sft", preferences, "--selection_steps", "0")
    assert (info["data"]["test_examples"], info["data"]["dev_examples"]) == (30, 30)
    assert info["data"]["held_out"]["test"]["rows"] == 30


def test_held_out_fraction_one_keeps_the_counts_as_given_and_bad_values_are_refused(pretrained, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", chats(300))
    with pytest.raises(SystemExit) as caught:  # 200 + 200 of 300 rows leave none to train: refused in one line
        stage("sft", tmp_path / "all", pretrained, chat, "--held_out_fraction", "1")
    assert caught.value.code == 2
    for value in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            stage("sft", tmp_path / "bad", pretrained, chat, "--held_out_fraction", value)
