"""The `plugformer` command: one table of subcommands."""

from __future__ import annotations

import sys
from collections.abc import Callable


def _demo(argv: list[str]) -> None:
    from .demo import main

    main(argv)


def _info(argv: list[str]) -> None:
    """Prints the (attention_score, position_scheme) matrix with the kernels that run each pair."""
    from .capabilities import KERNELS, combination_matrix

    print(f"{'attention_score':16s}{'position_scheme':16s}" + "".join(f"{k:16s}" for k in KERNELS))
    for score, scheme, kernels in combination_matrix():
        print(f"{score:16s}{scheme:16s}" + "".join(f"{'yes' if k in kernels else '-':16s}" for k in KERNELS))


COMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "demo": (_demo, "train a tokenizer and a small model offline, then generate through pipeline()"),
    "info": (_info, "list which kernels run each attention_score x position_scheme"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        usage = "\n".join(f"  {name:8s}{description}" for name, (_, description) in COMMANDS.items())
        print(f"usage: plugformer <command> [options]\n\ncommands:\n{usage}", file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    COMMANDS[argv[0]][0](argv[1:])
