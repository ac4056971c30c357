"""What every stage does the same way: load the previous stage's model, train with resumption, save a directory
the next stage (and the Auto classes) load, and record how the run went."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..data.tokenization import generation_eos_token_ids, load_tokenizer
from ..evaluation.held_out import data_record
from ..runtime.environment import environment_record
from ..runtime.files import model_source_problem, naming_a_full_disk, weights_with_umask_mode, write_json_atomic
from ..runtime.loading import load_checked
from ..runtime.run_folders import begin_run, finish_run, interrupted_run, release_lock
from .arguments import check_trainer_arguments
from .checkpoints import atomic_checkpoints, config_mismatch, last_good_checkpoint, verify_checkpoint
from .data import evaluation_data, stage_data
from .dev_scores import dev_policy_scores
from .distributed import agreed_checkpoint, check_launch, claim_output_dir, log_effective_batch
from .selection import DevSelection, ExactMatchSignal, save_last_step
from .sharding import refuse_unsharded_fallback
from .stage_table import Stage


logger = logging.getLogger(__name__)


def require_model_path(model_args, stage: str) -> str:
    path = model_args.model_name_or_path
    if not path:
        raise ValueError(
            f"stage {stage!r} needs --model_name_or_path: the output directory of the previous stage "
            "(pretrain -> sft -> reward -> rlhf; sft -> dpo; sft -> grpo)"
        )
    problem = model_source_problem(str(path))  # a missing folder, a bad Hub id, one not cached while offline
    if problem is not None:
        raise ValueError(f"--model_name_or_path {path}: {problem}; give the output directory of the previous stage")
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
        raise ValueError(
            f"config_overrides={script_args.config_overrides!r}: {unknown} are not PlugformerConfig "
            f"fields; fields: {sorted(known)}"
        )
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
            logger.warning(
                "--resume_from_checkpoint %s: no intact checkpoint in %s, starting fresh",
                value,
                training_args.output_dir,
            )
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
        if trainer.is_world_process_zero():  # an earlier LoRA run's adapters would read as this model's
            shutil.rmtree(Path(output_dir, "adapter"), ignore_errors=True)
        trainer.save_model(output_dir)
        if trainer.is_world_process_zero():
            weights_with_umask_mode(output_dir)
        return
    if trainer.is_world_process_zero():
        save_adapters(trainer, output_dir)
        merged = model.merge_and_unload()
        merged.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        weights_with_umask_mode(output_dir)
    trainer.accelerator.wait_for_everyone()


def has_adapters(model) -> bool:
    """Whether `model` is a PEFT model whose adapters the final save merges."""
    return hasattr(model, "merge_and_unload")


def save_adapters(trainer, output_dir: str) -> None:
    """The LoRA adapters alone, in `output_dir/adapter` (rank 0)."""
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(Path(output_dir) / "adapter")
        weights_with_umask_mode(Path(output_dir) / "adapter")


def final_save_failed(output_dir: str) -> str:
    from .checkpoints import intact_checkpoint

    return f"the model files in it are incomplete; {intact_checkpoint(output_dir)}"


def evaluate_saved(trainer, stage: str, saved: str = "the trained model is saved in") -> dict:
    """`trainer.evaluate()` after the trained model was saved; a failure says where the model is and is re-raised
    (its type and traceback kept, the location added as a note and logged)."""
    try:
        return trainer.evaluate()
    except Exception as error:
        where = (
            f"stage {stage!r}: the dev evaluation after training failed; {saved} "
            f"{trainer.args.output_dir} (no run_info.json was written)"
        )
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
    trainer,
    stage: Stage,
    script_args,
    tokenizer,
    extra: dict | None = None,
    selection: DevSelection | None = None,
    compute: Callable | None = None,
) -> dict:
    """Trains (resuming if asked), saves model + tokenizer, scores dev exact match, writes `run_info.json`; `stage` is
    the record of the stage trained (its name, data format, loss and card go into the records).

    With `selection` (a `DevSelection` callback of the trainer) the saved model is the best dev step's, and
    `run_info.json` records the selected and the last step with the dev history. `compute` counts the run's
    tokens (`compute_record`). From the first step to `run_info.json`, written last, the folder's records say the run
    is in progress (`run_folders.begin_run`); Ctrl-C meanwhile ends in one line saying so (`run_folders.interrupted_run`)."""
    args = trainer.args
    refuse_unsharded_fallback(trainer)
    checkpoint = resume_checkpoint(args)
    if checkpoint is not None:
        changed = config_mismatch(checkpoint, trainer.accelerator.unwrap_model(trainer.model).config)
        if changed:
            raise ValueError(
                f"--resume_from_checkpoint {args.resume_from_checkpoint}: {checkpoint} was trained with "
                f"another model ({changed}); resume it with its own settings, or train the new one "
                "into a new --output_dir (or --overwrite_output_dir true)"
            )
    if trainer.is_world_process_zero():  # before training writes anything: no record of the model it replaces
        begin_run(args.output_dir, stage.name)
    with interrupted_run(args.output_dir, stage.name):
        info = train_and_record(trainer, stage, script_args, tokenizer, checkpoint, extra, selection, compute)
    trainer.accelerator.wait_for_everyone()
    release_lock(args.output_dir)
    return info


def train_and_record(
    trainer,
    stage: Stage,
    script_args,
    tokenizer,
    checkpoint: str | None,
    extra: dict | None,
    selection: DevSelection | None,
    compute: Callable | None,
) -> dict:
    """The body of `train_and_save`: trains from `checkpoint`, saves the model, scores it and writes the records
    (`write_records`, main process); returns `run_info.json`'s content."""
    args = trainer.args
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
        metrics.update(evaluate_saved(trainer, stage.name, saved))
    if lora:
        with naming_a_full_disk(args.output_dir, "the trained model", lambda: final_save_failed(args.output_dir)):
            save_final_model(trainer, tokenizer, args.output_dir)
    if selection is not None and selection.keep_last:  # dpo: its implicit reward is what it learned, not step 0's
        with naming_a_full_disk(args.output_dir, "the last step's model", "the selected model is saved"):
            last_step = save_last_step(trainer, tokenizer, selection, args.output_dir)
        if last_step is not None and trainer.is_world_process_zero():
            weights_with_umask_mode(Path(args.output_dir, last_step))
        extra = {**(extra or {}), "last_step_model": last_step}
    if "eval_loss" in metrics and stage.language_model_loss:  # exp of it is a perplexity
        metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    info = {
        "stage": stage.name,
        "train_seconds": round(seconds, 1),
        "world_size": trainer.accelerator.num_processes,
        "environment": environment_record(trainer.accelerator.num_processes),  # what its numbers ran on
        "distributed_type": trainer.accelerator.distributed_type.value,  # FSDP, DEEPSPEED, MULTI_CPU (DDP), NO, ...
        "parameter_digests": digests,
        "metrics": metrics,
        "data": data_record(script_args),  # what `plugformer eval` scores the model on by default
        "data_format": stage.data_format,  # text: pretraining, scored in its corpus's format too
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
        write_records(trainer, stage, info, script_args)
        summary = info["dev_exact_match"] or {}
        print(
            f"[{stage.name}] {seconds:.0f}s, world size {info['world_size']}, saved to {args.output_dir}"
            + (f", dev exact match {summary['exact_match']:.1%}" if summary else "")
        )
    return info


def write_records(trainer, stage: Stage, info: dict, script_args) -> None:
    """The trainer state, the model card and `run_info.json` (`info`) beside the saved model, `run_info.json` last:
    its presence says that the files beside it are this run's (`run_folders.finish_run`)."""
    output_dir = trainer.args.output_dir
    # the whole log history, as `TrainerState.save_to_json` writes it (which writes in place)
    write_json_atomic(
        Path(output_dir, "trainer_state.json"), dataclasses.asdict(trainer.state), indent=2, sort_keys=True
    )
    with naming_a_full_disk(Path(output_dir, "README.md"), "the model card", "the trained model is saved"):
        write_card(trainer, stage, info, script_args)
    # written whole or not at all: a torn run_info.json broke every later pipeline run
    write_json_atomic(Path(output_dir, "run_info.json"), info, indent=2, default=str)
    finish_run(output_dir, stage.name)


def run_trainer(
    stage: Stage,
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
    selection_signal: Callable | None = None,
    **trainer_kwargs,
) -> dict:
    """The body of every TRL stage (`stage`, its record): the parent's model and tokenizer, the stage's data, `trainer_class` with LoRA
    when asked, then `train_and_save`. `evaluate=False` for online RL (no dev loss to compute); `extra` goes into
    `run_info.json`. `data(model, tokenizer) -> splits` replaces the stage's own splits (rft: the loaded parent's
    verified samples); `prepare(trainer) -> dict` runs on the built trainer before training (sft_matched: its step
    count), its result going into `run_info.json`; `compute` counts the tokens (`compute_record`). With
    `keep_last_step` and dev selection, the last step is saved beside the selected one (`save_last_step`: dpo);
    `selection_signal` is the stage's dev signal where the data holds no verifiable answer (`dev_selection`)."""
    check_trainer_arguments(training_args)  # --max_steps -5 and other counts that would silently mean something else
    check_launch(training_args)  # before the model loads: a launch of independent copies costs only the imports
    claim_output_dir(script_args, training_args, stage.name)  # another run's folder, or one in use, is refused as early
    model = load_model(auto_class, model_args, stage.name, **(model_kwargs or {}))
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    if model.config.pad_token_id is None:  # sequence classification finds the last real token through it
        model.config.pad_token_id = tokenizer.pad_token_id
    data = stage_data(stage, script_args) if data is None else data(model, tokenizer)
    selection = dev_selection(script_args, tokenizer, model, keep_last_step, data, selection_signal)
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
    extra = {**(extra or {}), "effective_batch": log_effective_batch(trainer, stage.name)}
    extra.update(prepare(trainer) if prepare is not None else {})
    return train_and_save(trainer, stage, script_args, tokenizer, extra, selection, compute)


# columns that hold a verifiable ground truth: dev selection scores exact match against them
VERIFIABLE = ("answer", "solution")


def dev_selection(
    script_args, tokenizer, model, keep_last: bool = False, data=None, signal: Callable | None = None
) -> DevSelection | None:
    """The dev-selection callback asked for by `--selection_steps`, on the first `--selection_examples` dev rows;
    None when off. Its signal is chosen by the data's columns: exact match where they hold a verifiable answer
    (`VERIFIABLE`, or the embedded task) and the model generates, else the stage's own, `signal(script_args,
    tokenizer, dev rows)` (`selection_signals`: the reward stage's whatever the data); refused when the stage has
    none."""
    steps = getattr(script_args, "selection_steps", 0)
    if not steps:
        return None
    columns = data["train"].column_names if data is not None else []
    verifiable = script_args.dataset_name is None or any(c in columns for c in VERIFIABLE)
    if signal is None or (verifiable and model.can_generate()):
        if not model.can_generate():
            raise ValueError(
                f"--selection_steps {steps}: dev selection scores generated answers; this model cannot generate"
            )
        rows = verifiable_dev_rows(script_args, steps)
        chosen = ExactMatchSignal(rows, tokenizer, script_args.max_new_tokens)
    else:
        rows = data.get("dev")
        if rows is None or len(rows) == 0:
            raise ValueError(f"--selection_steps {steps}: dev selection needs dev rows (--dev_examples > 0)")
        rows = rows.select(range(min(script_args.selection_examples, len(rows))))
        chosen = signal(script_args, tokenizer, rows)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"[selection] every {steps} steps: {chosen.description} on {len(rows)} dev rows ({chosen.name})", flush=True
        )
    return DevSelection(None, tokenizer, steps, keep_last=keep_last, signal=chosen)


