"""A mistake in what the user gave (a flag, a file, a folder, a key press) is one line naming it and what is
allowed, with exit status 2 (130 for Ctrl-C), before any work; or it works as a user expects, as documented."""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
from pathlib import Path

import pytest
import torch


WORDS = "the cat sat on a mat and dog ran far away from home near old red tree".split()


def sentence(index: int, length: int = 6) -> str:
    return " ".join(WORDS[(index * 7 + step * 3) % len(WORDS)] for step in range(length)) + f" {index}"


def cli_error(capsys, argv: list[str], code: int = 2) -> str:
    """The one line `plugformer ARGV` prints as it exits with `code`, with no traceback."""
    from plugformer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    # pytest's capture closes the stream that a library's log handler took in an earlier test: logging then prints
    # "--- Logging error ---" with a traceback of its own, which the command never printed
    err = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", capsys.readouterr().err, flags=re.S)
    assert exit_info.value.code == code, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    return err.strip().splitlines()[-1]


def refuse_work(*_, **__):
    raise AssertionError("work started")


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def documents(count: int = 40) -> list[dict]:
    return [{"text": sentence(index, 30)} for index in range(count)]


def deny_writes_under(monkeypatch, folder: Path) -> None:
    """`os.access` says `folder` (and what is under it) is not writable: the tests run as root, whom modes ignore."""
    from plugformer.runtime import files

    real = os.access
    monkeypatch.setattr(
        files.os, "access", lambda path, mode, **kw: not Path(path).is_relative_to(folder) and real(path, mode, **kw)
    )


PRETRAIN = ["--preset", "tiny", "--vocab_size", "300", "--block_size", "32", "--max_position_embeddings", "128",
            "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--max_steps", "1",
            "--dev_examples", "2", "--test_examples", "2", "--held_out_fraction", "1", "--exact_match_examples", "0",
            "--dataloader_pin_memory", "false"]  # fmt: skip
