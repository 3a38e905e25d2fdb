"""The run's folder (``--out``): the checks before anything is written, resuming, and making it the run's.

:func:`prepare_out` checks the folder and, with ``--resume`` (or on torchrun's restart), the checkpoint's
config against this run's (the data by its files, wherever they now are) and its code (:func:`source`)
against this one; :func:`take_out` then clears an ``--overwrite``'n run's files and writes ``config.yaml``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from experiments.harness import recipes
from experiments.harness.cli import flag
from experiments.harness.config import RunOptions
from experiments.harness.folder import (
    METRICS_FILE,
    PLOTS,
    RUN_FILES,
    FolderLock,
    UsageError,
    atomic_write,
    writing,
)
from tasks._src import cache as data_cache

__all__ = ["RESUMABLE", "DATA_KEYS", "prepare_out", "take_out"]
__all__ += ["fingerprint", "data_identity", "source"]

# Config keys that --resume may change: none changes the trajectory (except the length of a run whose schedule is a
# share of it: refused), so a lengthened run ends with the parameters of a run that was that long from the start.
RESUMABLE = ("iterations", "log_every", "val_every", "checkpoint_every")
# Config keys naming data on disk: on --resume, another spelling of the path, or another folder holding the same
# files (the data moved), is the same data.
DATA_KEYS = ("data", "test_data")
_TEMPORARY = re.compile(r"\..+\.tmp(\d+)")  # atomic_write's temporary files, .NAME.tmpPID
_WANDB_FILES = re.compile(r"(offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(-internal)?\.log")  # under --out/wandb
CODE = Path(__file__).resolve().parents[2]  # the checkout whose commit a run records (source())


def prepare_out(opts: RunOptions, cfg: Any, lock: FolderLock) -> dict[str, Any] | None:
    """Checks the output folder (taking it with ``lock``) before anything is written; returns the
    checkpoint when resuming.

    Rank 0 alone reads ``--out`` (other ranks may not see it) and sends every rank the checkpoint or
    the error, so that all ranks resume from the same state or stop together.

    Raises:
        UsageError: ``--out`` is a file, sits under a file or
            cannot be written; it holds another run (without ``--resume``/``--overwrite``); or
            the checkpoint to resume is missing, unreadable, from a config that differs in
            more than :data:`RESUMABLE`, or begun with other code (:func:`source`) than this.
    """
    outcome: dict[str, Any] | UsageError | None = None
    if opts.main:
        try:
            outcome = _check_out(opts, cfg, lock)
        except UsageError as e:
            if opts.world_size == 1:
                raise
            outcome = e
    if opts.world_size > 1:  # rank 0's outcome on every rank
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, UsageError):
        raise outcome
    return outcome


def _check_out(opts: RunOptions, cfg: Any, lock: FolderLock) -> dict[str, Any] | None:
    out = opts.out
    if opts.resume and opts.overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one.")
    _check_writable(out)
    if out.is_dir():
        lock.take(out)  # before reading it: a run still writing there would change what the checks see
    unstarted, taken = _unstarted(out, cfg), [f for f in RUN_FILES if (out / f).exists()]
    path = out / "checkpoint.pt"
    restarted = opts.restart > 0 and path.is_file()  # torchrun restarted the processes: on from the last checkpoint
    if restarted:
        print(f"torchrun restart {opts.restart}: resuming the run in {out} from its last checkpoint", file=sys.stderr)
    if opts.resume or restarted:
        if not path.is_file() and unstarted:
            print(
                f"--resume: {out} holds no checkpoint, as its run ended before the first; starting it from the beginning",
                file=sys.stderr,
            )
            return None
        if not path.is_file():
            if taken:  # a run of another config that ended before its first checkpoint: nothing to resume
                raise UsageError(
                    f"--resume: no checkpoint at {path}, so nothing to resume: the run there ({', '.join(taken)}) "
                    f"wrote none; pass --overwrite instead of --resume to start it anew, or another --out."
                )
            raise UsageError(f"--resume: no checkpoint at {path}; start the run without --resume.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            saved = state["config"]
        except Exception as e:  # a truncated or foreign file: say so, keep it
            raise UsageError(
                f"--resume: the checkpoint {path} is corrupt or not from this script ({type(e).__name__}: {e})."
            ) from None
        mine = dataclasses.asdict(cfg)
        scheduled = recipes.Schedule.of(saved).depends_on_length  # its schedule is a share of its --iterations
        diff = []
        for key in [*mine, *(k for k in saved if k not in mine)]:
            old, new = saved.get(key), mine.get(key)
            data = key in DATA_KEYS and isinstance(old, str) and isinstance(new, str)  # compared even when equal
            if (old == new and not data) or (key in RESUMABLE and not (key == "iterations" and scheduled)):
                continue
            if data:
                problem = _same_data(old, new, state.get("data", {}).get(key), key)
                if problem is None:
                    continue
                diff.append(f"{key}={new!r} (run has {old!r}; {problem})")
            else:
                diff.append(f"{key}={new!r} (run has {old!r})")
        if diff and scheduled and any(d.startswith("iterations=") for d in diff):
            raise UsageError(
                f"--resume: --iterations {cfg.iterations} differs from the run's {saved['iterations']}, and its "
                f"schedule (meta_lr_schedule, first_order_fraction or msl_fraction, as --algorithm sets them) is a "
                f"share of --iterations; resume with --iterations {saved['iterations']}."
            )
        if diff:
            allowed = ", ".join(flag(k) for k in RESUMABLE[:-1]) + f" and {flag(RESUMABLE[-1])}"
            raise UsageError(
                f"--resume: the config differs from the run in {out}: {', '.join(diff)}. Resume with the same "
                f"flags (only {allowed} may change), or --config {out / 'config.yaml'}."
            )
        # The code too: a run resumed with other code than it began with would mix two codes' results under one.
        now, began = source(), state.get("git_history", [{}])[0]
        if any(began.get(k, "unrecorded") != v for k, v in now.items()):
            was, this = (
                f"commit {(r.get('git_commit') or 'unknown')[:10]}"
                + (f" with uncommitted changes {r['git_changes']}" if r.get("git_dirty") else "")
                for r in (began, now)
            )
            raise UsageError(
                f"--resume: the run in {out} began with the code of {was}, and this is {this}: resume with the code "
                f"it began with, or pass --overwrite to start it anew."
            )
        state["git_history"].append({"at": "resume", "iteration": state["iteration"], **now})
        edited = _edited_keys(out / "config.yaml", saved)
        if edited:
            print(
                f"note: {out / 'config.yaml'} was edited ({', '.join(edited)}); --resume continues with the run's "
                f"config, kept in its checkpoint, and writes config.yaml anew (a resumable key changes by its flag)",
                file=sys.stderr,
            )
        return state
    if taken and not opts.overwrite and unstarted:
        print(f"--out {out} holds this run, ended before its first checkpoint: starting it again", file=sys.stderr)
        return None
    if taken and not opts.overwrite and "checkpoint.pt" not in taken:
        # --resume would say there is no checkpoint: name only what works, never a loop of two messages.
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(taken)}) without a checkpoint, so there is nothing to "
            f"resume; pass --overwrite to replace it, or another --out."
        )
    if taken and not opts.overwrite:
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(taken)}); pass --resume to continue it, "
            f"--overwrite to replace it, or another --out."
        )
    return None


def source() -> dict[str, Any]:
    """The code that runs: :data:`CODE`'s commit, whether its tracked files differ from it, and a digest of the
    differences, by which a resume knows the same changes (None each where git fails: not a checkout)."""
    git = functools.partial(subprocess.run, cwd=CODE, capture_output=True, timeout=10, check=True)
    try:
        commit = git(["git", "rev-parse", "HEAD"]).stdout.decode().strip()
        # Changed code, not results: a committed sweep resumed in place rewrites its results/ files (sweep.json).
        changes = git(["git", "diff", "--binary", "--no-ext-diff", "HEAD", "--", ".", ":(exclude)results"]).stdout
    except (OSError, subprocess.SubprocessError):
        commit, changes = None, None
    digest = hashlib.sha256(changes).hexdigest()[:16] if changes else None
    return {"git_commit": commit, "git_dirty": None if changes is None else bool(changes), "git_changes": digest}


def config_text(cfg: Any) -> str:
    """``cfg`` as ``config.yaml`` holds it (``--config`` reads it back)."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    return yaml.safe_dump(values, sort_keys=False)


