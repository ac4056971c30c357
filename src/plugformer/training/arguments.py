"""The script arguments the stages share, and the checks of their values and of the trainer's options. Each stage
parses (its script arguments, TRL's `ModelConfig`, the trainer's config) with `trl.TrlParser`: dataclass defaults <
YAML (`--config`) < command line, unknown keys and a flag given twice are errors (a list flag accumulates:
`STAGE_FLAGS_RULE`). A stage's own dataclass, built on these bases, lives in its module (`training/stages/`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..data.identity import HELD_OUT_FRACTION
from ..data.validation import refuse_source_options_without_a_source
from ..positions import POSITION_SCHEMES
from ..scores import ATTENTION_SCORES


@dataclass
class StageArguments:
    """Data and held-out evaluation, common to every stage."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "datasets.load_dataset source (local dir, json/csv/text/parquet with --data_files, Hub id); "
            "default: the embedded arithmetic generator"
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "the dataset's configuration name"})
    data_files: list[str] | None = field(default=None, metadata={"help": "local files for a builder such as json"})
    train_examples: int = field(default=4000, metadata={"help": "embedded generator: training examples"})
    dev_examples: int = field(default=200, metadata={"help": "dev examples (carved from train if the source has none)"})
    test_examples: int = field(
        default=200, metadata={"help": "test examples (carved from train if the source has none)"}
    )
    held_out_fraction: float = field(
        default=HELD_OUT_FRACTION,
        metadata={
            "help": "your data: dev and test carved from train each hold at most this share of its distinct rows "
            "(at least 1 from 1/share rows on), --dev_examples / --test_examples being the most; 1: "
            "those counts as given (refused where train keeps no row)"
        },
    )
    dataset_seed: int = field(default=0, metadata={"help": "seed of the embedded generator and of carved splits"})
    rename_columns: str | None = field(
        default=None,
        metadata={
            "help": "your data's columns under the names the stage reads, OLD=NEW pairs: "
            "'document=source,summary=target', 'question=prompt', 'content=text'"
        },
    )
    keep_duplicates: bool = field(
        default=False,
        metadata={
            "help": "your data: keep the training rows identical to a dev or test row (by default they are "
            "dropped, counted in run_info.json and the card: a held-out row's twin in train leaks it)"
        },
    )
    direct_answer_fraction: float = field(
        default=0.0,
        metadata={
            "help": "embedded generator: the fraction of SFT answers and of rejected preference answers that "
            "give the bare answer ('#### 432') without the working, as writers who skip steps do; in "
            "pretraining, of the corpus's problems told without the column method (a bare answer, or "
            "the one-digit facts alone in random order)"
        },
    )
    exact_match_examples: int = field(
        default=200, metadata={"help": "dev examples scored by greedy exact match after training (0: skip)"}
    )
    max_new_tokens: int = field(default=32, metadata={"help": "generation budget of the exact-match evaluation"})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "train into an output_dir that holds another run's model/checkpoints (they are removed); "
            "without it such a folder is refused unless --resume_from_checkpoint resumes that run"
        },
    )

    def __post_init__(self):
        check_counts(
            self,
            {
                "train_examples": 1,
                "dev_examples": 0,
                "test_examples": 0,
                "exact_match_examples": 0,
                "max_new_tokens": 1,
            },
        )
        share = self.held_out_fraction
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"--held_out_fraction {share!r}: expected a share of the rows in (0, 1]")
        if not isinstance(self.direct_answer_fraction, (int, float)) or not 0 <= self.direct_answer_fraction <= 1:
            raise ValueError(f"--direct_answer_fraction {self.direct_answer_fraction!r}: expected a number in [0, 1]")
        if self.rename_columns and self.dataset_name is None:
            raise ValueError(
                f"--rename_columns {self.rename_columns!r} renames your data's columns; the embedded data "
                "has the names the stage reads: give --dataset_name (and --data_files), or drop it"
            )
        refuse_source_options_without_a_source(
            self.dataset_name, data_files=self.data_files, dataset_config=self.dataset_config
        )

    def sizes(self) -> dict[str, int]:
        return {"train": self.train_examples, "dev": self.dev_examples, "test": self.test_examples}


FUSED_LOSS_HELP = (
    "compute the training loss from the hidden states in chunks, never holding the (batch, tokens, "
    "vocab) logits or their gradient (plugformer.losses); false: the full logits, as transformers' "
    "heads"
)


@dataclass
class ArchitectureArguments(StageArguments):
    """A new model built from a preset (the stages that start from no parent: pretrain, seq2seq) and its tokenizer."""

    preset: str = field(default="tiny", metadata={"help": "PlugformerConfig preset; the fields below override it"})
    attention_score: str = field(default="scaled_dot", metadata={"help": ATTENTION_SCORES.choices()})
    position_scheme: str = field(default="rope", metadata={"help": POSITION_SCHEMES.choices()})
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "tokenizer to use; default: train a byte-level BPE on the training texts"}
    )
    vocab_size: int = field(default=512, metadata={"help": "size of the tokenizer trained when none is given"})
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "any other PlugformerConfig fields, as in transformers' run_clm: "
            "'norm_type=layernorm,ffn_type=mlp' (values parsed as YAML)"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"vocab_size": 1})
        # `--hidden_size 32 --config_overrides hidden_size=64` trained 64; a field that defaults to None was given
        unset = {f.name for f in dataclasses.fields(self) if f.name in self.ARCHITECTURE and f.default is None}
        for name, value in parse_overrides(self.config_overrides, "config_overrides").items():
            given = getattr(self, name) if name in unset else None
            if given is not None and given != value:
                raise ValueError(
                    f"--{name} {given!r} and --config_overrides {name}={value!r} contradict each other; "
                    f"give {name} once"
                )

    # the flags that set a PlugformerConfig field directly (`--config_overrides` sets the others)
    ARCHITECTURE = (
        "attention_score",
        "position_scheme",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    )

    def architecture(self) -> dict:
        fields = {name: getattr(self, name) for name in self.ARCHITECTURE if getattr(self, name) is not None}
        return {**fields, **parse_overrides(self.config_overrides, "config_overrides")}


