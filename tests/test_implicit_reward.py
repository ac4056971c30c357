"""DPO's implicit reward as the rlhf stage's reward model: β·(log π(y|x) − log π_ref(y|x)), checked against a
per-sequence log-softmax computed here token by token, and wired through the rlhf stage, eval and the pipeline."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, tiny_config

from plugformer.data.sources import load_stage_dataset
from plugformer.data.tokenization import train_tokenizer
from plugformer.runtime.files import weights_sha256


def save_dpo_like(tmp_path, beta: float = 0.1):
    """A reference and a 'DPO' policy (the reference with other weights), saved with a tokenizer; the policy's
    run_info.json records what the dpo stage records."""
    rows = load_stage_dataset("preference", sizes={"train": 40}, seed=0, direct_fraction=0.5)["train"]
    texts = [m["content"] for row in rows for m in row["prompt"] + row["chosen"] + row["rejected"]]
    tokenizer = train_tokenizer(texts, vocab_size=300, split_digits=True)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    paths = {}
    for name, seed in (("reference", 0), ("policy", 1)):
        paths[name] = tmp_path / name
        build(config, seed=seed).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    record = {
        "stage": "dpo",
        "reference": str(paths["reference"]),
        "reference_weights_sha256": weights_sha256(paths["reference"]),
        "beta": beta,
        "data": {"direct_answer_fraction": 0.5},
    }
    (paths["policy"] / "run_info.json").write_text(json.dumps(record))
    return paths, tokenizer, rows


def sequence_log_prob(model, tokenizer, prompt, completion) -> float:
    """log p(completion | prompt), one predicted token at a time, from the full conversation's logits."""
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    start = len(tokenizer(head, add_special_tokens=False)["input_ids"])
    ids = tokenizer(whole, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)  # (T, V)
    return sum(log_probs[t - 1, ids[0, t]].item() for t in range(start, ids.shape[1]))


def test_implicit_reward_is_beta_times_the_log_ratio_of_each_completion(tmp_path):
    from transformers import AutoModelForCausalLM

    from plugformer.evaluation.implicit_reward import ImplicitReward

    paths, tokenizer, rows = save_dpo_like(tmp_path, beta=0.25)
    reward = ImplicitReward.from_dpo_stage(str(paths["policy"]), batch_size=3)  # batches of unequal lengths
    prompts, completions = list(rows["prompt"])[:7], list(rows["rejected"])[:7]
    policy, reference = (AutoModelForCausalLM.from_pretrained(paths[n]).eval() for n in ("policy", "reference"))
    expected = [
        0.25 * (sequence_log_prob(policy, tokenizer, p, c) - sequence_log_prob(reference, tokenizer, p, c))
        for p, c in zip(prompts, completions, strict=True)
    ]
    assert reward(prompts, completions) == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert any(abs(value) > 1e-2 for value in expected)  # the two models differ: the check has teeth


def test_the_reward_models_the_rlhf_stage_loads(tmp_path):
    from plugformer.evaluation.implicit_reward import ImplicitReward
    from plugformer.training.stages.rlhf import load_reward_model

    paths, _, _ = save_dpo_like(tmp_path)
    reward, tokenizer = load_reward_model(str(paths["policy"]))
    assert isinstance(reward, ImplicitReward) and tokenizer is None and reward.beta == 0.1
    with pytest.raises(ValueError, match=r"beta=0\.0 must be positive"):
        ImplicitReward(str(paths["policy"]), str(paths["reference"]), beta=0.0)
    with pytest.raises(ValueError, match="not a finished DPO stage"):
        ImplicitReward.from_dpo_stage(str(paths["reference"]))  # no run_info.json


