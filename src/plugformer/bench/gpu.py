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

import copy
import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..capabilities import KERNELS, supported_kernels, unsupported_reason
from ..configuration import PRESETS, PlugformerConfig
from ..losses import linear_cross_entropy
from ..modeling import PlugformerForCausalLM
from ..positions import POSITION_SCHEMES
from ..runtime.files import write_json_atomic
from ..scores import ATTENTION_SCORES
from .arguments import _choice
from .gpu_arithmetic import (
    REFERENCE_MFU,
    max_error,
    mfu,
    model_bound,
    model_flops_per_token,
    peak_bf16_flops,
    tolerance,
)
from .measure import TrainStep, autocast, random_tokens, run_interleaved
from .report import machine, matmul_parameters, throughput


VOCAB = PRESETS["tiny"]["vocab_size"]  # the cells' vocabulary: every cell is the tiny preset with a score and scheme
# Run in this order, so that a run past `--max_minutes` skips the tail: the grid and decoding, where flex attention
# compiles a kernel per bias kind (and, decoding, per key length), come last.
SECTIONS = ("mfu", "training", "fused_loss", "kernels", "decode")
CHECK_DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
DEFAULT_CHECK_DTYPES = {"cpu": ["fp64"], "cuda": ["fp32"]}
# The variants the stages train and the comparisons run (configs/compare, configs/pipeline): rotary, learned absolute,
# ALiBi's fixed bias and T5's learned bias, each with the default score.
TRAINING_VARIANTS = [("scaled_dot", "rope"), ("scaled_dot", "learned"), ("scaled_dot", "alibi"),
                     ("scaled_dot", "t5_bias")]  # fmt: skip
REFERENCE_KERNEL = "eager"  # what every kernel is compared with, in float64 on the CPU


@dataclass(frozen=True)
class Scale:
    """The sizes one run checks at: `TINY` (the CPU dry run, seconds) or `FULL` (a GPU, minutes)."""

    cell: dict  # changes to the tiny preset of the kernel cells, decode and the bf16 steps
    tokens: int  # sequence length of the kernel cells, training steps and decode (prefill + steps)
    batch: int
    decode_steps: int  # single-token steps after the prefill (flex attention compiles one kernel per key length)
    loss_shape: tuple[int, int, int]  # (rows, hidden, vocab) of the fused-loss function check
    loss_chunks: int  # chunks the fused loss is split into
    mfu_preset: str
    mfu_batch: int
    mfu_tokens: int
    repeats: int
    warmup: int


TINY = Scale(
    cell={},
    tokens=12,
    batch=2,
    decode_steps=1,
    loss_shape=(24, 32, 128),
    loss_chunks=4,
    mfu_preset="tiny",
    mfu_batch=2,
    mfu_tokens=64,
    repeats=3,
    warmup=1,
)
# 200 tokens: two of flex attention's 128-row blocks, the second partial; heads of 32 (flex attention's CUDA kernels
# take no head narrower than 16, the tiny preset's are 8)
FULL_CELL = {"max_position_embeddings": 256, "hidden_size": 128, "intermediate_size": 256}
FULL = Scale(
    cell=FULL_CELL,
    tokens=200,
    batch=2,
    decode_steps=2,
    loss_shape=(2048, 768, 50257),
    loss_chunks=4,
    mfu_preset="gpt2-small",
    mfu_batch=12,
    mfu_tokens=1024,
    repeats=10,
    warmup=3,
)


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


# --- models -------------------------------------------------------------------------------------------------------


def cell_config(scale: Scale, score: str, scheme: str) -> PlugformerConfig:
    return PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **scale.cell)


def build(config: PlugformerConfig, kernel: str | None, seed: int, device: str = "cpu", dtype=torch.float32):
    """A model of `config` on `kernel` (`None`: the one transformers resolves, sdpa where the capabilities allow):
    the same weights for every kernel of one seed."""
    torch.manual_seed(seed)
    config = copy.deepcopy(config)  # models built from one config share it
    if kernel is not None:
        config._attn_implementation = kernel
    return PlugformerForCausalLM(config).to(device=device, dtype=dtype)


