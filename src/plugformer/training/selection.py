"""Dev selection for the policy stages: score dev while training, hand on the best weights.

The NLP recipe's rule: the dev split chooses, the test split is read once at the end. `DevSelection` is a
`TrainerCallback`; it scores its signal on dev before the first step and every `every` steps, keeps a copy of the
best weights, and loads them back when training ends, before the stage saves its model. The signal is greedy exact
match (`ExactMatchSignal`) where the data holds a verifiable answer, else the stage's own (`selection_signals`). The
history (step, the signal's value, the trainer's proxy reward and KL at that step) goes into `run_info.json`; the
RLHF stage draws it as the over-optimisation curve of Gao et al. (2023).

A DPO policy is also a reward model (its implicit reward against the reference). Selection chooses the policy it
hands on; the reward is what DPO learned, so with `keep_last=True` the last step's weights are saved beside the
selected ones, in `LAST_STEP_DIR` (`save_last_step`): a DPO stage whose dev selection handed on step 0 holds the
reference itself, whose implicit reward is 0 for every answer.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..evaluation.language_scores import exact_match
from ..runtime.run_folders import LAST_STEP_DIR
from .sharding import is_sharded


logger = logging.getLogger(__name__)

# what TRL's online trainers log that the history keeps beside the gold dev score
LOGGED = ("reward", "kl")


class ExactMatchSignal:
    """Greedy dev exact match of the final number (`language_scores.exact_match`) on `rows` (`prompt` and `answer`), with the
    answers' format rate beside it: the signal wherever the data holds a verifiable answer."""

    name = "dev_exact_match"
    description = "greedy exact match of the final number against the `answer` (or `solution`) column"

    def __init__(self, rows, tokenizer, max_new_tokens: int = 32):
        self.rows, self.tokenizer, self.max_new_tokens = rows, tokenizer, max_new_tokens

    def __call__(self, model, step: int) -> dict:
        result = exact_match(model, self.tokenizer, self.rows, self.max_new_tokens, synced_gpus=is_sharded(model))
        return {"dev_exact_match": result["exact_match"], "dev_format": result["format"]}


