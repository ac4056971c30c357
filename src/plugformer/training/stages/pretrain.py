"""Pretraining with transformers' `Trainer`: a causal LM (or a masked LM for `is_causal=False` configs) from
scratch, on packed documents, with held-out perplexity, checkpoints and `--resume_from_checkpoint`. Trains the
tokenizer first when none is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    Trainer,
    default_data_collator,
)

from ...data.identity import corpus_cache_root, files_record, row_keys
from ...data.packing import pack
from ...data.prepare import Corpus, corpus_fingerprint, prepared_blocks, prepared_tokenizer, stream_corpus
from ...data.tokenization import CHAT_TEMPLATES, set_chat_template, train_tokenizer
from ...data.user_data import data_identity
from ...data.validation import check_data_files
from ...modeling import PlugformerForCausalLM, PlugformerForMaskedLM
from ..arguments import (
    FUSED_LOSS_HELP,
    ArchitectureArguments,
    check_counts,
    check_trainer_arguments,
    refuse_liger_kernel,
)
from ..cards import StageCard
from ..checkpoints import atomic_checkpoints
from ..common import load_model, load_tokenizer, preset_config, set_generation_eos, train_and_save
from ..data import stage_data
from ..distributed import check_launch, claim_output_dir, log_effective_batch
from ..stage_table import Stage, register_stage


@dataclass
class PretrainArguments(ArchitectureArguments):
    """A model from scratch (or continued pretraining with --model_name_or_path) and its tokenizer."""

    is_causal: bool = field(default=True, metadata={"help": "False: a BERT-style encoder trained as a masked LM"})
    block_size: int = field(default=128, metadata={"help": "tokens per training sequence (documents are packed)"})
    mlm_probability: float = field(default=0.15, metadata={"help": "masked-LM masking rate (is_causal=False)"})
    document_positions: bool = field(
        default=True,
        metadata={
            "help": "causal packing: positions restart at each document (and at the block's start for a "
            "document continued from the previous block) and documents do not see each other; False: "
            "positions run 0..block_size-1 across the block (contiguous text, as in the ALiBi paper's "
            "training)"
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "read --dataset_name lazily and tokenize and pack on the fly, for corpora that do not fit "
            "on disk (needs --max_steps); dev and test are the stream's first --dev_examples and next "
            "--test_examples documents, never trained on"
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "processes that tokenize and pack a corpus (default: every core available)"}
    )
    tokenizer_sample_mb: float = field(
        default=64.0,
        metadata={"help": "the new tokenizer trains on a seeded random sample of this many MB of training text"},
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "where a prepared corpus (its tokenizer, its packed blocks) is kept and reused; default: "
            "$PLUGFORMER_CACHE or ~/.cache/plugformer"
        },
    )
    fused_loss: bool = field(default=True, metadata={"help": FUSED_LOSS_HELP})
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": f"the chat template every later stage formats conversations with: {' | '.join(CHAT_TEMPLATES)} "
            "(question_answer: `<|bos|>Question: {user}\\nAnswer: {assistant}<|endoftext|>`, the "
            "embedded corpus's own documents); default: a new tokenizer's chatml, a loaded one's own"
        },
    )

    ARCHITECTURE = (*ArchitectureArguments.ARCHITECTURE, "is_causal")

    def __post_init__(self):
        super().__post_init__()
        check_counts(self, {"block_size": 2, "preprocessing_num_workers": 1})
        if isinstance(self.tokenizer_sample_mb, bool) or not (
            isinstance(self.tokenizer_sample_mb, (int, float)) and 0 < self.tokenizer_sample_mb < float("inf")
        ):
            raise ValueError(f"--tokenizer_sample_mb {self.tokenizer_sample_mb!r}: expected a positive number of MB")
        if self.streaming and self.dataset_name is None:
            raise ValueError(
                "--streaming true reads a --dataset_name source lazily; the embedded generator is "
                "already in memory: give --dataset_name (and --data_files), or drop --streaming"
            )
        if self.chat_template is not None and self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"--chat_template {self.chat_template!r}: expected one of {' | '.join(CHAT_TEMPLATES)}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"--mlm_probability {self.mlm_probability!r}: expected a rate between 0 and 1 (exclusive)")


def check_tokenizer_source(script_args, model_args) -> None:
    """Continued pretraining keeps the model's own tokenizer: its embedding rows are indexed by that vocabulary, so
    another `--tokenizer_name_or_path` (ignored before) is refused."""
    model, tokenizer = model_args.model_name_or_path, script_args.tokenizer_name_or_path
    if model is not None and tokenizer is not None and Path(tokenizer).resolve() != Path(model).resolve():
        raise ValueError(
            f"--tokenizer_name_or_path {tokenizer} beside --model_name_or_path {model}: continued "
            "pretraining uses the model's own tokenizer (its embeddings are indexed by it); drop "
            "--tokenizer_name_or_path, or drop --model_name_or_path to train a new model with that "
            "tokenizer"
        )


def load_corpus(script_args) -> Corpus:
    """The pretraining text: the embedded generator's (not cached: it is regenerated in seconds), a `datasets`
    source loaded into Arrow once (`datasets`' own cache) and identified for the corpus cache, or a stream."""
    if script_args.streaming:
        check_data_files(script_args.dataset_name, script_args.data_files)
        source = {
            "path": script_args.dataset_name,
            "name": script_args.dataset_config,
            "data_files": script_args.data_files,
        }
        corpus = stream_corpus(source, script_args.dev_examples, script_args.test_examples, script_args.rename_columns)
        script_args.data_identity = stream_identity(script_args, corpus)
        return corpus
    data = stage_data(STAGE, script_args)
    if script_args.dataset_name is None:
        return Corpus(data)
    source = {
        "dataset_name": script_args.dataset_name,
        "dataset_config": script_args.dataset_config,
        "data_files": script_args.data_files,
        "sizes": script_args.sizes(),
        "seed": script_args.dataset_seed,
    }
    if script_args.rename_columns:  # an unrenamed corpus keeps the cache key it had before the option
        source["rename_columns"] = script_args.rename_columns
    return Corpus(data, corpus_fingerprint(source, data, script_args.data_cache_dir))


def stream_identity(script_args, corpus: Corpus) -> dict:
    """What identifies a streamed corpus in `run_info.json` (`sources.data_identity`): its files' digests and its
    held-out documents' (the stream's first ones; nothing is dropped, as the stream is not read ahead)."""
    files = files_record(script_args.dataset_name, script_args.data_files, script_args.data_cache_dir)
    keys = {name: row_keys(split) for name, split in corpus.splits.items()}
    return data_identity(files, keys, {}, keep_duplicates=True)


def build_tokenizer(script_args, model_args, corpus: Corpus):
    """The previous model's tokenizer, a named one, or a new byte-level BPE (digits split) trained on the corpus:
    on all of the embedded data, on a bounded sample of any other corpus (trained once per corpus, then reused).
    `--chat_template`, when given, replaces its chat template."""
    tokenizer = source_tokenizer(script_args, model_args, corpus)
    return tokenizer if script_args.chat_template is None else set_chat_template(tokenizer, script_args.chat_template)


def source_tokenizer(script_args, model_args, corpus: Corpus):
    source = model_args.model_name_or_path or script_args.tokenizer_name_or_path
    if source is not None:
        return load_tokenizer(source)
    if corpus.fingerprint is None:
        return train_tokenizer(corpus.splits["train"]["text"], vocab_size=script_args.vocab_size, split_digits=True)
    root = corpus_cache_root(script_args.data_cache_dir)
    return prepared_tokenizer(
        corpus, script_args.vocab_size, script_args.tokenizer_sample_mb, script_args.dataset_seed, root
    )


def pack_corpus(corpus: Corpus, tokenizer, script_args, causal: bool) -> dict:
    """The corpus's splits packed into blocks (`pack`): prepared on every core and cached for a loaded corpus, in
    this process for the embedded data, on the fly for a stream's training split."""
    options = {
        "tokenizer": tokenizer,
        "block_size": script_args.block_size,
        "causal": causal,
        "document_positions": script_args.document_positions,
    }
    if corpus.fingerprint is None:
        blocks = corpus.splits.map(
            pack, batched=True, remove_columns=corpus.splits["train"].column_names, fn_kwargs=options
        )
    else:
        root = corpus_cache_root(script_args.data_cache_dir)
        blocks = prepared_blocks(
            corpus.splits, corpus.fingerprint, root=root, num_proc=script_args.preprocessing_num_workers, **options
        )
    blocks = dict(blocks)
    if corpus.stream is not None:
        columns = corpus.stream.column_names or list(next(iter(corpus.stream.take(1))))
        blocks["train"] = corpus.stream.map(
            pack, batched=True, batch_size=200, remove_columns=columns, fn_kwargs=options
        )
    return blocks


def build_model(script_args, model_args, tokenizer):
    """Continues `--model_name_or_path`, or builds the preset with the architecture fields given."""
    head = AutoModelForCausalLM if script_args.is_causal else AutoModelForMaskedLM
    if model_args.model_name_or_path is not None:
        return load_model(head, model_args, "pretrain")
    config = preset_config(script_args, model_args, tokenizer, "pretrain")
    return (PlugformerForCausalLM if config.is_causal else PlugformerForMaskedLM)(config)


def check_blocks(data, blocks, block_size: int) -> None:
    """Raises `ValueError` before training when the train or dev split packs into no block: a dev split shorter
    than one block would otherwise train to the end and then fail in evaluation, before the model is saved."""
    for split in ("train", "dev"):
        if isinstance(blocks.get(split), Dataset) and len(blocks[split]) == 0:  # a stream's length is unknown
            flag = "--dev_examples 0 (no dev loss), " if split == "dev" else ""
            raise ValueError(
                f"the {split} split ({len(data[split])} documents) holds fewer than block_size="
                f"{block_size} tokens, so it packs into no block; give more {split} text (--"
                f"{split}_examples), {flag}or a smaller --block_size"
            )


def train(script_args, model_args, training_args) -> dict:
    check_trainer_arguments(training_args)
    refuse_liger_kernel(training_args)
    check_tokenizer_source(script_args, model_args)
    check_launch(training_args)  # before the tokenizer trains: a launch of independent copies is refused at once
    if script_args.dataset_name is not None and not script_args.streaming:
        corpus_cache_root(script_args.data_cache_dir)  # a file as the corpus cache: refused before the data loads
    claim_output_dir(script_args, training_args, "pretrain")  # another run's folder, or one in use, is refused as early
    if script_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming true has no epochs to count (the stream's length is unknown): give --max_steps")
    with training_args.main_process_first(desc="corpus and tokenizer"):  # one process prepares, the others reuse
        corpus = load_corpus(script_args)
        tokenizer = build_tokenizer(script_args, model_args, corpus)
    model = build_model(script_args, model_args, tokenizer)
    model.fused_loss = script_args.fused_loss  # the heads' chunked loss in training (plugformer.losses)
    if model.can_generate():
        set_generation_eos(model, tokenizer)
    causal = model.config.is_causal
    with training_args.main_process_first(desc="packing"):
        blocks = pack_corpus(corpus, tokenizer, script_args, causal)
    check_blocks(corpus.splits, blocks, script_args.block_size)
    collator = (
        default_data_collator
        if causal
        else DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=script_args.mlm_probability)
    )
    trainer = atomic_checkpoints(Trainer)(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks.get("dev"),
        data_collator=collator,
        processing_class=tokenizer,
    )
    extra = {"effective_batch": log_effective_batch(trainer, "pretrain")}
    return train_and_save(trainer, STAGE, script_args, tokenizer, extra)


STAGE = register_stage(
    Stage(
        name="pretrain",
        parent=None,
        script_arguments=PretrainArguments,
        config_class="TrainingArguments",
        description="causal/masked LM from scratch (Trainer), tokenizer too",
        data_format="text",
        data_parallel=True,
        card=StageCard("pretrained from scratch on plain text", "Trainer"),
        language_model_loss=True,
        adapters=False,  # every weight of the new (or continued) model trains: --use_peft is refused
        train=train,
    )
)
