"""The fixed train / dev / test split of anything named by a key: a bucket of the key's sha256, so that splits never
change between runs or machines and never overlap (an arithmetic fact, a sentence, a date)."""

from __future__ import annotations

import hashlib


SPLITS = ("train", "dev", "test")


def split_of_key(key: str, dev_percent: int = 10, test_percent: int = 10) -> str:
    """The fixed split of anything named by `key` (an arithmetic fact, a sentence): a bucket of its sha256."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    if bucket < test_percent:
        return "test"
    return "dev" if bucket < test_percent + dev_percent else "train"
