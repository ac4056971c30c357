"""Red-team cases of issue 18: each hostile input at an entry point (CLI flags, output folders, checkpoints, data)
gets a one-line error naming the input and what is allowed, before any training starts, or works correctly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CONFIGS = str(ROOT / "configs" / "{stage}" / "tiny.yaml")


def refuse_training(*_, **__):
    raise AssertionError("training started")


# --- compare: options it sets per run ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "entry", "allowed"),
    [
        ("set", "seed=7", "--seeds"),
        ("set", "pretrain.seed=7", "--seeds"),
        ("set", "output_dir=/tmp/one", "--output_dir"),
        ("set", "dataset_seed=3", "--dataset_seed"),
        ("set", "model_name_or_path=/tmp/x", "--stages"),
        ("grid", "seed=1,2", "--seeds"),
    ],
)
def test_compare_refuses_options_it_sets_per_run(tmp_path, monkeypatch, where, entry, allowed):
    from plugformer.experiments import compare

    monkeypatch.setattr("plugformer.training.run_stage", refuse_training)
    kwargs = {"set": [entry]} if where == "set" else {"grid": [entry]}
    args = compare.CompareArguments(output_dir=str(tmp_path), seeds=[0, 1], stage_configs=CONFIGS, **kwargs)
    name = entry.partition("=")[0].rpartition(".")[2]
    with pytest.raises(ValueError, match=rf"--{where} {entry.split(',')[0]}.*compare sets {name!r} itself.*{allowed}"):
        compare.run(args)
    assert not (tmp_path / "runs").exists()


# --- convert: never onto its source, never "saved" without saving ------------------------------------------------


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


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


# --- training output folders: one run each, one live process each ------------------------------------------------


def pretrain(output_dir, *extra: str) -> dict:
    from test_training import PRETRAIN, TINY

    from plugformer.runtime.arguments import override_flags
    from plugformer.training import run_stage

    steps = [
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--eval_strategy",
        "no",
        "--dev_examples",
        "0",
        "--exact_match_examples",
        "0",
        "--max_steps",
        "2",
    ]
    return run_stage(
        "pretrain", override_flags(["--output_dir", str(output_dir), *TINY, *PRETRAIN], steps, list(extra))
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step pretraining run with checkpoint-2 (its folder is copied, never written to)."""
    directory = tmp_path_factory.mktemp("finished") / "run"
    pretrain(directory)
    return directory


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_a_second_run_into_an_occupied_folder_is_refused_before_training(finished, tmp_path, monkeypatch):
    from plugformer.training import pretrain as pretrain_module

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
    with caplog.at_level(logging.WARNING, logger="plugformer.training.outputs"):
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


def test_a_live_run_locks_its_folder_and_a_dead_ones_lock_is_taken_over(tmp_path, caplog, monkeypatch):
    import json
    import logging
    import socket
    import subprocess
    import sys

    from plugformer.training import pretrain as pretrain_module
    from plugformer.training.outputs import LOCK

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
    with caplog.at_level(logging.WARNING, logger="plugformer.training.outputs"):
        pretrain(tmp_path / "run")  # the same pid, now dead: a killed run's stale lock
    assert f"left by pid {live.pid}, which is no longer running; taking it over" in caplog.text
    assert not lock.exists()  # released when the run ended
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ValueError, match=r"locked by pid 1 on host elsewhere .* delete"):
        pretrain(tmp_path / "run", "--resume_from_checkpoint", "last")


# --- counts and options that silently meant something else -------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--max_steps", "-5"], r"--max_steps -5: expected a positive number of optimizer steps, or -1"),
        (["--max_steps", "0"], r"--max_steps 0: expected a positive number"),
        (["--max_steps", "-1", "--num_train_epochs", "0"], r"--num_train_epochs 0.0: expected a positive number"),
        (["--train_examples", "-3"], r"--train_examples -3: expected an integer >= 1"),
        (["--dev_examples", "-1"], r"--dev_examples -1: expected an integer >= 0"),
        (["--per_device_train_batch_size", "0"], r"--per_device_train_batch_size 0: expected an integer >= 1"),
        (["--gradient_accumulation_steps", "-2"], r"--gradient_accumulation_steps -2: expected an integer >= 1"),
        (["--learning_rate", "-0.001"], r"--learning_rate -0.001: expected a value >= 0"),
        (["--save_total_limit", "-1"], r"--save_total_limit -1: expected an integer >= 0"),
        (["--block_size", "1"], r"--block_size 1: expected an integer >= 2"),
        (["--mlm_probability", "1.5"], r"--mlm_probability 1.5: expected a rate between 0 and 1"),
    ],
)
def test_negative_and_zero_counts_are_refused_before_any_work(tmp_path, monkeypatch, flags, pattern):
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    with pytest.raises(ValueError, match=pattern):
        pretrain(tmp_path / "run", *flags)
    assert not (tmp_path / "run").exists()


