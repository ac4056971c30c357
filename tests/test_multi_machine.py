"""Several machines on one box (loopback): a launch that would train independent copies is refused, ranks that
would resume from different checkpoints are refused together (no hang), agreeing ranks resume to the uninterrupted
run's weights bit for bit, and the effective batch is printed once and kept in run_info.json. Plus the pure
functions of `plugformer.training.distributed` on the environments `accelerate launch` was measured to set."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from plugformer.training import distributed
from plugformer.training.distributed import (
    accelerate_launch_flags,
    announced_world_size,
    check_launch,
    checkpoint_disagreement,
    checkpoint_files,
    effective_batch,
    launch_problem,
)


ROOT = Path(__file__).resolve().parents[1]
# pretraining a 2-layer, 32-wide model for 6 steps of 4 x 2 accumulation per process, a checkpoint every 3 steps
FLAGS = ["--preset", "tiny", "--vocab_size", "300", "--block_size", "32", "--max_position_embeddings", "128",
         "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--dataloader_pin_memory", "false",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "6",
         "--learning_rate", "1e-3", "--save_strategy", "steps", "--save_steps", "3", "--save_on_each_node", "true",
         "--eval_strategy", "no", "--train_examples", "48", "--dev_examples", "0", "--test_examples", "8",
         "--exact_match_examples", "0"]  # fmt: skip
TIMEOUT = 180  # seconds per pair of launches; a hang shows up as a failure, not a stuck suite
REFUSED = "refusing to train"
DISAGREE = "the ranks would not resume from the same checkpoint"

# What `accelerate launch` 1.15 put into the environment of the training process, as printed by a script launched
# each way (only the variables the check reads; the ACCELERATE_DYNAMO_* and mixed-precision ones are set in all).
SIMPLE_CPU_TWO_MACHINES = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611",
                           "OMP_NUM_THREADS": "1", "KMP_BLOCKTIME": "1"}  # fmt: skip
SIMPLE_CPU_ONE_PROCESS = {"ACCELERATE_USE_CPU": "True", "OMP_NUM_THREADS": "1", "KMP_BLOCKTIME": "1"}
SIMPLE_TWO_MACHINES_NO_FLAG = {"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29658"}
MULTI_GPU_TWO_MACHINES = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29612", "WORLD_SIZE": "2", "RANK": "1",
                          "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_machines(mode: str, output_dirs: list[Path], *extra: str) -> list[subprocess.Popen]:
    """Two `accelerate launch --<mode> --num_machines 2 --machine_rank R` shells on 127.0.0.1, one process each,
    each in its own process group (so a hung one can be killed with its children)."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    processes = []
    for rank, output_dir in enumerate(output_dirs):
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            f"--{mode}",
            "--num_machines",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "plugformer",
            "train",
            "pretrain",
            "--output_dir",
            str(output_dir),
            *FLAGS,
            *extra,
        ]
        processes.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return processes


def finish(processes: list[subprocess.Popen], deadline: float) -> list[tuple[int | None, str]]:
    """(exit code, output) per machine; `None` for one still running at `deadline` (then killed: a hang)."""
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            results.append((None, output))
            continue
        results.append((process.returncode, output))
    return results


def codes(results) -> list:
    return [code for code, _ in results]


def tails(results) -> str:
    return "\n".join(output[-3000:] for _, output in results)


