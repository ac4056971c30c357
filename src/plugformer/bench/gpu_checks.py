"""The sections of the prepared GPU check (`plugformer.bench.gpu`): for each, a generator of named checks at a
`Scale` (`TINY`, the CPU dry run; `FULL`, a GPU), each a callable returning its case's record (or a refusal record)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..capabilities import KERNELS, supported_kernels, unsupported_reason
from ..configuration import PRESETS, PlugformerConfig
from ..losses import linear_cross_entropy
from ..modeling import PlugformerForCausalLM
from ..positions import POSITION_SCHEMES
from ..scores import ATTENTION_SCORES
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
from .report import matmul_parameters, throughput


if TYPE_CHECKING:
    from .gpu import GpuCheckArguments

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
