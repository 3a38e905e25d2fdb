"""How one meta-training step's cost grows: time and tensor peak against inner steps and against meta-batch size.

    .venv/bin/python -m benchmarks.cost_figure        # reads the two JSONs below, writes docs/img/cost-growth.png

Draws what ``benchmarks.memory`` measured, nothing else: ``results/benchmarks/memory.json`` (8 tasks,
by inner steps; with ``memory_long.json``, a run of the same setting at more steps, where it exists) and
``results/benchmarks/memory_tasks.json`` (by meta-batch size, 1 to 64 tasks),
each method a line, on log-log axes. A configuration that ran out of the worker's memory limit
ends its line (marked by a cross at the limit on the memory panels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS_JSON = REPO / "results/benchmarks/memory.json"
LONG_JSON = REPO / "results/benchmarks/memory_long.json"  # the same setting at more steps, where it was run
TASKS_JSON = REPO / "results/benchmarks/memory_tasks.json"
OUT = REPO / "docs/img/cost-growth.png"

# One colour and marker per method, the same in every panel; the peers dashed.
STYLE = {
    "second_order": ("tab:red", "o"),
    "second_order_chunked": ("tab:orange", "s"),
    "checkpointed": ("tab:green", "^"),
    "checkpointed_every1": ("tab:olive", "v"),
    "checkpointed_forward_over_reverse": ("tab:cyan", "<"),
    "first_order": ("tab:gray", "D"),
    "implicit": ("tab:purple", "P"),
    "learn2learn": ("black", "x"),
    "higher": ("tab:brown", "+"),
}
LABEL = {"second_order_chunked": "backward(chunk=1)", "checkpointed_forward_over_reverse": "checkpointed f-o-r"}


def _series(report: dict[str, Any], axis: str, key: str) -> dict[str, tuple[list[int], list[float], list[int]]]:
    """Per method: the x values where it ran, its ``key`` there, and the x values where it ran out of memory."""
    out: dict[str, tuple[list[int], list[float], list[int]]] = {}
    for r in sorted(report["results"], key=lambda r: r[axis]):
        xs, ys, oom = out.setdefault(r["method"], ([], [], []))
        if r.get("oom") or str(r.get("error", "")).startswith("MemoryError"):  # out of the worker's memory limit
            oom.append(r[axis])
        elif not r.get("error"):
            xs.append(r[axis])
            ys.append(r[key])
    return out


def draw(steps_report: dict[str, Any], tasks_report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    panels = [
        (steps_report, "steps", "seconds", "CPU seconds per step", axes[0, 0]),
        (steps_report, "steps", "tensor_mib", "tensor peak (MiB)", axes[1, 0]),
        (tasks_report, "tasks", "seconds", "CPU seconds per step", axes[0, 1]),
        (tasks_report, "tasks", "tensor_mib", "tensor peak (MiB)", axes[1, 1]),
    ]
    for report, axis, key, ylabel, ax in panels:
        limit = 1024 * report["setting"]["limit_gib"]
        for method, (xs, ys, oom) in _series(report, axis, key).items():
            colour, marker = STYLE.get(method, ("tab:blue", "."))
            dashed = "--" if method in ("learn2learn", "higher") else "-"
            ax.plot(xs, ys, dashed, color=colour, marker=marker, label=LABEL.get(method, method))
            if oom and key == "tensor_mib":
                ax.plot(oom[:1], [limit], marker="X", color=colour, markersize=10, linestyle="none")
        fixed = (
            f"{report['setting']['tasks']} tasks"
            if axis == "steps"
            else f"{report['steps'][0]} inner step{'s' if report['steps'][0] != 1 else ''}"
        )
        ax.set(xscale="log", yscale="log", xlabel=f"inner steps ({fixed})" if axis == "steps" else f"tasks ({fixed})")
        ticks = sorted({r[axis] for r in report["results"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    handles: dict[str, Any] = {}  # one legend for the methods of every panel
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=5, fontsize=9)
    device = steps_report["device"]
    fig.suptitle(
        f"One meta-training step of the Omniglot max-pool net, 5-way {steps_report['setting']['shots']}-shot, "
        f"{steps_report['setting']['query']} query per class\n({device}, {steps_report['threads']} thread, "
        f"torch {steps_report['versions'].get('torch', '?')}); X: out of the worker's address-space limit",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-json", type=Path, default=STEPS_JSON, help="(default: %(default)s)")
    parser.add_argument("--tasks-json", type=Path, default=TASKS_JSON, help="(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    reports = []
    for path in (args.steps_json, args.tasks_json):
        if not path.is_file():
            print(
                f"{path}: no such file; run benchmarks.memory with --json first (see this module's docstring)",
                file=sys.stderr,
            )
            return 2
        reports.append(json.loads(path.read_text()))
    if LONG_JSON.is_file() and args.steps_json == STEPS_JSON:
        reports[0] = {**reports[0], "results": reports[0]["results"] + json.loads(LONG_JSON.read_text())["results"]}
    draw(*reports, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
