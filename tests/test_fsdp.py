"""FSDP2 on CPU (gloo), really sharded.

- Bare (torchrun + `fully_shard`): trains to the weights one process reaches on the whole batch, digests its sharded
  parameters, and saves a normal checkpoint — plugformer's code and class in `auto_map`, no torch `_fsdp_*.py` files
  — that loads with `trust_remote_code` where plugformer is not installed.
- The stages (`accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml`): run sharded (not DDP in
  disguise), end with the weights the DDP topology reaches, score dev on rank 0 without hanging, and resume from a
  sharded checkpoint to the uninterrupted run's weights. An FSDP request that would fall back to DDP is refused, and
  so is transformers' own `--fsdp` on CPU, which plugformer shards only under accelerate's FSDP2 launch.
- Dev selection (`tests/selection_fsdp_worker.py`): the step selected is handed on whole, root module included.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf_integration import HIDE_PLUGFORMER
from tolerances import model_tolerance

from plugformer import PlugformerConfig, PlugformerForCausalLM
from plugformer.runtime.arguments import override_flags


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fsdp_worker.py")
LAUNCHER = Path(__file__).with_name("stage_launcher.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint trained 3 steps twice: FSDP2 on 2 processes, and in one process."""
    root = tmp_path_factory.mktemp("fsdp")
    torch.manual_seed(0)
    # t5_bias: a learned table outside the blocks (sharded with the root), GQA, tied embeddings
    config = PlugformerConfig.from_preset(
        "tiny",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        position_scheme="t5_bias",
    )
    PlugformerForCausalLM(config).save_pretrained(root / "start")
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
    for command, output in (([*torchrun, str(WORKER)], "sharded"), ([sys.executable, str(WORKER), "--single"], "one")):
        result = subprocess.run(
            [*command, str(root / "start"), str(root / output)], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
    return {name: root / name for name in ("start", "sharded", "one")}


def info(directory: Path) -> dict:
    return json.loads((directory / "worker.json").read_text())


def test_fsdp2_really_shards_and_trains_to_the_single_process_weights(runs):
    sharded = info(runs["sharded"])
    assert sharded["class"] == "FSDPPlugformerForCausalLM"  # fully_shard swapped the class: not DDP in disguise
    full = {name: tuple(t.shape) for name, t in load_file(runs["start"] / "model.safetensors").items()}
    for name, local in sharded["local_shapes"].items():
        assert local[0] == -(-full[name][0] // 2) and tuple(local[1:]) == full[name][1:], (
            name
        )  # dim 0 split over 2 ranks
    first, second = sharded["digests"]
    assert first == second  # digested whole (DTensor.full_tensor), the same on both ranks
    mine, reference = load_file(runs["sharded"] / "model.safetensors"), load_file(runs["one"] / "model.safetensors")
    assert mine.keys() == reference.keys()  # no tied copy (lm_head.weight) beside a plain checkpoint's keys
    for name in reference:
        assert not torch.equal(reference[name], load_file(runs["start"] / "model.safetensors")[name]), name
        torch.testing.assert_close(mine[name], reference[name], atol=1e-5, rtol=0)


def test_a_sharded_save_is_a_normal_checkpoint_with_plugformers_code(runs):
    directory = runs["sharded"]
    assert not list(directory.glob("_fsdp*")), "torch's FSDP files were saved as the checkpoint's code"
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["PlugformerForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.PlugformerForCausalLM"
    assert (directory / "modeling.py").read_text() == (
        Path(__file__).parents[1] / "src/plugformer/modeling.py"
    ).read_text()


LOAD_SCRIPT = (
    HIDE_PLUGFORMER
    + """
import torch
from transformers import AutoModelForCausalLM
directory, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(model(torch.arange(3, 19)[None]).logits, out)
"""
)


def test_a_sharded_save_loads_with_trust_remote_code_without_the_package(runs, tmp_path):
    (tmp_path / "load.py").write_text(LOAD_SCRIPT)
    env = {**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(runs["sharded"]), str(tmp_path / "logits.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    model = PlugformerForCausalLM.from_pretrained(runs["sharded"]).eval()
    with torch.no_grad():
        expected = model(torch.arange(3, 19)[None]).logits
    # the other process's threads and kernel choice: `model_tolerance`
    torch.testing.assert_close(
        torch.load(tmp_path / "logits.pt"), expected, atol=model_tolerance(model.config, expected), rtol=0
    )


# a few steps of a 2-layer, 32-wide model (tests/test_training.py's flags)
TINY = ["--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "8", "--train_examples", "96", "--dev_examples", "8", "--test_examples", "8",
        "--exact_match_examples", "4", "--max_new_tokens", "8", "--dataloader_pin_memory", "false",
        "--learning_rate", "1e-3"]  # fmt: skip
STAGE_FLAGS = {
    "pretrain": ["--preset", "tiny", "--vocab_size", "300", "--block_size", "32", "--max_position_embeddings", "128"],
    "sft": ["--bf16", "false", "--activation_checkpointing", "false", "--max_length", "64"],
    "grpo": [
        "--bf16",
        "false",
        "--activation_checkpointing",
        "false",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--reward_functions",
        "length",
    ],
}
PARENT = {"sft": "pretrain", "grpo": "sft"}


def launch(topology: str, stage: str, output: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs/accelerate" / topology),
        "--main_process_port",
        str(free_port()),
        str(LAUNCHER),
        stage,
        *override_flags(["--output_dir", str(output), *TINY, *STAGE_FLAGS[stage]], list(extra)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT, env=ENV)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def train_chain(root: Path, stages: tuple[str, ...]) -> None:
    """Each stage of `stages`, sharded and with DDP, 3 steps, each from its parent in the same topology."""
    for topology in ("cpu_fsdp2.yaml", "cpu_2proc.yaml"):
        for stage in stages:
            parent = ["--model_name_or_path", str(root / topology / PARENT[stage])] if stage in PARENT else []
            launch(topology, stage, root / topology / stage, "--max_steps", "3", "--save_strategy", "no", *parent)


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict[str, Path]:
    """pretrain -> sft, sharded and with DDP."""
    root = tmp_path_factory.mktemp("stages")
    train_chain(root, ("pretrain", "sft"))
    return {"fsdp": root / "cpu_fsdp2.yaml", "ddp": root / "cpu_2proc.yaml", "root": root}


@pytest.fixture(scope="module")
def chains_with_grpo(chains) -> dict[str, Path]:
    """... -> grpo (generation inside training, every rank generating with the sharded model)."""
    train_chain(chains["root"], ("grpo",))
    return chains


def run_info(directory: Path) -> dict:
    return json.loads((directory / "run_info.json").read_text())


# slow (deselected by default, ~90 s for pretrain + sft, ~35 s more for grpo): 4-6 launches of accelerate; the default
# suite keeps the 2-process FSDP2 equality with one process in test_fsdp2_really_shards_and_trains_to_the_single_...
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["pretrain", "sft", "grpo"])
def test_each_stage_trains_sharded_to_the_ddp_weights(request, stage):
    chains = request.getfixturevalue("chains_with_grpo" if stage == "grpo" else "chains")
    sharded, ddp = run_info(chains["fsdp"] / stage), run_info(chains["ddp"] / stage)
    assert (sharded["distributed_type"], ddp["distributed_type"]) == ("FSDP", "MULTI_CPU")
    assert sharded["world_size"] == 2 and len(set(sharded["parameter_digests"])) == 1
    assert sharded["dev_exact_match"]["examples"] == 4  # scored on rank 0 from the saved weights: no hang
    mine, reference = (
        load_file(chains["fsdp"] / stage / "model.safetensors"),
        load_file(chains["ddp"] / stage / "model.safetensors"),
    )
    assert mine.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(mine[name], reference[name], atol=1e-5, rtol=0)
    if stage in PARENT:  # the stage moved its parent's weights (the comparison is not between two copies)
        parent = load_file(chains["fsdp"] / PARENT[stage] / "model.safetensors")
        assert any(not torch.equal(parent[name], mine[name]) for name in parent)
    assert not list((chains["fsdp"] / stage).glob("_fsdp*"))


@pytest.mark.slow  # ~40 s: two launches
def test_a_sharded_run_resumes_to_the_uninterrupted_weights(tmp_path):
    flags = [
        "--max_steps",
        "6",
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--eval_strategy",
        "no",
        "--exact_match_examples",
        "0",
    ]
    launch("cpu_fsdp2.yaml", "pretrain", tmp_path / "whole", *flags)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", resumed / "checkpoint-3")
    launch("cpu_fsdp2.yaml", "pretrain", resumed, *flags, "--resume_from_checkpoint", "last")
    state = json.loads((resumed / "trainer_state.json").read_text())
    assert next(entry["step"] for entry in state["log_history"] if "loss" in entry) == 1  # history came with it
    whole, again = load_file(tmp_path / "whole" / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in whole:
        torch.testing.assert_close(again[name], whole[name], atol=1e-6, rtol=0)


def test_an_fsdp_request_that_would_become_ddp_is_refused(tmp_path):
    """FSDP1 has no CPU path: refused before a model is built, in one line."""
    config = (ROOT / "configs/accelerate/cpu_fsdp2.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1")
    (tmp_path / "fsdp1.yaml").write_text(config)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "fsdp1.yaml"),
        "--main_process_port",
        str(free_port()),
        str(LAUNCHER),
        "pretrain",
        "--output_dir",
        str(tmp_path / "out"),
        *TINY,
        *STAGE_FLAGS["pretrain"],
        "--max_steps",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT, env=ENV)
    assert result.returncode != 0
    assert "the launch asks for FSDP version 1 on CPU, which accelerate cannot run there" in result.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_trainer_that_did_not_shard_as_asked_is_refused_before_training(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from plugformer.training.sharding import refuse_unsharded_fallback

    trainer = SimpleNamespace(
        args=SimpleNamespace(fsdp="", deepspeed=None),
        accelerator=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU),
    )
    refuse_unsharded_fallback(trainer)  # nothing asked, nothing refused
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="asks for deepspeed but accelerate would run MULTI_CPU"):
        refuse_unsharded_fallback(trainer)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="asks for fsdp but accelerate would run MULTI_CPU"):
        refuse_unsharded_fallback(trainer)
    trainer.accelerator.distributed_type = DistributedType.FSDP
    refuse_unsharded_fallback(trainer)


def test_a_transformers_fsdp_request_on_cpu_names_version_2(monkeypatch):
    from types import SimpleNamespace

    from plugformer.training.sharding import refuse_unshardable_request

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    args = SimpleNamespace(fsdp=["full_shard"], fsdp_config={}, deepspeed=None, use_cpu=True)
    with pytest.raises(ValueError, match=r"--fsdp full_shard asks transformers for FSDP version 2 on CPU"):
        refuse_unshardable_request(args)


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
