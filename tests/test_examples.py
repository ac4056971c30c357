"""The example scripts run (in their quick settings) and produce what their docstrings promise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


EXAMPLES = Path(__file__).parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~20-25 s of training; the other examples run by default
def test_compare_attention_variants_example(tmp_path):
    summary = load_example("compare_attention_variants").main(
        ["--quick", "--output_dir", str(tmp_path), "--seeds", "0", "1", "--scores", "dot", "additive"]
    )
    assert set(summary["variants"]) == {
        "attention_score=dot,position_scheme=rope",
        "attention_score=additive,position_scheme=rope",
    }
    assert summary["best"] in summary["variants"]
    assert {p.name for p in tmp_path.iterdir()} >= {"results.md", "results.json", "results.png", "runs"}


def test_length_extrapolation_example(tmp_path):
    summary = load_example("length_extrapolation").main(
        ["--quick", "--output_dir", str(tmp_path), "--schemes", "learned", "rope"]
    )
    assert summary["schemes"]["learned"]["perplexity"][128] is None  # 8x the quick training length of 16
    assert summary["schemes"]["rope"]["perplexity"][128]["mean"] > 1
    assert json.loads((tmp_path / "results.json").read_text())["train_length"] == 16


@pytest.mark.slow  # ~15 s of training
def test_quickstart_trains_each_variant_into_something_different():
    """The variants learn the copying task (loss down from ln 32, continuation far above chance), and they differ."""
    results = load_example("quickstart").main()
    assert all(row["last_loss"] < row["first_loss"] - 1 for row in results.values())
    assert max(row["accuracy"] for row in results.values()) > 0.5
    assert len({round(row["last_loss"], 2) for row in results.values()}) == len(results)


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_every_example_documents_how_to_run_it(name):
    text = (EXAMPLES / f"{name}.py").read_text()
    assert text.startswith('"""') and f"python examples/{name}.py" in text


def test_full_pipeline_example_runs_the_stages_its_docstring_names(tmp_path, monkeypatch):
    """Without training: the pipeline is asked for the six stages, not every registered one (the baselines rft and
    sft_matched are opt-in, as in configs/pipeline/tiny.yaml); the slow test below runs them."""
    module = load_example("full_pipeline")
    asked = []

    def stop(args):
        asked.append(args)
        raise InterruptedError

    monkeypatch.setattr(module, "run", stop)
    with pytest.raises(InterruptedError):
        module.main(["--quick", "--output_dir", str(tmp_path)])
    assert sorted(asked[0].stages) == sorted(["pretrain", "sft", "reward", "rlhf", "dpo", "grpo"])


@pytest.mark.slow  # ~20-25 s of training; the other examples run by default
def test_full_pipeline_example(tmp_path):
    results = load_example("full_pipeline").main(["--quick", "--output_dir", str(tmp_path)])
    assert sorted(results) == sorted(["pretrain", "sft", "reward", "rlhf", "dpo", "grpo"])
    for name in ("results.md", "training_curves.png", "attention_final_model.png", "attention_final_model.safetensors"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_real_text_corpus_is_prose_each_document_once(tmp_path):
    """The corpus the real-text extrapolation trains on: documents of this install's docstrings and package
    descriptions, each at least 500 characters and none twice, written as the jsonl `--data_files` reads."""
    import json

    texts = load_example("real_text_corpus").main([str(tmp_path / "corpus.jsonl")])
    rows = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["text"] for row in rows] == texts and len(texts) > 100
    assert min(map(len, texts)) >= 500 and len(set(texts)) == len(texts)
    assert any("Return" in text for text in texts)  # docstrings: English prose about code
