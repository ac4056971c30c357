"""Training checkpoints that a kill at any moment cannot corrupt, and resumption that skips a damaged one.

transformers' `Trainer` writes `checkpoint-N` in place, file by file: a run killed mid-save leaves a directory that
looks like the newest checkpoint but is not whole, and `resume_from_checkpoint` then fails or, worse, loads it.
Every stage's trainer is wrapped by `atomic_checkpoints`: the Trainer writes into `<output_dir>/.staging/`, a
manifest (size and sha256 of every file) is added, the files are flushed to disk, and one `os.replace` publishes
`checkpoint-N` (a rename within a file system is atomic). Only then are old checkpoints rotated away.

`last_good_checkpoint` walks the checkpoints from the newest and returns the first whose files match its manifest,
warning about each one it skips (truncated, edited, missing files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from functools import cache
from pathlib import Path

from ..runtime.files import naming_a_full_disk, with_umask_mode, write_json_atomic
from ..runtime.run_folders import CHECKPOINT_NAME, MANIFEST, PROGRESS, STAGING, fsync, retire


logger = logging.getLogger(__name__)


class AtomicCheckpointMixin:
    """Mixed into a `Trainer` (or TRL trainer) class: `checkpoint-N` appears whole, or not at all.

    It also remembers the model's `config.use_cache` from before the Trainer set it to `args.use_cache` (False, a
    training setting), so that the saved model gets its own value back (`save_final_model`).
    """

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        self.model_use_cache = getattr(getattr(model, "config", None), "use_cache", None)
        super().__init__(*args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = Path(self._get_output_dir(trial=trial))
        staging = run_dir / STAGING
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # the remains of a save that was killed
        self.accelerator.wait_for_everyone()
        self._get_output_dir = lambda trial=None: str(staging)  # every rank writes its part into the staging area
        try:
            with naming_a_full_disk(run_dir / name, "a checkpoint", lambda: drop_staging(staging, run_dir)):
                super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            with naming_a_full_disk(run_dir / name, "a checkpoint", lambda: drop_staging(staging, run_dir)):
                self._repoint_best_checkpoint(run_dir, staging / name)
                publish(staging / name, run_dir / name)
                # what this run reached, so that resuming from an older checkpoint (newer ones deleted) is noticed
                write_json_atomic(run_dir / PROGRESS, {"step": self.state.global_step, "checkpoint": name})
            self._rotate(run_dir)
            with contextlib.suppress(OSError):  # emptied by the publish: no stray `.staging/` beside the model
                staging.rmdir()
        self.accelerator.wait_for_everyone()

    def _repoint_best_checkpoint(self, run_dir: Path, staged: Path) -> None:
        """The Trainer looked for the best checkpoint in the staging area; point it at the published one."""
        best_step = self.state.best_global_step
        if not best_step:
            return
        best = run_dir / f"checkpoint-{best_step}"
        if best.is_dir() or staged.name == best.name:
            self.state.best_model_checkpoint = str(best)
            self.state.save_to_json(str(staged / "trainer_state.json"))

    def _rotate(self, run_dir: Path) -> None:
        """Keeps `save_total_limit` checkpoints (the newest and the best always), as the Trainer does, but retires
        each by renaming it out of sight before deleting it: a kill mid-deletion leaves no half-deleted
        `checkpoint-N` behind."""
        from transformers.trainer_utils import sort_checkpoints

        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = sort_checkpoints(str(run_dir))  # oldest step first
        protected = {checkpoints[-1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(str(Path(self.state.best_model_checkpoint)))
        surplus = len(checkpoints) - max(limit, len(protected))
        for checkpoint in [c for c in checkpoints if c not in protected][: max(surplus, 0)]:
            retire(Path(checkpoint))


def drop_staging(staging: Path, run_dir: Path) -> str:
    """After a save that ran out of space: removes the partial checkpoint (giving its space back) and says which
    checkpoint is intact."""
    shutil.rmtree(staging, ignore_errors=True)
    return intact_checkpoint(run_dir)


def intact_checkpoint(run_dir: str | Path) -> str:
    """Which published checkpoint of `run_dir` is whole (the newest that passes `verify_checkpoint`), as advice after
    a failed write."""
    run_dir = Path(run_dir)
    steps = sorted(
        ((int(m.group(1)), p) for p in run_dir.iterdir() if (m := CHECKPOINT_NAME.match(p.name))), reverse=True
    )
    for step, path in steps:
        if (path / MANIFEST).is_file() and verify_checkpoint(path) is None:
            return f"{path.name} (step {step}) is intact: free some space and resume with --resume_from_checkpoint last"
    return "no earlier checkpoint was saved, so the training steps so far are lost; free some space and train again"


@cache
def atomic_checkpoints(trainer_class: type) -> type:
    """`trainer_class` with atomic checkpoints (the same class object for the same input)."""
    return type(f"Atomic{trainer_class.__name__}", (AtomicCheckpointMixin, trainer_class), {})


def publish(staged: Path, final: Path) -> None:
    """Writes the manifest, flushes every file, renames `staged` to `final` and flushes the parent directory. The
    files get the umask's mode (safetensors writes its files 0600)."""
    files = sorted(path for path in staged.rglob("*") if path.is_file())
    with_umask_mode(*files)
    manifest = {
        str(path.relative_to(staged)): {"bytes": path.stat().st_size, "sha256": _sha256(path)} for path in files
    }
    write_json_atomic(staged / MANIFEST, manifest, indent=1)
    for path in [*files, staged / MANIFEST]:
        fsync(path)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replaced as a whole
        retire(final)
    os.replace(staged, final)
    fsync(final.parent)


