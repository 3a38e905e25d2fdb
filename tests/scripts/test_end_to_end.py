"""The experiment scripts end to end: outputs, logged metrics, bit-identical resume, bad input."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_SINE, assert_logged, checkpoint, finished, omniglot_root, says, script

from experiments import omniglot, sine
from experiments.harness.config import parse_args
from experiments.harness.lifecycle import main
from experiments.harness.rundir import fingerprint

PNG = b"\x89PNG\r\n\x1a\n"


def test_sine_end_to_end(tmp_path):
    out = tmp_path / "sine"
    args = [
        "--iterations",
        "40",
        "--log-every",
        "10",
        "--val-every",
        "20",
        "--checkpoint-every",
        "20",
        "--out",
        str(out),
        "--wandb",
        "offline",
        *SMALL_SINE,
    ]
    printed = finished(script("experiments.sine", args, tmp_path))
    assert "test MSE on 20 tasks" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == "sine" and results["train_seconds"] > 0
    assert set(results["test"]) == {f"{k}shot_{s}step" for k in (5, 10, 20) for s in (1, 5, 10)}
    assert all(r["mse"] > 0 and r["ci95"] > 0 for r in results["test"].values())
    assert results["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
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
    args = [
        "--data",
        str(omniglot_root()),
        "--iterations",
        "4",
        "--meta-batch",
        "2",
        "--filters",
        "8",
        "--log-every",
        "2",
        "--val-every",
        "4",
        "--checkpoint-every",
        "2",
        "--val-tasks",
        "4",
        "--eval-tasks",
        "6",
        "--eval-chunk",
        "4",
        "--out",
        str(out),
        "--wandb",
        "offline",
    ]
    printed = finished(script("experiments.omniglot", args, tmp_path))
    assert "5-way 1-shot test accuracy on 6 tasks" in printed

    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == "omniglot"
    assert set(results["test"]) == set(results["test_best"]) == {"1step", "3step", "5step", "10step"}
    assert all(0 <= r["accuracy"] <= 1 and r["tasks"] == 6 for r in results["test"].values())
    # Model selection: the best validation's parameters in best.pt, tested on the same tasks as the last.
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["iteration"] == results["best_val"]["iteration"] in (2, 4)  # validated at 4 and (the last) 4
    assert best["validation"]["val/accuracy"] == results["best_val"]["val/accuracy"]
    # No path of this machine in the result file: the data by its folder's name, and its fingerprint.
    assert "/tmp" not in json.dumps(results) and str(tmp_path) not in json.dumps(results)
    assert results["config"]["data"] == omniglot_root().resolve().name
    assert results["data_files"]["data"]["fingerprint"] == fingerprint(str(omniglot_root()))
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
    # The cut run is signalled as soon as its first checkpoint (iteration 20) is written, long before its end.
    iterations = 400
    args = [
        "--iterations",
        str(iterations),
        "--checkpoint-every",
        "20",
        "--log-every",
        "20",
        "--val-every",
        "100",
        "--wandb",
        "disabled",
        *SMALL_SINE,
    ]
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
        main(run, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_unknown_flag_lists_close_matches(capsys, tmp_path):
    fails(
        capsys,
        sine.run,
        ["--inner-rl", "0.1", "--out", str(tmp_path)],
        "unknown flag --inner-rl (did you mean --inner-lr",
    )
    fails(capsys, sine.run, ["--iteration=5"], "unknown flag --iteration (did you mean --iterations")


def test_unknown_config_key_and_wrong_types(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner_rl: 0.1\n")
    fails(capsys, sine.run, ["--config", str(config)], "unknown key 'inner_rl' (did you mean inner_lr")
    config.write_text("iterations: ten\n")
    fails(capsys, sine.run, ["--config", str(config)], f"--config {config}: iterations 'ten' is not an integer.")
    config.write_text("eval_shots: 5\n")
    fails(
        capsys, sine.run, ["--config", str(config)], f"--config {config}: eval_shots must be a list (e.g. [5]), got 5."
    )
    fails(capsys, sine.run, ["--meta-batch", "2.5"], "error: --meta-batch '2.5' is not an integer.")
    fails(
        capsys,
        sine.run,
        ["--mode", "fomaml"],
        "error: --mode 'fomaml' is not one of second_order, first_order, checkpointed, reptile, implicit.",
    )
    fails(capsys, sine.run, ["--config", str(tmp_path / "nope.yaml")], "no such file")
    fails(
        capsys,
        sine.run,
        ["--compile", "true", "--mode", "checkpointed"],
        "--compile true with --mode checkpointed: only --mode second_order or first_order compiles; drop --compile",
    )


def test_config_file_and_flags_combine(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner-lr: 0.05\niterations: 7\neval_shots: [5]\n")
    cfg, flags = parse_args(
        "sine",
        sine.SineConfig,
        ["--config", str(config), "--iterations=9", "--out", str(tmp_path)],
        "",
        sine.validate_config,
    )
    assert (cfg.inner_lr, cfg.iterations, cfg.eval_shots, cfg.meta_batch) == (0.05, 9, (5,), 25)
    assert flags.out == tmp_path and flags.config == config
    _, flags = parse_args("sine", sine.SineConfig, [], "", sine.validate_config)
    assert flags.out == Path("runs") / "sine"


MAMLPP = {
    "steps": 5,
    "learn_inner_lr": "per_layer_per_step",
    "msl_fraction": 0.1,
    "first_order_fraction": 0.5,
    "meta_lr_schedule": "cosine",
    "min_meta_lr": 1e-5,
}


@pytest.mark.parametrize("module", [sine, omniglot], ids=["sine", "omniglot"])
def test_an_algorithm_sets_its_recipe_under_config_files_and_flags(capsys, tmp_path, module):
    cls = {sine: sine.SineConfig, omniglot: omniglot.OmniglotConfig}[module]
    defaults = vars(cls())

    def parse(*argv: str):
        return parse_args(module.__name__.rsplit(".", 1)[1], cls, list(argv), "", module.validate_config)[0]

    mamlpp = {
        **MAMLPP,
        **(
            {"inner_lr": 0.1, "meta_batch": 8, "loss": "mean", "per_step_bn": True}
            if module is omniglot
            else {"rate_meta_lr": 1e-4}
        ),
    }
    cfg = vars(parse("--algorithm", "mamlpp"))
    assert cfg == {**defaults, **mamlpp, "algorithm": "mamlpp", "compile": cfg["compile"]}  # those keys, no other
    assert parse("--algorithm", "fomaml").mode == "first_order"
    assert parse("--algorithm", "metasgd").learn_inner_lr == "per_parameter"
    assert parse("--algorithm", "anil").adapt == "head"
    assert parse("--algorithm", "mamlpp", "--steps", "3").steps == 3  # a flag overrides the recipe
    assert parse("--steps=3", "--algorithm=mamlpp").steps == 3  # before it too
    config = tmp_path / "c.yaml"
    config.write_text("steps: 2\nmeta-lr-schedule: constant\n")
    cfg = parse("--algorithm", "mamlpp", "--config", str(config))
    assert (cfg.steps, cfg.meta_lr_schedule, cfg.msl_fraction) == (2, "constant", 0.1)  # so does a config file
    assert (
        parse("--algorithm", "mamlpp", "--config", str(config), "--steps", "4").steps == 4
    )  # and a flag overrides both
    config.write_text("algorithm: mamlpp\n")
    assert parse("--config", str(config)).steps == 5  # a config file may choose the recipe
    assert parse("--config", str(config), "--algorithm", "maml").steps == defaults["steps"]  # and a flag overrides it
    config.write_text("algorithm: nope\n")
    for argv, where in (
        (["--algorithm", "nope"], "--algorithm"),
        (["--config", str(config)], f"--config {config}: algorithm"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main(module.run, argv)
        assert exit_.value.code == 2  # one line that names the choices
        says(capsys.readouterr().err, f"{where} 'nope'", "maml, fomaml, metasgd, anil, mamlpp, reptile, imaml")


def test_output_folder_holding_another_run_is_refused(capsys, tmp_path):
    (tmp_path / "config.yaml").write_text("keep me")
    (tmp_path / "checkpoint.pt").write_bytes(b"keep me too")
    fails(
        capsys,
        sine.run,
        ["--out", str(tmp_path)],
        f"--out {tmp_path} already holds a run (config.yaml, checkpoint.pt); pass --resume",
    )
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
    fails(
        capsys,
        omniglot.run,
        ["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)],
        f"--data {tmp_path / 'nowhere'}:",
    )
    assert not (tmp_path / "config.yaml").exists()


def test_meta_gradients_are_clipped_by_value_before_the_meta_step(tmp_path):
    """--clip-meta-grad c: one plain SGD meta-step of rate 1 moves each weight by its meta-gradient clamped to [-c, c]."""
    clip = 1e-5
    args = [*SMALL_SINE, "--iterations", "1", "--meta-optimizer", "sgd", "--meta-lr", "1", "--wandb", "disabled"]
    runs = {}
    for name, extra in (("plain", []), ("clipped", ["--clip-meta-grad", str(clip)])):
        sine.run([*args, *extra, "--out", str(tmp_path / name)])
        runs[name] = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["learner"]["model"]
    torch.manual_seed(0)
    start = sine.build_model(8).state_dict()
    steps = {k: runs["plain"][k] - p0 for k, p0 in start.items()}
    assert max(float(s.abs().max()) for s in steps.values()) > 10 * clip  # the clip binds
    for k, p0 in start.items():
        torch.testing.assert_close(runs["clipped"][k] - p0, steps[k].clamp(-clip, clip), rtol=0, atol=1e-9)
