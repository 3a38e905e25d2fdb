"""Fixtures for every test."""

from __future__ import annotations

import functools
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


@pytest.fixture(autouse=True)
def _compile_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` with inductor only in the tests marked ``inductor``; the others with ``aot_eager``.

    From an empty compile cache (as on CI), inductor's C++ kernels take most of a compiled test's time:
    one compiler call per kernel, about 1.5 s each, half of the suite's time. The ``inductor`` tests
    (``tests/engine/test_compiled.py``) compare what users run with the eager engine and finite
    differences; the rest test what the compiled path traces (the step, its arguments, rules, shared
    modules): dynamo's graph and AOT autograd's, the same under ``aot_eager``, run by eager kernels.
    Processes a test starts (the scripts) compile with inductor.
    """
    if request.node.get_closest_marker("inductor") is None:
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


# The tests that start processes of their own (the scripts, the engine's process group, the wheel build)
# and those that compile with inductor take seconds to minutes each (from an empty compile cache): they run
# first, so that under pytest-xdist the short ones fill the cores around them at the end instead of one
# worker finishing a long test alone (the longest first balances the workers best).
_LONG_FIRST = (
    "tests/scripts/",
    "tests/tools/test_packaging.py",
    "tests/engine/test_compiled.py",
    "tests/engine/test_distributed_helpers.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(_LONG_FIRST))  # stable: the order within each part stays
