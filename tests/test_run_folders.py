"""A run folder is a transaction: while a run replaces a finished one its records say "in progress", `run_info.json`
is written last, a checkpoint of another folder never lands on a finished run, `--overwrite_output_dir` removes only
what plugformer wrote (with `adapter/` going with its model), and every file gets the umask's modes."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import refuse_training
from test_corpus import write_corpus
from test_training import PRETRAIN, TINY, weights

from plugformer.runtime.arguments import override_flags
from plugformer.runtime.run_folders import RUN_RECORD


STEPS = ["--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no", "--dev_examples", "0",
         "--exact_match_examples", "0", "--max_steps", "2"]  # fmt: skip


def flags(output_dir, *extra: str) -> list[str]:
    return override_flags(["--output_dir", str(output_dir), *TINY, *PRETRAIN], STEPS, list(extra))


def pretrain(output_dir, *extra: str) -> dict:
    from plugformer.training import run_stage

    return run_stage("pretrain", flags(output_dir, *extra))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def record(folder: Path) -> dict:
    return json.loads((folder / RUN_RECORD).read_text())


def copy_of(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    return target


# --- in progress until run_info.json, written last ---------------------------------------------------------------


def test_a_resumed_finished_run_says_in_progress_before_anything_is_replaced(finished, tmp_path, monkeypatch):
    from transformers import Trainer

    run = copy_of(finished, tmp_path / "run")
    (run / "eval_test.json").write_text(json.dumps({"model": str(run), "split": "test", "exact_match": 0.5}))
    seen, original = {}, Trainer.train

    def train(self, *args, **kwargs):
        seen.update(records=sorted(p.name for p in run.glob("*.json")), claim=record(run))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train", train)
    pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "4")
    # the step-2 run's records (and eval's results of its model) are gone before step 3 is trained
    assert {"run_info.json", "trainer_state.json", "eval_test.json"}.isdisjoint(seen["records"])
    assert seen["claim"] == {"stage": "pretrain", "status": "in_progress"}
    assert json.loads((run / "run_info.json").read_text())["compute"]["steps"] == 4
    assert record(run) == {"stage": "pretrain", "status": "finished"}


def test_run_info_is_written_after_every_other_record(tmp_path, monkeypatch):
    from plugformer.runtime import files

    written, original = [], files.write_text_atomic

    def spy(path, text):
        written.append(Path(path).name)
        original(path, text)

    monkeypatch.setattr(files, "write_text_atomic", spy)
    run = tmp_path / "run"
    pretrain(run)
    assert written.index("run_info.json") > written.index("trainer_state.json")
    assert (run / "README.md").stat().st_mtime_ns <= (run / "run_info.json").stat().st_mtime_ns  # the card before
    assert written[-1] == RUN_RECORD and record(run)["status"] == "finished"


def test_ctrl_c_after_the_final_save_prints_one_line_and_leaves_no_stale_record(
    finished, tmp_path, monkeypatch, capsys
):
    from plugformer import cli
    from plugformer.training import common

    run = copy_of(finished, tmp_path / "run")
    old = weights(run)

    def interrupt(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "dev_policy_scores", interrupt)  # after the final save, before run_info.json
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "pretrain", *flags(run, "--resume_from_checkpoint", "last", "--max_steps", "4")])
    assert exit_.value.code == 130
    err = capsys.readouterr().err  # progress bars above: the interrupt is one line, the last, and no traceback
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and err.count("KeyboardInterrupt") == 1
    assert line.startswith("KeyboardInterrupt: stage 'pretrain' interrupted") and str(run) in line
    assert "--resume_from_checkpoint last" in line
    new = weights(run)
    assert any(not new[name].equal(old[name]) for name in old)  # the step-4 weights were saved ...
    assert not (run / "run_info.json").exists() and not (run / "trainer_state.json").exists()  # ... no step-2 record
    assert record(run)["status"] == "in_progress"


# --- a checkpoint of another folder ------------------------------------------------------------------------------


def test_a_checkpoint_of_another_folder_is_refused_into_a_finished_folder(finished, tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    target = copy_of(finished, tmp_path / "target")
    shutil.rmtree(target / "checkpoint-2")  # a finished run without checkpoints of its own
    before = snapshot(target)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    checkpoint = finished / "checkpoint-2"
    with pytest.raises(
        ValueError,
        match=rf"--resume_from_checkpoint {checkpoint}: .*{finished}.*--output_dir "
        rf"{target} holds another run .*--overwrite_output_dir true",
    ) as caught:
        pretrain(target, "--resume_from_checkpoint", str(checkpoint), "--max_steps", "4")
    assert "\n" not in str(caught.value)
    assert snapshot(target) == before


def test_a_checkpoint_of_another_folder_resumes_into_a_new_folder_or_with_overwrite(finished, tmp_path):
    checkpoint = str(finished / "checkpoint-2")
    info = pretrain(tmp_path / "new", "--resume_from_checkpoint", checkpoint, "--max_steps", "4")
    assert info["compute"]["steps"] == 4
    target = copy_of(finished, tmp_path / "target")
    (target / "checkpoint-2" / "marker").mkdir()  # its own checkpoint, to be replaced by the overwrite
    pretrain(target, "--resume_from_checkpoint", checkpoint, "--max_steps", "4", "--overwrite_output_dir", "true")
    assert sorted(p.name for p in target.glob("checkpoint-*")) == ["checkpoint-4"]
    assert json.loads((target / "run_info.json").read_text())["compute"]["steps"] == 4
    with pytest.raises(ValueError, match="contradict"):  # its own checkpoint would be removed by the overwrite
        pretrain(target, "--resume_from_checkpoint", str(target / "checkpoint-4"), "--overwrite_output_dir", "true")


# --- the overwrite removes only what plugformer wrote ------------------------------------------------------------


def test_overwrite_refuses_a_folder_of_another_tool_that_holds_checkpoints(tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    other = tmp_path / "other"
    for name in ("checkpoint-5", "checkpoint-10"):
        (other / name).mkdir(parents=True)
        (other / name / "trainer_state.json").write_text("{}")
    (other / "config.json").write_text("{}")
    (other / "eval_results.json").write_text('{"eval_loss": 1.0}')
    before = snapshot(other)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    with pytest.raises(
        ValueError,
        match=rf"--overwrite_output_dir true: {other} holds checkpoint-10, checkpoint-5, "
        r"which plugformer did not write .*holds no plugformer run",
    ):
        pretrain(other, "--overwrite_output_dir", "true")
    assert snapshot(other) == before


def test_overwrite_refuses_a_checkpoint_without_plugformers_manifest(finished, tmp_path):
    run = copy_of(finished, tmp_path / "run")
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-7")
    (run / "checkpoint-7" / "checkpoint_manifest.json").unlink()  # copied in from another tool
    with pytest.raises(ValueError, match=r"holds checkpoint-7, which plugformer did not write \(no checkpoint_"):
        pretrain(run, "--overwrite_output_dir", "true")
    assert (run / "checkpoint-2").is_dir() and (run / "run_info.json").is_file()


def test_overwrite_removes_plugformers_results_and_keeps_other_files(finished, tmp_path):
    run = copy_of(finished, tmp_path / "run")
    ours = {"model": str(run), "split": "test", "exact_match": 0.5, "key": {"model_dir": str(run)}}
    (run / "eval_test.json").write_text(json.dumps(ours))
    (run / "eval_notes.json").write_text('{"mine": true}')  # a file of the user's, named like a result
    (run / "eval_broken.json").write_text("not json")
    pretrain(run, "--overwrite_output_dir", "true")
    assert not (run / "eval_test.json").exists()
    assert (run / "eval_notes.json").read_text() == '{"mine": true}' and (run / "eval_broken.json").exists()


@pytest.mark.parametrize("how", ["overwrite", "resume"])
def test_a_full_run_over_a_lora_run_removes_its_adapter(finished, tmp_path, how):
    run = copy_of(finished, tmp_path / "run")
    (run / "adapter").mkdir()  # what a LoRA run leaves beside its merged model
    (run / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    extra = ["--overwrite_output_dir", "true"] if how == "overwrite" else ["--resume_from_checkpoint", "last"]
    pretrain(run, *extra, "--max_steps", "4")
    assert not (run / "adapter").exists()


@pytest.mark.parametrize("umask", [0o022], indirect=True, ids=oct)
def test_a_full_sft_over_a_lora_sft_removes_its_adapter(finished, tmp_path, umask):
    from test_training import train

    run = tmp_path / "sft"
    train("sft", run, "--model_name_or_path", str(finished), "--use_peft", "true", "--lora_r", "4")
    assert mode(run / "adapter" / "adapter_model.safetensors") == mode(run / "model.safetensors") == 0o644
    train("sft", run, "--model_name_or_path", str(finished), "--overwrite_output_dir", "true")
    assert not (run / "adapter").exists()


# --- modes -------------------------------------------------------------------------------------------------------


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600)], indirect=["umask"], ids=oct)
def test_files_get_the_modes_of_the_umask(tmp_path, umask, expected):
    corpus = write_corpus(tmp_path / "corpus.jsonl", 200)
    run = tmp_path / "run"
    pretrain(
        run,
        "--dataset_name",
        "json",
        "--data_files",
        str(corpus),
        "--data_cache_dir",
        str(tmp_path / "cache"),
        "--dev_examples",
        "8",
        "--test_examples",
        "8",
    )
    completes = sorted((tmp_path / "cache" / "blocks").glob("*/complete"))  # the packed corpus's marker
    assert completes
    files = [
        run / "model.safetensors",
        run / "run_info.json",
        run / "trainer_state.json",
        run / RUN_RECORD,
        run / "last_checkpoint.json",
        run / "checkpoint-2" / "model.safetensors",
        run / "checkpoint-2" / "checkpoint_manifest.json",
        *completes,
    ]
    assert {str(path.relative_to(tmp_path)): oct(mode(path)) for path in files} == {
        str(path.relative_to(tmp_path)): oct(expected) for path in files
    }


@pytest.mark.parametrize(
    ("umask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)], indirect=["umask"], ids=oct
)
def test_an_atomic_write_gets_the_mode_of_a_plain_open(tmp_path, umask, expected):
    from plugformer.runtime.files import write_text_atomic

    write_text_atomic(tmp_path / "a.json", "{}\n")
    (tmp_path / "b.json").write_text("{}\n")
    assert mode(tmp_path / "a.json") == mode(tmp_path / "b.json") == expected
    write_text_atomic(tmp_path / "a.json", "[]\n")  # replaced: the umask's mode again
    assert mode(tmp_path / "a.json") == expected


@pytest.mark.parametrize("umask", [0o022], indirect=True, ids=oct)
def test_a_converted_model_gets_the_umask_mode(llama_source, tmp_path, umask):
    from plugformer.integrations.convert import convert

    convert(llama_source, tmp_path / "converted")
    assert {mode(path) for path in (tmp_path / "converted").glob("*.safetensors")} == {0o644}
