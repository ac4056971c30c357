"""Issue 34 (round 3 of "nothing lost, nothing silently wrong") and issue 35's resume cases: each test failed before
its fix. Data loss, silently wrong results, a network leak, hangs, and tracebacks where one line naming the input
belongs."""

from __future__ import annotations

import re

import pytest


# --- network: offline stays the default whatever else is set -------------------------------------------------------


@pytest.mark.parametrize("other", ["HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DISABLE_TELEMETRY"])
@pytest.mark.parametrize("value", ["1", "0"])
def test_another_libraries_switch_does_not_turn_plugformers_offline_default_off(other, value):
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {other: value}
    applied = apply_offline_defaults(environ)
    assert environ["HF_HUB_OFFLINE"] == "1" and environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert applied == {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "USE_HUB_KERNELS": "NO"}


def test_only_the_documented_switch_turns_the_hub_back_on():
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}
    assert apply_offline_defaults(environ) == {"HF_HUB_DISABLE_TELEMETRY": "1", "USE_HUB_KERNELS": "NO"}
    assert environ["HF_HUB_OFFLINE"] == "0"
    environ = {"HF_HUB_OFFLINE": ""}  # set but empty: the libraries read it as unset, so it is no opt-in
    apply_offline_defaults(environ)
    assert environ["HF_HUB_OFFLINE"] == "1"


def test_the_imported_hub_is_switched_offline_when_the_user_set_only_datasets_offline(monkeypatch):
    import os

    import huggingface_hub.constants

    from plugformer.runtime.offline import apply_offline_defaults

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    apply_offline_defaults()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True


# --- data loss: one output-folder rule for every command that writes a model ---------------------------------------


def refuse_work(*_, **__):
    raise AssertionError("work started")