class DevSelection(TrainerCallback):
    """Scores a dev signal every `every` optimiser steps and restores the best weights at the end of training.

    Args:
        rows (`datasets.Dataset`): Dev problems (`prompt` and `answer` columns) for the default signal.
        tokenizer: The policy's tokenizer.
        every (`int`): Steps between two scores; the start (step 0) and the last step are always scored.
        max_new_tokens (`int`, *optional*, defaults to 32): Generation budget per answer.
        keep_last (`bool`, *optional*, defaults to `False`): Keep a full copy of the last step's weights when an
            earlier step is handed on (`last_weights`, for `save_last_step`).
        signal (*optional*): What is scored, higher being better: a callable `(model, step) -> dict` whose entry
            `signal.name` is the value compared; defaults to `ExactMatchSignal(rows, tokenizer, max_new_tokens)`.

    Every rank scores the same problems: unsharded, each its own replica (no collective); sharded by FSDP2, all in
    step (`synced_gpus`), as each forward gathers parameters from every rank, and the weights are copied and
    restored in their sharded form (`reshard`). ZeRO-3's partitioned parameters cannot be copied and restored here,
    so selection refuses to run under it. Ties keep the earlier step: the selected model is the least trained one
    among the best.
    """

    def __init__(self, rows, tokenizer, every: int, max_new_tokens: int = 32, keep_last: bool = False, signal=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"selection_steps={every!r}: expected a positive number of steps (0 turns selection off)")
        self.every, self.keep_last = every, keep_last
        self.signal = signal if signal is not None else ExactMatchSignal(rows, tokenizer, max_new_tokens)
        self.last_weights: dict[str, torch.Tensor] | None = None
        self.history: list[dict] = []
        self.best: dict | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None

    def score(self, model, step: int) -> None:
        key = self.signal.name
        entry = {"step": step, **self.signal(model, step)}
        self.history.append(entry)
        if self.best is None or entry[key] > self.best[key]:
            self.best = entry
            reshard(model)
            # a copy, not a view: the optimiser updates the parameters in place
            self._best_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        logger.info(
            "dev selection: step %d, %s %.3f (best %.3f at step %d)",
            step,
            key,
            entry[key],
            self.best[key],
            self.best["step"],
        )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ValueError(
                "--selection_steps: dev selection cannot copy and restore DeepSpeed ZeRO-3's partitioned "
                "weights; use --selection_steps 0 (the last step) or ZeRO-2 / FSDP2"
            )
        if not self.history:
            self.score(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0:
            self.score(model, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # the Trainer logs after `on_step_end` of the same step: attach what it logged to that step's entry
        if self.history and self.history[-1]["step"] == state.global_step:
            # float(): the progress printer may have formatted the values to strings in place
            self.history[-1].update({key: float(logs[key]) for key in LOGGED if key in (logs or {})})

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.history[-1]["step"] != state.global_step:
            self.score(model, state.global_step)
        if self.best["step"] != state.global_step:
            reshard(model)
            if self.keep_last and not hasattr(model, "peft_config"):  # LoRA: see save_last_step
                self.last_weights = full_weights(model)
            with torch.no_grad():
                parameters = dict(model.named_parameters())
                for name, value in self._best_weights.items():
                    parameters[name].copy_(value)
            key = self.signal.name
            logger.warning(
                "dev selection: handing on step %d (%s %.3f), not the last step %d (%.3f)",
                self.best["step"],
                key,
                self.best[key],
                state.global_step,
                self.history[-1][key],
            )
        self._best_weights = None

    def summary(self) -> dict:
        """What `run_info.json` records: the signal's name, the selected and the last step with their dev scores, and
        the history."""
        return {
            "signal": self.signal.name,
            "selected": self.best,
            "last": self.history[-1],
            "every": self.every,
            "history": self.history,
        }


def full_weights(model) -> dict[str, torch.Tensor]:
    """A CPU copy of every parameter, whole: FSDP2's shards are gathered (a collective: every rank calls it)."""
    weights = {}
    for name, parameter in model.named_parameters():
        tensor = parameter.detach()
        if hasattr(tensor, "full_tensor"):  # a DTensor shard
            tensor = tensor.full_tensor()
        weights[name] = tensor.cpu().clone()
    return weights


def save_last_step(trainer, tokenizer, selection: DevSelection, output_dir: str) -> str | None:
    """Writes the last step's weights, kept by `selection` (`keep_last`), as a model folder in
    `output_dir/LAST_STEP_DIR` beside the selected model already saved in `output_dir`; returns the subfolder's
    name, or None when the last step is the one handed on (nothing to keep).

    The folder is the saved model reloaded with the last step's parameters copied in, so its config, tokenizer and
    tied weights are the selected model's. LoRA runs keep no copy: their parameters are adapters and a merged base,
    which the copy cannot map (a warning says so, and the implicit reward reads the selected model).
    """
    if selection.last_weights is None:
        stale = Path(output_dir, LAST_STEP_DIR)
        if trainer.is_world_process_zero() and stale.is_dir():  # an earlier run's, in a folder being overwritten
            shutil.rmtree(stale)
        if selection.keep_last and selection.best["step"] != selection.history[-1]["step"]:
            logger.warning(
                "dev selection: the last step's weights were not kept (LoRA); %s holds the selected step only",
                output_dir,
            )
        return None
    if trainer.is_world_process_zero():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(output_dir)
        parameters = dict(model.named_parameters())
        unknown = sorted(set(selection.last_weights) - set(parameters))
        if unknown:
            raise ValueError(
                f"dev selection: the last step's parameters {unknown[:3]} are not in the saved model "
                f"{output_dir}; its last step cannot be written"
            )
        with torch.no_grad():
            for name, value in selection.last_weights.items():
                parameters[name].copy_(value)
        model.save_pretrained(Path(output_dir, LAST_STEP_DIR))
        tokenizer.save_pretrained(Path(output_dir, LAST_STEP_DIR))
    trainer.accelerator.wait_for_everyone()
    selection.last_weights = None
    return LAST_STEP_DIR


def reshard(model) -> None:
    """Puts every FSDP2 module of `model` back into its sharded state.

    FSDP2 leaves the root module's parameters (embeddings, final norm, LM head) unsharded after a forward (its
    `reshard_after_forward` is off): until resharded, `named_parameters()` gives those plain full tensors, which the
    next all-gather and the save never read. The best weights were copied from and restored into them, so a saved
    model held the selected step's decoder layers (resharded after each forward) beside the last step's embeddings,
    norm and head. A no-op without FSDP2.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def plot_overoptimisation(history: list[dict], path, title: str = "RLHF: proxy reward vs gold dev score"):
    """The over-optimisation picture of Gao et al. (2023) from a `DevSelection` history: the learned reward model's
    score (proxy) and dev exact match (gold) against the KL to the reference model, and against steps.

    Returns the path written, or None when the history has fewer than two scored steps with a logged reward, or no
    gold score (selection by another signal: `selection_signals`).
    """
    from ..evaluation.figures import pyplot, save_figure

    logged = [entry for entry in history if "reward" in entry]
    if len(logged) < 2 or any("dev_exact_match" not in entry for entry in history):
        return None
    plt = pyplot()
    panels = [("step", "optimiser step")] + (
        [("kl", "KL(policy ‖ reference), nats per token")] if all("kl" in e for e in logged) else []
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    # the start (step 0, the reference itself: KL 0) has a gold score but no logged reward yet
    start = [entry for entry in history if entry.get("step") == 0 and "reward" not in entry]
    for axis, (key, label) in zip(axes[0], panels, strict=True):
        xs = [entry[key] for entry in logged]
        axis.plot(xs, [entry["reward"] for entry in logged], "o-", color="tab:orange", label="proxy: reward model")
        axis.set_xlabel(label)
        axis.set_ylabel("reward model score", color="tab:orange")
        gold = axis.twinx()
        gold.plot(
            [0.0] * len(start) + xs,
            [100 * entry["dev_exact_match"] for entry in start + logged],
            "s-",
            color="tab:blue",
            label="gold: dev exact match",
        )
        gold.set_ylabel("dev exact match (%)", color="tab:blue")
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
