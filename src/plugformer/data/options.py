"""The data options of a study (`plugformer compare`, `plugformer extrapolate`) on a user's own corpus: passed to
every run's pretraining, and used to read back exactly the held-out documents that pretraining set aside."""

from __future__ import annotations

from dataclasses import dataclass, field

from .prepare import digest, file_signatures
from .validation import refuse_source_options_without_a_source


@dataclass
class CorpusArguments:
    """A `datasets` source instead of the embedded generator; the same names as `plugformer train pretrain`'s."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "your corpus for every run: a datasets source (json, csv, text, parquet with --data_files, "
            "a local folder, a Hub id when online); default: the embedded arithmetic generator"
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "the dataset's configuration name"})
    data_files: list[str] | None = field(default=None, metadata={"help": "local files for a builder such as json"})
    streaming: bool = field(default=False, metadata={"help": "read the corpus lazily (see train pretrain --help)"})
    data_cache_dir: str | None = field(default=None, metadata={"help": "where the prepared corpus is kept"})
    rename_columns: str | None = field(
        default=None, metadata={"help": "your corpus's text column under the name pretraining reads: 'content=text'"}
    )

    def __post_init__(self):
        refuse_source_options_without_a_source(
            self.dataset_name,
            data_files=self.data_files,
            dataset_config=self.dataset_config,
            streaming=self.streaming,
            rename_columns=self.rename_columns,
        )

    def corpus_flags(self) -> list[str]:
        """The options that make a pretraining run read this corpus (none for the embedded data)."""
        if self.dataset_name is None:
            return []
        flags = ["--dataset_name", self.dataset_name]
        flags += ["--dataset_config", self.dataset_config] if self.dataset_config else []
        flags += ["--data_files", *self.data_files] if self.data_files else []
        flags += ["--streaming", "true"] if self.streaming else []
        flags += ["--rename_columns", self.rename_columns] if self.rename_columns else []
        return flags + (["--data_cache_dir", self.data_cache_dir] if self.data_cache_dir else [])

    def corpus_key(self) -> str | None:
        """What the runs and scores depend on: the source and the sha256 of its files' bytes (`file_signatures`)."""
        if self.dataset_name is None:
            return None
        files = file_signatures(self.data_files)
        renamed = [self.rename_columns] if self.rename_columns else []  # unrenamed: the key it had before the option
        return digest(self.dataset_name, self.dataset_config, self.data_files, self.streaming, files, *renamed)

    def held_out_texts(self, split: str, dev: int, test: int, seed: int) -> list[str]:
        """The `split` documents that pretraining with `--dev_examples dev --test_examples test --dataset_seed
        seed` held out of this corpus: carved from train by the same seeded split, or a stream's first documents."""
        from .prepare import stream_corpus
        from .sources import load_stage_dataset

        if self.streaming:
            source = {"path": self.dataset_name, "name": self.dataset_config, "data_files": self.data_files}
            return list(stream_corpus(source, dev, test, self.rename_columns).splits[split]["text"])
        data = load_stage_dataset(
            "text",
            self.dataset_name,
            self.dataset_config,
            self.data_files,
            sizes={"dev": dev, "test": test},
            seed=seed,
            rename_columns=self.rename_columns,
        )
        return list(data[split]["text"])