def verify_checkpoint(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or `None` if every file matches its manifest.

    A checkpoint without a manifest was written by a plain `Trainer` (plugformer publishes a checkpoint only after
    its manifest): it passes, with a warning, if its trainer state parses and its safetensors read. `last` does not
    pick such a checkpoint by itself (`last_good_checkpoint`); only an explicit path resumes from one.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return _check_unmanifested(path)
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"{MANIFEST} is unreadable ({error})"
    # a manifest that lists nothing (`[]`, `{}`) or entries without sizes vouches for nothing
    entries_ok = isinstance(manifest, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
        for entry in manifest.values()
    )
    if not entries_ok:
        return f"{MANIFEST} is not a mapping of file name to {{bytes, sha256}} (got {str(manifest)[:60]})"
    if "trainer_state.json" not in manifest:
        return f"{MANIFEST} does not list trainer_state.json (listed: {sorted(manifest)[:5]})"
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _check_unmanifested(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        json.loads((path / "trainer_state.json").read_text())
        for weights in path.glob("*.safetensors"):
            with safe_open(str(weights), framework="pt") as handle:
                for key in handle.keys():  # reading each tensor detects a file cut short
                    handle.get_slice(key)
    except Exception as error:  # json, OS and safetensors' own error types alike mean "do not resume from it"
        return f"unreadable without a manifest ({type(error).__name__}: {error})"
    logger.warning(
        "%s has no %s (not written by plugformer, or edited): checked that its trainer state and weights "
        "read, not its optimizer, scheduler or random states",
        path,
        MANIFEST,
    )
    return None


def last_good_checkpoint(output_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` in `output_dir` that has a manifest and passes `verify_checkpoint`, warning about
    each skipped one, and loudly when the one chosen is older than the step the run had reached (`reached_step`):
    the newer checkpoints were deleted or damaged, and the steps after it are trained again.

    A checkpoint without a manifest is skipped: plugformer writes one into every checkpoint it publishes, so such a
    directory was copied in from elsewhere or edited; pass its path to `--resume_from_checkpoint` to use it.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    steps = {int(m.group(1)): p for p in output_dir.iterdir() if p.is_dir() and (m := CHECKPOINT_NAME.match(p.name))}
    chosen = None
    for step in sorted(steps, reverse=True):
        if not (steps[step] / MANIFEST).is_file():
            problem = (
                f"it has no {MANIFEST} (not published by plugformer, or edited); pass its path to "
                "--resume_from_checkpoint to resume from it anyway"
            )
        else:
            problem = verify_checkpoint(steps[step])
        if problem is None:
            chosen = step
            break
        logger.warning("skipping %s: %s; trying the previous checkpoint", steps[step], problem)
    reached, source = reached_step(output_dir)
    if reached is not None and (chosen is None or chosen < reached):
        logger.warning(
            "RESUMING FROM AN OLDER STATE: this run had reached step %d (%s), but the newest intact checkpoint is %s; "
            "the checkpoints after it were deleted or damaged, so steps %s-%d are trained again and the result will "
            "differ from an uninterrupted run",
            reached,
            source,
            f"checkpoint-{chosen}" if chosen else "none (a fresh start)",
            (chosen or 0) + 1,
            reached,
        )
    return None if chosen is None else str(steps[chosen])


# config.json keys that describe how a model runs, not what it is: a resume may change them
RUNTIME_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "architectures",
                       "auto_map", "_attn_implementation", "attn_implementation", "output_attentions",
                       "output_hidden_states", "return_dict", "tp_plan", "base_model_tp_plan", "pp_plan"}  # fmt: skip


def config_mismatch(checkpoint: str | Path, config) -> str | None:
    """The fields in which `checkpoint`'s `config.json` and the model about to resume from it differ ("field:
    checkpoint value -> this run's value", dropout rates and `RUNTIME_CONFIG_KEYS` aside), or `None`.

    A run resumed with another `--attention_score`, `--position_scheme` or size continued the old weights and
    optimizer and saved the result as the new variant (or failed deep in the optimizer on a group size); a
    checkpoint without `config.json` (LoRA adapters) is not compared.
    """
    try:
        saved = json.loads(Path(checkpoint, "config.json").read_text())
    except (OSError, ValueError):
        return None
    current = config.to_dict()
    changed = [
        f"{key}: {saved[key]!r} -> {current[key]!r}"
        for key in sorted(set(saved) & set(current))
        if key not in RUNTIME_CONFIG_KEYS and "dropout" not in key and saved[key] != current[key]
    ]
    return "; ".join(changed) or None


def reached_step(output_dir: str | Path) -> tuple[int | None, str | None]:
    """The furthest step an earlier run in `output_dir` recorded: `last_checkpoint.json` (written at each published
    checkpoint) or the final `trainer_state.json`; `(None, None)` when neither reads."""
    best, source = None, None
    for name, key in ((PROGRESS, "step"), ("trainer_state.json", "global_step")):
        try:
            step = json.loads(Path(output_dir, name).read_text())[key]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int) and (best is None or step > best):
            best, source = step, name
    return best, source


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
