"""Shared fixtures: tiny models for every valid (attention_score, position_scheme, kernel) combination."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import plugformer
from plugformer import PlugformerConfig, PlugformerForCausalLM, supported_kernels


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Compiled flex_attention on CPU: torch 2.13's inductor emits C++ that does not compile once it switches to dynamic
# shapes for a score_mod that reads a captured bias; static shapes compile (one kernel per shape, cached).
torch._dynamo.config.automatic_dynamic_shapes = False
torch._dynamo.config.recompile_limit = 1024
torch._dynamo.config.cache_size_limit = 1024

SCORES = plugformer.ATTENTION_SCORES.names()
SCHEMES = plugformer.POSITION_SCHEMES.names()
CPU_TRAINING_KERNELS = ("eager", "sdpa")  # torch 2.13 flex_attention has no backward on CPU


def tiny_config(score: str = "scaled_dot", scheme: str = "rope", **overrides) -> PlugformerConfig:
    return PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **overrides)


def build(config: PlugformerConfig, kernel: str = "eager", seed: int = 0) -> PlugformerForCausalLM:
    """A model in eval mode on `kernel`; configs are deep-copied (models built from one config share it)."""
    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config._attn_implementation = kernel
    return PlugformerForCausalLM(config).eval()


# Each compiled flex kernel costs seconds on a cold CPU cache. The causal suite runs flex on every combination; the
# encoder and seq2seq suites on these: every position scheme once, the dot-product scores taken in turn (each of them
# too while there are at least as many schemes), read from the registries.
DOT_PRODUCT_SCORES = [name for name in SCORES if plugformer.ATTENTION_SCORES.get(name).dot_product]
FLEX_REPRESENTATIVES = {(DOT_PRODUCT_SCORES[i % len(DOT_PRODUCT_SCORES)], scheme) for i, scheme in enumerate(SCHEMES)}


def combinations(kernels=None, all_flex=True, **overrides) -> list:
    """pytest params for every valid (score, scheme, kernel), id `score-scheme-kernel`; with `all_flex=False`,
    flex_attention only for `FLEX_REPRESENTATIVES`."""
    params = []
    for score in SCORES:
        for scheme in SCHEMES:
            for kernel in supported_kernels(tiny_config(score, scheme, **overrides)):
                if kernels is not None and kernel not in kernels:
                    continue
                if kernel == "flex_attention" and not all_flex and (score, scheme) not in FLEX_REPRESENTATIVES:
                    continue
                params.append(pytest.param(score, scheme, kernel, id=f"{score}-{scheme}-{kernel}"))
    return params


def trainable_on_this_device(kernel: str) -> bool:
    return kernel in CPU_TRAINING_KERNELS or torch.cuda.is_available()


@pytest.fixture
def tokens() -> torch.Tensor:
    """A fixed (2, 12) batch of ids avoiding the special ids 0-2."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(3, 128, (2, 12), generator=generator)
