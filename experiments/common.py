"""What every experiment script shares: flags and YAML configs, the output folder, checkpoints,
wandb, the meta-training loop, confidence intervals and results.json."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.metadata
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import Tensor

import maml

RUN_FILES = ("config.yaml", "checkpoint.pt", "results.json")


class UsageError(Exception):
    """Bad input from the user: the script prints the message and exits with code 2."""


# ---------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How to run, as opposed to what to train (the experiment's config dataclass).

    Under ``torchrun``, ``rank`` and ``world_size`` place this process among the ones that
    share each meta-batch, and ``device`` is its own (``cuda:LOCAL_RANK`` for ``--device cuda``).
    """

    experiment: str
    out: Path
    resume: bool
    overwrite: bool
    wandb: str
    device: torch.device
    config_file: Path | None
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        """Whether this process is rank 0, the one that logs and writes under ``--out``."""
        return self.rank == 0


def field(default: Any, help: str) -> Any:
    """A config dataclass field with its ``--help`` text."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_config(cfg: Any, positive: Sequence[str], choices: dict[str, Sequence[Any]]) -> None:
    """Raises ValueError naming the key of the first value that is not >= 1 or not among its choices."""
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key}={getattr(cfg, key)} must be >= 1.")
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"{key}={getattr(cfg, key)!r} is not one of {', '.join(map(repr, allowed))}.")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """``(type, optional)`` for ``T`` or ``T | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _convert(key: str, value: Any, tp: Any, source: str) -> Any:
    """Checks (YAML) or converts (command-line strings) ``value`` to the field's type."""
    base, optional = _base_type(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise UsageError(f"{source}: {key} must be a {_type_name(base)}, got null.")
    if typing.get_origin(base) in (list, tuple):
        (item,) = set(typing.get_args(base)) - {Ellipsis}
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)) or not value:
            raise UsageError(f"{source}: {key} must be a non-empty list of {_type_name(item)}, got {value!r}.")
        return tuple(_convert(key, v, item, source) for v in value)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str:
        if isinstance(value, str):
            return value
    raise UsageError(f"{source}: {key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}).")


def _type_name(tp: Any) -> str:
    base, optional = _base_type(tp)
    if typing.get_origin(base) in (list, tuple):
        name = f"a list of {_type_name(typing.get_args(base)[0])}"
    else:
        name = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string"}.get(base, str(base))
    return name + (" or null" if optional else "")


def _suggest(word: str, choices: Sequence[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(matches)}?)" if matches else ""


def _load_yaml(path: Path, cls: type) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: must be a mapping of config keys to values, got {type(data).__name__}.")
    types_ = _field_types(cls)
    names = list(types_)
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in types_:
            raise UsageError(
                f"--config {path}: unknown key {key!r}{_suggest(name, names)}. Known keys: {', '.join(names)}."
            )
        out[name] = _convert(name, value, types_[name], f"--config {path}")
    return out


