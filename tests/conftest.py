"""Fixtures for every test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

# Under pytest-xdist (-n N) the workers share the cores: each gets its share of torch's threads, so that
# N workers of all-core thread pools do not oversubscribe the machine (several-fold slower on 2 cores).
# The scripts a test starts as processes get the same share (OMP_NUM_THREADS, which torch reads at start-up).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """Restores torch's thread count after a test: a script run in-process sets it (sine: one thread)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# The tests that start processes of their own (the scripts, the wheel build) take seconds to minutes each:
# they run first, so that under pytest-xdist the short ones fill the cores around them at the end instead
# of one worker finishing a long test alone (the longest first balances the workers best).
_LONG_FIRST = ("tests/scripts/", "tests/tools/test_packaging.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))  # stable: the order within each part stays
