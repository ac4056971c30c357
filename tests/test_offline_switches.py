"""No connection leaves the machine unless the user turns the Hub on: plugformer's offline defaults
(`runtime.offline`) hold whatever another library's switch says, only `HF_HUB_OFFLINE=0` turns the Hub back on, Hub
kernels stay off unless the user turns them on, and a stage run through the CLI opens no connection off the machine."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("other", ["HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DISABLE_TELEMETRY"])
@pytest.mark.parametrize("value", ["1", "0"])
def test_another_libraries_switch_does_not_turn_plugformers_offline_default_off(other, value):
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {other: value}
    applied = apply_offline_defaults(environ)
    assert environ["HF_HUB_OFFLINE"] == "1" and environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert applied == {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "USE_HUB_KERNELS": "NO"}


def test_only_the_documented_switch_turns_the_hub_back_on():
    from plugformer.runtime.offline import apply_offline_defaults

    environ = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}
    assert apply_offline_defaults(environ) == {"HF_HUB_DISABLE_TELEMETRY": "1", "USE_HUB_KERNELS": "NO"}
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


def test_a_stage_through_the_cli_opens_no_connection_off_the_machine(finished, tmp_path, monkeypatch):
    """Telemetry and Hub switches as a fresh shell has them (none set, not CI); every connection and name lookup
    is recorded, and any that is not loopback fails."""
    import ipaddress
    import socket
    import time

    import huggingface_hub.constants
    from huggingface_hub.utils import _telemetry
    from test_training import TINY, TRL

    from plugformer.cli import main

    for name in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY",
        "DISABLE_TELEMETRY",
        "USE_HUB_KERNELS",
        "CI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", False)
    attempts = []

    def loopback(host) -> bool:
        if host in (None, "", "localhost") or isinstance(host, bytes):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not loopback(address[0]):
            attempts.append(address)
            raise OSError(f"test guard: connection to {address} refused")
        return real_connect(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if not loopback(host):
            attempts.append(host)
            raise socket.gaierror(f"test guard: lookup of {host} refused")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    main(["train", "sft", "--output_dir", str(tmp_path / "sft"), "--model_name_or_path", str(finished), *TINY, *TRL])
    deadline = time.time() + 10  # telemetry is sent from a daemon thread: let its queue drain
    while _telemetry._TELEMETRY_QUEUE.unfinished_tasks and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "sft" / "run_info.json").exists()
    assert attempts == []


def hub_kernels_enabled(environ: dict[str, str], monkeypatch) -> bool:
    """transformers' own answer to "fetch Hub kernels?" under `environ`: 5.25 reads `USE_HUB_KERNELS` at each call
    (`_kernels_enabled()`, default on), 5.19-5.24 once at import, against `ENV_VARS_TRUE_VALUES` (default on)."""
    from transformers.integrations import hub_kernels
    from transformers.utils.import_utils import ENV_VARS_TRUE_VALUES

    if callable(hub_kernels._kernels_enabled):
        monkeypatch.delenv("USE_HUB_KERNELS", raising=False)  # conftest's "NO", unless `environ` names it
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        return hub_kernels._kernels_enabled()
    return environ.get("USE_HUB_KERNELS", "YES").upper() in ENV_VARS_TRUE_VALUES


def test_the_offline_defaults_turn_hub_kernels_off_unless_the_user_turned_them_on(monkeypatch):
    from plugformer.runtime.offline import apply_offline_defaults

    conftests = os.environ["USE_HUB_KERNELS"]  # read first: the helper's monkeypatch changes the environment
    environ: dict[str, str] = {}
    assert apply_offline_defaults(environ) == {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "USE_HUB_KERNELS": "NO",
    }
    assert not hub_kernels_enabled(environ, monkeypatch)
    assert hub_kernels_enabled({}, monkeypatch)  # transformers' default, which the defaults override
    mine = {"USE_HUB_KERNELS": "YES"}
    assert "USE_HUB_KERNELS" not in apply_offline_defaults(mine) and mine["USE_HUB_KERNELS"] == "YES"
    assert not hub_kernels_enabled({"USE_HUB_KERNELS": conftests}, monkeypatch)


@pytest.mark.parametrize("score,scheme", [("scaled_dot", "rope"), ("additive", "t5_bias"), ("multiplicative", "alibi")])
def test_no_plugformer_layer_names_a_hub_kernel(score, scheme):
    """transformers 5.25 kernelizes, by default at load, the layers its `use_kernel_forward_from_hub` marked (the
    mark is a `kernel_layer_name` class attribute; from 5.25, where `kernels` is a dependency, the activations of
    `ACT2FN` carry it): plugformer's own layers carry none, so only transformers' activation modules, the ones Llama's
    MLP holds too, can be swapped for a Hub kernel of the same function, and never where `USE_HUB_KERNELS` is off."""
    from conftest import tiny_config

    from plugformer import PlugformerForCausalLM

    model = PlugformerForCausalLM(tiny_config(score, scheme))
    marked = {type(module) for module in model.modules() if hasattr(type(module), "kernel_layer_name")}
    assert all(kind.__module__ == "transformers.activations" for kind in marked), marked