def parse_args(
    experiment: str, cls: type, argv: Sequence[str] | None, description: str, validate: Callable[[Any], None]
) -> tuple[Any, RunOptions]:
    """Parses the command line into the experiment's config dataclass and the run options.

    Precedence: the dataclass defaults, then ``--config FILE`` (YAML), then flags. Every field is
    a kebab-case flag (``--inner-lr 0.01``, also ``--inner-lr=0.01`` and ``--inner_lr=0.01``, as
    ``wandb agent`` passes them).

    Raises:
        UsageError: unknown flag or key (with close matches), wrong type, invalid value.
    """
    types_ = _field_types(cls)
    parser = argparse.ArgumentParser(
        prog=f"python -m experiments.{experiment}", description=description, allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    run = parser.add_argument_group("run")
    run.add_argument("--config", type=Path, help="YAML file of config keys (flags override it)")
    run.add_argument("--out", type=Path, default=Path("runs") / experiment, help="output folder")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    run.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    run.add_argument("--wandb", choices=("offline", "online", "disabled"), help="wandb mode (default: $WANDB_MODE, "
                     "else online if logged in, else offline)")  # fmt: skip
    run.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    hyper = parser.add_argument_group("hyperparameters")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, tp in types_.items():
        help_ = next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("help", "")
        hyper.add_argument(_flag(name), f"--{name}" if "_" in name else _flag(name) + "-", dest=name, default=None,
                           metavar=_type_name(tp).split(" ", 1)[-1].upper().replace(" ", "_"),
                           help=f"{help_} (default: {defaults[name]})")  # fmt: skip

    def error(message: str) -> typing.NoReturn:
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and not o.endswith("-")]
        bad = unknown[0].split("=", 1)[0]
        raise UsageError(f"unknown flag {bad}{_suggest(bad, flags)}; see --help for the full list.")

    values = dict(defaults)
    if args.config is not None:
        values.update(_load_yaml(args.config, cls))
    for name, tp in types_.items():
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _convert(name, raw, tp, _flag(name))
    cfg = cls(**values)
    try:
        validate(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available on this machine; use --device cpu.")
    device, rank, world_size = join_processes(device)
    return cfg, RunOptions(experiment, args.out, args.resume, args.overwrite, args.wandb or default_wandb_mode(), device,
                           args.config, rank, world_size)  # fmt: skip


def default_wandb_mode() -> str:
    """$WANDB_MODE if set; online if the user is logged in; offline otherwise (never hangs without network)."""
    if os.environ.get("WANDB_MODE") in ("offline", "online", "disabled", "dryrun", "run"):
        return {"dryrun": "offline", "run": "online"}.get(os.environ["WANDB_MODE"], os.environ["WANDB_MODE"])
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


# ---------------------------------------------------------------------------- several processes (torchrun)


def join_processes(device: torch.device) -> tuple[torch.device, int, int]:
    """Under ``torchrun``, joins its process group; returns this process's device, rank and world size.

    torchrun (or any launcher of ``init_method="env://"``) sets RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; without them this is the only process: ``(device, 0, 1)``.
    The backend is gloo on CPU and NCCL on GPUs, each process on the GPU ``cuda:LOCAL_RANK``.

    Raises:
        UsageError: a device that the backends cannot serve, a GPU index that several
            processes of this machine would share, or fewer GPUs than processes.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return device, 0, 1
    if not dist.is_available():
        raise UsageError("this PyTorch build has no torch.distributed; run the script without torchrun.")
    if device.type == "cuda":
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if device.index is not None and local_size > 1:
            raise UsageError(f"--device {device}: the {local_size} processes on this machine would share one GPU; "
                             f"pass --device cuda, and each process takes the GPU cuda:LOCAL_RANK.")  # fmt: skip
        if device.index is None:
            if local_rank >= torch.cuda.device_count():
                raise UsageError(f"process LOCAL_RANK={local_rank} needs the GPU cuda:{local_rank}, but this machine has "
                                 f"{torch.cuda.device_count()}; start at most that many processes per machine "
                                 f"(--nproc-per-node).")  # fmt: skip
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # NCCL and broadcast_object_list use the current device
        dist.init_process_group("nccl")
    elif device.type == "cpu":
        dist.init_process_group("gloo")
    else:
        raise UsageError(f"--device {device}: several processes need --device cpu (gloo) or --device cuda (NCCL).")
    return device, dist.get_rank(), dist.get_world_size()


def check_shards(meta_batch: int, opts: RunOptions) -> None:
    """Raises UsageError when the meta-batch cannot be split into equal shares, one per process.

    Equal shares make the mean of the processes' meta-gradients the meta-gradient of the whole
    meta-batch (see ``maml.shard``); checked at start-up rather than at the first step.
    """
    if meta_batch % opts.world_size:
        fits = [n for n in range(1, meta_batch + 1) if meta_batch % n == 0]
        raise UsageError(
            f"--meta-batch {meta_batch} cannot be split evenly across {opts.world_size} processes (the world size "
            f"torchrun started): each process adapts the same number of tasks. Pass a --meta-batch that is a "
            f"multiple of {opts.world_size}, or start a number of processes (--nnodes x --nproc-per-node) that "
            f"divides {meta_batch}: {', '.join(map(str, fits))}."
        )


def broadcast(value: Any, opts: RunOptions) -> Any:
    """Rank 0's ``value`` on every process (any picklable object); ``value`` itself in one process."""
    if opts.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------- output folder


def prepare_out(opts: RunOptions, cfg: Any) -> dict[str, Any] | None:
    """Checks the output folder before anything is written; returns the checkpoint when resuming.

    With several processes, rank 0 alone reads ``--out`` (the others may run on machines
    that do not see it) and sends every rank the checkpoint or the error, so that all ranks
    resume from the same state or stop together.

    Raises:
        UsageError: ``--out`` holds another run (without ``--resume``/``--overwrite``), or the
            checkpoint to resume is missing, unreadable, or from a different config.
    """
    outcome: dict[str, Any] | UsageError | None = None
    if opts.main:
        try:
            outcome = _check_out(opts, cfg)
        except UsageError as e:
            if opts.world_size == 1:
                raise
            outcome = e
    outcome = broadcast(outcome, opts)
    if isinstance(outcome, UsageError):
        raise outcome
    return outcome


def _check_out(opts: RunOptions, cfg: Any) -> dict[str, Any] | None:
    out = opts.out
    if opts.resume and opts.overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one.")
    if opts.resume:
        path = out / "checkpoint.pt"
        if not path.is_file():
            raise UsageError(f"--resume: no checkpoint at {path}; start the run without --resume.")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            saved = state["config"]
        except Exception as e:  # a truncated or foreign file: say so, keep it
            raise UsageError(f"--resume: the checkpoint {path} is corrupt or not from this script ({type(e).__name__}: {e}).") from None
        mine = dataclasses.asdict(cfg)
        if saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise UsageError(
                f"--resume: the config differs from the run in {out}: "
                + ", ".join(f"{k}={new!r} (run has {old!r})" for k, (old, new) in diff.items())
                + f". Resume with the same flags, or --config {out / 'config.yaml'}."
            )
        return state
    taken = [f for f in RUN_FILES if (out / f).exists()]
    if taken and not opts.overwrite:
        raise UsageError(
            f"--out {out} already holds a run ({', '.join(taken)}); pass --resume to continue it, "
            f"--overwrite to replace it, or another --out."
        )
    return None


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Writes through a temporary file and a rename, so a kill never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_config(out: Path, cfg: Any) -> None:
    atomic_write(out / "config.yaml", lambda p: p.write_text(yaml.safe_dump(
        {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}, sort_keys=False)))  # fmt: skip


def load_config(cls: type, path: Path) -> Any:
    """The config dataclass saved in a run's config.yaml."""
    return cls(**_load_yaml(path, cls))


# ---------------------------------------------------------------------------- statistics, provenance


def mean_ci95(values: Tensor) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (normal approximation)."""
    values = values.double().flatten()
    n = values.numel()
    half = 1.96 * float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return float(values.mean()), half


def provenance() -> dict[str, Any]:
    """Package versions and the git commit of the code that ran."""
    versions = {"python": platform.python_version()}
    for pkg in ("maml-toolkit", "torch", "numpy", "wandb", "learn2learn", "higher"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None
    return {"versions": versions, "git_commit": commit, "git_dirty": dirty, "host": platform.node()}


def finish(opts: RunOptions, cfg: Any, run: Any, trainer: Trainer, test: dict[str, dict[str, Any]], metric: str,
           **extra: Any) -> None:  # fmt: skip
    """Puts the test metric in the wandb summary, writes results.json, and closes the wandb run."""
    for key, r in test.items():
        run.summary[f"test/{metric}_{key}"] = r[metric]
        run.summary[f"test/{metric}_{key}_ci95"] = r["ci95"]
    last = trainer.history[-1] if trainer.history else {}
    results = {
        "experiment": opts.experiment,
        "config": dataclasses.asdict(cfg),
        **extra,
        "test": test,
        "final_val": {k: v for k, v in last.items() if k.startswith("val/")},
        "iterations": trainer.iterations,
        "train_seconds": round(trainer.train_seconds, 1),
        "device": str(opts.device),
        "processes": opts.world_size,
        **provenance(),
    }
    atomic_write(opts.out / "results.json", lambda p: p.write_text(json.dumps(results, indent=2) + "\n"))
    finish_wandb(run)


# ---------------------------------------------------------------------------- wandb


def init_wandb(opts: RunOptions, cfg: Any, name: str, run_id: str | None) -> Any:
    """Starts (or resumes) the wandb run, its files under ``--out``; never blocks without a network."""
    import wandb

    os.environ.setdefault("WANDB_DIR", str(opts.out))
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "maml-toolkit"),
        name=os.environ.get("WANDB_NAME", name),
        group=os.environ.get("WANDB_RUN_GROUP"),
        dir=str(opts.out),
        mode=opts.wandb,
        id=run_id,
        resume="allow" if run_id else None,
        config=dataclasses.asdict(cfg),
    )


def finish_wandb(run: Any) -> None:
    import wandb

    run.finish()
    # finish() can return before the offline .wandb file is complete; teardown waits for it.
    wandb.teardown()


# ---------------------------------------------------------------------------- the training loop


@dataclasses.dataclass
class Trainer:
    """The meta-training loop shared by the experiments: resumable, bit for bit.

    Everything a step depends on (model, optimizer, learnable rates, the task sampler's
    generator, the global RNG, the iteration) is in the checkpoint, and the checkpoint is
    written atomically, so a run killed at any point and resumed with ``--resume`` ends with
    exactly the parameters of an uninterrupted run.

    Under ``torchrun`` every process samples the full meta-batch from the same generator,
    adapts its share (``maml.shard``), and the meta-gradients are averaged in one all-reduce
    before the same optimizer step everywhere: the trajectory does not depend on the number
    of processes (to float rounding), and a run may resume with another number. Rank 0 alone
    validates, logs and writes checkpoints.

    Attributes:
        learner: the meta-learner (its model is trained).
        optimizer: the outer optimizer over ``learner.parameters()``.
        sample: ``sample(generator) -> TaskBatch``, one meta-batch of training tasks.
        metrics: ``metrics(output, batch) -> dict`` of extra training metrics (e.g. accuracy),
            each a mean over the tasks of ``batch`` (with several processes, of this rank's
            share; the logged value is the mean over the ranks, the full meta-batch's).
        validate: ``validate() -> dict`` of validation metrics (its own fixed tasks); runs on rank 0 only.
        iterations: total meta-iterations.
        log_every, val_every, checkpoint_every: in iterations.
        seed: seeds the sampler's generator.
        device: where the meta-batches go.
    """

    learner: maml.MetaLearner
    optimizer: torch.optim.Optimizer
    sample: Callable[[torch.Generator], maml.TaskBatch]
    metrics: Callable[[maml.MetaOutput, maml.TaskBatch], dict[str, float]]
    validate: Callable[[], dict[str, float]]
    iterations: int
    log_every: int
    val_every: int
    checkpoint_every: int
    seed: int
    device: torch.device
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # Meta-losses and step time since the last log row: checkpointed, so a resumed run logs the same rows.
    window: list[float] = dataclasses.field(default_factory=list)
    step_time: float = 0.0
    train_seconds: float = 0.0  # wall time of the training loop, summed over resumed runs
    _began: float = dataclasses.field(default=0.0, repr=False)

    def state(self, iteration: int, generator: torch.Generator, cfg: Any, wandb_id: str | None) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "config": dataclasses.asdict(cfg),
            "learner": self.learner.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "history": self.history,
            "window": (self.window, self.step_time),
            "train_seconds": self.train_seconds + time.perf_counter() - self._began,
            "wandb_id": wandb_id,
        }

    def run(self, opts: RunOptions, cfg: Any, resumed: dict[str, Any] | None, run: Any) -> None:
        """Trains from iteration 0 or from ``resumed``."""
        from tqdm import tqdm

        generator = torch.Generator().manual_seed(self.seed)
        start = 0
        if resumed is not None:
            self.learner.load_state_dict(resumed["learner"])
            self.optimizer.load_state_dict(resumed["optimizer"])
            generator.set_state(resumed["generator"])
            torch.set_rng_state(resumed["torch_rng"])
            if resumed["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(resumed["cuda_rng"])
            self.history = resumed["history"]
            self.window, self.step_time = resumed["window"]
            self.train_seconds = resumed["train_seconds"]
            start = resumed["iteration"]
        wandb_id = getattr(run, "id", None)
        main, sharded = opts.main, opts.world_size > 1

        def checkpoint(iteration: int) -> None:
            atomic_write(opts.out / "checkpoint.pt", lambda p: torch.save(self.state(iteration, generator, cfg, wandb_id), p))

        # Ctrl-C and SIGTERM (kill, a cluster's pre-emption) stop the run at the end of the current
        # iteration, so the checkpoint written then is consistent; a second Ctrl-C stops at once
        # (the last periodic checkpoint stays valid). torchrun passes the signal on to every process.
        stop: list[int] = []

        def request_stop(signum: int, frame: Any) -> None:
            if stop:
                raise KeyboardInterrupt
            stop.append(signum)

        handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._began = time.perf_counter()
        bar = tqdm(range(start, self.iterations), initial=start, total=self.iterations, desc="meta-train",
                   dynamic_ncols=True, mininterval=0.5, disable=None if main else True)  # fmt: skip
        try:
            for iteration in bar:
                # The full meta-batch on every rank, whatever their number: the same trajectory.
                batch = maml.shard(self.sample(generator)).to(self.device)
                t0 = time.perf_counter()
                out = self.learner.run(batch)
                self.optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                if sharded:
                    # One all-reduce carries the meta-gradients, the meta-loss and whether a rank was
                    # signalled; ranks get signals at different moments, and deciding on the shared
                    # vote makes them all stop after the same iteration (none left in a collective).
                    votes = torch.stack([out.loss.detach(), out.loss.new_tensor(float(bool(stop)))])
                    loss, vote = maml.all_reduce_grads(self.learner.parameters(), votes).tolist()
                    stopping = vote > 0
                else:
                    loss, stopping = float(out.loss.detach()), bool(stop)
                logging = (iteration + 1) % self.log_every == 0
                if logging:
                    grads = [p.grad for p in self.learner.parameters() if p.grad is not None]
                    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
                self.optimizer.step()
                self.step_time += time.perf_counter() - t0
                self.window.append(loss)
                if logging:
                    inner, metrics = self._inner_losses(out, batch), self.metrics(out, batch)
                    row = {
                        "iteration": iteration + 1,
                        "train/meta_loss": sum(self.window) / len(self.window),
                        "train/meta_grad_norm": grad_norm,
                        "train/step_time_ms": 1e3 * self.step_time / len(self.window),
                        **inner,
                        **self._rates(),
                        **metrics,
                    }
                    if sharded:  # means over this rank's tasks -> means over the meta-batch
                        shard_means = torch.tensor([*inner.values(), *metrics.values()], dtype=torch.float64, device=self.device)
                        row.update(zip([*inner, *metrics], maml.all_reduce_mean(shard_means).tolist()))
                    if main and ((iteration + 1) % self.val_every == 0 or iteration + 1 == self.iterations):
                        row.update(self.validate())
                    self.history.append(row)
                    if main:
                        run.log(row, step=iteration + 1)
                    bar.set_postfix(meta_loss=f"{row['train/meta_loss']:.4f}")
                    self.window, self.step_time = [], 0.0
                if main and (stopping or (iteration + 1) % self.checkpoint_every == 0 or iteration + 1 == self.iterations):
                    checkpoint(iteration + 1)
                if stopping:
                    bar.close()
                    if main:
                        finish_wandb(run)
                        print(f"\nstopped after iteration {iteration + 1}; continue with the same command plus --resume",
                              file=sys.stderr)  # fmt: skip
                    # A rank stopped by another's signal exits as if it had received SIGTERM.
                    raise SystemExit(130 if stop and stop[0] == signal.SIGINT else 143)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            bar.close()
        self.train_seconds += time.perf_counter() - self._began

    def _inner_losses(self, out: maml.MetaOutput, batch: maml.TaskBatch) -> dict[str, float]:
        row = {"train/query_loss": float(out.query_losses.mean())}
        if out.support_losses.shape[0]:
            with torch.no_grad():
                after, _ = self.learner.task_losses(out.fast, batch.support_x, batch.support_y)
            row["train/support_loss_before"] = float(out.support_losses[0].mean())
            row["train/support_loss_after"] = float(after.mean())
        return row

    def _rates(self) -> dict[str, float]:
        return {f"inner_lr/{k}": float(v.detach().mean()) for k, v in self.learner.rate_parameters.items()}


def main(run: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Runs an experiment's entry point, turning UsageError into a message and exit code 2.

    Leaves the process group that ``parse_args`` joined under torchrun, however the run ends.
    """
    together = False  # whether every rank ends here at the same point of the run
    try:
        run(argv)
        together = True
    except UsageError as e:
        # Under torchrun every rank may print it; the rank says which process did.
        where = f" (rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
        print(f"error{where}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except SystemExit as e:
        together = e.code in (130, 143)  # the stop that every rank voted for after one iteration
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            if together:
                # Ranks > 0 finish before rank 0 (which evaluates and writes); a rank that tore down
                # its gloo connections while rank 0 still held them has died of SIGABRT at exit.
                # Leaving together is the shutdown that gloo and NCCL expect.
                dist.barrier()
            dist.destroy_process_group()
