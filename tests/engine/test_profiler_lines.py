"""The planner's probes run torch's profiler, whose library writes lines to the process's stderr that the user never
asked for: they are dropped, in either form this torch build or another prints, and nothing else is."""

from __future__ import annotations

import pytest

from maml._src.planner import _PROFILER_LINE


@pytest.mark.parametrize(
    "line",
    [
        "[W1129 06:19:49.866079836 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the "
        "profiling started, profiler results will not include the deallocation event",
        "[W1129 06:19:49.866079836 18277 site-packages/torch/csrc/CPUAllocator.cpp:245] Memory block of unknown size "
        "was allocated before the profiling started",
        "USDT:1129 06:19:49 1:2 SyncActivityProfilerHandler.cpp:23] profiler_start",
    ],
    ids=["without-thread-id", "with-thread-id", "kineto"],
)
def test_the_profilers_own_lines_are_dropped(line):
    assert _PROFILER_LINE.search(line)


@pytest.mark.parametrize(
    "line", ["[W1129 06:19:49.866 other.cpp:2] a warning of the user's code", "UserWarning: Memory block of unknown"]
)
def test_other_lines_are_kept(line):
    assert not _PROFILER_LINE.search(line)
