"""The ports of the peers' Omniglot MAML examples (``examples/``) compute the peers' own first meta-gradient.

For each port: the same initial weights in the port's network and in the peer example's own (its library's, with
its BatchNorm as it builds it), the same real Omniglot meta-batch, float64; the peer's loop written here as its
example writes it. The toolkit's meta-loss is the mean over tasks: learn2learn divides its summed gradients by the
meta-batch and TorchOpt backpropagates the mean, the same; higher backpropagates each task's loss, the sum, T times
the mean. The benchmark's copies of the peers' loops (``benchmarks/ports.py``) are held to the same gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, omniglot_root
from torch import nn

from benchmarks import ports
from examples import higher_omniglot, learn2learn_omniglot, torchopt_omniglot

with warnings.catch_warnings():  # gym, imported by learn2learn, warns about its own deprecation
    warnings.simplefilter("ignore")
    import higher
    import learn2learn as l2l
    import torchopt  # the peers extra (scripts/setup.sh) installs all three

CONV_TASKS = 4  # the conv ports' meta-batch here (theirs: 32): each task is 5 second-order steps of a conv net


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Omniglot decoded once for this module, into a folder of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAML_CACHE_DIR", str(tmp_path_factory.mktemp("omniglot-cache")))
        yield


def setup(port, tasks: int, seed: int = 0):
    """The port's network (float64) and learner, and a real Omniglot meta-batch of its protocol."""
    train, _, _ = port.samplers(str(omniglot_root()))
    batch = train.sample(tasks, torch.Generator().manual_seed(seed), dtype=torch.float64)
    torch.manual_seed(seed)
    net = port.network().double()
    return net, port.meta_learner(net), batch


def port_grads(learner, batch) -> list[torch.Tensor]:
    learner.backward(batch)  # the port's training step
    return [p.grad for p in learner.model.parameters()]


def peer_grads(name: str, net: nn.Module, peer: nn.Module) -> list[torch.Tensor]:
    """The peer's gradients, in the order of the port's parameters."""
    return [theirs.grad for _, theirs in ports.parameter_pairs(name, net, peer)]


def assert_close(got: list[torch.Tensor], expected: list[torch.Tensor], factor: float = 1.0) -> None:
    assert len(got) == len(expected) > 0
    assert max(e.abs().max().item() for e in expected) > 1e-3  # not vacuous
    for g, e in zip(got, expected, strict=True):
        assert g is not None and e is not None
        torch.testing.assert_close(factor * g, e, rtol=1e-10, atol=1e-12)


def test_the_learn2learn_port_has_learn2learns_meta_gradient():
    module = learn2learn_omniglot
    net, learner, batch = setup(module, module.TASKS)
    peer = ports.peer_network("learn2learn", net)  # l2l.vision.models.OmniglotFC holding the port's weights
    assert isinstance(peer, l2l.vision.models.OmniglotFC)
    bench_peer = ports.peer_network("learn2learn", net)

    # learn2learn's examples/vision/maml_omniglot.py: fast_adapt per task, then the gradients averaged.
    maml = l2l.algorithms.MAML(peer, lr=0.5, first_order=False)
    loss = nn.CrossEntropyLoss(reduction="mean")
    for adaptation_data, adaptation_labels, evaluation_data, evaluation_labels in zip(*batch.tensors):
        learner_ = maml.clone()
        for _step in range(1):  # adaptation_steps
            train_error = loss(learner_(adaptation_data), adaptation_labels)
            learner_.adapt(train_error)
        predictions = learner_(evaluation_data)
        valid_error = loss(predictions, evaluation_labels)
        valid_error.backward()
    for p in maml.parameters():
        p.grad.data.mul_(1.0 / module.TASKS)  # meta_batch_size

    ours = port_grads(learner, batch)
    assert_close(ours, peer_grads("learn2learn", net, peer))  # learn2learn's mean: no factor
    ports.peer_step("learn2learn", bench_peer)(batch)
    assert_close(ours, peer_grads("learn2learn", net, bench_peer))


def test_the_higher_port_has_highers_meta_gradient_times_the_tasks():
    net, learner, batch = setup(higher_omniglot, CONV_TASKS)
    peer = ports.peer_network("higher", net)  # higher's net: BatchNorm2d(64, momentum=1) with running statistics
    assert all(m.track_running_stats for m in peer.modules() if isinstance(m, nn.BatchNorm2d))
    bench_peer = ports.peer_network("higher", net)

    # higher's examples/maml-omniglot.py, train(): one innerloop_ctx per task, each query loss backpropagated.
    x_spt, y_spt, x_qry, y_qry = batch.tensors
    task_num = x_spt.size(0)
    n_inner_iter = 5
    inner_opt = torch.optim.SGD(peer.parameters(), lr=1e-1)
    for i in range(task_num):
        with higher.innerloop_ctx(peer, inner_opt, copy_initial_weights=False) as (fnet, diffopt):
            for _ in range(n_inner_iter):
                spt_logits = fnet(x_spt[i])
                spt_loss = F.cross_entropy(spt_logits, y_spt[i])
                diffopt.step(spt_loss)
            qry_logits = fnet(x_qry[i])
            qry_loss = F.cross_entropy(qry_logits, y_qry[i])
            qry_loss.backward()

    ours = port_grads(learner, batch)
    assert_close(ours, peer_grads("higher", net, peer), factor=task_num)  # higher's sum: T times the mean
    ports.peer_step("higher", bench_peer)(batch)
    assert_close(ours, peer_grads("higher", net, bench_peer), factor=task_num)


