"""Run by tests/test_fsdp.py under `torchrun --nproc_per_node 2` (gloo): FSDP2 (`fully_shard` on every block named in
`_no_split_modules`, then the root) trains a saved checkpoint for a few AdamW steps, each rank on its half of a fixed
batch, then digests and saves the sharded model. `python fsdp_worker.py --single IN OUT` runs the same steps on the
whole batch in one process: the reference."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from worker_exit import finish

import plugformer  # noqa: F401  (registers the Auto classes)
from plugformer.training.common import parameter_digest


STEPS = 3


def batch() -> torch.Tensor:
    return torch.randint(3, 120, (4, 16), generator=torch.Generator().manual_seed(7))  # (B, T)


def train(model, ids: torch.Tensor) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def sharded(source: str, output: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(source)
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    fully_shard(model)
    local_shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    losses = train(model, batch()[rank::world])  # equal halves: the mean of the ranks' gradients is the batch's
    digest = parameter_digest(model)
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    model.save_pretrained(output)
    if rank == 0:
        info = {"class": type(model).__name__, "digests": digests, "losses": losses, "local_shapes": local_shapes}
        with open(f"{output}/worker.json", "w") as file:
            json.dump(info, file)
    finish()  # barrier, destroy, exit without finalization (see worker_exit)


def single(source: str, output: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(source)
    losses = train(model, batch())
    model.save_pretrained(output)
    with open(f"{output}/worker.json", "w") as file:
        json.dump({"digests": [parameter_digest(model)], "losses": losses}, file)


if __name__ == "__main__":
    if sys.argv[1] == "--single":
        single(*sys.argv[2:])
    else:
        sharded(*sys.argv[1:])