def _edited_keys(path: Path, saved: dict[str, Any]) -> list[str]:
    """The keys whose values in ``path`` (a run's config.yaml) differ from the checkpoint's config ``saved``."""
    try:
        written = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # unreadable: rewritten from the run's config, as always
    if not isinstance(written, dict):
        return []
    kept = {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items()}
    return [k for k in {**kept, **written} if written.get(k) != kept.get(k)]


def _unstarted(out: Path, cfg: Any) -> bool:
    """Whether ``out`` (locked by now) holds a run of ``cfg`` to the letter that ended before its first checkpoint."""
    try:
        same = (out / "config.yaml").read_text() == config_text(cfg)
    except (OSError, UnicodeDecodeError):
        return False
    return same and not (out / "checkpoint.pt").exists() and not (out / "results.json").exists()


def _check_writable(out: Path) -> None:
    """Raises UsageError unless ``out`` is, or can be made, a folder this process can write in; writes nothing."""
    here = out
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file, not a folder; pass a folder (it is created if missing).")
        here = next(p for p in (out, *out.parents) if p.exists())
        if not here.is_dir():
            raise UsageError(f"--out {out}: {here} is a file, so no folder can be made there; pass another --out.")
        # Creating a file asks what the permissions, a read-only mount and `chattr +i` say, even to root.
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        raise UsageError(
            f"--out {out}: cannot write in {here} ({e.strerror or e}); make it writable or pass another --out."
        ) from None


