"""DeepSpeed ZeRO-2 and ZeRO-3 through the stages on CPU: DeepSpeed's CPU accelerator, 2 processes on gloo.

Skipped where DeepSpeed is not installed (`DS_BUILD_OPS=0 pip install -e .[deepspeed]`). The shipped topologies
(configs/accelerate/cpu_zero2.yaml, cpu_zero3.yaml) are launched exactly as a user would, with no DeepSpeed variable
or `--use_cpu` in the command: `plugformer train` picks the CPU accelerator itself (plugformer.training.sharding).

- pretrain -> sft -> grpo under each ZeRO stage end with the weights the DDP topology (cpu_2proc.yaml) reaches, equal
  digests on both ranks, dev exact match scored (ZeRO-3: from the saved checkpoint on rank 0, no hang) and a normal
  checkpoint (plugformer's code and `auto_map`, the DDP checkpoint's files). The first DeepSpeed run on a machine
  compiles DeepSpeed's shared-memory collective op (minutes); later runs reuse it.
- reward, rlhf and dpo under each ZeRO stage end with rc 0 and the same records (slow).
- an explicit `--use_cpu true`, with which accelerate would skip DeepSpeed, is refused before a model is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytest.importorskip("deepspeed")

from safetensors.torch import load_file
from test_fsdp import ENV, LAUNCHER, ROOT, STAGE_FLAGS, TINY, free_port

from plugformer.runtime.arguments import override_flags


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU path is taken only without CUDA")
pytestmark = CPU_ONLY

ZERO = ("cpu_zero2.yaml", "cpu_zero3.yaml")
DDP = "cpu_2proc.yaml"
FLAGS = {
    **STAGE_FLAGS,
    "reward": ["--bf16", "false", "--activation_checkpointing", "false", "--max_length", "64"],
    "dpo": ["--bf16", "false", "--activation_checkpointing", "false", "--max_length", "64"],
    "rlhf": ["--bf16", "false", "--activation_checkpointing", "false", "--num_generations", "4",
             "--max_completion_length", "8"],
}  # fmt: skip
PARENT = {"sft": "pretrain", "grpo": "sft", "reward": "sft", "rlhf": "sft", "dpo": "sft"}
# Measured on this 2-core machine, 3 steps at learning rate 1e-3 (max |dw| against the DDP topology's weights; the
# same figures on a rerun): ZeRO-2 pretrain 7.5e-9, sft 5.9e-7, grpo 3.5e-6; ZeRO-3 pretrain 4.3e-7, sft 4.3e-7,
# grpo 3.6e-6. Both save fp32 (ZeRO-3's "16-bit" save gathers the parameters in their training dtype), so the save
# adds nothing. The differences are consistent with gradients summed and averaged over the 2 ranks in another order
# (DDP's buckets against DeepSpeed's flat partitions), carried through AdamW. 1e-5 is 3x the largest and 200x below
# how far each stage moves its parent's weights (2.0e-3: 3 steps of a linearly decaying 1e-3), so a skipped step or
# a rank out of step is far outside it.
ATOL = 1e-5


def launch(topology: str, stage: str, output: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/<topology>` of `stage` for 3 steps; the timeout leaves room
    for DeepSpeed's one-time op compilation."""
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
        *override_flags(
            ["--output_dir", str(output), *TINY, *FLAGS[stage], "--max_steps", "3", "--save_strategy", "no"],
            list(extra),
        ),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=ENV)
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def run_chain(root: Path, topology: str, stages: tuple[str, ...]) -> None:
    for stage in stages:
        extra = ["--model_name_or_path", str(root / topology / PARENT[stage])] if stage in PARENT else []
        if stage == "rlhf":
            extra += ["--reward_model_path", str(root / topology / "reward")]
        launch(topology, stage, root / topology / stage, *extra)


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> Path:
    """pretrain -> sft -> grpo under cpu_zero2, cpu_zero3 and DDP, 3 steps each."""
    root = tmp_path_factory.mktemp("deepspeed")
    for topology in (*ZERO, DDP):
        run_chain(root, topology, ("pretrain", "sft", "grpo"))
    return root


def run_info(directory: Path) -> dict:
    return json.loads((directory / "run_info.json").read_text())


def assert_a_normal_deepspeed_run(directory: Path, reference: Path, generates: bool = True) -> None:
    """DEEPSPEED on 2 ranks holding the same weights, dev scored, and a checkpoint like the DDP topology's."""
    info = run_info(directory)
    assert (info["distributed_type"], info["world_size"]) == ("DEEPSPEED", 2)  # not DDP or one process in disguise
    assert len(info["parameter_digests"]) == 2 and len(set(info["parameter_digests"])) == 1
    if generates:
        assert info["dev_exact_match"]["examples"] == 4  # scored on rank 0 (ZeRO-3: from the saved weights), no hang
    config, expected = (json.loads((d / "config.json").read_text()) for d in (directory, reference))
    assert config["architectures"] == expected["architectures"]
    assert config["auto_map"] == expected["auto_map"] and all(
        v.split(".")[0] in ("modeling", "configuration") for v in config["auto_map"].values()
    )
    assert sorted(p.name for p in directory.glob("*.py")) == sorted(p.name for p in reference.glob("*.py"))


