"""Read offline wandb runs back from their files, with no server and no network.

An offline run (``wandb.init(mode="offline", dir=DIR)``) keeps everything it logged in
``DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb``; it writes no ``wandb-summary.json`` and
no ``config.yaml``. That file is a LevelDB-style log: a 7-byte header (``:W&B``, magic
``0xBEE1``, version 0), then protobuf ``wandb.proto.wandb_internal_pb2.Record`` messages
split into chunks that never cross a 32 KiB block. Each chunk has a 7-byte header: CRC-32 of
its type byte and data (little-endian uint32), data length (uint16) and type (full, first,
middle, last). wandb 0.31 ships no Python reader for it any more, so this module decodes it
with wandb's own protobuf classes.

Example:
    >>> run = read_run("runs/sine")  # an experiment's --out folder, or a run directory
    >>> run.config["inner_lr"], run.summary["val/mse"], len(run.history)

``python -m experiments.wandb_runs FOLDER`` prints the runs found under a folder as JSON.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["OfflineRun", "RunFileError", "find_runs", "iter_records", "read_run", "read_runs"]

BLOCK_SIZE = 32 * 1024
FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
FILE_VERSION = 0
CHUNK_HEADER = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {kind: zlib.crc32(bytes([kind])) for kind in (FULL, FIRST, MIDDLE, LAST)}
_INTERNAL_KEYS = frozenset({"_wandb"})


class RunFileError(ValueError):
    """A file is not a wandb run file, or is too damaged to read."""


@dataclass
class OfflineRun:
    """What one wandb run logged, read back from its ``run-<id>.wandb`` file.

    Attributes:
        id: The run id (the suffix of its directory name).
        name: The display name, or None if wandb chose none.
        group: The run group (``group=`` or ``WANDB_RUN_GROUP``), or None.
        project: The project name.
        config: The run's config (wandb's internal ``_wandb`` entry left out).
        history: One dict per ``wandb.log`` step, with ``_step`` (plus wandb's ``_runtime`` and
            ``_timestamp``); nested dicts that were logged come back nested.
        summary: The last value of each logged key, with the summary updates and removals the
            program made (``run.summary[...]``) applied in the order they happened.
        exit_code: The exit code wandb recorded, or None when the file has no exit record (the
            run is still going, or its process was killed).
        path: The run directory.
        problems: Damage met while reading (corrupt or truncated chunks); empty for a sound file.
    """

    id: str
    name: str | None
    group: str | None
    project: str | None
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    exit_code: int | None
    path: Path
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether the run finished writing (its file ends with an exit record)."""
        return self.exit_code is not None

    @property
    def state(self) -> str:
        """``"finished"`` (exit code 0), ``"failed"`` (non-zero) or ``"running"`` (no exit record)."""
        if self.exit_code is None:
            return "running"
        return "finished" if self.exit_code == 0 else "failed"


@cache
def _record_class() -> type:
    """Import wandb's protobuf ``Record`` class (imports wandb, so only when first needed)."""
    from wandb.proto import wandb_internal_pb2

    return wandb_internal_pb2.Record


def _read_file_header(data: bytes, path: Path) -> None:
    """Check the 7-byte header of a run file.

    Raises:
        RunFileError: If the file does not start with wandb's header.
    """
    if len(data) < FILE_HEADER.size:
        raise RunFileError(f"{path} is empty or truncated: it has no wandb header")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if ident != FILE_IDENT or magic != FILE_MAGIC:
        raise RunFileError(f"{path} is not a wandb run file (expected it to start with ':W&B')")
    if version != FILE_VERSION:
        raise RunFileError(f"{path} has wandb file version {version}; this reader knows version {FILE_VERSION}")