def test_trl_stages_refuse_negative_counts_before_loading_the_model(tmp_path, monkeypatch):
    from plugformer.training import common, run_stage

    monkeypatch.setattr(common, "load_model", refuse_training)
    for stage, flags in (
        ("sft", ["--max_steps", "-5"]),
        ("dpo", ["--max_length", "-1"]),
        ("grpo", ["--max_completion_length", "-8"]),
    ):
        with pytest.raises(ValueError, match=rf"--{flags[0][2:]} {flags[1]}: expected"):
            run_stage(stage, ["--output_dir", str(tmp_path / stage), "--model_name_or_path", str(tmp_path), *flags])


def test_a_tokenizer_beside_a_model_is_refused_not_ignored(finished, tmp_path, monkeypatch):
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    with pytest.raises(ValueError, match=r"--tokenizer_name_or_path .*other beside --model_name_or_path .*model's own"):
        pretrain(
            tmp_path / "run", "--model_name_or_path", str(finished), "--tokenizer_name_or_path", str(tmp_path / "other")
        )


# --- resuming: older than reached, odd manifests ------------------------------------------------------------------


def test_resuming_behind_the_step_reached_warns_naming_both_steps(tmp_path, caplog):
    import logging
    import shutil

    run = tmp_path / "run"
    pretrain(run, "--max_steps", "4")
    shutil.rmtree(run / "checkpoint-4")  # the newest checkpoint removed by hand
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        pretrain(run, "--max_steps", "4", "--resume_from_checkpoint", "last")
    assert "RESUMING FROM AN OLDER STATE: this run had reached step 4" in caplog.text
    assert "newest intact checkpoint is checkpoint-2" in caplog.text and "steps 3-4 are trained again" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):  # back at step 4: nothing to say
        pretrain(run, "--max_steps", "4", "--resume_from_checkpoint", "last")
    assert "OLDER STATE" not in caplog.text


@pytest.mark.parametrize("manifest", ["[]", "{}", '{"model.safetensors": []}', "null"])
def test_a_manifest_that_vouches_for_nothing_is_skipped_not_a_crash(finished, tmp_path, caplog, manifest):
    import logging

    from plugformer.training.checkpoints import MANIFEST, last_good_checkpoint, verify_checkpoint

    run = copy_of(finished, tmp_path)
    (run / "checkpoint-2" / MANIFEST).write_text(manifest)
    assert "manifest" in verify_checkpoint(run / "checkpoint-2")
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        assert last_good_checkpoint(run) is None
    assert "skipping" in caplog.text and "reached step 2" in caplog.text


def test_a_checkpoint_without_a_manifest_is_not_picked_by_last(finished, tmp_path, caplog):
    import logging

    from plugformer.training.checkpoints import MANIFEST, last_good_checkpoint, verify_checkpoint

    run = copy_of(finished, tmp_path)
    (run / "checkpoint-2" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        assert last_good_checkpoint(run) is None
        assert "no checkpoint_manifest.json" in caplog.text and "pass its path" in caplog.text
        caplog.clear()
        assert verify_checkpoint(run / "checkpoint-2") is None  # an explicit path: checked, accepted with a warning
    assert "not its optimizer, scheduler or random states" in caplog.text


# --- offline: no connection leaves the machine --------------------------------------------------------------------


def test_a_stage_through_the_cli_opens_no_connection_off_the_machine(finished, tmp_path, monkeypatch):
    """Telemetry and Hub switches as a fresh shell has them (none set, not CI); every connection and name lookup
    is recorded, and any that is not loopback fails."""
    import ipaddress
    import socket
    import time

    import huggingface_hub.constants
    from huggingface_hub.utils import _telemetry
    from test_training import TINY, TRL

    from plugformer.cli import main

    for name in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "DISABLE_TELEMETRY",
        "USE_HUB_KERNELS",
        "CI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", False)
    attempts = []

    def loopback(host) -> bool:
        if host in (None, "", "localhost") or isinstance(host, bytes):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            attempts.append(address)
            raise OSError(f"test guard: connection to {address} refused")
        return real_connect(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not loopback(host):
            attempts.append(host)
            raise socket.gaierror(f"test guard: lookup of {host} refused")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    main(["train", "sft", "--output_dir", str(tmp_path / "sft"), "--model_name_or_path", str(finished), *TINY, *TRL])
    deadline = time.time() + 10  # telemetry is sent from a daemon thread: let its queue drain
    while _telemetry._TELEMETRY_QUEUE.unfinished_tasks and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "sft" / "run_info.json").exists()
    assert attempts == []