CLASSIFY = ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--dev_examples", "4",
            "--test_examples", "4", "--held_out_fraction", "1", "--max_length", "32", "--learning_rate", "0",
            "--weight_decay", "0", "--dataloader_pin_memory", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Tiny saved models with one tokenizer, built (not trained): `lm` (a causal LM), `clf3` (a 3-label classifier
    on it) and `nli` (a 3-label decomposable attention model)."""
    from plugformer import (
        DecomposableAttentionConfig,
        DecomposableAttentionForSequenceClassification,
        PlugformerConfig,
        PlugformerForCausalLM,
        PlugformerForSequenceClassification,
        train_tokenizer,
    )

    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer([sentence(index, 12) for index in range(200)], vocab_size=300)
    special = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    labels = {"id2label": {0: "a", 1: "b", 2: "c"}, "label2id": {"a": 0, "b": 1, "c": 2}}
    torch.manual_seed(0)
    built = {
        "lm": PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", **sizes, **special)),
        "clf3": PlugformerForSequenceClassification(PlugformerConfig.from_preset("tiny", **sizes, **special, **labels)),
        "nli": DecomposableAttentionForSequenceClassification(
            DecomposableAttentionConfig(
                embedding_size=8, hidden_size=8, sep_token_id=tokenizer.sep_token_id, **special, **labels
            )
        ),
    }
    for name, model in built.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


# --- 1. the corpus cache: a file, the variable, a read-only folder --------------------------------------------------


@pytest.mark.parametrize("given", ["flag", "variable", "under a file"])
def test_a_cache_dir_that_is_a_file_is_refused_naming_it_before_the_data_loads(tmp_path, capsys, monkeypatch, given):
    from datasets import load_dataset  # noqa: F401 (imported before it is replaced below)

    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    data = write_jsonl(tmp_path / "docs.jsonl", documents())
    monkeypatch.setattr("plugformer.data.user_data.load_dataset", refuse_work)
    cache = {
        "flag": ["--data_cache_dir", str(afile)],
        "variable": [],
        "under a file": ["--data_cache_dir", str(afile / "cache")],
    }[given]
    monkeypatch.setenv("PLUGFORMER_CACHE", str(afile))
    line = cli_error(
        capsys,
        [
            "train",
            "pretrain",
            *PRETRAIN,
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
            *cache,
        ],
    )
    named = f"PLUGFORMER_CACHE={afile}" if given == "variable" else f"--data_cache_dir {cache[1]}"
    assert line.startswith(f"ValueError: {named}: ") and "is a file" in line, line
    assert "the corpus cache must be a folder" in line


def test_a_read_only_cache_is_refused_before_the_tokenizer_trains(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    deny_writes_under(monkeypatch, cache)
    monkeypatch.setattr("plugformer.data.tokenization.train_tokenizer", refuse_work)
    data = write_jsonl(tmp_path / "docs.jsonl", documents())
    line = cli_error(
        capsys,
        [
            "train",
            "pretrain",
            *PRETRAIN,
            "--dataset_name",
            "json",
            "--data_files",
            str(data),
            "--data_cache_dir",
            str(cache),
            "--output_dir",
            str(tmp_path / "out"),
        ],
    )
    assert line.startswith("ValueError: the corpus cache has no tokenizers entry ")
    assert f"{cache} is not writable by this user" in line and "--data_cache_dir" in line


# --- 2. eval into a folder it cannot write -------------------------------------------------------------------------


@pytest.mark.parametrize("output", [None, "elsewhere"])
def test_eval_refuses_a_results_folder_it_cannot_write_before_scoring(models, tmp_path, capsys, monkeypatch, output):
    import shutil

    from plugformer.evaluation import scoring

    model = shutil.copytree(models / "lm", tmp_path / "model")
    target = model if output is None else tmp_path / "ro"
    target.mkdir(exist_ok=True)
    deny_writes_under(monkeypatch, target)
    monkeypatch.setattr(scoring, "evaluate_directory", refuse_work)
    flags = [] if output is None else ["--output", str(target / "results.json")]
    line = cli_error(capsys, ["eval", "--model", str(model), *flags])
    default = " (the default, in --model" if output is None else ""
    assert line.startswith(f"ValueError: --output {target}/") and default in line, line
    assert f"{target} is not writable by this user" in line and "give --output FILE.json" in line


# --- 3. classify from a classifier of another label count ----------------------------------------------------------


def test_classify_from_a_classifier_of_other_labels_keeps_all_but_a_new_head(models, tmp_path, caplog):
    from safetensors.torch import load_file

    from plugformer.cli import main

    data = write_csv(tmp_path / "two.csv", ["text", "label"], [[sentence(i), "xy"[i % 2]] for i in range(40)])
    with caplog.at_level("WARNING", logger="plugformer.training.stages.classify"):
        main(
            [
                "train",
                "classify",
                *CLASSIFY,
                "--model_name_or_path",
                str(models / "clf3"),
                "--dataset_name",
                "csv",
                "--data_files",
                str(data),
                "--output_dir",
                str(tmp_path / "clf2"),
            ]
        )
    assert "is a classifier of 3 labels ['a', 'b', 'c']; your data has 2: ['x', 'y']" in caplog.text
    assert "replaced by a new 2-way head" in caplog.text
    parent, child = load_file(models / "clf3/model.safetensors"), load_file(tmp_path / "clf2/model.safetensors")
    assert child["score.weight"].shape == (2, 32) and parent["score.weight"].shape == (3, 32)
    assert all(child[name].equal(parent[name]) for name in parent if name != "score.weight")  # learning rate 0
    assert json.loads((tmp_path / "clf2/config.json").read_text())["id2label"] == {"0": "x", "1": "y"}


def test_classify_from_the_nli_model_takes_a_new_head_or_refuses_data_without_pairs(models, tmp_path, capsys):
    from safetensors.torch import load_file

    from plugformer.cli import main

    pairs = write_csv(
        tmp_path / "pairs.csv",
        ["text", "text_pair", "label"],
        [[sentence(i), sentence(i + 1), "xy"[i % 2]] for i in range(40)],
    )
    main(
        [
            "train",
            "classify",
            *CLASSIFY,
            "--model_name_or_path",
            str(models / "nli"),
            "--dataset_name",
            "csv",
            "--data_files",
            str(pairs),
            "--output_dir",
            str(tmp_path / "from_nli"),
        ]
    )
    assert load_file(tmp_path / "from_nli/model.safetensors")["classifier.weight"].shape == (2, 8)
    single = write_csv(tmp_path / "single.csv", ["text", "label"], [[sentence(i), "xyz"[i % 3]] for i in range(40)])
    line = cli_error(
        capsys,
        [
            "train",
            "classify",
            *CLASSIFY,
            "--model_name_or_path",
            str(models / "nli"),
            "--dataset_name",
            "csv",
            "--data_files",
            str(single),
            "--output_dir",
            str(tmp_path / "refused"),
        ],
    )
    assert line.startswith(f"ValueError: --model_name_or_path {models / 'nli'} is the nli stage's decomposable")
    assert "no text_pair column" in line


# --- 4. a CSV row with an extra field -----------------------------------------------------------------------------


def test_a_csv_row_with_an_extra_field_is_named_by_file_and_line(models, tmp_path, capsys):
    rows = [[sentence(i), "ab"[i % 2]] for i in range(40)]
    rows[17].append("oops")  # the file's line 19 (the header is line 1)
    data = write_csv(tmp_path / "extra.csv", ["text", "label"], rows)
    line = cli_error(
        capsys,
        [
            "train",
            "classify",
            *CLASSIFY,
            "--model_name_or_path",
            str(models / "lm"),
            "--dataset_name",
            "csv",
            "--data_files",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
        ],
    )
    assert f"{data} line 19: 3 fields where its header has 2 (text, label)" in line, line


# --- 5. and 6. convert: a missing local folder, an override that changes a tensor's shape ---------------------------


@pytest.mark.parametrize("source", ["{tmp}/missing/llama", "./missing-llama", "~/missing-llama-59", "missing-llama"])
def test_convert_names_a_missing_source_folder(tmp_path, capsys, source):
    source = source.replace("{tmp}", str(tmp_path))
    line = cli_error(capsys, ["convert", source, str(tmp_path / "out")])
    shown = Path(source).expanduser() if source.startswith("~") else source  # "~/..." is no Hub id: expanded
    assert line.startswith(f"ValueError: convert {shown}: no ") and "transformers checkpoint folder" in line, line
    assert not (tmp_path / "out").exists()


def test_convert_names_a_file_or_a_folder_without_config(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    assert "a file, not a folder" in cli_error(capsys, ["convert", str(tmp_path / "afile"), str(tmp_path / "o")])
    assert "holds no config.json" in cli_error(capsys, ["convert", str(tmp_path / "empty"), str(tmp_path / "o")])


def test_convert_keeps_the_weights_that_fit_when_an_override_changes_a_shape(llama_source, tmp_path, caplog):
    from safetensors.torch import load_file

    from plugformer.cli import main

    with caplog.at_level("WARNING", logger="plugformer.integrations.convert"):
        main(["convert", str(llama_source), str(tmp_path / "out"), "--set", "num_key_value_heads=1"])
    source, converted = load_file(llama_source / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    resized = ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    assert f"2 source tensors of another shape initialised anew {resized}" in caplog.text
    assert all(converted[name].shape == (16, 32) for name in resized)
    kept = [name for name in source if name not in resized and name in converted]
    assert "model.layers.0.self_attn.q_proj.weight" in kept and len(kept) >= len(source) - 3
    assert all(converted[name].equal(source[name]) for name in kept)


# --- 7. Ctrl-C while the command starts ----------------------------------------------------------------------------


def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130():
    import signal
    import subprocess
    import sys

    def default_sigint():  # a shell's background job ignores SIGINT; a terminal's Ctrl-C does not
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "plugformer", "--version"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=default_sigint,
    )
    seen = False
    for line in process.stderr:  # one line per import as it ends: interrupt once the imports after quiet_start run
        if seen:
            process.send_signal(signal.SIGINT)
            break
        seen = "plugformer.runtime.interrupts" in line
    rest = process.stderr.read()
    assert process.wait(timeout=300) == 130
    said = [line for line in rest.splitlines() if not line.startswith("import time:")]
    assert said == ["KeyboardInterrupt: interrupted while starting, before any work [plugformer]"], rest[-3000:]


def test_only_the_command_answers_ctrl_c_while_starting():
    from plugformer.runtime.interrupts import launched_as_command

    assert launched_as_command(["/usr/bin/plugformer", "train"], [])
    assert launched_as_command(["-m"], ["python", "-X", "importtime", "-m", "plugformer", "info"])
    assert not launched_as_command(["script.py"], ["python", "script.py"])
    assert not launched_as_command(["-m"], ["python", "-m", "pytest"])


# --- 8. compressed data files and folders --------------------------------------------------------------------------


def test_a_gzipped_jsonl_is_checked_inside_and_read(tmp_path):
    from plugformer.data.user_data import load_user_splits
    from plugformer.data.validation import check_data_files

    packed = tmp_path / "docs.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in documents()))
    check_data_files("json", [str(packed)])
    splits = load_user_splits(
        "text", "json", None, [str(packed)], {"dev": 2, "test": 2}, 0, data_cache_dir=str(tmp_path / "cache")
    )
    assert sum(len(split) for split in splits.values()) == 40
    latin = tmp_path / "latin.jsonl.gz"
    with gzip.open(latin, "wb") as handle:
        handle.write('{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl.gz: not UTF-8 text \(byte 13 \(decompressed\) is b'\\xe9'\)"):
        check_data_files("json", [str(latin)])
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:60])
    with pytest.raises(ValueError, match=r"cut.jsonl.gz: a damaged gzip file \(EOFError"):
        check_data_files("json", [str(cut)])


def test_a_folder_given_as_data_files_is_refused_naming_the_fix(tmp_path, capsys):
    folder = tmp_path / "parts"
    folder.mkdir()
    for part in range(2):
        write_jsonl(folder / f"part{part}.jsonl", documents()[part * 20 : (part + 1) * 20])
    line = cli_error(
        capsys,
        [
            "train",
            "pretrain",
            *PRETRAIN,
            "--dataset_name",
            "json",
            "--data_files",
            str(folder),
            "--output_dir",
            str(tmp_path / "out"),
        ],
    )
    assert line.startswith(f"ValueError: --data_files {folder} is a folder") and f"'{folder}/*.jsonl'" in line
    assert f"--dataset_name {folder} (without --data_files)" in line
    from plugformer.data.identity import files_record

    with pytest.raises(ValueError, match=rf"--data_files {folder} is a folder"):
        files_record("json", [str(folder)])


# --- 9. a damaged shard of the corpus cache ------------------------------------------------------------------------


def test_a_truncated_cache_shard_is_prepared_again_or_named(tmp_path, capsys, monkeypatch):
    from datasets import Dataset, DatasetDict

    from plugformer import train_tokenizer
    from plugformer.data import prepare

    texts = [sentence(index, 40) for index in range(60)]
    data = DatasetDict({"train": Dataset.from_dict({"text": texts})})
    tokenizer = train_tokenizer(texts, vocab_size=300)
    options = {"block_size": 16, "causal": True, "document_positions": False, "root": tmp_path, "num_proc": 1}
    first = prepare.prepared_blocks(data, "corpus", tokenizer, **options)["train"].to_dict()["input_ids"]
    (shard,) = (tmp_path / "blocks").glob("*/train*.arrow")  # cut short below: nothing mapped from it is read again
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    again = prepare.prepared_blocks(data, "corpus", tokenizer, **options)["train"].to_dict()["input_ids"]
    assert again == first
    assert f"the corpus cache's shard {shard} holds" in capsys.readouterr().out  # ... and is prepared again
    shard.write_bytes(shard.read_bytes()[:100])

    def read_only(*_):
        raise PermissionError("read-only")

    monkeypatch.setattr(prepare.os, "rename", read_only)
    with pytest.raises(ValueError, match=rf"shard {re.escape(str(shard))} .*; delete {re.escape(str(shard.parent))}"):
        prepare.prepared_blocks(data, "corpus", tokenizer, **options)


def test_a_cache_shard_damaged_inside_is_named_with_its_remedy(tmp_path):
    from datasets import Dataset

    from plugformer.data import prepare

    folder = tmp_path / "blocks" / "key"
    folder.mkdir(parents=True)
    Dataset.from_dict({"input_ids": [[1, 2, 3]] * 50}).save_to_disk(tmp_path / "saved")
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    (folder / "train.arrow").write_bytes(arrow.read_bytes()[:-40])  # written before shard sizes were recorded
    (folder / "complete").write_text(json.dumps({"train": ["train.arrow"]}))
    damaged = r"shard .*train.arrow is damaged \((ArrowInvalid|OSError): .*\); delete .*key"  # pyarrow's own type
    with pytest.raises(ValueError, match=damaged):
        prepare.load_blocks(folder)


# --- 10. classify: text_pair missing in some rows; labels 07 and 7 -----------------------------------------------


@pytest.mark.parametrize("kind", ["csv", "json"])
def test_classify_names_a_row_without_its_text_pair(models, tmp_path, capsys, kind):
    rows = [{"text": sentence(i), "text_pair": sentence(i + 1), "label": "ab"[i % 2]} for i in range(40)]
    if kind == "csv":
        rows[5]["text_pair"] = ""  # an empty field: a missing value
        data = write_csv(tmp_path / "pairs.csv", list(rows[0]), [list(row.values()) for row in rows])
    else:
        del rows[5]["text_pair"]
        data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    line = cli_error(
        capsys,
        [
            "train",
            "classify",
            *CLASSIFY,
            "--model_name_or_path",
            str(models / "lm"),
            "--dataset_name",
            kind,
            "--data_files",
            str(data),
            "--output_dir",
            str(tmp_path / "out"),
        ],
    )
    assert re.search(r"column 'text_pair' is null in row \d+ of the (train|dev|test) split", line), line


@pytest.mark.parametrize(
    ("labels", "expected"),
    [(["07", "7", "8"], {"07", "7", "8"}), (["0", "1", " 1"], {0, 1}), (["pos", "neg"], {"pos", "neg"})],
    ids=["two-spellings-of-7", "integers", "text"],
)
def test_csv_labels_are_read_as_written_unless_all_are_integers(tmp_path, labels, expected):
    from plugformer.data.user_data import load_user_splits
    from plugformer.training.stages.classify import label_names

    data = write_csv(
        tmp_path / "labels.csv", ["text", "label"], [[sentence(i), labels[i % len(labels)]] for i in range(30)]
    )
    splits = load_user_splits(
        "classification", "csv", None, [str(data)], {"dev": 3, "test": 3}, 0, data_cache_dir=str(tmp_path / "cache")
    )
    found = {value for split in splits.values() for value in split["label"]}
    assert found == expected
    assert len(label_names(list(found))) == len(expected)


# --- 11. a figure's dpi --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dpi", ["0", "-3"])
def test_a_dpi_that_is_not_positive_is_named(models, tmp_path, capsys, dpi):
    line = cli_error(
        capsys, ["attention-map", "--model", str(models / "lm"), "--dpi", dpi, "--output", str(tmp_path / "map.png")]
    )
    assert line.startswith(f"ValueError: --dpi {dpi}: expected a value > 0"), line
    line = cli_error(capsys, ["plot", "sinusoidal", "--dpi", dpi, "--output", str(tmp_path / "s.png")])
    assert line.startswith(f"ValueError: --dpi {dpi}: expected a value > 0"), line
    assert not list(tmp_path.glob("*.png"))


# --- found by the generated suite (tests/test_option_boundaries.py) -----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["demo", "--train_sentences", str(2**63)], r"--train_sentences 9223372036854775808: at most 10000000"),
        (["demo", "--eval_sentences", "-1"], r"--eval_sentences -1: expected an integer >= 1"),
        (
            ["plot", "sinusoidal", "--positions", str(2**63)],
            r"positions=9223372036854775808 x dim=64: .*at most 16777216",
        ),
    ],
    ids=["demo-huge", "demo-negative", "sinusoidal-huge"],
)
def test_a_huge_or_negative_count_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, pattern):
    monkeypatch.setattr("plugformer.runtime.run_folders.claim_folder", refuse_work)
    monkeypatch.setattr("plugformer.experiments.demo.claim_folder", refuse_work)
    line = cli_error(capsys, [*argv, "--output" + ("_dir" if argv[0] == "demo" else ""), str(tmp_path / "o")])
    assert re.search(pattern, line), line


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["train", "grpo", "--num_generations", "-1"], r"^ValueError: --num_generations -1: GRPO requires"),
        (["train", "pretrain", "--save_steps", "inf"], r"^ValueError: --save_steps inf: cannot convert"),
        (["train", "sft", "--pad_to_multiple_of", ""], r"^ValueError: --pad_to_multiple_of '': invalid literal"),
        (["train", "pretrain", "--fsdp_config", "{tmp}/missing.json"], r"--fsdp_config '.*missing.json': no such"),
        (["train", "pretrain", "--seed", "-1"], r"--seed -1: expected a value in \[0, 4294967295\]"),
        (["eval", "--dataset_name", ""], r"--dataset_name '': expected a builder"),
        (["eval", "--dataset_name", "{tmp}/missing"], r"--dataset_name .*/missing: no such folder or file"),
        (["compare", "--stages", ""], r"--stages : unknown stage ''"),
        (["extrapolate", "--factors", "1e308"], r"factors=\[1e\+308\]: .* longer than 1048576 tokens"),
    ],
    ids=["trl-post-init", "overflow", "empty-int", "fsdp-config", "seed", "empty-dataset", "missing-dataset",
         "unknown-stage", "huge-factor"],
)  # fmt: skip
def test_a_value_a_library_refuses_is_named_by_its_option(models, tmp_path, capsys, monkeypatch, argv, pattern):
    from plugformer.evaluation import evaluators

    for claim in ("plugformer.training.distributed.claim_output_dir", "plugformer.training.run_stage"):
        if argv[0] != "train" or not claim.endswith("run_stage"):
            monkeypatch.setattr(claim, refuse_work)
    monkeypatch.setattr(evaluators, "language_model_scores", refuse_work)
    argv = [value.replace("{tmp}", str(tmp_path)) for value in argv]
    where = {
        "train": ["--output_dir", str(tmp_path / "out")],
        "eval": ["--model", str(models / "lm")],
        "compare": ["--output_dir", str(tmp_path / "out")],
        "extrapolate": ["--output_dir", str(tmp_path)],
    }
    parent = ["--model_name_or_path", str(models / "lm")] if argv[1] in ("grpo", "sft") else []
    line = cli_error(capsys, [*argv, *where[argv[0]], *parent])
    assert re.search(pattern, line), line