def _data_files(path: str) -> tuple[Path, list[Path]] | None:
    """The files at ``path`` (a file, or a folder's non-hidden ones: caches left out) and their root; None if missing."""
    root = Path(path)
    if not root.is_dir():
        return (root.parent, [root]) if root.is_file() else None
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(folder) / f for f in files if not f.startswith(".")]
    return root, found


def fingerprint(path: str) -> str | None:
    """A digest of the names and sizes of the files at ``path`` (a file, or a folder's non-hidden files), None if missing:
    they tell data apart without reading it, wherever the files are (hidden caches left out)."""
    found = _data_files(path)
    entries = sorted((p.relative_to(found[0]).as_posix(), p.stat().st_size) for p in found[1]) if found else None
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest() if found else None


def data_identity(path: str) -> dict[str, str | None]:
    """What a checkpoint keeps of a data path: the resolved path, the files' fingerprint, and what the data caches
    key on (``tasks._src.cache.fingerprint``'s ``digest`` as ``state``, and ``content``, which a copy keeps)."""
    resolved = str(Path(path).expanduser().resolve())
    keyed = data_cache.fingerprint(*found) if (found := _data_files(resolved)) is not None else {}
    return {"path": resolved, "fingerprint": fingerprint(resolved), "state": keyed.get("digest"),
            "content": keyed.get("content")}  # fmt: skip


def _same_data(old: str, new: str, kept: dict[str, str | None] | None, key: str = "data") -> str | None:
    """None when ``new`` names the data the run began with (``old``, ``kept`` by its checkpoint); else why not.

    Raises:
        UsageError: ``new`` is the run's path, and its files changed since the run began (or last resumed).
    """
    # A checkpoint from before data identities were kept: its path, resolved from here.
    before = kept["path"] if kept else str(Path(old).expanduser().resolve())
    now = data_identity(new)
    if now["path"] == before:
        # What the cache compares: a file rewritten at its size decodes again (a checkpoint without it: names, sizes).
        same = [kept[k] in (None, now[k]) for k in ("fingerprint", "state") if kept and k in kept]
        if all(same):
            return None
        raise UsageError(
            f"--resume: {flag(key)} {new}: its files are not those the run began with (their names, sizes, "
            f"modification times or contents differ, as the decoded cache compares them: files added, removed, "
            f"touched or rewritten in place since); put them back, or start a new run with --overwrite or another "
            f"--out."
        )
    if kept is None or kept["fingerprint"] is None:
        return "its checkpoint keeps no record of the files to compare; pass the path the run began with"
    if now["fingerprint"] != kept["fingerprint"]:
        return "not the same files: their names or sizes differ" if now["fingerprint"] else f"{new} does not exist"
    if None not in (kept.get("content"), now["content"]) and kept.get("content") != now["content"]:
        return "not the same files: their contents differ"
    print(f"resuming with --data {new}: the same files as {before}, where the run began", file=sys.stderr)
    return None


def take_out(opts: RunOptions, cfg: Any, lock: FolderLock) -> None:
    """Makes ``--out`` this run's, once every check has passed (rank 0): clears, then writes config.yaml.

    With ``--overwrite``, first removes what the old run wrote (:data:`RUN_FILES`, metrics, plots,
    wandb runs), so its results never stand beside the new run's; other files stay. The temporary
    files of writers killed mid-write go too.

    Raises:
        UsageError: the folder cannot be written (full, read-only); nothing is left half-written.
    """
    out = opts.out
    made = not out.exists()
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
        lock.take(out)  # a folder made just now: two runs that both found it missing meet here
        # A run that ended before its first checkpoint starts again as if overwritten (_unstarted).
        if opts.overwrite or ((out / "config.yaml").exists() and not (out / "checkpoint.pt").exists()):
            for name in (*RUN_FILES, METRICS_FILE, *PLOTS):
                (out / name).unlink(missing_ok=True)
            runs = out / "wandb"
            for path in runs.iterdir() if runs.is_dir() else ():
                if _WANDB_FILES.fullmatch(path.name):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            with contextlib.suppress(OSError):
                runs.rmdir()  # when nothing but the old run's files was there
        for path in out.glob(".*.tmp*"):
            match = _TEMPORARY.fullmatch(path.name)
            if match and not _alive(int(match.group(1))):
                path.unlink(missing_ok=True)
    try:
        atomic_write(out / "config.yaml", lambda p: p.write_text(config_text(cfg)))
    except UsageError:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True
