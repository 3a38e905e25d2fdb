"""higher's examples/maml-omniglot.py, written with maml-toolkit.

    python -m examples.higher_omniglot --data DIR --iterations 1000   # DIR: the Omniglot archives ($OMNIGLOT_DIR)

The same network (three 64-channel 3x3 convolutions, each with BatchNorm, ReLU and 2x2 max-pool, then a linear
head) and the same MAML: 5-way 5-shot with 15 query images a class, 5 inner steps of SGD at lr 0.1 through
``innerloop_ctx(net, inner_opt, copy_initial_weights=False)``, second order, 32 tasks a meta-batch, Adam at lr
1e-3, seed 1, 100 epochs of 37 meta-batches. Two differences, neither of which changes what is learnt:

- higher calls ``qry_loss.backward()`` per task, so its gradient is the SUM over the 32 tasks, 32 times the
  toolkit's mean; Adam's step does not change with that scale (but for its eps, 1e-8), so the lr is the same.
- higher's ``BatchNorm2d(64, momentum=1)`` tracks running statistics, which the toolkit refuses in training mode
  (each task's fast weights would write them). In training mode the layer normalises with the batch's statistics
  whether or not it tracks them, and higher's test also runs in training mode: ``track_running_stats=False`` is
  the same function.

The data are the toolkit's: the characters under DIR split by alphabet, no rotations (higher's loader has none).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import maml
import tasks

WAYS, SHOTS, QUERY, TASKS = 5, 5, 15, 32
INNER_LR, STEPS, META_LR, SEED, ITERATIONS = 0.1, 5, 1e-3, 1, 100 * (1200 // 32)


def network(ways: int = WAYS) -> nn.Sequential:
    """higher's net: ``nn.BatchNorm2d(64, momentum=1, affine=True)`` there, without running statistics here."""
    layers: list[nn.Module] = []
    for n_in in (1, 64, 64):
        norm = nn.BatchNorm2d(64, momentum=1, affine=True, track_running_stats=False)
        layers += [nn.Conv2d(n_in, 64, 3), norm, nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64, ways))


def meta_learner(net: nn.Module) -> maml.MetaLearner:
    """``inner_opt = torch.optim.SGD(net.parameters(), lr=1e-1)``, 5 ``diffopt.step(spt_loss)`` per task."""
    return maml.MetaLearner(net, F.cross_entropy, inner_lr=INNER_LR, steps=STEPS, inner_optimizer="sgd")


def samplers(data: str) -> list[tasks.FewShotSampler]:
    """Train, validation and test tasks, of disjoint alphabets."""
    splits = tasks.Omniglot(data, rotations=False).split("alphabet", (0.6, 0.15, 0.25), seed=0)
    return [part.sampler(WAYS, SHOTS, QUERY) for part in splits]


def accuracy(learner: maml.MetaLearner, sampler: tasks.FewShotSampler, n: int, device: str = "cpu") -> float:
    """The query accuracy after adaptation on ``n`` tasks, the same ones at every call (higher's test, in training
    mode, with ``track_higher_grads=False``)."""
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
    meta_opt = torch.optim.Adam(learner.parameters(), lr=META_LR)
    g = torch.Generator().manual_seed(args.seed)
    for iteration in range(1, args.iterations + 1):
        meta_opt.zero_grad()
        loss = learner.backward(train.sample(TASKS, g, device=args.device))  # the meta-gradient in .grad
        meta_opt.step()
        if iteration % 10 == 0 or iteration == args.iterations:
            print(f"iteration {iteration}: meta-loss {loss.item():.3f}")
    for name, sampler in (("validation", validation), ("test", test)):
        print(f"{name} accuracy: {100 * accuracy(learner, sampler, args.eval_tasks, args.device):.1f} %")


if __name__ == "__main__":
    main()
