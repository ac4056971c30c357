"""The command line flushes subnormal floats to zero while a command runs (`runtime.denormals`), restores the mode
after, and keeps subnormals when `PLUGFORMER_FLUSH_DENORMAL=0`."""

from __future__ import annotations

import pytest
import torch

import plugformer.cli as cli
from plugformer.runtime.denormals import VARIABLE, denormals_flushed, flushing_denormals
from plugformer.runtime.flags import environment_flag


@pytest.fixture(autouse=True)
def keeping_subnormals():
    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


def test_the_block_flushes_and_restores():
    assert not denormals_flushed()
    assert torch.tensor([1e-39]).mul(1.0).item() > 0  # a subnormal survives outside
    with flushing_denormals() as flushing:
        assert flushing and denormals_flushed()
        assert torch.tensor([3e-38]).mul(0.1).item() == 0.0  # 3e-39: subnormal, read as 0
    assert not denormals_flushed()


def test_a_mode_set_before_stays_after():
    torch.set_flush_denormal(True)
    with flushing_denormals() as flushing:
        assert flushing
    assert denormals_flushed()


@pytest.mark.parametrize("value", ["0", "false", "No"])
def test_the_variable_keeps_subnormals(monkeypatch, value):
    monkeypatch.setenv(VARIABLE, value)
    with flushing_denormals() as flushing:
        assert not flushing and not denormals_flushed()


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("0", False)])
def test_every_command_runs_in_the_mode(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, value)
    seen = []
    monkeypatch.setitem(cli.COMMANDS, "info", (lambda argv: seen.append(denormals_flushed()), "stub"))
    cli.main(["info"])
    assert seen == [expected] and not denormals_flushed()


@pytest.mark.parametrize(
    ("value", "default", "expected"),
    [(None, True, True), ("", False, False), (" No ", True, False), ("FALSE", True, False), ("1", False, True),
     ("yes", False, True)],
)  # fmt: skip
def test_environment_flag_reads_a_switch(monkeypatch, value, default, expected):
    if value is None:
        monkeypatch.delenv("PLUGFORMER_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("PLUGFORMER_TEST_FLAG", value)
    assert environment_flag("PLUGFORMER_TEST_FLAG", default) is expected
