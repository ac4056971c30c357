"""`plugformer bench`: correctness of what it compares and computes (no timing assertions: timings are noise here)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from plugformer import ATTENTION_SCORES, POSITION_SCHEMES, PlugformerConfig, PlugformerForCausalLM
from plugformer.bench import BenchArguments
from plugformer.bench.measure import (
    GenerateRun,
    interleave,
    matmul_flops,
    peak_allocation,
    profile_call,
    run_interleaved,
)
from plugformer.bench.models import (
    PARITY_TOLERANCE,
    build_pair,
    check_parity,
    gqa_key_value_heads,
    logit_difference,
)
from plugformer.bench.readme import (
    check_markers,
    command_line,
    pair_label,
    readme_section,
    update_readme,
    variants_tables,
)
from plugformer.bench.readme import main as readme_main
from plugformer.bench.report import compare, matmul_parameters, ratio_cell, throughput, train_flops, utilisation
from plugformer.bench.runner import BASELINE, requested_variants
from plugformer.cli import main as cli_main
from plugformer.kernels_additive_native import native_additive
from plugformer.runtime.arguments import parse_arguments
from plugformer.runtime.variants import ATTENTION_MODIFIERS, modifier_fields, modifier_label


@pytest.mark.parametrize("pair", ["llama", "gpt2"])
def test_pairs_have_identical_logits_before_timing(pair, tokens):
    config = BenchArguments(sizes=["tiny"], seq_lens=[24], new_tokens=4, device="cpu").model_config("tiny")
    twin, reference, difference = build_pair(pair, config, seed=0, device="cpu", parity_length=24)
    assert difference <= PARITY_TOLERANCE
    assert logit_difference(twin, reference, tokens) <= PARITY_TOLERANCE  # another batch than the built-in check
    assert twin.config._attn_implementation == reference.config._attn_implementation == "sdpa"
    assert matmul_parameters(twin) == matmul_parameters(reference)  # same FLOPs on both sides of the ratio
    if pair == "llama":
        assert (twin.config.num_key_value_heads, reference.config.num_key_value_heads) == (2, 2)  # GQA: 4 over 2
        assert twin.config.position_scheme == "rope"
    else:
        assert type(reference).__name__ == "GPT2LMHeadModel" and twin.config.position_scheme == "learned"


def test_the_aa_pair_times_llama_against_its_own_copy(tokens):
    config = BenchArguments(sizes=["tiny"], seq_lens=[12], device="cpu").model_config("tiny")
    copy, reference, difference = build_pair("aa", config, seed=0, device="cpu", parity_length=12)
    assert type(copy) is type(reference) and type(reference).__name__ == "LlamaForCausalLM" and copy is not reference
    assert difference == 0.0
    for (name, mine), (_, theirs) in zip(copy.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr(), name  # equal, not shared
    row = {"models": {"reference": {"class": "LlamaForCausalLM"}}}
    assert pair_label("aa", row) == "A/A: LlamaForCausalLM vs its copy"
    assert pair_label("llama", row) == "llama vs LlamaForCausalLM"


def test_parity_check_refuses_models_that_differ(tokens):
    config = BenchArguments(sizes=["tiny"], seq_lens=[12], device="cpu").model_config("tiny")
    twin, reference, _ = build_pair("llama", config, seed=0, device="cpu", parity_length=12)
    with torch.no_grad():
        twin.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
    with pytest.raises(RuntimeError, match=r"logits differ by .* before timing"):
        check_parity(twin, reference, tokens, "llama")


def test_grouped_query_heads_for_sizes_without_them():
    assert gqa_key_value_heads(PlugformerConfig.from_preset("small")) == 3  # 6 heads -> groups of 2
    assert gqa_key_value_heads(PlugformerConfig.from_preset("tiny")) == 2  # already grouped: kept
    assert gqa_key_value_heads(PlugformerConfig(hidden_size=64, num_attention_heads=8)) == 4
    assert gqa_key_value_heads(PlugformerConfig(hidden_size=64, num_attention_heads=1)) == 1


def test_interleaving_runs_both_models_every_repeat_in_alternating_order():
    assert interleave(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    calls = []

    def subject(name):
        def call():
            calls.append(name)
            return {"seconds": float(len(calls))}

        return call

    samples = run_interleaved({"A": subject("A"), "B": subject("B")}, repeats=3, warmup=2)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A", "A", "B"]  # 2 warm-up repeats, then 3 timed
    assert samples == {
        "A": [{"seconds": 5.0}, {"seconds": 8.0}, {"seconds": 9.0}],
        "B": [{"seconds": 6.0}, {"seconds": 7.0}, {"seconds": 10.0}],
    }


def test_ratio_and_mfu_arithmetic_on_fake_timings():
    # A takes 2, 1, 4 s for 1000 tokens (median 2 s: 500 tokens/s), B 1 s each (1000 tokens/s)
    assert throughput(1000, [2.0, 1.0, 4.0]) == 500.0
    assert compare(1000, [2.0, 1.0, 4.0], [1.0, 1.0, 1.0]) == {"ratio": 0.5, "paired_min": 0.25, "paired_max": 1.0}
    # 2 x 16 tokens, N = 1000, 2 layers of 4 heads of 8: 32 · (6·1000 + 12·2·4·8·16) = 32 · 18288
    assert train_flops(1000, 2, 4, 8, batch_size=2, seq_len=16) == 585_216
    result = utilisation(585_216, [1.0, 2.0, 3.0], peak_flops_per_s=1e6)
    assert result["achieved_flops_per_s"] == pytest.approx(292_608.0)
    assert result["mfu"] == pytest.approx(0.292608)
    assert matmul_flops(1000) == 2_000_000_000


def test_generate_runs_exactly_new_tokens_even_when_eos_comes_first(tokens):
    torch.manual_seed(0)
    model = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny")).eval()
    prompts = tokens[:1, :6]
    first = model.generate(prompts, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1].item()
    model.generation_config.eos_token_id = first
    assert model.generate(prompts, max_new_tokens=5, do_sample=False, pad_token_id=0).shape == (1, 6 + 1)  # stops
    run = GenerateRun(model, prompts, new_tokens=5, dtype="fp32", device="cpu")
    timings = run()
    assert run.sequences.shape == (1, 6 + 5)
    assert timings["prefill_seconds"] > 0 and timings["decode_seconds"] > 0  # 4 cached steps after the prefill


def test_matmul_parameters_count_weight_matrices_and_the_head():
    # tiny: per layer q 32·32 + k 32·16 + v 32·16 + o 32·32 + gate, up 32·64 each + down 64·32 = 9216; head 128·32
    model = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny"))
    assert matmul_parameters(model) == 2 * 9216 + 128 * 32


def test_cpu_peak_memory_is_the_high_water_mark_of_live_tensors():
    assert peak_allocation([(3, -5), (1, 10), (2, 7)]) == 17  # sorted by time: 10, 17, 12

    def allocations():
        first = torch.empty(2**20, dtype=torch.uint8)
        second = torch.empty(2**21, dtype=torch.uint8)  # 3 MiB live here
        del first
        third = torch.empty(2**19, dtype=torch.uint8)
        del second, third

    assert profile_call(allocations, "cpu", live_bytes=100).peak_bytes == 100 + 3 * 2**20


def test_profiler_reports_the_sdpa_backend_that_ran():
    query = torch.randn(1, 2, 16, 8, requires_grad=True)
    bias = torch.randn(1, 2, 16, 16)
    attend = torch.nn.functional.scaled_dot_product_attention
    assert profile_call(lambda: attend(query, query, query, is_causal=True), "cpu").sdpa_backends == ["flash"]
    learned = bias.clone().requires_grad_()  # a float mask that needs grad: CPU SDPA takes its math path
    assert profile_call(lambda: attend(query, query, query, attn_mask=learned), "cpu").sdpa_backends == ["math"]


README_TEXT = "# Project\n\nProse – before.\n\n<!-- bench:begin -->\nold table\n<!-- bench:end -->\n\nProse after.\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    """The one `--quick` run of this module (it also regenerates a README's block), its output directory."""
    directory = tmp_path_factory.mktemp("bench")
    (directory / "README.md").write_text(README_TEXT, encoding="utf-8")
    cli_main(["bench", "--quick", "--output_dir", str(directory), "--readme", str(directory / "README.md")])
    return directory


# the schemes whose training step at the quick run's length (64, from slot 0, no padding) takes a kernel of their own:
# ALiBi's key-side bias per block (kernels_alibi), FIRE's bias recomputed per block (kernels_query_bias), and the
# biases constant beyond a distance the tiny preset puts below 64 (kernels_banded: clamped at 8, T5 buckets at 16),
# and KERPLE's through the Toeplitz-view kernel (kernels_relative), which takes fp32 only (not bf16)
OWN_BIAS_PATHS = {"alibi": "linear-bias", "fire": "query-bias", "t5_bias": "banded-bias", "clamped_bias": "banded-bias",
                  "kerple_log": "relative-bias", "forgetting": "query-bias"}  # fmt: skip


def expected_sdpa_kernel(score: str, scheme: str, dtype: str) -> str:
    """The profile label of a variant's training step on sdpa at the quick run's length. Differential attention's
    values are twice as wide as its queries, which torch's CPU flash kernel refuses: SDPA runs its math path, and of
    the bias kernels only the per-block one (FIRE's and forgetting attention's, no flash call of its own) takes it."""
    wide_values = score == "differential"
    path = OWN_BIAS_PATHS.get(scheme)
    path = path if not wide_values or path == "query-bias" else None
    if path == "relative-bias" and dtype != "fp32":
        path = None
    if path is None and POSITION_SCHEMES.get(scheme).has_bias:
        path = "blockwise-bias"  # plugformer's blockwise kernel for a score bias, fused SDPA inside
    return "sdpa:" + "+".join(sorted({"math" if wide_values else "flash", path} - {None}))


@pytest.mark.slow  # the quick_run fixture benchmarks every pair (~60 s); -m slow runs it
def test_quick_run_writes_one_row_per_pair_variant_and_dtype(quick_run):
    results = json.loads((quick_run / "bench.json").read_text())
    markdown = (quick_run / "bench.md").read_text()
    dtypes = ["fp32", "bf16"]
    assert results["arguments"]["dtypes"] == dtypes and results["arguments"]["seq_lens"] == [64]
    for section in ("train", "decode"):
        assert [(r["pair"], r["dtype"]) for r in results[section]] == [
            (pair, dtype) for pair in ("llama", "gpt2", "aa") for dtype in dtypes
        ]
    for row in results["train"] + results["decode"]:
        assert row["max_abs_logit_diff"] <= PARITY_TOLERANCE
        assert all(m["kernel"] == "sdpa:flash" for m in row["models"].values())
    assert all(row["same_tokens"] for row in results["decode"] if row["dtype"] == "fp32")
    # every registered score x scheme, then scaled_dot + none with each attention modifier, per dtype
    variants = [(s, p, "") for s in ATTENTION_SCORES.names() for p in POSITION_SCHEMES.names()]
    variants += [
        ("scaled_dot", "none", modifier_label(name, value))
        for name, values in ATTENTION_MODIFIERS.items()
        for value in values
    ]
    rows = [
        (r["dtype"], r["attention_score"], r["position_scheme"], r["attention_modifier"]) for r in results["variants"]
    ]
    assert rows == [(dtype, *variant) for dtype in dtypes for variant in variants]
    for row in results["variants"]:
        if "sdpa" not in row["supported_kernels"]:  # additive (no dot product) or a modifier sdpa refuses (softcapping)
            native = row["attention_score"] == "additive" and row["dtype"] == "fp32" and native_additive() is not None
            kernel = "eager:additive-native" if native else "eager"  # fp32 additive: the C kernel where it is built
        elif row["attention_modifier"]:
            kernel = row["kernel"] if row["kernel"].startswith("sdpa:") else "sdpa:..."  # the backend varies
        else:
            kernel = expected_sdpa_kernel(row["attention_score"], row["position_scheme"], row["dtype"])
        assert row["kernel"] == kernel
        assert row["baseline"]["kernel"] == "sdpa:flash"
        cells = [row["attention_score"], row["position_scheme"], row["attention_modifier"] or "-", kernel]
        assert f"| tiny | {row['dtype']} | 64 | {' | '.join(cells)} |" in markdown
    assert markdown.index("## Ratios") < markdown.index("## Absolute numbers") < markdown.index("## Machine")
    assert set(results["matmul_peak"]) == set(dtypes) and "torch_threads" in results["machine"]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--sections", "train", "bogus"], "sections"),
        (["--seq_lens", "1"], "seq_lens"),
        (["--dtypes", "int8"], "dtypes"),
        (["--sizes", "huge"], "sizes"),
        (["--sizes", "tiny,hidden_size=x"], "sizes"),
        (["--sizes", "tiny,rope_theta=5"], "sizes"),
        (["--sizes", "hidden_size=30,num_attention_heads=4"], "sizes"),
        (["--sizes", "tiny,head_dim=16"], "sizes"),  # the gpt2 pair needs head_dim · heads = hidden_size
        (["--pairs", "bert"], "pairs"),
        (["--attention_scores", "no_such_score"], "attention_scores"),
        (["--position_schemes", "xpos"], "position_schemes"),
        (["--attention_modifiers", "use_qk_norms"], "attention_modifiers"),
        (["--batch_size", "0"], "batch_size"),
        (["--repeats", "0"], "repeats"),
        (["--warmup", "-1"], "warmup"),
        (["--new_tokens", "1"], "new_tokens"),
        (["--matmul_size", "8"], "matmul_size"),
        (["--loss_vocab_sizes", "2"], "loss_vocab_sizes"),
        (["--device", "tpu"], "device"),
        (["--readme", "no/such/README.md"], "readme"),
        (["--bogus", "1"], "--bogus"),
    ],
)
def test_invalid_options_raise_a_value_error_naming_the_option(argv, option):
    with pytest.raises(ValueError, match=option):
        parse_arguments(BenchArguments, argv, prog="plugformer bench")


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast is refused on CPU only")
def test_fp16_is_refused_on_cpu():
    with pytest.raises(ValueError, match="dtypes: 'fp16'"):
        BenchArguments(dtypes=["fp16"])


