"""A user's own corpus: prepared once (tokenizer on a bounded sample, blocks packed on every core, cached under a
key of what they depend on), reused by later runs, streamed when asked, and resumed mid-epoch on exactly the
batches an uninterrupted run sees."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from plugformer.data import prepare
from plugformer.data.packing import encode_documents, pack
from plugformer.data.prepare import corpus_fingerprint, prepared_blocks, prepared_tokenizer
from plugformer.data.tokenization import train_tokenizer
from plugformer.runtime.arguments import override_flags
from plugformer.training import parse_stage_arguments
from plugformer.training.stages.pretrain import build_tokenizer, load_corpus, pack_corpus


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("corpus_worker.py")
WORDS = "the a cat dog sat ran on under mat tree def return class import self print if else for in".split()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def write_corpus(path: Path, documents: int, seed: int = 0) -> Path:
    """A jsonl file of `documents` texts of 5 to 120 words: some shorter than a block, some spanning several."""
    rng = random.Random(seed)
    with path.open("w") as file:
        for _ in range(documents):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 120))]
            file.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus.jsonl", 400)


def arguments(corpus_file: Path, cache: Path, *extra: str):
    argv = [
        "--dataset_name",
        "json",
        "--data_files",
        str(corpus_file),
        "--data_cache_dir",
        str(cache),
        "--vocab_size",
        "300",
        "--block_size",
        "32",
        "--dev_examples",
        "20",
        "--test_examples",
        "20",
        "--output_dir",
        str(cache.parent / "unused"),
        "--report_to",
        "none",
    ]
    script_args, model_args, _ = parse_stage_arguments("pretrain", override_flags(argv, list(extra)))
    return script_args, model_args


def prepare_once(corpus_file: Path, cache: Path, *extra: str):
    script_args, model_args = arguments(corpus_file, cache, *extra)
    corpus = load_corpus(script_args)
    tokenizer = build_tokenizer(script_args, model_args, corpus)
    return corpus, tokenizer, pack_corpus(corpus, tokenizer, script_args, causal=True)


def folders(cache: Path, kind: str) -> list[str]:
    return sorted(p.name for p in (cache / kind).iterdir() if (p / "complete").exists())


def test_a_second_run_reuses_the_tokenizer_and_the_blocks(corpus_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _, tokenizer, blocks = prepare_once(corpus_file, cache)
    assert len(folders(cache, "tokenizers")) == len(folders(cache, "blocks")) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("prepared again")

    monkeypatch.setattr(prepare, "pack", refuse)
    monkeypatch.setattr("plugformer.data.tokenization.train_tokenizer", refuse)
    _, again, reused = prepare_once(corpus_file, cache)
    assert again.get_vocab() == tokenizer.get_vocab()
    for split in ("train", "dev", "test"):
        assert reused[split]["input_ids"] == blocks[split]["input_ids"]


@pytest.mark.parametrize(
    "change,kind",
    [
        ("corpus", "tokenizers"),  # a rewritten file: a new tokenizer and new blocks
        ("--vocab_size 301", "tokenizers"),  # another tokenizer: new blocks
        ("--block_size 16", "blocks"),
        ("--document_positions false", "blocks"),
        ("--test_examples 21", "tokenizers"),  # other splits: another training text
    ],
)
def test_a_changed_corpus_or_tokenizer_never_reuses_stale_blocks(corpus_file, tmp_path, change, kind):
    cache = tmp_path / "cache"
    prepare_once(corpus_file, cache)
    extra = change.split() if change.startswith("--") else []
    if change == "corpus":
        write_corpus(corpus_file, 400, seed=1)
    corpus, tokenizer, blocks = prepare_once(corpus_file, cache, *extra)
    assert len(folders(cache, kind)) == 2 and len(folders(cache, "blocks")) == 2
    # the new blocks are the new corpus and tokenizer's: the dev split's first block is its first tokens
    block_size = 16 if change == "--block_size 16" else 32
    first = encode_documents(corpus.splits["dev"]["text"][:20], tokenizer)
    assert blocks["dev"]["input_ids"][0] == [t for d in first for t in d][:block_size]


def test_the_tokenizer_trains_on_a_bounded_sample(corpus_file, tmp_path, monkeypatch):
    seen = []

    def recording(texts, **kwargs):
        seen.extend(texts)
        return train_tokenizer(seen, **kwargs)

    monkeypatch.setattr("plugformer.data.tokenization.train_tokenizer", recording)
    script_args, _ = arguments(corpus_file, tmp_path / "cache")
    corpus = load_corpus(script_args)
    prepared_tokenizer(corpus, 300, sample_mb=0.01, seed=0, root=tmp_path / "cache")
    sizes = [len(text.encode()) for text in seen]
    assert sum(sizes[:-1]) < 10_000 <= sum(sizes)  # stops at the first document past 0.01 MB
    assert len(seen) < len(corpus.splits["train"])
    train = set(corpus.splits["train"]["text"])
    assert all(text in train for text in seen)  # never a held-out document


def test_blocks_packed_by_several_processes_equal_one_process(corpus_file, tmp_path):
    script_args, model_args = arguments(corpus_file, tmp_path / "cache")
    corpus = load_corpus(script_args)
    tokenizer = build_tokenizer(script_args, model_args, corpus)
    options = {"tokenizer": tokenizer, "block_size": 32, "causal": True, "document_positions": True}
    one = prepared_blocks(corpus.splits, "one", root=tmp_path / "one", num_proc=1, **options)
    two = prepared_blocks(corpus.splits, "two", root=tmp_path / "two", num_proc=2, **options)
    for split in ("train", "dev", "test"):
        assert one[split].to_dict() == two[split].to_dict()
    # each batch of 200 documents is packed as `pack` packs it, its tail dropped
    texts = corpus.splits["train"]["text"]
    expected = [pack({"text": texts[i : i + 200]}, **options)["input_ids"] for i in range(0, len(texts), 200)]
    assert np.array_equal(np.concatenate(expected), np.array(one["train"]["input_ids"]))


def test_the_corpus_fingerprint_follows_the_files_bytes(corpus_file):
    from datasets import load_dataset

    data = load_dataset("json", data_files=str(corpus_file))
    source = {"dataset_name": "json", "data_files": [str(corpus_file)]}
    before = corpus_fingerprint(source, data)
    assert corpus_fingerprint(source, data) == before
    os.utime(corpus_file, ns=(1, 1))  # same bytes, another modification time: the same corpus
    assert corpus_fingerprint(source, data) == before
    text = corpus_file.read_text()  # other bytes of the same length under the old modification time: another corpus
    corpus_file.write_text(text.replace(text[10], "#" if text[10] != "#" else "$", 1))
    os.utime(corpus_file, ns=(1, 1))
    assert corpus_fingerprint(source, data) != before
    pattern = str(corpus_file.parent / "*.jsonl")  # a glob: a file added to it changes the corpus
    matched = prepare.file_signatures([pattern])
    write_corpus(corpus_file.parent / "more.jsonl", 3)
    assert len(prepare.file_signatures([pattern])) == len(matched) + 1


def test_streaming_holds_out_the_first_documents_and_needs_max_steps(corpus_file, tmp_path):
    script_args, model_args = arguments(corpus_file, tmp_path / "cache", "--streaming", "true")
    corpus = load_corpus(script_args)
    texts = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    assert corpus.splits["dev"]["text"] == texts[:20] and corpus.splits["test"]["text"] == texts[20:40]
    assert [row["text"] for row in corpus.stream.take(3)] == texts[40:43]
    tokenizer = build_tokenizer(script_args, model_args, corpus)
    blocks = pack_corpus(corpus, tokenizer, script_args, causal=True)
    first = next(iter(blocks["train"]))["input_ids"]
    assert list(first) == [t for d in encode_documents(texts[40:60], tokenizer) for t in d][:32]
    with pytest.raises(ValueError, match="--streaming true has no epochs to count"):
        run(tmp_path / "no_steps", corpus_file, "--streaming", "true", "--max_steps", "-1")
    with pytest.raises(ValueError, match="--streaming true reads a --dataset_name source lazily"):
        parse_stage_arguments("pretrain", ["--streaming", "true", "--output_dir", str(tmp_path / "x")])


def test_a_cache_folder_without_its_completion_marker_is_prepared_again(corpus_file, tmp_path):
    """A folder without its `complete` marker (damaged by hand, or from another tool) is replaced, never read."""
    cache = tmp_path / "cache"
    _, _, blocks = prepare_once(corpus_file, cache)
    (folder,) = (cache / "blocks").iterdir()
    shards = json.loads((folder / "complete").read_text())["train"]
    (folder / "complete").unlink()
    (folder / shards[0]).unlink()
    _, _, again = prepare_once(corpus_file, cache)
    assert again["train"]["input_ids"] == blocks["train"]["input_ids"]


def run(output_dir: Path, corpus_file: Path, *extra: str) -> None:
    from plugformer.training import run_stage

    run_stage("pretrain", training_flags(output_dir, corpus_file, *extra))


def training_flags(output_dir: Path, corpus_file: Path, *extra: str) -> list[str]:
    return override_flags(
        [
            "--dataset_name",
            "json",
            "--data_files",
            str(corpus_file),
            "--data_cache_dir",
            str(output_dir.parent / "cache"),
            "--output_dir",
            str(output_dir),
            "--preset",
            "tiny",
            "--vocab_size",
            "300",
            "--block_size",
            "32",
            "--dev_examples",
            "20",
            "--test_examples",
            "20",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--per_device_train_batch_size",
            "4",
            "--eval_strategy",
            "no",
            "--exact_match_examples",
            "0",
            "--dataloader_pin_memory",
            "false",
            "--learning_rate",
            "1e-3",
            "--save_strategy",
            "steps",
            "--save_steps",
            "3",
            "--max_steps",
            "6",
        ],
        list(extra),
    )


def launch(record: Path, output_dir: Path, corpus_file: Path, processes: int, *extra: str) -> dict[int, list]:
    """Trains through tests/corpus_worker.py; returns each rank's batches, in the order it trained on them."""
    flags = training_flags(output_dir, corpus_file, *extra)
    if processes == 1:
        command = [sys.executable, str(WORKER), str(record), *flags]
    else:
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
            "--num_processes",
            str(processes),
            "--main_process_port",
            str(free_port()),
            str(WORKER),
            str(record),
            *flags,
        ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-4000:]
    return {rank: json.loads(Path(f"{record}.{rank}.json").read_text()) for rank in range(processes)}


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resumed_against_whole(tmp_path: Path, corpus_file: Path, processes: int, *extra: str) -> None:
    """A run stopped after step 3 (its checkpoint) and resumed sees, from step 4 on, exactly the uninterrupted run's
    batches on every rank, and ends on its weights."""
    whole = launch(tmp_path / "whole", tmp_path / "whole_run", corpus_file, processes, *extra)
    resumed_dir = tmp_path / "resumed_run"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "whole_run" / "checkpoint-3", resumed_dir / "checkpoint-3")
    resumed = launch(
        tmp_path / "resumed", resumed_dir, corpus_file, processes, *extra, "--resume_from_checkpoint", "last"
    )
    for rank in range(processes):
        assert len(whole[rank]) == 6 and len(resumed[rank]) == 3
        assert resumed[rank] == whole[rank][3:]
    if processes > 1:  # the ranks share out the data: no block is seen twice in one step
        for step in range(6):
            rows = [tuple(row) for rank in range(processes) for row in whole[rank][step]]
            assert len(set(rows)) == len(rows)
    first, again = load_file(tmp_path / "whole_run" / "model.safetensors"), load_file(resumed_dir / "model.safetensors")
    assert first.keys() == again.keys()
    for name in first:
        torch.testing.assert_close(again[name], first[name], atol=1e-6, rtol=0)


