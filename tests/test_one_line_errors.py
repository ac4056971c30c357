"""A user error at the command line is one line on stderr naming the input and what is allowed, with exit status 2
(`--debug` or `PLUGFORMER_DEBUG=1` shows the traceback): a missing or non-model folder, a bad path, a push to the Hub
while offline, a bad `--stage_configs` placeholder, a folder where a file is expected, zero examples to evaluate."""

from __future__ import annotations

import re

import pytest
from conftest import refuse_work


def one_line_error(capsys, argv: list[str]) -> str:
    """Runs the CLI, which must exit with status 2 and print one line (the traceback is behind --debug)."""
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "Traceback" not in error[0], error
    return error[0]


def test_eval_on_a_missing_or_non_model_folder_says_so(tmp_path, capsys):
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "missing")])
    assert line.startswith("ValueError: --model ") and "no such folder" in line
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello\n")
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path / "notes")])
    assert "is not a saved model folder (no config.json or tokenizer_config.json)" in line


def test_user_errors_print_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from plugformer.cli import main

    line = one_line_error(capsys, ["train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])
    assert line.startswith("ValueError: --max_steps -5: expected") and "PLUGFORMER_DEBUG=1" in line
    with pytest.raises(ValueError, match="max_steps -5"):
        main(["--debug", "train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])
    monkeypatch.setenv("PLUGFORMER_DEBUG", "1")
    with pytest.raises(ValueError, match="max_steps -5"):
        main(["train", "pretrain", "--output_dir", str(tmp_path), "--max_steps", "-5"])


def test_eval_of_zero_examples_is_refused_before_loading(finished, capsys):
    line = one_line_error(capsys, ["eval", "--model", str(finished), "--examples", "0"])
    assert line.startswith("ValueError: --examples 0: expected an integer >= 1")


def cli_error(capsys, argv) -> str:
    """The last stderr line of `plugformer ARGV`, which must exit 2 (a user error) in one line."""
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "pattern"),
    [
        (
            ["--model_name_or_path", "/nonexistent/model"],
            r"--model_name_or_path /nonexistent/model: /nonexistent/model does not exist",
        ),
        (["--output_dir", ""], r"--output_dir '': expected a folder path"),
        (["--output_dir", "{file}/sub"], r"--output_dir .*/afile/sub is under .*/afile, which is a file"),
        (["--push_to_hub", "true"], r"--push_to_hub true needs the Hub, but this run is offline"),
    ],
)
def test_a_stage_names_a_bad_path_or_an_offline_push_in_one_line(runs, tmp_path, capsys, monkeypatch, flags, pattern):
    from test_training import TINY, TRL

    (tmp_path / "afile").write_text("a file\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = [flag.replace("{file}", str(tmp_path / "afile")) for flag in flags]
    defaults = {"--model_name_or_path": str(runs / "final_only"), "--output_dir": str(tmp_path / "sft")}
    defaults.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    line = cli_error(capsys, ["train", "sft", *(x for pair in defaults.items() for x in pair), *TINY, *TRL])
    assert re.search(pattern, line), line


@pytest.mark.parametrize("template", ["configs/{stgae}/tiny.yaml", "configs/{0}/tiny.yaml", "configs/{stage/x.yaml"])
@pytest.mark.parametrize("command", ["compare", "extrapolate", "pipeline"])
def test_a_bad_stage_configs_placeholder_is_named(tmp_path, capsys, monkeypatch, command, template):
    monkeypatch.setattr("plugformer.training.run_stage", refuse_work)
    line = cli_error(capsys, [command, "--output_dir", str(tmp_path / "o"), "--stage_configs", template])
    assert f"--stage_configs {template!r}:" in line and "the only placeholder is {stage}" in line, line


def test_seeds_output_and_info_readme_refuse_a_folder(tmp_path, capsys):
    import json

    runs_made = []
    for seed in range(2):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        runs_made.append(run)
        (run / "results.json").write_text(json.dumps({"seed": seed, "stages": {}}))
    line = cli_error(capsys, ["info", "--readme", str(tmp_path)])
    assert f"--readme {tmp_path} is a folder" in line
    from plugformer.experiments import seeds

    with pytest.raises(ValueError, match=rf"--output {re.escape(str(tmp_path))} is a folder"):
        seeds.main([*map(str, runs_made), "--output", str(tmp_path)])
