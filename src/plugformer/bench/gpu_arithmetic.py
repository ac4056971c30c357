"""The arithmetic of the GPU check (`bench.gpu`): model FLOPs and MFU against the device's bf16 peak, and the rounding
bounds its comparisons use (`tests/tolerances.py`'s formula; the package cannot import the tests)."""

from __future__ import annotations

import math

import torch

from ..configuration import PlugformerConfig
from .report import train_flops


# Dense bf16 tensor-core peaks in FLOP/s (no sparsity), from the vendor's data sheets, by a substring of
# `torch.cuda.get_device_name()`; the first match wins (PCIe and NVL before the SXM default).
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),  # nanoGPT's `estimate_mfu` denominator
]
REFERENCE_MFU = "35–46 % (nanoGPT's GPT-2 124M, torchtitan's Llama on A100/H100)"
# Rounding bound of `tests/tolerances.py`: 2 sides × 2 for the probabilistic √n bound; rounded stages per layer.
SAFETY = 4.0
STAGES_PER_LAYER = 10
# A model in float64 still rounds in float32 in places: eager's softmax (`kernels.py`, `softmax(..., dtype=float32)`,
# as transformers' eager functions) and the unfused loss (`logits.float()`); its comparisons use float32's bound.
MODEL_ROUNDING = torch.float32


def model_flops_per_token(matmul_params: int, num_layers: int, num_heads: int, head_dim: float, seq_len: int) -> float:
    """Training FLOPs per token as in nanoGPT's `estimate_mfu` (PaLM, appendix B): 6·N + 12·L·H·d_head·T, where N
    counts the weight matrices (`bench.report.matmul_parameters`), 6 = 2 forward + 4 backward FLOPs per weight, and
    12·L·H·d_head·T the attention products QKᵀ and AV over all T keys (forward and backward). `bench.report.train_flops`
    is this times the batch's tokens."""
    return train_flops(matmul_params, num_layers, num_heads, head_dim, 1, seq_len) / seq_len


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU named `device_name` (`PEAK_BF16_FLOPS`); `None` for any other device."""
    for key, peak in PEAK_BF16_FLOPS if device_name else []:
        if key.lower() in device_name.lower():
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s (FLOPs per token × tokens/s) over the peak; `None` without a peak."""
    return None if peak_flops_per_s is None else flops_per_token * tokens_per_s / peak_flops_per_s


def tolerance(dtype: torch.dtype, magnitude: float, length: int, steps: float) -> float:
    """`tests/tolerances.tolerance`: SAFETY · u · (steps + √length) · magnitude, u the unit roundoff of `dtype`."""
    return SAFETY * torch.finfo(dtype).eps / 2 * (steps + math.sqrt(length)) * magnitude


def model_bound(config: PlugformerConfig, tokens: int, magnitude: float, dtype: torch.dtype) -> float:
    """`tests/tolerances.model_tolerance` for an output of size `magnitude` of a forward of `tokens` through `config`:
    the layers' rounded stages, the longest reduction (hidden, MLP or keys), in `dtype` or `MODEL_ROUNDING`, whichever
    is coarser."""
    length = max(config.hidden_size, config.intermediate_size, tokens)
    dtype = max(dtype, MODEL_ROUNDING, key=lambda d: torch.finfo(d).eps)
    return tolerance(dtype, magnitude, length, STAGES_PER_LAYER * config.num_hidden_layers)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    error = (actual.detach().cpu().double() - expected.detach().cpu().double()).abs().max().item()
    return error if math.isfinite(error) else math.inf