def refuse_bare_answers(arguments, stage: str) -> None:
    """Raises `ValueError` for `--direct_answer_fraction` above 0 in a stage whose data is no arithmetic (classify,
    seq2seq): it shapes the embedded arithmetic's answers only, and there it would be accepted and do nothing."""
    if arguments.direct_answer_fraction:
        raise ValueError(
            f"--direct_answer_fraction {arguments.direct_answer_fraction!r}: the {stage} stage's data has "
            "no worked answers to skip (it shapes the embedded arithmetic only); drop it"
        )


def check_counts(arguments, minimums: dict[str, int]) -> None:
    """Raises `ValueError` for a field of `arguments` that is not an integer of at least `minimums[field]` (`None`
    passes: "not set"). A negative count must never mean something else silently.

    >>> from types import SimpleNamespace
    >>> check_counts(SimpleNamespace(train_examples=-5), {"train_examples": 1})
    Traceback (most recent call last):
    ...
    ValueError: --train_examples -5: expected an integer >= 1
    """
    for name, minimum in minimums.items():
        value = getattr(arguments, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"--{name} {value!r}: expected an integer >= {minimum}")


# trainer options (TrainingArguments and TRL's configs) that count something; None means "not set" where allowed
TRAINER_COUNTS = {
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "save_total_limit": 0,
    "max_length": 1,
    "max_completion_length": 1,
    "num_generations": 1,
    "num_iterations": 1,
}


def check_trainer_arguments(training_args) -> None:
    """Raises `ValueError` for trainer options that transformers/TRL would silently read as something else:
    `max_steps` other than -1 (train `num_train_epochs`) below 1 (`--max_steps -5` trained the epochs), a
    non-positive `num_train_epochs` when it counts, negative logging/eval/save intervals, a negative learning rate
    (gradient ascent) or gradient-clipping norm, and the counts in `TRAINER_COUNTS`."""
    max_steps = training_args.max_steps
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or (max_steps != -1 and max_steps < 1):
        raise ValueError(
            f"--max_steps {max_steps!r}: expected a positive number of optimizer steps, or -1 to train "
            f"num_train_epochs ({training_args.num_train_epochs})"
        )
    if max_steps == -1 and not training_args.num_train_epochs > 0:
        raise ValueError(
            f"--num_train_epochs {training_args.num_train_epochs!r}: expected a positive number "
            "(or a positive --max_steps)"
        )
    for name in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(training_args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"--{name} {value!r}: expected a positive interval (steps, or a fraction of training)")
    for name in ("learning_rate", "max_grad_norm"):
        value = getattr(training_args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"--{name} {value!r}: expected a value >= 0")
    check_counts(training_args, TRAINER_COUNTS)
    if getattr(training_args, "push_to_hub", False):
        import os

        from huggingface_hub import constants

        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if constants.HF_HUB_OFFLINE or offline:  # else a 61-line traceback from the Hub client
            raise ValueError(
                "--push_to_hub true needs the Hub, but this run is offline (HF_HUB_OFFLINE=1, "
                "plugformer's default): run with HF_HUB_OFFLINE=0 to push, or drop --push_to_hub"
            )


def refuse_liger_kernel(training_args) -> None:
    """`--use_liger_kernel true` would fuse nothing on a plugformer model (Liger's patch table does not know its
    model type, and says so at info level only): refused, naming plugformer's own fused loss."""
    if getattr(training_args, "use_liger_kernel", False):
        raise ValueError(
            "--use_liger_kernel true: Liger's kernels do not patch plugformer models; the fused "
            "linear cross-entropy is plugformer's own --fused_loss (on by default): drop "
            "--use_liger_kernel"
        )


def parse_overrides(text: str | None, name: str) -> dict:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} (values parsed as YAML, by the one capped reader `load_yaml_text`).

    >>> parse_overrides("norm_type=layernorm,attention_dropout=0.1", "config_overrides")
    {'norm_type': 'layernorm', 'attention_dropout': 0.1}
    """
    from ..runtime.yaml_text import load_yaml_text

    values = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, separator, value = item.partition("=")
        if not separator or not key.strip():
            raise ValueError(f"{name}={text!r}: expected comma-separated FIELD=VALUE pairs, got {item!r}")
        values[key.strip()] = load_yaml_text(value, f"--{name} {key.strip()}")
    return values


@dataclass
class SelectionArguments(StageArguments):
    """Stages that pick their best dev step (the policy stages and the reward model)."""

    selection_steps: int = field(
        default=0,
        metadata={
            "help": "score dev every N steps (and at the start) and hand on the best weights, not the last (0: "
            "the last): exact match against an answer or solution column, else the stage's own signal "
            "(sft: completion log-likelihood; reward: pairwise accuracy; dpo: implicit-reward accuracy; "
            "grpo, rlhf: mean reward)"
        },
    )
    selection_examples: int = field(default=200, metadata={"help": "dev rows scored for selection"})

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"selection_steps": 0, "selection_examples": 0})


@dataclass
class PolicyArguments(SelectionArguments):
    """Stages that train a policy (sft, dpo, rlhf, grpo): dev selection and the headroom of sampling over greedy."""

    pass_at_k_samples: int = field(
        default=0, metadata={"help": "after training, dev pass@1 and pass@N from N samples at temperature 1 (0: skip)"}
    )

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"pass_at_k_samples": 0})
