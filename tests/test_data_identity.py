"""Your data named by content: files by the sha256 of their bytes, held-out splits by their rows' digests, splits
carved by rank of each row's content so that they cannot shift, and no held-out row with a twin in train."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from test_training import TINY, TRL, train, write_jsonl

from plugformer.data.identity import KEY_HEX, carve, file_sha256, files_record, row_keys, split_digest
from plugformer.data.sources import load_stage_dataset


def documents(count: int, start: int = 0) -> list[dict]:
    return [
        {"text": f"document {i}: " + " ".join(str(i * k % 97) for k in range(6))} for i in range(start, start + count)
    ]


def conversations(count: int, start: int = 0) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Repeat {i}"}],
            "completion": [{"role": "assistant", "content": f"{i} {i}"}],
        }
        for i in range(start, start + count)
    ]


def carved(path, dev: int = 8, test: int = 8, **options):
    return load_stage_dataset("text", "json", data_files=[str(path)], sizes={"dev": dev, "test": test}, **options)


def rewrite_keeping_size_and_mtime(path, old: str, new: str) -> None:
    """An in-place edit as `cp -p` or `rsync -t` of an edited copy leaves it: same length, same modification time."""
    assert len(old) == len(new)
    stat = os.stat(path)
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns


def test_rows_added_to_a_file_never_move_a_training_row_into_a_held_out_split(tmp_path):
    rng = random.Random(0)
    for trial in range(5):
        rows = documents(rng.randint(40, 120), start=1000 * trial)
        path = write_jsonl(tmp_path / f"c{trial}.jsonl", rows)
        before = carved(path)
        trained = set(before["train"]["text"])
        write_jsonl(path, rows + documents(rng.randint(1, 60), start=1000 * trial + 500))
        after = carved(path)
        for split in ("dev", "test"):
            assert not set(after[split]["text"]) & trained, (trial, split)


def test_a_rows_split_depends_on_its_content_and_the_seed_not_on_the_order_of_the_files(tmp_path):
    rows = documents(60)
    first = carved(write_jsonl(tmp_path / "a.jsonl", rows), seed=3)
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    second = carved(write_jsonl(tmp_path / "b.jsonl", shuffled), seed=3)
    for split in ("train", "dev", "test"):
        assert sorted(first[split]["text"]) == sorted(second[split]["text"])
    assert first["test"]["text"] == second["test"]["text"]  # held-out rows come in rank order
    assert set(carved(tmp_path / "a.jsonl", seed=4)["test"]["text"]) != set(first["test"]["text"])


def test_the_same_file_twice_is_refused_by_path_glob_link_or_content(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", documents(30))
    (tmp_path / "link.jsonl").symlink_to(path)
    shutil.copy(path, tmp_path / "copy.jsonl")
    for files, message in (
        ([path, path], "is named twice"),
        ([path, tmp_path / "*.jsonl"], "is named by both"),
        ([path, tmp_path / "link.jsonl"], "is named by both"),
        ([path, tmp_path / "copy.jsonl"], "hold the same bytes"),
    ):
        with pytest.raises(ValueError, match=message):
            load_stage_dataset("text", "json", data_files=[str(f) for f in files], sizes={"dev": 2, "test": 2})


def test_training_rows_identical_to_a_held_out_row_are_dropped_and_counted(tmp_path):
    rows = documents(40)
    path = write_jsonl(tmp_path / "c.jsonl", rows + rows[:20])  # half the documents twice
    data = carved(path)
    held = set(data["test"]["text"]) | set(data["dev"]["text"])
    assert not held & set(data["train"]["text"])
    assert len(set(data["test"]["text"])) == 8 and not set(data["dev"]["text"]) & set(data["test"]["text"])
    twins = sum(1 for row in rows[:20] if row["text"] in held)  # each held-out document of the repeated half
    assert sum(data.identity["duplicates_dropped"].values()) == twins > 0
    kept = carved(path, keep_duplicates=True)
    assert set(kept["test"]["text"]) & set(kept["train"]["text"])
    assert len(kept["train"]) == len(data["train"]) + twins


def test_the_identity_names_each_file_by_its_bytes_and_each_held_out_split_by_its_rows(tmp_path):
    import hashlib

    path = write_jsonl(tmp_path / "c.jsonl", documents(30))
    data = carved(path, dev=3, test=4)
    (record,) = data.identity["files"]
    assert record == {
        "path": str(path.resolve()),
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    test = data.identity["held_out"]["test"]
    keys = [hashlib.sha256(text.encode()).hexdigest() for text in data["test"]["text"]]
    assert test == {"rows": 4, "sha256": split_digest(keys), "row_keys": [key[:KEY_HEX] for key in keys]}


def test_a_file_edited_in_place_with_its_old_size_and_mtime_is_read_anew(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", documents(30))
    first = carved(path)
    rewrite_keeping_size_and_mtime(path, "document 7:", "DOCUMENT 7:")
    second = carved(path)  # datasets' own Arrow cache keys on the mtime: a copy of older bytes must not be served
    texts = [t for split in second.values() for t in split["text"]]
    assert any(t.startswith("DOCUMENT 7:") for t in texts) and not any(t.startswith("document 7:") for t in texts)
    assert first.identity["files"][0]["sha256"] != second.identity["files"][0]["sha256"]


def test_a_digest_is_read_from_the_cache_while_the_file_is_unchanged(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", documents(5)).resolve()
    cache = tmp_path / "digests"
    true = file_sha256(path, cache)
    (entry,) = cache.iterdir()
    kept = json.loads(entry.read_text())
    entry.write_text(json.dumps({**kept, "sha256": "f" * 64}))  # a planted value: returned only if the file is not read
    assert file_sha256(path, cache) == "f" * 64
    rewrite_keeping_size_and_mtime(path, "document 1:", "DOCUMENT 1:")  # the change time moves: read again
    assert file_sha256(path, cache) not in ("f" * 64, true)


def test_a_read_only_digest_cache_costs_only_a_reread(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", documents(5))
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would go")
    assert files_record("json", [str(path)], str(blocker))[0]["sha256"] == file_sha256(path.resolve())


def test_carving_keys_rows_by_what_a_stage_reads_not_by_an_id_column():
    from datasets import Dataset, DatasetDict

    rows = [{"id": i, "text": f"doc {i % 10}"} for i in range(30)]  # every document three times, with new ids
    splits, keys, dropped = carve(DatasetDict({"train": Dataset.from_list(rows)}), {"dev": 2, "test": 2}, seed=0)
    assert row_keys(splits["test"]) == keys["test"] and len(set(keys["test"])) == 2
    assert dropped == {"train": 8}  # the other two copies of each of the four held-out documents


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("identity") / "pretrain"
    train("pretrain", folder)
    return folder


def test_eval_after_the_data_grew_scores_the_rows_the_run_held_out(pretrained, tmp_path, caplog):
    from plugformer.evaluation.held_out import rows_digest
    from plugformer.evaluation.scoring import main as eval_main

    rows = conversations(60)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    flags = ["--dataset_name", "json", "--data_files", str(data), "--dev_examples", "8", "--test_examples", "8"]
    train("sft", tmp_path / "sft", "--model_name_or_path", str(pretrained), *flags)
    record = json.loads((tmp_path / "sft/run_info.json").read_text())["data"]
    assert record["files"][0]["sha256"] and record["held_out"]["test"]["rows"] == 8
    held_out = load_stage_dataset("conversation", "json", data_files=[str(data)], sizes={"dev": 8, "test": 8})
    assert record["held_out"]["test"]["sha256"] == split_digest(row_keys(held_out["test"]))
    write_jsonl(data, rows + conversations(20, start=60))  # the file grows after training
    results = eval_main(["--model", str(tmp_path / "sft"), "--output", str(tmp_path / "e.json")])
    assert results["examples"] == 8 and results["data_sha256"] == rows_digest(held_out["test"])
    assert "changed since the run" in caplog.text
    with pytest.raises(ValueError, match=r"--test_examples 12: the run held out 8 test rows"):
        eval_main(["--model", str(tmp_path / "sft"), "--output", str(tmp_path / "e.json"), "--test_examples", "12"])
    trained = [
        row
        for row in rows
        if row["prompt"][0]["content"]
        not in {p[0]["content"] for split in ("dev", "test") for p in held_out[split]["prompt"]}
    ]
    write_jsonl(data, trained)  # the held-out rows removed: no split of it can be scored honestly
    with pytest.raises(
        ValueError,
        match=r"data changed since the run \(.*chat.jsonl: sha256 \w{12} then, \w{12} now"
        r"\); 8 of the 8 test rows",
    ):
        eval_main(["--model", str(tmp_path / "sft"), "--output", str(tmp_path / "e.json")])
    other = write_jsonl(tmp_path / "other.jsonl", conversations(30, start=100))  # data given to eval: named by content
    given = eval_main(
        [
            "--model",
            str(tmp_path / "sft"),
            "--output",
            str(tmp_path / "o.json"),
            "--dataset_name",
            "json",
            "--data_files",
            str(other),
            "--test_examples",
            "4",
        ]
    )
    assert given["data"]["files"] == files_record("json", [str(other)])


def test_pretraining_refuses_a_corpus_named_twice_and_records_the_duplicates_it_dropped(tmp_path):
    rows = documents(60)
    corpus = write_jsonl(tmp_path / "c.jsonl", rows + rows)
    flags = ["--dataset_name", "json", "--data_cache_dir", str(tmp_path / "cache")]
    with pytest.raises(ValueError, match="is named twice"):
        train("pretrain", tmp_path / "twice", *flags, "--data_files", str(corpus), str(corpus))
    train("pretrain", tmp_path / "once", *flags, "--data_files", str(corpus))
    record = json.loads((tmp_path / "once/run_info.json").read_text())["data"]
    assert record["duplicates_dropped"] == {"train": 16} and record["keep_duplicates"] is False
    assert "16" in (tmp_path / "once/README.md").read_text().split("Duplicates", 1)[-1][:400]


def test_the_corpus_cache_prepares_a_file_edited_in_place_again(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", documents(60))
    flags = ["--dataset_name", "json", "--data_files", str(corpus), "--data_cache_dir", str(tmp_path / "cache")]
    train("pretrain", tmp_path / "a", *flags)
    train("pretrain", tmp_path / "b", *flags)
    assert "packed blocks reused" in capsys.readouterr().out
    rewrite_keeping_size_and_mtime(corpus, "document 9:", "DOCUMENT 9:")
    train("pretrain", tmp_path / "c", *flags)
    out = capsys.readouterr().out
    assert "packed blocks reused" not in out and "tokenizer reused" not in out


def test_sft_on_a_folder_of_chats_records_each_file(pretrained, tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", conversations(20))
    write_jsonl(folder / "b.jsonl", conversations(20, start=20))
    train(
        "sft",
        tmp_path / "sft",
        "--model_name_or_path",
        str(pretrained),
        *TRL,
        *TINY[:0],
        "--dataset_name",
        str(folder),
        "--dev_examples",
        "4",
        "--test_examples",
        "4",
    )
    record = json.loads((tmp_path / "sft/run_info.json").read_text())["data"]
    assert [f["path"] for f in record["files"]] == [str((folder / name).resolve()) for name in ("a.jsonl", "b.jsonl")]


def test_eval_of_a_run_recorded_before_the_digests_scores_the_rows_it_held_out_by_position(
    pretrained, tmp_path, caplog
):
    from datasets import load_dataset

    from plugformer.evaluation.held_out import rows_digest
    from plugformer.evaluation.scoring import main as eval_main

    data = write_jsonl(tmp_path / "chat.jsonl", conversations(40))
    flags = ["--dataset_name", "json", "--data_files", str(data), "--dev_examples", "4", "--test_examples", "6"]
    train("sft", tmp_path / "sft", "--model_name_or_path", str(pretrained), *flags)
    info_path = tmp_path / "sft/run_info.json"
    info = json.loads(info_path.read_text())
    for key in ("files", "held_out", "duplicates_dropped", "keep_duplicates"):  # as runs recorded it before
        info["data"].pop(key)
    info_path.write_text(json.dumps(info))
    results = eval_main(["--model", str(tmp_path / "sft"), "--output", str(tmp_path / "e.json")])
    rows = load_dataset("json", data_files=[str(data)])["train"]  # the carving of those runs, by position
    test = rows.train_test_split(test_size=6, seed=0)["test"]
    assert results["examples"] == 6 and results["data_sha256"] == rows_digest(test)
    assert "carved by position" in caplog.text
