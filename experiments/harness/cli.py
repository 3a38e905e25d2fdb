"""The command line of the experiment scripts: how a flag's words become a value, and the one-line errors.

Each field of the config dataclasses (``config.parse_args``) is a kebab-case flag (``--inner_lr`` too, as a
W&B sweep passes it) and a YAML key. The command line is parsed once, by :func:`read_argv`, with tyro's value
readers (:data:`REGISTRY`): what it refuses is a one-line :class:`UsageError` (tyro's own errors are a multi-line
box), and tyro itself only renders ``--help`` (:func:`tyro_cli`). ``--config`` files go through the same readers
(:func:`read_items`, :func:`load_yaml`). It imports no torch: the sweep reads its YAML with :class:`UniqueKeys` too.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import tyro
import yaml

from experiments.harness.folder import UsageError

__all__ = ["REGISTRY", "flag", "show", "suggest", "field_types", "spec_of", "read_items", "read_argv", "tyro_cli"]
__all__ += ["DuplicateKey", "UniqueKeys", "load_yaml"]


def flag(name: str) -> str:
    """The flag of a config key: ``inner_lr`` -> ``--inner-lr``."""
    return "--" + name.replace("_", "-")


def show(value: Any) -> str:
    """A value as it is written on the command line: ``null``, ``true``, ``5,10,20``."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(show, value))
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def suggest(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean a, b?)`` for the close matches of ``word`` among ``choices``; '' for none."""
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


# How tyro reads a value: a bool as true or false (True, False), None as null (or None), a tuple from
# values separated by commas or spaces (5,10,20); a bad value raises ValueError naming it.
REGISTRY = tyro.constructors.ConstructorRegistry()


@REGISTRY.primitive_rule
def _read_values(info: tyro.constructors.PrimitiveTypeInfo) -> tyro.constructors.PrimitiveConstructorSpec | None:
    spec, args = tyro.constructors.PrimitiveConstructorSpec, typing.get_args(info.type)

    def inner(tp: Any) -> Any:
        return tyro.constructors.ConstructorRegistry.get_primitive_spec(
            tyro.constructors.PrimitiveTypeInfo.make(tp, info.markers)
        )

    if info.type in (bool, int, float):
        kind, tp = {bool: "true or false", int: "an integer", float: "a number"}[info.type], info.type

        def read(words: list[str]) -> Any:
            try:
                return {"true": True, "false": False}[words[0].lower()] if tp is bool else tp(words[0])
            except (KeyError, ValueError):
                raise ValueError(f"{words[0]!r} is not {kind}") from None

        return spec(
            nargs=1,
            metavar={bool: "{true,false}", int: "INT", float: "FLOAT"}[tp],
            instance_from_str=read,
            is_instance=lambda x: isinstance(x, tp),
            str_from_instance=lambda x: [show(x)],
        )
    if info.type_origin is tuple and args[1:] == (...,):
        item = inner(args[0])

        def read_all(words: list[str]) -> tuple[Any, ...]:
            values = [v for word in words for v in word.split(",") if v]
            if not values:
                raise ValueError("needs at least one value")
            return tuple(item.instance_from_str([v]) for v in values)

        return spec(
            nargs="*",
            metavar=f"{item.metavar},...",
            instance_from_str=read_all,
            is_instance=lambda x: isinstance(x, tuple),
            str_from_instance=lambda x: [show(x)],
        )
    if info.type_origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        some = inner(next(a for a in args if a is not type(None)))
        return spec(
            nargs=some.nargs,
            metavar=f"{some.metavar}|null",
            instance_from_str=lambda words: None if words in (["null"], ["None"]) else some.instance_from_str(words),
            is_instance=lambda x: x is None or some.is_instance(x),
            str_from_instance=lambda x: ["null"] if x is None else some.str_from_instance(x),
            choices=None if some.choices is None else (*some.choices, "null", "None"),
        )
    return None


def field_types(cls: type) -> dict[str, Any]:
    """The type of each field of the dataclass ``cls``, by name: its flags and YAML keys (class variables are none)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def spec_of(tp: Any) -> tyro.constructors.PrimitiveConstructorSpec:
    """How tyro reads a flag of type ``tp`` (with :data:`REGISTRY`): its number of words, choices and reader."""
    with REGISTRY:
        return tyro.constructors.ConstructorRegistry.get_primitive_spec(
            tyro.constructors.PrimitiveTypeInfo.make(tp, set())
        )


