"""The embedded tasks (`plugformer.data.tasks`): every registered task's rows hold its columns and keep its splits
apart, the registry refuses what would make a format ambiguous, and a task registered in one place (here, in a
test) is read by the data loader, a stage, `plugformer eval`, `plugformer compare` and the model card."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest
import torch

from plugformer.data.sources import load_stage_dataset
from plugformer.data.splits import SPLITS, split_of_key
from plugformer.data.tasks import TASKS, EmbeddedTask, register_task
from plugformer.training.cards import StageCard


@pytest.fixture
def task_table(monkeypatch):
    """The task table, restored after the test: tasks registered in a test stay in it."""
    monkeypatch.setattr(TASKS, "_table", dict(TASKS._table))
    return TASKS


def parity_rows(count: int, split: str, seed: int = 0, direct_fraction: float = 0.0) -> list[dict]:
    """Three digits and whether their sum is odd; a row's split is a hash of its digits."""
    rng = random.Random(f"parity|{seed}|{split}")
    rows = []
    while len(rows) < count:
        digits = " ".join(str(rng.randrange(10)) for _ in range(3))
        if split_of_key(digits) == split:
            rows.append({"text": digits, "label": "odd" if sum(map(int, digits.split())) % 2 else "even"})
    return rows


PARITY = EmbeddedTask(
    name="parity",
    formats={"parity": parity_rows},
    columns={"parity": ("text", "label")},
    split_by="digits",
    scored_format="parity",
    metric="accuracy",
    scorer="classification",
    dataset_type="plugformer-parity",
    dataset_name="plugformer embedded parity",
    description='three digits, labelled by the parity of their sum ("3 8 1" -> even',
    held_out="The figures hold for the held-out split, whose digits never occur in training.",
)


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_generates_its_columns_deterministically_with_disjoint_splits(name):
    task = TASKS[name]
    for data_format, columns in task.columns.items():
        rows = {split: task.rows(data_format, 12, split, seed=3) for split in SPLITS}
        assert all(tuple(row) == columns for split in SPLITS for row in rows[split]), data_format
        assert rows["dev"] == task.rows(data_format, 12, "dev", seed=3)
        assert load_stage_dataset(data_format, sizes={"dev": 12}, seed=3)["dev"].to_list() == rows["dev"]
    held_out = {json.dumps(row, sort_keys=True) for split in ("dev", "test") for row in rows[split]}
    assert not held_out & {json.dumps(row, sort_keys=True) for row in rows["train"]}
    assert task.scored_format in task.formats and TASKS.task_of_format(task.scored_format) is task


def test_a_name_or_a_format_registered_twice_is_refused(task_table):
    with pytest.raises(ValueError, match="'dates' is already registered"):
        register_task(dataclasses.replace(TASKS["dates"]))
    with pytest.raises(ValueError, match="'source_target' data is already task 'dates'"):
        register_task(dataclasses.replace(TASKS["dates"], name="more_dates"))
    with pytest.raises(ValueError, match="columns name the formats"):
        register_task(dataclasses.replace(PARITY, columns={"other": ("text",)}))
    with pytest.raises(ValueError, match=r"unknown embedded task 'weather'; tasks: \['arithmetic', 'sentiment'"):
        TASKS.get_task("weather")
    with pytest.raises(ValueError, match="unknown embedded task 'weather'"):
        StageCard(summary="s", trainer="t", embedded_task="weather")
    with pytest.raises(ValueError, match="data format 'parity' has no embedded data; formats: "):
        load_stage_dataset("parity", sizes={"dev": 2})


def test_a_task_registered_in_one_place_is_read_by_data_stages_eval_compare_and_cards(
    task_table, tmp_path, monkeypatch
):
    from plugformer import PlugformerConfig, PlugformerForSequenceClassification, train_tokenizer
    from plugformer.evaluation.held_out import rows_digest
    from plugformer.evaluation.scoring import main as eval_main
    from plugformer.experiments.compare import refuse_unscorable_stage
    from plugformer.training import STAGES, register_stage
    from plugformer.training.cards import stage_card
    from plugformer.training.data import stage_data

    register_task(PARITY)
    # the data loader: its format's rows, split by its rule
    data = load_stage_dataset("parity", sizes={"train": 8, "test": 12}, seed=1)
    assert data["test"].to_list() == parity_rows(12, "test", seed=1)
    # a stage reading it: its record names the format and, on its card, the task
    card = StageCard(summary="a parity classifier", trainer="transformers.Trainer", embedded_task="parity")
    monkeypatch.setattr(STAGES, "_table", dict(STAGES._table))  # the stage, too, only in this test
    classify = STAGES.get_stage("classify")
    stage = register_stage(dataclasses.replace(classify, name="parity", data_format="parity", card=card))
    script_args = stage.script_arguments(train_examples=6, dev_examples=4, test_examples=0)
    assert stage_data(stage, script_args)["dev"].to_list() == parity_rows(4, "dev")
    # compare: a classifier, scored by accuracy
    refuse_unscorable_stage(["parity"], "accuracy")
    with pytest.raises(ValueError, match="accuracy scores a classifier"):
        refuse_unscorable_stage(["parity"], "perplexity")
    # eval: a model whose run recorded the format is scored on the task's held-out rows, by its scorer
    tokenizer = train_tokenizer([row["text"] for row in parity_rows(200, "train")], vocab_size=280)
    special = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    labels = {"id2label": {0: "even", 1: "odd"}, "label2id": {"even": 0, "odd": 1}}
    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(PlugformerConfig.from_preset("tiny", **sizes, **special, **labels))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    run = {"stage": "parity", "data_format": "parity", "data": {"dataset_seed": 0, "direct_answer_fraction": 0.0}}
    (tmp_path / "run_info.json").write_text(json.dumps(run))
    results = eval_main(["--model", str(tmp_path), "--examples", "12"])
    assert results["data_sha256"] == rows_digest(load_stage_dataset("parity", sizes={"test": 12})["test"])
    assert results["examples"] == 12 and 0.0 <= results[PARITY.metric] <= 1.0
    # the model card: its description, its held-out sentence, its model-index dataset
    metrics = {"eval_accuracy": 0.5, "eval_macro_f1": 0.5}
    info = {"stage": "parity", "world_size": 1, "train_seconds": 1.0, "metrics": metrics}
    text = str(stage_card(model, info, SimpleNamespace(), script_args, None, str(tmp_path), card))
    assert PARITY.card_text in text and PARITY.held_out in text and "type: plugformer-parity" in text
