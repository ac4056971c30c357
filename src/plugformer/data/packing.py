"""Packing documents into fixed-length training blocks, as `datasets.map(batched=True)` functions.

Documents are written `<bos> text <eos>`, concatenated, and cut into blocks of `block_size` tokens; a tail shorter
than a block at the end of each batch of documents is dropped (as in transformers' `run_clm.py`). The encoding runs
in the tokenizer's Rust backend on the whole batch, the cutting in numpy: the Python cost per batch is a few array
operations, not one per token, so packing runs near the tokenizer's own speed.
"""

from __future__ import annotations

import numpy as np


def encode_documents(texts: list[str], tokenizer) -> list[list[int]]:
    """The token ids of `<bos> text <eos>` for each text, from the fast tokenizer's backend.

    The backend is called directly: `tokenizer(...)` warns for every document longer than `model_max_length`, which
    is noise here (documents are cut into blocks), and builds attention masks and offsets that packing never reads.
    """
    backend = tokenizer.backend_tokenizer
    wrapped = [tokenizer.bos_token + text + tokenizer.eos_token for text in texts]
    encodings = backend.encode_batch_fast(wrapped, add_special_tokens=False)
    return [encoding.ids for encoding in encodings]


def pack(examples: dict, tokenizer, block_size: int, causal: bool, document_positions: bool = True) -> dict:
    """Packs the `text` column of a batch into blocks of `block_size` tokens.

    With `document_positions`, blocks carry `position_ids` restarting at each document, and the model reads each
    restart as a document boundary (as with TRL's packing): a document attends to itself only, causal or
    bidirectional (masked LM). A document continued from the previous block restarts at 0 too, so every position
    lies within 0..block_size-1; without, the block is one contiguous text at positions 0..block_size-1.

    Args:
        examples (`dict`): A batch with a `text` column (a list of strings).
        tokenizer ([`PreTrainedTokenizerFast`]): Has `bos_token` and `eos_token`.
        block_size (`int`): Tokens per block.
        causal (`bool`): Add `labels` equal to `input_ids` (the causal LM shifts them).
        document_positions (`bool`, *optional*, defaults to `True`): Add `position_ids` restarting per document.

    Returns:
        `dict` of int64 `np.ndarray` of shape (num_blocks, block_size): `input_ids`, and `position_ids` / `labels`.
    """
    documents = encode_documents(examples["text"], tokenizer)
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    # int64: what embeddings and the loss take; a prepared corpus stores them as int32 (`prepare.BLOCK_FEATURES`)
    tokens = np.fromiter((t for d in documents for t in d), dtype=np.int64, count=int(lengths.sum()))
    blocks = len(tokens) // block_size
    input_ids = tokens[: blocks * block_size].reshape(blocks, block_size)  # (blocks, block_size)
    packed = {"input_ids": input_ids}
    if document_positions:
        packed["position_ids"] = document_position_ids(lengths, blocks, block_size)
    if causal:
        # labels = inputs (the loss shifts them): the first token of a block, continued or not, is never a target
        # (nothing before it in the block sees it), and a document's `<eos>` predicts the next `<bos>`
        packed["labels"] = input_ids.copy()
    return packed


def document_position_ids(lengths: np.ndarray, blocks: int, block_size: int) -> np.ndarray:
    """Positions of every token of `blocks` blocks: counted from the last document start, or from the block's first
    token for the piece of a document that began in an earlier block (it attends within the block only, so its
    positions are relative to what it sees).

    >>> document_position_ids(np.array([3, 4]), 2, 3).tolist()
    [[0, 1, 2], [0, 1, 2]]
    >>> document_position_ids(np.array([2, 5]), 2, 3).tolist()
    [[0, 1, 0], [0, 1, 2]]
    """
    total = blocks * block_size
    index = np.arange(total, dtype=np.int64)
    restart = np.zeros(total, dtype=bool)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # token index of each `<bos>`
    restart[starts[starts < total]] = True
    restart[::block_size] = True  # a block's first token starts its count, whatever precedes it
    last_restart = np.maximum.accumulate(np.where(restart, index, 0))
    return (index - last_restart).reshape(blocks, block_size)  # (blocks, block_size)