def test_quick_keeps_the_options_the_user_changed():
    args = BenchArguments(quick=True, seq_lens=[32], device="cpu")
    assert args.seq_lens == [32] and args.sizes == ["tiny"] and args.repeats == 3
    assert BenchArguments(device="cpu").model_config("small,num_hidden_layers=2").num_hidden_layers == 2


@pytest.mark.slow  # the quick_run fixture benchmarks every pair (~60 s); -m slow runs it
def test_readme_section_quotes_the_ratios_of_the_quick_run(quick_run):
    results = json.loads((quick_run / "bench.json").read_text())
    section = readme_section([results])
    assert "`plugformer bench --device cpu --quick`" in section
    assert results["machine"]["cpu"] in section
    assert f"torch {results['machine']['torch']}, transformers {results['machine']['transformers']}" in section
    decode = {(r["pair"], r["dtype"]): r for r in results["decode"]}
    for row in results["train"]:
        mine, other = row["models"]["plugformer"], decode[row["pair"], row["dtype"]]
        assert (
            f"| {pair_label(row['pair'], row)} | tiny | {row['dtype']} | 64 | "
            f"{ratio_cell(row['ratio_tokens_per_s'])} | {ratio_cell(row['ratio_peak_memory'])} | "
            f"{other['ratio_prefill']['ratio']:.2f} | {ratio_cell(other['ratio_decode'])} | sdpa:flash / sdpa:flash | "
            f"{mine['mfu']:.1%} |"
        ) in section
    for row in results["variants"]:
        cells = [
            row["attention_score"],
            row["position_scheme"],
            row["attention_modifier"] or "-",
            ratio_cell(row["ratio_tokens_per_s"]),
            ratio_cell(row["ratio_peak_memory"]),
            row["kernel"],
            row["note"] or "-",
        ]
        assert "| " + " | ".join(cells) + " |" in section
    for dtype in ("fp32", "bf16"):  # one variants table per dtype, its columns per length
        assert f"Variants, tiny, {dtype}:" in section
    assert (
        "| attention_score | position_scheme | attention modifier | tokens/s, seq 64 | peak memory, seq 64 | kernel | note |"
    ) in section
    speed = {(r["pair"], r["dtype"]): r["models"]["plugformer"]["tokens_per_s"] for r in results["train"]}
    for pair in ("llama", "gpt2"):
        assert f"| {pair} | tiny | 64 | {speed[pair, 'bf16'] / speed[pair, 'fp32']:.2f} |" in section
    assert f"fp32 {results['matmul_peak']['fp32']['flops_per_s'] / 1e9:,.1f} GFLOP/s" in section


