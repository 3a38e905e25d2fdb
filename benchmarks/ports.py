"""The ports of the peers' Omniglot MAML examples (``examples/``) trained side by side with the peers' own loops.

    .venv/bin/python -m benchmarks.ports --out results/ports      # 3 ports x 2 engines x seeds 0, 1: ~30 min, 1 thread
    .venv/bin/python -m benchmarks.ports --ports higher --seeds 0 --iterations higher=2 --eval-tasks 32

For each port (``learn2learn``, ``higher``, ``torchopt``) and seed, two runs from the same initial weights (the
port's ``network()`` after ``torch.manual_seed(seed)``) on the same meta-batches (the port's samplers, drawn from a
generator seeded with the seed), with the port's Adam and meta-learning rate:

- ``maml-toolkit``: the port's training step, ``learner.backward(batch)`` of its ``meta_learner``;
- the peer: its example's own loop, with its own library and network, as the example writes it: learn2learn's
  ``MAML(OmniglotFC(...)).clone()`` and ``adapt(loss)`` per task, each query loss backpropagated and the gradients
  divided by the meta-batch; higher's ``innerloop_ctx(net, SGD, copy_initial_weights=False)`` and
  ``qry_loss.backward()`` per task (the sum over tasks); TorchOpt's ``MetaSGD`` with ``extract_state_dict`` /
  ``recover_state_dict`` around each task and the mean of the stacked query losses backpropagated at once. higher's
  and TorchOpt's nets track BatchNorm's running statistics, as their examples' do.

After training, both are evaluated alike: the trained weights in the port's network, the port's ``accuracy`` (the
toolkit's adaptation under ``torch.no_grad()``; ``tests/tools/test_ports.py`` holds its meta-gradient to the peers')
on ``--eval-tasks`` validation and as many test tasks, the same ones for both. Then, untimed, the peak of live tensor
bytes of one more meta-gradient (``benchmarks.tensor_peak.peak_tensor_bytes``, the profiler's memory events).
Times: the training loop's wall and CPU time (this process's, ``--threads`` threads), sampling excluded, and the
median iteration's (without the first, where ``batching="auto"`` times both batchings).

Each run writes ``OUT/<port>/<engine>-seed<k>/results.json`` (``--out``); ``python -m tools.tables`` renders
``docs/porting.md``'s table from them. The conv nets' step takes seconds of one CPU thread (32 tasks of 5 second-order
steps), so their default runs are a few iterations: a side-by-side check of the training, not a result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make the repository's packages importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import maml  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.tensor_peak import peak_tensor_bytes  # noqa: E402
from examples import higher_omniglot, learn2learn_omniglot, torchopt_omniglot  # noqa: E402

__all__ = [
    "EVAL_TASKS",
    "ITERATIONS",
    "PEERS",
    "PORTS",
    "copy_weights",
    "main",
    "parameter_pairs",
    "peer_network",
    "peer_step",
    "run",
]

PORTS: dict[str, ModuleType] = {
    "learn2learn": learn2learn_omniglot,
    "higher": higher_omniglot,
    "torchopt": torchopt_omniglot,
}
PEERS = {"learn2learn": "learn2learn", "higher": "higher", "torchopt": "torchopt"}  # the distribution of each
ITERATIONS = {"learn2learn": 100, "higher": 5, "torchopt": 5}  # about 2 minutes of one CPU thread each
EVAL_TASKS = {
    "learn2learn": 600,
    "higher": 96,
    "torchopt": 96,
}  # validation and test tasks each (5 or 75 queries a task)
Step = Callable[[maml.TaskBatch], Tensor]  # one meta-gradient into .grad; returns the meta-loss (detached)


def _quiet_import(name: str) -> ModuleType:
    with warnings.catch_warnings():  # gym, which learn2learn imports, warns about itself
        warnings.simplefilter("ignore")
        return __import__(name)


def peer_network(port: str, net: nn.Module) -> nn.Module:
    """The peer example's own network holding ``net``'s weights (``net``: the port's ``network()``)."""
    if port == "learn2learn":
        peer = _quiet_import("learn2learn").vision.models.OmniglotFC(28**2, learn2learn_omniglot.WAYS)
    else:  # higher's and TorchOpt's net: BatchNorm2d(64, momentum=1) with running statistics, as they build it
        layers: list[nn.Module] = []
        for n_in in (1, 64, 64):
            layers += [nn.Conv2d(n_in, 64, 3), nn.BatchNorm2d(64, momentum=1.0, affine=True)]
            layers += [nn.ReLU(inplace=port == "higher"), nn.MaxPool2d(2, 2)]
        peer = nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, PORTS[port].WAYS))
    peer = peer.to(next(net.parameters()))
    copy_weights(port, net, peer)
    return peer