def hub_kernels_enabled(environ: dict[str, str], monkeypatch) -> bool:
    """transformers' own answer to "fetch Hub kernels?" under `environ`: 5.25 reads `USE_HUB_KERNELS` at each call
    (`_kernels_enabled()`, default on), 5.19-5.24 once at import, against `ENV_VARS_TRUE_VALUES` (default on)."""
    from transformers.integrations import hub_kernels
    from transformers.utils.import_utils import ENV_VARS_TRUE_VALUES

    if callable(hub_kernels._kernels_enabled):
        monkeypatch.delenv("USE_HUB_KERNELS", raising=False)  # conftest's "NO", unless `environ` names it
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        return hub_kernels._kernels_enabled()
    return environ.get("USE_HUB_KERNELS", "YES").upper() in ENV_VARS_TRUE_VALUES


def test_the_offline_defaults_turn_hub_kernels_off_unless_the_user_turned_them_on(monkeypatch):
    from plugformer.runtime.offline import apply_offline_defaults

    conftests = os.environ["USE_HUB_KERNELS"]  # read first: the helper's monkeypatch changes the environment
    environ: dict[str, str] = {}
    assert apply_offline_defaults(environ) == {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "USE_HUB_KERNELS": "NO",
    }
    assert not hub_kernels_enabled(environ, monkeypatch)
    assert hub_kernels_enabled({}, monkeypatch)  # transformers' default, which the defaults override
    mine = {"USE_HUB_KERNELS": "YES"}
    assert "USE_HUB_KERNELS" not in apply_offline_defaults(mine) and mine["USE_HUB_KERNELS"] == "YES"
    assert not hub_kernels_enabled({"USE_HUB_KERNELS": conftests}, monkeypatch)


@pytest.mark.parametrize("score,scheme", [("scaled_dot", "rope"), ("additive", "t5_bias"), ("multiplicative", "alibi")])
def test_no_plugformer_layer_names_a_hub_kernel(score, scheme):
    """transformers 5.25 kernelizes, by default at load, the layers its `use_kernel_forward_from_hub` marked (the
    mark is a `kernel_layer_name` class attribute; from 5.25, where `kernels` is a dependency, the activations of
    `ACT2FN` carry it): plugformer's own layers carry none, so only transformers' activation modules, the ones Llama's
    MLP holds too, can be swapped for a Hub kernel of the same function, and never where `USE_HUB_KERNELS` is off."""
    from conftest import tiny_config

    from plugformer import PlugformerForCausalLM

    model = PlugformerForCausalLM(tiny_config(score, scheme))
    marked = {type(module) for module in model.modules() if hasattr(type(module), "kernel_layer_name")}
    assert all(kind.__module__ == "transformers.activations" for kind in marked), marked


# --- late and unclear errors ---------------------------------------------------------------------------------------


def one_line_error(capsys, argv: list[str]) -> str:
    """Runs the CLI, which must exit with status 2 and print one line (the traceback is behind --debug)."""
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in error[0], error
    return error[0]


def test_eval_on_a_missing_or_non_model_folder_says_so(tmp_path, capsys):
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "missing")])
    assert line.startswith("ValueError: --model ") and "no such folder" in line
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello\n")
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "notes")])
    assert "is not a saved model folder (no config.json or tokenizer_config.json)" in line


def test_user_errors_print_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from plugformer.cli import main

    line = one_line_error(capsys, ["train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])
    assert line.startswith("ValueError: --max_steps -5: expected") and "PLUGFORMER_DEBUG=1" in line
    with pytest.raises(ValueError, match="max_steps -5"):
        main(["--debug", "train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])
    monkeypatch.setenv("PLUGFORMER_DEBUG", "1")
    with pytest.raises(ValueError, match="max_steps -5"):
        main(["train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])


def jsonl(path: Path, rows: list) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"", "the file is empty"),
        (b"\n  \n", "the file is empty"),
        ('{"text": "caf\xe9 au lait"}\n'.encode("latin-1"), r"not UTF-8 text \(byte 13 is b'\\xe9'\)"),
        (b'{"text": "a"}\n{"text": null}\n', r"column 'text' is null in row 1 of the train split"),
    ],
    ids=["empty", "blank", "latin-1", "null-text"],
)
def test_bad_jsonl_is_named_before_training(tmp_path, monkeypatch, content, pattern):
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_training)
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError, match=rf"--data_files {data}: {pattern}|--data_files {data}.*{pattern}"):
        pretrain(
            tmp_path / "run",
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--dev_examples",
            "0",
            "--test_examples",
            "0",
        )


def test_missing_data_file_and_sft_with_other_columns_are_named(finished, tmp_path, monkeypatch):
    from plugformer.training import common, run_stage

    monkeypatch.setattr(common, "atomic_checkpoints", refuse_training)  # the trainer is never built
    argv = ["--output_dir", str(tmp_path / "sft"), "--model_name_or_path", str(finished), "--dataset_name", "json"]
    with pytest.raises(ValueError, match=r"--data_files .*nowhere.jsonl: no such file"):
        run_stage("sft", [*argv, "--data_files", str(tmp_path / "nowhere.jsonl")])
    data = jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(40)])
    with pytest.raises(
        ValueError,
        match=r"stage 'sft' needs the columns text \| messages \| prompt\+completion"
        r".*it has \['question', 'answer'\]",
    ):
        run_stage("sft", [*argv, "--data_files", str(data), "--dev_examples", "2", "--test_examples", "2"])


