"""Dev selection for every kind of data: exact match where the data holds an `answer` or a `solution`,
else the stage's own dev signal, chosen by the data's columns and recorded in run_info.json; the built-in rewards
read TRL's `solution` column; `plugformer eval` scores preference pairs whose prompt is implicit, as training did."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from own_data import ROOT, pretrained_folder, train_on_file
from test_training import write_jsonl

from plugformer.cli import main as cli_main
from plugformer.evaluation.rewards import exact_match_reward, math_verify_reward
from plugformer.training.data import with_answers


QUICK = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--logging_steps", "1",
         "--report_to", "none", "--disable_tqdm", "true", "--exact_match_examples", "0", "--pass_at_k_samples", "0",
         "--dataloader_pin_memory", "false", "--bf16", "false", "--max_new_tokens", "8"]  # fmt: skip


def pairs(count: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} + 2?", "chosen": f" {i} + 2 = {i + 2}\n#### {i + 2}", "rejected": f" #### {i + 3}"}
        for i in range(count)
    ]


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
        info = stage(
            "dpo",
            root / "dpo",
            pretrained,
            data,
            "--max_steps",
            "4",
            "--selection_steps",
            "2",
            "--max_length",
            "64",
            "--learning_rate",
            "1e-3",
        )
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
    from plugformer.evaluation.language_scores import reward_function_accuracy

    folder, _, _ = dpo
    implicit = [{"chosen": f"What is {i} + 5? {i + 5}", "rejected": f"What is {i} + 5? {i + 6}"} for i in range(30)]
    data = write_jsonl(tmp_path / "implicit.jsonl", implicit)
    cli_main(
        [
            "eval",
            "--model",
            str(folder),
            "--output",
            str(tmp_path / "eval.json"),
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--dev_examples",
            "3",
            "--test_examples",
            "5",
        ]
    )
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
    info = stage(
        "grpo",
        tmp_path / "grpo",
        pretrained,
        data,
        "--max_steps",
        "2",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--selection_steps",
        "1",
        "--selection_examples",
        "3",
    )
    logged = json.loads((tmp_path / "grpo/trainer_state.json").read_text())["log_history"]
    assert sum("rewards/exact_match_reward/mean" in entry for entry in logged) == 2  # the reward read `solution`
    assert info["selection"]["signal"] == "dev_exact_match"
    assert [entry["step"] for entry in info["selection"]["history"]] == [0, 1, 2]


def test_selection_without_a_ground_truth_or_a_stage_signal_is_refused_naming_both_columns(tmp_path):
    from types import SimpleNamespace

    from plugformer.training.common import dev_selection

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"say {i}"} for i in range(30)])
    args = SimpleNamespace(
        selection_steps=3,
        dataset_name="json",
        data_files=[str(data)],
        dataset_config=None,
        sizes=lambda: {"train": 30, "dev": 3, "test": 3},
        dataset_seed=0,
        direct_answer_fraction=0.0,
        rename_columns=None,
        keep_duplicates=False,
        selection_examples=3,
        max_new_tokens=8,
    )
    model = SimpleNamespace(can_generate=lambda: True)
    with pytest.raises(
        ValueError,
        match=r"^--selection_steps 3: .*`answer` column \(or the final answer of a "
        r"`solution`\).*\['answer \(or solution\)'\].*--selection_steps 0",
    ):
        dev_selection(args, None, model, data={"train": Dataset.from_list([{"prompt": "x"}])})


# --- the signals of the stages left: sft without an answer, reward, rlhf, grpo with your own verifier only ---


def chats(count: int) -> list[dict]:
    """Two-turn conversations without an `answer` column: both assistant turns are completions."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + 2?"},
                {"role": "assistant", "content": f"{i + 2}"},
                {"role": "user", "content": "And doubled?"},
                {"role": "assistant", "content": f"{2 * i + 4}"},
            ]
        }
        for i in range(count)
    ]


def dev_rows(stage_name: str, data: Path, **sizes):
    """The dev split the stage `stage_name` held out of the file `data` (its own arguments' defaults otherwise)."""
    from plugformer.training.data import stage_data
    from plugformer.training.stage_table import STAGES

    arguments = STAGES.get_stage(stage_name).script_arguments(dataset_name="json", data_files=[str(data)], **sizes)
    return stage_data(STAGES.get_stage(stage_name), arguments)["dev"]


