"""Every option of every command, generated from its parser, fed boundary values of its type (0, -1, huge, nan, inf,
empty, a word that is no choice, a file where a folder is expected, a missing path): each run either reaches the
command's work (stubbed: a stage's output-folder claim, `run_stage`, model loading, figure saving, the benchmark) or
exits with status 2 and one line naming the option. Never a traceback, never a refusal that names another input.

The options are read from the parsers themselves (each command's `--help` hands its parser over), so a new option
or stage is covered without an edit here. The default tier runs a fixed sample of them (`DEFAULT_SAMPLE` per
command); `-m slow` runs every option with every value."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import time
from pathlib import Path

import pytest


class WorkReached(BaseException):  # a signal, not an error: no `except Exception` may swallow it
    """Raised by the stubs where a command's work would begin: every check before it passed."""


def reach_work(*_, **__):
    raise WorkReached


# the stubs: where each command's work begins (imported lazily by the commands, so patched where they live)
WORK = [
    "plugformer.training.distributed.claim_output_dir",  # every stage claims its folder after its own checks
    "plugformer.training.run_stage",  # compare's, pipeline's and demo's runs (not `train`'s own)
    "transformers.modeling_utils.PreTrainedModel.from_pretrained",  # eval, attention-map, extrapolate, plot, convert
    "plugformer.evaluation.figures.save_figure",  # plot
    "plugformer.bench.run",  # bench
]


