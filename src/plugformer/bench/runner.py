"""The sections of `plugformer bench`: A/B pairs (train, decode) and plugformer variant rows."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

from ..capabilities import KERNELS, supported_kernels, unsupported_reason
from ..positions import POSITION_SCHEMES
from ..projections import ATTENTION_PROJECTIONS
from ..runtime.variants import ATTENTION_MODIFIERS, modifier_fields, modifier_label
from .arguments import BenchArguments
from .measure import GenerateRun, Profile, TrainStep, matmul_peak, profile_call, random_tokens, run_interleaved
from .models import build_pair, build_variant
from .report import compare, machine, matmul_parameters, throughput, train_flops, utilisation, write


# Every variant row is a ratio against this variant on sdpa; the attention-modifier rows are this variant plus one field.
BASELINE = {"attention_score": "scaled_dot", "position_scheme": "none"}


def kernel_label(model, profile: Profile) -> str:
    """The kernel that actually ran: the model's resolved implementation, with the SDPA backend seen (`sdpa:math`)."""
    implementation = KERNELS.of(model.config).name
    return f"{implementation}:{'+'.join(profile.sdpa_backends)}" if profile.sdpa_backends else implementation


def train_measurement(model, samples: list[dict], profile: Profile, tokens: int, flops: int, peak: float) -> dict:
    seconds = [sample["seconds"] for sample in samples]
    return {
        "class": type(model).__name__,
        "attn_implementation": KERNELS.of(model.config).name,
        "sdpa_backends": profile.sdpa_backends,
        "kernel": kernel_label(model, profile),
        "seconds": seconds,
        "tokens_per_s": throughput(tokens, seconds),
        "peak_memory_bytes": profile.peak_bytes,
        "flops_per_step": flops,
        **utilisation(flops, seconds, peak),
    }


def measure_training(
    args: BenchArguments, models: dict, config, seq_len: int, dtype: str, peak: float
) -> dict[str, dict]:
    """Interleaved timed training steps of `models` (name -> model, all of `config`'s shape) on one batch, then one
    profiled step each."""
    batch = random_tokens(args.batch_size, seq_len, config.vocab_size, args.seed, args.device)
    steps = {name: TrainStep(model, batch, dtype, args.device) for name, model in models.items()}
    samples = run_interleaved(steps, args.repeats, args.warmup)
    results = {}
    for name, model in models.items():
        profile = profile_call(steps[name].step, args.device, steps[name].live_bytes())
        parameters = matmul_parameters(model)
        flops = train_flops(
            parameters,
            config.num_hidden_layers,
            config.num_attention_heads,
            attention_width(config),
            args.batch_size,
            seq_len,
        )
        results[name] = train_measurement(model, samples[name], profile, batch.numel(), flops, peak)
        results[name]["matmul_parameters"] = parameters
    return results


def attention_width(config) -> float:
    """The head width d_head of the attention FLOPs: the mean of the query/key and value widths, which differ in
    multi-head latent attention (QKᵀ costs d_qk per score, AV d_v); `head_dim` for the standard projection."""
    projection = ATTENTION_PROJECTIONS.get(config.attention_projection)
    return (projection.query_key_dim(config) + projection.value_dim(config)) / 2


def train_row(args: BenchArguments, spec: str, pair: str, models: dict, seq_len: int, dtype: str, peak: float) -> dict:
    # the FLOPs count reads plugformer's config; the A/A pair's models are both Llama, of the size's dimensions
    config = args.model_config(spec) if pair == "aa" else models["plugformer"].config
    measured = measure_training(args, models, config, seq_len, dtype, peak)
    mine, reference = measured["plugformer"], measured["reference"]
    return {
        "pair": pair,
        "size": spec,
        "dtype": dtype,
        "seq_len": seq_len,
        "batch_size": args.batch_size,
        "ratio_tokens_per_s": compare(args.batch_size * seq_len, mine["seconds"], reference["seconds"]),
        "ratio_peak_memory": mine["peak_memory_bytes"] / reference["peak_memory_bytes"],
        "models": measured,
    }


