"""The prepared GPU check (`python -m plugformer.bench.gpu`): its CPU dry run in the default tier, so the script
cannot rot, its arithmetic against hand-computed values, and the full run on CUDA (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tolerances import model_tolerance

import plugformer
from plugformer import KERNELS, PlugformerConfig, combination_matrix
from plugformer.bench import gpu, gpu_arithmetic, gpu_checks


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`--device cpu --tiny` once: (exit status, the JSON report, the output folder)."""
    output = tmp_path_factory.mktemp("gpu_check")
    status = gpu.main(["--device", "cpu", "--tiny", "--output_dir", str(output)])
    return status, json.loads((output / "gpu_check.json").read_text()), output


def test_dry_run_passes_and_writes_both_reports(dry_run):
    status, report, output = dry_run
    assert status == 0 and report["counts"]["failed"] == 0, [c for c in report["checks"] if c["status"] == "failed"]
    assert report["counts"]["skipped"] == 0
    table = (output / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| section")]
    assert len(rows) == len(report["checks"])
    assert {c["section"] for c in report["checks"]} == set(gpu_checks.SECTIONS)


def test_dry_run_lists_every_kernel_cell_as_the_capabilities_decide(dry_run):
    """Every score × scheme × kernel cell (from `combination_matrix`, the registries' grid): refused exactly where no
    kernel record computes it, unavailable where the kernel does not run here, otherwise passed against eager."""
    _, report, _ = dry_run
    cells = {c["case"]: c for c in report["checks"] if c["section"] == "kernels"}
    expected = {}
    for score, scheme, kernels in combination_matrix():
        here = plugformer.supported_kernels(
            PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme)
        )
        for kernel in KERNELS.names():
            status = "passed" if kernel in here else "unavailable" if kernel in kernels else "refused"
            expected[f"{score}+{scheme} {kernel} fp64"] = status
    assert {case: cell["status"] for case, cell in cells.items()} == expected
    for cell in cells.values():
        if cell["status"] == "passed":
            assert cell["max_error"] <= cell["tolerance"]
            assert cell.get("grad_max_error", 0.0) <= cell.get("grad_tolerance", 0.0)
        if cell["status"] == "refused":
            assert "attn_implementation=" in cell["note"]  # the record's reason, naming the field


def test_dry_run_trains_decodes_and_fuses_each_stage_critical_variant(dry_run):
    _, report, _ = dry_run
    passed = {(c["section"], c["case"]) for c in report["checks"] if c["status"] == "passed"}
    for score, scheme in gpu_checks.TRAINING_VARIANTS:
        for kernel in ("eager", "sdpa"):  # the kernels with a CPU backward
            assert ("training", f"{score}+{scheme} {kernel} bf16") in passed
            assert ("decode", f"{score}+{scheme} {kernel} fp64") in passed
    assert {case for section, case in passed if section == "fused_loss"} == {
        "linear_cross_entropy fp64",
        "linear_cross_entropy bf16",
        "model.fused_loss fp64",
    }
    (mfu,) = [c for c in report["checks"] if c["section"] == "mfu"]
    assert mfu["status"] == "passed" and mfu["tokens_per_s"] > 0
    assert mfu["mfu"] is None and "unknown peak" in mfu["note"]  # a CPU has no entry in the peak table


def test_mfu_arithmetic_by_hand():
    # 6·N + 12·L·H·d·T = 6·1000 + 12·2·4·8·16 = 6000 + 12288
    assert gpu_arithmetic.model_flops_per_token(1000, 2, 4, 8, 16) == 18288
    # GPT-2 small in nanoGPT's `estimate_mfu`: 12 layers, 12 heads of 64, T = 1024
    assert (
        gpu_arithmetic.model_flops_per_token(124_000_000, 12, 12, 64, 1024)
        == 6 * 124_000_000 + 12 * 12 * 12 * 64 * 1024
    )
    assert gpu_arithmetic.mfu(18288, 1000.0, 1e9) == pytest.approx(0.018288)
    assert gpu_arithmetic.mfu(18288, 1000.0, None) is None
    # 300k tokens/s of GPT-2 small on an H100 SXM: 300e3 · (744,000,000 + 113,246,208) / 989e12 ≈ 26.00 %
    per_token = gpu_arithmetic.model_flops_per_token(124_000_000, 12, 12, 64, 1024)
    assert per_token == 857_246_208
    assert gpu_arithmetic.mfu(
        per_token, 300e3, gpu_arithmetic.peak_bf16_flops("NVIDIA H100 80GB HBM3")
    ) == pytest.approx(0.2600342, rel=1e-6)


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                       ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12),
                                       ("Tesla T4", None), (None, None)])  # fmt: skip
def test_peak_table(name, peak):
    assert gpu_arithmetic.peak_bf16_flops(name) == peak


def test_bound_is_the_tests_model_tolerance():
    config = PlugformerConfig.from_preset("tiny")
    logits = torch.randn(2, 12, config.vocab_size) * 3
    magnitude = max(logits.abs().max().item(), 1.0)
    assert gpu_arithmetic.model_bound(config, 12, magnitude, torch.float32) == pytest.approx(
        model_tolerance(config, logits)
    )
    # float64 models still round in float32 (eager's softmax, the unfused loss): float32's bound
    bound = gpu_arithmetic.model_bound(config, 12, magnitude, torch.float32)
    assert gpu_arithmetic.model_bound(config, 12, magnitude, torch.float64) == bound


def test_budget_skips_the_remaining_checks(tmp_path):
    status = gpu.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--sections",
            "fused_loss",
            "--max_minutes",
            "1e-9",
            "--output_dir",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0 and report["checks"]
    assert {c["status"] for c in report["checks"]} == {"skipped"}
    assert "skipped" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize(
    "argv,match",
    [(["--dtypes", "bf16"], "dtypes"), (["--sections", "speed"], "sections"), (["--max_minutes", "0"], "max_minutes")],
)
def test_refuses_bad_options(argv, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        gpu.main(["--device", "cpu", "--output_dir", str(tmp_path), *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_refuses_cuda_without_a_device(tmp_path):
    with pytest.raises(ValueError, match="device='cuda'"):
        gpu.main(["--device", "cuda", "--output_dir", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_full_check_on_cuda(tmp_path):
    status = gpu.main(["--device", "cuda", "--output_dir", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0, [c for c in report["checks"] if c["status"] == "failed"]
    if report["counts"]["skipped"]:  # past --max_minutes: not a failure of the code, but the check is incomplete
        warnings.warn(f"gpu check: {report['counts']['skipped']} checks skipped past --max_minutes", stacklevel=1)
    (mfu,) = [c for c in report["checks"] if c["section"] == "mfu"]
    assert mfu["status"] in ("passed", "skipped")
