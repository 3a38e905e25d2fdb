"""A run folder belongs to one live process: two runs or two sweep runners on one folder,
a lock left by a dead process, a sweep runner killed with SIGKILL, a run that ended before its first
checkpoint, and the environment errors a new user met (an empty --out, --device meta, a config file
that is not UTF-8). Each shows the line a user sees, the exit code and the files left in --out.

The concurrency tests run two real processes: a long tiny sine run is the live one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, TINY, env, says, script

from experiments.harness.folder import lock_holder

LONG = [*TINY, "--wandb", "disabled", "--iterations", "1000000", "--checkpoint-every", "1000000"]


def wait_for(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def last_line(proc: subprocess.Popen, code: int) -> str:
    _, err = proc.communicate(timeout=300)
    proc.stderr_text = err  # for the assertions on the other lines
    assert proc.returncode == code, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err[-3000:]
    return lines[-1]


def test_a_second_run_in_a_live_runs_folder_is_refused_and_a_dead_runs_folder_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = script("experiments.sine", [*LONG, "--out", str(out)], tmp_path)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), "the first run to start")
        files, config = sorted(p.name for p in out.iterdir()), (out / "config.yaml").read_text()
        for extra in (["--overwrite", "--seed", "1"], ["--resume"], []):
            second = script("experiments.sine", [*TINY, "--wandb", "disabled", "--out", str(out), *extra], tmp_path)
            says(last_line(second, 2), f"--out {out.resolve()}", f"process {first.pid}", "pass another --out")
        # The second runs wrote nothing: the folder holds the first run's files alone, its config unchanged.
        assert sorted(p.name for p in out.iterdir()) == files and (out / "config.yaml").read_text() == config
        assert first.poll() is None
    finally:
        first.kill()  # SIGKILL: no handler runs, the kernel drops the lock
        first.communicate()
    third = script(
        "experiments.sine",
        [*TINY, "--wandb", "disabled", "--iterations", "3", "--out", str(out), "--overwrite"],
        tmp_path,
    )
    assert "error" not in last_line(third, 0)
    assert (out / "results.json").is_file()


def test_a_run_that_ended_before_its_first_checkpoint_starts_again_with_or_without_resume(tmp_path):
    for resume, said in (
        ([], "--out {out} holds this run, ended before its first checkpoint: starting it again"),
        (
            ["--resume"],
            "--resume: {out} holds no checkpoint, as its run ended before the first; starting it from the beginning",
        ),
    ):
        out = tmp_path / f"run{len(resume)}"
        args = [*TINY, "--wandb", "disabled", "--iterations", "400", "--checkpoint-every", "400", "--out", str(out)]
        first = script("experiments.sine", args, tmp_path)
        wait_for(lambda out=out: (out / "config.yaml").exists(), "the first run to start")
        first.kill()
        first.communicate()
        assert not (out / "checkpoint.pt").exists()
        again = script("experiments.sine", [*args, *resume], tmp_path)
        _, err = again.communicate(timeout=600)
        assert again.returncode == 0, err[-3000:]
        assert said.format(out=out) in err.splitlines()
        assert (out / "results.json").is_file() and (out / "checkpoint.pt").is_file()


def test_a_folder_with_only_another_configs_config_yaml_is_still_refused(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--wandb", "disabled", "--iterations", "400", "--checkpoint-every", "400", "--out", str(out)]
    first = script("experiments.sine", args, tmp_path)
    wait_for(lambda: (out / "config.yaml").exists(), "the first run to start")
    first.kill()
    first.communicate()
    config = (out / "config.yaml").read_text()
    second = script("experiments.sine", [*args, "--seed", "7"], tmp_path)
    says(last_line(second, 2), f"--out {out}", "config.yaml", "pass --overwrite", "another --out")
    assert (out / "config.yaml").read_text() == config


SWEEP = """\
name: long
program: experiments/sine.py
command:
  - ${env}
  - ${interpreter}
  - -m
  - experiments.sine
  - ${args}
method: grid
metric: {name: val/mse, goal: minimize}
parameters:
  seed: {values: [0, 1]}
  iterations: {value: 1000000}
  checkpoint-every: {value: 1000000}
  compile: {value: "false"}
  meta-batch: {value: 2}
  hidden: {value: 8}
  val-tasks: {value: 4}
  wandb: {value: disabled}