def snapshot(directory) -> dict:
    from pathlib import Path

    directory = Path(directory)
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def pretrain(output_dir, *extra: str) -> dict:
    from test_training import PRETRAIN, TINY

    from plugformer.runtime.arguments import override_flags
    from plugformer.training import run_stage

    quick = ["--eval_strategy", "no", "--dev_examples", "0", "--exact_match_examples", "0", "--max_steps", "2"]
    return run_stage(
        "pretrain", override_flags(["--output_dir", str(output_dir), *TINY, *PRETRAIN], quick, list(extra))
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two finished 2-step pretraining runs: `checkpointed` (checkpoint-2) and `final_only` (no checkpoint); copied,
    never written to."""
    root = tmp_path_factory.mktemp("runs")
    pretrain(root / "checkpointed", "--save_strategy", "steps", "--save_steps", "2")
    pretrain(root / "final_only")
    return root


def copy_run(runs, name, tmp_path):
    import shutil

    shutil.copytree(runs / name, tmp_path / name)
    return tmp_path / name


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
    from plugformer.training.outputs import LOCK, RUN_RECORD

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


def test_a_stage_resuming_in_another_stages_folder_is_refused(runs, tmp_path, monkeypatch):
    from test_training import TINY, TRL

    from plugformer.training import common, run_stage

    run = copy_run(runs, "checkpointed", tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(common, "load_model", refuse_work)
    with pytest.raises(ValueError, match=r"holds a 'pretrain' run \(run_info.json\), not a 'sft' one"):
        run_stage(
            "sft",
            [
                "--model_name_or_path",
                str(run),
                "--output_dir",
                str(run),
                "--resume_from_checkpoint",
                "last",
                *TINY,
                *TRL,
            ],
        )
    with pytest.raises(ValueError, match=r"holds a 'pretrain' run"):  # an explicit checkpoint of another stage too
        run_stage(
            "sft",
            [
                "--model_name_or_path",
                str(run),
                "--output_dir",
                str(tmp_path / "sft"),
                "--resume_from_checkpoint",
                str(run / "checkpoint-2"),
                *TINY,
                *TRL,
            ],
        )
    assert snapshot(run) == before


def test_resuming_a_finished_run_without_checkpoints_does_not_retrain_it(runs, tmp_path, monkeypatch):
    from plugformer.training import pretrain as pretrain_module

    run = copy_run(runs, "final_only", tmp_path)
    before = snapshot(run)
    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=r"nothing to resume in .*'pretrain' run finished .* saved no checkpoint"):
        pretrain(run, "--resume_from_checkpoint", "last")
    assert snapshot(run) == before


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--attention_score", "additive"], "attention_score: 'scaled_dot' -> 'additive'"),
        (["--position_scheme", "alibi"], "position_scheme: 'rope' -> 'alibi'"),
        (["--hidden_size", "48"], "hidden_size: 32 -> 48"),  # a changed architecture: once an optimizer-group error
    ],
)
def test_resuming_with_another_variant_or_size_is_refused_naming_both_sides(runs, tmp_path, flags, named):
    from plugformer.training import checkpoints

    run = copy_run(runs, "checkpointed", tmp_path)
    weights = (run / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=rf"checkpoint-2 was trained with another model \(.*{named}"):
        pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "4", *flags)
    assert (run / "model.safetensors").read_bytes() == weights
    assert checkpoints.last_good_checkpoint(run).endswith("checkpoint-2")


def test_resuming_the_same_variant_still_continues(runs, tmp_path):
    run = copy_run(runs, "checkpointed", tmp_path)
    info = pretrain(run, "--resume_from_checkpoint", "last", "--max_steps", "3")
    assert info["stage"] == "pretrain" and (run / "checkpoint-2").is_dir()


# --- the same rule for convert, and for eval's results and the score caches ----------------------------------------


def test_convert_refuses_a_folder_holding_a_stage_or_a_live_run(runs, tmp_path, llama_source):
    import os
    import socket

    from plugformer.integrations.convert import convert
    from plugformer.training.outputs import LOCK

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
    from plugformer.training.outputs import LOCK, RUN_RECORD

    run = copy_run(runs, "checkpointed", tmp_path)
    (run / "eval_test.json").write_text('{"model": "run", "split": "test", "exact_match": 0.5}\n')
    main(["convert", str(llama_source), str(run), *flags])
    # before: the converted model sat beside the pretrain run's record, checkpoint and scores, read as theirs
    assert not (run / "run_info.json").exists() and not list(run.glob("checkpoint-*"))
    assert not (run / "eval_test.json").exists()
    assert json.loads((run / RUN_RECORD).read_text()) == {"stage": "convert"} and not (run / LOCK).exists()
    assert json.loads((run / "config.json").read_text())["model_type"] == "plugformer"


def test_a_claim_judges_the_folder_again_once_locked(tmp_path, monkeypatch):
    from plugformer.training import outputs

    folder = tmp_path / "out"
    real_acquire = outputs.acquire_lock

    def another_run_finishes_meanwhile(output_dir):
        (folder / "config.json").write_text("{}\n")  # written between the first look and the lock
        return real_acquire(output_dir)

    folder.mkdir()
    monkeypatch.setattr(outputs, "acquire_lock", another_run_finishes_meanwhile)
    with pytest.raises(ValueError, match=r"already holds another run \(config.json"):
        outputs.claim_folder(str(folder), "demo")
    assert sorted(p.name for p in folder.iterdir() if p.name != outputs.TAKEOVER) == ["config.json"]


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


def test_the_score_caches_are_keyed_by_the_models_config_and_tokenizer_too(tmp_path):
    from plugformer.experiments.compare import CompareArguments, score_key
    from plugformer.experiments.extrapolation import ExtrapolationArguments, evaluation_key

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text('{"position_scheme": "rope"}')
    (tmp_path / "tokenizer.json").write_text('{"vocab": 1}')
    keys = lambda: (score_key(CompareArguments(), tmp_path, "test"), evaluation_key(ExtrapolationArguments(), tmp_path))  # noqa: E731
    first = keys()
    assert keys() == first
    (tmp_path / "run_info.json").write_text("{}")  # a record beside the model changes no score
    assert keys() == first
    (tmp_path / "config.json").write_text('{"position_scheme": "nope"}')  # same weights, another model
    second = keys()
    assert second[0] != first[0] and second[1] != first[1]
    (tmp_path / "tokenizer.json").write_text('{"vocab": 2}')
    third = keys()
    assert third[0] != second[0] and third[1] != second[1]


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
from plugformer.training.outputs import acquire_lock
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

    from plugformer.training.outputs import LOCK

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


# --- silently wrong -------------------------------------------------------------------------------------------------


def test_dev_selection_under_fsdp2_hands_on_the_selected_step_whole(tmp_path):
    """The root module's parameters (embeddings, final norm, LM head) were the last step's, the layers the selected
    step's: FSDP2 leaves the root unsharded after a forward, and the restore wrote into the unsharded copies."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_fsdp import ENV, free_port

    worker = Path(__file__).with_name("selection_fsdp_worker.py")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    result = subprocess.run(
        [*torchrun, str(worker), str(tmp_path / "out.json")], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads((tmp_path / "out.json").read_text())
    assert outcome["parameters"] > 10 and outcome["differ"] == []


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (["--learning_rate", "inf"], r"--learning_rate inf: expected a finite number"),
        (["--learning_rate", "nan"], r"--learning_rate nan: expected a finite number"),
        (["--max_grad_norm", "nan"], r"--max_grad_norm nan: expected a finite number"),
        (["--weight_decay", "-1"], r"--weight_decay -1.0: expected a value >= 0"),
        (["--adam_beta2", "1.5"], r"--adam_beta2 1.5: expected a value in \[0, 1\]"),
        (["--direct_answer_fraction", "nan"], r"--direct_answer_fraction nan"),
    ],
)
def test_a_stage_refuses_non_finite_or_out_of_range_numbers_before_any_work(tmp_path, monkeypatch, flags, pattern):
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=pattern):
        pretrain(tmp_path / "run", *flags)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("command", "flags", "pattern"),
    [
        ("demo", ["--learning_rate", "inf"], r"--learning_rate inf: expected a finite number"),
        ("extrapolate", ["--factors", "1", "inf"], r"factors.*inf"),
        ("extrapolate", ["--factors", "nan"], r"factors.*nan"),
    ],
)
def test_every_command_refuses_non_finite_numbers_in_one_line(tmp_path, capsys, command, flags, pattern):
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--output_dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert re.search(pattern, error) and "Traceback" not in error and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_an_architecture_flag_beside_a_conflicting_override_is_refused(tmp_path, monkeypatch):
    from plugformer.training import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(ValueError, match=r"--hidden_size 32 and --config_overrides hidden_size=64 contradict"):
        pretrain(tmp_path / "run", "--hidden_size", "32", "--config_overrides", "hidden_size=64")


