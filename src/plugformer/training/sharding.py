"""Sharded data parallelism (FSDP2, DeepSpeed ZeRO) as the stages meet it: asked for, really on, or refused.

accelerate 1.15 turns FSDP on only for GPU-type modes: on a CPU (`use_cpu`, which `plugformer train` sets where no
GPU exists) an FSDP launch becomes plain DDP without a word (`AcceleratorState` picks `MULTI_CPU` and drops the
plugin), and DeepSpeed is skipped the same way. Two rules here:

- FSDP2 on CPU is made real: `enable_fsdp2_on_cpu` lets accelerate's own FSDP2 path (`fully_shard` per block named
  in `_no_split_modules`, then the root; gloo collectives) run where it would have fallen back to DDP. The suite
  trains with it and compares against one process (tests/test_fsdp.py).
- DeepSpeed on CPU runs on DeepSpeed's own CPU accelerator (`DS_ACCELERATOR=cpu`, gloo): for a DeepSpeed launch
  without CUDA (configs/accelerate/cpu_zero2.yaml, cpu_zero3.yaml) `plugformer train` leaves `use_cpu` off, with
  which accelerate would skip DeepSpeed, and names the gloo backend, without which accelerate 1.15 gives each
  process a world size of 1 (`deepspeed_on_cpu`, `prepare_deepspeed_on_cpu`; tests/test_deepspeed.py).
- Any other request that would run unsharded or not at all (FSDP1 on CPU, DeepSpeed with an explicit `use_cpu`) is
  refused before a model is built (`refuse_unshardable_request`), and any run whose trainer did not end up sharded
  as asked before training (`refuse_unsharded_fallback`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def requested_sharding(training_args) -> str | None:
    """`"fsdp"` or `"deepspeed"` when the launch (accelerate's environment) or the arguments ask for it, else None."""
    if _flag("ACCELERATE_USE_FSDP") or getattr(training_args, "fsdp", None):
        return "fsdp"
    if _flag("ACCELERATE_USE_DEEPSPEED") or getattr(training_args, "deepspeed", None):
        return "deepspeed"
    return None


# `plugformer train`'s defaults for a DeepSpeed launch without CUDA (instead of use_cpu=True): accelerate runs DeepSpeed
# only without `cpu`; `PartialState` initialises DeepSpeed's process group but, given no backend, counts one process
# per world (it would train independent copies); transformers refuses bf16 without a GPU unless use_cpu is set.
DEEPSPEED_ON_CPU_DEFAULTS = {"use_cpu": False, "ddp_backend": "gloo", "bf16": False}


def deepspeed_on_cpu() -> bool:
    """Whether this process was launched for DeepSpeed (`accelerate launch` with `distributed_type: DEEPSPEED`) on a
    machine without CUDA, where DeepSpeed's CPU accelerator has to run it."""
    return _flag("ACCELERATE_USE_DEEPSPEED") and not torch.cuda.is_available()


def prepare_deepspeed_on_cpu() -> None:
    """Points DeepSpeed at its CPU accelerator for a DeepSpeed launch without CUDA, unless `DS_ACCELERATOR` is set.

    Must run before `deepspeed` is imported: DeepSpeed picks its accelerator once, at import.
    """
    if deepspeed_on_cpu():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def enable_fsdp2_on_cpu() -> None:
    """Makes accelerate's FSDP2 path run on CPU processes (gloo) instead of dropping FSDP for DDP.

    Wraps `AcceleratorState.__init__` once: when it settled on `MULTI_CPU` while the launch asked for FSDP version 2,
    the state becomes `FSDP` with the plugin accelerate built from the environment. Nothing changes on GPUs, where
    accelerate enables FSDP itself, nor for FSDP1 (`refuse_unsharded_fallback` refuses that on CPU).
    """
    from accelerate import state
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if getattr(state.AcceleratorState.__init__, "_plugformer_cpu_fsdp2", False):
        return
    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        version = fsdp_plugin.fsdp_version if fsdp_plugin is not None else int(os.environ.get("FSDP_VERSION", 1))
        if self.distributed_type == DistributedType.MULTI_CPU and _flag("ACCELERATE_USE_FSDP") and version == 2:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin if fsdp_plugin is not None else FullyShardedDataParallelPlugin()

    init._plugformer_cpu_fsdp2 = True
    state.AcceleratorState.__init__ = init


DEEPSPEED_ON_CPU_HINT = (
    'on a CPU machine launch with `--config_file "$(plugformer accelerate-config cpu_zero2.yaml)"` (or '
    "cpu_zero3.yaml) and leave use_cpu unset "
    "(plugformer then runs DeepSpeed's CPU accelerator on gloo)"
)


def refuse_unshardable_request(training_args) -> None:
    """Before any model or trainer is built: refuses the sharding requests that cannot shard on this machine (FSDP1
    on CPU, which accelerate's plugin rejects with a device error; DeepSpeed with `use_cpu`, which accelerate skips:
    `plugformer train` leaves it off for a DeepSpeed launch, so this is an explicit `--use_cpu true`, or a DeepSpeed
    request outside such a launch)."""

    wanted = requested_sharding(training_args)
    on_cpu = training_args.use_cpu or not torch.cuda.is_available()
    launched = _flag("ACCELERATE_USE_FSDP")
    # accelerate's launch says FSDP_VERSION (default 1); transformers' `--fsdp` reads fsdp_config's "version" (default 2)
    version = (
        os.environ.get("FSDP_VERSION", "1") if launched else str((training_args.fsdp_config or {}).get("version", 2))
    )
    if wanted == "fsdp" and on_cpu and version != "2":
        raise ValueError(
            f"the launch asks for FSDP version {version} on CPU, which accelerate cannot run there: on CPU only FSDP "
            "version 2 shards (fsdp_version: 2, as `plugformer accelerate-config cpu_fsdp2`)"
        )
    if wanted == "fsdp" and on_cpu and not launched:
        fsdp = training_args.fsdp
        asked = " ".join(str(getattr(o, "value", o)) for o in fsdp) if isinstance(fsdp, (list, tuple)) else fsdp
        raise ValueError(
            f"--fsdp {asked} asks transformers for FSDP version 2 on CPU, which plugformer shards only under "
            "accelerate's FSDP2 launch: drop --fsdp and run `accelerate launch --config_file "
            '"$(plugformer accelerate-config cpu_fsdp2)" -m plugformer train ...`'
        )
    if wanted == "deepspeed" and training_args.use_cpu:
        raise ValueError(
            "the launch asks for DeepSpeed but use_cpu=True, with which accelerate skips DeepSpeed and trains "
            f"unsharded: {DEEPSPEED_ON_CPU_HINT}"
        )


def refuse_unsharded_fallback(trainer) -> None:
    """Refuses a run that asked for sharding but would train unsharded (the silent DDP fallback)."""
    from accelerate.utils import DistributedType

    wanted = requested_sharding(trainer.args)
    running = trainer.accelerator.distributed_type
    expected = {"fsdp": DistributedType.FSDP, "deepspeed": DistributedType.DEEPSPEED}.get(wanted)
    if expected is None or running == expected:
        return
    hint = (
        "on CPU only FSDP version 2 shards (fsdp_version: 2, as `plugformer accelerate-config cpu_fsdp2`)"
        if wanted == "fsdp"
        else DEEPSPEED_ON_CPU_HINT
    )
    raise ValueError(
        f"the launch asks for {wanted} but accelerate would run {running.value} (unsharded, as DDP or one process): "
        f"refusing rather than training without sharding; {hint}"
    )


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are split over processes (FSDP2 / tensor parallel DTensors, ZeRO-3), so that a
    forward on one rank alone would wait for the others forever."""
    return any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters())


@contextmanager
def alone_on_this_rank() -> Iterator[None]:
    """transformers' ZeRO-3 switch (`is_deepspeed_zero3_enabled`) off in this process meanwhile, for work one rank
    does alone on a plain model: with it on, `from_pretrained` builds the model partitioned (`zero.Init`) and
    `generate` defaults to `synced_gpus`, both collectives the other ranks never join. Nothing changes without it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref  # the module global is_deepspeed_zero3_enabled() reads
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
