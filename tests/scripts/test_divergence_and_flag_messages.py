"""What the experiment scripts say when a run diverges or its flags (or $WANDB_MODE) are wrong.

Each message is checked whole: the flag, the value and the fix, one line, and the exit code
(2 for a usage error; 1 for a divergence, which is no usage error). The runs are in-process and
tiny, with wandb disabled.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import omniglot_root
from torch import nn

import maml
from experiments import omniglot, sine
from experiments.harness.config import parse_args
from experiments.harness.divergence import Diverged, DivergenceWatch
from experiments.harness.lifecycle import main
from experiments.harness.report import default_wandb_mode

TINY_SINE = [
    "--compile",
    "false",
    "--hidden",
    "8",
    "--val-tasks",
    "4",
    "--eval-tasks",
    "4",
    "--eval-query",
    "10",
    "--meta-batch",
    "4",
    "--wandb",
    "disabled",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")  # Omniglot decoded once for the module


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MAML_CACHE_DIR", str(cache))


def exits(capsys: pytest.CaptureFixture[str], run, argv: list[str], code: int) -> str:
    """Runs a script in-process; returns its stderr, which must be one line, after checking the exit code."""
    with pytest.raises(SystemExit) as exit_:
        main(run, argv)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.rstrip("\n")


# ---------------------------------------------------------------------------- 1. divergence: inner or outer


def test_an_infinite_or_nan_rate_is_refused_at_parse_time(capsys, tmp_path):
    out = tmp_path / "run"
    for flag, value, fix in (
        ("--meta-lr", "inf", ", e.g. 0.001 (the default)"),
        ("--inner-lr", "nan", ", e.g. 0.001 (the default)"),
        ("--meta-lr", "1e39", " (in float32, the parameters' precision), e.g. 0.001 (the default)"),
    ):
        err = exits(capsys, sine.run, [flag, value, "--out", str(out), *TINY_SINE], 2)
        shown = f"{float(value):g}"
        assert err == f"error: {flag} {shown} must be a finite number > 0{fix}."
    assert not out.exists()


def test_outer_divergence_names_the_meta_iteration_and_the_meta_lr(capsys, tmp_path):
    # Adam's first step moves every weight by about the rate: 1e30 makes the next forward pass NaN.
    out = tmp_path / "run"
    argv = ["--meta-lr", "1e30", "--iterations", "5", "--checkpoint-every", "1", "--out", str(out), *TINY_SINE]
    err = exits(capsys, sine.run, argv, 1)
    assert err == (
        "error: the outer loop diverged by meta-iteration 2: the meta-parameters are finite, but their own support "
        f"loss (before any inner step) is nan for task 0; lower --meta-lr 1e+30. The run stopped; {out / 'checkpoint.pt'} "
        "keeps meta-iteration 1."
    )
    # The iteration that diverged was not checkpointed: the checkpoint holds the finite weights before it.
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["iteration"] == 1 and all(bool(torch.isfinite(v).all()) for v in state["learner"]["model"].values())
    assert not (out / "results.json").exists()


def tiny_learner(
    steps: int, inner_lr: float
) -> tuple[nn.Module, maml.MetaLearner, torch.optim.Optimizer, maml.TaskBatch]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=inner_lr, steps=steps)
    g = torch.Generator().manual_seed(0)
    return (
        model,
        learner,
        torch.optim.Adam(learner.parameters(), lr=0.001),
        maml.TaskBatch(*(torch.randn(3, 5, 1, generator=g) for _ in range(4))),
    )


def meta_step(
    watch: DivergenceWatch, learner: maml.MetaLearner, optimizer: torch.optim.Optimizer, batch: maml.TaskBatch
) -> None:
    """A training iteration as the trainer runs it, with the watch's checks."""
    optimizer.zero_grad()
    try:
        out = learner.run(batch)
    except FloatingPointError:  # the engine's check
        raise watch.diverged(batch) from None
    watch.record(out)
    out.loss.backward()
    optimizer.step()
    watch.check_step(optimizer)