def training_outputs(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None, str]:
    """Logits and every parameter's gradient of one training forward and backward (labels = ids); no gradients, and
    why, where the device has no backward for the kernel (torch's flex attention on the CPU)."""
    model.train().zero_grad(set_to_none=True)
    try:
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
    except NotImplementedError as error:  # raised by the forward already, where inputs require grad
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        return logits, None, f"forward only: {error}"
    return output.logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}, ""


def compare_step(config, tokens: int, dtype: torch.dtype, actual: tuple, expected: tuple) -> dict:
    """Logits and gradients `actual` against `expected` within `model_bound` in `dtype` (the gradients' magnitude:
    the largest reference gradient)."""
    logits, grads, note = actual
    reference_logits, reference_grads, _ = expected
    magnitude = max(reference_logits.abs().max().item(), 1.0)
    result = {
        "max_error": max_error(logits, reference_logits),
        "tolerance": model_bound(config, tokens, magnitude, dtype),
        "note": note,
    }
    if grads is not None:
        if grads.keys() != reference_grads.keys():
            missing = sorted(grads.keys() ^ reference_grads.keys())
            return result | {"status": "failed", "note": f"gradients of {missing} on one side only"}
        size = max(grad.abs().max().item() for grad in reference_grads.values())
        result["grad_max_error"] = max(max_error(grads[name], grad) for name, grad in reference_grads.items())
        result["grad_tolerance"] = model_bound(config, tokens, size, dtype)
    passed = result["max_error"] <= result["tolerance"] and result.get("grad_max_error", 0) <= result.get(
        "grad_tolerance", 0
    )
    return result | {"status": "passed" if passed else "failed"}


# --- checks -------------------------------------------------------------------------------------------------------
# Each section yields (case, check): `check` is a callable returning the result's fields, or a ready result (refused,
# unavailable) that is recorded as it is.


def kernel_checks(args: GpuCheckArguments, scale: Scale) -> Iterator[tuple[str, Callable | dict]]:
    """Every kernel × score × scheme × dtype against eager in float64 on the CPU."""
    ids = random_tokens(scale.batch, scale.tokens, VOCAB, args.seed, "cpu")
    for score in ATTENTION_SCORES.names():
        for scheme in POSITION_SCHEMES.names():
            config = cell_config(scale, score, scheme)
            reference = {}  # computed once per variant, at its first kernel that runs

            def expected(config=config, reference=reference):
                if not reference:
                    model = build(config, REFERENCE_KERNEL, args.seed, dtype=torch.float64)
                    reference["step"] = training_outputs(model, ids)
                return reference["step"]

            for kernel in KERNELS.names():
                for name in args.dtypes:
                    case = f"{score}+{scheme} {kernel} {name}"
                    ready = refusal(config, kernel)
                    if ready is not None:
                        yield case, ready
                        continue

                    def check(config=config, kernel=kernel, dtype=CHECK_DTYPES[name], expected=expected):
                        if (kernel, args.device, dtype) == (REFERENCE_KERNEL, "cpu", torch.float64):
                            actual = expected()  # the reference itself
                        else:
                            model = build(config, kernel, args.seed, args.device, dtype)
                            actual = training_outputs(model, ids.to(args.device))
                        return compare_step(config, scale.tokens, dtype, actual, expected())

                    yield case, check


def refusal(config: PlugformerConfig, kernel: str) -> dict | None:
    """The result of a kernel that is not tried: refused by its record, or not available here; `None` otherwise."""
    reason = unsupported_reason(config, kernel)
    if reason is not None:
        return {"status": "refused", "note": reason}
    if not KERNELS.get(kernel).available():
        return {"status": "unavailable", "note": f"{kernel} does not run here (KernelSpec.available)"}
    return None


def variant_kernels(scale: Scale) -> Iterator[tuple[str, PlugformerConfig, str]]:
    """(`score+scheme`, config, kernel) for each stage-critical variant and each kernel that computes it here."""
    for score, scheme in TRAINING_VARIANTS:
        config = cell_config(scale, score, scheme)
        for kernel in supported_kernels(config):
            yield f"{score}+{scheme}", config, kernel


