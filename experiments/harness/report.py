"""What a run reports: the test metrics with their 95 % confidence intervals, in ``results.json`` with its
provenance (:func:`finish`); the log of training (:class:`Logbook`: ``metrics.jsonl`` and wandb's rows); wandb (its
mode from ``--wandb``, ``$WANDB_MODE`` or whether the user is logged in, starting and finishing the run: rank 0 alone
logs, under ``--out``; without a server, a key or a network it logs offline, and says how to upload); and the plots
(:func:`learning_curves`, and :func:`save_figure` for a script's own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math
import netrc
import os
import platform
import socket
import sys
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from experiments.harness.config import RunOptions
from experiments.harness.folder import UsageError, atomic_write, writing
from experiments.harness.rundir import DATA_KEYS, source

__all__ = ["mean_ci95", "provenance", "finish", "wandb_mode", "default_wandb_mode", "init_wandb", "finish_wandb"]
__all__ += ["Logbook"]
__all__ += ["Panel", "pyplot", "save_figure", "fit_title", "learning_curves"]


def mean_ci95(values: Tensor) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (normal approximation)."""
    values = values.double().flatten()
    n = values.numel()
    half = 1.96 * float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return float(values.mean()), half


def provenance() -> dict[str, Any]:
    """Package versions, the machine, and the code that runs now (:func:`~experiments.rundir.source`)."""
    versions = {"python": platform.python_version()}
    for pkg in ("maml-toolkit", "torch", "numpy", "wandb", "learn2learn", "higher"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    cpu = None  # the processor's model name (Linux), else the platform's word for it
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return {
        "versions": versions,
        **source(),
        "host": platform.node(),
        "cpu": cpu or platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def finish(
    opts: RunOptions,
    cfg: Any,
    run: Any,
    trained: Mapping[str, Any],
    data_files: Mapping[str, Mapping[str, str | None]],
    test: dict[str, dict[str, Any]],
    metric: str,
    **extra: Any,
) -> None:
    """Puts the test metric in the wandb summary, writes results.json, and closes the wandb run.

    ``trained``: what the trainer keeps (``Trainer.results()``); ``data_files``: the data's identity by config key.
    A data path is recorded by :func:`data_record`, no path of this machine.
    """
    for key, r in test.items():
        run.summary[f"test/{metric}_{key}"] = r[metric]
        run.summary[f"test/{metric}_{key}_ci95"] = r["ci95"]
    config = dataclasses.asdict(cfg)
    data = {k: data_record(v, data_files.get(k, {})) for k in DATA_KEYS if isinstance(v := config.get(k), str)}
    config.update({k: d["name"] for k, d in data.items()})
    results = {
        "experiment": opts.experiment,
        "config": config,
        **({"data_files": data} if data else {}),
        **extra,
        "test": test,
        **trained,
        "device": str(opts.device),
        "processes": opts.world_size,
        **provenance(),
    }
    atomic_write(opts.out / "results.json", lambda p: p.write_text(json.dumps(results, indent=2) + "\n"))
    finish_wandb(run)


HOLDS_SHOWN = 20  # at most this many entries of a data folder are named in results.json (class folders can be more)


def data_record(path: str, identity: Mapping[str, str | None]) -> dict[str, Any]:
    """What ``results.json`` keeps of a data path (``config``'s ``data`` is its ``name``): no path, for a path is
    one machine's, relative (to a working directory the file does not record) or not, and results are committed.

    ``name``: the data's own (the folder's or file's, as the path resolves: ``--data .`` names the folder);
    ``holds``: the names in the folder, sorted, hidden ones (caches) left out, at most :data:`HOLDS_SHOWN` then
    ``"... N in all"`` (None for a file); ``fingerprint``: the run's digest of its files' names and sizes
    (:func:`~experiments.harness.rundir.fingerprint`), which tells the same data apart wherever it is.
    """
    resolved = Path(path).expanduser().resolve()
    holds = sorted(p.name for p in resolved.iterdir() if not p.name.startswith(".")) if resolved.is_dir() else None
    if holds is not None and len(holds) > HOLDS_SHOWN:
        holds = [*holds[:HOLDS_SHOWN], f"... {len(holds)} in all"]
    return {"name": resolved.name, "holds": holds, "fingerprint": identity.get("fingerprint")}


# ---------------------------------------------------------------------- the training log


class Logbook:
    """Rank 0's log of a run: every row to ``metrics.jsonl`` and to wandb. A start rewrites the file with the
    checkpoint's history, so after a kill it holds each logged iteration once and none that is redone. Where stderr
    is no terminal (a batch job), tqdm is silent and a plain progress line per log window goes to stderr instead."""

    def __init__(self, path: Path, file: IO[str], run: Any, wandb_from: int, start: int) -> None:
        self.path, self.file, self.run, self.wandb_from = path, file, run, wandb_from
        # tqdm switches itself off without a terminal (disable=None); then a plain line per log window.
        self.plain = sys.stderr is not None and not sys.stderr.isatty()
        self.window_began, self.window_start = time.perf_counter(), start

    @classmethod
    def open(cls, path: Path, history: list[dict[str, float]], run: Any, start: int) -> Logbook:
        """Rewrites ``path`` with ``history``, opens it for appending, and replays to wandb what its run lacks."""
        atomic_write(path, lambda p: p.write_text("".join(json.dumps(row) + "\n" for row in history)))
        with writing(path):
            file = path.open("a")
        # wandb's next step: 0 offline; online, past the last row its server holds (it has the earlier ones).
        wandb_from = run.starting_step
        for row in history:
            if row["iteration"] >= wandb_from:
                run.log(row, step=row["iteration"])
        return cls(path, file, run, wandb_from, start)

    def write(self, row: dict[str, float], iterations: int) -> None:
        """One row, to the file (flushed: a kill loses no row the process logged) and to wandb."""
        iteration = int(row["iteration"])
        with writing(self.path):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if iteration >= self.wandb_from:
            self.run.log(row, step=iteration)
        if self.plain:
            now = time.perf_counter()
            rate = (iteration - self.window_start) / max(now - self.window_began, 1e-9)
            eta = round((iterations - iteration) / rate)
            print(
                f"meta-train {iteration}/{iterations} ({100 * iteration // iterations} %): "
                f"meta-loss {row['train/meta_loss']:.4g}, {rate:.1f} it/s, "
                f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}",
                file=sys.stderr,
                flush=True,
            )
            self.window_began, self.window_start = now, iteration

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


# ---------------------------------------------------------------------- wandb

_MODES = ("offline", "online", "disabled")  # --wandb's choices
# $WANDB_MODE's other values that wandb accepts ("shared": several processes log one run; a script's run is one).
_OLD_NAMES = {"dryrun": "offline", "run": "online", "shared": "online"}


def wandb_mode(given: str | None) -> str:
    """The run's wandb mode: ``--wandb`` (``given``), else :func:`default_wandb_mode`.

    An empty ``$WANDB_MODE`` counts as unset, and is removed (wandb refuses it); UsageError for one that is no mode.
    """
    value = os.environ.get("WANDB_MODE")
    if value == "":
        del os.environ["WANDB_MODE"]
    elif value is not None and value not in (*_MODES, *_OLD_NAMES):
        raise UsageError(
            f"WANDB_MODE {value!r} is not one of {', '.join((*_MODES, *_OLD_NAMES))}; set it to one of them, or unset it."
        )
    return given or default_wandb_mode()


def default_wandb_mode() -> str:
    """$WANDB_MODE if set; online if the user is logged in; offline otherwise (never hangs without network).

    Logged in: ``$WANDB_API_KEY``, or a key in the netrc file (``$NETRC``, else ``~/.netrc``: ``wandb login``'s) for
    the host of ``$WANDB_BASE_URL`` (else https://api.wandb.ai).
    """
    mode = os.environ.get("WANDB_MODE")
    if mode in (*_MODES, *_OLD_NAMES):
        return _OLD_NAMES.get(mode, mode)  # type: ignore[arg-type]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entry = netrc.netrc(path).authenticators(host) if host else None
    except (OSError, netrc.NetrcParseError):
        return "offline"
    return "online" if entry and entry[2] else "offline"


def init_wandb(opts: RunOptions, cfg: Any, name: str, run_id: str | None) -> Any:
    """Starts (or resumes) the wandb run, its files under ``--out``; never blocks without a network.

    ``--wandb online`` with no server to reach (one TCP connection, at most 5 s), no API key, or a server that
    refuses the key logs offline instead, with a warning that gives the ``wandb sync`` command for later.
    """
    import wandb

    os.environ.setdefault("WANDB_DIR", str(opts.out))
    start = functools.partial(
        wandb.init,
        project=os.environ.get("WANDB_PROJECT", "maml-toolkit"),
        name=os.environ.get("WANDB_NAME", name),
        group=os.environ.get("WANDB_RUN_GROUP"),
        dir=str(opts.out),
        id=run_id,
        resume="allow" if run_id else None,
        config=dataclasses.asdict(cfg),
    )
    if opts.wandb != "online":
        return start(mode=opts.wandb)
    url = wandb.setup().settings.base_url
    parts = urllib.parse.urlsplit(url)
    problem, login = None, False
    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if not any(os.environ.get(v) for v in proxies):  # behind a proxy, the proxy connects: leave it to wandb
        try:
            address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
            socket.create_connection(address, timeout=5).close()
        except OSError as e:  # e.g. Connection refused, timed out
            problem = f"cannot reach the W&B server at {url} ({e.strerror or e})"
    if problem is None:
        try:
            return start(mode="online")
        except wandb.errors.Error as e:  # wandb's own retries have run out (init_timeout), or no usable key
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            login = isinstance(e, (wandb.errors.UsageError, wandb.errors.AuthenticationError))
            problem = (
                f"no W&B API key ({detail})"
                if isinstance(e, wandb.errors.UsageError)
                else f"the W&B server at {url} refused the API key ({detail})"
                if login
                else f"cannot reach the W&B server at {url} ({detail})"
            )
            wandb.teardown()
    run = start(mode="offline")
    print(
        f"warning: --wandb online: {problem}; logging offline instead. To upload the run later: "
        f"{'wandb login, then ' if login else ''}wandb sync {run.settings.sync_dir}",
        file=sys.stderr,
    )
    return run


def finish_wandb(run: Any, exit_code: int | None = None) -> None:
    """Finishes the wandb run (marked failed for an ``exit_code`` other than 0 and None)."""
    import wandb

    run.finish(exit_code=exit_code)
    wandb.teardown()  # finish() can return before the offline .wandb file is complete; teardown waits for it


# ---------------------------------------------------------------------- plots

# A panel of the learning curves: its title, y label and scale, and the (metric, label) lines it draws; a
# validation metric ("val/...") is drawn at the iterations that validated, as dots.
Panel = tuple[str, str, str, Sequence[tuple[str, str]]]


def pyplot() -> Any:
    import matplotlib  # when a plot is drawn; Agg: files only, no display needed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Writes ``fig`` to the PNG file ``path`` (atomically) and closes it.

    A title of the figure (``suptitle``) wider than the figure is wrapped at its words to fit, and the file holds
    everything drawn (``bbox_inches="tight"``), so no title is cut at the edges: ``task_grid.png`` is a few images
    wide, narrower than its title on one line.
    """
    fit_title(fig)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=120, bbox_inches="tight", pad_inches=0.05))
    pyplot().close(fig)


def fit_title(fig: Any, margin: float = 0.96) -> None:
    """Wraps each line of the figure's title (``suptitle``) that is wider than ``margin`` of the figure at its words."""
    title = getattr(fig, "_suptitle", None)  # matplotlib keeps the suptitle's Text there
    if title is None or not title.get_text().strip():
        return
    renderer = fig.canvas.get_renderer()
    width = margin * fig.bbox.width

    def fits(text: str) -> bool:
        title.set_text(text)
        return title.get_window_extent(renderer).width <= width

    wrapped: list[str] = []
    for line in title.get_text().split("\n"):
        words = line.split()
        if not words or fits(line):
            wrapped.append(line)
            continue
        wrapped.append(words[0])
        for word in words[1:]:
            if fits(f"{wrapped[-1]} {word}"):
                wrapped[-1] += f" {word}"
            else:
                wrapped.append(word)  # a word wider than the figure alone: bbox_inches="tight" keeps it whole
    title.set_text("\n".join(wrapped))


def learning_curves(out: Path, history: list[dict[str, float]], panels: Sequence[Panel]) -> None:
    """``learning_curves.png``: one panel per entry of ``panels``, over the logged rows ``history``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.5))
    its = [r["iteration"] for r in history]
    for ax, (title, ylabel, yscale, lines) in zip(axes, panels):
        for key, label in lines:
            if key.startswith("val/"):
                val = [(r["iteration"], r[key]) for r in history if key in r]
                if val:
                    ax.plot(*zip(*val), "o-", label=label)
            else:
                ax.plot(its, [r.get(key, float("nan")) for r in history], label=label)
        ax.set(xlabel="meta-iteration", ylabel=ylabel, yscale=yscale, title=title)
        ax.legend()
    save_figure(fig, out / "learning_curves.png")
