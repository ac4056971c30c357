"""Pretraining with transformers' `Trainer`: a causal LM (or a masked LM for `is_causal=False` configs) from
scratch, on packed documents, with held-out perplexity, checkpoints and `--resume_from_checkpoint`. Trains the
tokenizer first when none is given."""

from __future__ import annotations

import dataclasses
from itertools import accumulate, chain
from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    Trainer,
    default_data_collator,
)

from ..configuration import PlugformerConfig
from ..data.tokenization import train_tokenizer
from ..modeling import PlugformerForCausalLM, PlugformerForMaskedLM
from ..runtime.memory import check_model_fits
from .arguments import check_trainer_arguments
from .checkpoints import atomic_checkpoints
from .common import load_model, load_tokenizer, set_generation_eos, stage_data, train_and_save
from .distributed import check_launch, log_effective_batch
from .outputs import claim_output_dir


def check_tokenizer_source(script_args, model_args) -> None:
    """Continued pretraining keeps the model's own tokenizer: its embedding rows are indexed by that vocabulary, so
    another `--tokenizer_name_or_path` (ignored before) is refused."""
    model, tokenizer = model_args.model_name_or_path, script_args.tokenizer_name_or_path
    if model is not None and tokenizer is not None and Path(tokenizer).resolve() != Path(model).resolve():
        raise ValueError(f"--tokenizer_name_or_path {tokenizer} beside --model_name_or_path {model}: continued "
                         "pretraining uses the model's own tokenizer (its embeddings are indexed by it); drop "
                         "--tokenizer_name_or_path, or drop --model_name_or_path to train a new model with that "
                         "tokenizer")  # fmt: skip


def build_tokenizer(script_args, model_args, texts):
    """The previous model's tokenizer, a named one, or a new byte-level BPE (digits split) on `texts`."""
    source = model_args.model_name_or_path or script_args.tokenizer_name_or_path
    if source is not None:
        return load_tokenizer(source)
    return train_tokenizer(texts, vocab_size=script_args.vocab_size, split_digits=True)


def build_model(script_args, model_args, tokenizer):
    """Continues `--model_name_or_path`, or builds the preset with the architecture fields given."""
    head = AutoModelForCausalLM if script_args.is_causal else AutoModelForMaskedLM
    if model_args.model_name_or_path is not None:
        return load_model(head, model_args, "pretrain")
    architecture = script_args.architecture()
    known = {f.name for f in dataclasses.fields(PlugformerConfig)}
    unknown = sorted(set(architecture) - known)
    if unknown:
        raise ValueError(f"config_overrides={script_args.config_overrides!r}: {unknown} are not PlugformerConfig "
                         f"fields; fields: {sorted(known)}")  # fmt: skip
    if script_args.hidden_size is not None and script_args.intermediate_size is None:
        architecture["intermediate_size"] = None  # derived from hidden_size, not the preset's
    config = PlugformerConfig.from_preset(
        script_args.preset,
        **architecture,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if model_args.attn_implementation is not None:
        config._attn_implementation = model_args.attn_implementation
    check_model_fits(config, training=True, what="pretrain")  # before tens of GB are allocated
    return (PlugformerForCausalLM if config.is_causal else PlugformerForMaskedLM)(config)


def pack(examples: dict, tokenizer, block_size: int, causal: bool, document_positions: bool = True) -> dict:
    """Concatenates `<bos> text <eos>` documents and cuts blocks of `block_size` tokens (a shorter tail is
    dropped). With `document_positions`, blocks carry `position_ids` restarting at each document, and the model
    reads each restart as a document boundary (as with TRL's packing): a document attends to itself only, causal
    or bidirectional (masked LM). A
    document continued from the previous block restarts at 0 too, so every position lies within 0..block_size-1;
    without, the block is one contiguous text at positions 0..block_size-1."""
    documents = tokenizer([tokenizer.bos_token + t + tokenizer.eos_token for t in examples["text"]],
                          add_special_tokens=False)["input_ids"]  # fmt: skip
    tokens = list(chain.from_iterable(documents))
    usable = len(tokens) // block_size * block_size
    blocks = {"input_ids": [tokens[i : i + block_size] for i in range(0, usable, block_size)]}
    if document_positions:
        starts = set(accumulate((len(d) for d in documents[:-1]), initial=0))  # token index of each `<bos>`
        blocks["position_ids"] = [
            block_positions(range(i, i + block_size), starts) for i in range(0, usable, block_size)
        ]
    if causal:
        # labels = inputs (the loss shifts them): the first token of a block, continued or not, is never a target
        # (nothing before it in the block sees it), and a document's `<eos>` predicts the next `<bos>`
        blocks["labels"] = [list(block) for block in blocks["input_ids"]]
    return blocks


def block_positions(indices: range, starts: set[int]) -> list[int]:
    """Positions of the tokens `indices` of one block: counted from the last document start, or from the block's
    first token for the piece of a document that began in an earlier block (it attends within the block only, so
    its positions are relative to what it sees)."""
    positions, position = [], 0
    for index in indices:
        position = 0 if index in starts or index == indices.start else position + 1
        positions.append(position)
    return positions


def check_blocks(data, blocks, block_size: int) -> None:
    """Raises `ValueError` before training when the train or dev split packs into no block: a dev split shorter
    than one block used to train to the end and then fail in evaluation, before the model was saved."""
    for split in ("train", "dev"):
        if split in blocks and len(blocks[split]) == 0:
            flag = "--dev_examples 0 (no dev loss), " if split == "dev" else ""
            raise ValueError(f"the {split} split ({len(data[split])} documents) holds fewer than block_size="
                             f"{block_size} tokens, so it packs into no block; give more {split} text (--"
                             f"{split}_examples), {flag}or a smaller --block_size")  # fmt: skip


def train(script_args, model_args, training_args) -> dict:
    check_trainer_arguments(training_args)
    check_tokenizer_source(script_args, model_args)
    check_launch(training_args)  # before the tokenizer trains: a launch of independent copies is refused at once
    claim_output_dir(script_args, training_args)  # another run's folder, or one in use, is refused as early
    data = stage_data("pretrain", script_args)
    tokenizer = build_tokenizer(script_args, model_args, data["train"]["text"])
    model = build_model(script_args, model_args, tokenizer)
    if model.can_generate():
        set_generation_eos(model, tokenizer)
    causal = model.config.is_causal
    with training_args.main_process_first(desc="packing"):
        blocks = data.map(
            pack,
            batched=True,
            remove_columns=data["train"].column_names,
            fn_kwargs={
                "tokenizer": tokenizer,
                "block_size": script_args.block_size,
                "causal": causal,
                "document_positions": script_args.document_positions,
            },
        )
    check_blocks(data, blocks, script_args.block_size)
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
    return train_and_save(trainer, "pretrain", script_args, tokenizer, extra)
