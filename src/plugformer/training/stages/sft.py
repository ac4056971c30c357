"""Supervised fine-tuning with TRL's `SFTTrainer`: conversations through the model's chat template, loss on the
completion (the assistant's answer) only.

TRL 1.16's `SFTTrainer` computes its loss through its own chunked LM head (`trl.trainer.utils.add_fused_lm_head`,
patched onto any model), so the (batch, tokens, vocab) logits are never built: that is `--fused_loss true`.
`--fused_loss false` trains on the model's own unfused loss instead (`Trainer.compute_loss`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import FUSED_LOSS_HELP, PolicyArguments, refuse_liger_kernel
from ..cards import StageCard
from ..stage_table import Stage, register_stage


@dataclass
class SFTArguments(PolicyArguments):
    """Supervised fine-tuning on conversations: the policy stages' arguments and which loss trains it."""

    fused_loss: bool = field(
        default=True,
        metadata={
            "help": FUSED_LOSS_HELP + "; true is TRL's own chunked LM head (SFTTrainer's loss and its entropy "
            "and token-accuracy metrics), false the model's unfused loss (without those metrics)"
        },
    )


def unfused_trainer(sft_trainer: type) -> type:
    """`sft_trainer` with `Trainer`'s loss: the model's forward with the labels (the full logits), not TRL's fused
    head; TRL's entropy and token-accuracy metrics, which that head computes, are not logged."""
    from transformers import Trainer

    class UnfusedSFTTrainer(sft_trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    return UnfusedSFTTrainer


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from ..common import run_trainer

    refuse_liger_kernel(training_args)
    trainer_class = SFTTrainer if script_args.fused_loss else unfused_trainer(SFTTrainer)
    return run_trainer(
        STAGE,
        trainer_class,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        selection_signal=completion_likelihood_signal(training_args),
    )


def completion_likelihood_signal(training_args):
    """SFT's dev signal on data without a verifiable answer (`messages`, `prompt`/`completion`, `text`):
    `(script_args, tokenizer, dev rows) ->` the mean log-likelihood per completion token (`CompletionLikelihood`),
    each sequence cut to the trainer's `--max_length`."""

    def signal(script_args, tokenizer, rows):
        from ..selection_signals import CompletionLikelihood

        return CompletionLikelihood(rows, tokenizer, max_length=training_args.max_length)

    return signal


STAGE = register_stage(
    Stage(
        name="sft",
        parent="pretrain",
        script_arguments=SFTArguments,
        config_class="SFTConfig",
        description="supervised fine-tuning on conversations (TRL SFTTrainer)",
        data_format="conversation",
        data_parallel=True,
        card=StageCard("fine-tuned on conversations, loss on the answers", "trl.SFTTrainer"),
        language_model_loss=True,
        train=train,
    )
)
