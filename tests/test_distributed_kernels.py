"""The sdpa entry point's custom autograd kernels under 2-process training on CPU (gloo): `kernels_relative` (KERPLE),
`kernels_alibi` (ALiBi), `kernels_banded` (clamped and T5 biases over more tokens than their far distance) and
`kernels_query_bias` (FIRE and forgetting attention, in training) run forward and backward on every rank with FSDP2
(`fully_shard`) and with DDP, and both train to the weights one process reaches on the whole batch. One `torchrun`
launch (`kernels_fsdp_worker.py`) runs every case. `fully_shard` takes every parameter (it refused FIRE's c and L
scales while they were 0-d).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernels_fsdp_worker import CASES, LENGTH, STEPS
from test_fsdp import ENV, free_port
from tolerances import model_length, model_steps, tolerance

from plugformer import PlugformerConfig


WORKER = Path(__file__).with_name("kernels_fsdp_worker.py")
LAYERS = 2  # the tiny preset's num_hidden_layers: one kernel call per layer and forward
RUNS = {"fsdp2": "FSDPPlugformerForCausalLM", "ddp": "DistributedDataParallel"}
# Parameters whose exact gradient is 0, so AdamW (which divides each gradient element by its own size) steps on fp32
# rounding noise, as far in the reference as in the 2-process runs: FIRE's output bias adds a constant to each row's
# scores (the softmax ignores it), and at these distances (FIRE's inputs in [0, 0.23]) no ReLU of f_θ's hidden layer
# changes sign along a row, so its input bias does the same. In fp64 their gradients are 2e-19 and 1e-18.
ZERO_GRADIENT = {"fire": {"model.positions.mlp_in.bias", "model.positions.mlp_out.bias"}}
# fp32 sums in another order (each rank's half, then the mean over ranks): first gradients agree to 2.6e-8 (relative
# 4.5e-7), within a training step's bound (`gradient_bound`). AdamW divides each gradient element by its size, so the difference of small elements grows: after 3 steps at
# lr 1e-3 the weights differ by up to 4.7e-6 (ALiBi's embedding; at lr 1e-2 4.7e-5, and 1.1e-4 on the eager path,
# without these kernels, so it is the optimizer, not a kernel), and by 1.04e-5 in a run where the machine's thread
# count changed the summation order. The bound is 1.7 % of the 3e-3 the 3 steps can move a weight; a kernel's error
# shows in the gradients first, whose bound is tight.
WEIGHT_ATOL = 5e-5


def gradient_bound(scheme: str, scales: dict[str, float]) -> float:
    """`atol` of the first step's gradients, 2 processes against 1: fp32 through the case's model over LENGTH tokens,
    the largest gradient's size (`tolerances.gradient_tolerance`'s figures)."""
    config = PlugformerConfig.from_preset("tiny", position_scheme=scheme, **CASES[scheme][0])
    return tolerance(
        torch.float32, magnitude=max(scales.values()), length=model_length(config, LENGTH), steps=model_steps(config)
    )


def scheme_parameters(scheme: str) -> set[str]:
    """The parameters the position scheme adds to its case's model: the stack's (`model.positions.`) and the ones a
    `per_layer` scheme adds to each attention layer (forgetting attention's gates)."""
    from plugformer import PlugformerForCausalLM

    names = {}
    for name in (scheme, "none"):
        config = PlugformerConfig.from_preset("tiny", position_scheme=name, **CASES[scheme][0])
        names[name] = {parameter for parameter, _ in PlugformerForCausalLM(config).named_parameters()}
    return names[scheme] - names["none"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("kernels") / "results.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(WORKER),
        str(output),
    ]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(output.read_text())


@pytest.mark.parametrize("scheme", CASES)
def test_each_kernel_runs_forward_and_backward_on_every_rank(results, scheme):
    _, entry, function = CASES[scheme]
    calls = [results[scheme]["reference"]]
    for run, wrapper in RUNS.items():
        assert results[scheme][run]["class"] == wrapper
        calls += results[scheme][run]["calls"]  # one per rank
    for made in calls:
        assert set(made) == {entry, f"{function.__name__}.backward"}, made  # this kernel, and no other
        assert made[entry] == LAYERS * STEPS and made[f"{function.__name__}.backward"] >= LAYERS * STEPS, made


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("scheme", CASES)
def test_two_processes_train_to_the_one_process_weights(results, scheme, run):
    case, exempt = results[scheme], ZERO_GRADIENT.get(scheme, set())
    assert {name for name, scale in case["gradient_scale"].items() if scale < 1e-8} == exempt
    gradients, weights = case[run]["gradient_differences"], case[run]["differences"]
    assert gradients.keys() == weights.keys() == case["gradient_scale"].keys()
    bound = gradient_bound(scheme, case["gradient_scale"])
    assert {name: d for name, d in gradients.items() if d > bound} == {}
    assert {name: d for name, d in weights.items() if d > WEIGHT_ATOL and name not in exempt} == {}
    # the position scheme's parameters got a gradient through the kernel's backward and moved (ALiBi has none)
    owned = scheme_parameters(scheme)
    moved = {name: d for name, d in case[run]["moved"].items() if name in owned and name not in exempt}
    assert (moved != {}) == (scheme != "alibi")
    assert {name: d for name, d in moved.items() if d < 1e-4} == {}, "a scheme parameter did not move"


def every_variant_config(**overrides) -> list:
    """The tiny preset with each score x scheme, each attention projection and each attention modifier that the config
    accepts with `overrides`."""
    from conftest import PROJECTIONS, SCHEMES, SCORES, tiny_config

    from plugformer.runtime.variants import ATTENTION_MODIFIERS, modifier_fields

    fields = [{"score": score, "scheme": scheme} for score in SCORES for scheme in SCHEMES]
    fields += [{"projection": projection, "num_key_value_heads": 4} for projection in PROJECTIONS]
    fields += [modifier_fields(field, value, 2) for field, values in ATTENTION_MODIFIERS.items() for value in values]
    configs = []
    for chosen in fields:
        with contextlib.suppress(ValueError):  # a combination the config refuses (e.g. a latent seq2seq)
            configs.append(tiny_config(**chosen, **overrides))
    return configs


@pytest.mark.parametrize("seq2seq", [False, True], ids=["causal", "seq2seq"])
def test_no_variant_has_a_0d_parameter(seq2seq):
    """`fully_shard` (FSDP2) refuses 0-d parameters ("doesn't support scalar parameters"): every variant's parameters
    are at least vectors (FIRE's c and L scales were 0-d)."""
    from plugformer import PlugformerForCausalLM, PlugformerForConditionalGeneration

    head = PlugformerForConditionalGeneration if seq2seq else PlugformerForCausalLM
    configs = every_variant_config(**({"is_encoder_decoder": True, "pad_token_id": 0} if seq2seq else {}))
    scalars = {
        (config.position_scheme, name)
        for config in configs
        for name, p in head(config).named_parameters()
        if p.ndim == 0
    }
    assert len(configs) > 30 and scalars == set()