@pytest.mark.slow  # the quick_run fixture benchmarks every pair (~60 s); -m slow runs it
def test_readme_section_gives_each_run_its_command(quick_run):
    results = json.loads((quick_run / "bench.json").read_text())
    pairs = results | {"variants": [], "arguments": results["arguments"] | {"sections": ["train", "decode"]}}
    variants = results | {"train": [], "decode": [], "arguments": results["arguments"] | {"sections": ["variants"]}}
    section = readme_section([pairs, variants])
    first = section.index("`plugformer bench --sections train decode --device cpu --quick`")
    second = section.index("`plugformer bench --sections variants --device cpu --quick`")
    assert first < section.index("| pair | size | dtype |") < section.index("bf16 / fp32") < second
    assert second < section.index("Variants, tiny, fp32") and section.count("| attention_score |") == 2
    assert section.count("| pair | size | dtype |") == 1 and "new tokens" not in section[second:]


def test_variant_rows_come_from_the_registries_and_the_modifiers():
    """Every registered score x scheme; the baseline with each attention modifier only when the baseline is asked for."""
    every = requested_variants(BenchArguments(device="cpu"))
    pairs = [
        {"attention_score": s, "position_scheme": p} for s in ATTENTION_SCORES.names() for p in POSITION_SCHEMES.names()
    ]
    modified = [BASELINE | {name: value} for name, values in ATTENTION_MODIFIERS.items() for value in values]
    assert every == pairs + modified
    chosen = BenchArguments(
        attention_scores=["scaled_dot"],
        position_schemes=["none", "alibi"],
        attention_modifiers=["sliding_window", "value_residual"],
        device="cpu",
    )
    assert requested_variants(chosen)[2:] == [
        BASELINE | {"sliding_window": 256},
        BASELINE | {"value_residual": "fixed"},
        BASELINE | {"value_residual": "learned"},
    ]
    assert len(requested_variants(BenchArguments(attention_scores=["additive"], device="cpu"))) == len(
        POSITION_SCHEMES.names()
    )
    unmodified = BenchArguments(
        attention_scores=["scaled_dot"], position_schemes=["none", "alibi"], attention_modifiers=[], device="cpu"
    )
    assert requested_variants(unmodified) == [BASELINE, BASELINE | {"position_scheme": "alibi"}]


