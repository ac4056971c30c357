"""`plugformer pipeline` reuses a finished stage only while its folder computes what it computed when
the stage finished: the same weights, config.json, generation defaults and tokenizer files. An edited config.json
(position_scheme rope -> alibi) or tokenizer file is refused in one line naming the file, both digests and the
remedy; a record written before those files were digested retrains, saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import micro_stage_configs

from plugformer.experiments import pipeline, pipeline_reuse


ROOT = Path(__file__).resolve().parents[1]


# relative paths: a stage's record holds its command line, so a copy of the folder is the same run from its own root
FLAGS = ["--config", str(ROOT / "configs/pipeline/tiny.yaml"), "--stage_configs", "stages/{stage}.yaml", "--stages",
         "pretrain", "--test_examples", "4", "--max_new_tokens", "4", "--jobs", "1", "--output_dir", "out"]  # fmt: skip


@pytest.fixture(scope="module")
def finished_pipeline(tmp_path_factory) -> Path:
    """A folder whose pipeline (a 2-step pretraining stage of a 32-wide model) finished; it is copied, never written
    to."""
    folder = tmp_path_factory.mktemp("reuse")
    (folder / "stages").mkdir()
    micro_stage_configs(folder / "stages")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        pipeline.main(FLAGS)
    return folder


@pytest.fixture
def stage(finished_pipeline, tmp_path, monkeypatch) -> Path:
    """The finished pretrain stage's folder in a copy of the pipeline, the working directory at its root."""
    import shutil

    shutil.copytree(finished_pipeline, tmp_path / "copy")
    monkeypatch.chdir(tmp_path / "copy")
    return tmp_path / "copy" / "out" / "pretrain"


def refused(capsys) -> str:
    capsys.readouterr()
    with pytest.raises(ValueError) as caught:
        pipeline.main(FLAGS)
    message = str(caught.value)
    assert "\n" not in message and "--rerun true" in message
    assert "reusing" not in capsys.readouterr().out
    return message


def test_an_unchanged_finished_stage_is_reused(stage, capsys):
    before = (stage / "model.safetensors").read_bytes()
    capsys.readouterr()
    pipeline.main(FLAGS)
    assert "pretrain: reusing" in capsys.readouterr().out
    assert (stage / "model.safetensors").read_bytes() == before
    record = json.loads((stage / pipeline.RECORD).read_text())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        record[pipeline_reuse.MODEL_FILES_KEY]
    )


def test_a_finished_stage_whose_config_json_was_edited_is_refused_naming_it(stage, capsys):
    """Only the weights were hashed: a config.json edited from rope to alibi was reused, and the table reprinted the
    scores of a folder that now computes something else."""
    recorded = json.loads((stage / pipeline.RECORD).read_text())[pipeline_reuse.MODEL_FILES_KEY]["config.json"]
    config = json.loads((stage / "config.json").read_text())
    assert config["position_scheme"] == "rope"
    (stage / "config.json").write_text(json.dumps({**config, "position_scheme": "alibi"}, indent=2))
    now = pipeline_reuse.model_file_digests(stage)["config.json"]
    message = refused(capsys)
    assert message.startswith(
        f"stage 'pretrain': {Path('out/pretrain')} changed since the stage finished: "
        f"config.json (sha256 {recorded[:12]} when it finished, now sha256 {now[:12]})"
    )
    assert "tokenizer" not in message and "weights" not in message


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("tokenizer.json", {"normalizer": {"type": "Lowercase"}}),  # another tokenization of the same text
        ("tokenizer_config.json", {"model_max_length": 16}),
    ],
)
def test_a_finished_stage_whose_tokenizer_was_edited_is_refused_naming_the_file(name, edit, stage, capsys):
    tokenizer = json.loads((stage / name).read_text())
    (stage / name).write_text(json.dumps({**tokenizer, **edit}))
    message = refused(capsys)
    assert f"changed since the stage finished: {name} (sha256 " in message and " config.json" not in message


def test_a_file_removed_or_added_since_the_stage_finished_is_named(tmp_path):
    args = pipeline_args(tmp_path)
    stage = finish(args, "pretrain")
    record = pipeline.stage_record(args, "pretrain", pipeline.stage_argv(args, "pretrain"))
    assert pipeline.plan_stage(args, "pretrain", record) is None
    (stage / "generation_config.json").unlink()
    (stage / "vocab.json").write_text("{}")
    with pytest.raises(
        ValueError,
        match=r"generation_config.json \(sha256 \w{12} when it finished, now absent\), "
        r"vocab.json \(absent when it finished, now sha256 \w{12}\)",
    ):
        pipeline.plan_stage(args, "pretrain", record)
    with pytest.raises(ValueError, match="weights sha256"):  # replaced weights: named first, as before
        (stage / "model.safetensors").write_bytes(b"other weights")
        pipeline.plan_stage(args, "pretrain", record)


def test_a_record_without_the_config_and_tokenizer_digests_retrains_saying_why(tmp_path):
    """A pipeline_stage.json written before the config and tokenizer were digested cannot vouch for them."""
    args = pipeline_args(tmp_path)
    stage = finish(args, "pretrain")
    saved = json.loads((stage / pipeline.RECORD).read_text())
    del saved[pipeline_reuse.MODEL_FILES_KEY]
    (stage / pipeline.RECORD).write_text(json.dumps(saved))
    record = pipeline.stage_record(args, "pretrain", pipeline.stage_argv(args, "pretrain"))
    why, flags = pipeline.plan_stage(args, "pretrain", record)
    assert why == (
        "retraining: its pipeline_stage.json records no sha256 of config.json and the tokenizer files to "
        "check the folder's against"
    ) and flags == ["--overwrite_output_dir", "true"]


def pipeline_args(tmp_path: Path) -> pipeline.PipelineArguments:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "pretrain.yaml").write_text("max_steps: 2\n")
    return pipeline.PipelineArguments(
        output_dir=str(tmp_path / "out"), stages=["pretrain"], stage_configs=str(configs / "{stage}.yaml")
    )


def finish(args: pipeline.PipelineArguments, stage: str) -> Path:
    """A stage folder as the pipeline leaves a finished stage, with stand-ins for the weights and model files."""
    folder = Path(pipeline.stage_dir(args, stage))
    folder.mkdir(parents=True)
    (folder / "run_info.json").write_text(json.dumps({"parameter_digests": [1]}))
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        (folder / name).write_text(f"{name} as trained")
    record = pipeline.stage_record(args, stage, pipeline.stage_argv(args, stage))
    (folder / pipeline.RECORD).write_text(json.dumps(pipeline.finished_record(args, stage, record)))
    return folder