def test_eval_scores_a_dpo_policy_as_a_reward_model_too(tmp_path):
    """`plugformer eval` on a DPO stage adds the implicit reward's pairwise accuracy on test pairs drawn as the stage's
    training pairs were; the same accuracy as counting the pairs by hand."""
    from plugformer.evaluation.implicit_reward import ImplicitReward
    from plugformer.evaluation.scoring import EvalArguments, evaluate_directory

    paths, _, _ = save_dpo_like(tmp_path)
    results = evaluate_directory(EvalArguments(model=str(paths["policy"]), examples=12, max_new_tokens=4))
    pairs = load_stage_dataset("preference", sizes={"test": 12}, seed=0, direct_fraction=0.5)["test"]
    reward = ImplicitReward.from_dpo_stage(str(paths["policy"]))
    prompts = list(pairs["prompt"])
    chosen, rejected = reward(prompts, list(pairs["chosen"])), reward(prompts, list(pairs["rejected"]))
    right = sum(c > r for c, r in zip(chosen, rejected, strict=True))
    assert results["implicit_reward_pairwise_accuracy"] == right / 12
    assert "exact_match" in results


def test_the_pipeline_rewards_rlhf_with_the_stage_it_names(tmp_path):
    from plugformer.experiments import pipeline

    stages = ["pretrain", "sft", "reward", "dpo", "rlhf", "grpo"]
    args = pipeline.PipelineArguments(output_dir=str(tmp_path), stages=stages, rlhf_reward="dpo")
    argv = pipeline.stage_argv(args, "rlhf")
    assert argv[argv.index("--reward_model_path") + 1] == str(tmp_path / "dpo")
    assert pipeline.requirements(args)["rlhf"] == {"sft", "dpo"}
    assert "dpo" in pipeline.stage_record(args, "rlhf", argv)["parent_digests"]
    with pytest.raises(ValueError, match="'dpo' \\(rlhf_reward\\) must come before 'rlhf'"):
        pipeline.stage_argv(pipeline.PipelineArguments(rlhf_reward="dpo"), "rlhf")  # the default order
    with pytest.raises(ValueError, match="--rlhf_reward 'grpo': choose one of reward, dpo"):
        pipeline.PipelineArguments(rlhf_reward="grpo")


