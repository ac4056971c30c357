"""Ctrl-C while the `plugformer` command starts: one line and exit status 130, as `cli.main` answers it later.

The console script (and `python -m plugformer`) imports the package, and with it torch and transformers, before
`cli.main` runs: a Ctrl-C in those seconds printed a 30-line traceback of whichever import it hit. `quiet_start`,
called first thing by `plugformer/__init__.py`, answers it with a line instead — only in the command's own process,
never in a program or notebook that imports plugformer (where Ctrl-C must stay a `KeyboardInterrupt`); `cli.main`
hands Ctrl-C back to Python (`end_quiet_start`) before any work, and reports it itself from there.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
from pathlib import Path


def launched_as_command(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process is the `plugformer` command: its console script, or `python -m plugformer`.

    >>> launched_as_command(["/venv/bin/plugformer", "info"], []), launched_as_command(["-m"], ["python", "-m", "plugformer"])
    (True, True)
    >>> launched_as_command(["train.py"], ["python", "train.py"])
    False
    """
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and Path(argv[0]).name in ("plugformer", "plugformer.exe"):
        return True
    return any(flag == "-m" and module == "plugformer" for flag, module in itertools.pairwise(orig_argv))


def _starting(signum, frame) -> None:
    print("KeyboardInterrupt: interrupted while starting, before any work [plugformer]", file=sys.stderr, flush=True)
    raise SystemExit(130)  # 128 + SIGINT; SystemExit passes up through the imports without a traceback


def quiet_start() -> None:
    """Answers Ctrl-C with one line and status 130 until `end_quiet_start`, in the `plugformer` command's process
    only (`launched_as_command`), and only where Python's own handler is in place (not where SIGINT is ignored)."""
    if not launched_as_command() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _starting)


def end_quiet_start() -> None:
    """Python's `KeyboardInterrupt` again (the command's own handler reports it), if `quiet_start` replaced it."""
    if signal.getsignal(signal.SIGINT) is _starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
