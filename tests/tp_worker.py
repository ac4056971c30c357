"""The distributed half of `test_tensor_parallel.py`: run by `torchrun --nproc_per_node 2`, it loads each checkpoint
of a manifest twice, in this process alone and with `tp_plan="auto"` across the ranks, runs both on the same inputs
and writes what it measured, one JSON file per rank, for the test to assert on.

    torchrun --nproc_per_node 2 tests/tp_worker.py MANIFEST OUT_DIR

MANIFEST is a JSON list of cases `{"name", "path", "head", "kernel", "generate", "train"}`: `head` names a
`plugformer` model class, `kernel` an `attn_implementation` (`null`: the default), `generate` asks for greedy decoding,
`train` for the loss and every parameter's gradient. A case whose loading or running raises records the error (type
and message) instead, so one failure does not hide the others; every rank fails alike, so no collective is left
waiting.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
import warnings

import torch
from tolerances import gradient_tolerance, model_length, model_steps, model_tolerance, tolerance
from torch.distributed.tensor import DTensor
from worker_exit import finish

import plugformer


def inputs_for(config) -> dict[str, torch.Tensor]:
    """The same inputs on every rank: a batch of 2 whose second row is padded (on the left for a decoder, on the right
    otherwise), so the masks take part."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (2, 10), generator=generator)
    mask = torch.ones_like(ids)
    if config.is_causal and not config.is_encoder_decoder:
        mask[1, :3] = 0
    else:
        mask[1, 7:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, config.vocab_size, (2, 7), generator=generator)
    return inputs


def labels_for(head: str, config, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if head == "PlugformerForSequenceClassification":
        return torch.arange(2) % config.num_labels
    if head == "PlugformerForTokenClassification":
        return inputs["input_ids"] % config.num_labels
    return inputs.get("decoder_input_ids", inputs["input_ids"])


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one gathered from the ranks (a collective: every rank calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gradient_differences(sharded, reference) -> dict[str, float]:
    """`name -> max |Δ|` between the gradients of the two models (inf when only one of them has a gradient)."""
    expected = dict(reference.named_parameters())
    differences = {}
    for name, param in sharded.named_parameters():
        mine, theirs = param.grad, expected[name].grad
        if mine is None or theirs is None:
            differences[name] = 0.0 if mine is None and theirs is None else math.inf
        else:
            differences[name] = (full(mine) - theirs).abs().max().item()
    return differences


def run_case(case: dict) -> dict:
    head = getattr(plugformer, case["head"])
    options = {} if case["kernel"] is None else {"attn_implementation": case["kernel"]}
    reference = head.from_pretrained(case["path"], **options).eval()
    sharded = head.from_pretrained(case["path"], tp_plan="auto", **options).eval()
    inputs = inputs_for(reference.config)
    with torch.no_grad():
        expected, actual = reference(**inputs).logits, sharded(**inputs).logits
    tokens = inputs["input_ids"].shape[1]
    result = {
        "max_abs_diff": (actual - expected).abs().max().item(),
        # the all-reduce sums the heads' partial outputs in another order: fp32's rounding through the model
        "atol": model_tolerance(reference.config, expected),
        "logits_shape": [list(actual.shape), list(expected.shape)],
        "kernel": sharded.config._attn_implementation,
        # name -> [local shape, full shape] of every parameter tensor parallelism split
        "sharded": {
            name: [list(param.to_local().shape), list(param.shape)]
            for name, param in sharded.named_parameters()
            if isinstance(param, DTensor)
        },
    }
    if case["train"]:
        # With gradients transformers runs the sharded layers on DTensors: another code path than inference's
        labels = labels_for(case["head"], reference.config, inputs)
        losses = []
        for model in (sharded, reference):
            loss = model(**inputs, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
        result["loss_diff"] = abs(losses[0] - losses[1])
        result["grad_diff"] = gradient_differences(sharded, reference)
        length, steps = model_length(reference.config, tokens), model_steps(reference.config)
        result["loss_atol"] = tolerance(torch.float32, magnitude=max(abs(losses[1]), 1.0), length=length, steps=steps)
        grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
        result["grad_atol"] = gradient_tolerance(reference.config, grads, tokens)
    if case["generate"]:
        prompt = {key: value for key, value in inputs.items() if key != "decoder_input_ids"}
        greedy = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        result["generated"] = sharded.generate(**prompt, **greedy).tolist()
        result["generated_reference"] = reference.generate(**prompt, **greedy).tolist()
    return result


def main(manifest_path: str, out_dir: str) -> None:
    # `from_pretrained(tp_plan=...)` is deprecated in favour of `distributed_config`, but it is the documented call
    warnings.filterwarnings("ignore", message="Passing `tp_plan` directly", category=FutureWarning)
    with open(manifest_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        start = time.perf_counter()
        try:
            results[case["name"]] = run_case(case)
        except Exception as error:  # recorded for the test (an expected refusal is one such case)
            results[case["name"]] = {
                "error": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(limit=-4),
            }
        results[case["name"]]["seconds"] = time.perf_counter() - start
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    finish()  # barrier, destroy, exit without finalization (see worker_exit)


if __name__ == "__main__":
    main(*sys.argv[1:])
