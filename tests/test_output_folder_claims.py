"""One output-folder rule for every command that writes a model or results (a stage, demo, convert, eval): a folder
holding another run, a conversion's own source, a file, or a folder a live run has locked is refused before any work,
naming what it holds and the remedy (`--overwrite_output_dir true`, `--resume_from_checkpoint last`), and is left as
it was; told to replace a run, a command removes that run's records and checkpoints; a dead run's lock is taken
over, by one process only."""

from __future__ import annotations

import pytest
from conftest import copy_of, copy_run, refuse_training, refuse_work, snapshot
from conftest import pretrain_checkpointed as pretrain


@pytest.mark.parametrize(
    ("target", "pattern"),
    [
        (lambda src: src, "is the source"),
        (lambda src: src / "plugformer", "is inside the source"),
        (lambda src: src / "config.json", "is the source|inside the source"),
        (lambda src: src.parent / "afile", "is an existing file"),
        (lambda src: src.parent / "occupied", r"already holds another run \(config.json"),
    ],
    ids=["source", "inside-source", "a-source-file", "a-file", "occupied"],
)
def test_convert_refuses_to_overwrite_the_source_or_save_nothing(llama_source, target, pattern):
    from plugformer.integrations.convert import convert

    (llama_source.parent / "afile").write_text("keep me\n")
    (llama_source.parent / "occupied").mkdir()
    (llama_source.parent / "occupied" / "config.json").write_text("{}\n")
    before = snapshot(llama_source.parent)
    with pytest.raises(ValueError, match=rf"output_dir[= ].*({pattern})"):
        convert(llama_source, target(llama_source))
    assert snapshot(llama_source.parent) == before  # nothing written, nothing lost


def test_convert_overwrite_replaces_an_occupied_folder(llama_source):
    from plugformer.integrations.convert import convert

    occupied = llama_source.parent / "occupied"
    convert(llama_source, occupied)
    with pytest.raises(ValueError, match="already holds another run"):
        convert(llama_source, occupied)
    convert(llama_source, occupied, overwrite=True, position_scheme="alibi")
    assert '"alibi"' in (occupied / "config.json").read_text()
    with pytest.raises(ValueError, match="is the source"):  # not even with overwrite
        convert(llama_source, llama_source, overwrite=True)


def test_convert_refuses_a_folder_holding_a_stage_or_a_live_run(runs, tmp_path, llama_source):
    import os
    import socket

    from plugformer.integrations.convert import convert
    from plugformer.runtime.run_folders import LOCK

    run = copy_run(runs, "final_only", tmp_path)
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"already holds another run \(config.json.*--overwrite_output_dir true"):
        convert(llama_source, run)
    (run / LOCK).write_text(f'{{"pid": {os.getppid()}, "host": "{socket.gethostname()}", "started": "now"}}\n')
    locked = snapshot(run)
    with pytest.raises(ValueError, match=r"in use by a live run"):  # not even told to replace it
        convert(llama_source, run, overwrite=True)
    assert snapshot(run) == locked and {k: v for k, v in locked.items() if k != LOCK} == before


@pytest.mark.parametrize("flags", [["--overwrite_output_dir", "true"], ["--overwrite_output_dir"], ["--overwrite"]])
def test_convert_told_to_replace_a_stage_removes_its_records_and_checkpoints(runs, tmp_path, llama_source, flags):
    import json

    from plugformer.cli import main
    from plugformer.runtime.run_folders import LOCK, RUN_RECORD

    run = copy_run(runs, "checkpointed", tmp_path)
    (run / "eval_test.json").write_text('{"model": "run", "split": "test", "exact_match": 0.5}\n')
    main(["convert", str(llama_source), str(run), *flags])
    # before: the converted model sat beside the pretrain run's record, checkpoint and scores, read as theirs
    assert not (run / "run_info.json").exists() and not list(run.glob("checkpoint-*"))
    assert not (run / "eval_test.json").exists()
    assert json.loads((run / RUN_RECORD).read_text()) == {"stage": "convert"} and not (run / LOCK).exists()
    assert json.loads((run / "config.json").read_text())["model_type"] == "plugformer"


