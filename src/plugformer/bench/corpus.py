"""`python -m plugformer.bench.corpus --dataset_name json --data_files corpus.jsonl`: how fast a corpus is prepared
for pretraining, against the tokenizer's own batch encoding of the same text on the same cores, in one run.

Phases, each timed, with the peak anonymous memory (heap, not the page cache of memory-mapped Arrow files) of this
process and its workers sampled every 0.1 s:

- `load`: `datasets` reads the source into Arrow (its own cache makes a second run near instant);
- `tokenizer`: the BPE tokenizer trained on the bounded sample (or reused from the corpus cache);
- `encode`: the reference, `encode_batch_fast` over the training text in `num_proc` processes, counting tokens only;
- `prepare`: `prepared_blocks` into an empty cache (encode, pack, write Arrow), the pretraining path;
- `reuse`: the same call again, served from the cache.

The report gives `prepare_vs_encode`, the ratio of the two throughputs (1.0: packing and writing cost nothing).

`python -m plugformer.bench.corpus --time_to_first_step -- plugformer train pretrain ... --logging_steps 1` runs a
training command instead and reports the seconds until its first logged loss (the first optimizer step) and the peak
anonymous memory of the command's processes until then.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CorpusBenchArguments:
    dataset_name: str = field(default="json", metadata={"help": "datasets.load_dataset source"})
    data_files: list[str] = field(default_factory=list, metadata={"help": "local files of the corpus"})
    vocab_size: int = 8192
    block_size: int = 512
    tokenizer_sample_mb: float = 64.0
    num_proc: int | None = field(default=None, metadata={"help": "processes (default: every core available)"})
    data_cache_dir: str | None = field(default=None, metadata={"help": "the corpus cache (default: plugformer's)"})
    output: str | None = field(default=None, metadata={"help": "also write the report here as JSON"})
    time_to_first_step: bool = field(
        default=False, metadata={"help": "time the training command after `--` to its first logged loss instead"}
    )


def anonymous_bytes(pid: int) -> int:
    """Proportional anonymous memory of `pid` (`/proc/<pid>/smaps_rollup`), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):  # shared copy-on-write pages of forked workers counted once
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextmanager
def peak_memory(report: dict, name: str):
    """Times the block and samples the anonymous memory of this process and its children; records both."""
    import psutil

    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            pids = [me.pid, *(child.pid for child in me.children(recursive=True))]
            peak[0] = max(peak[0], sum(anonymous_bytes(pid) for pid in pids))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.perf_counter()
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        report[name] = {"seconds": round(time.perf_counter() - started, 2), "peak_anonymous_mb": round(peak[0] / 2**20)}


def _encode_range(task: tuple) -> int:
    """Tokens of the texts `start:stop` of `dataset`, encoded 200 at a time (one worker of the reference)."""
    dataset, tokenizer, start, stop = task
    backend, tokens = tokenizer.backend_tokenizer, 0
    for first in range(start, stop, 200):
        texts = dataset[first : min(first + 200, stop)]["text"]
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))
    return tokens


def encode_reference(dataset, tokenizer, num_proc: int) -> int:
    """The tokenizer's batch encoding of every text of `dataset` spread over `num_proc` processes; the token count."""
    bounds = [round(i * len(dataset) / num_proc) for i in range(num_proc + 1)]
    tasks = [(dataset, tokenizer, bounds[i], bounds[i + 1]) for i in range(num_proc)]
    with multiprocessing.get_context("fork").Pool(num_proc) as pool:
        return sum(pool.map(_encode_range, tasks))


def run(args: CorpusBenchArguments) -> dict:
    from ..data.identity import cache_root
    from ..data.prepare import (
        Corpus,
        corpus_fingerprint,
        default_num_proc,
        prepared_blocks,
        prepared_tokenizer,
    )
    from ..data.sources import load_stage_dataset

    num_proc = args.num_proc or default_num_proc()
    report: dict = {"num_proc": num_proc, "files": args.data_files}
    report["corpus_mb"] = round(sum(os.path.getsize(f) for f in args.data_files) / 1e6, 1)
    with peak_memory(report, "load"):
        data = load_stage_dataset(
            "text", dataset_name=args.dataset_name, data_files=args.data_files, sizes={"dev": 0, "test": 0}
        )
    source = {"dataset_name": args.dataset_name, "data_files": args.data_files, "bench": True}
    corpus = Corpus(data, corpus_fingerprint(source, data))
    text_mb = sum(len(t.encode()) for batch in data["train"].iter(batch_size=1000) for t in batch["text"]) / 1e6
    report["text_mb"] = round(text_mb, 1)
    with peak_memory(report, "tokenizer"):
        tokenizer = prepared_tokenizer(
            corpus, args.vocab_size, args.tokenizer_sample_mb, 0, cache_root(args.data_cache_dir)
        )
    with peak_memory(report, "encode"):
        report["tokens"] = encode_reference(data["train"], tokenizer, num_proc)
    options = {"tokenizer": tokenizer, "block_size": args.block_size, "causal": True, "document_positions": True}
    with tempfile.TemporaryDirectory(dir=cache_root(args.data_cache_dir).parent) as scratch:
        with peak_memory(report, "prepare"):
            blocks = prepared_blocks(data, corpus.fingerprint, root=Path(scratch), num_proc=num_proc, **options)
        with peak_memory(report, "reuse"):
            prepared_blocks(data, corpus.fingerprint, root=Path(scratch), num_proc=num_proc, **options)
        report["blocks"] = len(blocks["train"])
        del blocks
    for phase in ("encode", "prepare"):
        report[phase]["mb_per_s"] = round(text_mb / report[phase]["seconds"], 2)
    report["prepare_vs_encode"] = round(report["encode"]["seconds"] / report["prepare"]["seconds"], 3)
    return report


def time_to_first_step(command: list[str]) -> dict:
    """Runs `command` (a training run logging every step) until its first logged loss, then stops it; the seconds
    to that line and the peak anonymous memory of its processes meanwhile."""
    import subprocess

    report: dict = {"command": command}
    with peak_memory(report, "first_step"):
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            if "'loss'" in line or '"loss"' in line:
                break
        process.kill()
        process.wait()
    return report


def main(argv: list[str] | None = None) -> dict:
    import sys

    from ..runtime.arguments import parse_arguments
    from ..runtime.files import write_text_atomic

    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parse_arguments(CorpusBenchArguments, argv, "plugformer.bench.corpus")
    if args.time_to_first_step and not command:
        raise ValueError("--time_to_first_step times the training command given after `--`; none was given")
    report = time_to_first_step(command) if args.time_to_first_step else run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        write_text_atomic(args.output, text + "\n")
    return report


if __name__ == "__main__":
    main()