def test_variants_table_has_a_modifier_column_only_when_a_row_has_one():
    row = {
        "size": "tiny",
        "dtype": "fp32",
        "seq_len": 64,
        "attention_score": "scaled_dot",
        "position_scheme": "none",
        "ratio_tokens_per_s": 1.0,
        "ratio_peak_memory": 1.0,
        "kernel": "sdpa:flash",
        "note": "",
    }
    older = "\n".join(variants_tables({"variants": [row]}))  # a bench.json written before the modifier rows
    assert (
        "| attention_score | position_scheme | tokens/s, seq 64 |" in older and "| scaled_dot | none | 1.00 |" in older
    )
    modified = row | {"attention_modifier": "use_qk_norm=True", "ratio_tokens_per_s": 0.9}
    lines = "\n".join(variants_tables({"variants": [row | {"attention_modifier": ""}, modified]}))
    assert "| attention_score | position_scheme | attention modifier | tokens/s, seq 64 |" in lines
    assert "| scaled_dot | none | - | 1.00 |" in lines and "| scaled_dot | none | use_qk_norm=True | 0.90 |" in lines


def test_command_line_gives_the_options_that_differ_and_parses_back():
    cases = [
        BenchArguments(sizes=["small"], seq_lens=[512], sections=["train", "decode"], device="cpu"),
        BenchArguments(quick=True, repeats=7, dtypes=["bf16"], device="cpu", output_dir="x", seed=3),
        BenchArguments(sizes=["small,num_hidden_layers=2"], attention_scores=["additive"], device="cpu"),
        BenchArguments(position_schemes=["none", "alibi"], attention_modifiers=[], device="cpu"),
    ]
    assert command_line(dataclasses.asdict(cases[0])) == (
        "plugformer bench --sizes small --seq_lens 512 --sections train decode --device cpu"
    )
    assert command_line(dataclasses.asdict(cases[1])) == (
        "plugformer bench --repeats 7 --dtypes bf16 --device cpu --seed 3 --quick"
    )
    # no modifier rows: a YAML's `attention_modifiers: []`, which the command line writes as `none`
    assert command_line(dataclasses.asdict(cases[3])) == (
        "plugformer bench --position_schemes none alibi --attention_modifiers none --device cpu"
    )
    for arguments in cases:
        words = shlex.split(command_line(dataclasses.asdict(arguments)))
        parsed = parse_arguments(BenchArguments, words[2:], prog="plugformer bench")
        assert dataclasses.replace(parsed, output_dir=arguments.output_dir) == arguments


