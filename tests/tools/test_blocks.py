"""``benchmarks/blocks.c``, the exact count the memory budgets are held to, on allocation patterns whose answer is known.

Each runs in a process started with the wrapper preloaded (``benchmarks.blocks.preloaded_env``): two
blocks alive at once; garbage freed during the call (it lowers nothing); a parameter's backward
(its product and its gradient, which a Python dispatch mode would count as three); a convolution's
own buffers, which no operator returns; and the engine's profiler measure agreeing to the byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.blocks import CountUnavailable, counting, peak_block_bytes, preloaded_env

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    from benchmarks.blocks import peak_block_bytes
    from maml._src.planner import measure

    M, cpu = 2**20, torch.device("cpu")
    out = {}

    def two():
        a = torch.empty(M, dtype=torch.uint8)
        b = torch.empty(2 * M, dtype=torch.uint8)

    out["two"] = peak_block_bytes(two)
    garbage = [torch.empty(8 * M, dtype=torch.uint8)]

    def collect():
        garbage.clear()
        x = torch.empty(16 * M, dtype=torch.uint8)

    out["garbage"] = peak_block_bytes(collect)
    p = torch.zeros(M, dtype=torch.float64, requires_grad=True)
    out["backward"] = peak_block_bytes(lambda: (p * p).sum().backward())
    w, x = torch.randn(16, 16, 3, 3, dtype=torch.float64), torch.randn(8, 16, 32, 32, dtype=torch.float64)
    out["conv"] = peak_block_bytes(lambda: F.conv2d(x, w, padding=1))
    out["conv_output"] = 8 * 16 * 32 * 32 * 8

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 5))
    net = net.double()
    images, labels = torch.randn(10, 1, 16, 16, dtype=torch.float64), torch.arange(10) % 5

    def step():
        params = dict(net.named_parameters())
        loss = F.cross_entropy(torch.func.functional_call(net, params, (images,)), labels)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        fast = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
        F.cross_entropy(torch.func.functional_call(net, fast, (images,)), labels).backward()

    step()
    out["step_blocks"] = peak_block_bytes(step)
    out["step_profiler"] = measure(step, cpu).peak
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def counted() -> dict[str, int]:
    child = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, env=preloaded_env(), check=True, capture_output=True, text=True
    )
    return json.loads(child.stdout)


def test_blocks_alive_at_once_are_counted_at_their_requested_size(counted):
    assert counted["two"] == 3 * MiB


def test_garbage_freed_during_the_call_lowers_nothing(counted):
    assert counted["garbage"] == 16 * MiB


def test_a_backward_holds_its_product_and_gradient_not_a_third_copy(counted):
    assert 16 * MiB <= counted["backward"] < 16 * MiB + 1024  # and a few scalars


def test_a_kernels_own_buffers_are_counted(counted):
    assert counted["conv"] > counted["conv_output"]  # the columns of the unfolded input


def test_the_engines_profiler_measure_agrees_to_the_byte_on_a_second_order_step(counted):
    assert counted["step_profiler"] == counted["step_blocks"] > 0


def test_a_process_without_the_library_is_told_how_to_start_one():
    assert not counting()
    with pytest.raises(CountUnavailable, match="LD_PRELOAD"):
        peak_block_bytes(lambda: None)
