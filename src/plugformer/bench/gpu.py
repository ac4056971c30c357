"""The prepared GPU check: one command that runs every correctness and speed check a CUDA machine should pass.

    python -m plugformer.bench.gpu --output_dir outputs/gpu_check            # CUDA, ≤ 8 minutes on one H100
    python -m plugformer.bench.gpu --device cpu --tiny --output_dir /tmp/gc  # its CPU dry run (the default test tier)

Sections, in the order they run, each a list of checks (cases) that pass, fail, are refused (the kernel's record
refuses the variant: not tried), are unavailable (the kernel or its backward does not run here) or are skipped (past
`--max_minutes`):

- `mfu`: the training throughput of the `gpt2-small` preset (124M) in bf16 with the fused loss, on the kernel
  transformers resolves (sdpa), and its model FLOPs utilisation (`model_flops_per_token`) against the device's peak
  (`PEAK_BF16_FLOPS`); nanoGPT and torchtitan report 35–46 % (`REFERENCE_MFU`). Informative: it passes when it ran.
- `training`: one bf16 (autocast) training step with AdamW of each stage-critical variant (`TRAINING_VARIANTS`) on each
  kernel that computes it: the loss within bf16's bound of the float32 loss, finite gradients, every parameter moved.
- `fused_loss`: `losses.linear_cross_entropy` in several chunks against the cross-entropy of the full logits (loss
  and both gradients, in each of `--dtypes` and under bf16 autocast), and a training step with `model.fused_loss`
  against the unfused one.
- `kernels`: every registered kernel × score × position scheme (`capabilities.KERNELS`, `ATTENTION_SCORES`,
  `POSITION_SCHEMES`): one training forward and backward on the device in each of `--dtypes` against eager in
  float64 on the CPU (the logits and every parameter's gradient). Whether a kernel computes a variant is its record's
  answer (`capabilities.unsupported_reason`, `KernelSpec.available`: flash-attn only where installed); a backward the
  device lacks (torch's flex attention on the CPU) leaves the forward compared, said in the note.
- `decode`: a prefill and single-token steps through a `DynamicCache` against the full forward, per stage-critical
  variant and kernel, with the median time of a step.

Tolerances follow `tests/tolerances.py` (the package cannot import the tests): SAFETY · u · (steps + √length) ·
magnitude for the coarser dtype's unit roundoff u (`model_bound`). Every check's result, its largest error and bound and
its time go to `gpu_check.json` and `gpu_check.md` in `--output_dir`; the exit status is 1 if any check failed. Past
`--max_minutes` the remaining checks are reported as skipped.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime.files import write_json_atomic
from .arguments import _choice
from .gpu_checks import CHECK_DTYPES, DEFAULT_CHECK_DTYPES, FULL, SECTION_CHECKS, SECTIONS, TINY
from .report import machine


@dataclass
class GpuCheckArguments:
    device: str = field(default="auto", metadata={"help": "auto (cuda when present) | cpu | cuda"})
    tiny: bool = field(default=False, metadata={"help": "tiny sizes everywhere (the CPU dry run)"})
    output_dir: str = field(default="outputs/gpu_check", metadata={"help": "where gpu_check.json/.md go"})
    max_minutes: float = field(default=8.0, metadata={"help": "checks left after this are reported as skipped"})
    dtypes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "dtypes of the kernel, fused-loss and decode checks (fp64 fp32); default: fp64 on cpu, fp32 on cuda"
        },
    )
    sections: list[str] = field(default_factory=lambda: list(SECTIONS), metadata={"help": " ".join(SECTIONS)})
    seed: int = 0

    def __post_init__(self):
        _choice("device", [self.device], ["auto", "cpu", "cuda"])
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': no CUDA device is available")
        self.dtypes = self.dtypes or list(DEFAULT_CHECK_DTYPES[self.device])
        _choice("dtypes", self.dtypes, list(CHECK_DTYPES))
        _choice("sections", self.sections, list(SECTIONS))
        if not self.max_minutes > 0:
            raise ValueError(f"max_minutes={self.max_minutes!r} must be positive")


# --- running and reporting ------------------------------------------------------------------------------------------


def run_check(check: Callable | dict) -> dict:
    """A check's result with its time; an exception is a failure with its last line."""
    if isinstance(check, dict):
        return {"seconds": 0.0} | check
    start = time.perf_counter()
    try:
        result = check()
    except Exception as error:  # a check that raises has failed: record it and go on
        line = traceback.format_exception_only(error)[-1].strip()
        result = {"status": "failed", "note": line[:500]}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result | {"seconds": time.perf_counter() - start}


