"""The benchmarks page's performance block, generated from `bench.json` files: ratios of the run(s), with their
commands. The project's page is `model_cards/BENCHMARKS.md` (`bench.markers.PAGE`).

    python -m plugformer.bench.readme outputs/bench/bench.json --readme model_cards/BENCHMARKS.md
    python -m plugformer.bench.readme pairs/bench.json variants/bench.json --print

`update_readme` (`bench.markers`) rewrites only the text between the lines `<!-- bench:begin -->` and `<!-- bench:end -->`;
`plugformer bench --readme model_cards/BENCHMARKS.md` does the same right after a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

from ..runtime.markers import write_blocks
from .arguments import DEFAULT_DTYPES, QUICK, BenchArguments
from .markers import BEGIN, BLOCK, END, PAGE, check_markers, update_readme  # noqa: F401 (check_markers, update_readme: this module's names for them)
from .report import markdown_table, plural, ratio_cell


NOT_IN_COMMAND = ("output_dir", "readme")  # where the files go, not what is measured


def command_line(arguments: dict) -> str:
    """The `plugformer bench` command that measures what `arguments` (a bench.json's) records: the options that differ
    from the defaults (from `--quick`'s values when it was given). `--device` is always shown, as the recorded device
    is the one `auto` resolved to."""
    defaults = {
        f.name: f.default_factory() if callable(f.default_factory) else f.default
        for f in dataclasses.fields(BenchArguments)
    }
    if arguments.get("quick"):
        defaults |= QUICK
    defaults["dtypes"] = DEFAULT_DTYPES.get(arguments.get("device"), defaults["dtypes"])
    words = ["plugformer", "bench"]
    for name, default in defaults.items():
        if name in NOT_IN_COMMAND or name not in arguments:
            continue
        value = arguments[name]
        if name == "quick":
            words += ["--quick"] if value else []
        elif value == [] and name == "attention_modifiers":  # an empty list has no command-line form but `none`
            words += [f"--{name}", "none"]
        elif name == "device" or value != default:
            words += [f"--{name}", *(str(item) for item in (value if isinstance(value, list) else [value]))]
    return shlex.join(words)


def machine_line(results: dict) -> str:
    info, arguments = results["machine"], results["arguments"]
    device = f"GPU {info['gpu']}, " if info.get("gpu") else ""
    decode = f", {arguments['new_tokens']} new tokens" if results.get("decode") else ""
    threads = plural(info["torch_threads"], "torch thread")
    threads += ", subnormals flushed to zero" if info.get("subnormals_flushed") else ""
    return (
        f"{device}{info['cpu']} ({info['usable_cores']} usable cores, {threads}), "
        f"torch {info['torch']}, transformers {info['transformers']}, plugformer {info['plugformer']}, "
        f"{info['date'][:10]}; batch {arguments['batch_size']}, {plural(arguments['repeats'], 'repeat')} after "
        f"{arguments['warmup']} warm-up{decode}."
    )


def _kernels(row: dict) -> str:
    return f"{row['models']['plugformer']['kernel']} / {row['models']['reference']['kernel']}"


def pair_label(pair: str, row: dict) -> str:
    """`llama vs LlamaForCausalLM`; the A/A pair names its model against its own copy."""
    reference = row["models"]["reference"]["class"]
    return f"A/A: {reference} vs its copy" if pair == "aa" else f"{pair} vs {reference}"


def pairs_table(results: dict) -> list[str]:
    """One row per (pair, size, dtype, length): the train row and the decode row of the same prompt length."""
    rows: dict[tuple, dict] = {}
    for section, length in (("train", "seq_len"), ("decode", "prompt_len")):
        for row in results.get(section, []):
            rows.setdefault((row["pair"], row["size"], row["dtype"], row[length]), {})[section] = row
    if not rows:
        return []
    lines = [
        "plugformer / transformers reference, ratio of medians [range of the interleaved per-repeat ratios]; "
        "throughput > 1: plugformer faster, memory < 1: plugformer smaller."
        + (
            " The A/A row times a transformers model against its own copy: its spread is this run's noise floor."
            if any(pair == "aa" for pair, *_ in rows)
            else ""
        ),
        "",
    ]
    cells = []
    for (pair, size, dtype, length), row in rows.items():
        train, decode = row.get("train"), row.get("decode")
        either = train or decode
        cells.append(
            [
                pair_label(pair, either),
                size,
                dtype,
                length,
                ratio_cell(train["ratio_tokens_per_s"]) if train else "-",
                ratio_cell(train["ratio_peak_memory"]) if train else "-",
                ratio_cell(decode["ratio_prefill"]["ratio"]) if decode else "-",
                ratio_cell(decode["ratio_decode"]) if decode else "-",
                _kernels(either),
                f"{train['models']['plugformer']['mfu']:.1%}" if train else "-",
            ]
        )
    headers = [
        "pair",
        "size",
        "dtype",
        "seq",
        "train tokens/s",
        "train peak memory",
        "prefill tokens/s",
        "decode tokens/s",
        "kernel (plugformer / reference)",
        "plugformer MFU",
    ]
    return [*lines, *markdown_table(headers, cells)]


def _joined(values) -> str:
    return " / ".join(dict.fromkeys(str(value) for value in values if value)) or "-"


def variants_tables(results: dict) -> list[str]:
    """One table per (size, dtype): a row per score x scheme (and per attention modifier, in a column of its own when a
    row has one), tokens/s and peak memory ratios per length."""
    groups: dict[tuple, dict] = {}
    for row in results.get("variants", []):
        group = groups.setdefault((row["size"], row["dtype"]), {})
        key = (row["attention_score"], row["position_scheme"], row.get("attention_modifier", ""))  # "": older runs
        group.setdefault(key, {})[row["seq_len"]] = row
    lines = []
    for (size, dtype), variants in groups.items():
        lengths = list(dict.fromkeys(length for by_length in variants.values() for length in by_length))
        modified = any(modifier for _, _, modifier in variants)
        lines += [
            f"Variants, {size}, {dtype}: training step against scaled_dot + none on sdpa, same length "
            "(tokens/s ratio [range]; scaled_dot + none against its twin is an A/A run: the noise floor).",
            "",
        ]
        headers = ["attention_score", "position_scheme", *(["attention modifier"] if modified else [])]
        for length in lengths:
            headers += [f"tokens/s, seq {length}", f"peak memory, seq {length}"]
        cells = []
        for (score, scheme, modifier), by_length in variants.items():
            cell = [score, scheme, *([modifier or "-"] if modified else [])]
            for length in lengths:
                row = by_length.get(length)
                cell += (
                    [ratio_cell(row["ratio_tokens_per_s"]), ratio_cell(row["ratio_peak_memory"])] if row else ["-", "-"]
                )
            rows = by_length.values()
            cells.append([*cell, _joined(row["kernel"] for row in rows), _joined(row["note"] for row in rows)])
        lines += markdown_table([*headers, "kernel", "note"], cells)
    return lines


def loss_table(results: dict) -> list[str]:
    """The fused-loss rows: plugformer with `fused_loss` against Llama's full logits, per vocabulary size."""
    rows = results.get("loss", [])
    if not rows:
        return []
    lines = [
        "Fused loss: a training step of plugformer with `fused_loss` (the loss from the hidden states in chunks) "
        "/ `LlamaForCausalLM` with the same weights (full logits), ratio of medians [range].",
        "",
    ]
    cells = [
        [
            row["size"],
            row["dtype"],
            row["seq_len"],
            row["vocab_size"],
            ratio_cell(row["ratio_tokens_per_s"]),
            ratio_cell(row["ratio_peak_memory"]),
            f"{row['models']['plugformer']['peak_memory_bytes'] / 2**20:,.0f} / "
            f"{row['models']['reference']['peak_memory_bytes'] / 2**20:,.0f}",
        ]
        for row in rows
    ]
    headers = ["size", "dtype", "seq", "vocab", "train tokens/s", "train peak memory", "peak MiB (plugformer / Llama)"]
    return [*lines, *markdown_table(headers, cells)]


def dtype_lines(results: dict) -> list[str]:
    """Low-precision autocast over fp32 (plugformer's training tokens/s, same pair, size and length), and the
    measured matmul peaks."""
    speed = {
        (r["pair"], r["size"], r["seq_len"], r["dtype"]): r["models"]["plugformer"]["tokens_per_s"]
        for r in results.get("train", [])
    }
    lower = [dtype for dtype in ("bf16", "fp16") if dtype in results["arguments"]["dtypes"]]
    keys = list(dict.fromkeys(key[:3] for key in speed if (*key[:3], "fp32") in speed))
    lines = []
    if lower and keys:
        lines += [
            "Autocast over fp32, plugformer training tokens/s (ratio of medians of separate, not interleaved, loops):",
            "",
        ]
        lines += markdown_table(
            ["pair", "size", "seq", *(f"{dtype} / fp32" for dtype in lower)],
            [
                [
                    pair,
                    size,
                    length,
                    *(
                        ratio_cell(speed[pair, size, length, dtype] / speed[pair, size, length, "fp32"])
                        if (pair, size, length, dtype) in speed
                        else "-"
                        for dtype in lower
                    ),
                ]
                for pair, size, length in keys
            ],
        )
    peaks = results.get("matmul_peak", {})
    if peaks:
        sizes = _joined(peak["size"] for peak in peaks.values())
        values = ", ".join(f"{dtype} {peak['flops_per_s'] / 1e9:,.1f} GFLOP/s" for dtype, peak in peaks.items())
        over = "".join(
            f"; {dtype} / fp32 {ratio_cell(peaks[dtype]['flops_per_s'] / peaks['fp32']['flops_per_s'])}"
            for dtype in peaks
            if dtype != "fp32" and "fp32" in peaks
        )
        lines += [f"Measured matmul peak (`torch.mm`, n = {sizes}; the MFU denominator): {values}{over}.", ""]
    return lines


def readme_section(results_list: list[dict]) -> str:
    """Markdown for the benchmarks page from one or more `bench.json` results: per run, its command and machine, then
    the A/B pairs table, the autocast speed-ups and matmul peaks, then the variants tables, as far as the run has them."""
    lines = ["<!-- generated from bench.json by `python -m plugformer.bench.readme`; edit outside the markers -->", ""]
    for results in results_list:
        lines += [f"`{command_line(results['arguments'])}`", "", machine_line(results), ""]
        lines += [*pairs_table(results), *loss_table(results), *dtype_lines(results), *variants_tables(results)]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m plugformer.bench.readme",
        allow_abbrev=False,
        description=f"The performance block of {PAGE} from bench.json files written by `plugformer bench`.",
    )
    parser.add_argument("bench_json", nargs="+", help="bench.json files, one block per run, in this order")
    parser.add_argument(
        "--readme", default=None, help=f"file whose {BEGIN} ... {END} block is replaced (the project's: {PAGE})"
    )
    parser.add_argument("--print", action="store_true", help="print the block (also the default without --readme)")
    parser.add_argument(
        "--block",
        default=BLOCK,
        help=f"the name of the block to replace (default {BLOCK!r}: {BEGIN} ... {END}); "
        "another name keeps a second run's block beside the first",
    )
    args = parser.parse_args(argv)
    section = readme_section([json.loads(Path(path).read_text(encoding="utf-8")) for path in args.bench_json])
    if args.readme is not None:
        write_blocks(args.readme, {args.block: section})
    if args.print or args.readme is None:
        print(section, end="")
    return section


if __name__ == "__main__":
    main()