def losses_logged(output: str) -> int:
    return output.count("{'loss'")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every 2-machine launch of this file, two at a time (most of each is importing, so pairs share the cores):

    1. `whole`: `--multi_gpu` (gloo), 6 steps with a checkpoint at 3, each machine its own output folder; beside it
       `cpu`: the same with `--cpu`, which must be refused.
    2. From `whole`'s checkpoint-3, `--resume_from_checkpoint last` with it on machine 0 only (`disagree`) and on
       both machines (`agree`: machine 0's checkpoint with machine 1's own random state).
    """
    root = tmp_path_factory.mktemp("machines")
    names = ("whole", "cpu", "disagree", "agree")
    dirs = {name: [root / name / "machine0", root / name / "machine1"] for name in names}
    deadline = time.monotonic() + TIMEOUT
    first = {"whole": start_machines("multi_gpu", dirs["whole"]), "cpu": start_machines("cpu", dirs["cpu"])}
    results = {name: finish(processes, deadline) for name, processes in first.items()}
    assert codes(results["whole"]) == [0, 0], tails(results["whole"])
    checkpoint = dirs["whole"][0] / "checkpoint-3"
    shutil.copytree(checkpoint, dirs["disagree"][0] / "checkpoint-3")
    dirs["disagree"][1].mkdir(parents=True)
    for output_dir in dirs["agree"]:
        shutil.copytree(checkpoint, output_dir / "checkpoint-3")
    shutil.copy(dirs["whole"][1] / "checkpoint-3" / "rng_state_1.pth", dirs["agree"][1] / "checkpoint-3")
    deadline = time.monotonic() + TIMEOUT
    second = {
        name: start_machines("multi_gpu", dirs[name], "--resume_from_checkpoint", "last")
        for name in ("disagree", "agree")
    }
    results.update({name: finish(processes, deadline) for name, processes in second.items()})
    return {name: {"dirs": dirs[name], "results": results[name]} for name in dirs}


def test_a_cpu_launch_on_two_machines_is_refused_before_training(runs):
    results, dirs = runs["cpu"]["results"], runs["cpu"]["dirs"]
    for rank, (code, output) in enumerate(results):
        assert code not in (0, None), output[-3000:]
        (line,) = [line for line in output.splitlines() if line.startswith("ValueError: ")]
        assert REFUSED in line and "num_machines=2" in line and f"machine_rank={rank}" in line
        assert "no WORLD_SIZE/RANK" in line and "--multi_gpu" in line and "cpu_2proc.yaml" in line
        assert losses_logged(output) == 0 and not (dirs[rank] / "run_info.json").exists()


def test_ranks_that_disagree_on_the_checkpoint_are_refused_together(runs):
    """Machine 0 finds checkpoint-3, machine 1 finds none: both refuse (no rank starts fresh, nobody hangs)."""
    results, dirs = runs["disagree"]["results"], runs["disagree"]["dirs"]
    assert None not in codes(results), f"a machine hung past {TIMEOUT}s:\n{tails(results)}"
    for code, output in results:
        assert code != 0, output[-3000:]
        (line,) = [line for line in output.splitlines() if "ValueError: --resume_from_checkpoint" in line]
        assert DISAGREE in line and str(dirs[0] / "checkpoint-3") in line and "none, a fresh start" in line
        assert losses_logged(output) == 0


def test_ranks_that_agree_resume_to_the_uninterrupted_weights(runs):
    """Both machines hold checkpoint-3: the resumed run trains steps 4-6 only and ends with the uninterrupted run's
    weights, bit for bit."""
    results, dirs = runs["agree"]["results"], runs["agree"]["dirs"]
    assert codes(results) == [0, 0], tails(results)
    assert losses_logged(runs["whole"]["results"][0][1]) == 6 and losses_logged(results[0][1]) == 3  # it resumed
    whole, resumed = (load_file(str(d[0] / "model.safetensors")) for d in (runs["whole"]["dirs"], dirs))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    first, second = json.loads((dirs[0] / "run_info.json").read_text())["parameter_digests"]
    assert first == second


def test_effective_batch_is_printed_once_and_kept_in_run_info(runs):
    info = json.loads((runs["whole"]["dirs"][0] / "run_info.json").read_text())
    assert info["world_size"] == 2
    assert info["effective_batch"] == {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "world_size": 2,
        "total": 16,
        "unit": "examples",
    }
    outputs = [output for _, output in runs["whole"]["results"]]
    printed = [line for output in outputs for line in output.splitlines() if "effective batch" in line]
    assert printed == [
        "[pretrain] effective batch 16 examples per optimizer step = 4 per device x 2 accumulation x 2 processes"
    ]


def test_a_machine_whose_checkpoint_lacks_the_weights_disagrees(runs):
    """transformers writes weights on global rank 0 only, even with --save_on_each_node: machine 1's checkpoint-3
    has optimizer and trainer state but no model.safetensors, and must not count as the same checkpoint."""
    machine0, machine1 = (d / "checkpoint-3" for d in runs["whole"]["dirs"])
    assert "model.safetensors" in checkpoint_files(machine0) and "model.safetensors" not in checkpoint_files(machine1)
    choices = [{"checkpoint": str(c), "files": checkpoint_files(c)} for c in (machine0, machine1)]
    message = checkpoint_disagreement(choices, "last")
    assert DISAGREE in message and f"{machine1} (lacks model.safetensors, " in message


# --- the pure functions ---


def test_the_world_a_launcher_announced():
    assert announced_world_size(MULTI_GPU_TWO_MACHINES) == 2
    assert announced_world_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4  # mpirun (accelerate's MULTI_CPU)
    assert announced_world_size(SIMPLE_CPU_TWO_MACHINES) is None
    assert announced_world_size({"WORLD_SIZE": ""}) is None


def test_launch_flags_read_back_from_the_launcher_command_line():
    argv = [
        sys.executable,
        "/venv/bin/accelerate",
        "launch",
        "--cpu",
        "--num-machines=2",
        "--machine_rank",
        "1",
        "--num_processes",
        "2",
        "-m",
        "plugformer",
        "train",
        "pretrain",
    ]
    flags = {"cpu": True, "num_machines": "2", "machine_rank": "1", "num_processes": "2"}
    assert accelerate_launch_flags(argv) == flags
    assert accelerate_launch_flags([]) == {}


def test_launches_refused_and_launches_let_through():
    # refused: the simple launcher was asked for several machines/processes and formed no group
    message = launch_problem(SIMPLE_CPU_TWO_MACHINES, 1, None, ["accelerate", "launch", "--cpu", "--num_machines", "2"])
    assert message.startswith(REFUSED) and "(--cpu, num_machines=2)" in message and "MASTER_PORT=29611" in message
    assert "\n" not in message
    assert launch_problem(SIMPLE_TWO_MACHINES_NO_FLAG, 1).startswith(REFUSED)  # neither --cpu nor --multi_gpu
    # refused: a world was announced and formed, but the trainer runs alone (use_cpu=False without a GPU, measured)
    message = launch_problem(MULTI_GPU_TWO_MACHINES, 1, 2)
    assert message.startswith(REFUSED) and "WORLD_SIZE=2" in message and "--use_cpu true" in message
    # sound: a formed world, a single process, a plain `plugformer train` with a stray MASTER_PORT
    assert launch_problem(MULTI_GPU_TWO_MACHINES, 2, 2) is None
    assert launch_problem(SIMPLE_CPU_ONE_PROCESS, 1) is None
    assert launch_problem({"MASTER_PORT": "29500"}, 1) is None


def test_check_launch_raises_a_value_error(monkeypatch):
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SIMPLE_CPU_TWO_MACHINES.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "parent_argv", lambda: ["accelerate", "launch", "--cpu", "--num_machines", "2"])
    with pytest.raises(ValueError, match=r"refusing to train: .*\(--cpu, num_machines=2\)"):
        check_launch(SimpleNamespace(world_size=1))
    monkeypatch.delenv("MASTER_PORT")
    check_launch(SimpleNamespace(world_size=1))


def test_checkpoint_agreement_between_ranks():
    same = [
        {"checkpoint": "/m0/out/checkpoint-10", "files": ["model.safetensors"]},
        {"checkpoint": "/m1/out/checkpoint-10", "files": ["model.safetensors"]},
    ]
    assert checkpoint_disagreement(same, "last") is None  # per-machine folders: same step, same files
    assert checkpoint_disagreement([{"checkpoint": None}, {"checkpoint": None}], "last") is None  # all fresh
    steps = [{"checkpoint": "/out/checkpoint-10", "host": "a"}, {"checkpoint": "/out/checkpoint-20", "host": "b"}]
    message = checkpoint_disagreement(steps, "last")
    assert "rank 0 on a: /out/checkpoint-10; rank 1 on b: /out/checkpoint-20" in message and "\n" not in message
    explicit = [
        {"checkpoint": "/out/checkpoint-10"},
        {"checkpoint": None, "problem": "/out/checkpoint-10 is not a directory"},
    ]
    assert "rank 1: /out/checkpoint-10 is not a directory" in checkpoint_disagreement(explicit, "/out/checkpoint-10")
    single = [{"checkpoint": None, "problem": "x is not a directory"}]
    assert checkpoint_disagreement(single, "x") == "--resume_from_checkpoint x: x is not a directory"


def test_checkpoint_files_leave_out_what_each_rank_writes_for_itself(tmp_path):
    names = ("model.safetensors", "rng_state_0.pth", "rng_state_1.pth", "rng_state.pth", "checkpoint_manifest.json")
    for name in names:
        (tmp_path / name).write_text("x")
    (tmp_path / "global_step10").mkdir()  # DeepSpeed's per-rank shards
    (tmp_path / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("x")
    assert checkpoint_files(tmp_path) == ["model.safetensors"]


def test_resume_checkpoint_in_one_process_still_refuses_a_missing_path(tmp_path):
    from plugformer.training.common import resume_checkpoint

    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=str(tmp_path / "checkpoint-7"))
    with pytest.raises(ValueError, match=r"^--resume_from_checkpoint .*checkpoint-7: .* is not a directory$"):
        resume_checkpoint(args)
    args.resume_from_checkpoint = None
    assert resume_checkpoint(args) is None


def test_effective_batch_of_trainer_and_grpo_configs():
    from trl import GRPOConfig

    trainer = effective_batch(SimpleNamespace(per_device_train_batch_size=8, gradient_accumulation_steps=4), 16)
    assert trainer["total"] == 512 and trainer["unit"] == "examples"
    # TRL counts completions per device; 2 processes x 64 x 1 = 128 completions = 16 prompts x 8 generations
    config = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=64,
        num_generations=8,
        report_to="none",
    )
    grpo = effective_batch(config, 2)
    assert (grpo["total"], grpo["unit"], grpo["prompts"], grpo["completions_generated_per_process"]) == (
        128,
        "completions",
        16,
        64,
    )
    assert "16 prompts x 8 generations" in distributed.describe_effective_batch(grpo)


def test_a_command_that_succeeded_destroys_the_process_group_and_a_failed_one_leaves_it(tmp_path, capsys):
    """Left to the interpreter's finalization, gloo's group now and then aborted a rank of a finished launch (exit -6
    after the model was saved); the command line destroys it once a command succeeded. A failed command leaves it:
    another rank may still be inside a collective, which a destroy would leave hanging."""
    import torch.distributed as dist

    from plugformer.cli import main

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["eval", "--model", str(tmp_path / "missing")])
        assert exit_info.value.code == 2 and dist.is_initialized()
        main(["info"])
        assert "position_scheme" in capsys.readouterr().out
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
