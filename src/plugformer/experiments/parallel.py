"""Side-by-side stages for `plugformer pipeline --jobs N`: each stage runs as its own `plugformer train` process, as
soon as the stages it starts from have finished, on at most N CPU cores at once.

pretrain -> sft is a chain, but after SFT three branches are independent (reward -> rlhf, dpo, grpo), so on two
cores they run two at a time, the branch with the most work ahead first (`chain_work`): a long branch started last
would run alone at the end while the other core idles. A stage that is the only one able to run (pretrain, sft) gets
every free core as a data-parallel job (`accelerate launch`, gloo) with its per-device batch divided by the process
count: the effective batch, the steps and the learning-rate schedule stay those of its YAML. RL stages (rlhf, grpo)
always run in one process: their per-device batch is groups of completions, which a split would change. Each job's
output goes to `<output_dir>/logs/<stage>.log`. The held-out test scores (`plugformer eval`, one process each, logs
`<stage>.test.log`) run on cores no stage is waiting for, mostly while the last branch finishes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from ..training import STAGES


@dataclass
class Job:
    """One task of the pipeline (a stage's training, or its test scores): its commands, run one after the other."""

    stage: str
    commands: list[list[str]]
    processes: int = 1
    on_trained: Callable[[], None] | None = None  # called once the training command has succeeded
    process: subprocess.Popen | None = None
    started: float = 0.0
    finished: float | None = None
    returncode: int | None = None
    done_commands: int = 0
    log: Path | None = None
    _log_file: object = field(default=None, repr=False)


def free_port() -> int:
    """A TCP port nobody listens on now, for one data-parallel job's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# configs/accelerate/cpu_2proc.yaml's topology: accelerate starts torch.distributed on gloo only through MULTI_GPU
# with use_cpu (its own MULTI_CPU needs MPI), and its command line refuses --multi_gpu together with --cpu
CPU_DATA_PARALLEL = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
                     "machine_rank": 0, "mixed_precision": "no", "rdzv_backend": "static", "same_network": True,
                     "use_cpu": True}  # fmt: skip


def train_command(stage: str, argv: list[str], processes: int, log_dir: Path) -> list[str]:
    """`plugformer train STAGE ARGV` in this interpreter; under `accelerate launch` (gloo, CPU) for > 1 process,
    with an accelerate config written to `log_dir`."""
    import yaml

    train = ["-m", "plugformer", "train", stage, *argv]
    if processes == 1:
        return [sys.executable, *train]
    config = Path(log_dir, f"accelerate_{processes}proc.yaml")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump({**CPU_DATA_PARALLEL, "num_processes": processes}))
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
    ]
    return [*launch, *train]


def split_batch(stage: str, per_device_batch: int, free: int) -> int:
    """How many processes `stage` trains on when `free` cores are idle and nothing else can run: the most that
    divide its per-device batch evenly (so the effective batch stays the YAML's); 1 for a stage whose record is not
    `data_parallel` (online RL)."""
    if not STAGES.get_stage(stage).data_parallel:
        return 1
    return max(k for k in range(1, free + 1) if per_device_batch % k == 0)


def estimated_work(script_args, training_args) -> float:
    """The examples a stage's optimizer steps process (max_steps x per-device batch x accumulation; without max_steps
    train_examples x epochs): the unit `run_jobs` orders side-by-side stages by. A proxy: an RL example also
    generates its completion, so equal counts are not equal times; it tells a 500-step stage from a 50-step one."""
    batch = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    if training_args.max_steps > 0:
        return float(training_args.max_steps * batch)
    return float(getattr(script_args, "train_examples", 0) * training_args.num_train_epochs)


def subprocess_environment() -> dict[str, str]:
    """This process's environment, with one thread per process unless the caller chose otherwise: N jobs each
    using every core would oversubscribe the machine."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    return env


def _start_next(job: Job, env: dict[str, str]) -> None:
    command = job.commands[job.done_commands]
    job._log_file.write(f"\n$ {' '.join(command)}\n")
    job._log_file.flush()
    job.process = subprocess.Popen(command, stdout=job._log_file, stderr=subprocess.STDOUT, env=env)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def chain_work(needs: dict[str, set[str]], work: dict[str, float]) -> dict[str, float]:
    """Per task, its own `work` (0 if not given) plus the most work of any chain of tasks that need it: the longest
    path still ahead once it starts (the critical-path rule of list scheduling).

    >>> chain_work({"a": set(), "b": {"a"}, "c": {"a"}, "d": {"c"}}, {"a": 1, "b": 5, "c": 2, "d": 2})
    {'a': 6, 'b': 5, 'c': 4, 'd': 2}
    """
    ahead: dict[str, float] = {}

    def visit(task: str) -> float:
        if task not in ahead:
            after = [visit(other) for other in needs if task in needs[other]]
            ahead[task] = work.get(task, 0) + max(after, default=0)
        return ahead[task]

    return {task: visit(task) for task in needs}


def run_jobs(
    make_job: Callable[[str, int], Job],
    needs: dict[str, set[str]],
    jobs: int,
    log_dir: Path,
    poll_seconds: float = 0.5,
    spread: Collection[str] | None = None,
    work: dict[str, float] | None = None,
) -> dict[str, Job]:
    """Runs every task of `needs` as soon as what it needs has finished, on at most `jobs` cores; where several can
    start, the one heading the most remaining work goes first (`chain_work` of `work`, the estimated work per task;
    ties, and every task without `work`, in `needs`'s order).

    `make_job(task, free_cores)` builds a task's job when it can start. A task of `spread` (default: every task) is
    told how many cores are idle when nothing runs and no other task of `spread` can start, else 1: the pipeline's
    test scores (not in `spread`, after the stages in `needs`) wait for a free core instead of splitting one. A
    failed job stops new starts; the running ones finish (their work is kept and reused next time), then a
    `RuntimeError` names the failed tasks and shows their logs' last lines.
    """
    env = subprocess_environment()
    log_dir.mkdir(parents=True, exist_ok=True)
    ahead = chain_work(needs, work or {})
    waiting, running, finished = sorted(needs, key=lambda task: -ahead[task]), [], {}
    failed: list[Job] = []
    try:
        while running or (waiting and not failed):
            ready = [s for s in waiting if needs[s] <= finished.keys()] if not failed else []
            free = jobs - sum(job.processes for job in running)
            while ready and free > 0:
                stage = ready.pop(0)
                may_spread = spread is None or stage in spread
                alone = not running and not [s for s in ready if spread is None or s in spread]
                job = make_job(stage, free if may_spread and alone else 1)
                waiting.remove(stage)
                job.started = time.perf_counter()
                if not job.commands:  # nothing to do (a reused stage): its log stays that of its run
                    job.finished, job.returncode = job.started, 0
                    finished[stage] = job
                    continue
                job.log = log_dir / f"{stage}.log"
                job._log_file = job.log.open("w")
                print(
                    f"=== {stage}: started on {job.processes} process{'es' if job.processes > 1 else ''} "
                    f"(log: {job.log})",
                    flush=True,
                )
                _start_next(job, env)
                running.append(job)
                free -= job.processes
            time.sleep(poll_seconds)
            for job in list(running):
                code = job.process.poll()
                if code is None:
                    continue
                job.done_commands += 1
                if code == 0 and job.done_commands == 1 and job.on_trained is not None:
                    job.on_trained()
                if code == 0 and job.done_commands < len(job.commands):
                    _start_next(job, env)
                    continue
                job.returncode, job.finished = code, time.perf_counter()
                job._log_file.close()
                running.remove(job)
                finished[job.stage] = job
                status = "finished" if code == 0 else f"FAILED (exit {code})"
                print(f"=== {job.stage}: {status} after {job.finished - job.started:.0f}s", flush=True)
                if code != 0:
                    failed.append(job)
    except BaseException as error:
        for job in running:  # Ctrl-C reached the children too (same process group); anything else stops them here
            if not isinstance(error, KeyboardInterrupt):
                job.process.terminate()
            try:
                job.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                job.process.kill()
        raise
    if failed:
        shown = "\n\n".join(
            f"--- {job.stage} (exit {job.returncode}), last lines of {job.log}:\n{_tail(job.log)}" for job in failed
        )
        not_started = f"; not started: {waiting}" if waiting else ""
        raise RuntimeError(f"pipeline stage(s) {[job.stage for job in failed]} failed{not_started}\n{shown}")
    return finished


def read_scores(path: Path) -> dict:
    """The held-out scores a job's `plugformer eval --output` wrote (without the key of what they depend on, which
    the in-process scores have not)."""
    return {name: value for name, value in json.loads(path.read_text()).items() if name != "key"}