# --- hangs and unbounded resources ------------------------------------------------------------------------------------

BOMB = "".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh", strict=True)),
        "{key}: [" + ",".join(["*h"] * 9) + "]\n",
    ]
)


@pytest.mark.parametrize(("command", "key"), [("demo", "prompts"), ("train", "dataset_name")])
def test_an_alias_bomb_in_a_config_is_refused_before_it_is_built(tmp_path, capsys, command, key):
    from plugformer.cli import main

    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB.format(key=key))
    assert config.stat().st_size < 500
    argv = [
        command,
        *(["sft"] if command == "train" else []),
        "--config",
        str(config),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit):
        main(argv)
    assert re.search(rf"--config {re.escape(str(config))}: its aliases expand to \d+ values", capsys.readouterr().err)


def test_yaml_names_duplicate_keys_non_utf8_files_and_oversized_documents(tmp_path):
    from plugformer.runtime.arguments import MAX_YAML_BYTES, read_yaml

    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("max_steps: 2\nlearning_rate: 1e-3\nmax_steps: 5\n")
    with pytest.raises(ValueError, match=r"dup.yaml: key 'max_steps' is given twice \(lines 1 and 3\)"):
        read_yaml(duplicate)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("max_steps: 2\n# café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.yaml: not UTF-8 text \(byte b'\\xe9' at offset 18\)"):
        read_yaml(latin)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_YAML_BYTES // 10 + 1))
    with pytest.raises(ValueError, match=rf"big.yaml: \d+ bytes; a config file is at most {MAX_YAML_BYTES} bytes"):
        read_yaml(big)
    shared = tmp_path / "anchors.yaml"  # ordinary anchors still work
    shared.write_text("base: &base {lr: 1.0e-3}\nrun: *base\n")
    assert read_yaml(shared) == {"base": {"lr": 1e-3}, "run": {"lr": 1e-3}}


