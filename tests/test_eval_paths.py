"""`plugformer eval` records the model it scored as the results' folder reaches it, never by an absolute path into
the user's home folder (which names the user, and leaks when the folder is shared)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugformer.evaluation import scoring
from plugformer.runtime.files import portable_path, recorded_path


def fake_results(args):
    return {"model": args.model, "split": args.split, "exact_match": 0.5}


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home folder of its own (`Path.home()` reads HOME), holding a model folder `runs/sft`."""
    home = tmp_path / "home" / "alice"
    (home / "runs" / "sft").mkdir(parents=True)
    (home / "runs" / "sft" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(scoring, "evaluate_directory", fake_results)  # the paths, not the scores, are tested
    return home


def evaluate(*argv: str) -> dict:
    results = scoring.main(list(argv))
    return results


@pytest.mark.parametrize(
    ("output", "model", "model_dir"),
    [
        (None, ".", "."),  # the default, <model>/eval_test.json
        ("runs/eval.json", "sft", "sft"),  # a folder above the model
        ("results/eval.json", "../runs/sft", "../runs/sft"),  # beside it, both in the home folder
        ("../../shared/eval.json", "~/runs/sft", "~/runs/sft"),  # outside the home folder: ~ for the user's home
    ],
)
def test_the_results_name_the_model_without_the_home_folder(home, output, model, model_dir):
    model_path = home / "runs" / "sft"
    written = home / output if output else model_path / "eval_test.json"
    written.parent.mkdir(parents=True, exist_ok=True)
    evaluate("--model", str(model_path), *(["--output", str(written)] if output else []))  # an absolute --model
    text = written.read_text()
    results = json.loads(text)
    assert (results["model"], results["key"]["model_dir"]) == (model, model_dir)
    assert str(home) not in text and str(home.parent) not in text
    assert recorded_path(results["model"], written.parent) == model_path.resolve()  # read back to the model


def test_a_model_outside_the_home_folder_keeps_its_absolute_path(home, tmp_path):
    model = tmp_path / "data" / "sft"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    written = home / "eval.json"
    evaluate("--model", str(model), "--output", str(written))
    assert json.loads(written.read_text())["model"] == model.resolve().as_posix()


def test_a_relative_model_path_is_recorded_relative_to_the_results(home, monkeypatch):
    monkeypatch.chdir(home / "runs")
    evaluate("--model", "sft")
    assert json.loads((home / "runs" / "sft" / "eval_test.json").read_text())["model"] == "."


def test_a_rerun_replaces_its_own_results_and_refuses_another_models(home, tmp_path, monkeypatch):
    """`output_problem` reads the recorded path back relative to the results' folder."""
    model = home / "runs" / "sft"
    written = home / "runs" / "eval.json"
    evaluate("--model", str(model), "--output", str(written), "--examples", "5")
    monkeypatch.chdir(home)  # the same model by another relative path: still its own results
    evaluate("--model", "runs/sft", "--output", str(written), "--examples", "7")
    assert json.loads(written.read_text())["key"]["options"]["examples"] == 7
    other = home / "runs" / "dpo"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds the results of another model \(.*/runs/sft\), not of --model"):
        evaluate("--model", str(other), "--output", str(written))


def test_an_absolute_path_written_by_an_earlier_version_still_reads_back(home):
    model = home / "runs" / "sft"
    written = model / "eval_test.json"
    written.write_text(json.dumps({"model": str(model), "split": "test", "key": {"model_dir": str(model)}}))
    evaluate("--model", str(model))  # its own earlier result: replaced, not refused
    assert json.loads(written.read_text())["model"] == "."


@pytest.mark.parametrize(
    ("path", "folder", "expected"),
    [
        ("/srv/runs/sft", "/srv/runs/sft", "."),
        ("/srv/runs/sft", "/srv/runs", "sft"),
        ("/srv/runs/sft", "/srv/results", "/srv/runs/sft"),
    ],
)
def test_portable_path_outside_the_home_folder(path, folder, expected, monkeypatch):
    monkeypatch.setenv("HOME", "/home/nobody-here")
    assert portable_path(path, folder) == expected
    assert recorded_path(expected, folder) == Path(path).resolve()
