"""The compute-matched SFT baseline: what RL is measured against is SFT on the best data for the same compute.

From the parent (by default the pretrained model), TRL's `SFTTrainer` on the embedded all-worked demonstrations
(`--direct_answer_fraction 0`) for as many tokens as the stage named by `--match_compute_of` (the pipeline's
`matched_stage`, by default grpo) and every stage it descends from, down to this run's parent, processed: with the
pipeline's defaults, sft + grpo.

The rule (stated in the pipeline's table): a stage processed the tokens it trained on plus the tokens it sampled,
as its `run_info.json` `compute` records them (TRL's counts: prompt and completion tokens, padding excluded). A
sampled token costs one forward pass, about a third of a trained token's forward and backward; counting it as a
trained token gives the baseline the larger budget, never a smaller one than the compute RL used (a reward model's
forward passes, rlhf's, are not counted). The steps are
ceil(budget / (effective batch x mean tokens of a training example, as `SFTTrainer` tokenized them)); they replace
`--max_steps`, and `run_info.json` records the budget, the chain it came from and the tokens actually trained on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..arguments import refuse_liger_kernel
from ..cards import StageCard
from ..stage_table import Stage, StageInput, register_stage
from .sft import SFTArguments


@dataclass
class MatchedSFTArguments(SFTArguments):
    """SFT whose optimizer steps are set by the compute another stage's chain used (`training/stages/sft_matched.py`)."""

    match_compute_of: str | None = field(
        default=None,
        metadata={
            "help": "output directory of the stage whose compute this run matches (e.g. grpo): the tokens "
            "trained on and sampled by it and by each stage it descends from down to this run's parent "
            "(run_info.json's compute records) set --max_steps"
        },
    )


def compute_chain(matched: str, parent: str) -> list[dict]:
    """The `compute` records of the stage in `matched` and of each stage it descends from (their recorded
    `parent`), down to and excluding the folder `parent`; each with its `stage` and `folder`."""
    chain, folder, stop = [], Path(matched).resolve(), Path(parent).resolve()
    while folder != stop:
        info_path = folder / "run_info.json"
        if not info_path.is_file():
            raise ValueError(
                f"--match_compute_of {matched}: {folder} holds no run_info.json; give a finished stage's "
                "output directory"
            )
        info = json.loads(info_path.read_text())
        compute = info.get("compute") or {}
        if (compute and compute.get("parent") is None) or len(chain) > 64:
            raise ValueError(
                f"--match_compute_of {matched}: its chain of parents ends at {folder} without reaching "
                f"this run's parent {stop}; match a stage that descends from it"
            )
        if compute.get("train_tokens") is None:
            raise ValueError(
                f"--match_compute_of {matched}: {info_path} records no token count (its 'compute'); "
                "retrain that stage with this version of plugformer"
            )
        chain.append({"stage": info.get("stage"), "folder": str(folder), **compute})
        folder = Path(compute["parent"]).resolve()
    if not chain:
        raise ValueError(f"--match_compute_of {matched} is this run's parent: there is no compute to match")
    return chain


def token_budget(chain: list[dict]) -> int:
    """Tokens processed by the stages of `chain`: trained on plus sampled (a sampled token counted as a trained one)."""
    return sum(int(record["train_tokens"]) + int(record.get("sampling_tokens") or 0) for record in chain)


def matched_steps(budget: int, tokens_per_example: float, effective_batch: int) -> int:
    """The optimizer steps whose batches hold `budget` tokens: ceil(budget / (batch x tokens per example)), >= 1.

    >>> matched_steps(1000, 12.5, 8)  # 100 tokens a step
    10
    >>> matched_steps(1001, 12.5, 8)
    11
    """
    if tokens_per_example <= 0 or effective_batch < 1:
        raise ValueError(f"tokens_per_example={tokens_per_example}, effective_batch={effective_batch}: expected > 0")
    return max(1, math.ceil(budget / (effective_batch * tokens_per_example)))


def match_steps(script_args, model_args):
    """`run_trainer`'s `prepare`: sets the trainer's `max_steps` from the matched chain's budget; returns the record."""

    def prepare(trainer) -> dict:
        chain = compute_chain(script_args.match_compute_of, model_args.model_name_or_path)
        budget = token_budget(chain)
        lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]  # as SFTTrainer tokenized (and truncated)
        per_example = sum(lengths) / len(lengths)
        batch = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
        batch *= trainer.accelerator.num_processes
        trainer.args.max_steps = matched_steps(budget, per_example, batch)
        chain_text = " + ".join(record["stage"] for record in reversed(chain))
        print(
            f"[sft_matched] {budget} tokens processed by {chain_text}: {trainer.args.max_steps} steps of {batch} "
            f"examples (~{per_example:.1f} tokens each)",
            flush=True,
        )
        chained = [
            {key: r.get(key) for key in ("stage", "folder", "steps", "train_tokens", "sampling_tokens")} for r in chain
        ]
        return {
            "matched_compute": {
                "stages": chained,
                "token_budget": budget,
                "tokens_per_example": per_example,
                "steps": trainer.args.max_steps,
            }
        }

    return prepare


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from ..common import require_model_path, run_trainer
    from .sft import completion_likelihood_signal, unfused_trainer

    refuse_liger_kernel(training_args)
    if not script_args.match_compute_of:
        raise ValueError(
            "stage 'sft_matched' needs --match_compute_of: the output directory of the stage whose "
            "compute it matches (plugformer pipeline: matched_stage)"
        )
    if training_args.max_steps != -1:
        raise ValueError(
            f"--max_steps {training_args.max_steps}: stage 'sft_matched' computes its steps from the "
            "compute of --match_compute_of; drop --max_steps (plugformer train sft instead trains a "
            "chosen number of steps)"
        )
    compute_chain(script_args.match_compute_of, require_model_path(model_args, "sft_matched"))  # before any work
    trainer_class = SFTTrainer if script_args.fused_loss else unfused_trainer(SFTTrainer)
    return run_trainer(
        STAGE,
        trainer_class,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        prepare=match_steps(script_args, model_args),
        selection_signal=completion_likelihood_signal(training_args),
    )


# the stage whose compute (with its ancestors' down to this stage's parent) sets the steps
MATCHED = StageInput(
    flag="--match_compute_of", option="matched_stage", sources=("grpo", "rlhf", "dpo", "rft"), default="grpo"
)

STAGE = register_stage(
    Stage(
        name="sft_matched",
        parent="pretrain",
        script_arguments=MatchedSFTArguments,
        config_class="SFTConfig",
        description="SFT on all-worked demonstrations for the compute of a chain of stages (a baseline for RL)",
        data_format="conversation",
        data_parallel=True,
        card=StageCard("fine-tuned on worked demonstrations for the compute of the RL stage's chain", "trl.SFTTrainer"),
        language_model_loss=True,
        inputs=(MATCHED,),
        baseline=True,
        train=train,
    )
)