"""


def test_a_second_sweep_runner_is_refused_and_a_killed_runner_leaves_no_trial_running(tmp_path):
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    out = tmp_path / "sweep"
    runner = script("experiments.sweep", [str(tmp_path / "sweep.yaml"), "--out", str(out)], tmp_path)
    trial = out / "trial-001"
    try:
        wait_for(lambda: (trial / "metrics.jsonl").exists(), "the first trial to start", 300)
        second = script("experiments.sweep", [str(tmp_path / "sweep.yaml"), "--out", str(out), "--resume"], tmp_path)
        says(last_line(second, 2), f"--out {out.resolve()}", f"process {runner.pid}", "pass another --out")
        holder = lock_holder(trial.resolve())
        assert holder is not None and holder != runner.pid
    finally:
        runner.kill()  # SIGKILL: the runner cannot stop its trial itself
        runner.communicate()
    # The trial was told (SIGTERM when its parent died) and stops after its iteration, with a checkpoint.
    wait_for(lambda: not os.path.exists(f"/proc/{holder}") or _zombie(holder), "the orphaned trial to stop", 120)
    assert (trial / "checkpoint.pt").is_file()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize(
    "args, lead, fixes",
    [
        (["--out", ""], "--out", ("empty", "pass a folder")),
        (["--out="], "--out", ("empty", "pass a folder")),
        (["--device", "meta"], "--device meta", ("use --device cpu",)),
    ],
)
def test_an_empty_out_and_the_meta_device_are_one_line_and_write_nothing(tmp_path, args, lead, fixes):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.sine", "--wandb", "disabled", *args],
        cwd=tmp_path,
        env={**env(tmp_path), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    says(proc.stderr.strip().splitlines()[-1], lead, *fixes)
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache"] if (tmp_path / "cache").exists() else [])


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_bytes(b"iterations: 2\nhidden: \xff\n")
    out = tmp_path / "run"
    proc = script("experiments.sine", ["--config", str(config), "--out", str(out)], tmp_path)
    says(last_line(proc, 2), f"--config {config}", "byte 22", "save it as UTF-8")
    assert not out.exists()


def patched_run(tmp_path: Path, patch: str, args: list[str], **environ: str) -> subprocess.Popen:
    """``python -m experiments.sine ARGS`` with ``patch`` run at the child's start-up (a sitecustomize.py)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(patch)  # imported by Python at start-up
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.sine", *TINY, "--wandb", "disabled", *args],
        cwd=REPO,
        env={**env(tmp_path), "PYTHONPATH": f"{site}:{REPO}", **environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A job started in the background (nohup ... &, some CI runners) inherits SIGINT ignored, and
        # Python then installs no Ctrl-C handler: give the child a terminal's default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_training_or_in_the_final_evaluation_is_one_line_and_its_exit_code(tmp_path, sig, code):
    out = tmp_path / "run"
    # The stage made slow: wandb's start-up (before training) or the writing of results (after the test).
    patch = (
        "import os, time\n"
        "import experiments.harness.fit as fit\n"
        "name = {'start': 'init_wandb', 'final': 'finish'}[os.environ['SLOW_STAGE']]\n"
        "original = getattr(fit, name)\n"
        "def slow(*args, **kwargs):\n"
        "    open(os.environ['SLOW_MARK'], 'w').close()\n"
        "    time.sleep(60)\n"
        "    return original(*args, **kwargs)\n"
        "setattr(fit, name, slow)\n"
    )
    for stage, line in (
        ("start", "stopped during start-up, before training: nothing to resume; run the same command again."),
        (
            "final",
            f"stopped during the final evaluation; training is complete in {out}: the same command plus --resume "
            f"evaluates it.",
        ),
    ):
        mark = tmp_path / f"mark-{stage}"
        args = ["--iterations", "2", "--out", str(out), "--overwrite"]
        proc = patched_run(tmp_path, patch, args, SLOW_STAGE=stage, SLOW_MARK=str(mark))
        wait_for(mark.exists, f"the {stage} stage")
        proc.send_signal(sig)
        assert last_line(proc, code) == line
        if stage == "final":
            assert (out / "checkpoint.pt").is_file() and not (out / "results.json").exists()


# The stop's patience made 1 s; a mark file once training is in its first iteration (or the one named).
PATIENCE = (
    "import os, time\n"
    "import experiments.harness.lifecycle, experiments.harness.trainer as trainer\n"
    "experiments.harness.lifecycle.STOP_PATIENCE_S = 1.0\n"
    "original = trainer.Trainer._iteration\n"
    "def iteration(self, i, *args):\n"
    "    if i == int(os.environ.get('SLOW_ITERATION', 0)):\n"
    "        open(os.environ['SLOW_MARK'], 'w').close()\n"
    "        if 'SLOW_ITERATION' in os.environ:\n"
    "            time.sleep(600)\n"
    "    return original(self, i, *args)\n"
    "trainer.Trainer._iteration = iteration\n"
)


def test_one_ctrl_c_stops_an_inner_loop_of_the_most_steps_after_the_patience(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "mark"
    # 10,000 steps (the most --steps takes): seconds of inner loop, far longer than the patience.
    proc = patched_run(tmp_path, PATIENCE, ["--steps", "10000", "--out", str(out)], SLOW_MARK=str(mark))
    wait_for(mark.exists, "the first iteration")
    time.sleep(1)  # well inside its inner loop
    proc.send_signal(signal.SIGINT)
    # "at once": the patience ran out inside the iteration; a loop left to run to its end stops with another line.
    assert last_line(proc, 130) == (
        "stopped at once, before the first checkpoint: nothing to resume; run the same command again."
    )
    assert "stopping after this iteration (or at once: in 1 s, or at Ctrl-C again)" in proc.stderr_text
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_a_sigterm_in_an_iteration_that_outlasts_the_patience_keeps_the_last_checkpoint(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "mark"
    args = ["--iterations", "5", "--checkpoint-every", "1", "--out", str(out)]
    proc = patched_run(tmp_path, PATIENCE, args, SLOW_MARK=str(mark), SLOW_ITERATION="2")
    wait_for(mark.exists, "iteration 2")
    proc.send_signal(signal.SIGTERM)
    assert last_line(proc, 143) == (
        f"stopped at once; the last checkpoint in {out} is whole: the same command plus --resume goes on."
    )
    assert "stopping after this iteration (or at once: in 1 s, or at a second signal)" in proc.stderr_text
    assert torch.load(out / "checkpoint.pt", weights_only=False)["iteration"] == 2


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_script_imports_torch_is_one_line(tmp_path, sig, code):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.sine", *TINY, "--wandb", "disabled", "--out", str(out)],
        cwd=REPO,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.5)  # importing torch takes seconds: the signal lands in it
    proc.send_signal(sig)
    assert last_line(proc, code) == (
        "stopped during start-up, before training: nothing to resume; run the same command again."
    )
    assert not out.exists()