def test_a_stage_config_with_a_duplicate_key_is_refused_naming_it(tmp_path, monkeypatch):
    from plugformer.training import run_stage

    config = tmp_path / "sft.yaml"
    config.write_text("max_steps: 3\nlearning_rate: 1.0e-3\nmax_steps: 1\n")
    with pytest.raises(ValueError, match=r"key 'max_steps' is given twice"):
        run_stage("sft", ["--config", str(config), "--output_dir", str(tmp_path / "out")])


# --- silently wrong: a checkpoint missing tensors -------------------------------------------------------------------


def damaged(runs, tmp_path, drop: str = ".layers.1.", add: dict | None = None):
    import torch
    from safetensors.torch import load_file, save_file

    run = copy_run(runs, "final_only", tmp_path)
    tensors = {name: t for name, t in load_file(str(run / "model.safetensors")).items() if drop not in name}
    tensors.update({name: torch.zeros(2) for name in add or {}})
    save_file(tensors, str(run / "model.safetensors"), metadata={"format": "pt"})
    return run


def test_eval_refuses_a_checkpoint_with_a_layer_deleted(runs, tmp_path, capsys):
    from plugformer.cli import main

    run = damaged(runs, tmp_path)
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(run), "--split", "dev", "--examples", "4"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own load report
    assert re.match(
        r"ValueError: .*: the checkpoint does not match its model \(missing: model\.layers\.1\..*in all\)", last
    )