# --- JSON state is written whole or not at all ---------------------------------------------------------------------


def test_a_failed_state_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno
    import json

    from plugformer.runtime import files

    state = tmp_path / "run_info.json"
    files.write_json_atomic(state, {"step": 1})

    def disk_full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        files.write_json_atomic(state, {"step": 2, "padding": "x" * 10_000})
    assert json.loads(state.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run_info.json"]


def test_run_state_and_eval_results_are_published_by_a_rename(finished, tmp_path, monkeypatch):
    import os

    from plugformer.cli import main

    renamed = []
    real_replace = os.replace

    def recording_replace(source, target, *args, **kwargs):
        renamed.append(Path(target).name)
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", recording_replace)
    pretrain(tmp_path / "run")
    assert {"run_info.json", "trainer_state.json", "last_checkpoint.json"} <= set(renamed)
    main(["eval", "--model", str(tmp_path / "run"), "--examples", "2", "--max_new_tokens", "4"])
    assert "eval_test.json" in renamed


@pytest.mark.parametrize(
    ("flags", "split"),
    [
        (["--dev_examples", "1", "--block_size", "128"], "dev"),
        (["--train_examples", "1", "--block_size", "128"], "train"),
    ],
)
def test_a_split_shorter_than_one_block_is_refused_before_training(tmp_path, monkeypatch, flags, split):
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "train", refuse_training)
    with pytest.raises(ValueError, match=rf"the {split} split \(1 documents\) holds fewer than block_size=\d+ tokens"):
        pretrain(tmp_path / "run", "--eval_strategy", "steps", "--eval_steps", "1", *flags)
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_no_json_file_is_written_in_place():
    """Every JSON file plugformer writes goes through `plugformer.runtime.files` (a temporary file renamed over the target):
    no `write_text(json.dumps(...))` or `json.dump(..., handle)` is left in the package."""
    import re

    in_place = re.compile(r"write_text\(\s*json\.dumps|json\.dump\(|\.save_to_json\(")
    offenders = []
    for path in sorted((ROOT / "src" / "plugformer").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if in_place.search(line) and "staged" not in line:  # inside a checkpoint's staging area: published whole
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_compare_merges_config_overrides_with_config_fields_of_the_grid():
    from plugformer.experiments.grid import route

    argv = route({"config_overrides": "ffn_type=mlp", "norm_type": "layernorm"}, ["pretrain"])
    assert argv["pretrain"] == ["--config_overrides", "ffn_type=mlp,norm_type=layernorm"]  # one flag, both fields
    with pytest.raises(ValueError, match=r"\['norm_type'\] set more than once"):
        route({"config_overrides": "norm_type=rmsnorm", "norm_type": "layernorm"}, ["pretrain"])


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    """`plugformer demo --config configs/demo.yaml` worked only from the repository root (issue 17 item 9)."""
    from plugformer.experiments.demo import DemoArguments
    from plugformer.runtime.arguments import config_path, parse_arguments
    from plugformer.training import parse_stage_arguments

    monkeypatch.chdir(tmp_path)
    assert parse_arguments(DemoArguments, ["--config", "configs/demo.yaml"], prog="demo").position_scheme == "alibi"
    script_args, _, _ = parse_stage_arguments("sft", ["--config", "configs/sft/tiny.yaml", "--output_dir", "o"])
    assert script_args.pass_at_k_samples == 8
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/demo.yaml").write_text("max_steps: 3\n")  # a file where the user is wins
    assert parse_arguments(DemoArguments, ["--config", "configs/demo.yaml"], prog="demo").max_steps == 3
    with pytest.raises(FileNotFoundError, match=r"--config configs/nope.yaml: no such file \(looked in "):
        config_path("configs/nope.yaml")


@pytest.mark.parametrize("head", ["causal", "masked", "seq2seq", "classification"])
def test_labels_out_of_range_name_labels(head):
    """Labels past the vocabulary (or the classes) raised torch's IndexError naming neither (issue 18 item 6)."""
    import torch

    from plugformer import (
        PlugformerForCausalLM,
        PlugformerForConditionalGeneration,
        PlugformerForMaskedLM,
        PlugformerForSequenceClassification,
    )
    from tests.conftest import tiny_config

    classes = {
        "causal": PlugformerForCausalLM,
        "masked": PlugformerForMaskedLM,
        "seq2seq": PlugformerForConditionalGeneration,
        "classification": PlugformerForSequenceClassification,
    }
    extra = {
        "masked": {"is_causal": False},
        "seq2seq": {"is_encoder_decoder": True, "pad_token_id": 0},
        "classification": {"num_labels": 3, "pad_token_id": 0},
    }.get(head, {})
    model = classes[head](tiny_config(**extra)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 5))
    limit = 3 if head == "classification" else model.config.vocab_size
    good = torch.tensor([0, 2]) if head == "classification" else ids.index_fill(1, torch.tensor([0]), -100)
    bad = torch.tensor([0, limit]) if head == "classification" else ids.clone().fill_(limit)
    assert torch.isfinite(model(input_ids=ids, labels=good).loss)
    with pytest.raises(ValueError, match=rf"labels holds {limit}, outside \[0, {limit - 1}\]"):
        model(input_ids=ids, labels=bad)


