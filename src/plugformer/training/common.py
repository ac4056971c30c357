"""What every stage does the same way: load the previous stage's model, train with resumption, save a directory
the next stage (and the Auto classes) load, and record how the run went."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..data.sources import load_stage_dataset
from ..data.tokenization import generation_eos_token_ids, load_tokenizer
from ..data.validation import check_data_files, check_rows
from ..evaluation.held_out import data_record
from ..evaluation.pretrained import pretraining_format_exact_match
from ..evaluation.scoring import PER_EXAMPLE, exact_match, sampled_pass_at_k
from ..runtime.files import naming_a_full_disk, write_json_atomic
from ..runtime.loading import load_checked
from .arguments import check_trainer_arguments
from .checkpoints import atomic_checkpoints, config_mismatch, last_good_checkpoint, verify_checkpoint
from .distributed import agreed_checkpoint, check_launch, log_effective_batch
from .outputs import claim_output_dir, release_lock
from .selection import DevSelection, save_last_step
from .sharding import is_sharded, refuse_unsharded_fallback
from .stages import STAGES


logger = logging.getLogger(__name__)


def require_model_path(model_args, stage: str) -> str:
    path = model_args.model_name_or_path
    if not path:
        raise ValueError(
            f"stage {stage!r} needs --model_name_or_path: the output directory of the previous stage "
            "(pretrain -> sft -> reward -> rlhf; sft -> dpo; sft -> grpo)"
        )
    local = Path(path).is_absolute() or str(path).startswith((".", "~"))  # else it may be a Hub id
    if local and not Path(path).expanduser().is_dir():
        what = "is a file, not a folder" if Path(path).expanduser().exists() else "does not exist"
        raise ValueError(f"--model_name_or_path {path} {what}; give the output directory of the previous stage")
    return path


def load_model(auto_class, model_args, stage: str, **kwargs) -> PreTrainedModel:
    """The previous stage's model through an Auto class, with the dtype and kernel asked for."""
    path = require_model_path(model_args, stage)
    if model_args.attn_implementation is not None:
        kwargs["attn_implementation"] = model_args.attn_implementation
    dtype = model_args.dtype
    if dtype not in (None, "auto"):
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"--dtype {dtype!r} is not a torch dtype; use auto, float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    return load_checked(auto_class, path, revision=model_args.model_revision, dtype=dtype, **kwargs)


def with_adapters(model, model_args, task_type: str):
    """`model` with LoRA adapters (`--lora_*`) as PEFT's model of `task_type` (`SEQ_CLS`: the new head is trained whole
    and saved beside the adapters; `SEQ_2_SEQ_LM`), whatever `--lora_task_type` says (TRL's default, `CAUSAL_LM`,
    expects a decoder-only forward and would leave a classifier's head untrained)."""
    from peft import get_peft_model

    config = peft_config(model_args)
    config.task_type = task_type
    return get_peft_model(model, config)


def preset_config(script_args, model_args, tokenizer, stage: str, **fields):
    """The `PlugformerConfig` of a new model: `--preset` with the architecture flags and `--config_overrides`
    (`ArchitectureArguments.architecture`), the tokenizer's vocabulary and special ids, `fields` (e.g.
    `is_encoder_decoder=True`) and `--attn_implementation`; refused before any weight is allocated when a field is
    unknown or the model would not fit in memory (`runtime.memory.check_model_fits`)."""
    from ..configuration import PlugformerConfig
    from ..runtime.memory import check_model_fits

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
        **fields,
    )
    if model_args.attn_implementation is not None:
        config._attn_implementation = model_args.attn_implementation
    check_model_fits(config, training=True, what=stage)  # before tens of GB are allocated
    return config


def peft_config(model_args):
    """TRL's LoRA config from `--use_peft` and `--lora_*`; without `--lora_target_modules` PEFT takes
    `plugformer.LORA_TARGET_MODULES` (registered by model_type on import)."""
    from trl import get_peft_config

    return get_peft_config(model_args)


