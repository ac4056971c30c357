"""Training stages: each trains a few steps on the tiny preset, changes the trainable parameters and leaves a
directory the Auto classes load; LoRA adapters merge exactly; a killed run resumes to the same weights; a
2-process CPU run keeps both ranks identical."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import micro_stage_configs
from safetensors.torch import load_file
from tolerances import model_tolerance
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from plugformer.evaluation import rewards as reward_module
from plugformer.runtime.arguments import override_flags
from plugformer.training import STAGES, parse_stage_arguments, run_stage


ROOT = Path(__file__).resolve().parents[1]
# a few steps of a 2-layer, 32-wide model: every stage in seconds
TINY = ["--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--max_steps", "3",
        "--train_examples", "48", "--dev_examples", "8", "--test_examples", "8", "--exact_match_examples", "4",
        "--max_new_tokens", "8", "--dataloader_pin_memory", "false", "--learning_rate", "1e-3", "--held_out_fraction", "1"]  # fmt: skip
TRL = ["--bf16", "false", "--activation_checkpointing", "false", "--max_length", "64"]
ONLINE = ["--bf16", "false", "--activation_checkpointing", "false", "--num_generations", "4", "--max_completion_length", "8"]  # fmt: skip
PRETRAIN = ["--preset", "tiny", "--vocab_size", "300", "--block_size", "32", "--max_position_embeddings", "128"]


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def assert_trained(parent, child, prefix: str = "model.") -> None:
    """Every backbone tensor the child shares with its parent has moved (TRL's own tests check the same)."""
    before, after = weights(parent), weights(child)
    shared = [name for name in after if name.startswith(prefix) and name in before]
    assert shared, f"no shared parameters between {parent} and {child}"
    unchanged = [name for name in shared if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters not trained: {unchanged}"


def train(stage: str, output_dir, *extra: str) -> dict:
    flags = TRL if stage in ("sft", "reward", "dpo") else ONLINE if stage in ("grpo", "rlhf") else PRETRAIN
    return run_stage(stage, override_flags(["--output_dir", str(output_dir), *TINY], flags, list(extra)))


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Path]:
    """pretrain -> sft -> reward, the parents of the other stages."""
    root = tmp_path_factory.mktemp("chain")
    dirs = {stage: root / stage for stage in ("pretrain", "sft", "reward")}
    train("pretrain", dirs["pretrain"])
    train("sft", dirs["sft"], "--model_name_or_path", str(dirs["pretrain"]))
    train("reward", dirs["reward"], "--model_name_or_path", str(dirs["sft"]))
    return dirs


def test_pretrain_trains_a_tokenizer_and_a_model_that_loads(chain):
    info = json.loads((chain["pretrain"] / "run_info.json").read_text())
    assert info["world_size"] == 1 and info["metrics"]["train_loss"] > 0
    assert info["metrics"]["eval_perplexity"] == pytest.approx(2.718281828 ** info["metrics"]["eval_loss"], rel=1e-6)
    model = AutoModelForCausalLM.from_pretrained(chain["pretrain"])
    assert type(model).__name__ == "PlugformerForCausalLM" and model.config.vocab_size <= 300
    # the generation config stops at the end of a chat turn, or online RL completions never end
    assert len(model.generation_config.eos_token_id) == 2
    assert (chain["pretrain"] / "tokenizer.json").exists()
    # the Trainer turns the cache off for training; the saved configs keep the preset's
    for stage in ("pretrain", "sft", "reward"):
        assert json.loads((chain[stage] / "config.json").read_text())["use_cache"] is True, stage


def test_sft_and_reward_train_every_parameter(chain):
    assert_trained(chain["pretrain"], chain["sft"])
    assert_trained(chain["sft"], chain["reward"])
    reward_model = AutoModelForSequenceClassification.from_pretrained(chain["reward"])
    assert reward_model.config.num_labels == 1 and "score.weight" in weights(chain["reward"])
    info = json.loads((chain["sft"] / "run_info.json").read_text())
    assert info["dev_exact_match"]["examples"] == 4 and 0.0 <= info["dev_exact_match"]["exact_match"] <= 1.0


def test_dpo_trains_from_the_sft_model(chain, tmp_path):
    train("dpo", tmp_path, "--model_name_or_path", str(chain["sft"]))
    assert_trained(chain["sft"], tmp_path)
    AutoModelForCausalLM.from_pretrained(tmp_path)


def test_rlhf_optimises_against_the_learned_reward_model(chain, tmp_path):
    info = train(
        "rlhf", tmp_path, "--model_name_or_path", str(chain["sft"]), "--reward_model_path", str(chain["reward"])
    )
    assert info["reward_model"] == str(chain["reward"])
    assert_trained(chain["sft"], tmp_path)
    AutoModelForCausalLM.from_pretrained(tmp_path)


def test_rl_stage_hands_on_its_best_dev_step_and_draws_the_overoptimisation_curve(chain, tmp_path):
    info = train(
        "rlhf",
        tmp_path,
        "--model_name_or_path",
        str(chain["sft"]),
        "--reward_model_path",
        str(chain["reward"]),
        "--selection_steps",
        "1",
        "--selection_examples",
        "4",
    )
    chosen, history = info["selection"]["selected"], info["selection"]["history"]
    assert [entry["step"] for entry in history] == [0, 1, 2, 3] and info["selection"]["last"]["step"] == 3
    best = max(entry["dev_exact_match"] for entry in history)
    assert chosen == next(entry for entry in history if entry["dev_exact_match"] == best)  # the first best step
    assert all("reward" in entry and "kl" in entry for entry in history[1:])  # logged every step (TINY)
    # the saved model is the selected step's: the same 4 dev problems score the same, and step 0 is the SFT model
    assert info["dev_exact_match"]["exact_match"] == chosen["dev_exact_match"]
    if chosen["step"] == 0:
        assert all(torch.equal(weights(chain["sft"])[k], v) for k, v in weights(tmp_path).items())
    assert (tmp_path / "overoptimisation.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "run_info.json").read_text())["selection"] == json.loads(
        json.dumps(info["selection"])
    )


def test_sft_reports_the_headroom_of_sampling_over_greedy(chain, tmp_path):
    info = train("sft", tmp_path, "--model_name_or_path", str(chain["pretrain"]), "--pass_at_k_samples", "3")
    headroom = info["dev_pass_at_k"]
    assert set(headroom) == {"pass@1", "pass@3", "samples", "temperature", "examples"}
    assert headroom["examples"] == 4 and 0.0 <= headroom["pass@1"] <= headroom["pass@3"] <= 1.0
    with pytest.raises(ValueError, match="selection_steps"):
        train("dpo", tmp_path / "bad", "--model_name_or_path", str(chain["sft"]), "--selection_steps", "-1")


@pytest.fixture
def length_reward(monkeypatch):
    """An untrained model never answers right, so every group would have zero advantage: a graded reward
    (completion length) gives the few-step RL tests a signal."""
    graded = lambda completions, **kwargs: [float(len(reward_module.completion_text(c))) for c in completions]  # noqa: E731
    monkeypatch.setitem(reward_module.REWARD_FUNCTIONS, "length", graded)


def test_grpo_trains_on_a_verifiable_reward(chain, tmp_path, length_reward):
    train("grpo", tmp_path, "--model_name_or_path", str(chain["sft"]), "--reward_functions", "length")
    assert_trained(chain["sft"], tmp_path)
    AutoModelForCausalLM.from_pretrained(tmp_path)


def test_lora_adapters_train_save_reload_and_merge_exactly(chain, tmp_path):
    from peft import PeftModel

    info = train("sft", tmp_path, "--model_name_or_path", str(chain["sft"]), "--use_peft", "true", "--lora_r", "4")
    assert info["dev_exact_match"]["examples"] == 4  # the merged LoRA model is scored like any other
    adapter = tmp_path / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    lora_b = [t for name, t in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: nonzero means trained
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chain["sft"]), adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(8, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(ids).logits  # W + BA merged against x W + (x A) B: `model_tolerance`
        torch.testing.assert_close(merged(ids).logits, expected, atol=model_tolerance(merged.config, expected), rtol=0)
        base = AutoModelForCausalLM.from_pretrained(chain["sft"]).eval()
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-4)  # the adapters did something


def test_rlhf_without_a_reward_model_and_unknown_stage_fail_clearly(chain, tmp_path):
    with pytest.raises(ValueError, match="--reward_model_path"):
        train("rlhf", tmp_path, "--model_name_or_path", str(chain["sft"]))
    with pytest.raises(ValueError, match="needs --model_name_or_path"):
        train("sft", tmp_path)
    with pytest.raises(ValueError, match="unknown stage 'ppo'"):
        run_stage("ppo", [])
    with pytest.raises(ValueError, match="reward_functions"):
        train("grpo", tmp_path, "--model_name_or_path", str(chain["sft"]), "--reward_functions", "exactmatch")


STAGE_YAMLS = [path for stage in STAGES for path in sorted(ROOT.glob(f"configs/{stage}/*.yaml"))]


@pytest.mark.parametrize("path", STAGE_YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_stage_yaml_parses_into_its_stage(path):
    import yaml

    from plugformer.training.trainer_options import trainer_option_aliases

    values = yaml.safe_load(path.read_text())
    # transformers refuses bf16 without a GPU at construction: check the GPU recipes' other values on CPU
    cpu = ["--bf16", "false"] if values.get("bf16") and not torch.cuda.is_available() else []
    script_args, model_args, training_args = parse_stage_arguments(path.parent.name, ["--config", str(path), *cpu])
    parsed = {**vars(script_args), **vars(model_args), **vars(training_args)}
    parsed["report_to"] = ",".join(parsed["report_to"])  # transformers keeps a list
    # a renamed trainer option lands in the field the installed transformers has (5.19: the old name)
    parsed.update({name: parsed[field] for name, field in trainer_option_aliases().items() if field in parsed})
    assert {k: parsed[k] for k in values if not (cpu and k == "bf16")} == {
        k: v for k, v in values.items() if not (cpu and k == "bf16")
    }


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/accelerate/*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_topology_is_a_valid_accelerate_config(path):
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 1 and config.compute_environment.value == "LOCAL_MACHINE"


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/pipeline/*.yaml")), ids=lambda p: p.name)
def test_every_pipeline_yaml_names_existing_stage_configs(path):
    from plugformer.experiments.pipeline import PipelineArguments, stage_argv
    from plugformer.runtime.arguments import parse_arguments

    arguments = parse_arguments(PipelineArguments, ["--config", str(path)], prog="test")
    for stage in arguments.stages:
        assert (ROOT / stage_argv(arguments, stage)[1]).exists()


def test_yaml_below_command_line_and_unknown_keys_fail(tmp_path):
    config = tmp_path / "sft.yaml"
    config.write_text("output_dir: out\nmax_steps: 7\nlearning_rate: 0.01\n")
    _, _, training_args = parse_stage_arguments("sft", ["--config", str(config), "--max_steps", "9"])
    assert (training_args.max_steps, training_args.learning_rate) == (9, 0.01)
    config.write_text("output_dir: out\nmax_stepz: 7\n")
    with pytest.raises(ValueError, match="max_stepz"):
        parse_stage_arguments("sft", ["--config", str(config)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(stage: str, output_dir, *extra: str, processes: int = 2, timeout: int = 300) -> dict:
    """`accelerate launch` with the shipped 2-process CPU topology."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        str(free_port()),
        "-m",
        "plugformer",
        "train",
        stage,
        *override_flags(["--output_dir", str(output_dir), *TINY], list(extra)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((Path(output_dir) / "run_info.json").read_text())


# slow (~30 s a stage): tests/test_fused_loss_distributed.py's default case launches pretrain on 2 processes and
# checks the same (world size 2, one digest on both ranks) and more
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in ("pretrain", "sft")])
def test_two_cpu_processes_train_one_model(chain, stage, tmp_path):
    extra = PRETRAIN if stage == "pretrain" else [*TRL, "--model_name_or_path", str(chain["pretrain"])]
    info = launch(stage, tmp_path, *extra)
    assert info["world_size"] == 2
    first, second = info["parameter_digests"]
    assert first == second  # DDP kept the ranks in step
    parent = chain["pretrain"] if stage == "sft" else None
    if parent is not None:
        assert_trained(parent, tmp_path)


@pytest.mark.slow  # ~75 s; tests/test_checkpoints.py kills runs at random moments in the default suite
def test_a_killed_run_resumes_to_the_same_weights(tmp_path):
    """SIGKILL after a checkpoint, resume from it: the final weights equal an uninterrupted run's, bit for bit."""
    flags = override_flags(
        TINY,
        PRETRAIN,
        [
            "--max_steps",
            "120",
            "--save_strategy",
            "steps",
            "--save_steps",
            "10",
            "--eval_strategy",
            "no",
            "--dev_examples",
            "0",
            "--exact_match_examples",
            "0",
        ],
    )
    run_stage("pretrain", ["--output_dir", str(tmp_path / "whole"), *flags])

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "plugformer", "train", "pretrain", "--output_dir", str(killed), *flags]
    # the same thread count as the runs in this process: another one sums matmuls in another order, and the
    # weights then differ in the last bits (seen with OMP_NUM_THREADS=2 here against 1 in the child)
    threads = str(torch.get_num_threads())
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": threads},
    )
    deadline = time.time() + 240
    while not (killed / "checkpoint-20" / "trainer_state.json").exists():
        assert process.poll() is None and time.time() < deadline, "the run ended before checkpoint 20"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "run_info.json").exists()
    # the newest checkpoint may be half written by the kill; checkpoint 20 is complete
    run_stage(
        "pretrain", ["--output_dir", str(killed), *flags, "--resume_from_checkpoint", str(killed / "checkpoint-20")]
    )
    whole, resumed = weights(tmp_path / "whole"), weights(killed)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


# In this process by default: the shipped `jobs: 2` starts a process per stage and per test split (about 16, most of
# their time importing); tests/test_pipeline_jobs.py checks that side by side trains what in order trains.
@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pipeline_chains_every_stage_from_the_shipped_configs(tmp_path, capsys, jobs):
    """The README's pipeline on the shipped tiny YAMLs, cut to a few steps; a re-run reuses finished stages."""
    from plugformer.experiments.pipeline import main as pipeline_main

    argv = [
        "--config",
        str(ROOT / "configs/pipeline/tiny.yaml"),
        "--output_dir",
        str(tmp_path / "out"),
        "--stage_configs",
        micro_stage_configs(tmp_path),
        "--test_examples",
        "6",
        "--max_new_tokens",
        "6",
        "--jobs",
        str(jobs),
    ]
    results = pipeline_main(argv)
    assert list(results) == ["pretrain", "sft", "reward", "dpo", "rlhf", "grpo"]
    assert all(results[s]["examples"] == 6 for s in results if s != "reward")
    assert 0.0 <= results["reward"]["pairwise_accuracy"] <= 1.0
    assert 0.0 <= results["dpo"]["implicit_reward_pairwise_accuracy"] <= 1.0  # the reward rlhf_reward: dpo names
    table = (tmp_path / "out/results.md").read_text()
    assert sum(line.startswith("|") for line in table.splitlines()) == 2 + 6  # header, rule, a row per stage
    # the pretrained model's row: through the chat template, and as its corpus asks
    asked = f"{results['pretrain']['pretraining_format']['exact_match']:.1%} asked as in pretraining"
    assert [s for s in results if "pretraining_format" in results[s]] == ["pretrain"]
    assert next(line for line in table.splitlines() if line.startswith("| pretrain |")).count(asked) == 1
    assert "pipeline('text-generation'" in capsys.readouterr().out
    # parents are the right directories: the tiny pipeline rewards rlhf with the dpo stage's implicit reward
    assert json.loads((tmp_path / "out/rlhf/run_info.json").read_text())["reward_model"] == str(tmp_path / "out/dpo")
    dpo = json.loads((tmp_path / "out/dpo/run_info.json").read_text())
    assert dpo["reference"] == str(tmp_path / "out/sft") and dpo["beta"] == 0.1
    capsys.readouterr()
    pipeline_main([*argv, "--stages", "pretrain", "sft"])
    assert capsys.readouterr().out.count("reusing") == 2


def test_embedded_splits_never_share_a_fact_and_are_deterministic():
    from plugformer.data.sources import generate_problems, load_stage_dataset

    facts = {
        split: {(p.operation, p.a, p.b) for p in generate_problems(3000, split)} for split in ("train", "dev", "test")
    }
    assert not facts["train"] & facts["dev"] and not facts["train"] & facts["test"] and not facts["dev"] & facts["test"]
    assert generate_problems(50, "test", seed=3) == generate_problems(50, "test", seed=3)
    data = load_stage_dataset("preference", sizes={"train": 20, "dev": 5, "test": 5})
    assert {name: len(split) for name, split in data.items()} == {"train": 20, "dev": 5, "test": 5}
    row = data["train"][0]
    assert row["chosen"][0]["content"] != row["rejected"][0]["content"]
    question = row["prompt"][0]["content"]
    assert any(p.question == question for p in generate_problems(20, "train"))


def test_sft_on_local_json_files_with_carved_splits(chain, tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"{i} + 1 = {i + 1}\n#### {i + 1}"},
            ]
        }
        for i in range(40)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    info = train(
        "sft",
        tmp_path / "out",
        "--model_name_or_path",
        str(chain["pretrain"]),
        "--dataset_name",
        "json",
        "--data_files",
        str(path),
        "--dev_examples",
        "4",
        "--test_examples",
        "4",
    )
    assert info["dev_exact_match"] is None  # no `answer` column: nothing to score, no error
    assert_trained(chain["pretrain"], tmp_path / "out")
    with pytest.raises(ValueError, match=r"lacks the columns \['chosen', 'rejected'\]"):
        train(
            "dpo",
            tmp_path / "dpo",
            "--model_name_or_path",
            str(chain["sft"]),
            "--dataset_name",
            "json",
            "--data_files",
            str(path),
        )


@pytest.mark.parametrize(
    ("completion", "answer", "correct", "formatted"),
    [
        ("12 + 7 = 19\n#### 19", "19", 1.0, 1.0),
        ("12 + 7 = 19\n####19", "19", 1.0, 1.0),  # no space after the marker
        ("12 + 7 = 19\n####   19  ", "19", 1.0, 1.0),  # trailing spaces
        ("3 - 10 = -7\n#### -7", "-7", 1.0, 1.0),
        ("3 - 10 = -7\n#### − 7", "-7", 1.0, 0.0),  # unicode minus and a gap: right number, off format
        ("3 - 10 = -7\n#### 7", "-7", 0.0, 1.0),  # the sign matters
        ("12 + 7 = 19\n#### 19 apples", "19", 1.0, 0.0),  # trailing text: still the answer, not the format
        ("12 + 7 = 19\n#### 19\n#### 20", "19", 0.0, 0.0),  # the last marked answer counts
        ("#### 1,000", "1000", 1.0, 0.0),
        ("#### 19.0", "19", 1.0, 0.0),
        ("12 + 7 is nineteen", "19", 0.0, 0.0),
        ("the total is 19", "19", 1.0, 0.0),  # no marker: the last number
        ("", "19", 0.0, 0.0),
        ("12 + 7 = 190\n#### 190", "19", 0.0, 1.0),  # a prefix match is not a match
    ],
)
def test_verifiable_rewards_on_tricky_answers(completion, answer, correct, formatted):
    conversational = [{"role": "assistant", "content": completion}]
    for form in (completion, conversational):
        assert reward_module.exact_match_reward([form], answer=[answer]) == [correct]
        assert reward_module.format_reward([form]) == [formatted]


def test_pretrain_an_encoder_as_a_masked_lm(tmp_path):
    from transformers import AutoModelForMaskedLM

    info = train("pretrain", tmp_path, "--is_causal", "false", "--position_scheme", "t5_bias")
    model = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(model).__name__ == "PlugformerForMaskedLM" and model.config.is_causal is False
    assert info["dev_exact_match"] is None and info["metrics"]["eval_loss"] > 0  # masked-token loss on dev


def test_resume_from_checkpoint_last_finds_the_newest(tmp_path):
    from types import SimpleNamespace

    from plugformer.training.checkpoints import publish
    from plugformer.training.common import resume_checkpoint

    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint="last")
    assert resume_checkpoint(args) is None  # nothing yet: a fresh start, with a warning
    for step in (5, 10):  # published as plugformer publishes (with a manifest): `last` takes no other
        (tmp_path / "staged").mkdir()
        (tmp_path / "staged" / "trainer_state.json").write_text("{}")
        publish(tmp_path / "staged", tmp_path / f"checkpoint-{step}")
    assert resume_checkpoint(args) == str(tmp_path / "checkpoint-10")
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-5")
    assert resume_checkpoint(args) == str(tmp_path / "checkpoint-5")


def test_each_stage_writes_a_model_card_that_huggingface_hub_parses(chain):
    from huggingface_hub import ModelCard
    from scipy.stats import binomtest

    from plugformer.evaluation.stats import wilson_interval

    card = ModelCard.load(chain["sft"] / "README.md")
    info = json.loads((chain["sft"] / "run_info.json").read_text())
    metrics = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert metrics["exact_match"] == round(info["dev_exact_match"]["exact_match"], 4)
    assert metrics["perplexity"] == pytest.approx(info["metrics"]["eval_perplexity"], rel=1e-3)
    assert {"plugformer", "sft", "attention_score:scaled_dot", "position_scheme:rope"} <= set(card.data.tags)
    assert f"started from `{chain['pretrain']}`" in card.text and "trust_remote_code=True" in card.text
    reward_card = ModelCard.load(chain["reward"] / "README.md")
    assert "AutoModelForSequenceClassification" in reward_card.text
    for successes, trials in [(0, 10), (3, 10), (20, 100), (57, 300), (300, 300)]:
        expected = binomtest(successes, trials).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(successes, trials) == pytest.approx((expected.low, expected.high), abs=1e-12)


@pytest.mark.parametrize("stage", ["dpo", "grpo", "rlhf"])
def test_lora_in_the_preference_and_rl_stages(chain, stage, tmp_path, length_reward):
    extra = {"grpo": ["--reward_functions", "length"], "rlhf": ["--reward_model_path", str(chain["reward"])]}
    train(
        stage,
        tmp_path,
        "--model_name_or_path",
        str(chain["sft"]),
        "--use_peft",
        "true",
        "--lora_r",
        "4",
        *extra.get(stage, []),
    )
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert_trained(chain["sft"], tmp_path, prefix="model.layers.0.self_attn.q_proj")  # merged LoRA moved q_proj


def test_eval_scores_a_stage_directory_with_offline_metrics(chain, tmp_path):
    from plugformer.data.sources import load_stage_dataset
    from plugformer.evaluation.metrics import load_metric
    from plugformer.evaluation.scoring import main as eval_main

    output = tmp_path / "eval.json"
    results = eval_main(
        [
            "--model",
            str(chain["sft"]),
            "--split",
            "dev",
            "--examples",
            "6",
            "--max_new_tokens",
            "6",
            "--output",
            str(output),
        ]
    )
    assert json.loads(output.read_text())["examples"] == 6
    low, high = results["exact_match_ci95"]
    assert low <= results["exact_match"] <= high
    # perplexity: exp of the token-weighted mean of each document's own loss, computed one document at a time
    model = AutoModelForCausalLM.from_pretrained(chain["sft"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(chain["sft"])
    total, count = 0.0, 0
    for text in load_stage_dataset("text", sizes={"dev": 6})["dev"]["text"]:
        ids = tokenizer(tokenizer.bos_token + text + tokenizer.eos_token, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            loss = model(**ids, labels=ids["input_ids"]).loss.item()
        total, count = total + loss * (ids["input_ids"].shape[1] - 1), count + ids["input_ids"].shape[1] - 1
    assert results["perplexity"] == pytest.approx(2.718281828459045 ** (total / count), rel=1e-4)
    output = tmp_path / "reward_eval.json"  # another model's results never replace the sft model's
    reward = eval_main(["--model", str(chain["reward"]), "--split", "dev", "--examples", "6", "--output", str(output)])
    assert 0.0 <= reward["pairwise_accuracy"] <= 1.0 and reward["examples"] == 6
    # the pairs are drawn as the reward model's own training pairs were (recorded in run_info.json), unless told
    trained = json.loads((chain["reward"] / "run_info.json").read_text())["data"]
    assert trained == {"dataset_seed": 0, "direct_answer_fraction": 0.0} and reward["direct_answer_fraction"] == 0.0
    bare = eval_main(
        [
            "--model",
            str(chain["reward"]),
            "--split",
            "dev",
            "--examples",
            "6",
            "--output",
            str(output),
            "--direct_answer_fraction",
            "1.0",
        ]
    )
    from plugformer.evaluation.language_scores import preference_accuracy

    rows = load_stage_dataset("preference", sizes={"dev": 6}, direct_fraction=1.0)["dev"]
    assert all("\n" not in row["rejected"][0]["content"] for row in rows)
    scorer = AutoModelForSequenceClassification.from_pretrained(chain["reward"])
    assert bare["pairwise_accuracy"] == preference_accuracy(scorer, tokenizer, rows)
    # the metrics are local evaluate modules: they load and compute without network
    assert (
        load_metric("numeric_exact_match").compute(predictions=["#### −7", "7"], references=["-7", "8"])["exact_match"]
        == 0.5
    )
    with pytest.raises(ValueError, match="offline metrics"):
        load_metric("bleu")


def test_eval_asks_a_pretrained_model_as_its_corpus_asks_as_well(chain, tmp_path):
    """A model trained on text alone has never seen the chat template: its run records so, and eval adds its exact
    match when asked as the corpus asks (`Question: ...` / `Answer:`); a chat model is asked through the template only."""
    from plugformer.evaluation.scoring import main as eval_main

    formats = {stage: json.loads((chain[stage] / "run_info.json").read_text())["data_format"] for stage in chain}
    assert formats == {"pretrain": "text", "sft": "conversation", "reward": "preference"}
    base = eval_main(
        [
            "--model",
            str(chain["pretrain"]),
            "--split",
            "dev",
            "--examples",
            "4",
            "--max_new_tokens",
            "6",
            "--output",
            str(tmp_path / "base.json"),
        ]
    )
    assert len(base["pretraining_format_correct"]) == 4 and len(base["correct"]) == 4
    assert base["pretraining_format"]["exact_match"] == sum(base["pretraining_format_correct"]) / 4
    asked = base["pretraining_format_samples"][0]["prompt"]
    assert asked.startswith("<|bos|>Question: ") and asked.endswith("\nAnswer:") and "<|im_start|>" not in asked
    chat = eval_main(
        [
            "--model",
            str(chain["sft"]),
            "--split",
            "dev",
            "--examples",
            "4",
            "--max_new_tokens",
            "6",
            "--output",
            str(tmp_path / "chat.json"),
        ]
    )
    assert "pretraining_format" not in chat and "<|im_start|>" in chat["samples"][0]["prompt"]
    # the pretrain stage's own dev score (its card's) is asked the same way: eval on the same 4 dev problems with the
    # run's generation budget (8 tokens) gives the same answers
    dev = json.loads((chain["pretrain"] / "run_info.json").read_text())["dev_exact_match"]
    again = eval_main(
        [
            "--model",
            str(chain["pretrain"]),
            "--split",
            "dev",
            "--examples",
            "4",
            "--max_new_tokens",
            "8",
            "--output",
            str(tmp_path / "again.json"),
        ]
    )
    assert dev["prompt"] == "Question: {question}\nAnswer:" and dev["correct"] == again["pretraining_format_correct"]
    assert dev["samples"] == again["pretraining_format_samples"]
    card = (chain["pretrain"] / "README.md").read_text()
    assert (
        "greedy exact match on 4 dev problems asked as its corpus writes them (`'Question: {question}\\nAnswer:'`)"
        in card
    )
    assert "asked as its corpus" not in (chain["sft"] / "README.md").read_text()


def test_eval_gives_each_answer_the_budget_its_run_scored_dev_with(chain, tmp_path):
    """Without --max_new_tokens, eval generates as many tokens as the run's own dev exact match did (its
    run_info.json: 8 here), so a budget shorter than the longest worked answer cannot lower the held-out score behind
    the user's back; given, it wins; a folder without the record gets 32."""
    from plugformer.evaluation.scoring import EvalArguments, with_generation_budget
    from plugformer.evaluation.scoring import main as eval_main

    assert json.loads((chain["sft"] / "run_info.json").read_text())["max_new_tokens"] == 8
    recorded = eval_main(["--model", str(chain["sft"]), "--examples", "2", "--output", str(tmp_path / "a.json")])
    given = eval_main(
        ["--model", str(chain["sft"]), "--examples", "2", "--max_new_tokens", "3", "--output", str(tmp_path / "b.json")]
    )
    assert (recorded["max_new_tokens"], given["max_new_tokens"]) == (8, 3)
    tokenizer = AutoTokenizer.from_pretrained(chain["sft"])
    lengths = {
        name: [len(tokenizer(s["completion"])["input_ids"]) for s in result["samples"]]
        for name, result in (("recorded", recorded), ("given", given))
    }
    # the generation itself obeys the budget: the untrained model runs to it (no end of turn in 8 tokens)
    assert max(lengths["given"]) <= 3 < max(lengths["recorded"]) <= 8, lengths
    assert recorded["key"]["options"]["max_new_tokens"] == 8
    assert with_generation_budget(EvalArguments(model=str(tmp_path))).max_new_tokens == 32


def test_a_question_answer_chat_template_chosen_at_pretraining_reaches_sft(tmp_path):
    """`--chat_template question_answer` at pretraining: the tokenizer every later stage loads writes a conversation
    as the corpus writes a problem, SFT trains through it (TRL's assistant-only mask needs its generation tags) and
    asks its dev problems with it; an unknown template is refused before training, naming the choices."""
    from plugformer.data.tokenization import QUESTION_ANSWER_TEMPLATE

    train("pretrain", tmp_path / "pretrain", "--chat_template", "question_answer")
    info = train("sft", tmp_path / "sft", "--model_name_or_path", str(tmp_path / "pretrain"))
    assert AutoTokenizer.from_pretrained(tmp_path / "sft").chat_template == QUESTION_ANSWER_TEMPLATE
    asked = info["dev_exact_match"]["samples"][0]["prompt"]
    assert asked.startswith("<|bos|>Question: ") and asked.endswith("\nAnswer:")
    with pytest.raises(ValueError, match=r"--chat_template 'alpaca': expected one of chatml \| question_answer"):
        train("pretrain", tmp_path / "refused", "--chat_template", "alpaca")
    assert not (tmp_path / "refused").exists()


def test_model_card_names_the_training_examples_and_the_share_of_bare_answers(chain):
    """A stage's card says how many embedded examples it trained on (600 demonstrations is another model than 32,000),
    and whether they skip the working; the all-worked data does not mention it."""
    from types import SimpleNamespace

    from plugformer.training.arguments import StageArguments
    from plugformer.training.cards import stage_card

    model = AutoModelForCausalLM.from_pretrained(chain["sft"])
    info = json.loads((chain["sft"] / "run_info.json").read_text())

    def data_line(**fields) -> str:
        card = stage_card(
            model,
            info,
            SimpleNamespace(),
            StageArguments(**fields),
            parent="p",
            model_path="x/sft",
            card=STAGES["sft"].card,
        )
        return next(line for line in str(card).splitlines() if line.startswith("- data:"))

    assert "direct_answer_fraction 0.6: that share of the answers" in data_line(direct_answer_fraction=0.6)
    assert "direct_answer_fraction" not in data_line()
    assert data_line(train_examples=32000).endswith("split by arithmetic fact; 32,000 training examples)")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def test_eval_scores_a_model_trained_on_your_data_on_the_split_its_run_held_out(chain, tmp_path, monkeypatch, capsys):
    from plugformer.data.sources import load_stage_dataset
    from plugformer.evaluation.held_out import rows_digest
    from plugformer.evaluation.scoring import main as eval_main

    conversations = [
        {
            "prompt": [{"role": "user", "content": f"Repeat {i}"}],
            "completion": [{"role": "assistant", "content": f"{i} {i}"}],
        }
        for i in range(30)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", conversations)
    monkeypatch.chdir(tmp_path)  # a relative path is recorded absolute: eval finds it from any folder
    (tmp_path / "json").mkdir()  # a builder's name stays a name beside a folder of that name, as load_dataset reads it
    train(
        "sft",
        tmp_path / "sft",
        "--model_name_or_path",
        str(chain["pretrain"]),
        "--dataset_name",
        "json",
        "--data_files",
        "chat.jsonl",
        "--dev_examples",
        "3",
        "--test_examples",
        "5",
    )
    record = json.loads((tmp_path / "sft/run_info.json").read_text())["data"]
    assert record["dataset_name"] == "json" and record["data_files"] == [str(data)]
    assert (record["dev_examples"], record["test_examples"]) == (3, 5)
    card = (tmp_path / "sft/README.md").read_text()  # its model-index names your data, not the embedded task
    assert "type: json" in card and "name: chat.jsonl" in card and "arithmetic" not in card
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    results = eval_main(["--model", str(tmp_path / "sft")])  # no data flags: the run's own source and carving
    held_out = load_stage_dataset("conversation", "json", data_files=[str(data)], sizes={"dev": 3, "test": 5})
    assert results["examples"] == 5 and results["data_sha256"] == rows_digest(held_out["test"])
    assert "exact_match" not in results  # no `answer` column: the embedded task's scores are never reported
    shown = capsys.readouterr().out  # the per-example scores go to the file, not the terminal
    assert "completion_perplexity" in shown and "completion_losses" not in shown
    assert len(json.loads((tmp_path / "sft/eval_test.json").read_text())["completion_losses"]) == 5
    # the completion's loss as transformers computes it, prompt tokens masked
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    total, count = 0.0, 0
    for row in held_out["test"]:
        head = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        ids = torch.tensor([tokenizer(whole, add_special_tokens=False)["input_ids"]])
        labels = ids.clone()
        labels[0, : len(tokenizer(head, add_special_tokens=False)["input_ids"])] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss.item()
        predicted = int((labels[0, 1:] != -100).sum())
        total, count = total + loss * predicted, count + predicted
    assert sum(results["completion_tokens"]) == count
    assert results["completion_perplexity"] == pytest.approx(2.718281828459045 ** (total / count), rel=1e-4)


def test_eval_on_your_preference_pairs_and_what_it_refuses(chain, tmp_path):
    from plugformer.data.sources import load_stage_dataset
    from plugformer.evaluation.language_scores import preference_accuracy
    from plugformer.evaluation.scoring import main as eval_main

    pairs = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(24)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    flags = ["--dataset_name", "json", "--data_files", str(data), "--dev_examples", "4", "--test_examples", "6"]
    reward = eval_main(["--model", str(chain["reward"]), "--output", str(tmp_path / "r.json"), *flags])
    rows = load_stage_dataset("preference", "json", data_files=[str(data)], sizes={"dev": 4, "test": 6})["test"]
    scorer = AutoModelForSequenceClassification.from_pretrained(chain["reward"])
    tokenizer = AutoTokenizer.from_pretrained(chain["reward"])
    assert reward["examples"] == 6 and reward["pairwise_accuracy"] == preference_accuracy(scorer, tokenizer, rows)
    with pytest.raises(ValueError, match=r"nothing to score: it needs text"):  # an sft model, pairs, no DPO record
        eval_main(["--model", str(chain["sft"]), "--output", str(tmp_path / "s.json"), *flags])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": f"document {i}"} for i in range(12)])
    with pytest.raises(ValueError, match=r"reward model is scored on preference pairs"):
        eval_main(
            [
                "--model",
                str(chain["reward"]),
                "--output",
                str(tmp_path / "r.json"),
                "--dataset_name",
                "json",
                "--data_files",
                str(text),
                "--dev_examples",
                "2",
                "--test_examples",
                "2",
            ]
        )
    with pytest.raises(ValueError, match=r"--split train: your own data is scored on what training held out"):
        eval_main(["--model", str(chain["reward"]), "--split", "train", "--output", str(tmp_path / "r.json"), *flags])
    # no ground truth: dpo selects by its implicit reward's pairwise accuracy (tests/test_selection_signals.py)
    info = train("dpo", tmp_path / "dpo", "--model_name_or_path", str(chain["sft"]), "--selection_steps", "2", *flags)
    assert info["selection"]["signal"] == "dev_implicit_reward_accuracy"


def test_a_streamed_corpus_holds_out_its_first_documents(tmp_path):
    from plugformer.evaluation.held_out import held_out_rows

    data = write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"document {i}"} for i in range(20)])
    source = {
        "dataset_name": "json",
        "dataset_config": None,
        "data_files": [str(data)],
        "dataset_seed": 0,
        "dev_examples": 3,
        "test_examples": 4,
        "streaming": True,
    }
    assert held_out_rows(source, "dev", 10)["text"] == [f"document {i}" for i in range(3)]
    assert held_out_rows(source, "test", 2)["text"] == ["document 3", "document 4"]


def test_your_columns_renamed_for_training_eval_and_a_stream(tmp_path):
    """--rename_columns: a corpus whose text is in `content` pretrains (loaded, and streamed), its run records the
    renaming, and eval scores the documents the run held out under it; bad renamings name what is wrong."""
    from plugformer.data.sources import load_stage_dataset
    from plugformer.data.user_data import column_renames
    from plugformer.evaluation.held_out import held_out_rows, recorded_source
    from plugformer.evaluation.scoring import main as eval_main

    rows = [{"content": f"{i} plus {i + 1} is {2 * i + 1}.", "id": i} for i in range(60)]
    data = write_jsonl(tmp_path / "corpus.jsonl", rows)
    flags = [
        "--dataset_name",
        "json",
        "--data_files",
        str(data),
        "--rename_columns",
        "content=text",
        "--dev_examples",
        "5",
        "--test_examples",
        "6",
        "--exact_match_examples",
        "0",
    ]
    info = train("pretrain", tmp_path / "lm", *PRETRAIN, *flags, "--data_cache_dir", str(tmp_path / "cache"))
    assert info["data"]["rename_columns"] == "content=text"
    held = held_out_rows(recorded_source(str(tmp_path / "lm")), "test", 100)
    expected = load_stage_dataset(
        "text", "json", data_files=[str(data)], sizes={"dev": 5, "test": 6}, rename_columns="content=text"
    )["test"]
    assert held["text"] == expected["text"] and len(held) == 6 and set(held["text"]) <= {r["content"] for r in rows}
    assert eval_main(["--model", str(tmp_path / "lm")])["examples"] == 6
    streamed = train("pretrain", tmp_path / "stream", *PRETRAIN, *flags, "--streaming", "true")
    source = recorded_source(str(tmp_path / "stream"))
    assert streamed["data"]["streaming"] and held_out_rows(source, "dev", 10)["text"] == [
        r["content"] for r in rows[:5]
    ]
    with pytest.raises(ValueError, match=r"has no column 'body'; its columns: \['content', 'id'\]"):
        train("pretrain", tmp_path / "bad", *PRETRAIN, *override_flags(flags, ["--rename_columns", "body=text"]))
    with pytest.raises(ValueError, match=r"--rename_columns 'a=text' renames your data's columns; the embedded"):
        train("pretrain", tmp_path / "embedded", "--rename_columns", "a=text")
    with pytest.raises(ValueError, match=r"\['id'\] would name two columns"):
        column_renames("content=id", ["content", "id"])
    with pytest.raises(ValueError, match=r"expected comma-separated OLD=NEW pairs, got 'content'"):
        column_renames("content", ["content"])


def test_eval_scores_a_masked_lm_on_seeded_masked_tokens_of_held_out_text(tmp_path):
    from transformers import AutoModelForMaskedLM

    from plugformer.data.sources import load_stage_dataset
    from plugformer.evaluation.masked import masked_documents
    from plugformer.evaluation.scoring import main as eval_main

    train("pretrain", tmp_path / "mlm", "--is_causal", "false")
    results = eval_main(["--model", str(tmp_path / "mlm"), "--split", "dev", "--examples", "6"])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "mlm")
    texts = load_stage_dataset("text", sizes={"dev": 6})["dev"]["text"]
    documents = masked_documents(tokenizer, texts, 0.15, 0, 128)
    for (masked, labels), text in zip(documents, texts, strict=True):
        ids = tokenizer(tokenizer.bos_token + text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        drawn = (labels != -100).nonzero().flatten().tolist()
        assert len(drawn) == max(1, round(0.15 * (len(ids) - 2))) and 0 not in drawn and len(ids) - 1 not in drawn
        assert masked[drawn].eq(tokenizer.mask_token_id).all() and labels[drawn].tolist() == [ids[i] for i in drawn]
    # the masked tokens' loss as transformers' masked-LM head computes it, one document at a time
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm")
    total, count = 0.0, 0
    for masked, labels in documents:
        with torch.no_grad():
            loss = model(input_ids=masked[None], labels=labels[None]).loss.item()
        total, count = total + loss * int((labels != -100).sum()), count + int((labels != -100).sum())
    assert results["masked_tokens"] == count and results["examples"] == 6
    assert results["masked_token_perplexity"] == pytest.approx(2.718281828459045 ** (total / count), rel=1e-4)
    other = masked_documents(tokenizer, texts, 0.15, 1, 128)  # another seed draws other positions
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(documents, other, strict=True))