def command_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the commands of `cli.COMMANDS` with options, plot's subcommands in place of plot; `train <stage>` for every
    registered stage), read from the tables, so a new command or stage is covered without an edit here."""
    from plugformer.cli import COMMANDS as TABLE
    from plugformer.evaluation.plots import parser as plot_parser
    from plugformer.training import STAGES

    plots = next(a for a in plot_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    without_options = ("train", "plot", "info", "accelerate-config")  # train: per stage; info: two switches
    commands = tuple(name for name in TABLE if name not in without_options) + tuple(f"plot {name}" for name in plots)
    return commands, tuple(f"train {name}" for name in STAGES)


COMMANDS, STAGE_COMMANDS = command_names()
DEFAULT_SAMPLE = 6  # options per command in the default tier (all of them under -m slow)
TIME_BOUND = 30.0  # seconds one refusal or acceptance may take


CLAIMS = ("claim_output_dir", "claim_folder", "claimed_folder")  # a command claims its output folder before work


def stub_work(monkeypatch, command: str) -> None:
    import sys

    for target in WORK:
        if command.startswith("train ") and target.endswith(".run_stage"):
            continue  # `plugformer train` is run_stage: its stage's checks run, up to the claim of its folder
        module_name, _, attribute = target.rpartition(".")
        owner_name, _, class_name = module_name.rpartition(".")
        if class_name[:1].isupper():  # a method: patched on its class
            monkeypatch.setattr(getattr(sys.modules[owner_name], class_name), attribute, classmethod(reach_work))
        else:
            monkeypatch.setattr(target, reach_work)
    import plugformer.runtime.run_folders  # where the claims live (a training run's: training.distributed)
    import plugformer.training.distributed  # noqa: F401 (a training run's claim, every rank together)

    for name, module in list(sys.modules.items()):  # and wherever a module imported one by name
        for claim in CLAIMS:
            if name.startswith("plugformer.") and hasattr(module, claim):
                monkeypatch.setattr(module, claim, reach_work)


class OverTime(BaseException):  # a signal, not an error
    """A case ran past `TIME_BOUND`."""


@contextlib.contextmanager
def bounded(seconds: float, extra_memory: int = 4 * 2**30):
    """Runs the block under an alarm after `seconds` (`OverTime`) and an address-space cap of `extra_memory` bytes
    above what the process maps now (a count of 2**63 must fail as a `MemoryError`, not exhaust the machine)."""
    import resource
    import signal

    def over(signum, frame):
        raise OverTime

    mapped = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmSize:")
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_memory, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def parser_of(command: str):
    """The parser `plugformer COMMAND --help` prints: handed over by the help it prints."""
    from plugformer.cli import main

    caught = []
    original = argparse.ArgumentParser.print_help

    def capture(self, file=None):
        caught.append(self)

    argparse.ArgumentParser.print_help = capture
    try:
        with pytest.raises(SystemExit):
            main([*command.split(), "--help"])
    finally:
        argparse.ArgumentParser.print_help = original
    return caught[-1]


def options_of(command: str) -> list[tuple[str, argparse.Action]]:
    """(option string, action) of each optional argument of `command`, help and --config aside."""
    found = []
    for action in parser_of(command)._actions:
        names = [name for name in action.option_strings if name.startswith("--")]
        if names and not isinstance(action, argparse._HelpAction) and names[0] != "--config":
            found.append((names[0], action))
    return found


def boundary_values(action: argparse.Action, folder: Path) -> list[str]:
    """Values at the edges of what `action` takes, by its type: numbers at and past their ends and of the wrong type;
    for a path, empty, missing, a file where a folder may be expected and the reverse, a file this user may not read
    and a folder it may not write (`denied_paths` makes them so, as for any user but root)."""
    afile, missing = str(folder / "afile"), str(folder / "missing" / "x")
    if action.nargs == 0:
        return []  # a switch: nothing to feed
    if action.choices is not None:
        return ["not-a-choice"]
    kind = getattr(action.type, "__name__", str(action.type))
    if kind == "int":
        return ["0", "-1", str(2**63), "1.5", "abc"]
    if kind == "float":
        return ["0", "-1", "nan", "inf", "1e308", "abc"]
    if "bool" in kind:
        return ["maybe"]
    values = ["", missing]
    if any(word in action.dest for word in PATH_WORDS):
        # a file where a folder may be expected, a folder where a file may, unreadable, in a folder it cannot write
        values += [afile, str(folder / "afolder"), str(folder / UNREADABLE), str(folder / READ_ONLY / "x")]
    return values


PATH_WORDS = ("dir", "model", "path", "output", "file", "config", "cache", "data")
UNREADABLE, READ_ONLY = "unreadable.txt", "read-only"


@contextlib.contextmanager
def denied_paths(folder: Path):
    """Makes `folder/unreadable.txt` unreadable and `folder/read-only` unwritable as they are for a user other than
    root (which the suite may run as, and which the modes do not stop): `os.access` answers no, and opening the
    file, or creating anything in the folder, raises `PermissionError` (errno 13) with the path."""
    import builtins
    import errno
    import io
    import os

    unreadable, read_only = str(folder / UNREADABLE), str(folder / READ_ONLY)
    original_open, original_os_open, original_access = builtins.open, os.open, os.access
    original_mkdir = os.mkdir

    def denied(path, writing: bool) -> bool:
        path = os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else ""
        inside = path == read_only or path.startswith(read_only + os.sep)
        return path == unreadable or (writing and inside)

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    def guarded_open(file, mode="r", *args, **kwargs):
        if denied(file, any(flag in mode for flag in "wax+")):
            refuse(file)
        return original_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        if denied(path, bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))):
            refuse(path)
        return original_os_open(path, flags, *args, **kwargs)

    def guarded_access(path, mode, *args, **kwargs):
        if denied(path, bool(mode & os.W_OK)) or (os.path.abspath(os.fspath(path)) == unreadable and mode & os.R_OK):
            return False
        return original_access(path, mode, *args, **kwargs)

    def guarded_mkdir(path, *args, **kwargs):
        if denied(path, True):
            refuse(path)
        return original_mkdir(path, *args, **kwargs)

    (folder / READ_ONLY).mkdir(exist_ok=True)
    (folder / UNREADABLE).write_text("secret\n")
    builtins.open = io.open = guarded_open
    os.open, os.access, os.mkdir = guarded_os_open, guarded_access, guarded_mkdir
    try:
        yield
    finally:
        builtins.open = io.open = original_open
        os.open, os.access, os.mkdir = original_os_open, original_access, original_mkdir


def base_argv(command: str, folder: Path, model: Path) -> list[str]:
    """The least a command needs to reach its work, so that one option at a time is what is tested."""
    from plugformer.training import STAGES

    if command.startswith("train "):
        stage = command.split()[1]
        parent = STAGES.get_stage(stage).parent is not None  # pretrain, seq2seq and nli start anew
        needs = {
            "rlhf": ["--reward_model_path", str(model.parent / "reward")],
            "sft_matched": ["--match_compute_of", str(model.parent / "reward")],
        }
        return [
            *command.split(),
            "--output_dir",
            str(folder / "out"),
            *(["--model_name_or_path", str(model)] if parent else []),
            *needs.get(stage, []),
        ]
    return {
        "eval": ["eval", "--model", str(model), "--output", str(folder / "eval.json")],
        "attention-map": ["attention-map", "--model", str(model), "--output", str(folder / "map.png")],
        "plot positions": ["plot", "positions", "--model", str(model), "--output", str(folder / "p.png")],
        "plot sinusoidal": ["plot", "sinusoidal", "--output", str(folder / "s.png")],
        "plot curves": ["plot", "curves", str(folder / "run"), "--output", str(folder / "c.png")],
        "convert": ["convert", str(model.parent / "llama"), str(folder / "converted")],
        "seeds": ["seeds", str(folder / "seed0"), str(folder / "seed1"), "--output", str(folder / "seeds.md")],
    }.get(command, [command, "--output_dir", str(folder / "out")])


def named(option: str, line: str) -> bool:
    """Whether a refusal names `option` (as --name, or the field name with its value), or the new name of a renamed
    option (`--gradient_checkpointing` is `--activation_checkpointing`, TRL's `--vllm_importance_sampling_cap` is
    `--vllm_importance_sampling_clip_max`)."""
    from plugformer.training.trainer_options import RENAMED_TRAINER_OPTIONS

    renamed = {old: new for new, old in RENAMED_TRAINER_OPTIONS.items()}
    renamed["vllm_importance_sampling_cap"] = "vllm_importance_sampling_clip_max"
    bare = option.lstrip("-")
    return any(
        option in line or re.search(rf"\b{re.escape(name)}\b", line) is not None
        for option, name in ((option, bare), (f"--{renamed.get(bare, bare)}", renamed.get(bare, bare)))
    )


def run_one(
    command: str,
    option: str,
    value: str,
    folder: Path,
    model: Path,
    monkeypatch,
    capsys,
    base_only: bool = False,
    joined: bool = False,
) -> str | None:
    """`plugformer COMMAND OPTION VALUE` (`OPTION=VALUE` when `joined`: a value may start with "-"): None when it
    reached its work (stubbed) or refused in one line naming the option; else what went wrong. `base_only`: the
    command with its base arguments alone must reach its work."""
    from plugformer.cli import main

    stub_work(monkeypatch, command)
    started = time.perf_counter()
    given = (f"{option}={value}",) if joined else (option, value)
    argv = [*base_argv(command, folder, model), *(() if base_only else given)]
    shown = f"{command} {option} {value!r}"
    problem = None
    try:
        with bounded(TIME_BOUND), denied_paths(folder):
            main(argv)  # finished without work to do
    except WorkReached:
        pass
    except OverTime:
        problem = f"{shown}: still running after {TIME_BOUND:.0f} s"
    except SystemExit as exit_info:
        err = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", capsys.readouterr().err, flags=re.S)
        line = err.strip().splitlines()[-1] if err.strip() else ""
        if exit_info.code not in (0, 2) or "Traceback" in err:
            problem = f"{shown}: exit {exit_info.code}, {'a traceback' if 'Traceback' in err else line}"
        elif exit_info.code == 2 and (base_only or not named(option, line)):
            problem = f"{shown}: refused without naming {option}: {line[:300]}"
    except Exception as error:  # what the CLI lets through: a traceback for the user
        problem = f"{shown}: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
    finally:
        monkeypatch.undo()
        capsys.readouterr()
    elapsed = time.perf_counter() - started
    if problem is None and elapsed > TIME_BOUND:
        problem = f"{shown}: {elapsed:.0f} s"
    return problem


def sample(items: list, count: int | None, salt: str) -> list:
    """A fixed sample of `count` of `items` (by a digest of each, so it is the same every run), or all of them."""
    if count is None or len(items) <= count:
        return items
    return sorted(items, key=lambda item: hashlib.sha256(f"{salt}|{item[0]}".encode()).hexdigest())[:count]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny saved causal LM with its tokenizer (built, not trained); beside it a reward model (`reward`) and a
    transformers Llama (`llama`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plugformer import PlugformerConfig, PlugformerForCausalLM, PlugformerForSequenceClassification, train_tokenizer

    folder = tmp_path_factory.mktemp("boundaries") / "model"
    tokenizer = train_tokenizer([f"the cat sat on mat number {index}" for index in range(100)], vocab_size=300)
    config = PlugformerConfig.from_preset(
        "tiny",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    PlugformerForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    reward = PlugformerForSequenceClassification(PlugformerConfig(**{**config.to_dict(), "num_labels": 1}))
    reward.save_pretrained(folder.parent / "reward")  # what `train rlhf --reward_model_path` reads
    tokenizer.save_pretrained(folder.parent / "reward")
    # a finished stage's record of its compute, descending from `model`: what `train sft_matched` matches
    run_info = {"stage": "reward", "compute": {"parent": str(folder), "train_tokens": 4096}}
    (folder.parent / "reward" / "run_info.json").write_text(json.dumps(run_info))
    llama = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(llama).save_pretrained(folder.parent / "llama")  # what `convert` reads
    return folder


def check_command(command: str, count: int | None, model: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "afile").write_text("a file\n")
    (tmp_path / "afolder").mkdir()
    (tmp_path / "run").mkdir()  # a training log, what `plot curves` reads
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 1.0}]}))
    for seed in range(2):  # what `plugformer seeds` reads
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "results.json").write_text(json.dumps({"seed": seed, "stages": {}}))
    base = run_one(command, "--help", "", tmp_path, model, monkeypatch, capsys, base_only=True)
    if base is not None:  # what a command needs besides one option (a finished RL run to match): nothing to learn
        pytest.skip(f"{command} refuses its base arguments: {base}")
    problems = []
    for option, action in sample(options_of(command), count, command):
        for value in boundary_values(action, tmp_path):
            problems.append(run_one(command, option, value, tmp_path, model, monkeypatch, capsys))
    problems = [problem for problem in problems if problem is not None]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


@pytest.mark.parametrize("command", COMMANDS + STAGE_COMMANDS)
def test_a_sample_of_each_commands_options_is_refused_in_one_line_or_accepted(
    command, model, tmp_path, monkeypatch, capsys
):
    count = DEFAULT_SAMPLE if command in COMMANDS else 2
    check_command(command, count, model, tmp_path, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS + STAGE_COMMANDS)
def test_every_option_of_every_command_is_refused_in_one_line_or_accepted(
    command, model, tmp_path, monkeypatch, capsys
):
    check_command(command, None, model, tmp_path, monkeypatch, capsys)


def typed_options() -> list[tuple[str, str, str]]:
    """(command, option, its type's name) of every int, float or text option of every command, in a fixed order."""
    found = []
    for command in COMMANDS + STAGE_COMMANDS:
        for option, action in options_of(command):
            kind = getattr(action.type, "__name__", str(action.type))
            if action.nargs != 0 and action.choices is None and kind in ("int", "float", "str", "None"):
                found.append((command, option, kind))
    return found


def drawn_value(draw, kind: str) -> str:
    """A value of any size, sign or spelling for an option of `kind`: integers past 64 bits, floats with nan, inf and
    subnormals, numbers in another notation, and any text (control characters, non-ASCII, YAML-looking)."""
    from hypothesis import strategies as st

    numbers = st.one_of(st.integers(-(2**70), 2**70).map(str), st.floats().map(repr), st.floats().map("{:e}".format))
    if kind in ("int", "float"):
        return draw(st.one_of(numbers, st.text(max_size=12)))
    return draw(st.one_of(st.text(max_size=40), numbers, st.sampled_from(["{a: [1, *x]}", "- - -", "~", "null"])))


def check_drawn_options(count: int, model: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Property: for any value hypothesis draws for any typed option, the command reaches its work or refuses in one
    line naming the option, in time (the run's problems are collected, so one failure shows them all)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    (tmp_path / "afile").write_text("a file\n")
    options = typed_options()
    problems = []

    @settings(
        max_examples=count,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.data())
    def one(data):
        command, option, kind = data.draw(st.sampled_from(options))
        value = drawn_value(data.draw, kind)
        if "\x00" in value:  # no argv can hold a NUL
            return
        problem = run_one(command, option, value, tmp_path, model, monkeypatch, capsys, joined=True)
        if problem is not None:
            problems.append(problem)

    one()
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_drawn_values_for_typed_options_are_refused_in_one_line_or_accepted(model, tmp_path, monkeypatch, capsys):
    check_drawn_options(60, model, tmp_path, monkeypatch, capsys)


@pytest.mark.slow
def test_many_drawn_values_for_typed_options_are_refused_in_one_line_or_accepted(model, tmp_path, monkeypatch, capsys):
    check_drawn_options(600, model, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("command", COMMANDS + STAGE_COMMANDS)
def test_a_corpus_file_without_its_dataset_name_is_refused_not_ignored(command, model, tmp_path, monkeypatch, capsys):
    """`--data_files` (and `--dataset_config`) describe your data only beside `--dataset_name`: alone, every command
    that takes them refuses them by name instead of training on the embedded data (exit 0, the file unread)."""
    from plugformer.cli import main

    given = {option for option, _ in options_of(command)}
    if "--data_files" not in given or "--dataset_name" not in given:
        pytest.skip(f"{command} takes no corpus of yours")
    (tmp_path / "afile").write_text("a file\n")
    for option, value in (("--data_files", str(tmp_path / "afile")), ("--dataset_config", "default")):
        if option not in given:
            continue
        stub_work(monkeypatch, command)
        try:
            with pytest.raises(SystemExit) as exit_info:
                main([*base_argv(command, tmp_path, model), option, value])
        except WorkReached:
            pytest.fail(f"{command} {option} {value}: reached its work without --dataset_name (the option ignored)")
        finally:
            monkeypatch.undo()
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and f"{option} " in line and "--dataset_name" in line, line