def decode_row(args: BenchArguments, spec: str, pair: str, models: dict, prompt_len: int, dtype: str) -> dict:
    prompts = random_tokens(args.batch_size, prompt_len, models["plugformer"].config.vocab_size, args.seed, args.device)
    runs = {name: GenerateRun(model, prompts, args.new_tokens, dtype, args.device) for name, model in models.items()}
    samples = run_interleaved(runs, args.repeats, args.warmup)
    prefill_tokens, decode_tokens = prompts.numel(), args.batch_size * (args.new_tokens - 1)
    measured = {}
    for name, model in models.items():
        prefill = [sample["prefill_seconds"] for sample in samples[name]]
        decode = [sample["decode_seconds"] for sample in samples[name]]
        measured[name] = {
            "class": type(model).__name__,
            "kernel": kernel_label(model, profile_call(runs[name].generate, args.device)),
            "prefill_seconds": prefill,
            "decode_seconds": decode,
            "prefill_tokens_per_s": throughput(prefill_tokens, prefill),
            "decode_tokens_per_s": throughput(decode_tokens, decode),
        }
    mine, reference = measured["plugformer"], measured["reference"]
    return {
        "pair": pair,
        "size": spec,
        "dtype": dtype,
        "prompt_len": prompt_len,
        "new_tokens": args.new_tokens,
        "batch_size": args.batch_size,
        "same_tokens": bool((runs["plugformer"].sequences == runs["reference"].sequences).all()),
        "ratio_prefill": compare(prefill_tokens, mine["prefill_seconds"], reference["prefill_seconds"]),
        "ratio_decode": compare(decode_tokens, mine["decode_seconds"], reference["decode_seconds"]),
        "models": measured,
    }


def pair_rows(args: BenchArguments, spec: str, pair: str, peaks: dict) -> tuple[list[dict], list[dict], float]:
    """Decode rows first (the weights are still the converted ones, so greedy tokens should agree), then train rows."""
    config = args.model_config(spec)
    twin, reference, difference = build_pair(pair, config, args.seed, args.device, max(args.seq_lens))
    models = {"plugformer": twin, "reference": reference}
    decode, train = [], []
    for dtype in args.dtypes if "decode" in args.sections else []:
        for seq_len in args.seq_lens:
            decode.append(decode_row(args, spec, pair, models, seq_len, dtype) | {"max_abs_logit_diff": difference})
    for dtype in args.dtypes if "train" in args.sections else []:
        for seq_len in args.seq_lens:
            row = train_row(args, spec, pair, models, seq_len, dtype, peaks[dtype]["flops_per_s"])
            train.append(row | {"max_abs_logit_diff": difference})
    return train, decode, difference


def loss_rows(args: BenchArguments, spec: str, peaks: dict) -> list[dict]:
    """Training steps of plugformer with its fused loss (`model.fused_loss`, as `plugformer train` sets it) against
    `LlamaForCausalLM` with identical weights and its full logits, per vocabulary size, dtype and length."""
    rows = []
    for vocab_size in args.loss_vocab_sizes:
        config = args.model_config(spec, vocab_size=vocab_size)
        twin, reference, difference = build_pair("llama", config, args.seed, args.device, max(args.seq_lens))
        twin.fused_loss = True
        models = {"plugformer": twin, "reference": reference}
        for dtype in args.dtypes:
            for seq_len in args.seq_lens:
                row = train_row(args, spec, "llama", models, seq_len, dtype, peaks[dtype]["flops_per_s"])
                rows.append(row | {"vocab_size": vocab_size, "max_abs_logit_diff": difference})
        del twin, reference, models
        gc.collect()
    return rows


def variant_note(model, sdpa_backends: list[str]) -> str:
    """Why the kernel is not plain fused SDPA, from plugformer's capabilities and the model's parameters."""
    config = model.config
    if unsupported_reason(config, "sdpa") is not None:
        return "capabilities: no sdpa" + ("; tanh pair by pair in C" if "additive-native" in sdpa_backends else "")
    scheme = POSITION_SCHEMES.get(config.position_scheme)
    # a bias with parameters: the stack's scheme's, or a `per_layer` scheme's in each attention (forgetting's gates)
    learned = scheme.has_bias and (scheme.per_layer or any(p.requires_grad for p in model.model.positions.parameters()))
    if "math" in sdpa_backends:
        return "learned bias requires grad -> math" if learned else "sdpa fell back to math"
    if "relative-native" in sdpa_backends:
        return "forward and backward in C"
    if "banded-bias" in sdpa_backends:
        if "band-native" in sdpa_backends:  # kernels_band_native: the band's products in C
            return "forward in C; backward: far keys fused, near band in C"
        return "far keys fused without a mask; near band by blocks, its backward by hand"
    if "relative-bias" in sdpa_backends:
        return "fused forward, bias as a view; backward " + ("by hand" if learned else "fused")
    if "linear-bias" in sdpa_backends:
        return "key-side bias per block, no N x N mask"
    if "fire-native" in sdpa_backends:
        return "forward and backward in C, f_θ by pieces per row"
    if "query-bias" in sdpa_backends:
        return "bias per block, recomputed in backward"
    if "blockwise-bias" in sdpa_backends:
        return "blockwise bias, backward by hand" if learned else "blockwise bias, masks rebuilt in backward"
    return ""


