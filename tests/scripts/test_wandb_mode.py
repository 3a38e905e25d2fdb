"""What the experiment scripts make of $WANDB_MODE (empty: unset; unknown: a one-line usage error, exit code 2,
before anything is written) and when they count a user as logged in to wandb (the default mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_SINE, exits, says

from experiments import sine
from experiments.harness.lifecycle import main
from experiments.harness.report import default_wandb_mode


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


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
    says(err, "WANDB_MODE 'offlne'", "offline, online, disabled", "set it to one of them", "unset it")
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
