"""Run by tests/test_distributed_kernels.py under `torchrun --nproc_per_node 2` (gloo): for each position scheme whose
causal training call the `sdpa` entry point sends to a custom autograd kernel (`kernels_relative`, `kernels_alibi`,
`kernels_banded`, `kernels_query_bias`: FIRE and forgetting attention), a tiny model trained `STEPS` AdamW steps with
FSDP2 (`fully_shard` on every block named in `_no_split_modules`, then the root) and with DDP, each rank on its half of
a fixed batch, and on rank 0 in one process without a wrapper on the whole batch (the reference). Counts each kernel's
entry-point and hand-written backward calls on every rank, and writes per scheme every parameter's largest difference
from the reference: of its first gradient and of its trained weights."""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
from worker_exit import finish

from plugformer import PlugformerConfig, PlugformerForCausalLM
from plugformer.kernels_alibi import LinearBiasAttention
from plugformer.kernels_banded import BandedBiasAttention
from plugformer.kernels_query_bias import QueryBiasAttention
from plugformer.kernels_relative import RelativeBiasAttention
from plugformer.kernels_sdpa import SDPA_PATHS


STEPS = 3
LR = 1e-3
LENGTH = 16  # > the far distance 8 of clamped_bias (the tiny preset's) and of t5_bias (set below): banded applies
# scheme -> (config overrides, the sdpa path (`kernels_sdpa.SDPA_PATHS`) its calls must take, that path's autograd
# Function)
T5_BUCKETS = {"relative_attention_num_buckets": 8, "relative_attention_max_distance": 8}
CASES = {
    "kerple_log": ({}, "relative_bias", RelativeBiasAttention),
    "alibi": ({}, "linear_bias", LinearBiasAttention),
    "clamped_bias": ({}, "banded_bias", BandedBiasAttention),
    "t5_bias": (T5_BUCKETS, "banded_bias", BandedBiasAttention),
    "fire": ({}, "query_bias", QueryBiasAttention),
    "forgetting": ({}, "query_bias", QueryBiasAttention),
}
CALLS: Counter = Counter()


def counted(function, name: str):
    """`function`, counting its calls in `CALLS[name]`."""

    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return function(*args, **kwargs)

    return wrapper


def count_kernel_calls() -> None:
    """Swaps each path's record in `SDPA_PATHS` (which `sdpa_forward` reads at each call) for one whose `forward`
    counts, and wraps each kernel's `backward` (which autograd's node looks up on the Function class when it runs)."""
    for name in {path for _, path, _ in CASES.values()}:
        SDPA_PATHS.replace(name, forward=counted(SDPA_PATHS[name].forward, name))
    for function in {function for _, _, function in CASES.values()}:
        function.backward = staticmethod(counted(function.backward, f"{function.__name__}.backward"))


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole: FSDP2's are DTensors (a collective every rank reaches, in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(model, ids: torch.Tensor) -> tuple[dict, dict]:
    """`STEPS` AdamW steps. Returns the kernel calls they made and every parameter's first gradient, whole."""
    CALLS.clear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first = {}
    for step in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
        if step == 0:
            first = {name.removeprefix("module."): gathered(p.grad).clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return dict(CALLS), first


def full(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its name in the unwrapped model."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {name.removeprefix("module."): gathered(p).detach().clone() for name, p in model.named_parameters()}


def shard(model) -> None:
    """`fully_shard` on every block, then the root (as accelerate's FSDP2 plugin wraps a model)."""
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    fully_shard(model)


def run_case(scheme: str, overrides: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    config = PlugformerConfig.from_preset("tiny", position_scheme=scheme, attn_implementation="sdpa", **overrides)
    start = PlugformerForCausalLM(config)  # fp32, the same weights on both ranks (same seed)
    ids = torch.randint(3, 120, (4, LENGTH), generator=torch.Generator().manual_seed(7))  # (B, T)
    # equal halves, no padding: each half's loss is a mean over 2 x 15 tokens, so the mean of the ranks' gradients
    # (what FSDP2's reduce-scatter and DDP's all-reduce compute) is the whole batch's gradient
    half = ids[rank::world]
    result = {}
    if rank == 0:
        reference = copy.deepcopy(start)
        result["reference"], gradients = train(reference, ids)
        weights = full(reference)
        result["gradient_scale"] = {name: g.abs().max().item() for name, g in gradients.items()}
    sharded = copy.deepcopy(start)
    shard(sharded)
    runs = {"fsdp2": (sharded, train(sharded, half))}
    ddp = DistributedDataParallel(copy.deepcopy(start))
    runs["ddp"] = (ddp, train(ddp, half))
    initial = dict(start.named_parameters())
    for run, (model, (calls, first)) in runs.items():
        every_rank = [None] * world
        dist.all_gather_object(every_rank, calls)
        trained = full(model)
        if rank == 0:
            result[run] = {
                "class": type(model).__name__,
                "calls": every_rank,
                "gradient_differences": {name: (g - gradients[name]).abs().max().item() for name, g in first.items()},
                "differences": {name: (p - weights[name]).abs().max().item() for name, p in trained.items()},
                "moved": {name: (p - initial[name]).abs().max().item() for name, p in trained.items()},
            }
    return result


def main(output: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    count_kernel_calls()
    results = {scheme: run_case(scheme, overrides, rank, world) for scheme, (overrides, _, _) in CASES.items()}
    if rank == 0:
        with open(output, "w") as file:
            json.dump(results, file, indent=1)
    finish()  # barrier, destroy, exit without finalization (see worker_exit)


if __name__ == "__main__":
    main(sys.argv[1])
