"""The checkpoint `--resume_from_checkpoint last` picks: the newest one its manifest vouches for. A manifest that vouches
for nothing, or none at all, is skipped with a warning (an explicit path is still checked and accepted), and resuming
behind the step the run had reached warns, naming both steps."""

from __future__ import annotations

import pytest
from conftest import copy_of
from conftest import pretrain_checkpointed as pretrain


def test_resuming_behind_the_step_reached_warns_naming_both_steps(tmp_path, caplog):
    import logging
    import shutil

    run = tmp_path / "run"
    pretrain(run, "--max_steps", "4")
    shutil.rmtree(run / "checkpoint-4")  # the newest checkpoint removed by hand
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        pretrain(run, "--max_steps", "4", "--resume_from_checkpoint", "last")
    assert "RESUMING FROM AN OLDER STATE: this run had reached step 4" in caplog.text
    assert "newest intact checkpoint is checkpoint-2" in caplog.text and "steps 3-4 are trained again" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):  # back at step 4: nothing to say
        pretrain(run, "--max_steps", "4", "--resume_from_checkpoint", "last")
    assert "OLDER STATE" not in caplog.text


@pytest.mark.parametrize("manifest", ["[]", "{}", '{"model.safetensors": []}', "null"])
def test_a_manifest_that_vouches_for_nothing_is_skipped_not_a_crash(finished, tmp_path, caplog, manifest):
    import logging

    from plugformer.training.checkpoints import MANIFEST, last_good_checkpoint, verify_checkpoint

    run = copy_of(finished, tmp_path)
    (run / "checkpoint-2" / MANIFEST).write_text(manifest)
    assert "manifest" in verify_checkpoint(run / "checkpoint-2")
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        assert last_good_checkpoint(run) is None
    assert "skipping" in caplog.text and "reached step 2" in caplog.text


def test_a_checkpoint_without_a_manifest_is_not_picked_by_last(finished, tmp_path, caplog):
    import logging

    from plugformer.training.checkpoints import MANIFEST, last_good_checkpoint, verify_checkpoint

    run = copy_of(finished, tmp_path)
    (run / "checkpoint-2" / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="plugformer.training.checkpoints"):
        assert last_good_checkpoint(run) is None
        assert "no checkpoint_manifest.json" in caplog.text and "pass its path" in caplog.text
        caplog.clear()
        assert verify_checkpoint(run / "checkpoint-2") is None  # an explicit path: checked, accepted with a warning
    assert "not its optimizer, scheduler or random states" in caplog.text
