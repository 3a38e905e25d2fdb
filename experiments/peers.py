"""learn2learn's MAML as the training engine of an experiment (``--engine learn2learn``): the tables' peer row.

Training runs ``learn2learn.algorithms.MAML`` as its users write it (a ``clone()`` per task, ``maml_update`` steps,
with None for the parameters the inner loop leaves alone: ``MAML.adapt`` would move them all); all else, the final
test included, stays the experiment's, so the row differs from ``--engine maml`` only by what the library computes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

import maml
from experiments.harness.cli import flag

__all__ = ["ENGINES", "Learn2LearnMAML", "unsupported"]

ENGINES = ("maml", "learn2learn")


def unsupported(cfg: Any) -> str | None:
    """Why ``cfg`` cannot train with learn2learn's MAML (a one-line message naming the flag), or None."""
    if cfg.mode not in ("second_order", "first_order"):
        return f"--engine learn2learn trains in second_order or first_order mode, not --mode {cfg.mode}"
    for key, default in (
        ("learn_inner_lr", None),
        ("inner_optimizer", "sgd"),
        ("inner_optimizer_options", None),
        ("meta_optimizer", "adam"),
        ("backward_chunk", None),
        ("msl_fraction", 0.0),
        ("first_order_fraction", 0.0),
        ("compile", False),
        ("inner_proximal", 0.0),
    ):
        if getattr(cfg, key) not in (default, None):
            return (
                f"--engine learn2learn runs learn2learn's MAML (plain SGD inner steps at a fixed rate, the last "
                f"step's loss), so {flag(key)} {getattr(cfg, key)} does not apply; drop it or use --engine maml"
            )
    return None


class Learn2LearnMAML:
    """A :class:`maml.MetaLearner` (``engine``, over the same model, loss, rate, steps and adapt set) whose
    training passes run learn2learn's MAML; evaluation (no gradients) and every other attribute are the engine's."""

    def __init__(self, engine: maml.MetaLearner) -> None:
        with warnings.catch_warnings():  # gym, which learn2learn imports, warns about itself
            warnings.simplefilter("ignore")
            import learn2learn as l2l
        self._l2l = l2l
        self.engine = engine
        self.maml = l2l.algorithms.MAML(engine.model, lr=engine.inner_lr, first_order=engine.mode == "first_order")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def run(
        self, batch: maml.TaskBatch, params: Any = None, steps: int | None = None, step_weights: Tensor | None = None
    ) -> maml.MetaOutput:
        if not torch.is_grad_enabled() or params is not None or step_weights is not None:
            return self.engine.run(batch, params, steps, step_weights)
        steps = self.engine.steps if steps is None else steps
        second_order = self.engine.mode == "second_order"
        adapted = set(self.engine.adapted)
        loss_fn, lr = self.engine.loss_fn, self.engine.inner_lr
        query_losses, query_out, support_losses, fast = [], [], [], []
        for t in range(batch.num_tasks):
            clone = self.maml.clone()
            names = [n for n, _ in clone.module.named_parameters()]  # the model's names (clone's have "module.")
            task_support = []
            for _ in range(steps):
                loss = loss_fn(clone(batch.support_x[t]), batch.support_y[t])
                params = [p for n, p in clone.module.named_parameters() if n in adapted]
                grads = iter(torch.autograd.grad(loss, params, create_graph=second_order))
                self._l2l.algorithms.maml_update(clone, lr, [next(grads) if n in adapted else None for n in names])
                task_support.append(loss.detach())
            out = clone(batch.query_x[t])
            query_losses.append(loss_fn(out, batch.query_y[t]))
            query_out.append(out.detach())
            support_losses.append(torch.stack(task_support) if task_support else out.new_zeros(0))
            fast.append({n: p.detach() for n, p in clone.module.named_parameters() if n in adapted})
        losses = torch.stack(query_losses)
        return maml.MetaOutput(
            loss=losses.mean(),
            query_losses=losses.detach(),
            query_out=torch.stack(query_out),
            support_losses=torch.stack(support_losses, 1),
            fast={n: torch.stack([f[n] for f in fast]) for n in self.engine.adapted},
        )