@pytest.mark.parametrize("steps", [1, 2], ids=["query-loss", "support-loss"])
def test_meta_parameters_that_ran_away_blame_the_outer_loop_though_an_inner_loss_overflows(tmp_path, steps):
    # Meta-parameters 1e5 times too large (what too high a --meta-lr does over many iterations) have a
    # finite loss of their own, and one inner step on it overflows: the outer loop is the cause.
    model, learner, optimizer, batch = tiny_learner(steps, inner_lr=0.01)
    watch = DivergenceWatch(learner, 0, 0.001, 0.01)
    meta_step(watch, learner, optimizer, batch)  # a good iteration: the own loss the run started from
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e5)
    with pytest.raises(Diverged) as diverged:  # steps=2: the engine's check; steps=1: the step after
        meta_step(watch, learner, optimizer, batch)
    loss = "query" if steps == 1 else "support"
    assert str(diverged.value) == (
        "the outer loop diverged by meta-iteration 2: its updates raised the meta-parameters' own loss (before any "
        f"inner step) from 0.8196 to 8.822e+18, and from there the {loss} loss of task 0 is inf after 1 inner step; "
        "lower --meta-lr 0.001"
    )
    assert watch.iteration == 1


def test_the_same_overflow_from_meta_parameters_that_did_not_run_away_blames_the_inner_lr(tmp_path):
    _, learner, optimizer, batch = tiny_learner(3, inner_lr=1e4)
    watch = DivergenceWatch(learner, 4, 0.001, 1e4)
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    assert str(diverged.value) == (
        "the inner loop diverged at meta-iteration 5: the support loss of task 0 is inf after 2 inner steps, from a "
        "support loss of 0.8193 at the meta-parameters; lower --inner-lr 10000"
    )


def test_inner_divergence_names_the_inner_lr(capsys, tmp_path):
    out = tmp_path / "run"
    err = exits(
        capsys, sine.run, ["--inner-lr", "100", "--steps", "3", "--iterations", "5", "--out", str(out), *TINY_SINE], 1
    )
    assert re.fullmatch(
        r"error: the inner loop diverged at meta-iteration [1-5]: the (support|query) loss of task \d is (inf|nan) after "
        r"[1-3] inner steps?, from a support loss of [0-9.]+ at the meta-parameters; lower --inner-lr 100\. "
        r"The run stopped; no checkpoint was written\.",
        err,
    ), err


class Blowup(torch.optim.Optimizer):
    """SGD whose step leaves the first weight infinite (a finite gradient), or, with ``nan_grad``, is given a NaN gradient."""

    nan_grad = False

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        first = group["params"][0]
        if self.nan_grad:
            first.grad.fill_(math.nan)
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])
        first.fill_(math.inf)


@pytest.mark.parametrize("nan_grad", [False, True], ids=["finite-gradient", "nan-gradient"])
def test_an_optimizer_step_that_makes_a_weight_nan_is_caught_before_the_checkpoint(tmp_path, nan_grad):
    model = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.01)
    optimizer = Blowup(learner.parameters(), lr=0.1)
    optimizer.nan_grad = nan_grad
    watch = DivergenceWatch(learner, 7, 0.1, 0.01)
    batch = maml.TaskBatch(*(torch.randn(2, 5, 1, generator=torch.Generator().manual_seed(i)) for i in range(4)))
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    if nan_grad:  # finite losses, a NaN meta-gradient, meta-parameters that have not run away: the inner loop
        assert str(diverged.value) == (
            "the inner loop diverged at meta-iteration 8: the meta-gradient through its inner steps is NaN/Inf though "
            "its losses are finite (the second-order terms overflowed); lower --inner-lr 0.01"
        )
    else:
        assert str(diverged.value) == (
            "the outer loop diverged at meta-iteration 8: its optimizer step with --meta-lr 0.1 made 0.weight NaN/Inf "
            "from a finite meta-gradient; lower --meta-lr"
        )
    assert watch.iteration == 7  # the trainer checkpoints after the step: it never gets there