def completion_log_likelihood_by_hand(model, tokenizer, conversations) -> float:
    """Σ log p over every assistant turn's tokens given the conversation before it, over their count, from the
    model's own mean loss on one unpadded sequence at a time (labels -100 on the context)."""
    total, count = 0.0, 0
    for messages in conversations:
        for k, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            context = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
            head = tokenizer(context, add_special_tokens=False)["input_ids"]
            tail = tokenizer(whole[len(context) :], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([head + tail])
            labels = torch.tensor([[-100] * len(head) + tail])
            with torch.no_grad():
                loss = model(input_ids=ids, labels=labels).loss
            total -= float(loss) * len(tail)  # the mean over the `tail` tokens the labels keep
            count += len(tail)
    return total / count


def test_sft_on_chats_without_an_answer_selects_by_completion_log_likelihood(pretrained, tmp_path):
    from transformers import AutoModelForCausalLM

    from plugformer.data.tokenization import load_tokenizer

    data = write_jsonl(tmp_path / "chats.jsonl", chats(40))
    sizes = {"dev_examples": 4, "test_examples": 4}
    info = stage(
        "sft",
        tmp_path / "sft",
        pretrained,
        data,
        "--max_steps",
        "4",
        "--selection_steps",
        "2",
        "--learning_rate",
        "3e-3",
        "--dev_examples",
        "4",
        "--test_examples",
        "4",
    )
    selection = info["selection"]
    assert selection["signal"] == "dev_completion_log_likelihood"
    history = selection["history"]
    assert [entry["step"] for entry in history] == [0, 2, 4] and "dev_exact_match" not in history[0]
    values = [entry["dev_completion_log_likelihood"] for entry in history]
    assert all(v < 0 for v in values) and len(set(values)) == 3  # training moved it
    assert selection["selected"] == history[values.index(max(values))]
    for entry in history:
        assert entry["dev_completion_perplexity"] == pytest.approx(math.exp(-entry["dev_completion_log_likelihood"]))
    # by hand: step 0 is the parent, the selected step the saved model
    conversations = list(dev_rows("sft", data, **sizes)["messages"])
    assert len(conversations) == 4
    tokenizer = load_tokenizer(str(pretrained))
    for entry, folder in ((history[0], pretrained), (selection["selected"], tmp_path / "sft")):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        expected = completion_log_likelihood_by_hand(model, tokenizer, conversations)
        assert entry["dev_completion_log_likelihood"] == pytest.approx(expected, rel=1e-4)


@pytest.fixture(scope="module")
def reward_model(pretrained, tmp_path_factory):
    """A reward stage on 40 preference pairs, selecting every 2 steps: (folder, run_info, pairs file)."""
    root = tmp_path_factory.mktemp("reward")
    data = write_jsonl(root / "pairs.jsonl", pairs(40))
    at = QUICK.index("--pass_at_k_samples")
    quick = QUICK[:at] + QUICK[at + 2 :]  # a reward model samples nothing
    train_on_file(
        "reward",
        root / "reward",
        pretrained,
        data,
        *quick,
        "--max_steps",
        "4",
        "--selection_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--dev_examples",
        "4",
        "--test_examples",
        "4",
    )
    return root / "reward", json.loads((root / "reward/run_info.json").read_text()), data


def test_reward_on_pairs_selects_by_pairwise_accuracy(pretrained, reward_model):
    from transformers import AutoModelForSequenceClassification

    from plugformer.data.tokenization import load_tokenizer

    folder, info, data = reward_model
    selection = info["selection"]
    assert selection["signal"] == "dev_pairwise_accuracy"
    history = selection["history"]
    assert [entry["step"] for entry in history] == [0, 2, 4] and "dev_exact_match" not in history[0]
    best = max(entry["dev_pairwise_accuracy"] for entry in history)
    assert selection["selected"] == next(e for e in history if e["dev_pairwise_accuracy"] == best)
    # by hand, on the saved (selected) model: each pair's texts whole, unpadded, ending in end-of-text as TRL trains
    rows = dev_rows("reward", data, dev_examples=4, test_examples=4)
    tokenizer = load_tokenizer(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()

    def score(text: str) -> float:
        ids = tokenizer(text + tokenizer.eos_token, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])

    margins = [score(r["prompt"] + r["chosen"]) - score(r["prompt"] + r["rejected"]) for r in rows]
    assert len(margins) == 4
    assert selection["selected"]["dev_pairwise_accuracy"] == sum(m > 0 for m in margins) / 4  # a tie is wrong
    assert selection["selected"]["dev_reward_margin"] == pytest.approx(sum(margins) / 4, rel=1e-4, abs=1e-5)


def greedy_answers(folder: Path, prompts: list) -> list[str]:
    """The saved policy's greedy answers (8 new tokens, as `QUICK` asks)."""
    from transformers import AutoModelForCausalLM

    from plugformer.data.tokenization import load_tokenizer
    from plugformer.evaluation.answers import generate_answers

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return generate_answers(model, load_tokenizer(str(folder)), prompts, max_new_tokens=8)


def test_rlhf_on_prompts_without_an_answer_selects_by_the_reward_models_mean_score(pretrained, reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from plugformer.data.tokenization import load_tokenizer

    rows = [{"prompt": [{"role": "user", "content": f"Name a number after {i}."}]} for i in range(30)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    folder = reward_model[0]
    info = stage(
        "rlhf",
        tmp_path / "rlhf",
        pretrained,
        data,
        "--reward_model_path",
        str(folder),
        "--max_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--selection_steps",
        "1",
        "--selection_examples",
        "3",
        "--dev_examples",
        "4",
        "--test_examples",
        "4",
    )
    selection = info["selection"]
    assert selection["signal"] == "dev_mean_reward"
    assert [entry["step"] for entry in selection["history"]] == [0, 1, 2]
    assert "dev_exact_match" not in selection["history"][0]
    # by hand: the saved policy's greedy answers to the first 3 dev prompts, each scored alone by the reward model
    prompts = list(dev_rows("rlhf", data, dev_examples=4, test_examples=4)["prompt"])[:3]
    tokenizer = load_tokenizer(str(folder))
    scorer = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    scores = []
    for prompt, answer in zip(prompts, greedy_answers(tmp_path / "rlhf", prompts), strict=True):
        text = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": answer}], tokenize=False)
        with torch.no_grad():
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            scores.append(float(scorer(input_ids=ids).logits[0, 0]))
    assert selection["selected"]["dev_mean_reward"] == pytest.approx(sum(scores) / 3, rel=1e-4, abs=1e-5)


DISTINCT_SHARE = '''
def distinct_share(prompts, completions, **kwargs):
    """The share of a completion's characters that are distinct: a verifier that needs no ground truth."""
    return [len(set(c)) / max(len(c), 1) for c in completions]
'''


def test_grpo_with_only_your_own_verifier_selects_by_its_mean_reward(pretrained, tmp_path, monkeypatch):
    import sys

    import yaml

    (tmp_path / "user_code").mkdir()
    (tmp_path / "user_code/my_verifier.py").write_text(DISTINCT_SHARE)
    monkeypatch.syspath_prepend(str(tmp_path / "user_code"))
    monkeypatch.delitem(sys.modules, "my_verifier", raising=False)
    # your own config: no built-in reward (they are the shipped config's), your verifier alone
    config = yaml.safe_load((ROOT / "configs/grpo/tiny.yaml").read_text())
    config.update(reward_functions=[], reward_weights=None)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Count on from {i}:"} for i in range(30)])
    cli_main(
        [
            "train",
            "grpo",
            "--config",
            str(tmp_path / "grpo.yaml"),
            "--model_name_or_path",
            str(pretrained),
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--output_dir",
            str(tmp_path / "grpo"),
            *QUICK,
            "--reward_funcs",
            "my_verifier:distinct_share",
            "--learning_rate",
            "1e-3",
            "--max_steps",
            "2",
            "--num_generations",
            "4",
            "--max_completion_length",
            "8",
            "--selection_steps",
            "1",
            "--selection_examples",
            "3",
            "--dev_examples",
            "4",
            "--test_examples",
            "4",
        ]
    )
    info = json.loads((tmp_path / "grpo/run_info.json").read_text())
    assert [reward["name"] for reward in info["rewards"]] == ["distinct_share"]
    selection = info["selection"]
    assert selection["signal"] == "dev_mean_reward"
    assert [entry["step"] for entry in selection["history"]] == [0, 1, 2]
    # by hand: the distinct-character share of the saved policy's greedy answers to the first 3 dev prompts
    prompts = list(dev_rows("grpo", data, dev_examples=4, test_examples=4)["prompt"])[:3]
    answers = greedy_answers(tmp_path / "grpo", prompts)
    expected = sum(len(set(answer)) / max(len(answer), 1) for answer in answers) / 3
    assert expected > 0
    assert selection["selected"]["dev_mean_reward"] == pytest.approx(expected, abs=1e-9)


def test_the_completion_log_likelihood_reads_what_sfts_loss_reads_in_each_format(pretrained):
    from plugformer.data.tokenization import load_tokenizer
    from plugformer.training.selection_signals import CompletionLikelihood, completion_pairs

    eos = "<|endoftext|>"
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert completion_pairs(Dataset.from_list([{"messages": turns}]), eos) == [
        (turns[:1], turns[1:2]),
        (turns[:3], turns[3:]),
    ]
    # strings end in end-of-text as TRL appends it, once; a conversation's end is its template's
    rows = Dataset.from_list(
        [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "1 + 1 =", "completion": " 2" + eos}]
    )
    assert completion_pairs(rows, eos) == [("2 + 2 =", " 4" + eos), ("1 + 1 =", " 2" + eos)]
    assert completion_pairs(Dataset.from_list([{"text": "one two"}]), eos) == [("", "one two" + eos)]
    # a text's every token but the first, which nothing predicts
    tokenizer = load_tokenizer(str(pretrained))
    ids = tokenizer("one two" + eos, add_special_tokens=False)["input_ids"]
    assert CompletionLikelihood(Dataset.from_list([{"text": "one two"}]), tokenizer).tokens == len(ids) - 1


def test_the_pipeline_summary_names_each_stages_selection_signal():
    """A stage selected by its own signal (DPO's accuracy, SFT's likelihood) is reported by it, not by exact match."""
    from plugformer.experiments.pipeline import other_text

    def summary(signal, selected, last):
        step = {"signal": signal, "selected": {"step": 4, signal: selected}, "last": {"step": 8, signal: last}}
        return other_text({"selection": step})

    assert summary("dev_exact_match", 0.5, 0.25) == "dev (dev_exact_match): step 4 selected (50.0%), last step 8 25.0%"
    assert summary("dev_implicit_reward_accuracy", 0.75, 0.5).endswith("selected (75.0%), last step 8 50.0%")
    assert summary("dev_completion_log_likelihood", -1.25, -1.5).endswith("selected (-1.250), last step 8 -1.500")
