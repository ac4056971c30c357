"""Arithmetic on the samples (throughput, ratios, FLOPs, MFU) and the written report (`bench.md`, `bench.json`)."""

from __future__ import annotations

import datetime
import os
import platform
import resource
from pathlib import Path

import torch
import transformers
from torch import nn

from ..runtime.files import write_json_atomic
from .measure import median


def matmul_parameters(model: nn.Module) -> int:
    """N of the 6·N FLOPs rule: parameters of weight matrices (≥ 2-D, outside embedding lookups), the LM head
    counted even when tied to the embedding (the head is a matmul, the lookup is not). Biases and norms are left out.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        total += sum(p.numel() for p in module.parameters(recurse=False) if p.ndim >= 2)
    return total


def train_flops(
    matmul_params: int, num_layers: int, num_heads: int, head_dim: float, batch_size: int, seq_len: int
) -> int:
    """Model FLOPs of one training step, counted as in PaLM (Chowdhery et al. 2022, appendix B), per token:
    6·N for the weight matmuls (2·N forward, 4·N backward) + 12·L·H·d_head·T for attention (QKᵀ and AV, 2·T·d_head
    FLOPs each per head and token forward, ×3 with the backward), over the full T×T scores although a causal
    kernel may skip about half. Score functions beyond a dot product (additive's tanh) are not counted."""
    return round(batch_size * seq_len * (6 * matmul_params + 12 * num_layers * num_heads * head_dim * seq_len))


def throughput(tokens: int, seconds: list[float]) -> float:
    """Tokens per second at the median time."""
    return tokens / median(seconds)


def compare(tokens: int, seconds_a: list[float], seconds_b: list[float]) -> dict[str, float]:
    """A's throughput over B's (> 1: A faster) as the ratio of the medians, and the range of the per-repeat ratios
    of the interleaved pairs (A_i, B_i): a spread the machine's noise puts around the ratio."""
    paired = [b / a for a, b in zip(seconds_a, seconds_b, strict=True)]
    return {
        "ratio": throughput(tokens, seconds_a) / throughput(tokens, seconds_b),
        "paired_min": min(paired),
        "paired_max": max(paired),
    }


def utilisation(flops: int, seconds: list[float], peak_flops_per_s: float) -> dict[str, float]:
    """Achieved FLOP/s at the median time, and model FLOPs utilisation = achieved / measured matmul peak."""
    achieved = flops / median(seconds)
    return {"achieved_flops_per_s": achieved, "mfu": achieved / peak_flops_per_s}


def machine(device: str) -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    from .. import __version__
    from ..runtime.denormals import denormals_flushed

    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "subnormals_flushed": denormals_flushed(),  # bias kernels on Intel CPUs depend on it (`runtime.denormals`)
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "plugformer": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _rate(value: float) -> str:
    return f"{value:,.0f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def ratio_cell(value: dict[str, float] | float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return f"{value['ratio']:.2f} [{value['paired_min']:.2f}–{value['paired_max']:.2f}]"
    return f"{value:.2f}"


def plural(count: int, noun: str) -> str:
    """`1 repeat`, `5 repeats`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return [*lines, *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows), ""]


def ratio_tables(results: dict) -> list[str]:
    lines = [
        "## Ratios (same run, interleaved A/B; throughput ratio > 1 = plugformer faster, memory < 1 = smaller)",
        "",
        "Each cell: ratio of the medians [range of the per-repeat ratios of interleaved pairs].",
        "",
    ]
    if results["train"]:
        lines += ["### Training step, plugformer / transformers reference", ""]
        lines += markdown_table(
            ["pair", "size", "dtype", "seq", "kernel (plugformer / reference)", "tokens/s", "peak memory"],
            [
                [
                    r["pair"],
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    f"{r['models']['plugformer']['kernel']} / {r['models']['reference']['kernel']}",
                    ratio_cell(r["ratio_tokens_per_s"]),
                    ratio_cell(r["ratio_peak_memory"]),
                ]
                for r in results["train"]
            ],
        )
    if results["decode"]:
        lines += ["### Generation with KV cache, plugformer / transformers reference", ""]
        lines += markdown_table(
            [
                "pair",
                "size",
                "dtype",
                "prompt",
                "new",
                "kernel (plugformer / reference)",
                "prefill tokens/s",
                "decode tokens/s",
                "same tokens",
            ],
            [
                [
                    r["pair"],
                    r["size"],
                    r["dtype"],
                    r["prompt_len"],
                    r["new_tokens"],
                    f"{r['models']['plugformer']['kernel']} / {r['models']['reference']['kernel']}",
                    ratio_cell(r["ratio_prefill"]),
                    ratio_cell(r["ratio_decode"]),
                    "yes" if r["same_tokens"] else "no",
                ]
                for r in results["decode"]
            ],
        )
    if results.get("loss"):
        lines += ["### Fused loss: training step, plugformer (`fused_loss`) / LlamaForCausalLM (full logits)", ""]
        lines += markdown_table(
            ["size", "dtype", "seq", "vocab", "tokens/s", "peak memory"],
            [
                [
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    r["vocab_size"],
                    ratio_cell(r["ratio_tokens_per_s"]),
                    ratio_cell(r["ratio_peak_memory"]),
                ]
                for r in results["loss"]
            ],
        )
    if results["variants"]:
        lines += [
            "### Variants, training step relative to scaled_dot + none on sdpa (same size, dtype, length)",
            "",
            "scaled_dot + none against its own twin is an A/A run: its spread is the noise floor.",
            "",
        ]
        lines += markdown_table(
            [
                "size",
                "dtype",
                "seq",
                "attention_score",
                "position_scheme",
                "attention modifier",
                "kernel",
                "tokens/s",
                "peak memory",
                "note",
            ],
            [
                [
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    r["attention_score"],
                    r["position_scheme"],
                    r["attention_modifier"] or "-",
                    r["kernel"],
                    ratio_cell(r["ratio_tokens_per_s"]),
                    ratio_cell(r["ratio_peak_memory"]),
                    r["note"],
                ]
                for r in results["variants"]
            ],
        )
    return lines


def absolute_tables(results: dict) -> list[str]:
    lines = ["## Absolute numbers (medians)", ""]
    lines += ["### Measured matmul peak", ""]
    lines += markdown_table(
        ["dtype", "n", "GFLOP/s"],
        [[dtype, peak["size"], f"{peak['flops_per_s'] / 1e9:,.1f}"] for dtype, peak in results["matmul_peak"].items()],
    )
    if results["train"]:
        lines += ["### Training step", ""]
        lines += markdown_table(
            ["pair", "size", "dtype", "seq", "model", "kernel", "tokens/s", "peak MiB", "MFU"],
            [
                [
                    r["pair"],
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    m["class"],
                    m["kernel"],
                    _rate(m["tokens_per_s"]),
                    _mib(m["peak_memory_bytes"]),
                    f"{m['mfu']:.1%}",
                ]
                for r in results["train"]
                for m in r["models"].values()
            ],
        )
    if results.get("loss"):
        lines += ["### Fused loss (training step)", ""]
        lines += markdown_table(
            ["size", "dtype", "seq", "vocab", "model", "tokens/s", "peak MiB", "MFU"],
            [
                [
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    r["vocab_size"],
                    m["class"],
                    _rate(m["tokens_per_s"]),
                    _mib(m["peak_memory_bytes"]),
                    f"{m['mfu']:.1%}",
                ]
                for r in results["loss"]
                for m in r["models"].values()
            ],
        )
    if results["decode"]:
        lines += ["### Generation", ""]
        lines += markdown_table(
            ["pair", "size", "dtype", "prompt", "new", "model", "kernel", "prefill tokens/s", "decode tokens/s"],
            [
                [
                    r["pair"],
                    r["size"],
                    r["dtype"],
                    r["prompt_len"],
                    r["new_tokens"],
                    m["class"],
                    m["kernel"],
                    _rate(m["prefill_tokens_per_s"]),
                    _rate(m["decode_tokens_per_s"]),
                ]
                for r in results["decode"]
                for m in r["models"].values()
            ],
        )
    if results["variants"]:
        lines += ["### Variants (training step)", ""]
        lines += markdown_table(
            [
                "size",
                "dtype",
                "seq",
                "attention_score",
                "position_scheme",
                "attention modifier",
                "kernel",
                "capabilities",
                "tokens/s",
                "peak MiB",
                "MFU",
                "baseline tokens/s",
                "baseline MiB",
            ],
            [
                [
                    r["size"],
                    r["dtype"],
                    r["seq_len"],
                    r["attention_score"],
                    r["position_scheme"],
                    r["attention_modifier"] or "-",
                    r["kernel"],
                    " ".join(r["supported_kernels"]),
                    _rate(r["variant"]["tokens_per_s"]),
                    _mib(r["variant"]["peak_memory_bytes"]),
                    f"{r['variant']['mfu']:.1%}",
                    _rate(r["baseline"]["tokens_per_s"]),
                    _mib(r["baseline"]["peak_memory_bytes"]),
                ]
                for r in results["variants"]
            ],
        )
    return lines


METHOD = """## Method

- A/B: both models run once per repeat, in alternating order (A, B, B, A, ...), for the warm-up and the timed
  repeats; medians are reported.
  Pairs: a randomly initialised transformers model (no download) is saved and converted by `plugformer.integrations.convert`;
  max |logit difference| ≤ 1e-4 (fp32) is asserted before any timing.
- Training step: forward + backward (loss over all positions, labels = inputs) + AdamW step, gradients freed;
  tokens/s = batch · seq / step time. bf16/fp16 run under `torch.autocast` (fp32 weights and optimiser).
- Peak memory: one extra, untimed step after the timed ones: bytes the model holds before it (parameters, buffers,
  AdamW moments, batch) + the highest increase of allocated bytes during it. CUDA: from
  `torch.cuda.max_memory_allocated()`; CPU: the peak running total of `torch.profiler`'s allocation events, i.e.
  tensor memory of torch's allocator, not RSS (allocator caching, fragmentation and memory libraries allocate
  outside torch are not seen).