def test_demo_refuses_a_folder_holding_a_finished_stage(runs, tmp_path, monkeypatch):
    from plugformer.experiments import demo

    run = copy_run(runs, "final_only", tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(demo, "train_tokenizer", refuse_work)
    with pytest.raises(
        ValueError, match=r"--output_dir .* already holds another run \(config.json.*--overwrite_output_dir"
    ):
        demo.main(["--output_dir", str(run)])
    assert snapshot(run) == before


def test_demo_told_to_replace_a_stage_removes_its_records(runs, tmp_path):
    import json

    from plugformer.experiments import demo
    from plugformer.runtime.run_folders import LOCK, RUN_RECORD

    run = copy_run(runs, "final_only", tmp_path)
    demo.main(
        [
            "--output_dir",
            str(run),
            "--overwrite_output_dir",
            "true",
            "--max_steps",
            "1",
            "--train_sentences",
            "64",
            "--eval_sentences",
            "8",
            "--hidden_size",
            "32",
            "--num_hidden_layers",
            "1",
            "--vocab_size",
            "300",
            "--prompts",
            "1 plus 1 is",
        ]
    )
    assert not (run / "run_info.json").exists()  # the folder no longer claims to hold the pretrain stage
    assert json.loads((run / RUN_RECORD).read_text()) == {"stage": "demo"}
    assert not (run / LOCK).exists()


def test_a_second_run_into_an_occupied_folder_is_refused_before_training(finished, tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    with pytest.raises(
        ValueError,
        match=r"--output_dir .* already holds another run \(checkpoint-2, config.json.*"
        r"--resume_from_checkpoint last.*--overwrite_output_dir true",
    ):
        pretrain(run, "--seed", "1")
    assert snapshot(run) == before


def test_resuming_the_same_run_and_an_explicit_overwrite_still_train(finished, tmp_path, caplog):
    import json
    import logging

    run = copy_of(finished, tmp_path)
    pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "4")  # continues the run: 2 more steps
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    with caplog.at_level(logging.WARNING, logger="plugformer.runtime.run_folders"):
        pretrain(run, "--overwrite_output_dir", "true", "--save_steps", "1")
    assert (
        "removing ['.plugformer_run.json', 'checkpoint-2', 'checkpoint-4', 'last_checkpoint.json', 'run_info.json', "
        "'trainer_state.json']" in caplog.text
    )
    # only the new run's checkpoints: rotation and `last` can never pick the old run's
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 2
    with pytest.raises(ValueError, match="contradict"):
        pretrain(run, "--overwrite_output_dir", "true", "--resume_from_checkpoint", "last")


def test_a_read_only_output_folder_is_refused_naming_it(tmp_path, monkeypatch):
    from plugformer.runtime import run_folders

    parent = tmp_path / "ro"
    parent.mkdir()
    monkeypatch.setattr(run_folders.os, "access", lambda path, mode: str(path) != str(parent))  # root ignores modes
    assert "ro is not writable by this user" in run_folders.occupied_problem(str(parent / "run"), None, False, "sft")


def test_a_claim_judges_the_folder_again_once_locked(tmp_path, monkeypatch):
    from plugformer.runtime import run_folders

    folder = tmp_path / "out"
    real_acquire = run_folders.acquire_lock

    def another_run_finishes_meanwhile(output_dir):
        (folder / "config.json").write_text("{}\n")  # written between the first look and the lock
        return real_acquire(output_dir)

    folder.mkdir()
    monkeypatch.setattr(run_folders, "acquire_lock", another_run_finishes_meanwhile)
    with pytest.raises(ValueError, match=r"already holds another run \(config.json"):
        run_folders.claim_folder(str(folder), "demo")
    assert sorted(p.name for p in folder.iterdir() if p.name != run_folders.TAKEOVER) == ["config.json"]


def test_a_live_run_locks_its_folder_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog, monkeypatch):
    import json
    import logging
    import socket
    import subprocess
    import sys

    from plugformer.runtime.run_folders import LOCK
    from plugformer.training.stages import pretrain as pretrain_module

    lock = tmp_path / "run" / LOCK
    lock.parent.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": "then"}))
        with monkeypatch.context() as patch:
            patch.setattr(pretrain_module, "build_tokenizer", refuse_training)
            with pytest.raises(ValueError, match=rf"in use by a live run \(pid {live.pid}"):
                pretrain(tmp_path / "run")
        assert json.loads(lock.read_text())["pid"] == live.pid  # the live run's lock is left alone
    finally:
        live.kill()
        live.wait()
    with caplog.at_level(logging.WARNING, logger="plugformer.runtime.run_folders"):
        pretrain(tmp_path / "run")  # the same pid, now dead: a killed run's stale lock
    assert f"left by pid {live.pid}, which is no longer running; taking it over" in caplog.text
    assert not lock.exists()  # released when the run ended
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ValueError, match=r"locked by pid 1 on host elsewhere .* delete"):
        pretrain(tmp_path / "run", "--resume_from_checkpoint", "last")


