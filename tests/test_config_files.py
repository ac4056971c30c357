"""`--config` YAML files: a value of the wrong type is refused naming the file, the key and the type expected (YAML
floats without a dot and command-line strings still convert); duplicate keys, non-UTF-8 text, oversized documents
and alias bombs are refused before anything is built; the shipped configs are found from any directory."""

from __future__ import annotations

import re

import pytest
from conftest import refuse_training


@pytest.mark.parametrize(
    ("entry", "text", "pattern"),
    [
        ("pretrain", 'learning_rate: "abc"', r"learning_rate: 'abc' is a YAML str; expected float"),
        ("pretrain", 'max_steps: "10"', r"max_steps: '10' is a YAML str; expected int"),
        ("pretrain", 'overwrite_output_dir: "yes"', r"overwrite_output_dir: 'yes' is a YAML str; expected bool"),
        ("pretrain", "save_strategy: no", r"save_strategy: False is a YAML bool; expected str .*quote it"),
        ("pretrain", "data_files: a.jsonl", r"data_files: 'a.jsonl' is a YAML str; expected a list of str or null"),
        ("pretrain", "train_examples: 2.5", r"train_examples: 2.5 is a YAML float; expected int"),
        ("grpo", "num_generations: 2.5", r"num_generations: 2.5 is a YAML float; expected int or null"),
        ("grpo", "env: [A]", r"env: \['A'\]: expected a mapping"),
        ("pipeline", "stages: grpo", r"stages: 'grpo' is a YAML str; expected a list of str"),
        ("demo", 'max_steps: "10"', r"max_steps: '10' is a YAML str; expected int"),
    ],
)
def test_a_wrong_typed_yaml_value_is_refused_naming_file_key_and_type(tmp_path, monkeypatch, entry, text, pattern):
    """argparse converted string YAML values ('10' -> 10, 'yes' -> True), dumped its usage for 'abc' without naming
    the file, and left a string for a list field a string (`stages: grpo` ran stages 'g', 'r', ...)."""
    from plugformer.training import common
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    monkeypatch.setattr(common, "load_model", refuse_training)
    monkeypatch.setattr("plugformer.experiments.pipeline.run", refuse_training)
    monkeypatch.setattr("plugformer.experiments.demo.run", refuse_training)
    config = tmp_path / "config.yaml"
    config.write_text(text + "\n")
    argv = {
        "pretrain": ["train", "pretrain", "--output_dir", str(tmp_path / "run")],
        "grpo": ["train", "grpo", "--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(tmp_path)],
        "pipeline": ["pipeline", "--output_dir", str(tmp_path / "run")],
        "demo": ["demo"],
    }[entry]
    with pytest.raises(ValueError, match=rf"--config {config}: {pattern}"):
        from plugformer.cli import main

        main(["--debug", *argv, "--config", str(config)])
    assert not (tmp_path / "run").exists()


def test_yaml_floats_without_a_dot_and_command_line_strings_still_convert(tmp_path):
    from plugformer.experiments.pipeline import PipelineArguments
    from plugformer.runtime.arguments import parse_arguments
    from plugformer.training import parse_stage_arguments

    config = tmp_path / "config.yaml"
    config.write_text("learning_rate: 1e-3\nnum_train_epochs: 2\nreport_to: none\n")  # PyYAML alone: '1e-3' a str
    flags = [
        "--max_steps",
        "10",
        "--bf16",
        "false",
        "--dataset_name",
        "json",
        "--data_files",
        "a.jsonl",
        "b.jsonl",
        "--num_generations",
        "4",
    ]
    script, _, training = parse_stage_arguments("grpo", ["--config", str(config), "--output_dir", "o", *flags])
    assert (training.learning_rate, training.num_train_epochs, training.max_steps) == (1e-3, 2, 10)
    assert (training.bf16, training.num_generations, script.data_files) == (False, 4, ["a.jsonl", "b.jsonl"])
    args = parse_arguments(PipelineArguments, ["--stages", "pretrain", "sft", "--rerun", "yes"], prog="pipeline")
    assert args.stages == ["pretrain", "sft"] and args.rerun is True


def test_yaml_names_duplicate_keys_non_utf8_files_and_oversized_documents(tmp_path):
    from plugformer.runtime.arguments import MAX_YAML_BYTES, read_yaml

    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("max_steps: 2\nlearning_rate: 1e-3\nmax_steps: 5\n")
    with pytest.raises(ValueError, match=r"dup.yaml: key 'max_steps' is given twice \(lines 1 and 3\)"):
        read_yaml(duplicate)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("max_steps: 2\n# café\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.yaml: not UTF-8 text \(byte b'\\xe9' at offset 18\)"):
        read_yaml(latin)
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_YAML_BYTES // 10 + 1))
    with pytest.raises(ValueError, match=rf"big.yaml: \d+ bytes; a config file is at most {MAX_YAML_BYTES} bytes"):
        read_yaml(big)
    shared = tmp_path / "anchors.yaml"  # ordinary anchors still work
    shared.write_text("base: &base {lr: 1.0e-3}\nrun: *base\n")
    assert read_yaml(shared) == {"base": {"lr": 1e-3}, "run": {"lr": 1e-3}}


def test_a_stage_config_with_a_duplicate_key_is_refused_naming_it(tmp_path, monkeypatch):
    from plugformer.training import run_stage

    config = tmp_path / "sft.yaml"
    config.write_text("max_steps: 3\nlearning_rate: 1.0e-3\nmax_steps: 1\n")
    with pytest.raises(ValueError, match=r"key 'max_steps' is given twice"):
        run_stage("sft", ["--config", str(config), "--output_dir", str(tmp_path / "out")])


BOMB = "".join(
    [
        'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh", strict=True)),
        "{key}: [" + ",".join(["*h"] * 9) + "]\n",
    ]
)


@pytest.mark.parametrize(("command", "key"), [("demo", "prompts"), ("train", "dataset_name")])
def test_an_alias_bomb_in_a_config_is_refused_before_it_is_built(tmp_path, capsys, command, key):
    from plugformer.cli import main

    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB.format(key=key))
    assert config.stat().st_size < 500
    argv = [
        command,
        *(["sft"] if command == "train" else []),
        "--config",
        str(config),
        "--output_dir",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit):
        main(argv)
    assert re.search(rf"--config {re.escape(str(config))}: its aliases expand to \d+ values", capsys.readouterr().err)


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    """`plugformer demo --config configs/demo.yaml` worked only from the repository root."""
    from plugformer.experiments.demo import DemoArguments
    from plugformer.runtime.arguments import config_path, parse_arguments
    from plugformer.training import parse_stage_arguments

    monkeypatch.chdir(tmp_path)
    assert parse_arguments(DemoArguments, ["--config", "configs/demo.yaml"], prog="demo").position_scheme == "alibi"
    script_args, _, _ = parse_stage_arguments("sft", ["--config", "configs/sft/tiny.yaml", "--output_dir", "o"])
    assert script_args.pass_at_k_samples == 8
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/demo.yaml").write_text("max_steps: 3\n")  # a file where the user is wins
    assert parse_arguments(DemoArguments, ["--config", "configs/demo.yaml"], prog="demo").max_steps == 3
    with pytest.raises(FileNotFoundError, match=r"--config configs/nope.yaml: no such file \(looked in "):
        config_path("configs/nope.yaml")
