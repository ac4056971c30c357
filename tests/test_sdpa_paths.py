"""The sdpa CPU paths as a table (`kernels_sdpa.SDPA_PATHS`): `sdpa_forward` tries the records in their declared order
and the first whose `applies` holds computes the call; a record registered by a test takes its place in that order.
Each path's numbers are its own module's reference tests (`test_kernels_alibi.py`, `test_kernels_banded.py`,
`test_kernels_relative.py`, `test_relative_native.py`, `test_query_bias_kernel.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugformer.bench.measure import SDPA_OPS
from plugformer.biases import RelativeBias
from plugformer.kernels_sdpa import SDPA_PATHS, SdpaPath, SdpaPaths, sdpa_forward


PROBE = "probe"


def count_path_calls(monkeypatch, name: str) -> list:
    """One entry per call `sdpa_forward` gives the path `name` from now on (its record swapped for a counting copy
    until the test ends)."""
    calls = []
    path = SDPA_PATHS[name]

    def counted(*args):
        calls.append(1)
        return path.forward(*args)

    monkeypatch.setitem(SDPA_PATHS, name, dataclasses.replace(path, forward=counted))
    return calls


def spy_on_applies(monkeypatch) -> list[str]:
    """The names of the paths whose `applies` `sdpa_forward` asks, in the order it asks them."""
    asked = []
    for name, path in list(SDPA_PATHS.items()):

        def applies(*args, _name=name, _rule=path.applies):
            asked.append(_name)
            return _rule(*args)

        monkeypatch.setitem(SDPA_PATHS, name, dataclasses.replace(path, applies=applies))
    return asked


@pytest.fixture
def probe():
    """A path that takes every call and returns ones `(B, H, Q, D)`, removed from the table afterwards."""
    path = SdpaPath(PROBE, lambda *call: True, lambda module, query, *rest: torch.ones_like(query))
    yield path
    SDPA_PATHS.pop(PROBE, None)


class Module:
    is_causal = True


def alibi_call(dtype=torch.float64, length: int = 12) -> tuple:
    """query, key, value `(1, 2, N, 8)` and ALiBi's bias over N tokens (slopes 1/2, 1/4): the linear-bias kernel's
    call, in fp64 so that the C kernel (fp32 only) declines it."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, length, 8, generator=generator, dtype=dtype) for _ in range(3))
    distance = torch.arange(-(length - 1), length, dtype=dtype)
    values = torch.tensor([[0.5], [0.25]], dtype=dtype) * distance.clamp(max=0)  # (H, 2N − 1): −m_h · (i − j)
    return query, key, value, RelativeBias(values, length, length, linear=True)


def test_the_declared_order_is_the_one_sdpa_forward_tries(monkeypatch):
    assert list(SDPA_PATHS) == [
        "relative_native",
        "banded_bias",
        "linear_bias",
        "relative_bias",
        "fire_native",
        "query_bias",
    ]
    asked = spy_on_applies(monkeypatch)
    calls = count_path_calls(monkeypatch, "linear_bias")
    query, key, value, bias = alibi_call()
    sdpa_forward(Module(), query, key, value, None, 8**-0.5, position_bias=bias)
    assert asked == ["relative_native", "banded_bias", "linear_bias"]  # the first that applies computes it
    assert calls == [1]


def test_a_path_registered_before_another_is_tried_in_its_place(probe, monkeypatch):
    SDPA_PATHS.register(probe, before="linear_bias")
    assert list(SDPA_PATHS)[1:4] == ["banded_bias", PROBE, "linear_bias"]
    asked = spy_on_applies(monkeypatch)
    query, key, value, bias = alibi_call()
    output, weights = sdpa_forward(Module(), query, key, value, None, 8**-0.5, position_bias=bias)
    assert asked == ["relative_native", "banded_bias", PROBE]  # linear_bias, later, is not asked
    assert weights is None and output.shape == (1, 12, 2, 8)  # (B, Q, H, D), as every kernel returns it
    assert torch.equal(output, torch.ones_like(output))


def test_a_path_registered_last_takes_what_no_earlier_path_does(probe, monkeypatch):
    """A padding mask: no built-in path applies, so the new last one is asked after all and computes the call;
    removed, the blockwise kernel computes it again."""
    query, key, value, bias = alibi_call()
    mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
    blockwise, _ = sdpa_forward(Module(), query, key, value, mask, 8**-0.5, position_bias=bias)
    SDPA_PATHS.register(probe)
    asked = spy_on_applies(monkeypatch)
    output, _ = sdpa_forward(Module(), query, key, value, mask, 8**-0.5, position_bias=bias)
    assert asked == [*list(SDPA_PATHS)[:-1], PROBE] and torch.equal(output, torch.ones_like(output))
    monkeypatch.undo()
    del SDPA_PATHS[PROBE]
    again, _ = sdpa_forward(Module(), query, key, value, mask, 8**-0.5, position_bias=bias)
    torch.testing.assert_close(again, blockwise, atol=0, rtol=0)


def test_the_table_refuses_duplicates_unknown_places_and_misnamed_records(probe):
    paths = SdpaPaths(probe)
    with pytest.raises(ValueError, match="already registered"):
        paths.register(probe)
    with pytest.raises(ValueError, match="before='nowhere' is not an sdpa path"):
        paths.register(dataclasses.replace(probe, name="other"), before="nowhere")
    with pytest.raises(ValueError, match="must be an `SdpaPath` named 'other'"):
        paths["other"] = probe
    with pytest.raises(KeyError, match="'nowhere' is not an sdpa path"):
        paths["nowhere"]


def test_replace_keeps_the_place_and_returns_the_old_record(probe):
    paths = SdpaPaths(probe, dataclasses.replace(probe, name="second"))
    old = paths.replace(PROBE, applies=lambda *call: False)
    assert old is probe and list(paths) == [PROBE, "second"] and paths[PROBE].applies is not probe.applies


def test_every_path_is_named_in_a_profile():
    """Each path labels its calls `plugformer::<name>`, which `plugformer bench` reports as an SDPA backend."""
    assert all(path.profiler_name in SDPA_OPS for path in SDPA_PATHS.values())
    query, key, value, bias = alibi_call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        sdpa_forward(Module(), query, key, value, None, 8**-0.5, position_bias=bias)
    assert "plugformer::linear_bias" in {event.name for event in profiler.events()}