def verifiable_dev_rows(script_args, steps: int):
    """The first `--selection_examples` dev prompts with their ground truth (`evaluation_data`)."""
    try:
        rows = evaluation_data(script_args).get("dev")
    except ValueError as error:  # your own data without a ground truth: say which flag asked for one
        if script_args.dataset_name is None:
            raise
        raise ValueError(
            f"--selection_steps {steps}: dev selection scores greedy answers against the `answer` "
            f"column (or the final answer of a `solution`) of your data's dev split: {error}. Add or "
            "mend that column, or train without dev selection: --selection_steps 0"
        ) from error
    if rows is None or len(rows) == 0:
        raise ValueError(f"--selection_steps {steps}: dev selection needs dev problems (--dev_examples > 0)")
    return rows.select(range(min(script_args.selection_examples, len(rows))))


def write_card(trainer, stage: Stage, info: dict, script_args) -> None:
    """README.md (a huggingface_hub model card) beside the weights, with the card text of `stage`'s record."""
    from .cards import stage_card

    model = trainer.accelerator.unwrap_model(trainer.model)
    parent = model.config._name_or_path or None
    card = stage_card(
        model,
        info,
        trainer.args,
        script_args,
        parent=parent,
        model_path=trainer.args.output_dir,
        card=stage.card,
    )
    card.save(Path(trainer.args.output_dir) / "README.md")


def set_generation_eos(model, tokenizer) -> None:
    """End of text and end of a chat turn both stop generation (TRL's GRPO/RLOO rely on it)."""
    model.generation_config.eos_token_id = generation_eos_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