# the map-style one-process case in the slow tier: the two-process test resumes a map-style corpus by default
@pytest.mark.parametrize(
    "streaming", [pytest.param(False, id="map-style", marks=pytest.mark.slow), pytest.param(True, id="streaming")]
)
def test_a_resumed_run_sees_exactly_the_uninterrupted_batches(tmp_path, streaming):
    corpus_file = write_corpus(tmp_path / "corpus.jsonl", 400)
    resumed_against_whole(tmp_path, corpus_file, 1, "--streaming", str(streaming).lower())


# the streaming two-process case in the slow tier: the one-process test covers streaming resumption by default
@pytest.mark.parametrize(
    "streaming", [pytest.param(False, id="map-style"), pytest.param(True, id="streaming", marks=pytest.mark.slow)]
)
def test_a_resumed_two_process_run_sees_exactly_the_uninterrupted_batches(tmp_path, streaming):
    corpus_file = write_corpus(tmp_path / "corpus.jsonl", 400)
    resumed_against_whole(tmp_path, corpus_file, 2, "--streaming", str(streaming).lower())


def test_the_shipped_own_text_recipe_trains_on_a_jsonl_file(tmp_path):
    """configs/pretrain/own_text.yaml with only the corpus given (and the sizes cut for a test)."""
    from plugformer.training import run_stage

    corpus_file = write_corpus(tmp_path / "corpus.jsonl", 120)
    info = run_stage(
        "pretrain",
        [
            "--config",
            str(ROOT / "configs/pretrain/own_text.yaml"),
            "--data_files",
            str(corpus_file),
            "--output_dir",
            str(tmp_path / "out"),
            "--data_cache_dir",
            str(tmp_path / "cache"),
            "--max_steps",
            "2",
            "--hidden_size",
            "32",
            "--num_hidden_layers",
            "1",
            "--num_attention_heads",
            "2",
            "--num_key_value_heads",
            "2",
            "--vocab_size",
            "300",
            "--block_size",
            "32",
            "--dev_examples",
            "10",
            "--test_examples",
            "10",
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "1",
            "--eval_strategy",
            "no",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
        ],
    )
    assert info["stage"] == "pretrain" and (tmp_path / "out" / "model.safetensors").exists()
    assert len(folders(tmp_path / "cache", "blocks")) == 1