def training_checks(args: GpuCheckArguments, scale: Scale) -> Iterator[tuple[str, Callable]]:
    """One bf16 (autocast) AdamW step per stage-critical variant and kernel."""
    ids = random_tokens(scale.batch, scale.tokens, VOCAB, args.seed, args.device)
    for variant, config, kernel in variant_kernels(scale):

        def check(config=config, kernel=kernel):
            model = build(config, kernel, args.seed, args.device)
            with torch.no_grad():
                fp32_loss = model.train()(input_ids=ids, labels=ids).loss.item()
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            try:
                with autocast(args.device, "bf16"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            except NotImplementedError as error:  # flex attention on the CPU: raised by the forward already
                return {"status": "unavailable", "note": f"no backward on {args.device}: {error}"}
            finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            optimizer.step()
            still = [name for name, p in model.named_parameters() if torch.equal(p.detach(), before[name])]
            bound = model_bound(config, scale.tokens, max(abs(fp32_loss), 1.0), torch.bfloat16)
            error = abs(loss.item() - fp32_loss)
            passed = finite and not still and error <= bound
            note = "" if passed else f"finite gradients: {finite}; parameters not moved: {still[:5]}"
            return {
                "status": "passed" if passed else "failed",
                "max_error": error,
                "tolerance": bound,
                "note": note,
                "loss": loss.item(),
            }

        yield f"{variant} {kernel} bf16", check


def fused_loss_checks(args: GpuCheckArguments, scale: Scale) -> Iterator[tuple[str, Callable]]:
    """`linear_cross_entropy` in chunks against the full logits' cross-entropy; a model step with and without
    `fused_loss` (both in each of `--dtypes`, and the function once more under bf16 autocast)."""
    for name in [*args.dtypes, "bf16"]:
        yield f"linear_cross_entropy {name}", lambda name=name: fused_function_check(args, scale, name)
    for name in args.dtypes:
        yield f"model.fused_loss {name}", lambda name=name: fused_model_check(args, scale, CHECK_DTYPES[name])


def fused_function_check(args: GpuCheckArguments, scale: Scale, name: str) -> dict:
    rows, hidden_size, vocab = scale.loss_shape
    dtype = CHECK_DTYPES.get(name, torch.float32)  # bf16: float32 inputs under autocast, as in training
    generator = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=dtype).to(args.device).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype) / math.sqrt(hidden_size)
    weight = weight.to(args.device).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[::5] = -100  # ignored rows
    labels = labels.to(args.device)
    chunk = vocab * math.ceil(rows / scale.loss_chunks)
    with autocast(args.device, name if name == "bf16" else "fp32"):
        fused = linear_cross_entropy(hidden, weight, labels, chunk_elements=chunk)
        fused_grads = torch.autograd.grad(fused, (hidden, weight))
        logits = (hidden @ weight.T).to(torch.promote_types(dtype, torch.float32))  # (rows, vocab)
        full = torch.nn.functional.cross_entropy(logits, labels)
        full_grads = torch.autograd.grad(full, (hidden, weight))
    bound_dtype = torch.bfloat16 if name == "bf16" else dtype
    bound = tolerance(bound_dtype, max(full.abs().item(), 1.0), max(hidden_size, vocab), 4)
    grad_size = max(grad.abs().max().item() for grad in full_grads)
    grad_bound = tolerance(bound_dtype, grad_size, max(hidden_size, vocab, rows), 4)
    error = max_error(fused, full)
    grad_error = max(max_error(a, b) for a, b in zip(fused_grads, full_grads, strict=True))
    passed = error <= bound and grad_error <= grad_bound
    return {
        "status": "passed" if passed else "failed",
        "max_error": error,
        "tolerance": bound,
        "grad_max_error": grad_error,
        "grad_tolerance": grad_bound,
    }