def test_a_stage_refuses_a_parent_with_unexpected_backbone_tensors(runs, tmp_path):
    from test_training import TINY, TRL

    from plugformer.training import run_stage

    run = damaged(runs, tmp_path, drop="no such tensor", add={"model.layers.9.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.9\.mlp\.up_proj\.weight\)"):
        run_stage("sft", ["--model_name_or_path", str(run), "--output_dir", str(tmp_path / "sft"), *TINY, *TRL])


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_a_seq2seq_checkpoint_without_its_embedding_is_reported_and_refused(tmp_path, tie_word_embeddings):
    """The decoder shared the encoder's embedding module: transformers then took the encoder's embedding for an
    initialised tie target, so a checkpoint without it loaded unreported, the weight left on the meta device (and
    `load_checked` looked only under `model.`, which the seq2seq head, its own base model, has not)."""
    import torch
    from safetensors.torch import load_file, save_file

    from plugformer import PlugformerConfig, PlugformerForConditionalGeneration
    from plugformer.runtime.loading import load_checked

    config = PlugformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        is_encoder_decoder=True,
        is_causal=False,
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = PlugformerForConditionalGeneration(config)
    assert model.decoder.embed_tokens.weight is model.encoder.embed_tokens.weight  # one embedding, either way
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    reloaded = load_checked(PlugformerForConditionalGeneration, tmp_path)  # intact: loads, still one embedding
    assert reloaded.decoder.embed_tokens.weight is reloaded.encoder.embed_tokens.weight
    assert torch.equal(reloaded.encoder.embed_tokens.weight, weights["encoder.embed_tokens.weight"])
    del weights["encoder.embed_tokens.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = PlugformerForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert "encoder.embed_tokens.weight" in info["missing_keys"]
    assert reloaded.encoder.embed_tokens.weight.device.type == "cpu"  # initialised, not left on meta
    with pytest.raises(ValueError, match=r"missing: .*encoder\.embed_tokens\.weight"):
        load_checked(PlugformerForConditionalGeneration, tmp_path)


def test_attention_map_refuses_a_text_too_long_to_draw(runs, capsys):
    from plugformer.cli import main

    with pytest.raises(SystemExit):
        main(["attention-map", "--model", str(runs / "final_only"), "--text", "12 plus 7 is 19. " * 180])
    assert re.search(r"ValueError: the text is \d+ tokens; attention-map draws at most 512", capsys.readouterr().err)


def test_an_attention_figure_too_large_is_refused_before_it_is_drawn(tmp_path):
    import torch

    from plugformer.evaluation.attention_maps import AttentionMap, plot_attention_map

    tokens = [f"t{i}" for i in range(100)]
    big = AttentionMap("self", torch.rand(4, 4, 100, 100), [0, 1, 2, 3], [0, 1, 2, 3], tokens, tokens)
    with pytest.raises(ValueError, match=r"would be \d+ x \d+ pixels \(4 layers x 4 heads of 100 x 100 tokens"):
        plot_attention_map(big, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()


def test_pipeline_jobs_is_capped_at_the_cores_available():
    from plugformer.experiments.pipeline import PipelineArguments, available_cores

    with pytest.raises(ValueError, match=rf"--jobs 1000: this machine lets plugformer use {available_cores()} CPU"):
        PipelineArguments(jobs=1000)
    assert PipelineArguments(jobs=available_cores()).jobs == available_cores()


# --- tracebacks instead of one line naming the input ----------------------------------------------------------------


def cli_error(capsys, argv) -> str:
    """The last stderr line of `plugformer ARGV`, which must exit 2 (a user error) in one line."""
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (
            ["--model_name_or_path", "/nonexistent/model"],
            r"--model_name_or_path /nonexistent/model: /nonexistent/model does not exist",
        ),
        (["--output_dir", ""], r"--output_dir '': expected a folder path"),
        (["--output_dir", "{file}/sub"], r"--output_dir .*/afile/sub is under .*/afile, which is a file"),
        (["--push_to_hub", "true"], r"--push_to_hub true needs the Hub, but this run is offline"),
    ],
)
def test_a_stage_names_a_bad_path_or_an_offline_push_in_one_line(runs, tmp_path, capsys, monkeypatch, flags, pattern):
    from test_training import TINY, TRL

    (tmp_path / "afile").write_text("a file\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = [flag.replace("{file}", str(tmp_path / "afile")) for flag in flags]
    defaults = {"--model_name_or_path": str(runs / "final_only"), "--output_dir": str(tmp_path / "sft")}
    defaults.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    line = cli_error(capsys, ["train", "sft", *(x for pair in defaults.items() for x in pair), *TINY, *TRL])
    assert re.search(pattern, line), line


def test_a_read_only_output_folder_is_refused_naming_it(tmp_path, monkeypatch):
    from plugformer.training import outputs

    parent = tmp_path / "ro"
    parent.mkdir()
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: str(path) != str(parent))  # root ignores modes
    assert "ro is not writable by this user" in outputs.occupied_problem(str(parent / "run"), None, False, "sft")


@pytest.mark.parametrize("template", ["configs/{stgae}/tiny.yaml", "configs/{0}/tiny.yaml", "configs/{stage/x.yaml"])
@pytest.mark.parametrize("command", ["compare", "extrapolate", "pipeline"])
def test_a_bad_stage_configs_placeholder_is_named(tmp_path, capsys, monkeypatch, command, template):
    monkeypatch.setattr("plugformer.training.run_stage", refuse_work)
    line = cli_error(capsys, [command, "--output_dir", str(tmp_path / "o"), "--stage_configs", template])
    assert f"--stage_configs {template!r}:" in line and "the only placeholder is {stage}" in line, line


def test_seeds_output_and_info_readme_refuse_a_folder(tmp_path, capsys):
    import json

    runs_made = []
    for seed in range(2):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        runs_made.append(run)
        (run / "results.json").write_text(json.dumps({"seed": seed, "stages": {}}))
    line = cli_error(capsys, ["info", "--readme", str(tmp_path)])
    assert f"--readme {tmp_path} is a folder" in line
    from plugformer.experiments import seeds

    with pytest.raises(ValueError, match=rf"--output {re.escape(str(tmp_path))} is a folder"):
        seeds.main([*map(str, runs_made), "--output", str(tmp_path)])


def test_attention_sinks_under_tensor_parallelism_are_refused_at_load():
    from transformers.distributed import DistributedConfig

    from plugformer import PlugformerConfig, PlugformerForCausalLM

    config = PlugformerConfig.from_preset(
        "tiny",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_attention_sinks=True,
    )
    config.distributed_config = DistributedConfig(tp_size=2)  # what from_pretrained(tp_plan="auto") sets
    with pytest.raises(ValueError, match=r"use_attention_sinks=True cannot run with tensor parallelism \(tp_size=2\)"):
        PlugformerForCausalLM(config)


def test_a_transformers_fsdp_request_on_cpu_names_version_2(monkeypatch):
    from types import SimpleNamespace

    from plugformer.training.sharding import refuse_unshardable_request

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    args = SimpleNamespace(fsdp=["full_shard"], fsdp_config={}, deepspeed=None, use_cpu=True)
    with pytest.raises(ValueError, match=r"--fsdp full_shard asks transformers for FSDP version 2 on CPU"):
        refuse_unshardable_request(args)