def weights(directory: Path, reference: Path) -> tuple[dict, dict]:
    """Both checkpoints' tensors, with the same keys: no tied copy (`lm_head.weight`) beside a plain checkpoint's
    (accelerate's ZeRO-2 state dict clones each tensor, so transformers alone no longer sees the tie;
    `PlugformerPreTrainedModel.save_pretrained` drops it)."""
    mine, theirs = load_file(directory / "model.safetensors"), load_file(reference / "model.safetensors")
    assert mine.keys() == theirs.keys()
    return mine, theirs


@pytest.mark.parametrize("topology", ZERO)
@pytest.mark.parametrize("stage", ["pretrain", "sft", "grpo"])
def test_each_stage_trains_under_zero_to_the_ddp_weights(chains, topology, stage):
    directory, reference = chains / topology / stage, chains / DDP / stage
    assert_a_normal_deepspeed_run(directory, reference)
    assert run_info(reference)["distributed_type"] == "MULTI_CPU"
    mine, theirs = weights(directory, reference)
    for name in theirs:
        assert mine[name].dtype == torch.float32, name
        torch.testing.assert_close(mine[name], theirs[name], atol=ATOL, rtol=0)
    if stage in PARENT:  # the stage moved its parent's weights (the comparison is not between two copies)
        parent = load_file(chains / topology / PARENT[stage] / "model.safetensors")
        assert any(not torch.equal(parent[name], mine[name]) for name in mine)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ZERO)
def test_reward_rlhf_and_dpo_run_under_zero(chains, topology):
    run_chain(chains, topology, ("reward", "rlhf", "dpo"))
    for stage in ("reward", "rlhf", "dpo"):
        # the DDP chain has no reward/rlhf/dpo: its sft checkpoint and grpo's stand in for the files and auto_map
        reference = chains / DDP / ("sft" if stage == "reward" else "grpo")
        directory = chains / topology / stage
        if stage == "reward":
            info = run_info(directory)
            assert (info["distributed_type"], info["world_size"]) == ("DEEPSPEED", 2)
            assert len(set(info["parameter_digests"])) == 1 and info.get("dev_exact_match") is None
            assert json.loads((directory / "config.json").read_text())["architectures"] == [
                "PlugformerForSequenceClassification"
            ]
            assert sorted(p.name for p in directory.glob("*.py")) == sorted(p.name for p in reference.glob("*.py"))
        else:
            assert_a_normal_deepspeed_run(directory, reference)


def test_an_explicit_use_cpu_with_deepspeed_is_refused(tmp_path):
    result = launch("cpu_zero2.yaml", "pretrain", tmp_path / "out", "--use_cpu", "true", check=False)
    assert result.returncode != 0
    assert "the launch asks for DeepSpeed but use_cpu=True" in result.stderr
    assert "cpu_zero2.yaml" in result.stderr  # where to go instead
    assert not (tmp_path / "out" / "model.safetensors").exists()


PARSE_SCRIPT = """
import json, sys
from plugformer.training import parse_stage_arguments
from plugformer.training.sharding import prepare_deepspeed_on_cpu
prepare_deepspeed_on_cpu()  # as run_stage does first
_, _, args = parse_stage_arguments("sft", sys.argv[1:])
from deepspeed.accelerator import get_accelerator
values = [args.use_cpu, args.ddp_backend, args.bf16, args.world_size, args.process_index, get_accelerator()._name]
print("PARSED", json.dumps(values))
"""


def test_a_deepspeed_launch_without_cuda_gets_the_cpu_accelerator_defaults(tmp_path):
    """No DS_ACCELERATOR, no --use_cpu: plugformer picks DeepSpeed's CPU accelerator, leaves use_cpu off and names
    gloo, without which each process would count a world of one (accelerate's PartialState given no backend)."""
    (tmp_path / "parse.py").write_text(PARSE_SCRIPT)
    env = {key: value for key, value in ENV.items() if key != "DS_ACCELERATOR"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs/accelerate/cpu_zero2.yaml"),
        "--main_process_port",
        str(free_port()),
        str(tmp_path / "parse.py"),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    parsed = sorted(
        json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("PARSED")
    )
    assert parsed == [[False, "gloo", False, 2, rank, "cpu"] for rank in (0, 1)]


def test_the_cpu_accelerator_is_a_default_only_for_a_deepspeed_launch(monkeypatch):
    from plugformer.training.sharding import prepare_deepspeed_on_cpu

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    prepare_deepspeed_on_cpu()
    assert "DS_ACCELERATOR" not in os.environ
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    prepare_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "mine")
    prepare_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "mine"  # never overrides a choice