def test_update_readme_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_bytes(README_TEXT.encode("utf-8"))
    os.chmod(readme, 0o644)
    before, after = README_TEXT.split("old table\n")
    update_readme(readme, "\nnew | table\n\n")
    assert readme.read_bytes() == (before + "new | table\n" + after).encode("utf-8")
    update_readme(readme, "new | table\n")  # the same block again: the same bytes
    assert readme.read_bytes() == (before + "new | table\n" + after).encode("utf-8")
    assert os.stat(readme).st_mode & 0o777 == 0o644 and [p.name for p in tmp_path.iterdir()] == ["README.md"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("# no markers\n", "found 0 and 0"),
        ("<!-- bench:end -->\nx\n<!-- bench:begin -->\n", "comes before"),
        ("<!-- bench:begin -->\n<!-- bench:begin -->\n<!-- bench:end -->\n", "found 2 and 1"),
    ],
)
def test_update_readme_refuses_a_file_without_its_markers(tmp_path, text, message):
    readme = tmp_path / "NOTES.md"
    readme.write_text(text)
    with pytest.raises(ValueError, match=rf"NOTES\.md: .*{message}"):
        update_readme(readme, "table\n")
    assert readme.read_text() == text
    with pytest.raises(ValueError, match=r"readme: .*NOTES\.md"):
        BenchArguments(readme=str(readme), device="cpu")


