"""Fixtures for every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """Restores torch's thread count after a test: a script run in-process sets it (sine: one thread)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
