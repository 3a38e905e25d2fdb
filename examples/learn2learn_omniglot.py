"""learn2learn's examples/vision/maml_omniglot.py, written with maml-toolkit.

    python -m examples.learn2learn_omniglot --data DIR --iterations 1000   # DIR: the Omniglot archives ($OMNIGLOT_DIR)

The same network (learn2learn's ``OmniglotFC``: four Linear-BatchNorm-ReLU blocks of 256, 128, 64 and 64 units, a
linear head), and the same MAML: 5-way 1-shot with one query image a class (its ``train_samples=2*shots``), one
inner step at lr 0.5, second order, 32 tasks a meta-batch, Adam at lr 0.003, seed 42. learn2learn backpropagates
each task's query loss and then divides the gradients by the meta-batch: the mean over tasks, the toolkit's
meta-loss. Its ``BatchNorm1d`` keeps no running statistics (``track_running_stats=False``), as the toolkit asks.
The data are the toolkit's: the characters under DIR split by alphabet, the training ones in 4 rotations.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import maml
import tasks

WAYS, SHOTS, QUERY, TASKS = 5, 1, 1, 32
INNER_LR, STEPS, META_LR, SEED, ITERATIONS = 0.5, 1, 0.003, 42, 60000


def network(ways: int = WAYS) -> nn.Sequential:
    """``l2l.vision.models.OmniglotFC(28 ** 2, ways)``: truncated normal weights (std 0.01, cut at 2 std), zero biases."""
    sizes, layers = [28 * 28, 256, 128, 64, 64], [nn.Flatten()]
    for n_in, n_out in zip(sizes, sizes[1:]):
        norm = nn.BatchNorm1d(n_out, momentum=0.999, eps=1e-3, track_running_stats=False)
        layers += [nn.Linear(n_in, n_out), norm, nn.ReLU()]
    layers.append(nn.Linear(sizes[-1], ways))
    for linear in (m for m in layers if isinstance(m, nn.Linear)):
        nn.init.trunc_normal_(linear.weight, std=0.01, a=-0.02, b=0.02)
        nn.init.zeros_(linear.bias)
    return nn.Sequential(*layers)


def meta_learner(net: nn.Module) -> maml.MetaLearner:
    """``l2l.algorithms.MAML(net, lr=0.5, first_order=False)`` with its ``clone()`` and ``adapt(loss)`` per task."""
    return maml.MetaLearner(net, F.cross_entropy, inner_lr=INNER_LR, steps=STEPS)


def samplers(data: str) -> list[tasks.FewShotSampler]:
    """Train, validation and test tasks, of disjoint alphabets."""
    splits = tasks.Omniglot(data).split("alphabet", (0.6, 0.15, 0.25), seed=0)
    return [part.sampler(WAYS, SHOTS, QUERY) for part in splits]


def accuracy(learner: maml.MetaLearner, sampler: tasks.FewShotSampler, n: int, device: str = "cpu") -> float:
    """The query accuracy after adaptation on ``n`` tasks, the same ones at every call."""
    g, hits = torch.Generator().manual_seed(1), []
    with torch.no_grad():  # evaluation: the same adaptation, no graph
        for start in range(0, n, TASKS):
            batch = sampler.sample(min(TASKS, n - start), g, device=device)
            hits.append((learner.run(batch).query_out.argmax(-1) == batch.query_y).flatten())
    return torch.cat(hits).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.environ.get("OMNIGLOT_DIR"), help="the archives (default: $OMNIGLOT_DIR)")
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice)")
    parser.add_argument("--eval-tasks", type=int, default=600, help="validation and test tasks")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.data is None:
        parser.error("no data: pass --data DIR (the Omniglot archives) or set $OMNIGLOT_DIR")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, validation, test = samplers(args.data)
    learner = meta_learner(network().to(args.device))
    opt = torch.optim.Adam(learner.parameters(), lr=META_LR)
    g = torch.Generator().manual_seed(args.seed)
    for iteration in range(1, args.iterations + 1):
        opt.zero_grad()
        loss = learner.backward(train.sample(TASKS, g, device=args.device))  # the meta-gradient in .grad
        opt.step()
        if iteration % 100 == 0 or iteration == args.iterations:
            print(f"iteration {iteration}: meta-loss {loss.item():.3f}")
    for name, sampler in (("validation", validation), ("test", test)):
        print(f"{name} accuracy: {100 * accuracy(learner, sampler, args.eval_tasks, args.device):.1f} %")


if __name__ == "__main__":
    main()
