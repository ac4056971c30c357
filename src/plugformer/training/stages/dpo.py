"""Direct preference optimisation with TRL's `DPOTrainer` (Rafailov et al. 2023) on preference pairs; the
reference model is the starting (SFT) model, rebuilt by TRL from its directory or, with LoRA, the adapter-free
base."""

from __future__ import annotations

import os
from pathlib import Path

from ..arguments import PolicyArguments
from ..cards import StageCard
from ..stage_table import Stage, register_stage


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    from ..common import run_trainer

    # the reference and beta make the saved policy a reward model too (`implicit_reward`, the rlhf stage's
    # --reward_model_path); with LoRA the reference is the adapter-free base, the same directory. Recorded by absolute
    # path beside its weights' sha256: a relative path was read against the consumer's working folder. Dev selection
    # picks the policy handed on; the last step is kept as the reward (`keep_last_step`)
    implicit = {**reference_record(model_args.model_name_or_path), "beta": training_args.beta}
    return run_trainer(
        STAGE,
        DPOTrainer,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        extra=implicit,
        keep_last_step=True,
        selection_signal=implicit_reward_signal(model_args, training_args),
    )


def implicit_reward_signal(model_args, training_args):
    """DPO's dev signal on pairs without a verifiable answer: `(script_args, tokenizer, dev rows) ->` the implicit
    reward's pairwise accuracy against the reference this stage trains against (`ImplicitRewardAccuracy`)."""

    def signal(script_args, tokenizer, rows):
        from ..selection_signals import ImplicitRewardAccuracy

        return ImplicitRewardAccuracy(
            rows, tokenizer, model_args.model_name_or_path, training_args.beta, max_length=training_args.max_length
        )

    return signal


def reference_record(reference: str) -> dict:
    """`{"reference": its absolute path, "reference_weights_sha256": ...}` for a local model folder (a Hub id is
    kept as given, with no digest)."""
    from ...runtime.files import weights_sha256

    if not Path(reference).is_dir():
        return {"reference": reference, "reference_weights_sha256": None}
    return {"reference": os.path.abspath(reference), "reference_weights_sha256": weights_sha256(reference)}


STAGE = register_stage(
    Stage(
        name="dpo",
        parent="sft",
        script_arguments=PolicyArguments,
        config_class="DPOConfig",
        description="direct preference optimisation (TRL DPOTrainer)",
        data_format="preference",
        data_parallel=True,
        card=StageCard("aligned offline on preference pairs (DPO)", "trl.DPOTrainer"),
        train=train,
    )
)