@pytest.mark.slow  # the quick_run fixture benchmarks every pair (~60 s); -m slow runs it
def test_bench_readme_option_and_module_cli_write_the_same_block(quick_run, tmp_path, capsys):
    results = json.loads((quick_run / "bench.json").read_text())
    section = readme_section([results])
    assert (quick_run / "README.md").read_text() == README_TEXT.replace("old table\n", section)  # by `--readme`
    capsys.readouterr()
    readme_main([str(quick_run / "bench.json"), "--print"])
    assert capsys.readouterr().out == section
    readme = tmp_path / "README.md"
    readme.write_text(README_TEXT)
    readme_main([str(quick_run / "bench.json"), "--readme", str(readme)])
    assert capsys.readouterr().out == "" and readme.read_text() == (quick_run / "README.md").read_text()


def test_the_benchmarks_page_has_its_generated_performance_blocks():
    """The blocks live in `model_cards/BENCHMARKS.md` (`PAGE`), the target the generator documents; the README has none."""
    from plugformer.bench.markers import PAGE
    from plugformer.runtime.markers import check_block, markers

    root = Path(__file__).resolve().parents[1]
    check_markers(root / PAGE)
    check_block(root / PAGE, "bench-variants")
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert not any(marker in readme for name in ("bench", "bench-variants") for marker in markers(name))


