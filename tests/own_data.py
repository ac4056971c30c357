"""What the suites that train stages on a user's files share: the shipped tiny config run through the command line,
as the README gives it, and one pretrained model per module to start from."""

from __future__ import annotations

from pathlib import Path

from plugformer.cli import main as cli_main


ROOT = Path(__file__).resolve().parents[1]


def train_on_file(name: str, output: Path, parent: Path, data: Path, *flags: str) -> None:
    """`plugformer train <name> --config configs/<name>/tiny.yaml` from `parent` on the JSON lines file `data`."""
    cli_main(
        [
            "train",
            name,
            "--config",
            str(ROOT / f"configs/{name}/tiny.yaml"),
            "--model_name_or_path",
            str(parent),
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--output_dir",
            str(output),
            *flags,
        ]
    )


def pretrained_folder(tmp_path_factory, label: str) -> Path:
    """A tiny pretrained model (`test_training.train`) in a fresh temporary folder named after `label`."""
    from test_training import train

    folder = tmp_path_factory.mktemp(label) / "pretrain"
    train("pretrain", folder)
    return folder
