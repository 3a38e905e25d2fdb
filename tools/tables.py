"""Every table of the README and of ``docs/``, rendered from result files and from the code: no figure typed by hand.

    python -m tools.tables            # rewrites every table block of README.md and docs/*.md
    python -m tools.tables --check    # exit 1 (and the first difference) where a page is stale

A block is the text between ``<!-- table: NAME -->`` and ``<!-- /table -->``; ``NAME`` picks its
renderer (:data:`RENDERERS`), which reads only committed files: a trial's ``results.json`` and
``metrics.jsonl``, a sweep's ``sweep.json``, a benchmark's JSON under ``results/benchmarks``, and
the scripts' own config dataclasses and recipes (the flag and recipe tables). Each result table says
what its figures are (seeds, iterations, which checkpoint), and the device, date, commit and command
they come from.

Every line of a page that looks like a marker (``<!--`` and ``table``, in any case or spacing) must
be exactly one of the two, alone on its line, with blocks opened and closed in turn and a known
``NAME``; otherwise nothing is rendered or written, so that a damaged marker cannot swallow the text
up to the next block's end. In a fenced code block (a page showing the syntax) a marker is text.

Exit codes: 0, 1 for ``--check`` on a stale page, 2 for a missing file, a damaged marker or an unknown
block (one line, naming the page and its line); on 2 no page is written.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import math
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from experiments.harness.folder import UsageError, atomic_write

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
OPEN = re.compile(r"<!-- table: (?P<name>[\w-]+) -->")  # a block's first line, exactly (BLOCK's opening)
CLOSE = "<!-- /table -->"  # a block's last line, exactly
LIKE_MARKER = re.compile(r"<!--.*table", re.I)  # a line meant as a marker, however misspelt or spaced
FENCE = re.compile(r"\s*(?P<fence>`{3,}|~{3,})")  # a code fence's line: the markers in a fenced block are text
MEANT = re.compile(r"<!--\s*(?P<close>/)?\s*table\s*(?::\s*(?P<name>\w+(?:-\w+)*))?", re.I)  # what it meant
STEPS = ("1step", "5step", "10step")  # the test columns: the reference trains with 1 step and tests with up to 10


class TableError(Exception):
    """A result file or README block is missing, unreadable or not reproducible: one line, exit code 2."""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TableError(f"{path.relative_to(REPO)}: {e}") from None


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    except (OSError, ValueError) as e:
        raise TableError(f"{path.relative_to(REPO)}: {e}") from None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def command(results: dict[str, Any]) -> str:
    """The command that ran a trial: its script with the flags whose values differ from the defaults."""
    from experiments import omniglot, sine  # here: only this needs torch
    from experiments.harness import recipes

    name, cfg = results["experiment"], results["config"]
    cls = {"omniglot": omniglot.OmniglotConfig, "sine": sine.SineConfig}[name]
    base = cls(**{k: v for k, v in cfg.items() if k in ("ways", "shots")}, **recipes.recipe(cls, cfg["algorithm"]))
    defaults = dataclasses.asdict(base.resolved() if hasattr(base, "resolved") else base)
    flags = []
    for key, value in results["config"].items():
        if defaults.get(key) == value or (isinstance(value, list) and tuple(value) == defaults.get(key)):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list) else "null" if value is None else value
        if key == "data":  # where the run found the archives, a path of its machine: the reader's is DIR
            shown = "DIR"
        flags.append(f"--{key.replace('_', '-')} {shown}")
    return " ".join([f"python -m experiments.{name}", *flags])


def _distinct(values: Iterable[Any]) -> str:
    """The distinct values that are not None, in order of first appearance, comma-separated ("-" for none)."""
    return ", ".join(dict.fromkeys(str(v) for v in values if v is not None)) or "-"


def provenance(runs: Sequence[dict[str, Any]]) -> str:
    """Device, processor, threads, dates and commits of ``runs``, as one sentence.

    A run's ``git_commit`` and ``git_dirty`` are the code at its end; ``git_history``, the code at its start and at
    each resume. Results written before runs kept that history (the committed ones, the benchmarks') have only the
    end's: they are shown, and the sentence says that their commit was taken at their end.

    Raises:
        TableError: a run whose commit does not reproduce it: one that records no commit, or that started, was
            resumed or ended in a tree with uncommitted changes, or at another commit than it ended at.
    """
    for run in runs:
        name = run.get("command", run.get("experiment", "a run"))
        if not run.get("git_commit"):
            raise TableError(
                f"{name!r} records no git commit (git failed, or it ran outside a checkout): run it again in one"
            )
        for record in [*run.get("git_history", []), run]:  # its start, its resumes, its end
            when = {"start": "started", "resume": "was resumed"}.get(record.get("at"), "ran")
            if record.get("git_dirty") is not False:
                raise TableError(
                    f"{name!r} {when} in a tree with uncommitted changes: run it again from a committed tree"
                )
            if record.get("git_commit") != run["git_commit"]:
                raise TableError(
                    f"{name!r} {when} at commit {str(record.get('git_commit'))[:10]} and ended at "
                    f"{run['git_commit'][:10]}: run it again at one commit"
                )
    dates = [run.get("date") or _commit_date(run.get("git_commit")) for run in runs]
    cpus = _distinct(run.get("gpu") or run.get("cpu") for run in runs)
    threads = _distinct(run.get("threads") for run in runs)
    commits = _distinct((run.get("git_commit") or "")[:10] for run in runs)
    device = _distinct(run["device"] for run in runs)
    threads = f", {threads} thread{'s' * (threads != '1')} a run" if threads != "-" else ""
    # Results that predate the start's record: their commit is the end's, and the sentence says no more.
    late = sum("git_history" not in run for run in runs)
    if late == len(runs):
        commits += f" (taken at {'the run' if late == 1 else 'each run'}'s end; its start was not recorded)"
    elif late:
        commits += f" (taken at the end for {late} of the {len(runs)} runs, whose start was not recorded)"
    return (
        f"device {device}"
        + (f" ({cpus})" if cpus != "-" else "")
        + f"{threads}; {_distinct(sorted(dates))}; commit {commits}"
    )


# The Omniglot archives a run read, known by the number of characters it found in them (results.json's
# ``data``): the two small background archives hold 242 once Greek and Latin, in both, are read once.
OMNIGLOT_ARCHIVES = {
    242: "the two small background archives, `images_background_small1.zip` and `images_background_small2.zip`",
    1623: "the full archives, `images_background.zip` and `images_evaluation.zip`",
}


def omniglot_data(runs: Sequence[dict[str, Any]]) -> str:
    """Which Omniglot archives ``runs`` read and how their characters were split, as a sentence ("" if unrecorded)."""
    splits = {tuple(run["data"]["characters"]) for run in runs if "characters" in run.get("data", {})}
    if len(splits) != 1:  # none recorded, or runs that read different data
        return ""
    ((train, val, test),) = splits
    archives = OMNIGLOT_ARCHIVES.get(train + val + test, "archives")
    return (
        f" Data (`--data DIR` or `$OMNIGLOT_DIR`): {archives}, {train + val + test} characters, {train} to train on, "
        f"{val} to validate and {test} to test."
    )


def _commit_date(commit: str | None) -> str | None:
    """The date of a commit, for results written before they recorded their own date."""
    if not commit:
        return None
    try:
        shown = subprocess.run(
            ["git", "show", "-s", "--format=%cs", commit],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return shown.stdout.strip() or None


# ---------------------------------------------------------------------------- renderers


def omniglot_curve(root: Path = REPO / "results/omniglot/curve") -> str:
    """Validation accuracy against iterations of one run (every 250 iterations and the last)."""
    results, rows = _json(root / "results.json"), _rows(root / "metrics.jsonl")
    cfg = results["config"]
    val = [r for r in rows if "val/accuracy" in r]
    shown = [r for r in val if r["iteration"] % 200 == 0 or r is val[-1]]
    lines = [
        f"Validation accuracy of `{cfg['algorithm']}` (seed {cfg['seed']}) on {cfg['val_tasks']} fixed validation tasks "
        f"after {cfg['steps']} step{'s' * (cfg['steps'] != 1)}, every 200 of {results['iterations']} iterations (the "
        f"meta-loss: the mean over the {cfg['log_every']} iterations before; the training query accuracy: "
        + ("the same mean" if results.get("train_metrics") == "log window mean" else "that iteration's meta-batch")
        + f"). `{command(results)}`; {provenance([results])}.{omniglot_data([results])}",
        "",
        "| iteration | validation accuracy % | training query accuracy % | meta-loss |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['iteration']} | {_pct(r['val/accuracy'])} | {_pct(r['train/accuracy'])} | {r['train/meta_loss']:.3f} |"
        for r in shown
    ]
    best = max(val, key=lambda r: r["val/accuracy"])
    test, best_test = results["test"], results.get("test_best", results["test"])
    lines += [
        "",
        f"Best validation {_pct(best['val/accuracy'])} % at iteration {best['iteration']}. Test accuracy on "
        f"{test['10step']['tasks']} tasks after 10 steps: {_pct(test['10step']['accuracy'])} % +- "
        f"{_pct(test['10step']['ci95'])} % (last parameters), {_pct(best_test['10step']['accuracy'])} % +- "
        f"{_pct(best_test['10step']['ci95'])} % (best validation).",
    ]
    return "\n".join(lines) + "\n"


def _run_folders(root: Path) -> list[tuple[Path, dict[str, Any], list[dict[str, Any]]]]:
    """Each run folder under ``root`` that has a ``results.json``: the folder, its results and its metrics rows."""
    folders = sorted(p for p in root.iterdir() if (p / "results.json").is_file())
    return [(folder, _json(folder / "results.json"), _rows(folder / "metrics.jsonl")) for folder in folders]


def _task(runs: Sequence[dict[str, Any]]) -> str:
    """The runs' task, e.g. ``5-way 1-shot`` (each distinct one, where the runs mix them)."""
    return _distinct(f"{r['config']['ways']}-way {r['config']['shots']}-shot" for r in runs)


def learning_curve(root: Path, window: int) -> str:
    """The runs' validation curves, ``window`` iterations a row: the mean and best validation, the meta-loss.

    One validation on 100 tasks has a 95 % interval of several points, so a window's mean shows
    where the curve flattens and its best shows what model selection picks from.
    """
    blocks = []
    for folder, results, rows in _run_folders(root):
        cfg = results["config"]
        lines = [
            f"`{cfg['algorithm']}`, {_task([results])}, seed {cfg['seed']}: validation on "
            f"{cfg['val_tasks']} fixed tasks every {cfg['val_every']:,} iterations, and the training meta-loss, "
            f"{window:,} iterations a row ({folder.relative_to(REPO).as_posix()}/metrics.jsonl).{omniglot_data([results])}",
            "",
            "| iterations | validations | mean validation % | best validation % | mean meta-loss |",
            "|---|---|---|---|---|",
        ]
        for end in range(window, results["iterations"] + window, window):
            inside = [r for r in rows if end - window < r["iteration"] <= end]
            val = [r["val/accuracy"] for r in inside if "val/accuracy" in r]
            if not val:
                continue
            loss = [r["train/meta_loss"] for r in inside if "train/meta_loss" in r]
            lines.append(
                f"| {end - window + 1:,}-{min(end, results['iterations']):,} | {len(val)} | "
                f"{_pct(sum(val) / len(val))} | {_pct(max(val))} | {sum(loss) / len(loss):.3f} |"
            )
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) if blocks else "No run yet.\n"


