"""Run by tests/test_fsdp.py under `torchrun --nproc_per_node 2` (gloo): FSDP2 (`fully_shard` on every
decoder layer, then the root) with `DevSelection` scoring a scripted dev curve (best at step 0), three AdamW steps,
then the restore at the end of training. Writes whether every parameter (gathered whole) equals its step-0 value."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from worker_exit import finish

from plugformer import PlugformerConfig, PlugformerForCausalLM
from plugformer.training import selection


def full(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole from the sharded state (what a save reads)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def main(output: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = PlugformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = PlugformerForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    scores = iter([1.0, 0.0])  # step 0 is the best

    def scripted_exact_match(model, *args, **kwargs):
        with torch.no_grad():
            model(input_ids=ids)  # scoring runs forwards, as generation does
        return {"exact_match": next(scores), "format": 1.0}

    selection.exact_match = scripted_exact_match
    callback = selection.DevSelection(rows=None, tokenizer=None, every=100)
    state = type("State", (), {"global_step": 0})()
    callback.on_train_begin(None, state, None, model=model)
    start = full(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state.global_step = 3
    callback.on_train_end(None, state, None, model=model)
    restored = full(model)
    differ = sorted(name for name in start if not torch.equal(start[name], restored[name]))
    if dist.get_rank() == 0:
        with open(output, "w") as file:
            json.dump({"differ": differ, "parameters": len(start)}, file)
    finish()  # barrier, destroy, exit without finalization (see worker_exit)


if __name__ == "__main__":
    main(sys.argv[1])
