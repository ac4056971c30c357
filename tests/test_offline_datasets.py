"""A Hub dataset id while the Hub is offline (plugformer's default, `runtime.offline`) is refused in one line that
names the id and the switch, `HF_HUB_OFFLINE=0`, instead of `datasets`' 41-line `ConnectionError` traceback. No test
here reaches the network: the Hub is switched off in the libraries themselves first."""

from __future__ import annotations

import pytest

from plugformer.cli import main as cli_main


MADE_UP = "made-up-org/no-such-dataset-4f1c"


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)


def refused(message: str) -> None:
    assert MADE_UP in message and "HF_HUB_OFFLINE=0" in message and "offline" in message


def test_loading_a_hub_id_offline_is_a_value_error_naming_it(tmp_path):
    from plugformer.data.sources import load_stage_dataset

    with pytest.raises(ValueError) as error:
        load_stage_dataset("conversation", MADE_UP, data_cache_dir=str(tmp_path))
    refused(str(error.value))
    assert isinstance(error.value.__cause__, ConnectionError)  # --debug still shows datasets' own error


def test_streaming_a_hub_id_offline_is_refused_too():
    from plugformer.data.prepare import stream_corpus

    with pytest.raises(ValueError) as error:
        stream_corpus({"path": MADE_UP}, dev=2, test=2)
    refused(str(error.value))


@pytest.mark.parametrize("streaming", [False, True])
def test_eval_held_out_rows_of_a_hub_id_offline_are_refused(streaming):
    from plugformer.evaluation.held_out import held_out_rows

    source = {
        "dataset_name": MADE_UP,
        "dataset_config": None,
        "data_files": None,
        "dataset_seed": 0,
        "streaming": streaming,
        "dev_examples": 2,
        "test_examples": 2,
        "files": [],
    }
    with pytest.raises(ValueError) as error:
        held_out_rows(source, "test", 2)
    refused(str(error.value))


def test_the_cli_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(
            [
                "train",
                "pretrain",
                "--config",
                "configs/pretrain/tiny.yaml",
                "--dataset_name",
                MADE_UP,
                "--output_dir",
                str(tmp_path / "out"),
                "--report_to",
                "none",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("ValueError: --dataset_name")
    refused(err)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_online_a_connection_error_is_not_rewritten(monkeypatch):
    """Online, a `ConnectionError` is a real network failure: passed on as it is (not blamed on the offline switch)."""
    import datasets.config
    import huggingface_hub.constants

    from plugformer.data.validation import refusing_hub_ids_offline

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ConnectionError), refusing_hub_ids_offline(MADE_UP):
        raise ConnectionError("the network is down")
