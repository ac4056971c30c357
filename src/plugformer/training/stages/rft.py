"""Rejection-sampling fine-tuning (RFT; Yuan et al. 2023, STaR: Zelikman et al. 2022), the classical cheap
alternative to online RL: the parent (SFT) model samples `--num_samples` answers per training prompt, the verifiable
reward GRPO uses (`exact_match`: the final number equals the ground truth) keeps the right ones, and TRL's
`SFTTrainer` fine-tunes the parent on them, as the sft stage does.

Kept: every distinct verified answer of a prompt (`--max_kept_per_prompt 0`, Yuan et al.'s choice: distinct
reasoning paths each add data), or at most N of them (1: best-of-k); an answer repeated for one prompt is kept once.
Sampling runs before training, on every process alike (same seed, same samples); `run_info.json` records what was
sampled and kept (`sampling`) and the sampled tokens (`compute.sampling_tokens`: prompt and completion tokens of each
sampled sequence, as TRL's GRPO counts its own)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from ..arguments import check_counts, refuse_liger_kernel
from ..cards import StageCard
from ..stage_table import Stage, register_stage
from .sft import SFTArguments


@dataclass
class RFTArguments(SFTArguments):
    """Rejection-sampling fine-tuning: the parent's own samples of the training prompts, verified, then SFT."""

    num_samples: int = field(default=8, metadata={"help": "completions sampled per training prompt (k)"})
    sampling_temperature: float = field(default=1.0, metadata={"help": "temperature of the sampling (pure sampling)"})
    sampling_max_new_tokens: int = field(default=48, metadata={"help": "generation budget of each sample"})
    sampling_batch_size: int = field(default=256, metadata={"help": "sequences generated per `generate` call"})
    max_kept_per_prompt: int = field(
        default=0,
        metadata={
            "help": "verified completions kept per prompt after removing duplicates; 0: every distinct one "
            "(Yuan et al. 2023's RFT), 1: best-of-k (one right answer per prompt)"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_counts(
            self, {"num_samples": 1, "sampling_max_new_tokens": 1, "sampling_batch_size": 1, "max_kept_per_prompt": 0}
        )
        temperature = self.sampling_temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < 1e6:
            raise ValueError(f"--sampling_temperature {temperature!r}: expected a positive number")


def verified_rows(
    prompts: list, answers: list, completions: list[str], samples: int, max_kept: int = 0, verify=None
) -> tuple[list[dict], dict]:
    """(SFT rows, record) from `samples` completions per prompt (prompt by prompt, as `generate_answers` returns them).

    A completion is kept when `verify` (a reward function in TRL's signature; default GRPO's `exact_match`) gives
    it 1, unless the same text was already kept for the same
    prompt, or `max_kept` (> 0) answers of that prompt already were. Rows are conversational prompt-completion pairs
    (TRL's format, loss on the completion); the record counts what was sampled, verified, dropped and kept.
    """
    from ...evaluation.rewards import exact_match_reward

    if len(completions) != len(prompts) * samples:
        raise ValueError(f"{len(completions)} completions for {len(prompts)} prompts x {samples} samples")
    right = (verify or exact_match_reward)(completions, answer=[str(a) for a in answers for _ in range(samples)])
    rows, seen, kept = [], set(), {}
    duplicates = over_cap = 0
    for index, (completion, reward) in enumerate(zip(completions, right, strict=True)):
        if reward != 1:
            continue
        prompt, text = prompts[index // samples], completion.strip()
        key = json.dumps(prompt, sort_keys=True)
        if (key, text) in seen:
            duplicates += 1
            continue
        if max_kept and kept.get(key, 0) >= max_kept:
            over_cap += 1
            continue
        seen.add((key, text))
        kept[key] = kept.get(key, 0) + 1
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": text}]})
    record = {
        "prompts": len(prompts),
        "samples_per_prompt": samples,
        "sampled": len(completions),
        "verified": sum(reward == 1 for reward in right),
        "duplicates": duplicates,
        "over_cap": over_cap,
        "kept": len(rows),
        "prompts_kept": len(kept),
    }
    return rows, record


def sampled_data(script_args, counts: dict):
    """`run_trainer`'s `data`: the parent's verified samples of the training prompts as the train split, the
    conversation dev split for the dev loss; the tokens sampled go into `counts`, the record into `counts["sampling"]`."""

    def build(model, tokenizer):
        from accelerate import PartialState
        from datasets import Dataset, DatasetDict

        from ...evaluation.answers import generate_answers
        from ..data import format_data, stage_data

        problems = stage_data(STAGE, script_args)["train"]
        prompts, answers, k = list(problems["prompt"]), list(problems["answer"]), script_args.num_samples
        model.to(PartialState().device)
        started = time.perf_counter()
        completions = generate_answers(
            model,
            tokenizer,
            prompts,
            script_args.sampling_max_new_tokens,
            batch_size=max(1, script_args.sampling_batch_size // k),
            samples=k,
            temperature=script_args.sampling_temperature,
            counts=counts,
        )
        rows, record = verified_rows(prompts, answers, completions, k, script_args.max_kept_per_prompt)
        record.update(
            temperature=script_args.sampling_temperature, sampling_seconds=round(time.perf_counter() - started, 1)
        )
        counts["sampling"] = record
        print(
            f"[rft] kept {len(rows)} verified answers of {len(completions)} sampled ({record['verified']} right, "
            f"{record['prompts_kept']} of {len(prompts)} prompts, {record['sampling_seconds']:.0f} s)",
            flush=True,
        )
        if not rows:
            raise ValueError(
                f"stage 'rft': none of the {len(completions)} sampled answers was verified right; nothing "
                "to fine-tune on: sample more (--num_samples) or start from a better parent"
            )
        dev = format_data("conversation", script_args, "stage 'rft'").get("dev")
        return DatasetDict({"train": Dataset.from_list(rows), **({"dev": dev} if dev is not None else {})})

    return build


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from ..common import run_trainer, trained_tokens
    from .sft import unfused_trainer

    refuse_liger_kernel(training_args)
    counts = {}

    def compute(trainer) -> dict:
        return {**trained_tokens(trainer), "sampling_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}

    trainer_class = SFTTrainer if script_args.fused_loss else unfused_trainer(SFTTrainer)
    return run_trainer(
        STAGE,
        trainer_class,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        data=sampled_data(script_args, counts),
        prepare=lambda trainer: {"sampling": counts["sampling"]},
        compute=compute,
    )


STAGE = register_stage(
    Stage(
        name="rft",
        parent="sft",
        script_arguments=RFTArguments,
        config_class="SFTConfig",
        description="rejection-sampling fine-tuning: SFT on its parent's verified samples (a baseline for RL)",
        data_format="prompt_answer",  # the prompts it samples and their ground truth; it trains on conversations
        data_parallel=False,  # its sampling is not split over processes: each would sample every prompt
        card=StageCard("fine-tuned on its parent's own verified samples (rejection sampling)", "trl.SFTTrainer"),
        language_model_loss=True,
        baseline=True,
        train=train,
    )
)