def test_the_loss_section_times_the_fused_loss_against_llama_at_each_vocabulary(tmp_path, monkeypatch):
    """One tiny run of `--sections loss`: a row per vocabulary size, the plugformer model trained with its fused loss
    (counted), in bench.md and in the benchmarks page's block."""
    import plugformer.losses

    calls = []
    fused = plugformer.losses.linear_cross_entropy
    monkeypatch.setattr(plugformer.losses, "linear_cross_entropy", lambda *a, **k: calls.append(1) or fused(*a, **k))
    argv = [
        "bench",
        "--sizes",
        "tiny",
        "--seq_lens",
        "16",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--dtypes",
        "fp32",
        "--sections",
        "loss",
        "--loss_vocab_sizes",
        "64",
        "300",
        "--matmul_size",
        "64",
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path),
    ]
    cli_main(argv)
    results = json.loads((tmp_path / "bench.json").read_text())
    assert [row["vocab_size"] for row in results["loss"]] == [64, 300] and calls
    for row in results["loss"]:
        assert row["models"]["reference"]["class"] == "LlamaForCausalLM"
        assert row["max_abs_logit_diff"] <= PARITY_TOLERANCE and row["ratio_peak_memory"] > 0
    assert "### Fused loss" in (tmp_path / "bench.md").read_text()
    section = readme_section([results])
    assert "`plugformer bench --sizes tiny --seq_lens 16" in section and "| tiny | fp32 | 16 | 300 |" in section


def test_modifier_fields_repeat_a_per_layer_pattern_with_the_fields_it_needs():
    """The bench's layer_types row mixes sliding and full layers at any depth, with the window sliding layers need."""
    pattern = ["sliding_attention", "full_attention"]
    assert modifier_fields("layer_types", pattern, 3) == {
        "sliding_window": 256,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    }
    assert modifier_fields("value_residual", "fixed", 3) == {"value_residual": "fixed"}
    config = BenchArguments(device="cpu").model_config("tiny", **modifier_fields("layer_types", pattern, 2))
    assert config.layer_types == pattern and config.sliding_window == 256
    assert modifier_label("layer_types", pattern) == (
        "sliding_window=256, layer_types=['sliding_attention', 'full_attention'] repeated"
    )


MODIFIER_ROWS = [  # the modifiers' variants: per-layer attention types, gated attention, value residuals, latent attention
    "sliding_window=256, layer_types=['sliding_attention', 'full_attention'] repeated",
    "use_gated_attention=True",
    "value_residual='fixed'",
    "value_residual='learned'",
    "attention_projection='latent'",
]


def test_the_variants_section_runs_a_row_per_modifier_value(tmp_path):
    """One tiny run of `--sections variants` on the baseline pair: a row for each attention modifier's each value (the
    `MODIFIER_ROWS` rows among them), each with a ratio against the baseline and its kernel; no timing asserted."""
    argv = [
        "bench",
        "--sizes",
        "tiny",
        "--seq_lens",
        "16",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--dtypes",
        "fp32",
        "--sections",
        "variants",
        "--attention_scores",
        "scaled_dot",
        "--position_schemes",
        "none",
        "--matmul_size",
        "64",
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path),
    ]
    cli_main(argv)
    rows = json.loads((tmp_path / "bench.json").read_text())["variants"]
    labels = [row["attention_modifier"] for row in rows]
    assert labels == [
        "",
        *(modifier_label(name, value) for name, values in ATTENTION_MODIFIERS.items() for value in values),
    ]
    assert set(MODIFIER_ROWS) <= set(labels)
    for row in rows:
        assert row["ratio_tokens_per_s"]["ratio"] > 0 and row["ratio_peak_memory"] > 0
        assert row["kernel"].split(":")[0] in row["supported_kernels"]
    markdown = (tmp_path / "bench.md").read_text()
    assert all(f"| {label} |" in markdown for label in MODIFIER_ROWS)