def _iter_payloads(data: bytes, problems: list[str]) -> Iterator[bytes]:
    """Reassemble the record payloads of a run file from its chunks.

    A corrupt chunk (bad checksum, unknown type, out-of-order part) costs the rest of its block
    and any record it belonged to, as in LevelDB; a truncated tail ends the file. Both are noted
    in ``problems``.

    Args:
        data: The whole file, header included.
        problems: Receives a line for each piece of damage.

    Yields:
        The serialized protobuf of each complete record, in file order.
    """
    pos, end = FILE_HEADER.size, len(data)
    parts: list[bytes] | None = None
    while pos < end:
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < CHUNK_HEADER.size:
            pos += left_in_block  # zero padding at a block's end
            continue
        if pos + CHUNK_HEADER.size > end:
            problems.append(f"truncated chunk header at byte {pos}")
            return
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0 and checksum == 0:
            pos += left_in_block  # zero-filled rest of a block
            continue
        start = pos + CHUNK_HEADER.size
        stop = start + length
        if stop > end:
            problems.append(f"truncated record at byte {pos}")
            return
        chunk = data[start:stop]
        if (
            kind not in _TYPE_CRC
            or length > left_in_block - CHUNK_HEADER.size
            or zlib.crc32(chunk, _TYPE_CRC[kind]) != checksum
        ):
            problems.append(f"corrupt chunk at byte {pos}; skipped the rest of its block")
            parts = None
            pos += left_in_block
            continue
        pos = stop
        if kind == FULL:
            if parts is not None:
                problems.append(f"record cut short before byte {pos - length - CHUNK_HEADER.size}")
            parts = None
            yield chunk
        elif kind == FIRST:
            if parts is not None:
                problems.append(f"record cut short before byte {pos - length - CHUNK_HEADER.size}")
            parts = [chunk]
        elif parts is None:
            problems.append(f"record part without its start at byte {pos - length - CHUNK_HEADER.size}")
        elif kind == MIDDLE:
            parts.append(chunk)
        else:
            parts.append(chunk)
            yield b"".join(parts)
            parts = None
    if parts is not None:
        problems.append("the file ends inside a record")


def iter_records(path: str | Path, problems: list[str] | None = None) -> Iterator[Any]:
    """Decode the records of a ``run-<id>.wandb`` file.

    Args:
        path: The ``.wandb`` file.
        problems: If given, receives a line for each corrupt or truncated piece skipped.

    Yields:
        ``wandb.proto.wandb_internal_pb2.Record`` messages, in the order wandb wrote them.

    Raises:
        RunFileError: If the file is not a wandb run file.
    """
    path = Path(path)
    data = path.read_bytes()
    _read_file_header(data, path)
    record_class = _record_class()
    sink = problems if problems is not None else []
    for payload in _iter_payloads(data, sink):
        record = record_class()
        try:
            record.ParseFromString(payload)
        except Exception as error:  # protobuf's DecodeError; its class differs between backends
            sink.append(f"undecodable record skipped: {error}")
            continue
        yield record


def _is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a wandb run directory (holds a ``run-*.wandb`` file)."""
    return path.is_dir() and any(path.glob("run-*.wandb"))


def _run_dir_sort_key(path: Path) -> tuple[str, str]:
    """Order run directories by their start time (``[offline-]run-<YYYYmmdd_HHMMSS>-<id>``)."""
    return path.name.removeprefix("offline-"), str(path)


def find_runs(folder: str | Path) -> list[Path]:
    """Find the wandb run directories in a folder.

    Args:
        folder: A run directory (``.../wandb/offline-run-*``), a ``run-*.wandb`` file, or any
            folder above them, such as an experiment's ``--out`` folder or a whole sweep's.

    Returns:
        The run directories, oldest first (by the start time in their names).

    Raises:
        FileNotFoundError: If ``folder`` does not exist.
    """
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist")
    if folder.is_file():
        if folder.suffix != ".wandb":
            raise RunFileError(f"{folder} is not a .wandb run file or a folder holding runs")
        return [folder.parent]
    if _is_run_dir(folder):
        return [folder]
    found = {file.parent.resolve(): file.parent for file in folder.glob("**/*run-*/run-*.wandb")}
    return sorted(found.values(), key=_run_dir_sort_key)


def _decode(value_json: str) -> Any:
    """Decode one JSON value as wandb wrote it (``NaN`` and ``Infinity`` included)."""
    try:
        return json.loads(value_json)
    except ValueError:
        return value_json


def _key_path(item: Any) -> list[str]:
    """The key of a config, history or summary item, as a path of nested keys."""
    return list(item.nested_key) if item.nested_key else [item.key]


def _set_path(target: dict[str, Any], keys: Sequence[str], value: Any) -> None:
    """Set ``target[k0][k1]...[kn] = value``, creating (or replacing non-dict) levels on the way."""
    for key in keys[:-1]:
        child = target.get(key)
        if not isinstance(child, dict):
            child = target[key] = {}
        target = child
    target[keys[-1]] = value


def _remove_path(target: dict[str, Any], keys: Sequence[str]) -> None:
    """Remove ``target[k0]...[kn]`` if present."""
    for key in keys[:-1]:
        target = target.get(key)
        if not isinstance(target, dict):
            return
    target.pop(keys[-1], None)


def _apply_updates(target: dict[str, Any], record: Any) -> None:
    """Apply the ``update`` and ``remove`` items of a config or summary record to ``target``."""
    for item in record.update:
        _set_path(target, _key_path(item), _decode(item.value_json))
    for item in record.remove:
        _remove_path(target, _key_path(item))


def _history_row(record: Any) -> dict[str, Any]:
    """One logged step of a history record, with ``_step`` always present."""
    row: dict[str, Any] = {}
    for item in record.item:
        _set_path(row, _key_path(item), _decode(item.value_json))
    if "_step" not in row and record.HasField("step"):
        row["_step"] = record.step.num
    return row


def _without_internal(values: dict[str, Any]) -> dict[str, Any]:
    """Drop wandb's bookkeeping entries (``_wandb``) from a config or summary."""
    return {key: value for key, value in values.items() if key not in _INTERNAL_KEYS}