def stage_data(stage: str, script_args):
    """The splits of `stage`, in the data format its record names (`format_data`)."""
    return format_data(STAGES.get_stage(stage).data_format, script_args, f"stage {stage!r}")


def evaluation_data(script_args):
    """Prompts with their ground truth, for dev selection and dev exact match (`format_data`)."""
    return format_data("prompt_answer", script_args, "stage 'evaluation'")


def format_data(data_format: str, script_args, reader: str):
    """The splits of `data_format`; user data is checked first (files missing, empty, not UTF-8) and after loading
    (SFT's columns, null values in the columns the format needs, empty splits), each error naming the file or split
    and `reader`, what needs them."""
    if script_args.dataset_name is not None:
        check_data_files(script_args.dataset_name, script_args.data_files)
    data = load_stage_dataset(
        data_format,
        dataset_name=script_args.dataset_name,
        dataset_config=script_args.dataset_config,
        data_files=script_args.data_files,
        sizes=script_args.sizes(),
        seed=script_args.dataset_seed,
        direct_fraction=script_args.direct_answer_fraction,
        rename_columns=script_args.rename_columns,
    )
    if script_args.dataset_name is not None:
        source = f"--dataset_name {script_args.dataset_name}" + (
            f" --data_files {' '.join(script_args.data_files)}" if script_args.data_files else ""
        )
        check_rows(data_format, data, source, reader)
    return data


def resume_checkpoint(training_args) -> str | None:
    """`--resume_from_checkpoint PATH`, or `last`/`true` for the newest intact checkpoint in the output directory
    (a damaged newer one is skipped with a warning). An explicit PATH that fails its manifest is refused. Resolved
    on every rank, then compared: ranks that would resume from different checkpoints (or some not at all) are
    refused together, listing each rank's choice."""
    value = training_args.resume_from_checkpoint
    checkpoint, problem = None, None
    if value is not None and str(value).lower() not in ("last", "true"):
        problem = verify_checkpoint(value) if Path(value).is_dir() else f"{value} is not a directory"
        checkpoint = value if problem is None else None
    elif value is not None:
        checkpoint = last_good_checkpoint(training_args.output_dir)
        if checkpoint is None:
            logger.warning("--resume_from_checkpoint %s: no intact checkpoint in %s, starting fresh", value,
                           training_args.output_dir)  # fmt: skip
    return agreed_checkpoint(checkpoint, problem, value)


