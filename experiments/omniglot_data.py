"""The Omniglot data of experiments.omniglot: its characters split into train, validation and test, and their task samplers."""

from __future__ import annotations

from typing import Protocol

import tasks
from experiments.cli import UsageError


class SplitConfig(Protocol):
    """What the split and its samplers read of a config (``experiments.omniglot.OmniglotConfig`` and ``experiments.images.ImagesConfig`` have it)."""

    data: str | None
    rotations: str
    split_by: str
    split_fractions: tuple[float, ...]
    split_seed: int
    ways: int
    shots: int
    query: int | None
    train_shots: int | None

    @property
    def train_shots_flag(self) -> str: ...


__all__ = ["ROTATED", "SPLITS", "Data", "SplitConfig", "load", "notes", "shares", "make_splits"]

ROTATED = {"all": True, "train": (True, False, False), "none": False}  # --rotations: which of train, val, test
SPLITS = ("train", "validation", "test")

# What load gives the other hooks: the split characters, and the train, validation and test samplers (None: no characters).
Data = tuple[tasks.OmniglotSplits, list[tasks.FewShotSampler | None]]


def load(cfg: SplitConfig) -> Data:
    """The characters split into train, validation and test, and their task samplers (:func:`make_splits`)."""
    try:
        omni = tasks.Omniglot(cfg.data, rotations=cfg.rotations != "none")
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise UsageError(f"--data {cfg.data}: {e}") from None
    return make_splits(omni, cfg)


def notes(cfg: SplitConfig, data: Data) -> list[str]:
    """A line for each split that --split-fractions leaves without characters."""
    _, (_, val, test) = data
    return [
        f"note: --split-fractions {shares(cfg)} gives the {name} split no characters; the run "
        f"{'trains without validation' if name == 'validation' else 'skips the final test'}."
        for name, sampler in (("validation", val), ("test", test))
        if sampler is None
    ]


def shares(cfg: SplitConfig) -> str:
    """--split-fractions as it is written on the command line."""
    return ",".join(f"{f:g}" for f in cfg.split_fractions)


def make_splits(omni: tasks.Omniglot, cfg: SplitConfig) -> Data:
    """The train, validation and test parts and their task samplers (None for a part whose share is 0).

    Raises:
        UsageError: naming the flag, the split and the fix, when a share > 0 gets no character or a
            split cannot make the tasks that --ways, --shots and --query ask for.
    """
    by, given = cfg.split_by, shares(cfg)
    try:
        splits = omni.split(by, cfg.split_fractions, seed=cfg.split_seed, rotations=ROTATED[cfg.rotations])
    except ValueError as e:  # too few alphabets or archives for every share > 0
        reason = str(e).split("): ", 1)[-1]  # without the API call, which names no flag
        raise UsageError(f"--split-by {by} --split-fractions {given}: {reason}") from None
    samplers: list[tasks.FewShotSampler | None] = []
    for name, part, share in zip(SPLITS, splits, cfg.split_fractions, strict=True):
        if share == 0:
            samplers.append(None)
            continue
        if part.num_classes < cfg.ways:
            alphabets = f"{len(part.alphabets)} alphabet{'s' if len(part.alphabets) != 1 else ''}"
            classes = f"{len(part.characters)} characters of {alphabets}" + (
                ", 4 rotations each" if part.rotations else ""
            )
            finer = " or --split-by character" if by != "character" else ""
            raise UsageError(
                f"--ways {cfg.ways}: the {name} split holds only {part.num_classes} classes ({classes}; --split-by {by} "
                f"--split-fractions {given}); lower --ways to at most {part.num_classes}, or give the {name} split "
                f"more characters: a larger share in --split-fractions{finer}."
            )
        try:
            shots = cfg.train_shots if name == "train" else cfg.shots
            flag = cfg.train_shots_flag if name == "train" else "--shots"
            samplers.append(tasks.FewShotSampler(part.images, part.labels, cfg.ways, shots, cfg.query))
        except ValueError as e:  # fewer images per class than shots + query
            raise UsageError(f"{flag} {shots} --query {cfg.query}, the {name} split: {e}") from None
    return splits, samplers