# --- a finished training run is saved before anything can fail after it --------------------------------------------


def test_an_evaluation_failure_after_training_keeps_the_saved_model_and_says_where(tmp_path, monkeypatch, caplog):
    """The dev evaluation ran before the final save: an error there lost the whole training run (issue 18)."""
    import logging

    from transformers import Trainer

    def broken_evaluate(*_, **__):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(Trainer, "evaluate", broken_evaluate)
    with caplog.at_level(logging.ERROR, logger="plugformer.training.common"), pytest.raises(RuntimeError) as raised:
        pretrain(tmp_path / "run", "--dev_examples", "8", "--block_size", "16")
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "config.json").is_file()
    where = f"the trained model is saved in {tmp_path / 'run'}"
    assert any(where in note for note in raised.value.__notes__) and where in caplog.text
    assert not (tmp_path / "run" / "run_info.json").exists()  # not recorded as a finished stage


# --- --test_examples 0: no held-out table, said so; refused where a test split is needed ---------------------------


def test_pipeline_with_test_examples_0_reports_no_test_scores(finished, tmp_path, capsys):
    """`plugformer pipeline --test_examples 0` ended in KeyError: 'test' after the stage had trained (issue 18)."""
    import json
    import shutil

    import torch

    from plugformer.experiments import pipeline
    from plugformer.runtime.files import write_json_atomic

    args = pipeline.PipelineArguments(
        output_dir=str(tmp_path / "pipeline"),
        stages=["pretrain"],
        test_examples=0,
        stage_configs=CONFIGS,
        max_new_tokens=4,
    )
    shutil.copytree(finished, tmp_path / "pipeline" / "pretrain")  # a finished stage, recorded as this one: reused
    argv = pipeline.stage_argv(args, "pretrain")
    record = pipeline.finished_record(args, "pretrain", pipeline.stage_record(args, "pretrain", argv))
    write_json_atomic(tmp_path / "pipeline" / "pretrain" / pipeline.RECORD, record)
    results = pipeline.run(args)
    assert "reusing" in capsys.readouterr().out
    assert "exact_match" not in results["pretrain"] and results["pretrain"]["gain"] is None
    table = (tmp_path / "pipeline" / "results.md").read_text()
    assert table.startswith("no held-out test scores (--test_examples 0)") and "| pretrain | — |" in table
    assert json.loads((tmp_path / "pipeline" / "results.json").read_text())["pretrain"]["train_seconds"] >= 0
    # the wall time is recorded beside the machine's matmul rate, without which it compares with nothing
    run = json.loads((tmp_path / "pipeline" / pipeline.RUN_RECORD).read_text())
    assert run["wall_seconds"] >= 0 and run["jobs"] == 1 and run["machine"]["matmul_gflops"] > 0
    assert run["machine"]["threads"] == torch.get_num_threads()
    # measured before and after the run, the mean of the two in front
    before, after = run["machine"]["matmul_gflops_before"], run["machine"]["matmul_gflops_after"]
    assert before > 0 and after > 0 and run["machine"]["matmul_gflops"] == pytest.approx((before + after) / 2, abs=0.06)


