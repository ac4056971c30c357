"""Issue 34 (round 3 of "nothing lost, nothing silently wrong") and issue 35's resume cases: each test failed before
its fix. Data loss, silently wrong results, a network leak, hangs, and tracebacks where one line naming the input
belongs."""

from __future__ import annotations

import pytest


# --- network: offline stays the default whatever else is set -------------------------------------------------------


@pytest.mark.parametrize("other", ["HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DISABLE_TELEMETRY"])
@pytest.mark.parametrize("value", ["1", "0"])
def test_another_libraries_switch_does_not_turn_plugformers_offline_default_off(other, value):
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {other: value}
    applied = apply_offline_defaults(environ)
    assert environ["HF_HUB_OFFLINE"] == "1" and environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert applied == {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_only_the_documented_switch_turns_the_hub_back_on():
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}
    assert apply_offline_defaults(environ) == {"HF_HUB_DISABLE_TELEMETRY": "1"}
    assert environ["HF_HUB_OFFLINE"] == "0"
    environ = {"HF_HUB_OFFLINE": ""}  # set but empty: the libraries read it as unset, so it is no opt-in
    apply_offline_defaults(environ)
    assert environ["HF_HUB_OFFLINE"] == "1"


def test_the_imported_hub_is_switched_offline_when_the_user_set_only_datasets_offline(monkeypatch):
    import os

    import huggingface_hub.constants

    from plugformer.runtime.offline import apply_offline_defaults

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    apply_offline_defaults()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE is True
