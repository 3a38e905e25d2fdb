"""The experiment scripts end to end: outputs, logged metrics, bit-identical resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments import common, omniglot, sine
from experiments.wandb_runs import find_runs, read_run
from helpers import REPO, omniglot_root

PNG = b"\x89PNG\r\n\x1a\n"
SMALL_SINE = ["--compile", "false", "--hidden", "8", "--eval-tasks", "20", "--val-tasks", "10", "--eval-query", "20"]


def env(tmp_path: Path) -> dict[str, str]:
    """A subprocess environment that keeps wandb offline, local and fast."""
    return {
        **os.environ,
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # any stray network call fails at once
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_SILENT": "true",
        "MAML_CACHE_DIR": str(tmp_path / "cache"),
    }


def script(module: str, args: list[str], tmp_path: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def finished(proc: subprocess.Popen, code: int = 0) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err[-3000:]
    return out


def checkpoint(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)


def assert_logged(out: Path, history: list[dict], summary: dict[str, float]) -> None:
    """The offline wandb run under ``out`` holds exactly the rows the script kept, and the summary."""
    (run_dir,) = find_runs(out)
    run = read_run(run_dir)
    assert not run.problems
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run.history]
    assert logged == history
    for key, value in summary.items():
        assert run.summary[key] == pytest.approx(value, rel=1e-12)


def test_sine_end_to_end(tmp_path):
    out = tmp_path / "sine"
    args = ["--iterations", "40", "--log-every", "10", "--val-every", "20", "--checkpoint-every", "20",
            "--out", str(out), "--wandb", "offline", *SMALL_SINE]  # fmt: skip
    printed = finished(script("experiments.sine", args, tmp_path))
    assert "test MSE on 20 tasks" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == "sine" and results["train_seconds"] > 0
    assert set(results["test"]) == {f"{k}shot_{s}step" for k in (5, 10, 20) for s in (1, 5, 10)}
    assert all(r["mse"] > 0 and r["ci95"] > 0 for r in results["test"].values())
    assert results["versions"]["torch"] == torch.__version__.split("+")[0] or results["versions"]["torch"]
    assert len(results["git_commit"] or "") in (0, 40) and results["config"]["iterations"] == 40
    state = checkpoint(out)
    assert state["iteration"] == 40 and len(state["history"]) == 4
    assert "val/mse" in state["history"][1] and "train/support_loss_after" in state["history"][0]
    for png in ("learning_curves.png", "sine_fit.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert (out / "config.yaml").is_file()
    assert_logged(out, state["history"], {"test/mse_5shot_1step": results["test"]["5shot_1step"]["mse"]})


def test_omniglot_end_to_end(tmp_path):
    out = tmp_path / "omniglot"
    args = ["--data", str(omniglot_root()), "--iterations", "4", "--meta-batch", "2", "--filters", "8",
            "--log-every", "2", "--val-every", "4", "--checkpoint-every", "2", "--val-tasks", "4",
            "--eval-tasks", "6", "--eval-chunk", "4", "--out", str(out), "--wandb", "offline"]  # fmt: skip
    printed = finished(script("experiments.omniglot", args, tmp_path))
    assert "5-way 1-shot test accuracy on 6 tasks" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == "omniglot"
    assert set(results["test"]) == {"3step", "5step"}
    assert all(0 <= r["accuracy"] <= 1 and r["tasks"] == 6 for r in results["test"].values())
    chars = results["data"]["characters"]
    assert sum(chars) == 242 and min(chars) > 0
    train, val, test = map(set, results["data"]["alphabets"])
    assert not (train & val or train & test or val & test)  # held-out alphabets
    state = checkpoint(out)
    assert state["iteration"] == 4 and "train/accuracy" in state["history"][0]
    for png in ("learning_curves.png", "task_grid.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert_logged(out, state["history"], {"test/accuracy_3step": results["test"]["3step"]["accuracy"]})


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_then_resumed_run_is_bit_identical(tmp_path, how):
    iterations = 1500
    args = ["--iterations", str(iterations), "--checkpoint-every", "50", "--log-every", "50", "--val-every", "500",
            "--wandb", "disabled", *SMALL_SINE]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    reference = script("experiments.sine", [*args, "--out", str(whole)], tmp_path)

    proc = script("experiments.sine", [*args, "--out", str(cut)], tmp_path)
    deadline = time.monotonic() + 300
    while not (cut / "checkpoint.pt").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(how)
    proc.communicate(timeout=300)
    assert proc.returncode == {signal.SIGKILL: -signal.SIGKILL, signal.SIGINT: 130}[how]
    stopped_at = checkpoint(cut)["iteration"]
    assert 0 < stopped_at < iterations, "the run was not interrupted: raise `iterations`"

    finished(script("experiments.sine", [*args, "--out", str(cut), "--resume"], tmp_path))
    finished(reference)
    a, b = checkpoint(whole), checkpoint(cut)
    assert a["iteration"] == b["iteration"] == iterations
    for key, value in a["learner"]["model"].items():
        assert torch.equal(value, b["learner"]["model"][key]), key
    timeless = [[{k: v for k, v in row.items() if k != "train/step_time_ms"} for row in s["history"]] for s in (a, b)]
    assert timeless[0] == timeless[1]
    assert torch.equal(a["generator"], b["generator"])
    ra, rb = (json.loads((d / "results.json").read_text())["test"] for d in (whole, cut))
    assert ra == rb


# ---------------------------------------------------------------------------- bad input: exit 2, nothing lost


def fails(capsys, run, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        common.main(run, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_unknown_flag_lists_close_matches(capsys, tmp_path):
    fails(capsys, sine.run, ["--inner-rl", "0.1", "--out", str(tmp_path)], "unknown flag --inner-rl (did you mean --inner-lr")
    fails(capsys, sine.run, ["--iteration=5"], "unknown flag --iteration (did you mean --iterations")


def test_unknown_config_key_and_wrong_types(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner_rl: 0.1\n")
    fails(capsys, sine.run, ["--config", str(config)], "unknown key 'inner_rl' (did you mean inner_lr")
    config.write_text("iterations: ten\n")
    fails(capsys, sine.run, ["--config", str(config)], "iterations must be an int, got 'ten' (str)")
    config.write_text("eval_shots: 5\n")
    fails(capsys, sine.run, ["--config", str(config)], "eval_shots must be a non-empty list of an int, got 5")
    fails(capsys, sine.run, ["--meta-batch", "2.5"], "--meta-batch: meta_batch must be an int, got '2.5' (str)")
    fails(capsys, sine.run, ["--mode", "fomaml"], "mode='fomaml' is not one of 'second_order', 'first_order', 'checkpointed'")
    fails(capsys, sine.run, ["--config", str(tmp_path / "nope.yaml")], "no such file")
    fails(capsys, sine.run, ["--compile", "true", "--mode", "checkpointed"],
          "compile applies to mode second_order or first_order, not checkpointed; drop --compile or pick another --mode.")  # fmt: skip


def test_config_file_and_flags_combine(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner-lr: 0.05\niterations: 7\neval_shots: [5]\n")
    cfg, opts = common.parse_args("sine", sine.SineConfig, ["--config", str(config), "--iterations=9", "--out", str(tmp_path)],
                                  "", sine.validate_config)  # fmt: skip
    assert (cfg.inner_lr, cfg.iterations, cfg.eval_shots, cfg.meta_batch) == (0.05, 9, (5,), 25)
    assert opts.out == tmp_path and opts.config_file == config
    _, opts = common.parse_args("sine", sine.SineConfig, [], "", sine.validate_config)
    assert opts.out == Path("runs") / "sine"


def test_output_folder_holding_another_run_is_refused(capsys, tmp_path):
    (tmp_path / "config.yaml").write_text("keep me")
    (tmp_path / "checkpoint.pt").write_bytes(b"keep me too")
    fails(capsys, sine.run, ["--out", str(tmp_path)], f"--out {tmp_path} already holds a run (config.yaml, checkpoint.pt); pass --resume")
    assert (tmp_path / "config.yaml").read_text() == "keep me"
    fails(capsys, sine.run, ["--out", str(tmp_path), "--resume"], "is corrupt or not from this script")
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"keep me too"


def test_resume_without_a_checkpoint_or_with_another_config(capsys, tmp_path):
    fails(capsys, sine.run, ["--out", str(tmp_path / "empty"), "--resume"], "--resume: no checkpoint at")
    # (--iterations may change on resume: the meta-batch may not.)
    torch.save({"config": {**vars(sine.SineConfig()), "meta_batch": 5}}, tmp_path / "checkpoint.pt")
    fails(capsys, sine.run, ["--out", str(tmp_path), "--resume"], "--resume: the config differs from the run in")


def test_missing_data_path(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("OMNIGLOT_DIR", raising=False)
    fails(capsys, omniglot.run, ["--out", str(tmp_path)], "no data: pass --data PATH")
    fails(capsys, omniglot.run, ["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)], f"--data {tmp_path / 'nowhere'}:")
    assert not (tmp_path / "config.yaml").exists()
