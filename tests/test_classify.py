"""The classify stage: a num_labels-way head fine-tuned on labelled text (the embedded sentiment grammar, or your own
csv with sentence pairs and string labels), its labels kept as the model's id2label, and `plugformer eval`'s scores
of it on the split training held out."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from plugformer.data.corpus import nli_examples, sentiment_sentences
from plugformer.data.sources import load_stage_dataset, split_of_key
from plugformer.evaluation.classification import evaluate_classifier
from plugformer.evaluation.held_out import rows_digest
from plugformer.evaluation.scoring import main as eval_main
from plugformer.experiments.pipeline import PipelineArguments
from plugformer.runtime.arguments import override_flags
from plugformer.training import run_stage
from plugformer.training.stages.classify import check_labels, label_names


FLAGS = ["--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no",
         "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16", "--max_steps", "3",
         "--dataloader_pin_memory", "false", "--learning_rate", "1e-3", "--max_length", "32"]  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pretrain")
    run_stage(
        "pretrain",
        [
            "--output_dir",
            str(folder),
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--save_strategy",
            "no",
            "--max_steps",
            "2",
            "--train_examples",
            "48",
            "--dev_examples",
            "4",
            "--test_examples",
            "4",
            "--preset",
            "tiny",
            "--vocab_size",
            "300",
            "--block_size",
            "32",
            "--exact_match_examples",
            "0",
            "--dataloader_pin_memory",
            "false",
        ],
    )
    return folder


def classify(output_dir, parent, *extra: str) -> dict:
    return run_stage(
        "classify",
        override_flags(["--output_dir", str(output_dir), "--model_name_or_path", str(parent)], FLAGS, list(extra)),
    )


def test_the_sentiment_grammar_is_split_by_sentence_and_labelled_by_its_rule():
    sentences = sentiment_sentences()
    assert len(sentences) == len({text for text, _ in sentences}) == 8 * 4 * 2 * 2 * 14
    for text, label in sentences:  # positive adjective xor "not"
        positive = text.split()[-1] in ("great", "wonderful", "good", "excellent", "lovely", "fun", "delightful")
        assert label == int(positive != (" not " in f" {text} "))
    data = load_stage_dataset("classification", sizes={"train": 5000, "dev": 5000, "test": 5000})
    texts = {split: set(rows["text"]) for split, rows in data.items()}
    assert not texts["train"] & texts["dev"] and not texts["train"] & texts["test"] and not texts["dev"] & texts["test"]
    assert sum(map(len, texts.values())) == len(sentences)  # every sentence once, in the split its hash names
    assert all(split_of_key(text) == split for split, rows in data.items() for text in rows["text"])
    again = load_stage_dataset("classification", sizes={"test": 20}, seed=3)["test"]
    assert again["text"] == load_stage_dataset("classification", sizes={"test": 20}, seed=3)["test"]["text"]


def test_labels_become_class_ids_and_bad_labels_are_refused():
    assert label_names([10, 2, 2]) == ["2", "10"] and label_names(["b", "a"]) == ["a", "b"]
    with pytest.raises(ValueError, match=r"column 'label' holds int and str values"):
        label_names([1, "a"])
    with pytest.raises(ValueError, match=r"column 'label' holds float values; give every label as an integer"):
        label_names([1.0, 0.0])
    with pytest.raises(ValueError, match=r"a single label \(\['a'\]\)"):
        check_labels({"train": None}, ["a"])
    with pytest.raises(ValueError, match=r"the dev split has labels the training split never has: \['c'\]"):
        check_labels({"dev": {"label": ["a", "c"]}}, ["a", "b"])


def test_classify_on_the_embedded_grammar_and_its_test_scores(pretrained, tmp_path):
    info = classify(tmp_path / "clf", pretrained, "--dev_examples", "20", "--test_examples", "30")
    assert info["labels"] == ["NEGATIVE", "POSITIVE"]
    assert 0 <= info["metrics"]["eval_accuracy"] <= 1 and 0 <= info["metrics"]["eval_macro_f1"] <= 1
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf")
    assert model.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}
    card = (tmp_path / "clf/README.md").read_text()
    assert "dev accuracy" in card and "plugformer-sentiment" in card and "arithmetic" not in card
    results = eval_main(["--model", str(tmp_path / "clf"), "--examples", "30"])
    rows = load_stage_dataset("classification", sizes={"test": 30})["test"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "clf")
    expected = evaluate_classifier(model, tokenizer, rows["text"], [model.config.label2id[v] for v in rows["label"]])
    assert results["data_sha256"] == rows_digest(rows) and results["examples"] == 30
    assert results["accuracy"] == expected["accuracy"] == sum(results["correct"]) / 30
    assert results["macro_f1"] == expected["macro_f1"]
    labelled = pipeline("text-classification", model=str(tmp_path / "clf"))("the food was not really good")
    assert labelled[0]["label"] in ("NEGATIVE", "POSITIVE")


def test_classify_on_your_csv_of_sentence_pairs_with_text_labels(pretrained, tmp_path):
    names = {0: "entailment", 1: "neutral", 2: "contradiction"}
    path = tmp_path / "nli.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "text_pair", "label"])
        writer.writerows((premise, hypothesis, names[label]) for premise, hypothesis, label in nli_examples(90))
    info = classify(
        tmp_path / "nli",
        pretrained,
        "--dataset_name",
        "csv",
        "--data_files",
        str(path),
        "--dev_examples",
        "9",
        "--test_examples",
        "12",
        "--held_out_fraction",
        "1",
    )
    assert info["labels"] == ["contradiction", "entailment", "neutral"]  # sorted text labels
    record = json.loads((tmp_path / "nli/run_info.json").read_text())["data"]
    assert record["dataset_name"] == "csv" and record["test_examples"] == 12
    results = eval_main(["--model", str(tmp_path / "nli")])  # the run's own held-out pairs
    held_out = load_stage_dataset(
        "classification", "csv", data_files=[str(path)], sizes={"dev": 9, "test": 12}, held_out_fraction=1.0
    )
    assert results["examples"] == 12 and results["data_sha256"] == rows_digest(held_out["test"])
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "nli")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "nli")
    rows = held_out["test"]
    expected = evaluate_classifier(
        model, tokenizer, rows["text"], [model.config.label2id[v] for v in rows["label"]], pairs=rows["text_pair"]
    )
    assert results["correct"] == expected["correct"]


def test_classify_with_lora_trains_the_adapters_and_the_new_head_and_merges_them(pretrained, tmp_path):
    from safetensors.torch import load_file

    classify(tmp_path / "lora", pretrained, "--use_peft", "true", "--lora_r", "4", "--learning_rate", "3e-2")
    assert (tmp_path / "lora/adapter/adapter_model.safetensors").is_file()
    parent, merged = load_file(pretrained / "model.safetensors"), load_file(tmp_path / "lora/model.safetensors")
    query = next(name for name in parent if name.endswith("layers.0.self_attn.q_proj.weight"))
    assert not (parent[query] == merged[query]).all()  # the adapters, merged into q_proj
    assert "score.weight" in merged and not any("lora" in name for name in merged)
    adapter = load_file(tmp_path / "lora/adapter/adapter_model.safetensors")
    # the trained head is saved with the adapters (PEFT's modules_to_save) and is the merged model's head
    assert (adapter["base_model.model.score.weight"] == merged["score.weight"]).all()
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lora")
    assert model.config.id2label == {0: "NEGATIVE", 1: "POSITIVE"}


def test_the_pipeline_runs_classify_only_when_listed():
    assert "classify" not in PipelineArguments().stages


CONFIGS = str(Path(__file__).parents[1] / "configs" / "{stage}" / "tiny.yaml")
# a 2-step encoder under a new head: 100 classify steps at 3e-3 learn the adjectives' polarity (4 of 4 seeds: 100% dev)
BUDGET = ["pretrain.max_steps=2", "pretrain.is_causal=false", "classify.max_steps=100", "train_examples=400",
          "report_to=none", "hidden_size=32", "num_hidden_layers=1", "vocab_size=300"]  # fmt: skip


def scored_rows_agree(run_dir: Path, rows, split: str = "test") -> None:
    """compare's cached 1/0 per row of a run equal `evaluate_classifier` on `rows`."""
    model = AutoModelForSequenceClassification.from_pretrained(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    labels = [model.config.label2id[str(v)] for v in rows["label"]]  # a csv's integer labels: class names "0", ...
    pairs = rows["text_pair"] if "text_pair" in rows.column_names else None
    expected = evaluate_classifier(model, tokenizer, rows["text"], labels, pairs=pairs)
    cached = json.loads((run_dir / f"compare_accuracy_{split}.json").read_text())
    assert cached["scores"] == [float(c) for c in expected["correct"]] and cached["examples"] == len(rows)


def test_compare_ranks_classifiers_on_the_split_held_out_of_your_labelled_data(tmp_path):
    from plugformer.evaluation.held_out import held_out_rows, recorded_source
    from plugformer.experiments.compare import CompareArguments, run

    path = tmp_path / "reviews.csv"  # the grammar's sentences without "not": polarity is the adjective's
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "label"])
        writer.writerows((text, ("neg", "pos")[label]) for text, label in sentiment_sentences() if " not " not in text)
    labelled = [
        "classify.dataset_name=csv",
        f"classify.data_files={path}",
        "classify.dev_examples=50",
        "classify.test_examples=80",
    ]
    # learning rate 0 leaves the new head at its initialisation: a planted, clearly worse variant
    args = CompareArguments(
        output_dir=str(tmp_path / "out"),
        grid=["classify.learning_rate=0.003,0.0"],
        seeds=[0, 1],
        set=BUDGET + labelled,
        stages=["pretrain", "classify"],
        metric="accuracy",
        dev_examples=40,
        test_examples=60,
        bootstrap_samples=2000,
        stage_configs=CONFIGS,
    )
    summary = run(args)
    assert summary["metric"] == "accuracy" and summary["best"] == "classify.learning_rate=0.003"
    worse = summary["variants"]["classify.learning_rate=0.0"]
    assert worse["versus_best"]["significant"] and worse["versus_best"]["difference"] > 0  # best is more accurate
    assert summary["variants"][summary["best"]]["test"]["mean"] > 0.8
    assert "accuracy, best − other" in (tmp_path / "out/results.md").read_text()
    # the rows scored: the first 60 of the 80 the classify runs held out of the csv, the same for every run
    run_dir = next((tmp_path / "out/runs").glob("classify.learning_rate=0.003-*")) / "seed0/classify"
    source = recorded_source(str(run_dir))
    assert source["data_files"] == [str(path)] and source["test_examples"] == 80
    scored_rows_agree(run_dir, held_out_rows(source, "test", 60))
    with pytest.raises(ValueError, match=r"variants scored on different data cannot be paired"):
        run(
            CompareArguments(
                output_dir=str(tmp_path / "x"),
                grid=[f"classify.data_files={path},{path}"],
                seeds=[0],
                stages=["pretrain", "classify"],
                metric="accuracy",
                stage_configs=CONFIGS,
            )
        )