def variant_row(
    args: BenchArguments, spec: str, baseline, variant: dict, seq_len: int, dtype: str, peak: float
) -> dict:
    """One variant (`variant`: the config fields attention_score, position_scheme and at most one attention modifier
    with one of its values), interleaved with `baseline` (scaled_dot + none on sdpa)."""
    score, scheme = variant["attention_score"], variant["position_scheme"]
    modifiers = [name for name in variant if name in ATTENTION_MODIFIERS]
    layers = args.model_config(spec).num_hidden_layers
    fields = {"attention_score": score, "position_scheme": scheme}
    for name in modifiers:
        fields |= modifier_fields(name, variant[name], layers)
    config = args.model_config(spec, **fields)
    modifier = ", ".join(modifier_label(name, variant[name]) for name in modifiers)
    model = build_variant(config, args.seed + 1, args.device)
    measured = measure_training(args, {"variant": model, "baseline": baseline}, model.config, seq_len, dtype, peak)
    mine, base = measured["variant"], measured["baseline"]
    return {
        "size": spec,
        "dtype": dtype,
        "seq_len": seq_len,
        "batch_size": args.batch_size,
        "attention_score": score,
        "position_scheme": scheme,
        "attention_modifier": modifier,
        "kernel": mine["kernel"],
        "supported_kernels": supported_kernels(model.config),
        "note": variant_note(model, mine["sdpa_backends"]),
        "ratio_tokens_per_s": compare(args.batch_size * seq_len, mine["seconds"], base["seconds"]),
        "ratio_peak_memory": mine["peak_memory_bytes"] / base["peak_memory_bytes"],
        **measured,
    }


def requested_variants(args: BenchArguments) -> list[dict]:
    """The requested variants: every score x position scheme, then, when the baseline is among them, the baseline with
    each requested attention modifier set to each of its values (`variants.ATTENTION_MODIFIERS`; a per-layer value is
    the pattern `variant_row` repeats over the layers)."""
    found = [
        {"attention_score": score, "position_scheme": scheme}
        for score in args.attention_scores
        for scheme in args.position_schemes
    ]
    if BASELINE in found:
        found += [BASELINE | {name: value} for name in args.attention_modifiers for value in ATTENTION_MODIFIERS[name]]
    return found


def variant_rows(args: BenchArguments, spec: str, peaks: dict) -> list[dict]:
    """Every requested variant against scaled_dot + none on sdpa, per dtype and length."""
    rows = []
    for dtype in args.dtypes:
        for seq_len in args.seq_lens:
            baseline = build_variant(args.model_config(spec, **BASELINE), args.seed, args.device, "sdpa")
            peak = peaks[dtype]["flops_per_s"]
            for variant in requested_variants(args):
                rows.append(variant_row(args, spec, baseline, variant, seq_len, dtype, peak))
            gc.collect()  # a full collection costs ~0.3 s: once per group, for anything a reference cycle kept alive
    return rows


def run(args: BenchArguments) -> dict:
    """Runs the requested sections, writes `bench.md` and `bench.json` into `args.output_dir` (and the generated
    block of `args.readme` when given), returns the results."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # weight-loading bars of every conversion would bury the output
    results = {
        "arguments": dataclasses.asdict(args),
        "matmul_peak": {},
        "train": [],
        "decode": [],
        "variants": [],
        "loss": [],
    }
    for dtype in args.dtypes:
        results["matmul_peak"][dtype] = matmul_peak(dtype, args.device, args.matmul_size, args.repeats, args.warmup)
    for spec in args.sizes:
        for pair in args.pairs if {"train", "decode"} & set(args.sections) else []:
            train, decode, difference = pair_rows(args, spec, pair, results["matmul_peak"])
            print(f"{spec} {pair}: max |logit difference| {difference:.2g}; timed", flush=True)
            results["train"] += train
            results["decode"] += decode
            gc.collect()
        if "loss" in args.sections:
            results["loss"] += loss_rows(args, spec, results["matmul_peak"])
            print(f"{spec}: fused loss timed", flush=True)
        if "variants" in args.sections:
            results["variants"] += variant_rows(args, spec, results["matmul_peak"])
            print(f"{spec}: variants timed", flush=True)
    results["machine"] = machine(args.device)
    path = write(results, args.output_dir)
    print("\n" + path.read_text() + f"\nwritten: {path}, {Path(args.output_dir) / 'bench.json'}")
    if args.readme is not None:
        from .readme import readme_section, update_readme  # here: `python -m plugformer.bench.readme` runs it fresh

        update_readme(args.readme, readme_section([results]))
        print(f"updated the generated block of {args.readme}")
    return results