@pytest.mark.parametrize(
    ("entry", "field", "value", "pattern"),
    [
        ("pipeline", "test_examples", -1, r"--test_examples -1: expected an integer >= 0"),
        ("compare", "test_examples", 0, r"test_examples=0: expected at least 1"),
        ("compare", "dev_examples", 0, r"dev_examples=0: expected at least 1"),
        ("extrapolate", "test_examples", 0, r"test_examples=0: expected at least 1"),
    ],
)
def test_zero_test_examples_is_refused_where_a_test_split_is_needed(entry, field, value, pattern):
    from plugformer.experiments.compare import CompareArguments
    from plugformer.experiments.extrapolation import ExtrapolationArguments
    from plugformer.experiments.pipeline import PipelineArguments

    arguments = {"pipeline": PipelineArguments, "compare": CompareArguments, "extrapolate": ExtrapolationArguments}
    with pytest.raises(ValueError, match=pattern):
        arguments[entry](**{field: value})


def test_eval_of_zero_examples_is_refused_before_loading(finished, capsys):
    line = one_line_error(capsys, ["eval", "--model", str(finished), "--examples", "0"])
    assert line.startswith("ValueError: --examples 0: expected an integer >= 1")


# --- YAML values are typed: a value of the wrong type is refused naming the file and the key -----------------------


@pytest.mark.parametrize(
    ("entry", "text", "pattern"),
    [
        ("pretrain", 'learning_rate: "abc"', r"learning_rate: 'abc' is a YAML str; expected float"),
        ("pretrain", 'max_steps: "10"', r"max_steps: '10' is a YAML str; expected int"),
        ("pretrain", 'overwrite_output_dir: "yes"', r"overwrite_output_dir: 'yes' is a YAML str; expected bool"),
        ("pretrain", "save_strategy: no", r"save_strategy: False is a YAML bool; expected str .*quote it"),
        ("pretrain", "data_files: a.jsonl", r"data_files: 'a.jsonl' is a YAML str; expected a list of str or null"),
        ("pretrain", "train_examples: 2.5", r"train_examples: 2.5 is a YAML float; expected int"),
        ("grpo", "num_generations: 2.5", r"num_generations: 2.5 is a YAML float; expected int or null"),
        ("grpo", "env: [A]", r"env: \['A'\]: expected a mapping"),
        ("pipeline", "stages: grpo", r"stages: 'grpo' is a YAML str; expected a list of str"),
        ("demo", 'max_steps: "10"', r"max_steps: '10' is a YAML str; expected int"),
    ],
)
def test_a_wrong_typed_yaml_value_is_refused_naming_file_key_and_type(tmp_path, monkeypatch, entry, text, pattern):
    """argparse converted string YAML values ('10' -> 10, 'yes' -> True), dumped its usage for 'abc' without naming
    the file, and left a string for a list field a string (`stages: grpo` ran stages 'g', 'r', ...) (issue 18)."""
    from plugformer.training import common
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    monkeypatch.setattr(common, "load_model", refuse_training)
    monkeypatch.setattr("plugformer.experiments.pipeline.run", refuse_training)
    monkeypatch.setattr("plugformer.experiments.demo.run", refuse_training)
    config = tmp_path / "config.yaml"
    config.write_text(text + "\n")
    argv = {
        "pretrain": ["train", "pretrain", "--output_dir", str(tmp_path / "run")],
        "grpo": ["train", "grpo", "--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(tmp_path)],
        "pipeline": ["pipeline", "--output_dir", str(tmp_path / "run")],
        "demo": ["demo"],
    }[entry]
    with pytest.raises(ValueError, match=rf"--config {config}: {pattern}"):
        from plugformer.cli import main

        main(["--debug", *argv, "--config", str(config)])
    assert not (tmp_path / "run").exists()


def test_yaml_floats_without_a_dot_and_command_line_strings_still_convert(tmp_path):
    from plugformer.experiments.pipeline import PipelineArguments
    from plugformer.runtime.arguments import parse_arguments
    from plugformer.training import parse_stage_arguments

    config = tmp_path / "config.yaml"
    config.write_text("learning_rate: 1e-3\nnum_train_epochs: 2\nreport_to: none\n")  # PyYAML alone: '1e-3' a str
    flags = [
        "--max_steps",
        "10",
        "--bf16",
        "false",
        "--dataset_name",
        "json",
        "--data_files",
        "a.jsonl",
        "b.jsonl",
        "--num_generations",
        "4",
    ]
    script, _, training = parse_stage_arguments("grpo", ["--config", str(config), "--output_dir", "o", *flags])
    assert (training.learning_rate, training.num_train_epochs, training.max_steps) == (1e-3, 2, 10)
    assert (training.bf16, training.num_generations, script.data_files) == (False, 4, ["a.jsonl", "b.jsonl"])
    args = parse_arguments(PipelineArguments, ["--stages", "pretrain", "sft", "--rerun", "yes"], prog="pipeline")
    assert args.stages == ["pretrain", "sft"] and args.rerun is True


# --- a full disk: one line naming what was written, the space free and what is intact -----------------------------


def full_disk_cli(tmp_path, capsys, monkeypatch, *flags) -> str:
    """A 4-step pretraining run through the CLI (checkpoints at steps 2 and 4) under a disk that fills as set up by
    the caller; returns the one line printed."""
    import shutil

    from test_training import PRETRAIN, TINY

    from plugformer.runtime.arguments import override_flags

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=12_345))  # what a full disk reports
    steps = [
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--eval_strategy",
        "no",
        "--dev_examples",
        "0",
        "--exact_match_examples",
        "0",
        "--max_steps",
        "4",
    ]
    argv = [
        "train",
        "pretrain",
        *override_flags(["--output_dir", str(tmp_path / "run"), *TINY, *PRETRAIN], steps, list(flags)),
    ]
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    error = capsys.readouterr().err  # the data-loading progress bars come before the error on stderr
    assert exited.value.code == 2 and "Traceback" not in error
    return error.strip().splitlines()[-1]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_says_so(tmp_path, capsys, monkeypatch):
    """torch.save's short write ('PytorchStreamWriter failed writing file ...') reached the user as raw torch text,
    with the partial checkpoint left in the staging area (issue 18)."""
    import torch

    from plugformer.training.checkpoints import STAGING, verify_checkpoint

    real_save = torch.save

    def filling_save(value, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            Path(path).write_bytes(b"partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:659] . PytorchStreamWriter failed writing file "
                "data/0: file write failed"
            )
        return real_save(value, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling_save)
    line = full_disk_cli(tmp_path, capsys, monkeypatch)
    run = tmp_path / "run"
    assert line.startswith(
        f"DiskFullError: [Errno 28] writing a checkpoint to {run / 'checkpoint-4'}: the disk is full"
    )
    assert "12.1 KiB free on the file system of" in line
    assert "checkpoint-2 (step 2) is intact: free some space and resume with --resume_from_checkpoint last" in line
    assert verify_checkpoint(run / "checkpoint-2") is None  # the earlier checkpoint really is whole
    assert not (run / "checkpoint-4").exists() and not (run / STAGING).exists()  # the partial one is gone


def test_a_full_disk_during_the_final_save_names_the_folder_and_the_intact_checkpoint(tmp_path, capsys, monkeypatch):
    """safetensors' IoError on the final model, and an ENOSPC from a state file, each get one line."""
    import errno

    import transformers.modeling_utils
    from safetensors import SafetensorError

    from plugformer.runtime import files

    real_save_file = transformers.modeling_utils.safe_save_file

    def filling_save_file(tensors, filename, *args, **kwargs):
        if ".staging" not in str(filename):  # checkpoints go through the staging area; the final model does not
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                'space left on device" })'
            )
        return real_save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", filling_save_file)
    line = full_disk_cli(tmp_path, capsys, monkeypatch)
    assert line.startswith(
        f"DiskFullError: [Errno 28] writing the trained model to {tmp_path / 'run'}: the disk is "
        "full (No space left on device)"
    )
    assert "the model files in it are incomplete; checkpoint-4 (step 4) is intact" in line

    state = tmp_path / "run_info.json"
    files.write_json_atomic(state, {"step": 1})

    def no_space(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(
        files.DiskFullError,
        match=r"writing run_info.json to .*run_info.json: the disk is full .* "
        r"free on .*; the previous run_info.json is intact",
    ):
        files.write_json_atomic(state, {"step": 2})
    assert state.read_text() == '{"step": 1}\n'


def test_only_out_of_space_errors_are_renamed():
    import errno

    from plugformer.runtime.files import is_out_of_space

    assert is_out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), "/")
    assert not is_out_of_space(OSError(errno.EACCES, "Permission denied"), "/")
    assert not is_out_of_space(RuntimeError("PytorchStreamWriter failed writing file data/0"), "/")  # space is free
    assert not is_out_of_space(ValueError("something else"), "/")