@pytest.mark.parametrize(
    "lines,message",
    [
        (['{"text": "a b"}', '{"text": 5}'], r"column 'text' holds a int \(5\) in row 1 \(counted from 0"),
        (['{"text": "a b"}', '{"text": "c"', '{"text": "d"}'], r"corpus.jsonl line 2: not valid JSON"),
        (
            ['{"body": "a b"}', '{"body": "c"}'],
            r"lacks the columns \['text'\] of the 'text' format \(it has \['body'\]",
        ),
        (['{"text": "a b"}'] * 30, r"30 rows left in train cannot give --test_examples 30 and still train"),
    ],
    ids=["not a string", "malformed line", "missing column", "held out too much"],
)
def test_errors_in_user_data_name_the_file_and_row(tmp_path, lines, message):
    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text("\n".join(lines) + "\n")
    script_args, _ = arguments(corpus_file, tmp_path / "cache", "--test_examples", "30")
    with pytest.raises(ValueError, match=message) as caught:
        load_corpus(script_args)
    assert f"--data_files {corpus_file}" in str(caught.value) and "\n" not in str(caught.value)


def test_compare_on_your_corpus_trains_on_it_and_scores_the_documents_pretraining_held_out(tmp_path):
    from plugformer.experiments.compare import CompareArguments
    from plugformer.experiments.compare import run as compare

    corpus_file = write_corpus(tmp_path / "corpus.jsonl", 200)
    tiny = [
        "max_steps=2",
        "eval_strategy=no",
        "save_strategy=no",
        "report_to=none",
        "hidden_size=32",
        "num_hidden_layers=1",
        "vocab_size=300",
        "block_size=32",
        "per_device_train_batch_size=4",
    ]
    args = CompareArguments(
        output_dir=str(tmp_path / "study"),
        grid=["position_scheme=rope,alibi"],
        seeds=[0, 1],
        set=tiny,
        dev_examples=10,
        test_examples=12,
        bootstrap_samples=1000,
        stage_configs=str(ROOT / "configs/{stage}/tiny.yaml"),
        dataset_name="json",
        data_files=[str(corpus_file)],
        data_cache_dir=str(tmp_path / "cache"),
    )
    summary = compare(args)
    assert set(summary["variants"]) == {"position_scheme=rope", "position_scheme=alibi"}
    # every run trained on the corpus: one tokenizer and one set of blocks, prepared once for the four runs
    assert len(folders(tmp_path / "cache", "tokenizers")) == len(folders(tmp_path / "cache", "blocks")) == 1
    script_args, _ = arguments(corpus_file, tmp_path / "cache", "--dev_examples", "10", "--test_examples", "12")
    held_out = load_corpus(script_args).splits
    assert args.held_out_texts("test", 10, 12, 0) == list(held_out["test"]["text"])
    assert not set(held_out["test"]["text"]) & set(held_out["train"]["text"])
    scored = json.loads(
        next((tmp_path / "study" / "runs").glob("*/seed0/pretrain/compare_perplexity_test.json")).read_text()
    )
    assert len(scored["scores"]) == 12 and scored["corpus"] == args.corpus_key()
    with pytest.raises(ValueError, match="compare sets 'data_files' itself for every run"):
        compare(CompareArguments(**{**vars(args), "set": [*tiny, f"data_files={corpus_file}"]}))
    with pytest.raises(ValueError, match="set compare's --test_examples instead"):
        compare(CompareArguments(**{**vars(args), "set": [*tiny, "test_examples=5"]}))
    with pytest.raises(ValueError, match=r"on your corpus .* compare scores perplexity"):
        CompareArguments(**{**vars(args), "metric": "exact_match"})
