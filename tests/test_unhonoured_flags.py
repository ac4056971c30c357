"""A flag a command would accept and ignore is refused by one rule, read from each stage's record: `--use_peft` where
the stage trains every weight or would adapt a random initialisation, `--lora_*` without `--use_peft`, and the demo's
trainer counts (`--max_steps -5` trained 3 epochs), refused as `plugformer train` refuses them; and a
`--tokenizer_name_or_path` beside a `--model_name_or_path`, which has a tokenizer of its own."""

from __future__ import annotations

import re
import time

import pytest
from conftest import pretrain_checkpointed as pretrain
from conftest import refuse_training

from plugformer.cli import main
from plugformer.training import STAGES, parse_stage_arguments


def stage_argv(name: str, tmp_path, *flags: str, parent: bool = True) -> list[str]:
    """`flags` for stage `name`, with `--model_name_or_path` (a path only: nothing is loaded while parsing) where
    `parent`, and the directories of the stages it reads."""
    argv = ["--output_dir", str(tmp_path / name), *flags]
    if parent:
        argv += ["--model_name_or_path", str(tmp_path / "parent")]
    for needed in STAGES[name].inputs:
        argv += [needed.flag, str(tmp_path / needed.default)]
    return argv


@pytest.mark.parametrize("name", list(STAGES))
def test_use_peft_is_refused_where_the_stage_trains_every_weight(name, tmp_path):
    stage = STAGES[name]
    argv = stage_argv(name, tmp_path, "--use_peft", "true", "--lora_r", "4")
    if stage.adapters:
        _, model_args, _ = parse_stage_arguments(name, argv)
        assert model_args.use_peft and model_args.lora_r == 4
        return
    with pytest.raises(ValueError, match=rf"^--use_peft true: the {name} stage trains every weight .* drop --use_peft"):
        parse_stage_arguments(name, argv)


@pytest.mark.parametrize("name", [name for name, stage in STAGES.items() if stage.adapters])
def test_use_peft_without_a_trained_model_is_refused(name, tmp_path):
    """LoRA on a random initialisation adapts nothing (seq2seq trained it); a stage with a parent would fail later,
    when it loads no model, with a message that does not name the adapters."""
    argv = stage_argv(name, tmp_path, "--use_peft", "true", parent=False)
    with pytest.raises(ValueError, match=rf"^--use_peft true without --model_name_or_path: .* the {name} stage"):
        parse_stage_arguments(name, argv)


@pytest.mark.parametrize("name", list(STAGES))
@pytest.mark.parametrize(("flag", "value"), [("--lora_r", "4"), ("--lora_dropout", "0.2"), ("--use_dora", "true")])
def test_a_lora_option_without_use_peft_is_refused(name, flag, value, tmp_path):
    with pytest.raises(ValueError, match=rf"^{flag} .* shapes LoRA adapters, which the {name} stage trains only with"):
        parse_stage_arguments(name, stage_argv(name, tmp_path, flag, value))


def test_the_defaults_pass_for_every_stage(tmp_path):
    for name in STAGES:
        parse_stage_arguments(name, stage_argv(name, tmp_path, parent=STAGES[name].parent is not None))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "pretrain", "--use_peft", "true"], r"--use_peft true: the pretrain stage trains every weight"),
        (["train", "seq2seq", "--use_peft", "true"], r"--use_peft true without --model_name_or_path"),
        (["demo", "--max_steps", "-5"], r"--max_steps -5: expected a positive number of optimizer steps"),
        (["demo", "--batch_size", "0"], r"--batch_size 0: expected an integer >= 1"),
    ],
    ids=["pretrain-use_peft", "seq2seq-use_peft-no-model", "demo-max_steps", "demo-batch_size"],
)
def test_the_command_line_refuses_in_one_line_before_any_work(argv, message, tmp_path, capsys):
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and re.match(rf"ValueError: {message}", error), error
    assert time.monotonic() - start < 30  # refused while parsing: no tokenizer or corpus was built
    assert not (tmp_path / "run").exists()  # nor a folder claimed


def test_a_tokenizer_beside_a_model_is_refused_not_ignored(finished, tmp_path, monkeypatch):
    from plugformer.training.stages import pretrain as pretrain_module

    monkeypatch.setattr(pretrain_module, "stage_data", refuse_training)
    with pytest.raises(ValueError, match=r"--tokenizer_name_or_path .*other beside --model_name_or_path .*model's own"):
        pretrain(
            tmp_path / "run", "--model_name_or_path", str(finished), "--tokenizer_name_or_path", str(tmp_path / "other")
        )