# ---------------------------------------------------------------------------- 2. the sine test table


def test_the_sine_table_keeps_its_columns_for_diverged_values():
    cfg = sine.SineConfig(eval_tasks=600, eval_shots=(5, 10), eval_steps=(1, 10))
    values = {
        (5, 1): (0.2974, 0.0312),
        (5, 10): (3411432.206, 2087494.9668689),
        (10, 1): (math.nan, math.nan),
        (10, 10): (1.5e-5, math.inf),
    }
    results = {
        f"{k}shot_{s}step": {"mse": m, "ci95": c, "shots": k, "steps": s, "diverged_tasks": int(m > 1e6)}
        for (k, s), (m, c) in values.items()
    }
    assert sine._table(results, cfg) == "\n".join(
        [
            "test MSE on 600 tasks (mean +- 95% CI)",
            "K                    1 step               10 steps",
            "5        0.297 +-     0.031  3.41e+06 +-  2.09e+06",
            "10         nan +-       nan   1.5e-05 +-       inf",
            "tasks whose inner loop diverged (infinite or NaN loss): K=5 10 steps: 1",
        ]
    )


# ---------------------------------------------------------------------------- 3. which rate, which value


@pytest.mark.parametrize(
    ("run", "argv", "message"),
    [
        (sine.run, ["--inner-lr", "0"], "--inner-lr 0 must be a finite number > 0, e.g. 0.001 (the default)."),
        (sine.run, ["--meta-lr", "-0.5"], "--meta-lr -0.5 must be a finite number > 0, e.g. 0.001 (the default)."),
        (
            omniglot.run,
            ["--inner-lr", "nan"],
            "--inner-lr nan must be a finite number > 0; leave it out for the default.",
        ),
        (omniglot.run, ["--meta-lr", "0"], "--meta-lr 0 must be a finite number > 0, e.g. 0.001 (the default)."),
        (
            sine.run,
            ["--rate-meta-lr", "0"],
            "--rate-meta-lr 0 must be a finite number > 0; leave it out for the default.",
        ),
        (sine.run, ["--steps", "-1"], "--steps -1 must be an integer >= 0."),
        (sine.run, ["--eval-steps", "1,-1"], "--eval-steps 1,-1: each must be an integer >= 0."),
        (sine.run, ["--eval-shots", "5,0"], "--eval-shots 5,0: each must be an integer >= 1."),
        (omniglot.run, ["--meta-batch", "0"], "--meta-batch 0 must be an integer >= 1."),
    ],
    ids=[
        "sine-inner-lr-0",
        "sine-meta-lr-negative",
        "omniglot-inner-lr-nan",
        "omniglot-meta-lr-0",
        "rate-meta-lr",
        "steps",
        "eval-steps",
        "eval-shots",
        "omniglot-meta-batch",
    ],
)
def test_a_bad_number_names_its_flag_and_value(capsys, tmp_path, run, argv, message):
    data = ["--data", "unused"] if run is omniglot.run else []  # the numbers are checked first
    err = exits(capsys, run, [*argv, "--out", str(tmp_path / "run"), *data], 2)
    assert err == f"error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_bad_rate_from_a_config_file_names_it_too(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner_lr: .nan\n")
    err = exits(capsys, sine.run, ["--config", str(config), "--out", str(tmp_path / "run")], 2)
    assert err == "error: --inner-lr nan must be a finite number > 0, e.g. 0.001 (the default)."


# ---------------------------------------------------------------------------- 4. --help and the flag spellings


