"""The fused LM-head losses under `accelerate launch` on 2 CPU processes (gloo): DDP (`cpu_2proc.yaml`) and FSDP2
(`cpu_fsdp2.yaml`), `train pretrain` (plugformer's own fused head, `plugformer.losses`) and `train sft` (TRL's fused
head, `trl.trainer.utils.add_fused_lm_head`).

TRL 1.14 removed its earlier fused losses after finding that under plain DDP they ran on the unwrapped model, so the
gradients were never all-reduced. Here each rank counts its fused calls (tests/fused_loss_worker.py), both ranks must
end with the same weights (`run_info.json`'s `parameter_digests`), and after 3 SGD steps that move every tensor by
far more than 1e-5 the fused run's weights must be within 1e-5 of the unfused run's and of one process's on the whole
global batch (measured: within 1.2e-7). Faults injected into the DDP pretrain run were caught: the loss computed on
the unwrapped model (the ranks' weights differed, by up to 0.095 from the unfused run's), and the fused loss divided
by the rank's own tokens instead of both ranks' (3e-3 off; AdamW, scale-invariant, would not have seen it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fused_loss import PRETRAIN, SFT, STAGE_FLAGS, trained_weights

from plugformer.runtime.arguments import override_flags


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fused_loss_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
STEPS = 3  # STAGE_FLAGS' --max_steps
DISTRIBUTED_TYPE = {"cpu_2proc.yaml": "MULTI_CPU", "cpu_fsdp2.yaml": "FSDP"}
# plain SGD, not AdamW: Adam's step does not change when every gradient is scaled alike, so a loss divided by one
# rank's tokens where it should be by both ranks' (a 2x gradient) would train the same AdamW weights
OPTIMIZER = ["--optim", "sgd", "--learning_rate", "1.0"]
ATOL = 1e-5
# every tensor moves by more than this from its starting weights (measured: the least-moved, layer 0's q_proj, by
# 1.5e-4, the most by 0.3), so that agreeing within ATOL says something about training, not about two starting copies
MOVED = 10 * ATOL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_flags(stage: str, start: Path) -> list[str]:
    # pretrain continues `start` (so that its starting weights are on disk to measure the training against)
    # sft: 64 conversations (48 keep 47 rows, so one process's third batch would hold 7, while 2 ranks wrap around to 8)
    flags = ["--block_size", "32"] if stage == "pretrain" else [*SFT, "--train_examples", "64"]
    return override_flags(STAGE_FLAGS, OPTIMIZER, [*flags, "--model_name_or_path", str(start)])


def launch(topology: str, stage: str, output: Path, *extra: str) -> tuple[dict, list[dict]]:
    """`plugformer train <stage>` on 2 processes of `topology`; its `run_info.json` and each rank's fused calls."""
    calls = output.with_name(output.name + "-calls")
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs/accelerate" / topology),
        "--main_process_port",
        str(free_port()),
        str(WORKER),
        str(calls),
        stage,
        "--output_dir",
        str(output),
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-4000:]
    info = json.loads((output / "run_info.json").read_text())
    return info, [json.loads((calls / f"rank{rank}.json").read_text()) for rank in range(2)]


def new_model(output: Path, *extra: str) -> Path:
    """3 steps of a new tiny model (and its tokenizer) in this process: the starting checkpoint of the runs."""
    from plugformer.training import run_stage

    run_stage("pretrain", ["--output_dir", str(output), *STAGE_FLAGS, *PRETRAIN, *extra])
    return output


@pytest.fixture(scope="module")
def start_tied(tmp_path_factory) -> Path:
    return new_model(tmp_path_factory.mktemp("fused") / "tied")


@pytest.fixture(scope="module")
def start_untied(tmp_path_factory) -> Path:  # under FSDP2 the head is then sharded with the final norm only
    return new_model(tmp_path_factory.mktemp("fused") / "untied", "--config_overrides", "tie_word_embeddings=false")


def expected_calls(stage: str, fused: bool) -> dict:
    """Each rank's fused calls in training: one a micro-batch from the stage's fused head, none from the other."""
    ours, trls = (STEPS if fused and stage == "pretrain" else 0), (STEPS if fused and stage == "sft" else 0)
    return {"plugformer": ours, "trl": trls}


def assert_same_training(weights: dict, reference: dict, start: dict) -> None:
    """`weights` within ATOL of `reference`, each tensor moved by more than MOVED from `start`."""
    assert weights.keys() == reference.keys() == start.keys()
    for name, weight in reference.items():
        moved = (weight - start[name]).abs().max().item()
        assert moved > MOVED, f"{name} moved by {moved:.2e} only"
        torch.testing.assert_close(weights[name], weight, rtol=0, atol=ATOL, msg=name)


def train_fused_and_unfused(topology: str, stage: str, start: Path, root: Path) -> dict[bool, Path]:
    """Both losses on 2 processes of `topology`: one model on both ranks, the fused head on each rank when asked."""
    outputs, losses = {}, {}
    for fused in (True, False):
        output = root / f"{stage}-{'fused' if fused else 'unfused'}"
        info, calls = launch(topology, stage, output, *stage_flags(stage, start), "--fused_loss", str(fused).lower())
        assert (info["world_size"], info["distributed_type"]) == (2, DISTRIBUTED_TYPE[topology])
        first, second = info["parameter_digests"]
        assert first == second  # the ranks' gradients were all-reduced (or reduce-scattered): one model
        for rank, counts in enumerate(calls):  # the fused head ran on every rank, the unfused run's on none
            assert counts == expected_calls(stage, fused), rank
        outputs[fused], losses[fused] = output, info["metrics"]["train_loss"]
    assert losses[True] == pytest.approx(losses[False], rel=ATOL)  # the same scale: 2 ranks' tokens in each divisor
    return outputs


CASES = [
    # slow (deselected by default): ~35-50 s each on 2 shared cores (2 launches and a run in this process)
    pytest.param("cpu_2proc.yaml", "pretrain", "tied", id="ddp-pretrain"),  # the default suite's representative
    pytest.param("cpu_2proc.yaml", "sft", "tied", id="ddp-sft", marks=pytest.mark.slow),
    pytest.param("cpu_fsdp2.yaml", "pretrain", "tied", id="fsdp2-pretrain", marks=pytest.mark.slow),
    pytest.param("cpu_fsdp2.yaml", "pretrain", "untied", id="fsdp2-pretrain-untied", marks=pytest.mark.slow),
    pytest.param("cpu_fsdp2.yaml", "sft", "tied", id="fsdp2-sft", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("topology", "stage", "tie"), CASES)
def test_two_processes_train_the_same_weights_fused_and_unfused(topology, stage, tie, request, tmp_path):
    from plugformer.training import run_stage

    start = request.getfixturevalue(f"start_{tie}")
    outputs = train_fused_and_unfused(topology, stage, start, tmp_path)
    fused, before = trained_weights(outputs[True]), trained_weights(start)
    assert_same_training(fused, trained_weights(outputs[False]), before)
    # and the steps of one process on the whole global batch (8 = 2 ranks x 4), fused
    one = tmp_path / f"{stage}-one"
    whole_batch = ["--per_device_train_batch_size", "8", "--fused_loss", "true"]
    run_stage(stage, ["--output_dir", str(one), *override_flags(stage_flags(stage, start), whole_batch)])
    assert_same_training(fused, trained_weights(one), before)