def read_items(
    items: Sequence[tuple[str, list[str]]], types_: dict[str, Any], name: Any = flag, where: str = ""
) -> dict[str, Any]:
    """The values of ``(key, words)`` pairs, each read as tyro reads its flag; a later pair of a key wins.

    Checked in tyro's order: the choices as given, then each value in the order of ``types_``. ``name(key)``
    names a key in the messages (its flag, or the key itself in a config file) after the prefix ``where``.

    Raises:
        UsageError: a value not among its choices, or one its reader refuses.
    """
    given = dict(items)
    for key, words in items:
        _check_choice(key, words, types_, name, where)
    values = {}
    for key in (k for k in types_ if k in given):
        try:
            values[key] = spec_of(types_[key]).instance_from_str(given[key])
        except (ValueError, TypeError) as e:
            raise UsageError(f"{where}{name(key)} {e}.") from None
    return values


def _check_choice(key: str, words: list[str], types_: dict[str, Any], name: Any = flag, where: str = "") -> None:
    """Raises UsageError when ``key``'s flag has choices and ``words`` is not one (as tyro checks them, on reading)."""
    choices = spec_of(types_[key]).choices
    if choices is not None and words and words[0] not in choices:
        allowed = ", ".join(c for c in choices if c != "None")  # null stands for it
        raise UsageError(f"{where}{name(key)} {words[0]!r} is not one of {allowed}.")


def _stops_values(token: str) -> bool:
    """Whether ``token`` ends the words of the flag before it: ``--``, or a flag (a dash and a letter, not -inf)."""
    negative = token[1:].lower() in ("inf", "nan", "infinity")  # tyro's rule: a value, not a flag
    return token == "--" or (token.startswith("-") and token.lstrip("-")[:1].isalpha() and not negative)


def read_argv(argv: Sequence[str], types_: dict[str, Any], switches: Collection[str] = ()) -> dict[str, Any] | None:
    """The values of the flags in ``argv``, read and split among the flags as tyro reads them; None when it asks for
    ``--help``.

    ``types_``: each key's type (``inner_lr``); ``switches``: the keys whose flag takes no value (``--resume``).

    Raises:
        UsageError: an unknown flag (with close matches) or a stray word; a flag without its value;
            a value not among its flag's choices, or one its reader refuses.
    """
    flags = [flag(k) for k in types_] + ["--help"]
    items: list[tuple[str, list[str]]] = []
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token in ("-h", "--help"):
            return None  # tyro prints the help
        if token == "--":
            unknown += argv[i:]  # after --, only positional arguments, and there are none
            break
        name, attached, value = token.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key not in types_:
            unknown.append(token)
            continue
        if key in switches:
            unknown += [value] if attached else []
            items.append((key, ["true"]))
            continue
        if attached:
            words = [value]
        elif spec_of(types_[key]).nargs == "*":
            words = []
            while i < len(argv) and not _stops_values(argv[i]):
                words.append(argv[i])
                i += 1
        elif i == len(argv) or _stops_values(argv[i]):
            raise UsageError(f"{flag(key)} needs a value.")
        else:
            words = [argv[i]]
            i += 1
        _check_choice(key, words, types_)
        items.append((key, words))
    if unknown:
        bad = unknown[0].split("=", 1)[0]
        if not bad.startswith("-"):
            raise UsageError(f"unexpected argument {bad!r}: a value follows its flag (--name value).")
        raise UsageError(f"unknown flag {bad}{suggest(bad.replace('_', '-'), flags)}; see --help for the full list.")
    values = read_items([(k, w) for k, w in items if k not in switches], types_)
    return {**values, **{k: True for k, _ in items if k in switches}}


def tyro_cli(tp: Any, args: Sequence[str], default: Any, **kwargs: Any) -> Any:
    """``tyro.cli`` with this package's readers and flag names (no prefixes, no ``--no-`` pairs): ``--help``."""
    return tyro.cli(
        tp,
        args=list(args),
        default=default,
        registry=REGISTRY,
        config=(tyro.conf.OmitArgPrefixes, tyro.conf.FlagCreatePairsOff),
        **kwargs,
    )


# ---------------------------------------------------------------------- --config files


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

    A mapping given for a key of text is read as its JSON (``inner_optimizer_options: {momentum: 0.9}``).

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
    types_ = field_types(cls)
    items = []
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise UsageError(
                f"--config {path}: unknown key {key!r}{suggest(name, list(types_))}. Known keys: {', '.join(types_)}."
            )
        if isinstance(value, dict) and str in (types_[name], *typing.get_args(types_[name])):
            value = json.dumps(value)  # a mapping for a key of text is its JSON (--inner-optimizer-options)
        listed = typing.get_origin(types_[name]) is tuple
        if isinstance(value, dict) or isinstance(value, list) != listed:
            should = f"a list (e.g. [{show(value)}])" if listed else "a single value"
            raise UsageError(f"--config {path}: {name} must be {should}, got {value!r}.")
        items.append((name, [show(value)]))
    return read_items(items, types_, name=str, where=f"--config {path}: ")