LOCK_TAKER = """
import json, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
read_text = pathlib.Path.read_text
def slow_read(self, *args, **kwargs):  # a pause between judging the lock and replacing it, until both have read
    text = read_text(self, *args, **kwargs)
    if self.name == ".plugformer.lock":
        (folder / f"read-{sys.argv[2]}").touch()
        deadline = time.time() + 5  # taken one at a time, the other one never reads meanwhile: go on after 5 s
        while len(list(folder.glob("read-*"))) < 2 and time.time() < deadline:
            time.sleep(0.01)
    return text
pathlib.Path.read_text = slow_read
import types  # the lock's modules need only the standard library: skip the package's heavy __init__ files
for name in ("plugformer", "plugformer.runtime", "plugformer.training"):
    package = sys.modules[name] = types.ModuleType(name)
    package.__path__ = [str(pathlib.Path(sys.argv[3], *name.split(".")))]
from plugformer.runtime.run_folders import acquire_lock
(folder / f"ready-{sys.argv[2]}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
problem = acquire_lock(folder)
print(json.dumps({"held": problem is None, "problem": problem}))
sys.stdout.flush()
time.sleep(3.0)  # a live holder while the other process judges
"""


def test_two_processes_taking_over_one_stale_lock_never_both_hold_it(tmp_path):
    import json
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from plugformer.runtime.run_folders import LOCK

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    source = Path(__file__).parents[1] / "src"
    takers = [
        subprocess.Popen(
            [sys.executable, "-c", LOCK_TAKER, str(tmp_path), str(i), str(source)], stdout=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    results = [json.loads(taker.communicate(timeout=120)[0].strip().splitlines()[-1]) for taker in takers]
    assert sorted(r["held"] for r in results) == [False, True], results
    assert "in use by a live run" in next(r["problem"] for r in results if not r["held"])


def fake_results(args):
    return {"model": args.model, "split": args.split, "exact_match": 0.5}


@pytest.mark.parametrize(
    ("output", "pattern"),
    [
        ("run_info.json", r"run_info.json is the name of a model's or a run's own file"),
        ("config.json", r"config.json is the name of a model's or a run's own file"),
        ("notes.json", r"already holds a file that is no result of plugformer eval.*--overwrite_output true"),
        ("other.json", r"holds the results of another model \(/elsewhere\).*--overwrite_output true"),
        (".", r"is a folder"),
    ],
)
def test_eval_refuses_an_output_that_holds_another_models_or_runs_files(runs, tmp_path, monkeypatch, output, pattern):
    from plugformer.evaluation import scoring

    run = copy_run(runs, "final_only", tmp_path)
    (run / "notes.json").write_text('{"mine": 1}\n')
    (run / "other.json").write_text('{"model": "/elsewhere", "split": "test", "key": {"model_dir": "/elsewhere"}}\n')
    before = snapshot(run)
    monkeypatch.setattr(scoring, "evaluate_directory", refuse_work)
    with pytest.raises(ValueError, match=pattern):
        scoring.main(["--model", str(run), "--output", str(run / output)])
    assert snapshot(run) == before


def test_eval_replaces_its_own_earlier_result_and_keys_what_it_depends_on(runs, tmp_path, monkeypatch):
    import json

    from plugformer.evaluation import scoring
    from plugformer.runtime.files import weights_sha256

    run = copy_run(runs, "final_only", tmp_path)
    monkeypatch.setattr(scoring, "evaluate_directory", fake_results)
    scoring.main(["--model", str(run), "--examples", "5"])
    first = json.loads((run / "eval_test.json").read_text())["key"]
    assert first["options"]["examples"] == 5 and first["model_dir"] == "."  # relative to the results
    assert first["weights_sha256"] == weights_sha256(run) and first["model_files_sha256"]
    scoring.main(["--model", str(run), "--examples", "7"])  # the same model folder: replaced
    assert json.loads((run / "eval_test.json").read_text())["key"]["options"]["examples"] == 7
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "x", "split": "test", "key": {"model_dir": "/elsewhere"}}))
    scoring.main(["--model", str(run), "--output", str(other), "--overwrite_output", "true"])  # told to
    assert json.loads(other.read_text())["key"]["model_dir"] == run.name