def fused_model_check(args: GpuCheckArguments, scale: Scale, dtype: torch.dtype) -> dict:
    config = cell_config(scale, *TRAINING_VARIANTS[0])
    ids = random_tokens(scale.batch, scale.tokens, config.vocab_size, args.seed, args.device)
    model = build(config, None, args.seed, args.device, dtype)
    outputs = []
    for fused in (True, False):
        model.fused_loss = fused
        model.train().zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        outputs.append((loss.detach().reshape(1, 1), {n: p.grad.clone() for n, p in model.named_parameters()}, ""))
    note = f"kernel {KERNELS.of(model.config).name}"
    return compare_step(config, scale.tokens, dtype, outputs[0], outputs[1]) | {"note": note}


def decode_checks(args: GpuCheckArguments, scale: Scale) -> Iterator[tuple[str, Callable]]:
    """A prefill of all but `scale.decode_steps` tokens, then single-token steps through a `DynamicCache`, against the
    full forward."""
    from transformers import DynamicCache

    ids = random_tokens(scale.batch, scale.tokens, VOCAB, args.seed, args.device)
    prefill = scale.tokens - scale.decode_steps
    for variant, config, kernel in variant_kernels(scale):
        for name in args.dtypes:

            def check(config=config, kernel=kernel, dtype=CHECK_DTYPES[name]):
                model = build(config, kernel, args.seed, args.device, dtype).eval()
                cache, pieces, seconds = DynamicCache(config=model.config), [], []
                with torch.no_grad():
                    full = model(ids, use_cache=False).logits
                    pieces.append(model(ids[:, :prefill], cache=cache, use_cache=True).logits)
                    for position in range(prefill, scale.tokens):
                        start = time.perf_counter()
                        pieces.append(model(ids[:, position : position + 1], cache=cache, use_cache=True).logits)
                        seconds.append(time.perf_counter() - start)
                error = max_error(torch.cat(pieces, dim=1), full)
                bound = model_bound(config, scale.tokens, max(full.abs().max().item(), 1.0), dtype)
                return {
                    "status": "passed" if error <= bound else "failed",
                    "max_error": error,
                    "tolerance": bound,
                    "note": f"median decode step {sorted(seconds)[len(seconds) // 2] * 1e3:.2f} ms",
                }

            yield f"{variant} {kernel} {name}", check


def mfu_checks(args: GpuCheckArguments, scale: Scale) -> Iterator[tuple[str, Callable]]:
    """bf16 training throughput of `scale.mfu_preset` on its default kernel with the fused loss, and its MFU."""

    def check():

        config = PlugformerConfig.from_preset(scale.mfu_preset)
        model = build(config, None, args.seed, args.device)
        model.fused_loss = True  # as `plugformer train` sets it
        batch = random_tokens(scale.mfu_batch, scale.mfu_tokens, config.vocab_size, args.seed, args.device)
        samples = run_interleaved({"step": TrainStep(model, batch, "bf16", args.device)}, scale.repeats, scale.warmup)
        tokens_per_s = throughput(batch.numel(), [sample["seconds"] for sample in samples["step"]])
        per_token = model_flops_per_token(
            matmul_parameters(model),
            config.num_hidden_layers,
            config.num_attention_heads,
            config.head_dim,
            scale.mfu_tokens,
        )
        name = torch.cuda.get_device_name() if args.device == "cuda" else None
        peak = peak_bf16_flops(name)
        utilisation = mfu(per_token, tokens_per_s, peak)
        shown = "unknown peak: tokens/s only" if utilisation is None else f"MFU {utilisation:.1%} vs {REFERENCE_MFU}"
        return {
            "status": "passed",
            "tokens_per_s": tokens_per_s,
            "flops_per_token": per_token,
            "peak_flops": peak,
            "mfu": utilisation,
            "note": f"{KERNELS.of(model.config).name}: {tokens_per_s:,.0f} tokens/s; {shown}",
        }

    yield f"{scale.mfu_preset} bf16 B={scale.mfu_batch} T={scale.mfu_tokens}, fused loss", check


SECTION_CHECKS = {"training": training_checks, "fused_loss": fused_loss_checks, "decode": decode_checks,
                  "mfu": mfu_checks, "kernels": kernel_checks}  # fmt: skip


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