def _values(spec: dict[str, Any] | None, default: Any) -> list[Any]:
    """A sweep parameter's values (``values`` or ``value``), or ``[default]`` when the sweep does not set it."""
    return [default] if spec is None else list(spec.get("values", [spec.get("value")]))


def _row(engine: str, algorithm: str) -> str:
    return "learn2learn MAML" if engine == "learn2learn" else f"`{algorithm}`"


def _mean_std(values: Sequence[float], show: Callable[[float], str] = _pct) -> str:
    """Mean +- standard deviation (n - 1) over seeds, each written by ``show`` (the mean alone for one seed)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return show(mean)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{show(mean)} +- {show(std)}"


def _finished(sweep: Path, report: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``results.json`` of the sweep's trials that finished."""
    paths = (sweep / trial["name"] / "results.json" for trial in report["trials"])
    return [_json(path) for path in paths if path.is_file()]


def _seeds(runs: list[dict[str, Any]], planned: list[int]) -> tuple[list[dict[str, Any]], str]:
    """``runs`` by seed, and the cell that says how many of the planned seeds they are, and which."""
    runs = sorted(runs, key=lambda r: r["config"]["seed"])
    return runs, f"{len(runs)} of {len(planned)} ({', '.join(str(r['config']['seed']) for r in runs)})"


