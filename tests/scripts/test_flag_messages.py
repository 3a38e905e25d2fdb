"""What the experiment scripts say when a flag's value is wrong (a bad number, from the command line or a
config file), how --help shows the flags, and which spellings they take.

Each message is checked for what it must hold: the flag and the value first, the fix, one line, and exit
code 2 (a usage error), with nothing written; its wording may change. The runs are in-process, with wandb disabled.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from helpers import exits

from experiments import omniglot, sine
from experiments.harness.config import parse_args


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


# ---------------------------------------------------------------------------- which rate, which value


@pytest.mark.parametrize(
    ("run", "argv", "named", "fix"),
    [
        (sine.run, ["--inner-lr", "0"], "--inner-lr 0", "> 0, e.g. 0.001 (the default)"),
        (sine.run, ["--meta-lr", "-0.5"], "--meta-lr -0.5", "> 0, e.g. 0.001 (the default)"),
        (omniglot.run, ["--inner-lr", "nan"], "--inner-lr nan", "leave it out for the default"),
        (omniglot.run, ["--meta-lr", "0"], "--meta-lr 0", "> 0, e.g. 0.001"),
        (sine.run, ["--rate-meta-lr", "0"], "--rate-meta-lr 0", "leave it out for the default"),
        (sine.run, ["--steps", "-1"], "--steps -1", "integer >= 0"),
        (sine.run, ["--eval-steps", "1,-1"], "--eval-steps 1,-1", "integer >= 0"),
        (sine.run, ["--eval-shots", "5,0"], "--eval-shots 5,0", "integer >= 1"),
        (omniglot.run, ["--meta-batch", "0"], "--meta-batch 0", "integer >= 1"),
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
def test_a_bad_number_names_its_flag_and_value(capsys, tmp_path, run, argv, named, fix):
    data = ["--data", "unused"] if run is omniglot.run else []  # the numbers are checked first
    err = exits(capsys, run, [*argv, "--out", str(tmp_path / "run"), *data], 2)
    assert err.startswith(f"error: {named}") and fix in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_bad_rate_from_a_config_file_names_it_too(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("inner_lr: .nan\n")
    err = exits(capsys, sine.run, ["--config", str(config), "--out", str(tmp_path / "run")], 2)
    assert err.startswith("error: --inner-lr nan ") and "> 0" in err and "\n" not in err, err


# ---------------------------------------------------------------------------- --help and the flag spellings


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
    for field in dataclasses.fields(cls):
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
