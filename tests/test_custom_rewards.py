"""`plugformer train grpo --reward_funcs pkg.module:function`: your own verifier, imported and checked before any work,
trains beside the built-in rewards, reaches TRL (its logged `rewards/<name>/mean`), and is named in run_info.json and
the model card."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from plugformer.cli import main as cli_main
from plugformer.evaluation.custom_rewards import resolve_reward_function


ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
         "--max_completion_length", "8", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true",
         "--exact_match_examples", "0", "--selection_steps", "0", "--pass_at_k_samples", "0", "--bf16", "false",
         "--dataloader_pin_memory", "false", "--dev_examples", "4", "--test_examples", "4"]  # fmt: skip
VERIFIER = '''
CALLS = []

def digits_reward(prompts, completions, answer, **kwargs):
    """1.0 per digit of the answer the completion writes: a user's own verifier."""
    CALLS.append(len(completions))
    return [float(sum(d in str(c) for d in str(a))) for c, a in zip(completions, answer)]

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def by_position(prompts, completions, /, **kwargs):
    return [0.0] * len(completions)

NOT_CALLABLE = 3
'''


@pytest.fixture
def verifiers(tmp_path, monkeypatch) -> str:
    """A module `my_verifiers` on sys.path and PYTHONPATH, as a user's own file would be."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "my_verifiers.py").write_text(textwrap.dedent(VERIFIER))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    sys.modules.pop("my_verifiers", None)
    yield "my_verifiers"
    sys.modules.pop("my_verifiers", None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("digits_reward", r"expected pkg\.module:function"),
        ("no_such_module:f", r"cannot import 'no_such_module' \(no such module\); put the folder .* on PYTHONPATH"),
        ("my_verifiers:missing", r"'my_verifiers' has no 'missing'; it defines \["),
        ("my_verifiers:NOT_CALLABLE", r"'NOT_CALLABLE' is of type int, not a function"),
        ("my_verifiers:no_kwargs", r"no_kwargs\(prompts, completions\) takes no \*\*kwargs"),
        ("my_verifiers:by_position", r"by_position\(.*\) takes \['prompts', 'completions'\] by position only"),
    ],
)
def test_bad_reward_funcs_are_refused_in_one_line_naming_the_flag_and_value(verifiers, spec, message):
    with pytest.raises(ValueError, match=rf"^--reward_funcs '{spec}': {message}") as caught:
        resolve_reward_function(spec)
    assert "\n" not in str(caught.value)


def test_bad_reward_funcs_are_refused_by_the_command_before_any_work(verifiers, tmp_path, capsys):
    base = [
        "train",
        "grpo",
        "--config",
        str(ROOT / "configs/grpo/tiny.yaml"),
        "--model_name_or_path",
        str(tmp_path / "no-model-here"),
        "--output_dir",
        str(tmp_path / "out"),
        *QUICK,
    ]
    for extra, message in (
        (["--reward_funcs", "my_verifiers:no_kwargs"], "--reward_funcs 'my_verifiers:no_kwargs': no_kwargs("),
        (["--reward_funcs", "my_verifiers:digits_reward"], "--reward_weights [1.0, 0.25]: 2 weights for 3 reward"),
        (["--reward_funcs", "my_verifiers:digits_reward", "--reward_functions", "nope"], "--reward_functions ['nope']"),
    ):
        with pytest.raises(SystemExit) as caught:
            cli_main([*base, *extra])
        error = capsys.readouterr().err.strip().splitlines()
        assert caught.value.code == 2 and len(error) == 1 and message in error[0], error
        assert not (tmp_path / "out").exists()  # refused before the (missing) model was looked for


def test_a_users_verifier_trains_grpo_and_reaches_trl(verifiers, tmp_path):
    from test_training import train

    train("pretrain", tmp_path / "pretrain")
    train("sft", tmp_path / "sft", "--model_name_or_path", str(tmp_path / "pretrain"))
    cli_main(
        [
            "train",
            "grpo",
            "--config",
            str(ROOT / "configs/grpo/tiny.yaml"),
            "--model_name_or_path",
            str(tmp_path / "sft"),
            "--output_dir",
            str(tmp_path / "grpo"),
            *QUICK,
            "--train_examples",
            "16",
            "--reward_funcs",
            f"{verifiers}:digits_reward",
            "--reward_weights",
            "1.0",
            "0.25",
            "0.5",
        ]
    )
    assert sys.modules[verifiers].CALLS == [4, 4]  # one group of 4 completions per step, two steps
    logged = json.loads((tmp_path / "grpo/trainer_state.json").read_text())["log_history"]
    means = [entry["rewards/digits_reward/mean"] for entry in logged if "rewards/digits_reward/mean" in entry]
    assert len(means) == 2 and all(mean >= 0 for mean in means)
    info = json.loads((tmp_path / "grpo/run_info.json").read_text())
    mine = info["rewards"][-1]
    assert [r["name"] for r in info["rewards"]] == ["exact_match_reward", "format_reward", "digits_reward"]
    assert mine["spec"] == "my_verifiers:digits_reward" and mine["weight"] == 0.5 and len(mine["sha256"]) == 64
    card = (tmp_path / "grpo/README.md").read_text()
    assert "digits_reward x0.5 (`my_verifiers:digits_reward`, sha256 " in card