- Fused loss (section `loss`): the same training step with the plugformer model's `fused_loss` set (the loss from
  the hidden states in chunks, no (batch, seq, vocab) logits) against `LlamaForCausalLM` with identical weights,
  per vocabulary size (`--loss_vocab_sizes`, replacing the size's `vocab_size`).
- Kernel: `config._attn_implementation` after loading, and the SDPA backend the profiler saw run during that
  step (`sdpa:flash`, `sdpa:math`, ...). A float score bias that requires grad sends CPU SDPA to its math path.
- Generation: greedy `generate`, `min_new_tokens = max_new_tokens`, DynamicCache; prefill = start of the call to the
  first token's scores (includes generate's setup); decode = first to last token's scores, (new - 1) · batch
  tokens. Timestamps come from a logits processor.
- MFU = (batch · seq · (6·N + 12·L·H·d_head·seq)) / median step time / measured matmul peak; N = weight-matrix
  parameters (LM head counted, embedding lookups, biases and norms not); the peak is `torch.mm` on n × n operands
  in the same dtype, timed in this run. The attention term counts every query-key pair (PaLM's convention); a
  causal kernel computes about half of them, so at long sequences the MFU overstates and can pass 100%.
"""


def markdown(results: dict) -> str:
    info = results["machine"]
    description = [
        "## Machine",
        "",
        f"- CPU: {info['cpu']} ({info['logical_cores']} logical cores, {info['usable_cores']} usable, "
        f"{info['torch_threads']} torch threads, {info['cpu_capability']}"
        f"{', subnormals flushed to zero' if info.get('subnormals_flushed') else ''})",
        *([f"- GPU: {info['gpu']}"] if info["gpu"] else []),
        f"- torch {info['torch']}, transformers {info['transformers']}, plugformer {info['plugformer']}, "
        f"Python {info['python']}, {info['platform']}",
        f"- {info['date']}; process peak RSS {results['process_peak_rss_bytes'] / 2**20:,.0f} MiB",
        "",
    ]
    arguments = results["arguments"]
    header = [
        "# plugformer bench",
        "",
        f"sizes {arguments['sizes']}, seq {arguments['seq_lens']}, batch {arguments['batch_size']}, "
        f"{plural(arguments['repeats'], 'repeat')} after {arguments['warmup']} warm-up, dtypes {arguments['dtypes']}, "
        f"device {arguments['device']}. Absolute times drift on a shared machine; the ratios, measured interleaved "
        "within this run, are the numbers to compare.",
        "",
    ]
    return "\n".join([*header, *ratio_tables(results), *absolute_tables(results), *description, METHOD])


def write(results: dict, output_dir: str | Path) -> Path:
    """Writes `bench.md` and `bench.json` into `output_dir`; returns the markdown's path."""
    results["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / "bench.json", results, indent=2)
    path = output / "bench.md"
    path.write_text(markdown(results))
    return path