# --- a config that cannot fit in memory is refused before it is built ---------------------------------------------


def size_variants():
    """(head, config fields): every score function and position scheme, both norms, placements and feed-forwards,
    biases, GQA, an explicit head_dim, untied heads, the encoder heads and the seq2seq model."""
    from plugformer.positions import POSITION_SCHEMES
    from plugformer.scores import ATTENTION_SCORES

    variants = [("causal_lm", {"attention_score": score}) for score in ATTENTION_SCORES.names()]
    variants += [("causal_lm", {"position_scheme": scheme}) for scheme in POSITION_SCHEMES.names()]
    variants += [
        (
            "causal_lm",
            {
                "norm_type": "layernorm",
                "norm_placement": "post",
                "ffn_type": "mlp",
                "attention_bias": True,
                "mlp_bias": True,
                "tie_word_embeddings": False,
                "num_key_value_heads": 1,
                "head_dim": 12,
            },
        ),
        ("causal_lm", {"attention_score": "additive", "ffn_type": "glu", "mlp_bias": True, "num_key_value_heads": 2}),
        ("masked_lm", {"is_causal": False, "position_scheme": "clamped_bias", "tie_word_embeddings": False}),
        ("sequence_classification", {"is_causal": False, "num_labels": 3, "pad_token_id": 0}),
        ("token_classification", {"is_causal": False, "num_labels": 5, "position_scheme": "learned"}),
        (
            "seq2seq",
            {
                "is_encoder_decoder": True,
                "pad_token_id": 0,
                "position_scheme": "t5_bias",
                "num_decoder_layers": 3,
                "attention_score": "multiplicative",
            },
        ),
        (
            "seq2seq",
            {
                "is_encoder_decoder": True,
                "pad_token_id": 0,
                "position_scheme": "clamped_bias",
                "tie_word_embeddings": False,
                "attention_score": "additive",
                "attention_bias": True,
            },
        ),
    ]
    return variants


