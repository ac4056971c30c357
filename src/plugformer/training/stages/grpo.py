"""RLVR with TRL's `GRPOTrainer` (Shao et al. 2024): groups of sampled answers per prompt, scored by verifiable
rewards (exact numeric answer, answer format, and your own `--reward_funcs`), generated with plain `generate`.

The shipped configs set TRL 1.16's default loss explicitly, `loss_type: dapo` (Yu et al. 2025: token-level losses
normalised by the active tokens of the whole accumulated batch, no length bias), with `beta: 0.0` (no KL term, no
reference model); the model card names both."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...evaluation.custom_rewards import resolve_reward_function, reward_name, reward_record
from ...evaluation.rewards import REWARD_FUNCTIONS
from ..arguments import PolicyArguments
from ..cards import StageCard
from ..stage_table import Stage, register_stage


@dataclass
class GRPOArguments(PolicyArguments):
    """GRPO: the policy stages' arguments and the verifiable (or your own) reward functions."""

    reward_functions: list[str] = field(
        default_factory=lambda: ["exact_match", "format"],
        metadata={"help": "verifiable rewards from plugformer.evaluation.rewards (weights: --reward_weights)"},
    )
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "your own reward functions (TRL's option): pkg.module:function (or pkg.module.function) "
            "on the Python path, each f(prompts, completions, **kwargs) -> list[float | None] with the "
            "data's other columns as keywords; scored after --reward_functions, --reward_weights "
            "weighing all of them in that order"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.reward_functions = list(self.reward_functions or [])
        self.reward_funcs = list(self.reward_funcs or [])
        unknown = [name for name in self.reward_functions if name not in REWARD_FUNCTIONS]
        if unknown or not (self.reward_functions or self.reward_funcs):
            raise ValueError(
                f"--reward_functions {self.reward_functions}: choose one or more of "
                f"{sorted(REWARD_FUNCTIONS)}, or give your own with --reward_funcs pkg.module:function"
            )
        for spec in self.reward_funcs:  # imported and checked now, before any model or data loads
            resolve_reward_function(spec)


def reward_functions(names: list[str], specs: list[str] | None = None) -> list:
    """The built-in rewards `names` (`REWARD_FUNCTIONS`), then your own `specs` (`--reward_funcs`), in the order
    `--reward_weights` weighs them. Raises `ValueError` for an unknown name, none at all, or two of one name (TRL
    logs each under its name: `rewards/<name>/mean`)."""
    unknown = [name for name in names if name not in REWARD_FUNCTIONS]
    if unknown or not (names or specs):
        raise ValueError(
            f"--reward_functions {names}: choose one or more of {sorted(REWARD_FUNCTIONS)}, or give your "
            "own with --reward_funcs pkg.module:function"
        )
    functions = [REWARD_FUNCTIONS[name] for name in names] + [resolve_reward_function(s) for s in specs or []]
    given = [*names, *(specs or [])]
    seen: dict[str, str] = {}
    for value, function in zip(given, functions, strict=True):
        name = reward_name(function)
        if name in seen:
            raise ValueError(
                f"--reward_funcs {value!r}: its function is named {name!r}, as {seen[name]!r} is; TRL "
                "logs each reward under its name (rewards/<name>/mean): rename one"
            )
        seen[name] = value
    return functions


def check_reward_weights(weights: list[float] | None, script_args) -> None:
    """Raises `ValueError` unless `--reward_weights` gives one weight per reward function (built-in, then yours):
    TRL refuses a mismatch only after the model has loaded."""
    given = [*script_args.reward_functions, *script_args.reward_funcs]
    if weights is not None and len(weights) != len(given):
        raise ValueError(
            f"--reward_weights {list(weights)}: {len(weights)} weights for {len(given)} reward functions "
            f"({', '.join(given)}: --reward_functions, then --reward_funcs); give one weight each, in "
            "that order"
        )


def rewards_record(script_args, training_args) -> list[dict]:
    """`run_info.json`'s record of the rewards trained on, in order: each one's name, weight and origin (a built-in
    name, or your function's flag value, file and sha256)."""
    weights = training_args.reward_weights or [1.0] * (
        len(script_args.reward_functions) + len(script_args.reward_funcs)
    )
    records = [{"builtin": name, "name": reward_name(REWARD_FUNCTIONS[name])} for name in script_args.reward_functions]
    records += [reward_record(resolve_reward_function(spec), spec) for spec in script_args.reward_funcs]
    return [{**record, "weight": float(weight)} for record, weight in zip(records, weights, strict=True)]


def train(script_args, model_args, training_args) -> dict:
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from ..common import run_trainer, sampled_tokens

    rewards = reward_functions(script_args.reward_functions, script_args.reward_funcs)
    check_reward_weights(training_args.reward_weights, script_args)
    return run_trainer(
        STAGE,
        GRPOTrainer,
        AutoModelForCausalLM,
        script_args,
        model_args,
        training_args,
        evaluate=False,
        compute=sampled_tokens,
        reward_funcs=rewards,
        extra={"rewards": rewards_record(script_args, training_args)},
        selection_signal=mean_reward_signal(rewards, training_args.reward_weights),
    )


# the built-in rewards that compare completions with a ground truth (`answer` or `solution`)
NEED_GROUND_TRUTH = ("exact_match", "math_verify", "steps")


def mean_reward_signal(rewards: list, weights: list[float] | None):
    """GRPO's dev signal on prompts without a verifiable answer: `(script_args, tokenizer, dev rows) ->` the weighted
    mean reward of greedy dev answers (`MeanReward`). Refused (`ValueError`) while a built-in reward needs the
    ground truth the data lacks: it would fail at the first step."""

    def signal(script_args, tokenizer, rows):
        from ..selection_signals import MeanReward

        needing = [name for name in script_args.reward_functions if name in NEED_GROUND_TRUTH]
        if needing:
            raise ValueError(
                f"--reward_functions {script_args.reward_functions}: {needing} compare completions with "
                f"an `answer` or `solution` column, which your data lacks (it has {rows.column_names}); "
                "add one, or reward with --reward_functions format and your own --reward_funcs"
            )
        return MeanReward(rows, tokenizer, rewards, weights, max_new_tokens=script_args.max_new_tokens)

    return signal


STAGE = register_stage(
    Stage(
        name="grpo",
        parent="sft",
        script_arguments=GRPOArguments,
        config_class="GRPOConfig",
        description="RL with verifiable rewards (TRL GRPOTrainer)",
        data_format="prompt",
        data_parallel=False,  # its per-device batch is groups of completions, which a split would change
        card=StageCard("trained with verifiable rewards (GRPO)", "trl.GRPOTrainer"),
        train=train,
    )
)