def test_the_torchopt_port_has_torchopts_meta_gradient():
    net, learner, batch = setup(torchopt_omniglot, CONV_TASKS)
    peer = ports.peer_network("torchopt", net)
    bench_peer = ports.peer_network("torchopt", net)

    # TorchOpt's examples/few-shot/maml_omniglot.py, train(): MetaSGD in place, the state recovered after each task.
    x_spt, y_spt, x_qry, y_qry = batch.tensors
    task_num = x_spt.size(0)
    n_inner_iter = 5
    inner_opt = torchopt.MetaSGD(peer, lr=1e-1)
    qry_losses = []
    net_state_dict = torchopt.extract_state_dict(peer, by="reference", detach_buffers=True)
    optim_state_dict = torchopt.extract_state_dict(inner_opt, by="reference")
    for i in range(task_num):
        for _ in range(n_inner_iter):
            spt_logits = peer(x_spt[i])
            spt_loss = F.cross_entropy(spt_logits, y_spt[i])
            inner_opt.step(spt_loss)
        qry_logits = peer(x_qry[i])
        qry_loss = F.cross_entropy(qry_logits, y_qry[i])
        qry_losses.append(qry_loss)
        torchopt.recover_state_dict(peer, net_state_dict)
        torchopt.recover_state_dict(inner_opt, optim_state_dict)
    qry_losses = torch.mean(torch.stack(qry_losses))
    qry_losses.backward()

    ours = port_grads(learner, batch)
    assert_close(ours, peer_grads("torchopt", net, peer))  # TorchOpt's mean: no factor
    ports.peer_step("torchopt", bench_peer)(batch)
    assert_close(ours, peer_grads("torchopt", net, bench_peer))


@pytest.mark.parametrize("port", [learn2learn_omniglot, higher_omniglot, torchopt_omniglot], ids=lambda m: m.__name__)
def test_a_port_trains_and_reports_its_accuracy(port, monkeypatch, capsys):
    monkeypatch.setattr(port, "TASKS", 2)  # its loop as it is, on a smaller meta-batch
    monkeypatch.setattr(port, "STEPS", 1)
    monkeypatch.setenv("OMNIGLOT_DIR", str(omniglot_root()))
    port.main(["--iterations", "2", "--eval-tasks", "3", "--threads", "1", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("iteration 2: meta-loss ")
    assert [line.split(":")[0] for line in lines[1:]] == ["validation accuracy", "test accuracy"]


@pytest.mark.parametrize("form", ["module", "file"])
@pytest.mark.parametrize("name", ["learn2learn_omniglot", "higher_omniglot", "torchopt_omniglot"])
def test_a_port_runs_as_a_module_and_as_a_file(name, form):
    command = ["-m", f"examples.{name}"] if form == "module" else [str(REPO / "examples" / f"{name}.py")]
    env = {k: v for k, v in os.environ.items() if k != "OMNIGLOT_DIR"}
    run = subprocess.run(
        [sys.executable, *command, "--iterations", "1", "--threads", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and "no data: pass --data DIR" in run.stderr, run.stderr  # it started, and asks


def test_the_ports_table_gives_each_engine_over_its_seeds_with_the_runs_provenance(tmp_path):
    from tools import tables

    def result(port: str, engine: str, seed: int, accuracy: float) -> None:
        run = {
            "command": "python -m benchmarks.ports --out results/ports",
            "device": "cpu",
            "threads": 1,
            "date": "2026-11-29",
            "git_commit": "0123456789abcdef",
            "git_dirty": False,
            "versions": {"torch": "2.14.1"},
            "peer": {} if engine == "maml-toolkit" else {engine: "0.2.1"},
            "port": port,
            "engine": engine,
            "seed": seed,
            "iterations": 5,
            "train_seconds": 60.0 + seed,
            "iteration_cpu_seconds": 10.0,
            "tensor_peak_bytes": 2**20 * (1 + seed),
            "validation": {"accuracy": accuracy, "tasks": 96},
            "test": {"accuracy": accuracy - 0.1, "tasks": 96},
        }
        folder = tmp_path / port / f"{engine}-seed{seed}"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(run))

    for seed, accuracy in ((0, 0.8), (1, 0.9)):
        result("higher", "higher", seed, accuracy)
        result("higher", "maml-toolkit", seed, accuracy)
    lines = tables.ports(tmp_path).splitlines()
    assert (
        lines[2]
        == "| higher | maml-toolkit (the port) | 0, 1 | 5 | 85.0 +- 7.1 | 75.0 +- 7.1 | 60 +- 1 | 10.00 +- 0.00 | 2 MiB |"
    )
    assert lines[3].startswith("| higher | higher (its loop) | 0, 1 | 5 | 85.0 +- 7.1 |")
    assert lines[-1].endswith(
        "`python -m benchmarks.ports --out results/ports`; torch 2.14.1; device cpu, 1 thread a run; 2026-11-29; "
        "commit 0123456789 (taken at each run's end; its start was not recorded)."
    )
    assert "(tasks each: higher 96)" in lines[-1] and "own library (higher 0.2.1)" in lines[-1]
    assert tables.ports(tmp_path / "none") == "No run yet: `python -m benchmarks.ports --out results/ports`.\n"