def test_the_closed_form_parameter_count_equals_real_models():
    from plugformer import (
        PlugformerForCausalLM,
        PlugformerForConditionalGeneration,
        PlugformerForMaskedLM,
        PlugformerForSequenceClassification,
        PlugformerForTokenClassification,
    )
    from plugformer.runtime.memory import parameter_count
    from tests.conftest import tiny_config

    classes = {
        "causal_lm": PlugformerForCausalLM,
        "masked_lm": PlugformerForMaskedLM,
        "sequence_classification": PlugformerForSequenceClassification,
        "token_classification": PlugformerForTokenClassification,
        "seq2seq": PlugformerForConditionalGeneration,
    }
    for head, fields in size_variants():
        config = tiny_config(
            **{
                "score": fields.pop("attention_score", "scaled_dot"),
                "scheme": fields.pop("position_scheme", "rope"),
                **fields,
            }
        )
        model = classes[head](config)
        assert parameter_count(config, head) == sum(p.numel() for p in model.parameters()), (head, fields)


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(tmp_path, monkeypatch, llama_source):
    """A config that would allocate tens of GB went ahead until the allocator failed, or the machine swapped."""
    from transformers import Trainer

    from plugformer.experiments.demo import DemoArguments, build_model
    from plugformer.integrations.convert import convert
    from plugformer.runtime import memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: (2**30, "this machine has"))
    monkeypatch.setattr(Trainer, "train", refuse_training)
    big = ["--hidden_size", "8192", "--num_hidden_layers", "48", "--num_attention_heads", "64"]
    with pytest.raises(
        ValueError,
        match=r"pretrain: vocab_size=300, hidden_size=8192, intermediate_size=21888, "
        r"num_hidden_layers=48, .* make 32\.47B parameters, which need at least "
        r"483\.8 GiB \(16 bytes each: fp32 weights, gradients and AdamW's two "
        r"moments\) but this machine has 1\.0 GiB available; .*"
        r"PLUGFORMER_SKIP_MEMORY_CHECK=1",
    ):
        pretrain(tmp_path / "run", *big)

    class Tokenizer:  # what build_model reads of one
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return 512

    with pytest.raises(ValueError, match=r"plugformer demo: .*hidden_size=16384.*need at least"):
        build_model(DemoArguments(hidden_size=16384, num_attention_heads=64, num_key_value_heads=8), Tokenizer())
    monkeypatch.setattr(memory, "available_memory", lambda device=None: (1000, "this machine has"))
    with pytest.raises(
        ValueError,
        match=r"convert \(the source model and its conversion\): .*4 bytes each: fp32 "
        r"weights, 2 models\) but this machine has 1000 B available",
    ):
        convert(llama_source, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
    monkeypatch.setenv(memory.OVERRIDE, "1")  # the documented override builds it anyway
    assert convert(llama_source, tmp_path / "converted").num_parameters() > 0


def test_tensor_parallel_is_refused_where_transformers_plans_are_not_verified(monkeypatch):
    """transformers 5.19's plans shard plugformer's models wrongly (its TP runs failed): tp_size > 1 is refused at
    construction, naming the release, wherever compat does not vouch for the plans."""
    from conftest import tiny_config
    from transformers.distributed import DistributedConfig

    from plugformer import PlugformerForCausalLM, attention

    monkeypatch.setattr(attention, "TENSOR_PARALLEL_VERIFIED", False)
    config = tiny_config("scaled_dot", "rope")
    config.distributed_config = DistributedConfig(tp_size=2)  # what from_pretrained(tp_plan=...) sets
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp_size=2\) needs transformers>=5.24"):
        PlugformerForCausalLM(config)
    config.distributed_config = DistributedConfig(tp_size=1)
    PlugformerForCausalLM(config)
