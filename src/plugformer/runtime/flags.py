"""Yes/no switches read from environment variables (`PLUGFORMER_DEBUG`, `PLUGFORMER_FLUSH_DENORMAL`, ...)."""

from __future__ import annotations

import os


def environment_flag(name: str, default: bool = False) -> bool:
    """`name`'s value as a switch: unset or empty gives `default`; 0 / false / no (any case) is off, anything else on."""
    value = os.environ.get(name, "").strip().lower()
    return default if value == "" else value not in ("0", "false", "no")
