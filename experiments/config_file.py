"""Reading a ``--config`` YAML file: its keys, read as their flags are, and one line for what is wrong with it."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from experiments import cli
from experiments.cli import UsageError

__all__ = ["DuplicateKey", "UniqueKeys", "load_yaml"]


class DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping: ``key``, and ``problem_mark`` where it stands the second time."""

    def __init__(self, key: Any, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"the key {key!r} is given twice; keep one", mark)
        self.key = key


class UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (yaml.safe_load keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges another mapping: no key of its own
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path: Path, cls: type) -> dict[str, Any]:
    """The keys of a ``--config`` file, read as their flags are.

    Raises:
        UsageError: no such file, not YAML, not a mapping, an unknown key (with close matches),
            a list for a single value or the reverse, or a value its flag would refuse.
    """
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file.")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeys) or {}
    except UnicodeDecodeError as e:
        raise UsageError(f"--config {path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8.") from None
    except yaml.MarkedYAMLError as e:  # one line: where, and what
        mark = e.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UsageError(f"--config {path}: not valid YAML{at}: {e.problem}.") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: must be a mapping of config keys to values, got {type(data).__name__}.")
    types_ = typing.get_type_hints(cls)
    items = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise UsageError(
                f"--config {path}: unknown key {key!r}{cli.suggest(name, list(types_))}. Known keys: {', '.join(types_)}."
            )
        listed = typing.get_origin(types_[name]) is tuple
        if isinstance(value, dict) or isinstance(value, list) != listed:
            should = f"a list (e.g. [{cli.show(value)}])" if listed else "a single value"
            raise UsageError(f"--config {path}: {name} must be {should}, got {value!r}.")
        items.append((name, [cli.show(value)]))
    return cli.read_items(items, types_, name=str, where=f"--config {path}: ")