def help_text(capsys, monkeypatch, cls, experiment) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # one column of boxes, whatever the terminal
    with pytest.raises(SystemExit) as exit_:
        parse_args(experiment, cls, ["--help"], "", lambda cfg: None)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def help_entries(text: str) -> dict[str, str]:
    """Each flag's --help entry (its lines joined), keyed by its first option string."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("\n\n", 1)[1].splitlines():  # after the usage paragraph
        line = line.replace("\u2502", " ").rstrip()  # tyro boxes each group, with these sides where stdout takes UTF-8
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith(" " * 10):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("experiment", ["sine", "omniglot"])
def test_help_shows_each_default_once_and_no_alias(capsys, monkeypatch, experiment):
    cls = {"sine": sine.SineConfig, "omniglot": omniglot.OmniglotConfig}[experiment]
    text = help_text(capsys, monkeypatch, cls, experiment)
    entries = help_entries(text)
    for field in cls.__dataclass_fields__.values():
        flag = "--" + field.name.replace("_", "-")
        entry = entries[flag]
        assert entry.count("(default") == 1, entry  # once: no "(default: X) (default: None)"
        assert entry.split()[0] == flag and not re.match(r"\s*--\S+ \S+, --", entry), entry  # no alias
    assert "--iterations-" not in text and "_" not in "".join(re.findall(r"--[\w-]+", text))
    assert "(default: None)" not in text
    assert entries["--iterations"].endswith(f"(default: {cls().iterations})")
    assert entries["--out"].endswith(f"output folder (default: runs/{experiment})")
    if experiment == "omniglot":
        assert entries["--data"].endswith("Omniglot archives or folders (default: $OMNIGLOT_DIR)")
        assert entries["--eval-steps"].endswith("(the reference tests with up to 10) (default: 1,3,5,10)")
        assert entries["--query"].endswith("(null: K, as the reference: 1 at 1-shot) (default: null)")


def test_flags_take_the_agents_underscores_and_kebab_case(capsys, tmp_path):
    argv = [
        "--inner_lr=0.05",
        "--meta_batch",
        "3",
        "--eval-shots=5,10",
        "--log_every=7",
        "--iterations",
        "9",
        "--out",
        str(tmp_path),
    ]
    cfg, _ = parse_args("sine", sine.SineConfig, argv, "", sine.validate_config)
    assert (cfg.inner_lr, cfg.meta_batch, cfg.eval_shots, cfg.log_every, cfg.iterations) == (0.05, 3, (5, 10), 7, 9)
    err = exits(capsys, sine.run, ["--iterations-", "5"], 2)
    assert err.startswith("error: unknown flag --iterations- (did you mean --iterations, ")  # no longer an alias
    err = exits(capsys, sine.run, ["--inner_rl=0.1"], 2)
    assert err.startswith("error: unknown flag --inner_rl (did you mean --inner-lr")


# ---------------------------------------------------------------------------- 5, 6. the Omniglot splits


def omniglot_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--data",
        str(omniglot_root()),
        "--iterations",
        "1",
        "--meta-batch",
        "1",
        "--filters",
        "4",
        "--query",
        "2",
        "--log-every",
        "1",
        "--val-every",
        "1",
        "--val-tasks",
        "2",
        "--eval-tasks",
        "2",
        "--eval-steps",
        "1",
        "--out",
        str(tmp_path / "run"),
        "--wandb",
        "disabled",
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--ways", "120"],  # every split in 4 rotations (the reference's): 26 validation characters are 104 classes
            "--ways 120: the validation split holds only 104 classes (26 characters of 1 alphabet, 4 rotations each; "
            "--split-by alphabet --split-fractions 0.6,0.15,0.25); lower --ways to at most 104, or give the validation "
            "split more characters: a larger share in --split-fractions or --split-by character.",
        ),
        (
            ["--split-fractions", "0.99,0.01,0"],
            "--split-by alphabet --split-fractions 0.99,0.01,0: there are only 8 alphabets (Balinese, Early_Aramaic, "
            "Greek, Japanese_(katakana), Korean, Latin, Sanskrit, Tagalog), too few to give the validation part any; set "
            "its fraction to 0 or split by a finer unit.",
        ),
        (
            ["--split-fractions", "0,0.5,0.5"],
            "--split-fractions 0,0.5,0.5 gives the train split no characters; meta-training needs a train share > 0, "
            "e.g. 0.6,0.15,0.25.",
        ),
        (
            ["--split-fractions", "0.5,0.6,0"],
            "--split-fractions 0.5,0.6,0 sums to 1.1; the three shares (train, validation, test) must sum to 1, e.g. "
            "0.6,0.15,0.25.",
        ),
        (
            ["--split-fractions", "0.5,0.5"],
            "--split-fractions 0.5,0.5 must be three shares >= 0 (train, validation, test) that sum to 1, e.g. "
            "0.6,0.15,0.25.",
        ),
    ],
    ids=["ways-on-validation", "too-few-alphabets", "no-train", "sum", "two-shares"],
)
def test_a_split_problem_names_the_flag_and_the_split(capsys, tmp_path, extra, message):
    err = exits(capsys, omniglot.run, omniglot_args(tmp_path, *extra), 2)
    assert err == f"error: {message}"
    assert not (tmp_path / "run").exists()


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("meta-train")]  # without the progress lines


def test_a_zero_test_share_trains_validates_and_skips_the_test(capsys, tmp_path):
    main(omniglot.run, omniglot_args(tmp_path, "--split-fractions", "0.75,0.25,0"))
    captured = capsys.readouterr()
    assert notes(captured.err) == [
        "note: --split-fractions 0.75,0.25,0 gives the test split no characters; the run skips the final test."
    ]
    assert captured.out == (
        f"no final test: --split-fractions 0.75,0.25,0 gives the test split no characters "
        f"(results.json has test: {{}}); the model is in {tmp_path / 'run' / 'checkpoint.pt'}.\n"
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["test"] == {}
    assert results["test_skipped"] == "--split-fractions 0.75,0.25,0 gives the test split no characters"
    assert results["data"]["characters"][2] == 0 and "val/accuracy" in results["final_val"]
    assert not (tmp_path / "run" / "task_grid.png").exists()


def test_a_zero_validation_share_trains_without_validation(capsys, tmp_path):
    main(omniglot.run, omniglot_args(tmp_path, "--split-fractions", "1,0,0"))
    captured = capsys.readouterr()
    assert notes(captured.err) == [
        "note: --split-fractions 1,0,0 gives the validation split no characters; the run trains without validation.",
        "note: --split-fractions 1,0,0 gives the test split no characters; the run skips the final test.",
    ]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["final_val"] == {} and results["test"] == {} and results["data"]["characters"] == [242, 0, 0]
    history = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["history"]
    assert len(history) == 1 and not any(key.startswith("val/") for key in history[0])


# ---------------------------------------------------------------------------- 7. $WANDB_MODE, and who is logged in


def test_an_empty_wandb_mode_is_unset(capsys, tmp_path, monkeypatch):
    # `WANDB_MODE= python -m experiments.sine`: wandb itself refuses "" (a pydantic traceback), whatever mode it is given.
    monkeypatch.setenv("WANDB_MODE", "")
    out = tmp_path / "run"
    main(sine.run, ["--iterations", "2", "--out", str(out), *TINY_SINE])
    assert "Traceback" not in capsys.readouterr().err
    assert (out / "results.json").is_file()


@pytest.mark.parametrize("flag", [[], ["--wandb", "disabled"]], ids=["default", "--wandb"])
def test_an_unknown_wandb_mode_is_a_usage_error_before_anything_is_written(capsys, tmp_path, monkeypatch, flag):
    monkeypatch.setenv("WANDB_MODE", "offlne")
    out = tmp_path / "run"
    argv = ["--iterations", "2", "--out", str(out), *TINY_SINE[:-2], *flag]  # TINY_SINE ends with --wandb disabled
    err = exits(capsys, sine.run, argv, 2)
    assert (
        err
        == "error: WANDB_MODE 'offlne' is not one of offline, online, disabled, dryrun, run, shared; set it to one of them, or unset it."
    )
    assert not out.exists()


def test_logged_in_means_a_key_for_the_host_of_the_wandb_server(tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example.org:8080\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(netrc))
    assert default_wandb_mode() == "offline"  # a key for another server than api.wandb.ai
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org:8080")  # a self-hosted server
    assert default_wandb_mode() == "online"
    netrc.write_text(
        "machine wandb.example.org:8080 login user password 0123456789abcdef\nmachine api.wandb.ai login user password\n"
    )
    monkeypatch.delenv("WANDB_BASE_URL")
    assert default_wandb_mode() == "offline"  # an entry without a key is no login
    netrc.write_text("# api.wandb.ai\nmachine api.wandb.ai login user password 0123456789abcdef\n")
    assert default_wandb_mode() == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert default_wandb_mode() == "offline"


# ---------------------------------------------------------------------------- Reptile's divergence: the inner loop's


@pytest.mark.parametrize(
    "meta_lr, own, fix",
    [
        (
            0.01,
            "8.817e+18",
            "the inner loop diverged by meta-iteration 2: the meta-steps raised the meta-parameters' own loss (before "
            "any inner step) from 0.8196 to {own}, and from there the support loss of task 0 is inf after 1 inner step; "
            "Reptile's meta-step at --meta-lr 0.01 (at most 1) only moves the meta-parameters towards the weights the "
            "inner steps adapt, so those ran away: lower --inner-lr 0.01 or --steps 2",
        ),
        (
            50.0,
            "1.459e+18",
            "the outer loop diverged by meta-iteration 2: the meta-steps raised the meta-parameters' own loss (before "
            "any inner step) from 0.8196 to {own}, and from there the support loss of task 0 is inf after 1 inner step; "
            "lower --meta-lr 50 to at most 1, where Reptile's meta-step stops at the adapted weights instead of "
            "overshooting them",
        ),
    ],
    ids=["interpolating", "overshooting"],
)
def test_reptile_meta_parameters_that_ran_away_blame_what_moved_them(meta_lr: float, own: str, fix: str) -> None:
    # Reptile's SGD step theta += meta_lr (phi - theta) stops between the meta-parameters and the adapted
    # weights at a meta-lr of at most 1: meta-parameters that ran away were led there by the inner loop, and
    # "lower --meta-lr" would send a user who already lowered it to lower it again. Above 1 the step
    # overshoots, and the fix is a meta-lr of at most 1, below the one passed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 1))
    learner = maml.MetaLearner(model, F.mse_loss, inner_lr=0.01, steps=2, mode="reptile")
    optimizer = torch.optim.SGD(learner.parameters(), lr=meta_lr)
    g = torch.Generator().manual_seed(0)
    batch = maml.TaskBatch(*(torch.randn(3, 5, 1, generator=g) for _ in range(4)))
    watch = DivergenceWatch(learner, 0, meta_lr, 0.01, reptile=True)
    meta_step(watch, learner, optimizer, batch)  # a good iteration: the own loss the run started from
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1e5)
    with pytest.raises(Diverged) as diverged:
        meta_step(watch, learner, optimizer, batch)
    assert str(diverged.value) == fix.format(own=own)


def test_a_reptile_run_that_diverges_names_the_inner_lr_not_the_meta_lr_it_lowered(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["--algorithm", "reptile", "--inner-lr", "5", "--meta-lr", "0.01", "--iterations", "50", "--out", str(out)]
    err = exits(capsys, sine.run, [*argv, *TINY_SINE], 1)
    assert re.fullmatch(
        r"error: the inner loop diverged by meta-iteration \d+: the meta-steps raised the meta-parameters' own loss "
        r"\(before any inner step\) from [0-9.e+]+ to [0-9.e+]+, and from there the (support|query) loss of task \d "
        r"is (inf|nan) after [1-5] inner steps?; Reptile's meta-step at --meta-lr 0\.01 \(at most 1\) only moves the "
        r"meta-parameters towards the weights the inner steps adapt, so those ran away: lower --inner-lr 5 or "
        r"--steps 5\. The run stopped; .*",
        err,
    ), err
    assert "lower --meta-lr" not in err