def _run_file(run_dir: Path) -> Path:
    """The ``run-<id>.wandb`` file of a run directory."""
    files = sorted(run_dir.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"{run_dir} holds no run-*.wandb file")
    return files[-1]


def _read_run_dir(run_dir: Path) -> OfflineRun:
    """Decode the run file of one run directory."""
    path = _run_file(run_dir)
    problems: list[str] = []
    run = OfflineRun(
        id=path.stem.removeprefix("run-"),
        name=None,
        group=None,
        project=None,
        config={},
        history=[],
        summary={},
        exit_code=None,
        path=run_dir,
        problems=problems,
    )
    for record in iter_records(path, problems):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info = record.run
            run.id = info.run_id or run.id
            run.name = info.display_name or None
            run.group = info.run_group or None
            run.project = info.project or None
            _apply_updates(run.config, info.config)
            _apply_updates(run.summary, info.summary)
        elif kind == "config":
            _apply_updates(run.config, record.config)
        elif kind == "history":
            row = _history_row(record.history)
            run.history.append(row)
            for item in record.history.item:
                _set_path(run.summary, _key_path(item), _decode(item.value_json))
            if "_step" in row:
                run.summary["_step"] = row["_step"]
        elif kind == "summary":
            _apply_updates(run.summary, record.summary)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config = _without_internal(run.config)
    run.summary = _without_internal(run.summary)
    return run


def read_run(path: str | Path, run_id: str | None = None) -> OfflineRun:
    """Read one wandb run back from its files.

    Args:
        path: A run directory, its ``.wandb`` file, or a folder above (an experiment's ``--out``).
            When the folder holds several runs, the latest one is read.
        run_id: Read the run with this id instead of the latest.

    Returns:
        The run's config, history and summary.

    Raises:
        FileNotFoundError: If ``path`` holds no wandb run (or none with ``run_id``).
        RunFileError: If the run file is not a wandb run file.
    """
    runs = find_runs(path)
    if run_id is not None:
        runs = [run_dir for run_dir in runs if run_dir.name.endswith(f"-{run_id}")]
    if not runs:
        which = f"with id {run_id!r} " if run_id else ""
        raise FileNotFoundError(
            f"no wandb run {which}under {path}: expected <folder>/wandb/offline-run-*/run-*.wandb "
            "(does the program call wandb.init(dir=<its --out folder>)?)"
        )
    return _read_run_dir(runs[-1])


def read_runs(folder: str | Path) -> list[OfflineRun]:
    """Read every wandb run under a folder, oldest first (see ``find_runs``)."""
    return [_read_run_dir(run_dir) for run_dir in find_runs(folder)]


def _as_json(run: OfflineRun, with_history: bool) -> dict[str, Any]:
    """A JSON-ready view of a run."""
    view: dict[str, Any] = {
        "id": run.id,
        "name": run.name,
        "group": run.group,
        "project": run.project,
        "state": run.state,
        "exit_code": run.exit_code,
        "path": str(run.path),
        "config": run.config,
        "summary": run.summary,
        "steps": len(run.history),
    }
    if with_history:
        view["history"] = run.history
    if run.problems:
        view["problems"] = run.problems
    return view


def main(argv: Sequence[str] | None = None) -> int:
    """Print the runs under a folder as JSON: ``python -m experiments.wandb_runs FOLDER [--history]``."""
    parser = argparse.ArgumentParser(prog="python -m experiments.wandb_runs", description=main.__doc__)
    parser.add_argument("folder", type=Path, help="a run directory, or a folder holding runs (an --out folder)")
    parser.add_argument("--history", action="store_true", help="include every logged row")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.folder)
    except (OSError, RunFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not runs:
        print(f"error: no wandb runs under {args.folder}", file=sys.stderr)
        return 2
    json.dump([_as_json(run, args.history) for run in runs], sys.stdout, indent=2, default=str)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