def parameter_pairs(port: str, net: nn.Module, peer: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """Each parameter of the port's ``net`` with the same one of the peer's ``peer``."""
    if port != "learn2learn":  # the same nn.Sequential, the same names
        theirs = dict(peer.named_parameters())
        return [(p, theirs[k]) for k, p in net.named_parameters()]
    layers = [m for m in net if isinstance(m, (nn.Linear, nn.BatchNorm1d))]  # linear, norm, ..., linear
    blocks = [m for block in peer.features[1] for m in (block.linear, block.normalize)] + [peer.classifier]
    assert [type(m) for m in layers] == [type(m) for m in blocks]
    return [(getattr(a, k), getattr(b, k)) for a, b in zip(layers, blocks) for k in ("weight", "bias")]


def copy_weights(port: str, source: nn.Module, target: nn.Module, to_port: bool = False) -> None:
    """The port's network's weights into the peer's (or back, ``to_port``)."""
    pairs = parameter_pairs(port, target, source) if to_port else parameter_pairs(port, source, target)
    with torch.no_grad():
        for a, b in pairs:
            (a if to_port else b).copy_(b if to_port else a)


def peer_step(port: str, peer: nn.Module) -> Step:
    """The peer example's meta-gradient of one meta-batch on ``peer`` (:func:`peer_network`), as it writes it."""
    module = PORTS[port]
    if port == "learn2learn":
        l2l = _quiet_import("learn2learn")
        meta = l2l.algorithms.MAML(peer, lr=module.INNER_LR, first_order=False)
        loss = nn.CrossEntropyLoss(reduction="mean")

        def step(batch: maml.TaskBatch) -> Tensor:
            total = 0.0
            for sx, sy, qx, qy in zip(batch.support_x, batch.support_y, batch.query_x, batch.query_y):
                learner = meta.clone()
                for _ in range(module.STEPS):
                    learner.adapt(loss(learner(sx), sy))
                evaluation_error = loss(learner(qx), qy)
                evaluation_error.backward()
                total += evaluation_error.item()
            for p in meta.parameters():  # "Average the accumulated gradients"
                p.grad.data.mul_(1.0 / batch.num_tasks)
            return torch.tensor(total / batch.num_tasks)

        return step
    if port == "higher":
        higher = _quiet_import("higher")

        def step(batch: maml.TaskBatch) -> Tensor:
            inner_opt = torch.optim.SGD(peer.parameters(), lr=module.INNER_LR)
            qry_losses = []
            for i in range(batch.num_tasks):
                with higher.innerloop_ctx(peer, inner_opt, copy_initial_weights=False) as (fnet, diffopt):
                    for _ in range(module.STEPS):
                        diffopt.step(F.cross_entropy(fnet(batch.support_x[i]), batch.support_y[i]))
                    qry_loss = F.cross_entropy(fnet(batch.query_x[i]), batch.query_y[i])
                    qry_losses.append(qry_loss.detach())
                    qry_loss.backward()  # the sum over tasks
            return sum(qry_losses) / batch.num_tasks

        return step
    torchopt = _quiet_import("torchopt")
    inner_opt = torchopt.MetaSGD(peer, lr=module.INNER_LR)

    def step(batch: maml.TaskBatch) -> Tensor:
        net_state_dict = torchopt.extract_state_dict(peer, by="reference", detach_buffers=True)
        optim_state_dict = torchopt.extract_state_dict(inner_opt, by="reference")
        qry_losses = []
        for i in range(batch.num_tasks):
            for _ in range(module.STEPS):
                inner_opt.step(F.cross_entropy(peer(batch.support_x[i]), batch.support_y[i]))
            qry_losses.append(F.cross_entropy(peer(batch.query_x[i]), batch.query_y[i]))
            torchopt.recover_state_dict(peer, net_state_dict)
            torchopt.recover_state_dict(inner_opt, optim_state_dict)
        loss = torch.mean(torch.stack(qry_losses))
        loss.backward()
        return loss.detach()

    return step


def run(port: str, engine: str, seed: int, iterations: int, eval_tasks: int, data: str) -> dict[str, Any]:
    """One training run of ``port``'s protocol by ``engine`` (``"maml-toolkit"`` or the peer), and what it measured."""
    module = PORTS[port]
    train, validation, test = module.samplers(data)
    torch.manual_seed(seed)
    net = module.network()
    learner = module.meta_learner(net)
    if engine == "maml-toolkit":
        trained, step = net, learner.backward
    else:
        trained = peer_network(port, net)
        step = peer_step(port, trained)
    opt = torch.optim.Adam(trained.parameters(), lr=module.META_LR)
    g = torch.Generator().manual_seed(seed)
    wall, cpu, losses = [], [], []
    for _ in range(iterations):
        batch = train.sample(module.TASKS, g)
        w, c = time.perf_counter(), time.process_time()
        opt.zero_grad()
        losses.append(float(step(batch)))
        opt.step()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    if trained is not net:  # evaluated alike: the peer's weights in the port's network
        copy_weights(port, trained, net, to_port=True)
    evaluation = {
        name: {"accuracy": module.accuracy(learner, sampler, eval_tasks), "tasks": eval_tasks}
        for name, sampler in (("validation", validation), ("test", test))
    }
    peak_batch = train.sample(module.TASKS, torch.Generator().manual_seed(10_000 + seed))
    opt.zero_grad(set_to_none=True)
    peak = peak_tensor_bytes(lambda: step(peak_batch))
    later = cpu[1:] or cpu
    return {
        "port": port,
        "engine": engine,
        "seed": seed,
        "iterations": iterations,
        "protocol": {
            k.lower(): getattr(module, k) for k in ("WAYS", "SHOTS", "QUERY", "TASKS", "INNER_LR", "STEPS", "META_LR")
        },
        "batching": learner.resolved_batching if engine == "maml-toolkit" else None,
        "train_seconds": sum(wall),
        "train_cpu_seconds": sum(cpu),
        "iteration_cpu_seconds": statistics.median(later),
        "iteration_seconds": statistics.median(wall[1:] or wall),
        "meta_losses": losses,
        "tensor_peak_bytes": peak,
        **evaluation,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", nargs="+", choices=list(PORTS), default=list(PORTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=("maml-toolkit", "peer"),
        default=["maml-toolkit", "peer"],
        help="which side of each pair to run (default: both; one side again after a change to it)",
    )
    parser.add_argument(
        "--iterations",
        nargs="+",
        default=[],
        metavar="PORT=N",
        help=f"training iterations of a port's runs (default: {' '.join(f'{k}={v}' for k, v in ITERATIONS.items())})",
    )
    parser.add_argument(
        "--eval-tasks",
        type=int,
        help=f"validation and test tasks of every port (default: {' '.join(f'{k}={v}' for k, v in EVAL_TASKS.items())})",
    )
    parser.add_argument("--threads", type=int, default=1, help="(default: %(default)s)")
    parser.add_argument("--data", help="the Omniglot archives (default: $OMNIGLOT_DIR)")
    parser.add_argument("--out", type=Path, help="write each run's results.json under OUT/<port>/<engine>-seed<k>/")
    args = parser.parse_args(argv)
    iterations = dict(ITERATIONS)
    for item in args.iterations:
        name, _, n = item.partition("=")
        if name not in PORTS or not n.isdigit():
            parser.error(f"--iterations {item}: write PORT=N, PORT one of {', '.join(PORTS)}")
        iterations[name] = int(n)
    data = args.data or os.environ.get("OMNIGLOT_DIR")
    if data is None:
        parser.error("no data: pass --data DIR (the Omniglot archives) or set $OMNIGLOT_DIR")
    torch.set_num_threads(args.threads)
    command = sys.argv[1:] if argv is None else argv
    for port in args.ports:
        for seed in args.seeds:
            for engine in [e if e != "peer" else PEERS[port] for e in args.engines]:
                result = run(port, engine, seed, iterations[port], args.eval_tasks or EVAL_TASKS[port], data)
                print(
                    f"{port:<12} {engine:<13} seed {seed}: {result['iterations']} iterations in "
                    f"{result['train_seconds']:.1f} s ({result['iteration_cpu_seconds']:.3f} s CPU an iteration), "
                    f"tensor peak {result['tensor_peak_bytes'] / 2**20:,.0f} MiB, validation "
                    f"{100 * result['validation']['accuracy']:.1f} %, test {100 * result['test']['accuracy']:.1f} %",
                    flush=True,
                )
                if args.out is not None:
                    peer_version = {engine: _version(engine)} if engine != "maml-toolkit" else {}
                    path = args.out / port / f"{engine}-seed{seed}" / "results.json"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_report(path, "ports", command, "cpu", args.threads, peer=peer_version, **result)
    return 0


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
