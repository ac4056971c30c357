"""A stage's scores on dev after training: greedy exact match (asked as the corpus asks, for a model trained on
text alone), pass@k from samples, an encoder-decoder's generated targets; written into `run_info.json`."""

from __future__ import annotations

import logging

from ..evaluation.language_scores import exact_match, sampled_pass_at_k
from ..evaluation.pretrained import pretraining_format_exact_match
from ..evaluation.scoring import PER_EXAMPLE
from .data import evaluation_data, format_data
from .sharding import is_sharded


logger = logging.getLogger(__name__)


def dev_policy_scores(trainer, script_args, tokenizer, as_text: bool = False) -> tuple[dict | None, dict | None]:
    """(greedy dev exact match, dev pass@k from `--pass_at_k_samples` samples or None) of language-model stages
    (both None for the reward model or masked LMs); see `dev_exact_match` for where a sharded model is scored and
    `as_text`."""
    samples = getattr(script_args, "pass_at_k_samples", 0)
    scores = dev_exact_match(trainer, script_args, tokenizer, return_model=bool(samples), as_text=as_text)
    if not samples or scores is None:
        return scores, None
    scores, model, rows = scores
    ks = tuple(sorted({1, samples}))
    headroom = sampled_pass_at_k(model, tokenizer, rows, samples, ks, max_new_tokens=script_args.max_new_tokens)
    return scores, headroom


def dev_exact_match(trainer, script_args, tokenizer, return_model: bool = False, as_text: bool = False):
    """Greedy exact match on dev for language-model stages (not for the reward model or masked LMs); with
    `return_model`, (scores, the model scored, the dev rows). `as_text`: a model trained on text alone, asked as its
    corpus writes a problem (`evaluation.pretrained`), not through the chat template it never saw.

    Runs on rank 0 only. A sharded model (FSDP2, ZeRO-3) cannot generate there alone, as every forward gathers
    parameters from all ranks: its saved checkpoint (the full weights) is scored instead, loaded as a plain model,
    with transformers' ZeRO-3 switch off meanwhile (`alone_on_this_rank`: else `from_pretrained` would partition
    the copy and `generate` sync with the other ranks, both waiting for them forever).
    """
    import contextlib

    from .sharding import alone_on_this_rank

    model = trainer.accelerator.unwrap_model(trainer.model)
    sharded = is_sharded(model)
    with alone_on_this_rank() if sharded else contextlib.nullcontext():
        if sharded:
            model = type(model).from_pretrained(trainer.args.output_dir, dtype=model.dtype)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a (merged) LoRA wrapper
        if script_args.exact_match_examples <= 0 or not base.can_generate():
            return None
        if base.config.is_encoder_decoder:  # source -> target pairs: their generated targets
            return dev_seq2seq_scores(model, tokenizer, script_args)
        try:
            rows = evaluation_data(script_args).get("dev")
        except ValueError as error:  # a dataset without prompt/answer columns has nothing to score
            logger.info("no exact-match evaluation: %s", error)
            return None
        if rows is None:
            return None
        rows = rows.select(range(min(script_args.exact_match_examples, len(rows))))
        score = pretraining_format_exact_match if as_text else exact_match
        scores = score(model, tokenizer, rows, max_new_tokens=script_args.max_new_tokens)
        return (scores, model, rows) if return_model else scores


def dev_seq2seq_scores(model, tokenizer, script_args) -> dict | None:
    """An encoder-decoder's scores on the first `--exact_match_examples` dev pairs (`evaluation.seq2seq`), without
    the per-example lists."""
    from ..evaluation.seq2seq import seq2seq_scores

    rows = format_data("source_target", script_args, "dev scores of an encoder-decoder").get("dev")
    if rows is None or len(rows) == 0:
        return None
    rows = rows.select(range(min(script_args.exact_match_examples, len(rows))))
    scores = seq2seq_scores(
        model,
        tokenizer,
        rows,
        max_new_tokens=script_args.max_target_length,
        num_beams=script_args.num_beams,
        max_source_length=script_args.max_source_length,
        max_target_length=script_args.max_target_length,
    )
    return {key: value for key, value in scores.items() if key not in PER_EXAMPLE or key == "samples"}