def test_a_dpo_reference_is_read_by_its_absolute_path_and_checked_by_its_weights(tmp_path, monkeypatch):
    """A reference recorded as the relative path it was given (`"sft"`) was read against the reader's
    working folder: another folder's `./sft` gave an implicit-reward accuracy of 0.0 instead of 0.4375, silently."""
    import shutil

    from plugformer.evaluation.implicit_reward import ImplicitReward
    from plugformer.evaluation.scoring import EvalArguments, evaluate_directory
    from plugformer.training.stages.rlhf import load_reward_model

    paths, _, _ = save_dpo_like(tmp_path / "run")
    expected = evaluate_directory(EvalArguments(model=str(paths["policy"]), examples=8, max_new_tokens=2))
    # another folder, with a `reference` of other weights: the recorded absolute path is read, not ./reference
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(paths["policy"], elsewhere / "reference")
    monkeypatch.chdir(elsewhere)
    again = evaluate_directory(EvalArguments(model=str(paths["policy"]), examples=8, max_new_tokens=2))
    assert again["implicit_reward_pairwise_accuracy"] == expected["implicit_reward_pairwise_accuracy"]
    # the recorded reference replaced: refused, naming both digests, by eval and by rlhf's reward source
    info = json.loads((paths["policy"] / "run_info.json").read_text())
    recorded = info["reference_weights_sha256"]
    shutil.copy(paths["policy"] / "model.safetensors", paths["reference"] / "model.safetensors")
    for consume in (
        lambda: evaluate_directory(EvalArguments(model=str(paths["policy"]), examples=8)),
        lambda: load_reward_model(str(paths["policy"])),
    ):
        with pytest.raises(
            ValueError,
            match=rf"{paths['reference']} holds weights sha256 \w{{12}}, but the dpo stage "
            rf"trained against weights sha256 {recorded[:12]}",
        ):
            consume()
    # a relative reference with no digest (a record from before): which model it is cannot be checked
    info.update(reference="reference", reference_weights_sha256=None)
    (paths["policy"] / "run_info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="without an absolute path and a weights sha256"):
        ImplicitReward.from_dpo_stage(str(paths["policy"]))


def test_dpo_stage_records_its_reference_by_absolute_path_and_weights_digest(tmp_path, monkeypatch):
    from plugformer.runtime.files import weights_sha256
    from plugformer.training.stages.dpo import reference_record

    paths, _, _ = save_dpo_like(tmp_path)
    monkeypatch.chdir(tmp_path)
    record = reference_record("reference")
    assert record == {
        "reference": str(paths["reference"]),
        "reference_weights_sha256": weights_sha256(paths["reference"]),
    }
    assert len(record["reference_weights_sha256"]) == 64


def test_rlhf_refuses_a_reward_source_without_a_trained_reward_head(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from plugformer.training.stages.rlhf import load_reward_model

    paths, tokenizer, _ = save_dpo_like(tmp_path)
    # a language model's folder (an sft stage) with no dpo record: its reward head would be freshly initialised
    with pytest.raises(
        ValueError,
        match=r"--reward_model_path .*reference: a PlugformerForCausalLM with "
        r"num_labels=2, no trained reward head",
    ):
        load_reward_model(str(paths["reference"]))
    classifier = tmp_path / "reward"
    AutoModelForSequenceClassification.from_pretrained(paths["reference"], num_labels=1).save_pretrained(classifier)
    tokenizer.save_pretrained(classifier)
    model, reward_tokenizer = load_reward_model(str(classifier))
    assert model.config.num_labels == 1 and reward_tokenizer is not None


def test_a_policy_that_is_its_reference_gives_no_reward_and_no_accuracy(tmp_path):
    """A DPO stage whose dev selection handed on step 0 saved the SFT weights; its implicit reward was 0 for
    every answer, the pipeline's table read "implicit reward pairwise accuracy 0.0%" and RLHF trained on no signal."""
    import shutil

    from plugformer.evaluation.implicit_reward import ImplicitReward, ZeroReward
    from plugformer.evaluation.scoring import EvalArguments, evaluate_directory
    from plugformer.training.stages.rlhf import load_reward_model

    paths, _, _ = save_dpo_like(tmp_path)
    shutil.copy(paths["reference"] / "model.safetensors", paths["policy"] / "model.safetensors")  # step 0 handed on
    with pytest.raises(ZeroReward, match="0 for every answer"):
        ImplicitReward.from_dpo_stage(str(paths["policy"]))
    with pytest.raises(ValueError, match="holds its reference's weights"):
        load_reward_model(str(paths["policy"]))
    results = evaluate_directory(EvalArguments(model=str(paths["policy"]), examples=6, max_new_tokens=2))
    assert results["implicit_reward_pairwise_accuracy"] is None
    assert "0 for every answer" in results["implicit_reward_note"]


def test_the_implicit_reward_reads_the_last_step_a_dpo_stage_kept(tmp_path):
    """Where dev selection handed on an earlier step, the dpo stage keeps its last step in last_step/ and records it:
    the reward is that policy's log-ratio, not the handed-on one's."""
    import shutil

    from transformers import AutoModelForCausalLM

    from plugformer.evaluation.implicit_reward import ImplicitReward

    paths, tokenizer, rows = save_dpo_like(tmp_path, beta=0.5)
    shutil.copytree(paths["policy"], paths["policy"] / "last_step", ignore=shutil.ignore_patterns("run_info.json"))
    shutil.copy(paths["reference"] / "model.safetensors", paths["policy"] / "model.safetensors")  # step 0 handed on
    info = json.loads((paths["policy"] / "run_info.json").read_text())
    (paths["policy"] / "run_info.json").write_text(json.dumps({**info, "last_step_model": "last_step"}))
    reward = ImplicitReward.from_dpo_stage(str(paths["policy"]))
    prompts, completions = list(rows["prompt"])[:3], list(rows["chosen"])[:3]
    last, reference = (
        AutoModelForCausalLM.from_pretrained(p).eval() for p in (paths["policy"] / "last_step", paths["reference"])
    )
    expected = [
        0.5 * (sequence_log_prob(last, tokenizer, p, c) - sequence_log_prob(reference, tokenizer, p, c))
        for p, c in zip(prompts, completions, strict=True)
    ]
    assert reward(prompts, completions) == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert any(abs(value) > 1e-2 for value in expected)
