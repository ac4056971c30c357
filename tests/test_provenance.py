"""The experiment tools identify runs and references by content and refuse what they cannot support —
`plugformer seeds` over duplicated or mismatched runs, compare's statistics options, repeated flags and cache key,
a DPO stage's reference, rlhf's reward source, pipeline reuse of replaced weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plugformer.experiments import seeds


def write_run(
    folder: Path,
    exact_match: float,
    seed: int | None = None,
    examples: int = 200,
    data_sha256: str = "a" * 64,
    digest: int | None = None,
) -> str:
    """A finished pipeline folder as `plugformer seeds` reads it: results.json, pipeline_run.json, run_info.json."""
    folder.mkdir(parents=True)
    results = {
        "sft": {
            "train_seconds": 5.0,
            "exact_match": exact_match - 0.1,
            "examples": examples,
            "data_sha256": data_sha256,
            "gain": None,
        },
        "grpo": {
            "train_seconds": 6.0,
            "exact_match": exact_match,
            "examples": examples,
            "data_sha256": data_sha256,
            "gain": {"difference": 0.1, "p_value": 0.01},
        },
    }
    (folder / "results.json").write_text(json.dumps(results))
    if seed is not None:
        (folder / "pipeline_run.json").write_text(
            json.dumps({"seed": seed, "wall_seconds": 10.0, "machine": {"matmul_gflops": 100.0}})
        )
    if digest is not None:
        (folder / "sft").mkdir()
        (folder / "sft" / "run_info.json").write_text(json.dumps({"parameter_digests": [digest]}))
    return str(folder)


def refused(capsys, directories: list[str], match: str) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        seeds.main(directories)
    assert capsys.readouterr().out == ""  # refused before any number is printed
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_seeds_refuses_one_run_given_several_times(tmp_path, capsys, monkeypatch):
    run0 = write_run(tmp_path / "run0", 0.5, seed=0)
    message = refused(capsys, [run0, run0, run0], "same run")
    assert message.startswith(f"plugformer seeds: {run0} and {run0} are the same run")  # names both sides
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["run0", str(tmp_path / "run0")], r"same run \(both are ")  # one folder by two paths


def test_seeds_refuses_a_copied_run_and_one_trained_twice(tmp_path, capsys):
    run0 = write_run(tmp_path / "run0", 0.5, seed=0)
    shutil.copytree(run0, tmp_path / "copy")
    refused(capsys, [run0, str(tmp_path / "copy")], "identical results.json")
    # different results.json (timings), the same weights in every stage: one run
    a = write_run(tmp_path / "a", 0.5, digest=123)
    b = write_run(tmp_path / "b", 0.6, digest=123)
    refused(capsys, [a, b], "same parameter digests")
    # the same --seed recorded twice
    c = write_run(tmp_path / "c", 0.5, seed=1)
    d = write_run(tmp_path / "d", 0.6, seed=1)
    refused(capsys, [c, d], "both ran with --seed 1")


def test_seeds_refuses_fewer_than_two_runs(tmp_path, capsys):
    refused(capsys, [write_run(tmp_path / "run0", 0.5, seed=0)], "at least two distinct runs")


def test_seeds_refuses_runs_scored_on_different_test_sets(tmp_path, capsys):
    a = write_run(tmp_path / "a", 0.5, seed=0, examples=200)
    b = write_run(tmp_path / "b", 0.6, seed=1, examples=100)
    message = refused(capsys, [a, b], "different test sets")
    assert f"{a} 200 examples" in message and f"{b} 100 examples" in message
    c = write_run(tmp_path / "c", 0.6, seed=2, data_sha256="b" * 64)  # the same size, other problems
    refused(capsys, [a, c], r"sha256 aaaaaaaaaaaa\).*sha256 bbbbbbbbbbbb")


def test_seeds_accepts_distinct_runs_on_one_test_set(tmp_path):
    directories = [write_run(tmp_path / f"run{i}", 0.5 + i / 10, seed=i, digest=i) for i in range(3)]
    assert seeds.main(directories).startswith("3 runs (run0, run1, run2)")


@pytest.mark.parametrize(("flags", "match"), [
    (["--alpha", "2"], r"--alpha 2\.0: expected a significance level strictly between 0 and 1"),
    (["--alpha", "-1"], r"--alpha -1\.0"),
    (["--alpha", "0"], r"--alpha 0\.0"),
    (["--bootstrap_samples", "1"], r"--bootstrap_samples 1: expected an integer of at least 1000"),
    (["--bootstrap_samples", "999"], r"--bootstrap_samples 999"),
])  # fmt: skip
def test_compare_refuses_significance_options_it_cannot_support_before_any_work(flags, match, tmp_path):
    from plugformer.experiments.compare import main

    with pytest.raises(ValueError, match=match):
        main([*flags, "--output_dir", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_paired_bootstrap_refuses_fewer_resamples_than_its_documented_minimum():
    from plugformer.evaluation.stats import MIN_BOOTSTRAP_SAMPLES, paired_bootstrap

    assert MIN_BOOTSTRAP_SAMPLES == 1000
    with pytest.raises(ValueError, match="at least 1000 bootstrap resamples"):
        paired_bootstrap([1.0, 0.0], [0.0, 0.0], samples=1)
    assert paired_bootstrap([1.0, 0.0], [0.0, 0.0], samples=1000).p_value >= 1 / 1001


def test_repeated_list_flags_accumulate_and_other_repeated_flags_are_refused():
    from plugformer.experiments.compare import CompareArguments
    from plugformer.experiments.extrapolation import ExtrapolationArguments
    from plugformer.experiments.grid import parse_grid, variants
    from plugformer.runtime.arguments import parse_arguments

    args = parse_arguments(
        CompareArguments,
        [
            "--grid",
            "attention_score=dot,additive",
            "--grid",
            "position_scheme=rope",
            "--set",
            "max_steps=3",
            "--set=hidden_size=32",
        ],
        prog="plugformer compare",
    )
    assert args.grid == ["attention_score=dot,additive", "position_scheme=rope"]  # the attention axis is kept
    assert len(variants(parse_grid(args.grid))) == 2 and args.set == ["max_steps=3", "hidden_size=32"]
    extrapolate = parse_arguments(
        ExtrapolationArguments,
        ["--set", "a=1", "--position_schemes", "rope", "--set", "b=2"],
        prog="plugformer extrapolate",
    )
    assert extrapolate.set == ["a=1", "b=2"] and extrapolate.position_schemes == ["rope"]
    with pytest.raises(ValueError, match=r"--max_new_tokens given twice \(--max_new_tokens 1, then --max_new_tokens"):
        parse_arguments(CompareArguments, ["--max_new_tokens", "1", "--max_new_tokens=32"], prog="plugformer compare")


def test_stage_commands_take_no_abbreviated_flags_and_accumulate_repeated_lists():
    from plugformer.training import parse_stage_arguments

    assert parse_stage_arguments("sft", ["--output_dir", "unused", "--max_steps", "3"])[2].max_steps == 3
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--max_step', '1'\]"):
        parse_stage_arguments("sft", ["--output_dir", "unused", "--max_step", "1"])  # was read as --max_steps
    _, model_args, _ = parse_stage_arguments(
        "sft",
        [
            "--output_dir",
            "unused",
            "--use_peft",
            "true",
            "--model_name_or_path",
            "unused-model",
            "--lora_target_modules",
            "q_proj",
            "--lora_target_modules",
            "v_proj",
        ],
    )
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]  # not the last one alone
    script_args, _, _ = parse_stage_arguments(
        "pretrain",
        [
            "--output_dir",
            "unused",
            "--dataset_name",
            "json",
            "--data_files",
            "a.jsonl",
            "--data_files=b.jsonl",
            "c.jsonl",
        ],
    )
    assert script_args.data_files == ["a.jsonl", "b.jsonl", "c.jsonl"]
    # a single-value option given twice: refused (`--max_steps 1 ... --max_steps 9` trained 9 silently)
    with pytest.raises(ValueError, match=r"--max_steps given twice \(--max_steps 1, then --max_steps 9\)"):
        parse_stage_arguments("sft", ["--output_dir", "unused", "--max_steps", "1", "--max_steps", "9"])
    with pytest.raises(ValueError, match=r"--config given twice"):
        parse_stage_arguments("sft", ["--config", "configs/sft/tiny.yaml", "--config", "configs/sft/tiny.yaml"])


def test_a_repeated_flag_on_a_stage_command_is_refused_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from plugformer.cli import main
    from plugformer.training.stages import pretrain as pretrain_module

    def refuse_work(*_, **__):
        raise AssertionError("work started")

    monkeypatch.setattr(pretrain_module, "build_tokenizer", refuse_work)
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "train",
                "pretrain",
                "--output_dir",
                str(tmp_path / "run"),
                "--learning_rate",
                "1e-3",
                "--learning_rate",
                "2e-3",
            ]
        )
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "--learning_rate given twice (--learning_rate 1e-3, then --learning_rate 2e-3); give it once" in error
    assert not (tmp_path / "run").exists()


def test_a_key_of_the_stage_yaml_given_on_the_command_line_is_no_repeat(tmp_path):
    from plugformer.training import parse_stage_arguments

    (tmp_path / "sft.yaml").write_text("learning_rate: 1.0e-3\nmax_steps: 5\n")
    _, _, training = parse_stage_arguments(
        "sft", ["--config", str(tmp_path / "sft.yaml"), "--output_dir", "unused", "--learning_rate", "2e-3"]
    )
    assert training.learning_rate == 2e-3 and training.max_steps == 5  # the command line wins over the YAML


def test_override_flags_gives_each_flag_once_the_later_part_winning():
    from plugformer.runtime.arguments import override_flags

    base = ["--output_dir", "o", "--max_steps", "3", "--data_files", "a", "b", "--bf16", "--seed", "1"]
    assert override_flags(base, ["--max-steps=9", "--data_files", "c"], ["--seed", "2", "--learning_rate", "-1"]) == [
        "--output_dir",
        "o",
        "--max-steps=9",
        "--data_files",
        "c",
        "--bf16",
        "--seed",
        "2",
        "--learning_rate",
        "-1",
    ]
    assert override_flags(base) == base and override_flags([], base) == base
    assert override_flags(["--seed", "1"], ["--seed", "2"], ["--seed=3"]) == ["--seed=3"]  # a third part wins too
    # a repeat within one part is kept: it is the user's, for the stage command to refuse
    assert override_flags(["--seed", "1", "--seed", "2"], ["--max_steps", "3"]).count("--seed") == 2


def test_compare_composes_each_stage_flag_once(tmp_path, monkeypatch):
    """compare's runs: its own flags, then the grid's and --set's (a stage-named key winning for its stage); the
    stage commands refuse a repeat, so the composed command line gives each flag once."""
    from plugformer.experiments import compare
    from plugformer.training import parse_stage_arguments

    settings = {
        "learning_rate": "1e-3",
        "pretrain.learning_rate": "2e-3",
        "exact_match_examples": "4",
        "max_steps": "2",
    }
    options = compare.route(settings, ["pretrain", "sft"])
    assert options["pretrain"].count("--learning_rate") == 1 and "2e-3" in options["pretrain"]
    assert options["sft"][options["sft"].index("--learning_rate") + 1] == "1e-3"
    seen = {}
    monkeypatch.setattr("plugformer.training.run_stage", lambda stage, argv: seen.setdefault(stage, argv))
    args = compare.CompareArguments(output_dir=str(tmp_path), stages=["pretrain", "sft"], seeds=[0])
    compare.train_run(args, tmp_path / "runs" / "variant", options, seed=0)
    for stage, argv in seen.items():
        flags = [token for token in argv if token.startswith("--")]
        assert len(flags) == len(set(flags)), (stage, argv)
        parse_stage_arguments(stage, argv)  # what the stage command reads: no repeat
        assert argv[argv.index("--exact_match_examples") + 1] == "4"  # the --set replaced compare's own 0
    assert seen["pretrain"][seen["pretrain"].index("--learning_rate") + 1] == "2e-3"


def test_compare_refuses_a_set_key_given_twice_and_a_grid_key_replaces_a_set_one(tmp_path):
    from plugformer.experiments import compare

    args = compare.CompareArguments(
        output_dir=str(tmp_path), grid=["position_scheme=rope"], set=["max_steps=2", "max_steps=3"]
    )
    with pytest.raises(ValueError, match=r"--set max_steps given twice \(--set max_steps=2, then --set max_steps=3\)"):
        compare.run_plan(args, {"position_scheme": "rope"})
    args = compare.CompareArguments(output_dir=str(tmp_path), grid=["max_steps=3,4"], set=["max_steps=2"])
    _, options = compare.run_plan(args, {"max_steps": "3"})  # a budget in --set, one of its keys varied
    assert options["pretrain"] == ["--max_steps", "3"]


@pytest.mark.parametrize(
    "entry",
    ["block_size=32", "pretrain.max_position_embeddings=32", "position_scheme=alibi", "document_positions=true"],
)
def test_extrapolate_refuses_a_set_of_what_it_fixes_per_run(entry):
    from plugformer.experiments.extrapolation import ExtrapolationArguments

    # `--set block_size=32` replaced --train_length 64 in runs the table labels "trained at 64 tokens"
    with pytest.raises(
        ValueError, match=rf"--set {entry}: extrapolate sets \w+ itself for every run \((from --|false)"
    ):
        ExtrapolationArguments(set=[entry])


@pytest.mark.parametrize(
    "command",
    [
        ["seeds", "a", "b", "--outp", "x.md"],
        ["convert", "a", "b", "--overwr"],
        ["plot", "sinusoidal", "--di", "8"],
    ],
)
def test_argparse_commands_refuse_abbreviations(command, capsys):
    from plugformer.cli import main

    with pytest.raises(SystemExit) as caught:
        main(command)
    assert caught.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_compare_score_cache_is_keyed_on_every_option_that_changes_the_scores(tmp_path, monkeypatch):
    from plugformer.experiments import compare

    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"weights one")
    scored = []

    def fake_score(args, folder, split, size):
        scored.append((args.max_new_tokens, args.metric))
        return [1.0] * size, [1.0] * size

    monkeypatch.setattr(compare, "_score", fake_score)
    base = {"metric": "exact_match", "dev_examples": 3, "test_examples": 4, "stages": ["pretrain", "sft"]}
    compare.example_scores(compare.CompareArguments(**base, max_new_tokens=1), model_dir, "test")
    compare.example_scores(compare.CompareArguments(**base, max_new_tokens=1), model_dir, "test")
    assert len(scored) == 1  # the same options: reused
    # a stale cache gave 1.000 at --max_new_tokens 32 for answers scored at 1 token
    compare.example_scores(compare.CompareArguments(**base, max_new_tokens=32), model_dir, "test")
    assert scored[-1] == (32, "exact_match") and len(scored) == 2
    # how scores are compared does not change them: reused
    compare.example_scores(
        compare.CompareArguments(**base, max_new_tokens=32, alpha=0.01, seeds=[4, 5]), model_dir, "test"
    )
    assert len(scored) == 2
    for changed in ({"dataset_seed": 1}, {"dev_examples": 5}):  # the data scored
        compare.example_scores(compare.CompareArguments(**{**base, **changed}, max_new_tokens=32), model_dir, "test")
    assert len(scored) == 4
    (model_dir / "model.safetensors").write_bytes(b"weights two")  # the model replaced in its folder
    compare.example_scores(compare.CompareArguments(**base, max_new_tokens=32), model_dir, "test")
    assert len(scored) == 5


def test_compare_refuses_to_score_a_reward_classifier_as_a_language_model():
    from plugformer.experiments.compare import CompareArguments

    with pytest.raises(ValueError, match=r"'reward' trains a text-classification model"):
        CompareArguments(stages=["pretrain", "sft", "reward"])
    assert CompareArguments(stages=["pretrain", "sft", "reward", "rlhf"]).stages[-1] == "rlhf"


def test_extrapolation_cache_key_covers_the_options_and_the_weights_scored(tmp_path):
    from plugformer.experiments.extrapolation import ExtrapolationArguments, evaluation_key

    (tmp_path / "model.safetensors").write_bytes(b"weights one")
    key = evaluation_key(ExtrapolationArguments(), tmp_path)
    assert evaluation_key(ExtrapolationArguments(seeds=[3], output_dir="elsewhere"), tmp_path) == key
    for changed in ({"eval_windows": 4}, {"test_examples": 10}, {"dataset_seed": 2}, {"factors": [1.0, 2.0]}):
        assert evaluation_key(ExtrapolationArguments(**changed), tmp_path) != key, changed
    (tmp_path / "model.safetensors").write_bytes(b"weights two")  # the model replaced in its folder
    assert evaluation_key(ExtrapolationArguments(), tmp_path) != key


# --- what a number ran on -------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
ENVIRONMENT_KEYS = {"cpu", "cpu_capability", "aten_cpu_capability", "torch", "blas", "transformers", "trl",
                    "accelerate", "peft", "datasets", "python", "platform", "world_size", "torch_threads",
                    "omp_num_threads"}  # fmt: skip


def test_the_environment_record_holds_what_torch_and_the_platform_report(monkeypatch):
    import platform

    import accelerate
    import datasets
    import torch
    import transformers
    import trl

    from plugformer.runtime.environment import environment_record, environment_text

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    record = environment_record(world_size=2)
    assert set(record) == ENVIRONMENT_KEYS
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["aten_cpu_capability"] == "avx2"  # the variable that lowers it, as set
    assert record["torch"] == torch.__version__ and record["torch_threads"] == torch.get_num_threads()
    assert record["omp_num_threads"] == "3" and record["world_size"] == 2
    assert (record["transformers"], record["trl"], record["accelerate"], record["datasets"]) == (
        transformers.__version__,
        trl.__version__,
        accelerate.__version__,
        datasets.__version__,
    )
    assert record["python"] == platform.python_version() and record["platform"] == platform.platform()
    assert record["cpu"] and record["blas"].split()[0] in torch.__config__.show()  # BLAS_INFO=mkl: "mkl 2024.2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert environment_record(world_size=1)["omp_num_threads"] is None
    text = environment_text(record)
    assert text.startswith(f"{record['cpu']} ({record['cpu_capability']}), torch {torch.__version__}")


@pytest.fixture(scope="module")
def finished_stage(tmp_path_factory) -> Path:
    """A pipeline folder whose 2-step pretraining stage of a 32-wide model finished (read, never written to)."""
    from conftest import micro_stage_configs

    from plugformer.experiments import pipeline

    folder = tmp_path_factory.mktemp("environment")
    pipeline.main(
        [
            "--config",
            str(ROOT / "configs/pipeline/tiny.yaml"),
            "--stage_configs",
            micro_stage_configs(folder),
            "--stages",
            "pretrain",
            "--test_examples",
            "0",
            "--jobs",
            "1",
            "--output_dir",
            str(folder / "out"),
        ]
    )
    return folder / "out"


def test_a_stage_its_card_and_the_pipeline_record_what_they_ran_on(finished_stage):
    import torch

    info = json.loads((finished_stage / "pretrain/run_info.json").read_text())
    assert set(info["environment"]) == ENVIRONMENT_KEYS and info["environment"]["world_size"] == info["world_size"]
    assert info["environment"]["torch"] == torch.__version__
    assert info["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    run = json.loads((finished_stage / "pipeline_run.json").read_text())
    assert set(run["environment"]) == ENVIRONMENT_KEYS
    card = (finished_stage / "pretrain/README.md").read_text()
    assert f"s of training on {info['environment']['cpu']} ({info['environment']['cpu_capability']}), torch " in card


def test_eval_results_record_what_they_ran_on(finished_stage, tmp_path):
    import torch

    from plugformer.evaluation.scoring import main as eval_main

    output = tmp_path / "eval.json"
    eval_main(
        [
            "--model",
            str(finished_stage / "pretrain"),
            "--examples",
            "2",
            "--max_new_tokens",
            "2",
            "--output",
            str(output),
        ]
    )
    environment = json.loads(output.read_text())["key"]["environment"]
    assert set(environment) == ENVIRONMENT_KEYS and environment["world_size"] == 1
    assert environment["torch_threads"] == torch.get_num_threads()


def test_compare_and_extrapolate_results_record_what_they_ran_on(tmp_path):
    from plugformer.experiments.compare import CompareArguments, write_results

    write_results(CompareArguments(output_dir=str(tmp_path)), {"variants": {}}, "table", lambda summary, path: None)
    written = json.loads((tmp_path / "results.json").read_text())
    assert set(written["environment"]) == ENVIRONMENT_KEYS and written["variants"] == {}


def test_seeds_names_the_machines_and_says_when_runs_differ(tmp_path):
    from plugformer.runtime.environment import environment_record, environment_text

    environment = environment_record(world_size=1)
    runs = [write_run(tmp_path / f"run{i}", 0.5 + i / 10, seed=i, digest=i) for i in range(3)]
    for run in runs:
        record = json.loads(Path(run, "pipeline_run.json").read_text())
        Path(run, "pipeline_run.json").write_text(json.dumps({**record, "environment": environment}))
    assert seeds.main(runs).endswith(f"every run on {environment_text(environment)}")
    assert environment_text(environment).startswith(f"{environment['cpu']} ({environment['cpu_capability']}), torch")
    other = {**environment, "cpu_capability": "AVX512"}
    record = json.loads(Path(runs[2], "pipeline_run.json").read_text())
    Path(runs[2], "pipeline_run.json").write_text(json.dumps({**record, "environment": other}))
    assert "runs on different or unrecorded machines (the spread mixes seeds" in seeds.main(runs)


# --- GRPO's loss is set, not left to TRL's default -------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted((ROOT / "configs/grpo").glob("*.yaml")), ids=lambda path: path.name)
def test_every_grpo_config_sets_trl_default_loss_explicitly_and_its_card_names_it(config):
    """TRL 1.16's GRPO default `loss_type` is "dapo" (token-level normalisation) with beta 0; the configs set both, so
    the results are those of the default and a TRL release that changes it changes no shipped run."""
    import dataclasses

    import trl
    import yaml

    from plugformer.training import parse_stage_arguments
    from plugformer.training.cards import loss_text

    values = yaml.safe_load(config.read_text())
    assert values["loss_type"] == "dapo" and values["beta"] == 0.0
    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert (defaults["loss_type"], defaults["beta"]) == ("dapo", 0.0)  # the values the shipped results were run with
    training_args = parse_stage_arguments("grpo", ["--config", str(config), "--output_dir", "unused"])[2]
    assert loss_text(training_args) == ", `dapo` loss, beta 0"
