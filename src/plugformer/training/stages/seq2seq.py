"""Sequence-to-sequence training with transformers' `Seq2SeqTrainer`: an encoder-decoder (`PlugformerForConditional
Generation`) on `source` -> `target` pairs, from a preset (with a tokenizer trained on the training pairs) or from a
saved encoder-decoder (`--model_name_or_path`).

Cross-attention scores with the configured `--attention_score` (additive is Bahdanau et al. 2015's, multiplicative
Luong et al. 2015's "general"), so `plugformer compare --stages seq2seq --grid attention_score=...` is that
comparison. The dev split's target perplexity is measured after training and its generated targets are scored by
exact match and chrF (`evaluation.seq2seq`); `plugformer eval` scores the test split. The embedded data is dates
normalised to ISO 8601 ("the 3rd of may, 1999" -> `1999-05-03`, `data.dates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..arguments import ArchitectureArguments, check_counts, refuse_bare_answers
from ..cards import StageCard
from ..stage_table import Stage, register_stage


@dataclass
class Seq2SeqArguments(ArchitectureArguments):
    """An encoder-decoder trained on `source` -> `target` pairs (cross-attention scored as --attention_score)."""

    num_decoder_layers: int | None = field(default=None, metadata={"help": "decoder layers (default: as the encoder)"})
    max_source_length: int = field(default=128, metadata={"help": "source tokens at most; longer sources are cut"})
    max_target_length: int = field(default=128, metadata={"help": "target tokens at most; longer targets are cut"})
    num_beams: int = field(default=1, metadata={"help": "beam width of the dev and held-out scoring (1: greedy)"})

    ARCHITECTURE = (*ArchitectureArguments.ARCHITECTURE, "num_decoder_layers")

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"num_decoder_layers": 1, "max_source_length": 2, "max_target_length": 2, "num_beams": 1})
        refuse_bare_answers(self, "seq2seq")


def tokenized(split, tokenizer, script_args):
    """`split` as source `input_ids` and target `labels`, each ending with end of text (`evaluation.seq2seq`)."""
    from ...evaluation.seq2seq import encode_sources, encode_targets

    def encode(batch):
        return {
            "input_ids": encode_sources(tokenizer, batch["source"], script_args.max_source_length),
            "labels": encode_targets(tokenizer, batch["target"], script_args.max_target_length),  # a csv's 42: "42"
        }

    return split.map(encode, batched=True, remove_columns=split.column_names)


def build_tokenizer(script_args, model_args, data):
    """The model's own tokenizer, a named one, or a byte-level BPE (digits split) trained on the training pairs."""
    from ...data.tokenization import load_tokenizer, train_tokenizer

    source = model_args.model_name_or_path or script_args.tokenizer_name_or_path
    if source is not None:
        return load_tokenizer(source)
    texts = [str(text) for text in (*data["train"]["source"], *data["train"]["target"])]
    return train_tokenizer(texts, vocab_size=script_args.vocab_size, split_digits=True)


def check_parent(model_args) -> None:
    """Raises `ValueError` before any work when `--model_name_or_path` is no encoder-decoder (a pretrain stage's
    decoder or encoder, whose tokenizer and weights the stage would otherwise start loading)."""
    from transformers import AutoConfig

    from ..common import require_model_path

    if model_args.model_name_or_path is None:
        return
    path = require_model_path(model_args, "seq2seq")
    if not getattr(AutoConfig.from_pretrained(path), "is_encoder_decoder", False):
        raise ValueError(
            f"--model_name_or_path {path} is no encoder-decoder (a decoder or encoder stack); the "
            "seq2seq stage trains one: leave --model_name_or_path out to build it from --preset"
        )


def build_model(script_args, model_args, tokenizer):
    """`--model_name_or_path`'s encoder-decoder, or the preset as one with the architecture fields given; its
    position table covers `--max_source_length` and `--max_target_length` unless `--max_position_embeddings` says."""
    from transformers import AutoModelForSeq2SeqLM

    from ...configuration import PlugformerConfig
    from ...modeling import PlugformerForConditionalGeneration
    from ..common import load_model, preset_config

    if model_args.model_name_or_path is not None:
        return load_model(AutoModelForSeq2SeqLM, model_args, "seq2seq")
    fields = {"is_encoder_decoder": True, "decoder_start_token_id": tokenizer.bos_token_id}
    if "max_position_embeddings" not in script_args.architecture():  # room for the longest source and target
        longest = max(script_args.max_source_length, script_args.max_target_length)
        preset = PlugformerConfig.from_preset(script_args.preset).max_position_embeddings
        fields["max_position_embeddings"] = max(preset, longest)
    return PlugformerForConditionalGeneration(preset_config(script_args, model_args, tokenizer, "seq2seq", **fields))


def set_generation(model, tokenizer, script_args) -> None:
    """Generation stops at end of text, searches `--num_beams` wide and writes up to `--max_target_length` tokens
    (saved with the model: `generate` and `plugformer eval` read it)."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id
    model.generation_config.num_beams = script_args.num_beams
    model.generation_config.max_new_tokens = script_args.max_target_length


def train(script_args, model_args, training_args) -> dict:
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer

    from ..arguments import check_trainer_arguments, refuse_liger_kernel
    from ..checkpoints import atomic_checkpoints
    from ..common import train_and_save, with_adapters
    from ..data import stage_data
    from ..distributed import check_launch, claim_output_dir, log_effective_batch

    check_trainer_arguments(training_args)
    refuse_liger_kernel(training_args)
    check_launch(training_args)
    check_parent(model_args)
    claim_output_dir(script_args, training_args, "seq2seq")
    with training_args.main_process_first(desc="data and tokenizer"):  # one process trains the tokenizer
        data = stage_data(STAGE, script_args)
        tokenizer = build_tokenizer(script_args, model_args, data)
    model = build_model(script_args, model_args, tokenizer)
    set_generation(model, tokenizer, script_args)
    if model_args.use_peft:
        model = with_adapters(model, model_args, "SEQ_2_SEQ_LM")
    trainer = atomic_checkpoints(Seq2SeqTrainer)(
        model=model,
        args=training_args,
        train_dataset=tokenized(data["train"], tokenizer, script_args),
        eval_dataset=tokenized(data["dev"], tokenizer, script_args) if "dev" in data else None,  # test: eval's
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    extra = {"effective_batch": log_effective_batch(trainer, "seq2seq")}
    return train_and_save(trainer, STAGE, script_args, tokenizer, extra)


STAGE = register_stage(
    Stage(
        name="seq2seq",
        parent=None,
        script_arguments=Seq2SeqArguments,
        config_class="Seq2SeqTrainingArguments",
        description="encoder-decoder on source -> target pairs (Seq2SeqTrainer; exact match, chrF), tokenizer too",
        data_format="source_target",
        data_parallel=True,
        card=StageCard(
            "an encoder-decoder trained on source -> target pairs",
            "Seq2SeqTrainer",
            "text2text-generation",
            embedded_task="dates",
        ),
        language_model_loss=True,
        train=train,
        pipeline_default=False,
    )
)
