"""Dev selection for every kind of data (issue 60): exact match where the data holds an `answer` or a `solution`,
else the stage's own dev signal, chosen by the data's columns and recorded in run_info.json; the built-in rewards
read TRL's `solution` column; `plugformer eval` scores preference pairs whose prompt is implicit, as training did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from own_data import pretrained_folder, train_on_file
from test_training import write_jsonl

from plugformer.cli import main as cli_main
from plugformer.evaluation.rewards import exact_match_reward, math_verify_reward
from plugformer.training.data import with_answers


QUICK = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--logging_steps", "1",
         "--report_to", "none", "--disable_tqdm", "true", "--exact_match_examples", "0", "--pass_at_k_samples", "0",
         "--dataloader_pin_memory", "false", "--bf16", "false", "--max_new_tokens", "8"]  # fmt: skip


def pairs(count: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 2?", "chosen": f" {i} + 2 = {i + 2}\n#### {i + 2}", "rejected": f" #### {i + 3}"}
            for i in range(count)]  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return pretrained_folder(tmp_path_factory, "signals")


def stage(name: str, output: Path, parent: Path, data: Path, *extra: str) -> dict:
    """`plugformer train <name>` with its shipped tiny config on your `data`."""
    train_on_file(name, output, parent, data, *QUICK, *extra)
    return json.loads((output / "run_info.json").read_text())


@pytest.fixture(scope="module")
def dpo(pretrained, tmp_path_factory):
    """A DPO stage on 40 preference pairs without an `answer`, selecting every 2 steps: (folder, run_info, stdout)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("dpo")
    data = write_jsonl(root / "pairs.jsonl", pairs(40))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        info = stage("dpo", root / "dpo", pretrained, data, "--max_steps", "4", "--selection_steps", "2",
                     "--max_length", "64", "--learning_rate", "1e-3")  # fmt: skip
    return root / "dpo", info, out.getvalue()


def test_dpo_on_pairs_without_an_answer_selects_by_its_implicit_reward(dpo):
    folder, info, printed = dpo
    selection = info["selection"]
    assert selection["signal"] == "dev_implicit_reward_accuracy"
    assert "[selection] every 2 steps: pairwise accuracy of the implicit reward" in printed
    assert "on 4 dev rows (dev_implicit_reward_accuracy)" in printed  # 10% of 40 pairs held out as dev
    history = selection["history"]
    assert [entry["step"] for entry in history] == [0, 2, 4]
    # step 0: the policy is its reference, every implicit reward is 0, and a tie ranks no pair right (as TRL counts)
    assert history[0]["dev_implicit_reward_accuracy"] == 0.0 and history[0]["dev_implicit_reward_margin"] == 0.0
    assert all(0.0 <= entry["dev_implicit_reward_accuracy"] <= 1.0 for entry in history)
    best = max(entry["dev_implicit_reward_accuracy"] for entry in history)
    assert selection["selected"] == next(e for e in history if e["dev_implicit_reward_accuracy"] == best)
    assert "dev_exact_match" not in history[0]
    if selection["selected"]["step"] != 4:  # DPO keeps what it learned beside the step it hands on
        assert info["last_step_model"] == "last_step" and (folder / "last_step/model.safetensors").is_file()


def test_eval_scores_preference_pairs_whose_prompt_is_implicit(dpo, tmp_path):
    from trl.data_utils import maybe_extract_prompt

    from plugformer.evaluation.implicit_reward import ImplicitReward
    from plugformer.evaluation.scoring import reward_function_accuracy

    folder, _, _ = dpo
    implicit = [{"chosen": f"What is {i} + 5? {i + 5}", "rejected": f"What is {i} + 5? {i + 6}"} for i in range(30)]
    data = write_jsonl(tmp_path / "implicit.jsonl", implicit)
    cli_main(["eval", "--model", str(folder), "--output", str(tmp_path / "eval.json"), "--dataset_name", "json",
              "--data_files", str(data), "--dev_examples", "3", "--test_examples", "5"])  # fmt: skip
    scores = json.loads((tmp_path / "eval.json").read_text())
    from plugformer.data.sources import load_stage_dataset

    rows = load_stage_dataset("preference", "json", data_files=[str(data)], sizes={"dev": 3, "test": 5})["test"]
    assert "prompt" not in rows.column_names and scores["examples"] == 5
    expected = reward_function_accuracy(ImplicitReward.from_dpo_stage(str(folder)), rows.map(maybe_extract_prompt))
    assert scores["implicit_reward_pairwise_accuracy"] == expected


def test_the_built_in_rewards_read_a_solution_where_there_is_no_answer():
    solutions = ["3 + 4 = 7\n#### 7", "The total is 1,200 apples.", "no number"]
    assert exact_match_reward(["#### 7", "so 1200", "#### 0"], solution=solutions) == [1.0, 1.0, 0.0]
    # an answer column wins over a solution: the embedded data holds both, and selects as before
    assert exact_match_reward(["#### 7"], answer=["8"], solution=["#### 7"]) == [0.0]
    for reward in (exact_match_reward, math_verify_reward):
        with pytest.raises(ValueError, match=r"an `answer` or a `solution` column; your data has neither"):
            reward(["#### 7"], prompts=["q"])
    data = {"dev": Dataset.from_list([{"prompt": "q", "solution": s} for s in solutions])}
    assert with_answers(data)["dev"]["answer"] == ["7", "1200", None]


def test_grpo_on_prompt_solution_data_rewards_and_selects_by_the_solutions_final_answer(pretrained, tmp_path):
    rows = [{"prompt": f"What is {i} + 3?", "solution": f"{i} + 3 = {i + 3}\n#### {i + 3}"} for i in range(30)]
    data = write_jsonl(tmp_path / "math.jsonl", rows)
    info = stage("grpo", tmp_path / "grpo", pretrained, data, "--max_steps", "2", "--num_generations", "4",
                 "--max_completion_length", "8", "--selection_steps", "1", "--selection_examples", "3")  # fmt: skip
    logged = json.loads((tmp_path / "grpo/trainer_state.json").read_text())["log_history"]
    assert sum("rewards/exact_match_reward/mean" in entry for entry in logged) == 2  # the reward read `solution`
    assert info["selection"]["signal"] == "dev_exact_match"
    assert [entry["step"] for entry in info["selection"]["history"]] == [0, 1, 2]


def test_selection_without_a_ground_truth_or_a_stage_signal_is_refused_naming_both_columns(tmp_path):
    from types import SimpleNamespace

    from plugformer.training.common import dev_selection

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"say {i}"} for i in range(30)])
    args = SimpleNamespace(selection_steps=3, dataset_name="json", data_files=[str(data)], dataset_config=None,
                           sizes=lambda: {"train": 30, "dev": 3, "test": 3}, dataset_seed=0, direct_answer_fraction=0.0,
                           rename_columns=None, keep_duplicates=False, selection_examples=3, max_new_tokens=8)  # fmt: skip
    model = SimpleNamespace(can_generate=lambda: True)
    with pytest.raises(ValueError, match=r"^--selection_steps 3: .*`answer` column \(or the final answer of a "
                                         r"`solution`\).*\['answer \(or solution\)'\].*--selection_steps 0"):  # fmt: skip
        dev_selection(args, None, model, data={"train": Dataset.from_list([{"prompt": "x"}])})
