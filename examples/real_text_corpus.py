"""A corpus of real English text from what every Python install holds, for experiments that need prose rather than
the embedded tasks (the real-text length extrapolation in `model_cards/extrapolation-tiny/RESULTS.md`): the
docstrings of the standard library's modules (one document per module, its test packages left out) and the long
descriptions in the installed packages' METADATA. Documents under 500 characters are dropped, repeats kept once;
the order is the files' sorted paths, so one install gives the same file every time (its sha256 is printed).

    python examples/real_text_corpus.py corpus.jsonl
    plugformer extrapolate --config configs/extrapolation/real_text.yaml --data_files corpus.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path


MIN_CHARACTERS = 500
SKIPPED_PACKAGES = ("test", "tests", "idle_test", "site-packages")


def module_docstrings(path: Path) -> str:
    """The docstrings of a module, its classes and its functions (over 40 characters), in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return "\n\n".join(doc for doc in docs if doc and len(doc) > 40)


def metadata_description(path: Path) -> str:
    """The long description of a package: its METADATA after the header block."""
    _, separator, body = path.read_text(encoding="utf-8", errors="replace").partition("\n\n")
    return body if separator else ""


def documents(stdlib: Path, site_packages: Path) -> list[str]:
    """The corpus's documents: long enough, each text once."""
    texts = [
        module_docstrings(path)
        for path in sorted(stdlib.rglob("*.py"))
        if not set(path.relative_to(stdlib).parts) & set(SKIPPED_PACKAGES)
    ]
    texts += [metadata_description(path) for path in sorted(site_packages.glob("*.dist-info/METADATA"))]
    seen, kept = set(), []
    for text in (text.strip() for text in texts):
        digest = hashlib.sha256(text.encode()).hexdigest()
        if len(text) >= MIN_CHARACTERS and digest not in seen:
            seen.add(digest)
            kept.append(text)
    return kept


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the jsonl file to write ({'text': ...} per line)")
    parser.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the standard library's folder")
    parser.add_argument("--site_packages", default=sysconfig.get_paths()["purelib"], help="where METADATA is read")
    args = parser.parse_args(argv)
    texts = documents(Path(args.stdlib), Path(args.site_packages))
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    digest = hashlib.sha256(Path(args.output).read_bytes()).hexdigest()
    print(f"{args.output}: {len(texts)} documents, {sum(map(len, texts)):,} characters, sha256 {digest}")
    return texts


if __name__ == "__main__":
    main(sys.argv[1:])