def omniglot_seeds(
    sweeps: Sequence[Path] = (REPO / "results/omniglot/seeds", REPO / "results/omniglot/learn2learn"),
) -> str:
    """Test accuracy per recipe over the seeds that finished: the best-validation parameters, and the last ones.

    The rows and their seeds are the sweeps' grids (``sweep.json``); a row shows the trials that finished.
    """
    planned: dict[str, list[int]] = {}
    groups: dict[str, list[dict[str, Any]]] = {}
    commands = []
    for sweep in sweeps:
        report = _json(sweep / "sweep.json")
        params = report["sweep"]["config"]["parameters"]
        for engine in _values(params.get("engine"), "maml"):
            for algorithm in _values(params.get("algorithm"), "maml"):
                planned[_row(engine, algorithm)] = _values(params.get("seed"), 0)
                groups[_row(engine, algorithm)] = []
        for run in _finished(sweep, report):
            groups[_row(run["config"].get("engine", "maml"), run["config"]["algorithm"])].append(run)
        commands.append(
            f"`python -m experiments.sweep {report['sweep']['file']} --out {sweep.relative_to(REPO).as_posix()}`"
        )
    everything = [run for runs in groups.values() for run in runs]
    pending = [
        f"{key} ({len(planned[key])} seed{'s' * (len(planned[key]) != 1)})" for key, runs in groups.items() if not runs
    ]
    if not everything:
        return f"No trial has finished yet: {', '.join(pending)}; the sweeps resume with `--resume`.\n"
    header = [
        "row",
        "seeds",
        "iterations",
        *(f"{s.removesuffix('step')} step{'s' * (s != '1step')}" for s in STEPS),
        "10 steps, last parameters",
        "best validation at",
        "minutes a run",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for key, runs in groups.items():
        if not runs:
            continue
        runs, seeds = _seeds(runs, planned[key])
        cells = [key, seeds, _distinct(r["iterations"] for r in runs)]
        cells += [_mean_std([r.get("test_best", r["test"])[s]["accuracy"] for r in runs]) for s in STEPS]
        cells += [_mean_std([r["test"]["10step"]["accuracy"] for r in runs])]
        cells += [", ".join(str(r.get("best_val", {}).get("iteration", "-")) for r in runs)]
        cells += [f"{sum(r['train_seconds'] for r in runs) / len(runs) / 60:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    tasks = everything[0]["test"]["10step"]["tasks"]
    notes = [
        "",
        f"{_task(everything)} test accuracy % on {tasks} tasks of held-out "
        f"{_distinct(r['config'].get('split_by', 'alphabet') + 's' for r in everything)}, mean +- standard deviation "
        f"over the seeds that finished (n - 1), with the parameters of the best validation (every "
        f"{_distinct(r['config']['val_every'] for r in everything)} iterations, `best.pt`) "
        f"unless the column says otherwise; the training steps are each recipe's, the test steps the columns'. "
        f"Minutes a run: the mean training time, other runs sharing the cores (a cost, not a timing). "
        f"Runs: {provenance(everything)}. Sweeps: {', '.join(commands)}.{omniglot_data(everything)}",
    ]
    if pending:
        notes.append(f"Without results here: {', '.join(pending)} (trials of the sweeps; `--resume` runs them).")
    return "\n".join(lines + notes) + "\n"


def memory(
    path: Path = REPO / "results/benchmarks/memory.json",
    parts: Sequence[Path] = (REPO / "results/benchmarks/memory_long.json",),
) -> str:
    """``benchmarks/memory.py --json``: tensor peak, RSS and time of one meta-training step per method and inner steps.

    ``parts``, those that exist: further runs of the same setting (more inner steps, or the
    configurations a stopped run did not reach); each fills the cells the runs before it lack, and
    its command and commit join the caption.
    """
    report = _json(path)
    cells = {(r["method"], r["steps"]) for r in report["results"]}
    captions = []
    for part in (p for p in parts if p.is_file()):
        extra = _json(part)
        if extra["setting"] != report["setting"]:
            raise TableError(f"{part.relative_to(REPO)}: another setting than {path.relative_to(REPO)}'s")
        new = [r for r in extra["results"] if (r["method"], r["steps"]) not in cells]
        if not new:  # none of its figures is shown: nothing to name
            continue
        cells |= {(r["method"], r["steps"]) for r in new}
        steps = ", ".join(map(str, sorted({r["steps"] for r in new})))
        captions.append(
            f" The cells of {steps} steps not in the first run: `{extra['command']}`; {provenance([extra])}."
        )
        report = {**report, "results": report["results"] + new}
    return _memory_table(report, "steps").rstrip("\n") + "".join(captions) + "\n"


def memory_auto(path: Path = REPO / "results/benchmarks/memory_auto.json") -> str:
    """:func:`memory` of the checkpointed mode's defaults, and its ratios to second order and learn2learn at each steps."""
    report = _json(path)
    cells = {(r["method"], r["steps"]): r for r in report["results"] if "tensor_mib" in r and not r.get("error")}
    ratios = []
    for peer in ("second_order", "learn2learn"):
        pairs = [(cells[m, s], cells[peer, s]) for m, s in sorted(cells) if m == "checkpointed" and (peer, s) in cells]
        if pairs:
            tensors = ", ".join(f"{c['tensor_mib'] / p['tensor_mib']:.3g}x" for c, p in pairs)
            times = ", ".join(f"{c['seconds'] / p['seconds']:.2f}x" for c, p in pairs)
            steps = ", ".join(str(c["steps"]) for c, _ in pairs)
            ratios.append(f"against `{peer}` at {steps} steps: {tensors} its tensors, {times} its time")
    line = f"\nThe checkpointed mode {'; '.join(ratios)}.\n" if ratios else ""
    return memory(path, ()) + line


def memory_tasks(path: Path = REPO / "results/benchmarks/memory_tasks.json") -> str:
    """``benchmarks/memory.py --tasks ... --json``: the same per method and meta-batch size."""
    return _memory_table(_json(path), "tasks")


def _memory_table(report: dict[str, Any], axis: str) -> str:
    """Methods down, ``axis`` (``"steps"`` or ``"tasks"``) across: each cell the tensor peak, RSS and time."""
    cells = {(r["method"], r[axis]): r for r in report["results"]}
    setting = report["setting"]
    limit = setting["limit_gib"]
    cuda = report["device"].startswith("cuda")

    def out_of_memory(r: dict[str, Any]) -> bool:
        return bool(r.get("oom")) or str(r.get("error", "")).startswith("MemoryError")  # a C++ bad_alloc too

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        if out_of_memory(r):
            return f"> {limit:g} GiB"
        if r.get("error"):
            return f"error ({str(r['error']).split(':')[0]})"  # the exception's name; its message is in the JSON
        if cuda:  # both figures are the allocator's peak: one is enough
            return f"{r['tensor_mib']:,.0f} MiB, {r['seconds']:.1f} s"
        tensors = f"{r['tensor_mib']:,.0f} MiB tensors (RSS " if "tensor_mib" in r else ""
        rss = f"{r['extra_mib']:,.0f} MiB" + (")" if tensors else "")
        return f"{tensors}{rss}, {r['seconds']:.1f} s"

    columns = sorted({r[axis] for r in report["results"]})
    lines = [
        "| method | " + " | ".join(f"{c} {axis}" for c in columns) + " |",
        "|---" + "|---:" * len(columns) + "|",
    ]
    lines += [f"| `{m}` | " + " | ".join(cell(cells.get((m, c))) for c in columns) + " |" for m in report["methods"]]
    clock = "wall time" if cuda else f"CPU time of {report['threads']} thread"
    fixed = (
        f"{setting['tasks']} tasks"
        if axis == "steps"
        else f"{report['steps'][0]} inner step{'s' * (report['steps'][0] != 1)}"
    )
    lines += [
        "",
        (
            "Peak of `torch.cuda.max_memory_allocated` during one meta-training step over the memory allocated before it "
            if cuda
            else "Peak of live tensor bytes of one meta-training step (profiler memory events), "
            "its peak resident memory over the process's baseline "
            if any("tensor_mib" in r for r in report["results"])
            else "Peak memory of one meta-training step over the process's baseline, "
        )
        + f"and its {clock}{' (of its only step, which also touches its memory first)' if setting['repeats'] == 0 else ''} (the MAML "
        f"Omniglot max-pool net, {fixed}, {setting['ways']}-way {setting['shots']}-shot, "
        f"{setting['query']} query images per class, batching `{setting['batching']}`"
        + (f", `memory_budget={setting['memory_budget']!r}`" if "memory_budget" in setting else "")
        + (
            "; error: the worker failed, with the exception named"
            if any(r.get("error") and not out_of_memory(r) for r in report["results"])
            else ""
        )
        + (
            ""
            if cuda
            else f"; a worker may add {limit:g} GiB of address space, RLIMIT_AS; > {limit:g} GiB: it ran out of it"
        )
        + ")."
        + f" `{report['command']}`; torch {report['versions'].get('torch', '?')}; {provenance([report])}."
        + (
            " The run was stopped before its last configurations: - did not run."
            if not report.get("complete", True) and len(cells) < len(columns) * len(report["methods"])
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


def plans(path: Path = REPO / "results/benchmarks/plans.json") -> str:
    """``benchmarks/plans.py --json``: the plan a budget picks, its time and peak, and the fastest plan that fits."""
    report = _json(path)
    lines = [
        "| mode | budget | the plan it picks | its time | its tensor peak | fastest plan that fits | its time | ratio |",
        "|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in report["rows"]:
        fastest = (
            f"{r['fastest']} | {r['fastest_seconds']:.2f} s | {r['ratio']:.2f}x" if "fastest" in r else "none | - | -"
        )
        lines.append(
            f"| {r['mode']} | {r['budget']} | {r['plan'].split('; about')[0]} | {r['seconds']:.2f} s | "
            f"{r['peak_mib']:,.0f} MiB | {fastest} |"
        )
    s = report["setting"]
    lines += [
        "",
        f"One meta-training step (meta-loss and backward) of the MAML Omniglot max-pool net, {s['tasks']} tasks "
        f"{s['ways']}-way {s['shots']}-shot, {s['query']} query images per class, {s['steps']} inner steps; times: the "
        f"median CPU time of {s['repeats']} steps of {report['threads']} thread after a warm-up step; a plan fits when "
        f"its tensor peak (profiler memory events) is at most the budget; the candidates: `backward(chunk=c)` and "
        f"`maml.Checkpointed(tasks=c)` (with `every=1` and with the segments that hold least) for c in 1, 2, 4, 8, "
        f"by `vmap` and in a loop. `{report['command']}`; torch "
        f"{report['versions'].get('torch', '?')}; {provenance([report])}.",
    ]
    return "\n".join(lines) + "\n"


def budgets(path: Path = REPO / "results/benchmarks/budgets.json") -> str:
    """``benchmarks/budgets.py --json``: each family, mode and budget, the plan, and the first and a later call's peak."""
    report = _json(path)
    lines = [
        "| family | mode | budget | the plan | first call | later call | first / budget |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    worst, said = 0.0, 0
    for r in report["rows"]:
        held = r["held"]
        warned = [c for c in ("first", "later") if r[f"{c}_said"]]
        said += len(warned)
        kept = [r[c] for c in ("first", "later") if c not in warned]
        worst = max([worst] + [(k - held) / r["allowance"] for k in kept])
        budget = mib(r["budget"]) if r["budget"] is not None else f"default ({mib(held)})"
        cells = [f"{mib(r[c])}{' (said)' * (c in warned)}" for c in ("first", "later")]
        lines.append(
            f"| {r['family']} | {r['mode']} | {budget} | {r['plan'].split('; about')[0]} | {cells[0]} | "
            f"{cells[1]} | {r['first'] / held:.2f} |"
        )
    lines += [
        "",
        f"A new learner's first `backward(batch)` (its planner's probes and the choice of `\"auto\"` included) and its "
        f'second, float64, `"auto"` batching; peaks of the CPU allocator\'s blocks allocated during the call, counted '
        f"exactly by a wrapper of `posix_memalign` and `free` the engine does not use (`benchmarks/blocks.c`); "
        f"budgets: the smallest the learner accepts and three times it, and the checkpointed mode's default. "
        f"{len(report['rows'])} configurations; the most any call held over its budget, in units of the allowance "
        f"({report['allowance']}): {max(worst, 0):.2f} (over 1: over the allowance); (said): the call warned "
        f"(`maml.MemoryBudgetWarning`) that it held more than its budget, a model whose activations follow the "
        f"data meeting heavier tasks than its plan measured ({said} calls). `{report['command']}`; torch "
        f"{report['versions'].get('torch', '?')}; {provenance([report])}.",
    ]
    return "\n".join(lines) + "\n"


def planning_cost(path: Path = REPO / "results/benchmarks/planning_cost.json") -> str:
    """``benchmarks/planning_cost.py --json``: each model's first budgeted call against the same calls unplanned."""
    report = _json(path)
    rows = {(r["model"], r["budgeted"]): r for r in report["rows"]}
    lines = [
        "| model | budget | peak RSS rise, first call: planned / unplanned | later calls' | first call's time, "
        "in later calls: planned / unplanned |",
        "|---|---:|---:|---:|---:|",
    ]
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    for model in dict.fromkeys(r["model"] for r in report["rows"]):
        planned, plain = rows[(model, True)], rows[(model, False)]
        lines.append(
            f"| {model} | {mib(planned['budget'])} | {mib(planned['first_rss_rise'])} / "
            f"{mib(plain['first_rss_rise'])} | {mib(planned['later_rss_rise'])} / {mib(plain['later_rss_rise'])} | "
            f"{planned['first_seconds'] / planned['later_seconds']:.1f} / "
            f"{plain['first_seconds'] / plain['later_seconds']:.1f} |"
        )
    lines += [
        "",
        f'Second order, float64, three times the smallest budget the learner accepts, `"auto"` batching (planned) '
        f"against `backward(batch, chunk=1)` in a loop (unplanned), each in a fresh process; peak RSS rise: of the "
        f"process's `VmHWM` over the first call, and over the {report['later_calls']} later ones; time: the first "
        f"call's CPU time over a later call's (the median). wide_layer: one hidden layer of 16,384 units, 6 tasks; "
        f"the others: `benchmarks/budgets.py`'s families. `{report['command']}`; torch "
        f"{report['versions'].get('torch', '?')}; {provenance([report])}.",
    ]
    return "\n".join(lines) + "\n"


def optimizers(path: Path = REPO / "results/benchmarks/optimizers.json", slow: float = 1.5) -> str:
    """``benchmarks/optimizers.py --json``: each inner optimizer's step against the engine's SGD and higher's same rule.

    Below the tables, from the same figures: the rules over ``slow`` times SGD's CPU time, and those slower than
    higher's version of the same ``torch.optim`` optimizer.
    """
    report = _json(path)
    ms = lambda s: f"{1e3 * s:,.1f} ms" if s >= 0.1 else f"{1e3 * s:,.2f} ms"  # noqa: E731
    mib = lambda n: f"{n / 2**20:,.2f} MiB" if n < 10 * 2**20 else f"{n / 2**20:,.0f} MiB"  # noqa: E731
    blocks, over, behind = [], [], []
    for table in report["tables"]:
        lines = [
            f"**{table['workload']}**: {table['name']}, {table['tasks']} task{'s' * (table['tasks'] != 1)}, {table['steps']} inner "
            f'step{"s" * (table["steps"] != 1)} (`batching="{table["batching"]}"`'
            + (', what `"auto"` picks for SGD' if table.get("batching_asked") == "auto" else "")
            + f"; median of {table['repeats']} steps)",
            "",
            "| `inner_optimizer` | lr | CPU time | vs SGD | wall time | tensor peak | operators (vs SGD) "
            "| higher | higher vs its SGD | ours / higher | higher's peak | meta-gradient vs higher |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in table["rows"]:
            o, h = r["ours"], r["higher"]
            ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
            peer = (
                [ms(h["cpu"]), ratio(r["higher_vs_sgd"]), ratio(r["vs_higher"]), mib(h["peak_bytes"])]
                + [f"{r['grad_diff']:.0e}"]
                if h
                else ["-"] * 5
            )
            cells = [f"`{r['optimizer']}`", f"{r['lr']:g}", ms(o["cpu"]), ratio(r["vs_sgd"]), ms(o["wall"])]
            cells += [mib(o["peak_bytes"]), f"{o['ops']:,} ({ratio(r['ops_vs_sgd'])})", *peer]
            lines.append("| " + " | ".join(cells) + " |")
            if r["vs_sgd"] is not None and r["vs_sgd"] > slow:
                over.append(
                    f"`{r['optimizer']}` on {table['workload']} ({r['vs_sgd']:.2f}x, with "
                    f"{r['ops_vs_sgd']:.2f}x the operators)"
                )
            if r["vs_higher"] is not None and r["vs_higher"] > 1:
                behind.append(f"`{r['optimizer']}` on {table['workload']} ({r['vs_higher']:.2f}x)")
        blocks.append("\n".join(lines))
    warmups = sorted({t["warmup"] for t in report["tables"]})
    blocks.append(
        f"One meta-training step, `learner.meta_loss(batch).backward()`, second order, per rule of "
        f"`maml.INNER_OPTIMIZERS` (`torch.optim`'s default options, `momentum`'s 0.9; lr: the column), every method "
        f"from the same weights, interleaved in one process in a random order after {_distinct(warmups)} warm-up "
        f"step{'s' * (warmups != [1])} each; CPU time of {report['threads']} thread (and wall time), the median. "
        f"vs SGD: the row's CPU time over "
        f"the engine's SGD's; tensor peak: the peak of live tensor bytes of one step, from the profiler's memory "
        f"events (`benchmarks.tensor_peak.peak_tensor_bytes`, as the memory tables count them); operators: the ATen "
        f"operators one step calls, counted by a dispatch mode (under `vmap` a batched operator once), the rule's own "
        f"arithmetic where the step is bound by per-operator overhead. higher: `higher.innerloop_ctx` with the "
        f"`torch.optim` optimizer of the same name and options, per task, `(query loss / tasks).backward()` after "
        f"each (so it holds one task's graph where `meta_loss` holds every task's: its smaller peak), Adam's `eps` "
        f"overridden at each step so that its update is `torch.optim`'s; higher has no AdamW, NAdam or RAdam (-). "
        f"Meta-gradient vs higher: the largest difference of the engine's from higher's, relative to higher's largest "
        f"entry, from the same weights in float64."
        + (
            " The Omniglot images are synthetic (`benchmarks/memory.py`'s meta-batch: time and memory do not depend "
            "on the pixels)."
            if any(t["workload"] == "omniglot" for t in report["tables"])
            else ""
        )
        + f" `{report['command']}`; torch "
        f"{report['versions'].get('torch', '?')}; {provenance([report])}."
        + ("" if report.get("complete", True) else " The run was stopped before its end.")
    )
    blocks.append(
        f"Over {slow:g}x SGD's CPU time: {', '.join(over) or 'none'}. Slower than higher's version of the same "
        f"optimizer: {', '.join(behind) or 'none'}."
    )
    return "\n\n".join(blocks) + "\n"


def readme_loop(path: Path = REPO / "results/benchmarks/readme_loop.json") -> str:
    """``benchmarks/readme_loop.py --json``: the README's loop against each peer's own loop on the three ports' models."""
    report = _json(path)
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    names = {
        "peer": "the peer's own loop",
        "readme": "`learner.backward(batch)`",
        "readme_peer_memory": "`learner.backward(batch)`, free memory = the peer's peak",
        "meta_loss": "`learner.meta_loss(batch).backward()`",
    }
    peers = {"learn2learn": "learn2learn", "higher": "higher", "torchopt": "TorchOpt"}
    lines = [
        "| port | tasks, inner steps | loop | tensor peak | vs the peer | CPU time | vs the peer | plan |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for table in report["tables"]:
        rows = {r["method"]: r for r in table["rows"]}
        peer = rows["peer"]
        for method, r in rows.items():
            cells = [
                f"{peers[table['port']]}'s Omniglot example",
                f"{table['tasks']} x {table['ways']}-way {table['shots']}-shot, {table['steps']}",
                names[method],
                mib(r["peak_bytes"]),
                f"{r['peak_bytes'] / peer['peak_bytes']:.2f}x",
                f"{r['cpu']:.3f} s",
                f"{r['cpu'] / peer['cpu']:.2f}x",
                r["plan"] or "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "One meta-gradient step from the same weights (no optimizer step) on each port's model, meta-batch and inner "
        "loop (`examples/`), random 28x28 images. The peer's loop as its example writes it: learn2learn's "
        "`clone()`/`adapt()` and higher's `innerloop_ctx` backpropagate task by task, TorchOpt's `MetaSGD` loop "
        "keeps every task's graph and backpropagates their mean once. `learner.backward(batch)` plans within the "
        "free memory: the machine's, and then only what the peer's loop held (the engine's reading of the free memory "
        "set to the peer's tensor peak). Tensor peak: the peak of live tensor bytes of a step, from the profiler's "
        "memory events (`benchmarks.tensor_peak.peak_tensor_bytes`); CPU time: the calling thread's, the median of "
        f"{_distinct(t['repeats'] for t in report['tables'])} steps after a warm-up step (the engine's first call, which "
        "measures and plans, is the warm-up), the methods interleaved. The meta-gradients are the peers' in float64 "
        f"(`tests/tools/test_ports.py`). `{report['command']}`; torch {report['versions'].get('torch', '?')}; "
        f"{provenance([report])}." + ("" if report.get("complete", True) else " The run was stopped before its end."),
    ]
    return "\n".join(lines) + "\n"


def image_sampling(path: Path = REPO / "results/benchmarks/image_sampling.json") -> str:
    """``benchmarks/image_sampling.py``: meta-batches a second of the image sampler against learn2learn's TaskDataset."""
    r = _json(path)
    ours, peer = r["ours"], r["learn2learn"]
    lines = [
        "| sampler | tasks a second | ms a meta-batch | load |",
        "|---|---:|---:|---:|",
        f"| `tasks.MiniImageNet(...).sampler` | {ours['tasks_per_second']:,.0f} | {ours['ms_per_meta_batch']:.1f} | "
        f"{ours['cold_load_s']:.2f} s decoding once, {ours['warm_load_s']:.3f} s from the cache |",
        f"| learn2learn `TaskDataset` | {peer['tasks_per_second']:,.0f} | {peer['ms_per_meta_batch']:.1f} | "
        f"{peer['load_s']:.2f} s |",
        "",
        f"{r['task']}; {r['data']}; {r['speedup']:.2f}x learn2learn's rate. `{r['command']}`; "
        f"torch {r['versions'].get('torch', '?')}; {provenance([r])}.",
    ]
    return "\n".join(lines) + "\n"


def image_loads(path: Path = REPO / "results/benchmarks/image_loads.json") -> str:
    """``benchmarks/image_loads.py --json``: a Meta-Dataset set's load, decoding once and from the decoded cache."""
    r = _json(path)
    lines = ["| data set | images | decoding once | from the cache |", "|---|---:|---:|---:|"]
    for row in r["rows"]:
        cold = f"{row['cold_s']:.1f} s" if row["cold_s"] is not None else "- (memory-mapped: no decoding)"
        lines.append(f"| {row['set']} | {row['images']:,} | {cold} | {row['warm_s']:.3f} s |")
    lines += [
        "",
        "Wall time of the three splits' load (`splits()`), each in a fresh process; CUB-200-2011 as its archive "
        "extracts, with 500 x 375 JPEGs of random pixels, decoded to 84 x 84 and cached, then mapped from the cache; "
        f"Quick Draw's `.npy` files opened as memory maps. `{r['command']}`; torch "
        f"{r['versions'].get('torch', '?')}; {provenance([r])}.",
    ]
    return "\n".join(lines) + "\n"


def speed(path: Path = REPO / "results/benchmarks/speed.json") -> str:
    """``benchmarks/speed.py --json``: one meta-training step's median time per method, per workload, against learn2learn."""
    report = _json(path)
    blocks = []
    for table in (t for t in report["tables"] if t["table"] == "main"):
        lines = [
            f'**{table["workload"]}**: {table["name"]} (`batching="auto"` picks `{table["batching"]}`; '
            f"median of {table['repeats']} steps)",
            "",
            "| method | median | spread | vs learn2learn | % of peak |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in table["rows"]:
            speedup = "-" if math.isnan(row["speedup"]) else f"{row['speedup']:.2f}x"
            lines.append(
                f"| {row['method']} | {1e3 * row['median']:,.2f} ms | {1e3 * row['min']:,.2f}..{1e3 * row['max']:,.2f} ms "
                f"| {speedup} | {100 * row['peak_fraction']:.1f} |"
            )
        blocks.append("\n".join(lines))
    blocks.append(
        f"Wall time of one meta-training step (zero the gradients, meta-loss, backward, Adam step), every method "
        f"interleaved in one process after warm-up; spread: fastest..slowest step; vs learn2learn: its second "
        f"order's median over the row's (first-order rows against its first order); % of peak: the step's "
        f"FLOPs over its time against the measured float32 matmul peak ({report['peak_gflops']:.0f} GFLOP/s). "
        f"`{report['command']}`; torch {report['versions'].get('torch', '?')}; {provenance([report])}."
        + (_unfinished(report) if not report.get("complete", True) else "")
    )
    return "\n\n".join(blocks) + "\n"


def _unfinished(report: dict[str, Any]) -> str:
    """The sentence naming the workloads a stopped speed run did not reach."""
    words = shlex.split(report["command"])
    asked = words[words.index("--workloads") + 1 :] if "--workloads" in words else []
    asked = list(itertools.takewhile(lambda w: not w.startswith("--"), asked))
    done = {t["workload"] for t in report["tables"]}
    missing = [w for w in asked if w not in done]
    return f" The run was stopped before {', '.join(missing)}." if missing else " The run was stopped before its end."


def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass and its bases (what ``--help`` prints for each field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flags(cls: type, defaults: dict[str, str] | None = None) -> str:
    """Every flag of a config dataclass: its default (``defaults``: shown instead) and its ``--help`` words."""
    from experiments.harness import cli  # here: only this needs torch

    docs, instance = _field_docs(cls), cls()
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = getattr(instance, f.name)
        shown = (defaults or {}).get(f.name) or ("null" if default is None else cli.show(default))
        words = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{cli.flag(f.name)}` | `{shown}` | {words} |")
    return "\n".join(lines) + "\n"


def _flags_of(name: str) -> Callable[[], str]:
    def render_flags() -> str:
        from experiments import omniglot, sine
        from experiments.harness import config

        if name == "run":  # each script's own --out
            return flags(config.RunFlags, {"out": "runs/sine`, `runs/omniglot"})
        return flags({"sine": sine.SineConfig, "omniglot": omniglot.OmniglotConfig}[name])

    return render_flags


def recipe_table() -> str:
    """What each ``--algorithm`` sets, in both scripts (``experiments.harness.recipes``) and in each (its config's
    ``RECIPES``)."""
    from experiments import omniglot, sine  # here: only this needs torch
    from experiments.harness import cli, config, recipes

    def keys(values: dict[str, Any]) -> str:
        return " ".join(f"`{cli.flag(k)} {cli.show(v)}`" for k, v in values.items()) or "-"

    lines = ["| `--algorithm` | paper | both scripts | sine | Omniglot |", "|---|---|---|---|---|"]
    for algorithm in recipes.ALGORITHMS:
        common = recipes.recipe(config.ExperimentConfig, algorithm)
        own = {
            e: {k: v for k, v in recipes.recipe(cls, algorithm).items() if k not in common}
            for e, cls in (("sine", sine.SineConfig), ("omniglot", omniglot.OmniglotConfig))
        }
        cells = [f"`{algorithm}`", recipes.PAPERS[algorithm], keys(common), keys(own["sine"]), keys(own["omniglot"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SINE_COLUMNS = (
    "5shot_1step",
    "5shot_5step",
    "5shot_10step",
    "10shot_1step",
    "10shot_10step",
    "20shot_1step",
    "20shot_10step",
)


def _mse(values: Sequence[float]) -> str:
    """Mean +- standard deviation (n - 1) of MSEs; "diverges" where a seed's test diverged (NaN or inf)."""
    if not all(math.isfinite(v) for v in values):
        return "diverges"
    return _mean_std(values, lambda v: f"{v:.3f}")


def _sine_column(key: str) -> str:
    """``"5shot_10step"`` -> ``"K = 5, 10 steps"``."""
    shots, steps = (int(part.removesuffix("shot").removesuffix("step")) for part in key.split("_"))
    return f"K = {shots}, {steps} step{'s' * (steps != 1)}"


def sine_seeds(sweep: Path = REPO / "results/sine/seeds") -> str:
    """Test MSE per recipe over the seeds that finished (the sweep's grid says which are planned)."""
    report = _json(sweep / "sweep.json")
    params = report["sweep"]["config"]["parameters"]
    planned = {a: _values(params.get("seed"), 0) for a in _values(params.get("algorithm"), "maml")}
    groups: dict[str, list[dict[str, Any]]] = {a: [] for a in planned}
    for run in _finished(sweep, report):
        groups[run["config"]["algorithm"]].append(run)
    everything = [run for runs in groups.values() for run in runs]
    if not everything:
        return "No trial has finished yet; the sweep resumes with `--resume`.\n"
    header = [
        "`--algorithm`",
        "seeds",
        *(_sine_column(c) for c in SINE_COLUMNS),
    ]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for algorithm, runs in groups.items():
        if not runs:
            continue
        runs, seeds = _seeds(runs, planned[algorithm])
        cells = [f"`{algorithm}`", seeds]
        cells += [_mse([r["test"][c]["mse"] for r in runs]) for c in SINE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    pending = [
        f"{len(planned[a]) - len(runs)} seed{'s' * (len(planned[a]) - len(runs) != 1)} of `{a}`"
        for a, runs in groups.items()
        if len(runs) < len(planned[a])
    ]
    cfg = everything[0]["config"]
    lines += [
        "",
        f"Test MSE on {cfg['eval_tasks']} fresh tasks ({cfg['eval_query']} query points each) after K support points "
        f"and the steps shown, mean +- standard deviation over the seeds that finished (n - 1); "
        f"{everything[0]['iterations']:,} training iterations each. Runs: {provenance(everything)}. Sweep: "
        f"`python -m experiments.sweep {report['sweep']['file']} --out {sweep.relative_to(REPO).as_posix()}`.",
    ]
    if pending:
        lines.append(f"Without results here: {', '.join(pending)} (trials of the sweep; `--resume` runs them).")
    return "\n".join(lines) + "\n"


PORT_NAMES = {"learn2learn": "learn2learn", "higher": "higher", "torchopt": "TorchOpt"}


def ports(root: Path = REPO / "results/ports") -> str:
    """``benchmarks/ports.py --out``: each port of a peer's Omniglot example beside the peer's own loop, over seeds."""
    runs = [_json(path) for path in sorted(root.glob("*/*/results.json"))]
    if not runs:
        return "No run yet: `python -m benchmarks.ports --out results/ports`.\n"
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["port"], run["engine"]), []).append(run)
    order = {name: i for i, name in enumerate(PORT_NAMES)}
    header = ["example", "trained by", "seeds", "iterations", "validation %", "test %", "s a run", "CPU s an iteration"]
    lines = ["| " + " | ".join([*header, "tensor peak"]) + " |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (port, engine), group in sorted(
        groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1] != "maml-toolkit")
    ):
        group = sorted(group, key=lambda r: r["seed"])
        shown = (
            "maml-toolkit (the port)" if engine == "maml-toolkit" else f"{PORT_NAMES.get(engine, engine)} (its loop)"
        )
        cells = [PORT_NAMES.get(port, port), shown, ", ".join(str(r["seed"]) for r in group)]
        cells += [_distinct(r["iterations"] for r in group)]
        cells += [_mean_std([r[split]["accuracy"] for r in group]) for split in ("validation", "test")]
        cells += [_mean_std([r["train_seconds"] for r in group], lambda v: f"{v:.0f}")]
        cells += [_mean_std([r["iteration_cpu_seconds"] for r in group], lambda v: f"{v:.2f}")]
        cells += [f"{max(r['tensor_peak_bytes'] for r in group) / 2**20:,.0f} MiB"]
        lines.append("| " + " | ".join(cells) + " |")
    tasks = ", ".join(
        f"{PORT_NAMES.get(p, p)} {_distinct(r['validation']['tasks'] for r in runs if r['port'] == p)}"
        for p in sorted({r["port"] for r in runs}, key=lambda p: order.get(p, 99))
    )
    commands = _distinct(f"`{r['command']}`" for r in runs)
    versions = _distinct(f"{k} {v}" for r in runs for k, v in r.get("peer", {}).items())
    lines += [
        "",
        f"Each example's protocol (its network, inner steps and rate, meta-batch, Adam), from the same initial weights "
        f"on the same meta-batches: the port (`examples/`, `learner.backward(batch)`) and the peer's own loop with its "
        f"own library ({versions}). Validation and test accuracy: the trained weights adapted to held-out tasks of "
        f"disjoint alphabets, alike for both (tasks each: {tasks}), mean +- standard deviation over the seeds (n - 1); "
        f"s a run: the training loop's wall time (sampling excluded; the port's first iteration includes "
        f'`batching="auto"` timing both batchings); CPU s an iteration: the median after the first; tensor peak: live '
        f"tensor bytes of one meta-gradient of a meta-batch (profiler memory events), the largest over the seeds. The "
        f"conv examples' runs are a few iterations of 32 tasks of 5 second-order steps, seconds each on one CPU thread: "
        f"a check that both train alike, not a result. {commands}; torch "
        f"{_distinct(r['versions'].get('torch') for r in runs)}; {provenance(runs)}.",
    ]
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[], str]] = {
    "speed": speed,
    "speed_omniglot20": functools.partial(speed, REPO / "results/benchmarks/speed_omniglot20.json"),
    "speed_cuda": functools.partial(speed, REPO / "results/benchmarks/speed_cuda.json"),
    "sine-seeds": sine_seeds,
    "omniglot-curve": omniglot_curve,
    "omniglot-seeds": omniglot_seeds,
    "omniglot-20way": functools.partial(omniglot_seeds, [REPO / "results/omniglot/20way"]),
    "omniglot-20way-curve": functools.partial(learning_curve, REPO / "results/omniglot/20way", window=250),
    "memory": memory,
    "memory_cuda": functools.partial(
        memory,
        REPO / "results/benchmarks/memory_cuda.json",
        [REPO / "results/benchmarks/memory_cuda_5steps.json", REPO / "results/benchmarks/memory_cuda_80steps.json"],
    ),
    "image_sampling": image_sampling,
    "image_loads": image_loads,
    "memory_tasks": memory_tasks,
    "memory_auto": memory_auto,
    "memory_budget": functools.partial(memory, REPO / "results/benchmarks/memory_budget.json", ()),
    "plans": plans,
    "budgets": budgets,
    "planning_cost": planning_cost,
    "optimizers": optimizers,
    "readme_loop": readme_loop,
    "flags-run": _flags_of("run"),
    "flags-sine": _flags_of("sine"),
    "flags-omniglot": _flags_of("omniglot"),
    "recipes": recipe_table,
    "ports": ports,
}
PAGES = ("README.md", "docs")  # the pages whose blocks are rendered: a file, or every .md under a folder


def _opening(name: str = "NAME") -> str:
    """A block's opening marker for ``name``, as messages quote it."""
    return f"`<!-- table: {name} -->`"


def _marker_fix(line: str) -> str:
    """The marker that ``line`` (one that looks like a marker but is not one) was most likely meant to be."""
    meant = MEANT.search(line)
    if meant is None:
        return f"{_opening()} or `{CLOSE}`"
    if meant.group("close"):
        return f"`{CLOSE}`"
    name = (meant.group("name") or "").lower()
    return _opening(name) if name in RENDERERS else f"{_opening()} (known names: {', '.join(RENDERERS)})"


def validate(text: str, page: str = "README.md") -> list[tuple[int, int, str]]:
    """The table blocks of ``text``: the 0-based line numbers of each one's markers, and its name.

    Raises :class:`TableError` (naming ``page`` and the line) unless ``text``'s table markers are sound: every line
    outside a fenced code block that looks like a marker is exactly ``<!-- table: NAME -->`` (``NAME`` a key of
    :data:`RENDERERS`) or ``<!-- /table -->``, and they alternate, opening first and closing last. A rewrite from a
    block whose end marker is lost or misspelt to the next block's end would delete everything in between. Inside a
    fenced block (a page showing the syntax) a marker is text, and no table is rendered there.
    """
    blocks: list[tuple[int, int, str]] = []
    opened: tuple[int, str] | None = None  # the line number and name of the block open at this line
    fence = ""  # the fence of the code block this line is in ("" outside one)
    for number, line in enumerate(text.split("\n"), 1):  # "\n" alone: BLOCK's and an editor's lines
        found = FENCE.match(line)
        if fence:  # in a fenced block: its closing fence is of its character, as long or longer, and nothing else
            closes = found and found["fence"][0] == fence[0] and len(found["fence"]) >= len(fence)
            fence = "" if closes and not line[found.end() :].strip() else fence
            continue
        if found:
            fence = found["fence"]
            continue
        if not LIKE_MARKER.search(line):
            continue
        where = f"{page}:{number}"
        if line == CLOSE:
            if opened is None:
                raise TableError(
                    f"{where}: `{CLOSE}` ends no table block: delete it, or write {_opening()} "
                    f"alone on a line where its table starts"
                )
            blocks.append((opened[0] - 1, number - 1, opened[1]))
            opened = None
            continue
        start = OPEN.fullmatch(line)
        if start is None:
            raise TableError(
                f"{where}: {line.strip()!r} is not a table marker: write {_marker_fix(line)} alone on the line"
            )
        name = start.group("name")
        if opened is not None:
            raise TableError(
                f"{page}:{opened[0]}: the table block {opened[1]!r} has no end before line {number} opens the block "
                f"{name!r}: write `{CLOSE}` alone on the line after its table (blocks do not nest)"
            )
        if name not in RENDERERS:
            raise TableError(
                f"{where}: no renderer for the table block {name!r} (known: {', '.join(RENDERERS)}): write "
                f"{_opening()} with one of those names"
            )
        opened = (number, name)
    if opened is not None:
        raise TableError(
            f"{page}:{opened[0]}: the table block {opened[1]!r} has no end: write `{CLOSE}` alone on the line "
            f"after its table"
        )
    return blocks


def render(text: str, page: str = "README.md") -> str:
    """``text`` (of ``page``) with every table block rendered anew, once :func:`validate` finds its markers sound."""
    lines, pieces, done = text.split("\n"), [], 0
    for opening, closing, name in validate(text, page):
        # The markers and the table as one piece: the table's last newline puts the end marker on a line of its own.
        pieces += [*lines[done:opening], f"{lines[opening]}\n{RENDERERS[name]()}{lines[closing]}"]
        done = closing + 1
    return "\n".join([*pieces, *lines[done:]])


def pages(root: Path = REPO) -> list[Path]:
    """The Markdown files :data:`PAGES` names under ``root``."""
    found: list[Path] = []
    for entry in PAGES:
        path = root / entry
        found += sorted(path.glob("**/*.md")) if path.is_dir() else [path]
    return found


def _shown(page: Path, root: Path) -> str:
    """``page`` as messages name it: relative to ``root`` where it lies under it, else as given."""
    try:
        return page.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(page)


def main(argv: Sequence[str] | None = None, root: Path = REPO) -> int:
    """The command line; ``root``: the repository whose pages are rendered, and to which messages name them."""
    parser = argparse.ArgumentParser(prog="python -m tools.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from its rendering")
    parser.add_argument("--page", type=Path, action="append", help="render only this page (again for more)")
    args = parser.parse_args(argv)
    chosen = args.page or pages(root)
    # Read and render every page (render validates its markers first), and only then write: an error on
    # any page (exit 2) leaves every page as it was, the sound ones too.
    try:
        texts = [page.read_text() for page in chosen]
        rendered = [render(text, _shown(page, root)) for page, text in zip(chosen, texts)]
    except (OSError, TableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = []
    for page, text, new in zip(chosen, texts, rendered):
        if new == text:
            continue
        if args.check:
            old_lines, new_lines = text.splitlines(), new.splitlines()
            line = next(
                (i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b), min(len(old_lines), len(new_lines))
            )
            stale.append(f"{_shown(page, root)} is stale from line {line + 1}")
        else:
            try:
                atomic_write(page, lambda tmp, new=new: tmp.write_text(new))
            except UsageError as e:  # a full disk or a page that cannot be written: one line
                print(f"error: {e}", file=sys.stderr)
                return 2
    if stale:
        print(f"{'; '.join(stale)}: run python -m tools.tables", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