def test_compare_scores_a_classifier_on_the_embedded_grammar_and_refuses_a_mismatched_metric(tmp_path):
    from plugformer.experiments.compare import CompareArguments, run

    budget = [*(b for b in BUDGET if not b.startswith("classify.max_steps")), "classify.max_steps=5"]
    args = CompareArguments(
        output_dir=str(tmp_path),
        grid=["classify.learning_rate=0.003"],
        seeds=[0],
        set=budget,
        stages=["pretrain", "classify"],
        metric="accuracy",
        dev_examples=20,
        test_examples=30,
        stage_configs=CONFIGS,
    )
    run(args)
    run_dir = next((tmp_path / "runs").glob("*")) / "seed0/classify"
    scored_rows_agree(run_dir, load_stage_dataset("classification", sizes={"test": 30})["test"])
    with pytest.raises(ValueError, match=r"accuracy scores a classifier and a classifier is scored by accuracy"):
        CompareArguments(stages=["pretrain", "classify"])  # perplexity of a classifier
    with pytest.raises(ValueError, match=r"end --stages with classify or nli and set --metric accuracy"):
        CompareArguments(stages=["pretrain"], metric="accuracy")


def test_compare_scores_sentence_pairs_with_integer_labels_as_eval_does(tmp_path):
    from plugformer.evaluation.held_out import held_out_rows, recorded_source
    from plugformer.experiments.compare import CompareArguments, run

    path = tmp_path / "nli.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["text", "text_pair", "label"])
        writer.writerows(nli_examples(120))
    budget = [
        *(b for b in BUDGET if not b.startswith("classify.max_steps")),
        "classify.max_steps=5",
        "classify.dataset_name=csv",
        f"classify.data_files={path}",
        "classify.dev_examples=20",
        "classify.test_examples=30",
    ]
    run(
        CompareArguments(
            output_dir=str(tmp_path / "out"),
            grid=["classify.learning_rate=0.003"],
            seeds=[0],
            set=budget,
            stages=["pretrain", "classify"],
            metric="accuracy",
            dev_examples=20,
            test_examples=30,
            stage_configs=CONFIGS,
        )
    )
    run_dir = next((tmp_path / "out/runs").glob("*")) / "seed0/classify"
    scored_rows_agree(run_dir, held_out_rows(recorded_source(str(run_dir)), "test", 30))  # each pair, both texts


@pytest.mark.slow  # ~15 s: two processes start
def test_two_cpu_processes_train_one_classifier(pretrained, tmp_path):
    from conftest import launch_on_two_processes

    argv = override_flags(["--model_name_or_path", str(pretrained)], FLAGS, ["--per_device_train_batch_size", "4"])
    info = launch_on_two_processes("classify", argv, tmp_path / "ddp")
    assert info["world_size"] == 2 and info["effective_batch"]["total"] == 8
    first, second = info["parameter_digests"]
    assert first == second  # DDP kept the ranks in step
    classify(tmp_path / "one", pretrained)  # one process on the whole batch of 8: the same steps
    one = AutoModelForSequenceClassification.from_pretrained(tmp_path / "one").state_dict()
    for name, weight in AutoModelForSequenceClassification.from_pretrained(tmp_path / "ddp").state_dict().items():
        torch.testing.assert_close(weight, one[name], rtol=0, atol=1e-5, msg=name)
