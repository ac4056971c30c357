"""Natural language inference with the decomposable attention model (Parikh et al. 2016,
`plugformer.DecomposableAttentionForSequenceClassification`): attend, compare, aggregate, with no recurrence and,
unless `--intra_attention true`, no word order.

The data is sentence pairs, `text` (premise), `text_pair` (hypothesis) and `label`, encoded `premise <|sep|>
hypothesis`; labels become class ids as in the classify stage (sorted names, saved as the model's `id2label`). A new
model gets a byte-level BPE trained on the training pairs; `--model_name_or_path` continues a saved decomposable model.
The dev split is scored after training by accuracy and macro F1; `plugformer eval` scores the test split. The
embedded data is an inference grammar (`data.nli`) whose role-swapped hypotheses only word order decides, so
`plugformer compare --stages nli --grid intra_attention=false,true` is the paper's intra-attention ablation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import StageArguments, check_counts, refuse_bare_answers
from ..cards import StageCard
from ..stage_table import Stage, register_stage


@dataclass
class NLIArguments(StageArguments):
    """The decomposable attention model (Parikh et al. 2016) trained on sentence pairs (`text`, `text_pair`,
    `label`): a new model (with a tokenizer trained on the training pairs), or a saved one continued."""

    # a new model's DecomposableAttentionConfig fields; None: the config's default (in the help)
    embedding_size: int | None = field(default=None, metadata={"help": "width of the token embeddings (unset: 128)"})
    hidden_size: int | None = field(
        default=None, metadata={"help": "width of the projected inputs and of F, G and H (unset: 128)"}
    )
    intra_attention: bool | None = field(
        default=None,
        metadata={
            "help": "intra-sentence attention with a learned bias per distance (§3.3), which sees word order; "
            "unset or false: each sentence is a bag of words"
        },
    )
    max_intra_distance: int | None = field(
        default=None, metadata={"help": "distances beyond this share one bias (unset: 10)"}
    )
    hidden_act: str | None = field(
        default=None, metadata={"help": "activation of F, G and H (unset: relu, the paper's)"}
    )
    hidden_dropout: float | None = field(default=None, metadata={"help": "dropout inside F, G and H (unset: 0.2)"})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "tokenizer to use; default: train a byte-level BPE on the training pairs"}
    )
    vocab_size: int = field(default=512, metadata={"help": "size of the tokenizer trained when none is given"})
    max_length: int = field(default=128, metadata={"help": "tokens per pair at most; longer pairs are cut"})
    exact_match_examples: int = field(default=0, metadata={"help": "unused: a classifier generates no answers"})

    # the flags that set a DecomposableAttentionConfig field of a new model
    ARCHITECTURE = (
        "embedding_size",
        "hidden_size",
        "intra_attention",
        "max_intra_distance",
        "hidden_act",
        "hidden_dropout",
    )

    def __post_init__(self):
        super().__post_init__()
        check_counts(
            self, {"embedding_size": 1, "hidden_size": 1, "max_intra_distance": 1, "vocab_size": 1, "max_length": 3}
        )
        dropout = self.hidden_dropout
        if dropout is not None and (
            isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1
        ):
            raise ValueError(f"--hidden_dropout {dropout!r}: expected a number in [0, 1)")
        refuse_bare_answers(self, "nli")

    def architecture(self) -> dict:
        """The architecture flags given (the others keep `DecomposableAttentionConfig`'s defaults)."""
        return {name: getattr(self, name) for name in self.ARCHITECTURE if getattr(self, name) is not None}


def check_parent(script_args, model_args) -> None:
    """Raises `ValueError` before any work for a `--model_name_or_path` that is no decomposable attention model, for
    architecture flags beside it that differ from its own (they would be ignored) and for options this model has no
    use for (`--use_peft`: the record's `adapters=False`, refused for every such stage while parsing)."""
    from transformers import AutoConfig

    from ...decomposable import DecomposableAttentionConfig
    from ..common import require_model_path

    if model_args.attn_implementation is not None:
        raise ValueError(
            f"--attn_implementation {model_args.attn_implementation}: the decomposable attention model "
            "computes its alignments itself, with no attention kernel to choose; drop it"
        )
    if model_args.model_name_or_path is None:
        DecomposableAttentionConfig(**script_args.architecture())  # an invalid field is refused before any work
        return
    path = require_model_path(model_args, "nli")
    saved = AutoConfig.from_pretrained(path)
    if saved.model_type != DecomposableAttentionConfig.model_type:
        raise ValueError(
            f"--model_name_or_path {path} is a {saved.model_type!r} model; the nli stage trains a "
            "decomposable attention model: leave --model_name_or_path out to build a new one"
        )
    changed = {name: value for name, value in script_args.architecture().items() if getattr(saved, name) != value}
    if changed:
        flags = ", ".join(f"--{name} {value} (saved: {getattr(saved, name)})" for name, value in changed.items())
        raise ValueError(
            f"{flags}: --model_name_or_path {path} keeps its own architecture; drop them or give its values"
        )


def build_tokenizer(script_args, model_args, data):
    """The model's own tokenizer, a named one, or a byte-level BPE trained on the training pairs."""
    from ...data.tokenization import load_tokenizer, train_tokenizer

    source = model_args.model_name_or_path or script_args.tokenizer_name_or_path
    if source is not None:
        return load_tokenizer(source)
    texts = [f"{text} {pair}" for text, pair in zip(data["train"]["text"], data["train"]["text_pair"], strict=True)]
    return train_tokenizer(texts, vocab_size=script_args.vocab_size)


def build_model(script_args, model_args, tokenizer, labels: dict):
    """`--model_name_or_path`'s model, whose classes must be the data's (continued on other labels, its head would
    answer with the new names for what it learned as the old), or a new one from the architecture flags with the
    tokenizer's vocabulary, padding and separator; `labels`: `classify.label_fields`."""
    from transformers import AutoModelForSequenceClassification

    from ...decomposable import DecomposableAttentionConfig, DecomposableAttentionForSequenceClassification
    from ..common import load_model

    if model_args.model_name_or_path is not None:
        model = load_model(AutoModelForSequenceClassification, model_args, "nli")
        saved = [model.config.id2label[index] for index in range(model.config.num_labels)]
        wanted = list(labels["id2label"].values())
        if saved != wanted:
            raise ValueError(
                f"--model_name_or_path {model_args.model_name_or_path} classifies into {saved}; the "
                f"data's labels are {wanted}: continue it on data with its labels, or train a new "
                "model"
            )
        return model
    if tokenizer.sep_token_id is None:
        raise ValueError(
            f"the tokenizer of {script_args.tokenizer_name_or_path} has no separator token; the model "
            "splits each pair at it"
        )
    config = DecomposableAttentionConfig(
        **script_args.architecture(),
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        sep_token_id=tokenizer.sep_token_id,
        bos_token_id=tokenizer.bos_token_id,  # as the tokenizer's: else `Trainer` rewrites them, with a warning
        eos_token_id=tokenizer.eos_token_id,
        **labels,
    )
    return DecomposableAttentionForSequenceClassification(config)


def train(script_args, model_args, training_args) -> dict:
    from ..arguments import check_trainer_arguments, refuse_liger_kernel
    from ..common import train_and_save
    from ..data import stage_data
    from ..distributed import check_launch, claim_output_dir, log_effective_batch
    from .classify import label_fields, labelled_trainer

    check_trainer_arguments(training_args)
    refuse_liger_kernel(training_args)
    check_launch(training_args)
    check_parent(script_args, model_args)
    claim_output_dir(script_args, training_args, "nli")
    with training_args.main_process_first(desc="data and tokenizer"):  # one process trains the tokenizer
        data = stage_data(STAGE, script_args)
        tokenizer = build_tokenizer(script_args, model_args, data)
    labels = label_fields(data)
    model = build_model(script_args, model_args, tokenizer, labels)
    trainer = labelled_trainer(model, tokenizer, data, labels["label2id"], script_args, training_args)
    extra = {"effective_batch": log_effective_batch(trainer, "nli"), "labels": list(labels["id2label"].values())}
    return train_and_save(trainer, STAGE, script_args, tokenizer, extra)


STAGE = register_stage(
    Stage(
        name="nli",
        parent=None,
        script_arguments=NLIArguments,
        config_class="TrainingArguments",
        description="decomposable attention model (Parikh et al. 2016) on premise/hypothesis pairs, tokenizer too",
        data_format="sentence_pair",
        data_parallel=True,
        card=StageCard(
            "natural language inference with attend, compare and aggregate (Parikh et al. 2016)",
            "Trainer",
            "text-classification",
            embedded_task="nli",
        ),
        train=train,
        pipeline_default=False,
        adapters=False,  # a few hundred thousand weights, all trained: --use_peft is refused
    )
)