def parameter_digest(model: torch.nn.Module) -> int:
    """A 63-bit digest of every parameter's bytes (equal digests: identical weights).

    A sharded parameter (FSDP2's and tensor parallelism's `DTensor`, a ZeRO-3 partition) is digested whole:
    `full_tensor()` or DeepSpeed's `GatheredParameters` gathers it, a collective that every rank reaches here, in the
    same (sorted) order. The bytes are read from a clone: a view of an FSDP2 parameter's storage breaks its later
    resharding, and a gathered ZeRO-3 parameter is released again on leaving the context.
    """
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        if hasattr(parameter, "ds_id"):  # ZeRO-3: an empty placeholder until gathered
            import deepspeed

            with deepspeed.zero.GatheredParameters([parameter]):
                tensor = parameter.detach().cpu().clone()
        else:
            tensor = parameter.detach()
            if hasattr(tensor, "full_tensor"):  # a DTensor
                tensor = tensor.full_tensor()
        digest.update(name.encode())
        digest.update(tensor.cpu().clone().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def save_final_model(trainer, tokenizer, output_dir: str) -> None:
    """Saves a directory the next stage loads: LoRA adapters in `adapter/` and the merged model beside them."""
    model = trainer.model
    use_cache = getattr(trainer, "model_use_cache", None)
    if use_cache is not None:  # the Trainer set config.use_cache = args.use_cache (False) for training
        trainer.accelerator.unwrap_model(model).config.use_cache = use_cache
    if not has_adapters(model):
        trainer.save_model(output_dir)
        return
    if trainer.is_world_process_zero():
        save_adapters(trainer, output_dir)
        merged = model.merge_and_unload()
        merged.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
    trainer.accelerator.wait_for_everyone()


def has_adapters(model) -> bool:
    """Whether `model` is a PEFT model whose adapters the final save merges."""
    return hasattr(model, "merge_and_unload")


def save_adapters(trainer, output_dir: str) -> None:
    """The LoRA adapters alone, in `output_dir/adapter` (rank 0)."""
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(Path(output_dir) / "adapter")


def final_save_failed(output_dir: str) -> str:
    from .checkpoints import intact_checkpoint

    return f"the model files in it are incomplete; {intact_checkpoint(output_dir)}"


def evaluate_saved(trainer, stage: str, saved: str = "the trained model is saved in") -> dict:
    """`trainer.evaluate()` after the trained model was saved; a failure says where the model is and is re-raised
    (its type and traceback kept, the location added as a note and logged)."""
    try:
        return trainer.evaluate()
    except Exception as error:
        where = (f"stage {stage!r}: the dev evaluation after training failed; {saved} "
                 f"{trainer.args.output_dir} (no run_info.json was written)")  # fmt: skip
        logger.error("%s: %s: %s", where, type(error).__name__, error)
        error.add_note(where)
        raise


def trained_tokens(trainer) -> dict:
    """The tokens an offline trainer trained on: TRL's own count behind its logged `num_tokens` (SFT, DPO: the
    non-padding tokens of every micro-batch, prompts included), else transformers' `num_input_tokens_seen`."""
    counted = getattr(trainer, "_total_train_tokens", None) or trainer.state.num_input_tokens_seen or None
    return {"train_tokens": int(counted) if counted else None, "sampling_tokens": 0}


def sampled_tokens(trainer) -> dict:
    """The tokens of an online RL trainer (GRPO, RLOO): TRL counts the prompt and completion tokens of every sampled
    sequence (`num_input_tokens_seen`, its logged `num_tokens`); each is generated once and trained on
    `num_iterations` times."""
    seen = int(trainer.state.num_input_tokens_seen)
    return {"train_tokens": seen * getattr(trainer.args, "num_iterations", 1), "sampling_tokens": seen}


def compute_record(trainer, compute: Callable | None = None) -> dict:
    """`run_info.json`'s `compute`: optimizer steps, tokens trained on and sampled (`compute(trainer)`, by default
    `trained_tokens`), and the folder the stage started from (`parent`: whose `compute` the chain continues)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    parent = getattr(model.config, "_name_or_path", None) or None
    if parent is not None and Path(parent).is_dir():
        parent = os.path.abspath(parent)
    return {"steps": trainer.state.global_step, **(compute or trained_tokens)(trainer), "parent": parent}


def train_and_save(
    trainer, stage: str, script_args, tokenizer, extra: dict | None = None, selection: DevSelection | None = None,
    compute: Callable | None = None,
) -> dict:  # fmt: skip
    """Trains (resuming if asked), saves model + tokenizer, scores dev exact match, writes `run_info.json`.

    With `selection` (a `DevSelection` callback of the trainer) the saved model is the best dev step's, and
    `run_info.json` records the selected and the last step with the dev history. `compute` counts the run's
    tokens (`compute_record`)."""
    args = trainer.args
    refuse_unsharded_fallback(trainer)
    checkpoint = resume_checkpoint(args)
    if checkpoint is not None:
        changed = config_mismatch(checkpoint, trainer.accelerator.unwrap_model(trainer.model).config)
        if changed:
            raise ValueError(f"--resume_from_checkpoint {args.resume_from_checkpoint}: {checkpoint} was trained with "
                             f"another model ({changed}); resume it with its own settings, or train the new one "
                             "into a new --output_dir (or --overwrite_output_dir true)")  # fmt: skip
    started = time.perf_counter()
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    seconds = time.perf_counter() - started
    metrics = dict(train_output.metrics)
    # every rank's digest: after data-parallel training all ranks must hold the same weights
    digest = torch.tensor([parameter_digest(trainer.model)], dtype=torch.int64, device=trainer.accelerator.device)
    digests = trainer.accelerator.gather(digest).tolist()
    # saved before the dev evaluation: an evaluation that fails must not lose a finished training run. With LoRA the
    # adapters are saved first and the merged model after it: merging unloads the adapters, and DPO's evaluation
    # still needs them (its reference is the model with the adapters disabled)
    lora = has_adapters(trainer.model)
    with naming_a_full_disk(args.output_dir, "the trained model", lambda: final_save_failed(args.output_dir)):
        save_adapters(trainer, args.output_dir) if lora else save_final_model(trainer, tokenizer, args.output_dir)
    if trainer.eval_dataset is not None:
        saved = "the trained LoRA adapters are saved in adapter/ of" if lora else "the trained model is saved in"
        metrics.update(evaluate_saved(trainer, stage, saved))
    if lora:
        with naming_a_full_disk(args.output_dir, "the trained model", lambda: final_save_failed(args.output_dir)):
            save_final_model(trainer, tokenizer, args.output_dir)
    if selection is not None and selection.keep_last:  # dpo: its implicit reward is what it learned, not step 0's
        with naming_a_full_disk(args.output_dir, "the last step's model", "the selected model is saved"):
            last_step = save_last_step(trainer, tokenizer, selection, args.output_dir)
        extra = {**(extra or {}), "last_step_model": last_step}
    if "eval_loss" in metrics and STAGES.get_stage(stage).language_model_loss:  # exp of it is a perplexity
        metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    info = {
        "stage": stage,
        "train_seconds": round(seconds, 1),
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": trainer.accelerator.distributed_type.value,  # FSDP, DEEPSPEED, MULTI_CPU (DDP), NO, ...
        "parameter_digests": digests,
        "metrics": metrics,
        "data": data_record(script_args),  # what `plugformer eval` scores the model on by default
        "data_format": STAGES.get_stage(stage).data_format,  # text: pretraining, scored in its corpus's format too
        "max_new_tokens": script_args.max_new_tokens,  # its dev answers' budget: `plugformer eval`'s default too
        "compute": compute_record(trainer, compute),
        **(extra or {}),
        **({"selection": selection.summary()} if selection is not None else {}),
    }
    if trainer.is_world_process_zero():
        as_text = info["data_format"] == "text"  # pretraining: asked as its corpus asks, not through the template
        info["dev_exact_match"], pass_at_k = dev_policy_scores(trainer, script_args, tokenizer, as_text)
        if pass_at_k is not None:
            info["dev_pass_at_k"] = pass_at_k
        # written whole or not at all: a torn run_info.json broke every later pipeline run
        write_json_atomic(Path(args.output_dir, "run_info.json"), info, indent=2, default=str)
        # the whole log history, as `TrainerState.save_to_json` writes it (which writes in place)
        write_json_atomic(Path(args.output_dir, "trainer_state.json"), dataclasses.asdict(trainer.state), indent=2,
                          sort_keys=True)  # fmt: skip
        with naming_a_full_disk(Path(args.output_dir, "README.md"), "the model card", "the trained model is saved"):
            write_card(trainer, info, script_args)
        summary = info["dev_exact_match"] or {}
        print(f"[{stage}] {seconds:.0f}s, world size {info['world_size']}, saved to {args.output_dir}"
              + (f", dev exact match {summary['exact_match']:.1%}" if summary else ""))  # fmt: skip
    trainer.accelerator.wait_for_everyone()
    release_lock(args.output_dir)
    return info


def run_trainer(
    stage: str,
    trainer_class,
    auto_class,
    script_args,
    model_args,
    training_args,
    model_kwargs: dict | None = None,
    evaluate: bool = True,
    extra: dict | None = None,
    data=None,
    prepare: Callable | None = None,
    compute: Callable | None = None,
    keep_last_step: bool = False,
    **trainer_kwargs,
) -> dict:
    """The body of every TRL stage: the parent's model and tokenizer, the stage's data, `trainer_class` with LoRA
    when asked, then `train_and_save`. `evaluate=False` for online RL (no dev loss to compute); `extra` goes into
    `run_info.json`. `data(model, tokenizer) -> splits` replaces the stage's own splits (rft: the loaded parent's
    verified samples); `prepare(trainer) -> dict` runs on the built trainer before training (sft_matched: its step
    count), its result going into `run_info.json`; `compute` counts the tokens (`compute_record`). With
    `keep_last_step` and dev selection, the last step is saved beside the selected one (`save_last_step`: dpo)."""
    check_trainer_arguments(training_args)  # --max_steps -5 and other counts that would silently mean something else
    check_launch(training_args)  # before the model loads: a launch of independent copies costs only the imports
    claim_output_dir(script_args, training_args, stage)  # another run's folder, or one in use, is refused as early
    model = load_model(auto_class, model_args, stage, **(model_kwargs or {}))
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    if model.config.pad_token_id is None:  # sequence classification finds the last real token through it
        model.config.pad_token_id = tokenizer.pad_token_id
    data = stage_data(stage, script_args) if data is None else data(model, tokenizer)
    selection = dev_selection(script_args, tokenizer, model, keep_last_step)
    trainer = atomic_checkpoints(trainer_class)(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        **({"eval_dataset": data.get("dev")} if evaluate else {}),
        processing_class=tokenizer,
        peft_config=peft_config(model_args),
        callbacks=[selection] if selection is not None else None,
        **trainer_kwargs,
    )
    extra = {**(extra or {}), "effective_batch": log_effective_batch(trainer, stage)}
    extra.update(prepare(trainer) if prepare is not None else {})
    return train_and_save(trainer, stage, script_args, tokenizer, extra, selection, compute)


def dev_selection(script_args, tokenizer, model, keep_last: bool = False) -> DevSelection | None:
    """The dev-selection callback asked for by `--selection_steps` (policy stages), on the first
    `--selection_examples` dev problems; None when off."""
    steps = getattr(script_args, "selection_steps", 0)
    if not steps:
        return None
    if not model.can_generate():
        raise ValueError(
            f"--selection_steps {steps}: dev selection scores generated answers; this model cannot generate"
        )
    try:
        rows = evaluation_data(script_args).get("dev")
    except ValueError as error:  # your own data without a ground truth: say which flag asked for one
        if script_args.dataset_name is None:
            raise
        raise ValueError(f"--selection_steps {steps}: dev selection scores greedy answers against the `answer` "
                         f"column (the final number) of your data's dev split: {error}. Add or mend that column, or "
                         "train without dev selection: --selection_steps 0") from error  # fmt: skip
    if rows is None or len(rows) == 0:
        raise ValueError(f"--selection_steps {steps}: dev selection needs dev problems (--dev_examples > 0)")
    rows = rows.select(range(min(script_args.selection_examples, len(rows))))
    return DevSelection(rows, tokenizer, steps, max_new_tokens=script_args.max_new_tokens, keep_last=keep_last)


def write_card(trainer, info: dict, script_args) -> None:
    """README.md (a huggingface_hub model card) beside the weights."""
    from ..evaluation.cards import stage_card

    model = trainer.accelerator.unwrap_model(trainer.model)
    parent = model.config._name_or_path or None
    card = stage_card(model, info, trainer.args, script_args, parent=parent, model_path=trainer.args.output_dir,
                      card=STAGES.get_stage(info["stage"]).card)  # fmt: skip
    card.save(Path(trainer.args.output_dir) / "README.md")


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
    scores = seq2seq_scores(model, tokenizer, rows, max_new_tokens=script_args.max_target_length,
                            num_beams=script_args.num_beams, max_source_length=script_args.max_source_length,
                            max_target_length=script_args.max_target_length)  # fmt: skip
    return {key: value for key, value in scores.items() if key not in PER_EXAMPLE or key == "samples"}


def set_generation_eos(model, tokenizer) -> None:
    """End of text and end of a chat turn both stop generation (TRL's GRPO/RLOO rely on it)."""
    model.generation_config.eos_token_id = generation_eos_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
