"""A guard before building a model from a config: its parameter count, the bytes that weights (and, when training,
gradients and AdamW's two moments) take, against the memory available, refused with the fields that drive the size
unless `PLUGFORMER_SKIP_MEMORY_CHECK=1`.

The count is read off the model itself, built on the meta device (shapes without storage: no memory, a fraction of a
second even for tens of billions of parameters), so every variant, norm and feed-forward is counted as built, with no
second description of the architecture here. `tests/test_memory.py` checks it against transformers' own models
(Llama, Qwen3, GPT-2, T5) and hand formulas. The estimate is a lower bound (activations, the data, the allocator's slack
and a second copy during a load are not counted): a refusal means the model cannot fit, never that it might not.
"""

from __future__ import annotations

import copy

import torch

from ..modeling import (
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
    PlugformerForSequenceClassification,
    PlugformerForTokenClassification,
)
from .files import size_text
from .flags import environment_flag


OVERRIDE = "PLUGFORMER_SKIP_MEMORY_CHECK"
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")  # fmt: skip
# bytes per parameter: fp32 weights; training adds an fp32 gradient and AdamW's two fp32 moments
INFERENCE_BYTES, TRAINING_BYTES = 4, 16
HEADS = {
    "causal_lm": PlugformerForCausalLM,
    "masked_lm": PlugformerForMaskedLM,
    "seq2seq": PlugformerForConditionalGeneration,
    "sequence_classification": PlugformerForSequenceClassification,
    "token_classification": PlugformerForTokenClassification,
}


def parameter_count(config, head: str | None = None) -> int:
    """Parameters of the model `config` builds, shared (tied) ones counted once.

    Args:
        config ([`PlugformerConfig`]): The configuration; not changed.
        head (`str`, *optional*): `causal_lm`, `masked_lm`, `seq2seq`, `sequence_classification` or
            `token_classification`; by default the LM head the config implies (seq2seq, causal or masked).
    """
    head = head or ("seq2seq" if config.is_encoder_decoder else "causal_lm" if config.is_causal else "masked_lm")
    if head not in HEADS:
        raise ValueError(f"head={head!r}: choose one of {list(HEADS)}")
    # A copy (a model writes its resolved kernel onto its config), on eager: every kernel builds the same parameters,
    # and eager computes every config, so the count never fails on a kernel this machine lacks.
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = HEADS[head](config)
    # `parameters()` yields a tied parameter (the LM head sharing the embedding) once
    return sum(parameter.numel() for parameter in model.parameters())


def available_memory(device: str | None = None) -> tuple[int | None, str]:
    """(bytes available, where) on `device` (`cuda[:N]` or `cpu`; by default CUDA when present): the free device
    memory, or the system's MemAvailable."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} has"
    try:
        import psutil  # accelerate's dependency

        return psutil.virtual_memory().available, "this machine has"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine has"
    except OSError:
        pass
    return None, "unknown"


def check_model_fits(config, training: bool, device: str | None = None, copies: int = 1, what: str = "") -> None:
    """Raises `ValueError` naming the size fields, the estimate and the memory available when the parameters (with
    `training`, also their gradients and AdamW's moments; `copies` models at once) exceed it; skipped when
    `PLUGFORMER_SKIP_MEMORY_CHECK` is set to anything but 0/false/no."""
    if environment_flag(OVERRIDE):
        return
    available, where = available_memory(device)
    if available is None:
        return
    parameters = parameter_count(config)
    per_parameter = TRAINING_BYTES if training else INFERENCE_BYTES
    needed = parameters * per_parameter * copies
    if needed <= available:
        return
    fields = ", ".join(f"{name}={getattr(config, name)}" for name in SIZE_FIELDS)
    kind = "fp32 weights, gradients and AdamW's two moments" if training else "fp32 weights"
    raise ValueError(
        f"{what + ': ' if what else ''}{fields} make {parameters / 1e9:.2f}B parameters, which need at least "
        f"{size_text(needed)} ({per_parameter} bytes each: {kind}{f', {copies} models' if copies > 1 else ''}) but "
        f"{where} {size_text(available)} available; make those fields smaller, or set {OVERRIDE}=1 to build it anyway"
    )
