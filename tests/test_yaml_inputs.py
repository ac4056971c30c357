"""Every YAML-valued input goes through one reader with one node cap (`runtime.yaml_text`): a config file
(`--config`) and a value on the command line (`convert --set`, `--config_overrides`, which `compare --grid` fills)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from plugformer.cli import main
from plugformer.runtime.yaml_text import MAX_YAML_VALUES, load_yaml_text, read_yaml
from plugformer.training.arguments import parse_overrides


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """A block-style "billion laughs": `width ** levels` values from under a kB, with no comma (a `--config_overrides`
    item ends at a comma) and no `=`."""
    lines = ["- &a0 lol"]
    for level in range(1, levels + 1):
        lines += [f"- &a{level}", *[f"  - *a{level - 1}"] * width]
    return "\n".join(lines) + "\n"


BOMB = alias_bomb()
# a hang is what this guards against: a refusal takes milliseconds, the bomb minutes and gigabytes
SECONDS = 20.0


def test_the_bomb_is_small_and_would_expand_past_the_cap():
    assert len(BOMB) < 1000 and "," not in BOMB and "=" not in BOMB
    assert 10**9 > MAX_YAML_VALUES


def test_one_reader_caps_a_file_and_a_command_line_value_alike(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    limit = rf"at most {MAX_YAML_VALUES}"
    with pytest.raises(
        ValueError, match=rf"^--config {re.escape(str(path))}: its aliases expand to \d+ values \({limit}"
    ):
        read_yaml(path)
    with pytest.raises(ValueError, match=rf"^--set hidden_act: its aliases expand to \d+ values \({limit}"):
        load_yaml_text(BOMB, "--set hidden_act")
    with pytest.raises(ValueError, match=rf"^--config_overrides norm_type: its aliases expand to \d+ values \({limit}"):
        parse_overrides(f"norm_type={BOMB}", "config_overrides")


def test_command_line_values_read_as_the_config_files_do():
    # YAML 1.2 floats and a refused duplicate key, as in --config files (PyYAML's safe_load read '1e-3' as a string)
    assert parse_overrides("attention_dropout=1e-3,norm_type=layernorm", "config_overrides") == {
        "attention_dropout": 1e-3,
        "norm_type": "layernorm",
    }
    with pytest.raises(ValueError, match=r"^--set rope_parameters: .*key 'factor' is given twice"):
        load_yaml_text("{factor: 2, factor: 4}", "--set rope_parameters")


def _argv(entry: str, tmp_path: Path) -> list[str]:
    config = tmp_path / "bomb.yaml"
    config.write_text(BOMB)
    return {
        "convert --set": ["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--set", f"hidden_act={BOMB}"],
        "train --config_overrides": [
            "train",
            "pretrain",
            "--output_dir",
            str(tmp_path / "run"),
            "--config_overrides",
            f"norm_type={BOMB}",
        ],
        "train --config": ["train", "pretrain", "--config", str(config), "--output_dir", str(tmp_path / "run")],
        "demo --config": ["demo", "--config", str(config), "--output_dir", str(tmp_path / "run")],
    }[entry]


@pytest.mark.parametrize("entry", ["convert --set", "train --config_overrides", "train --config", "demo --config"])
def test_an_alias_bomb_is_refused_in_one_line_at_every_yaml_valued_input(entry, tmp_path, capsys):
    option = entry.split()[-1]
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(entry, tmp_path))
    elapsed = time.monotonic() - start
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error, error
    assert re.match(rf"ValueError: {option}\b.*its aliases expand to \d+ values \(at most {MAX_YAML_VALUES}\)", error)
    assert elapsed < SECONDS, f"{entry}: refused after {elapsed:.1f} s"
