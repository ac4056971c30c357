"""The one YAML reader of every YAML-valued input: `--config` files (`read_yaml`) and values given on the command line
(`convert --set`, `--config_overrides`, which `--grid` and `compare --set` fill; `load_yaml_text`).

Each is refused in one `ValueError` naming the input when its aliases expand past `MAX_YAML_VALUES` values (an alias
bomb, refused before anything is built), when it is larger than `MAX_YAML_BYTES`, holds a key twice or is not YAML.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


# a YAML input larger than this, or whose aliases expand to more values, is refused before it is built: a 480-byte
# "billion laughs" under any key hung a command past 2.4 GB, a 316-byte one in `convert --set` grew to 2.8 GB;
# plugformer's configs are a few kB
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading `1e-3` as a float as YAML 1.2 does (PyYAML's YAML 1.1 resolver needs a dot,
    `1.0e-3`, and gives the string '1e-3' otherwise; the command line's float() took it, so configs write it), and
    refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key {key!r} is given twice (lines {seen[key] + 1} and "
                        f"{key_node.start_mark.line + 1}); PyYAML would keep the last silently: keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _expanded_values(node, sizes: dict) -> int:
    """How many values `node` stands for once every alias is expanded (shared subtrees counted each time they are
    referred to, each computed once)."""
    if id(node) not in sizes:
        sizes[id(node)] = 0  # a recursive alias (`&a [*a]`) counts once here; PyYAML refuses it when building
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        sizes[id(node)] = 1 + sum(_expanded_values(child, sizes) for child in children)
    return sizes[id(node)]


def load_yaml_text(text: str, source: str) -> Any:
    """The document in the YAML `text` (safe loader, `YamlLoader`), or a `ValueError` starting with `source` (the
    input as the user gave it, e.g. `"--set num_hidden_layers"`): larger than `MAX_YAML_BYTES`, aliases that expand
    past `MAX_YAML_VALUES` values (checked on the composed nodes, before any value is built), a duplicate key, invalid
    YAML or nesting too deep.

    >>> load_yaml_text("[1e-3, on]", "--set dropout")
    [0.001, True]
    >>> load_yaml_text("a: &a [x, x]\\nb: [*a, *a]", "--set f")
    {'a': ['x', 'x'], 'b': [['x', 'x'], ['x', 'x']]}
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_YAML_BYTES:
        raise ValueError(f"{source}: {size} bytes of YAML; a YAML input is at most {MAX_YAML_BYTES} bytes")
    loader = YamlLoader(text)  # a SafeLoader: no arbitrary objects
    loader.name = source  # marks name the input, not "<unicode string>"
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_values(node, {})
        if values > MAX_YAML_VALUES:
            raise ValueError(
                f"{source}: its aliases expand to {values} values (at most {MAX_YAML_VALUES}); an alias "
                "bomb? write the values out"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        message = " ".join(str(error).split())
        raise ValueError(f"{source}: {message}") from None
    except RecursionError:
        raise ValueError(f"{source}: nested too deeply to be a setting") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """The document in the YAML file `path` (`load_yaml_text`), or a `ValueError` naming the file: unreadable (no
    permission, a folder), larger than `MAX_YAML_BYTES` (checked before it is read), not UTF-8 (with the byte's
    offset), or refused by `load_yaml_text`."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_YAML_BYTES:
            raise ValueError(f"--config {path}: {size} bytes; a config file is at most {MAX_YAML_BYTES} bytes")
        raw = Path(path).read_bytes()
    except (PermissionError, IsADirectoryError) as error:  # a missing file: FileNotFoundError, named by callers
        raise ValueError(f"--config {path}: cannot be read ({error.strerror}); give a readable YAML file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--config {path}: not UTF-8 text (byte {raw[error.start : error.start + 1]!r} at offset "
            f"{error.start}); save it as UTF-8"
        ) from None
    return load_yaml_text(text, f"--config {path}")