def run(args: GpuCheckArguments) -> dict:
    """Runs the sections, writes `gpu_check.json` and `gpu_check.md` into `args.output_dir`; returns the report."""
    scale = TINY if args.tiny else FULL
    deadline = time.monotonic() + 60 * args.max_minutes
    # flex attention compiles once per bias kind and dtype: above dynamo's default 8 recompiles it would silently
    # run uncompiled (tests/conftest.py raises the same limits)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1024)
    checks, started = [], time.monotonic()
    with _highest_precision(), _threads(1 if args.tiny and args.device == "cpu" else torch.get_num_threads()):
        for section in [name for name in SECTIONS if name in args.sections]:
            for case, check in SECTION_CHECKS[section](args, scale):
                if isinstance(check, dict) or time.monotonic() <= deadline:  # a refusal costs nothing: always listed
                    result = run_check(check)
                else:
                    result = {"status": "skipped", "note": f"--max_minutes {args.max_minutes} exceeded", "seconds": 0.0}
                checks.append({"section": section, "case": case} | result)
                if result["status"] == "failed":
                    print(f"FAILED {section}: {case}: {result.get('note', '')}", flush=True)
            print(f"{section}: done ({time.monotonic() - started:.0f} s)", flush=True)
    counts = {status: sum(c["status"] == status for c in checks) for status in STATUSES}
    report = {
        "arguments": dataclasses.asdict(args),
        "scale": dataclasses.asdict(scale),
        "counts": counts,
        "seconds": time.monotonic() - started,
        "machine": machine(args.device),
        "checks": checks,
    }
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output / "gpu_check.json", report, indent=2)
    (output / "gpu_check.md").write_text(markdown(report))
    return report


STATUSES = ("passed", "failed", "refused", "unavailable", "skipped")


class _highest_precision:
    """float32 matrix products without TF32 while the checks run (a float32 bound assumes float32 rounding)."""

    def __enter__(self):
        self.previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.previous)


class _threads:
    """`count` torch threads while the checks run: one for the tiny CPU run, whose tensors of a few hundred elements
    gain nothing from more, and whose threads, spinning on a shared machine's busy cores, made it 5× slower."""

    def __init__(self, count: int):
        self.count = count

    def __enter__(self):
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc):
        torch.set_num_threads(self.previous)


def _number(value) -> str:
    return "" if value is None else f"{value:.3g}"


def markdown(report: dict) -> str:
    info, counts = report["machine"], report["counts"]
    lines = [
        "# plugformer GPU check",
        "",
        f"{info['gpu'] or info['cpu']} ({info['device']}); torch {info['torch']}, transformers "
        f"{info['transformers']}, plugformer {info['plugformer']}; {info['date']}; {report['seconds']:.0f} s.",
        "",
        ", ".join(f"{counts[status]} {status}" for status in STATUSES) + ".",
        "",
        "| section | case | status | max error | tolerance | grad max error | grad tolerance | time (s) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for check in report["checks"]:
        note = str(check.get("note", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {check['section']} | {check['case']} | {check['status']} | {_number(check.get('max_error'))} | "
            f"{_number(check.get('tolerance'))} | {_number(check.get('grad_max_error'))} | "
            f"{_number(check.get('grad_tolerance'))} | {check['seconds']:.2f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parses `argv` (`GpuCheckArguments`), runs the check, prints the summary; 1 if any check failed, else 0."""
    from ..runtime.arguments import parse_arguments

    args = parse_arguments(GpuCheckArguments, sys.argv[1:] if argv is None else argv, prog="plugformer.bench.gpu")
    report = run(args)
    print(f"{report['counts']} in {report['seconds']:.0f} s; written: {Path(args.output_dir) / 'gpu_check.md'}")
    return 1 if report["counts"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
