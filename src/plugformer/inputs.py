"""Validation of a stack's inputs: malformed ids, embeddings, masks and positions are refused before any work with a
`ValueError` / `TypeError` that names the argument (a seq2seq decoder's are its model's `decoder_*` arguments).

Types and shapes are checked always, in Python. Values (ids in the vocabulary, finite embeddings, 0/1 masks with a 1
in every row, non-negative positions) need tensor reductions; a decoding step runs them every token, so they are few
and cheap:
- their statistics are read in one device sync (on the CPU, scalar reads cost none);
- ids on the CPU are left to the embedding's own bounds check, whose `IndexError` `embed_ids` turns into the same
  error (on an accelerator an out-of-range index is a device-side assert, so they are checked up front there);
- they are skipped while torch.compile traces, where a data-dependent branch would break the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache


if TYPE_CHECKING:
    from .stack import PlugformerModel


ID_DTYPES = (torch.int64, torch.int32)  # what `nn.Embedding` indexes with


def check_inputs(
    stack: PlugformerModel,
    input_ids,
    inputs_embeds,
    attention_mask,
    position_ids,
    cache,
    encoder_hidden_states,
    encoder_attention_mask,
) -> None:
    """Refuses malformed inputs of `stack.forward` (see the module docstring); returns nothing."""
    prefix = "decoder_" if stack.cross_attention else ""
    batch, length = _check_token_inputs(prefix, input_ids, inputs_embeds, stack.embed_tokens.embedding_dim)
    described = lambda: _describe_tokens(prefix, input_ids, inputs_embeds)  # noqa: E731 (built only to fail)
    if attention_mask is not None:  # it covers the cached tokens too; a static cache's length (a tensor) is not read
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        past = self_cache.get_seq_length() if self_cache is not None else 0
        exact = isinstance(past, int)
        expected = (batch, length + past if exact else length)
        after = f" after {past} cached tokens" if exact and past else ""
        _check_mask(f"{prefix}attention_mask", attention_mask, expected, lambda: described() + after, exact)
    if encoder_attention_mask is not None and encoder_hidden_states is not None:
        source = tuple(encoder_hidden_states.shape[:2])
        _check_mask(
            "attention_mask", encoder_attention_mask, source, lambda: f"the encoder output covers {source} tokens"
        )
    if position_ids is not None:
        _check_positions(f"{prefix}position_ids", position_ids, batch, length, described)
    if not torch.compiler.is_compiling():
        ids = input_ids if input_ids is not None and input_ids.device.type != "cpu" else None  # CPU: `embed_ids`
        masks = [(f"{prefix}attention_mask", attention_mask), ("attention_mask", encoder_attention_mask)]
        vocab_size = stack.embed_tokens.num_embeddings
        _raise_first(_value_checks(prefix, vocab_size, ids, inputs_embeds, masks, position_ids))


def embed_ids(embedding: nn.Embedding, input_ids: torch.Tensor, name: str) -> torch.Tensor:
    """`embedding(input_ids)`; an id outside the vocabulary raises `check_inputs`' `ValueError` naming `name`
    (on the CPU, where `check_inputs` leaves the ids to the embedding's bounds check)."""
    try:
        return embedding(input_ids)
    except IndexError:
        low, high = (int(value) for value in torch.aminmax(input_ids))
        if low < 0 or high >= embedding.num_embeddings:
            raise _out_of_vocabulary(name, low, high, embedding.num_embeddings) from None
        raise


def _out_of_vocabulary(name: str, low: int, high: int, vocab_size: int) -> ValueError:
    return ValueError(
        f"{name} contains id {low if low < 0 else high}, outside the vocabulary of vocab_size={vocab_size} "
        f"(ids 0 to {vocab_size - 1})"
    )


def _describe_tokens(prefix: str, input_ids, inputs_embeds) -> str:
    given, tokens = (
        (f"{prefix}input_ids", input_ids) if input_ids is not None else (f"{prefix}inputs_embeds", inputs_embeds)
    )
    return f"{given} has shape {tuple(tokens.shape)}"


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_token_inputs(prefix: str, input_ids, inputs_embeds, hidden_size: int) -> tuple[int, int]:
    """Dtype and shape of `input_ids` (B, T) or `inputs_embeds` (B, T, hidden_size); returns (B, T)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"Pass exactly one of {prefix}input_ids or {prefix}inputs_embeds")
    if input_ids is not None:
        name, value = f"{prefix}input_ids", input_ids
        _require_tensor(name, value)
        if value.dtype not in ID_DTYPES:
            raise TypeError(f"{name} must hold integer token ids (torch.long or torch.int), got dtype {value.dtype}")
        expected = "(batch_size, sequence_length)"
        if value.ndim != 2:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    else:
        name, value = f"{prefix}inputs_embeds", inputs_embeds
        _require_tensor(name, value)
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        expected = f"(batch_size, sequence_length, hidden_size={hidden_size})"
        if value.ndim != 3 or value.shape[-1] != hidden_size:
            raise ValueError(f"{name} must have shape {expected}, got {tuple(value.shape)}")
    if 0 in value.shape[:2]:
        raise ValueError(f"{name} is empty (shape {tuple(value.shape)}): it needs at least one token in each row")
    return value.shape[0], value.shape[1]


def _check_mask(name: str, mask, expected: tuple[int, int], described: Callable[[], str], exact: bool = True) -> None:
    """A 2-D padding mask of shape `expected` (bool, integer, or float 0/1 values, checked later); 4-D masks (a
    model-ready mask, transformers' convention) pass through. `exact=False` only requires the length to reach it."""
    _require_tensor(name, mask)
    if mask.ndim == 4:
        return
    if mask.is_complex() or mask.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D (batch_size, length) mask of 1 (attend) and 0 (padding), got dtype {mask.dtype} "
            f"and shape {tuple(mask.shape)}"
        )
    if mask.shape[0] != expected[0] or (mask.shape[1] != expected[1] if exact else mask.shape[1] < expected[1]):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, but {described()}: expected {expected}")


def _check_positions(name: str, position_ids, batch: int, length: int, described: Callable[[], str]) -> None:
    _require_tensor(name, position_ids)
    if position_ids.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must hold integer positions (torch.long or torch.int), got dtype {position_ids.dtype}")
    if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(f"{name} has shape {tuple(position_ids.shape)}, but {described()}")


def _value_checks(prefix: str, vocab_size: int, input_ids, inputs_embeds, masks, position_ids) -> list:
    """`(statistics, problem, context)` per check: 0-d integer tensors (fetched together, in one device sync) and a
    module-level function `problem(context, *values)` returning the error to raise, or None."""
    checks = []
    if input_ids is not None:
        checks.append((torch.aminmax(input_ids), _ids_problem, (f"{prefix}input_ids", vocab_size)))
    if inputs_embeds is not None:
        checks.append(((torch.isfinite(inputs_embeds).all().long(),), _embeds_problem, f"{prefix}inputs_embeds"))
    for name, mask in masks:
        if mask is None or mask.ndim != 2:
            continue
        # a row that attends to nothing has no defined softmax (kernels give NaN or zeros, each its own)
        checks.append(((mask.bool().any(dim=-1).all().long(),), _empty_row_problem, (name, mask)))
        if mask.dtype == torch.bool:
            continue
        if mask.is_floating_point():  # 0.5 lies between 0 and 1: count the values that are neither
            checks.append(((((mask != 0) & (mask != 1)).sum(),), _float_mask_problem, (name, mask)))
        else:  # integers: the extremes say it all
            checks.append((torch.aminmax(mask), _integer_mask_problem, name))
    if position_ids is not None:
        checks.append(((position_ids.min(),), _positions_problem, f"{prefix}position_ids"))
    return checks


def _raise_first(checks: list) -> None:
    """Raises the error of the first check whose statistics are bad; one device sync for all of them."""
    if not checks:
        return
    statistics = [value for values, _, _ in checks for value in values]
    if statistics[0].device.type == "cpu":  # reading a CPU scalar costs no sync: skip the stack
        fetched = iter([value.item() for value in statistics])
    else:
        fetched = iter(torch.stack([value.long().to(statistics[0].device) for value in statistics]).tolist())
    for values, problem, context in checks:
        error = problem(context, *[next(fetched) for _ in values])
        if error is not None:
            raise error


def _ids_problem(context: tuple[str, int], low: int, high: int) -> ValueError | None:
    name, vocab_size = context
    return _out_of_vocabulary(name, low, high, vocab_size) if low < 0 or high >= vocab_size else None


def _embeds_problem(name: str, finite: int) -> ValueError | None:
    return None if finite else ValueError(f"{name} contains NaN or infinity")


def _mask_values_error(name: str, example) -> ValueError:
    return ValueError(
        f"{name} must hold 1 (attend) and 0 (padding), got other values such as {example} (an additive 0 / -inf "
        "mask is not a padding mask)"
    )


def _float_mask_problem(context: tuple[str, torch.Tensor], count: int) -> ValueError | None:
    name, mask = context
    return _mask_values_error(name, mask[(mask != 0) & (mask != 1)][0].item()) if count else None


def _integer_mask_problem(name: str, low: int, high: int) -> ValueError | None:
    return _mask_values_error(name, low if low < 0 else high) if low < 0 or high > 1 else None


def _empty_row_problem(context: tuple[str, torch.Tensor], every_row_attends: int) -> ValueError | None:
    if every_row_attends:
        return None
    name, mask = context
    row = int((~mask.bool().any(dim=-1)).nonzero()[0, 0])
    return ValueError(
        f"{name} row {row} is all zeros: that sequence has no token to attend to; every row needs at least one 1 "
        "(drop empty sequences from the batch)"
    )


def _positions_problem(name: str, low: int) -> ValueError | None:
    return ValueError(f"{name} contains negative positions, e.g. {low}") if low < 0 else None


IGNORE_INDEX = -100  # cross-entropy's ignore_index: label positions that are not scored


def check_labels(labels, classes: int, what: str = "vocab_size") -> None:
    """Refuses integer `labels` outside `[0, classes)` other than -100 (ignored), naming `labels`: cross-entropy
    would raise an `IndexError` on CPU (a device assert on CUDA) that names neither.

    >>> check_labels(torch.tensor([[1, -100, 4]]), 5)
    >>> check_labels(torch.tensor([[1, 5]]), 5)
    Traceback (most recent call last):
    ...
    ValueError: labels holds 5, outside [0, 4] (vocab_size=5) and not -100 (ignored)
    """
    if labels is None or labels.is_floating_point() or labels.numel() == 0:
        return
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= classes))
    if bool(bad.any()):
        value = labels[bad].flatten()[0].item()
        raise ValueError(
            f"labels holds {value}, outside [0, {classes - 1}] ({what}={classes}) and not {IGNORE_INDEX} (ignored)"
        )
