"""wandb: the run's mode (``--wandb``, ``$WANDB_MODE``, or whether the user is logged in), starting and finishing it.

Rank 0 alone logs, under ``--out``; without a server, a key or a network it logs offline, and says how to upload.
"""

from __future__ import annotations

import dataclasses
import functools
import netrc
import os
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from experiments.cli import UsageError
from experiments.run_options import RunOptions

__all__ = ["wandb_mode", "default_wandb_mode", "init_wandb", "finish_wandb"]

_MODES = ("offline", "online", "disabled")  # --wandb's choices
# $WANDB_MODE's other values that wandb accepts ("shared": several processes log one run; a script's run is one).
_OLD_NAMES = {"dryrun": "offline", "run": "online", "shared": "online"}


def wandb_mode(given: str | None) -> str:
    """The run's wandb mode: ``--wandb`` (``given``), else :func:`default_wandb_mode`.

    An empty ``$WANDB_MODE`` counts as unset, and is removed (wandb refuses it); UsageError for one that is no mode.
    """
    value = os.environ.get("WANDB_MODE")
    if value == "":
        del os.environ["WANDB_MODE"]
    elif value is not None and value not in (*_MODES, *_OLD_NAMES):
        raise UsageError(
            f"WANDB_MODE {value!r} is not one of {', '.join((*_MODES, *_OLD_NAMES))}; set it to one of them, or unset it."
        )
    return given or default_wandb_mode()


def default_wandb_mode() -> str:
    """$WANDB_MODE if set; online if the user is logged in; offline otherwise (never hangs without network).

    Logged in: ``$WANDB_API_KEY``, or a key in the netrc file (``$NETRC``, else ``~/.netrc``: ``wandb login``'s) for
    the host of ``$WANDB_BASE_URL`` (else https://api.wandb.ai).
    """
    mode = os.environ.get("WANDB_MODE")
    if mode in (*_MODES, *_OLD_NAMES):
        return _OLD_NAMES.get(mode, mode)  # type: ignore[arg-type]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entry = netrc.netrc(path).authenticators(host) if host else None
    except (OSError, netrc.NetrcParseError):
        return "offline"
    return "online" if entry and entry[2] else "offline"


def init_wandb(opts: RunOptions, cfg: Any, name: str, run_id: str | None) -> Any:
    """Starts (or resumes) the wandb run, its files under ``--out``; never blocks without a network.

    ``--wandb online`` with no server to reach (one TCP connection, at most 5 s), no API key, or a server that
    refuses the key logs offline instead, with a warning that gives the ``wandb sync`` command for later.
    """
    import wandb

    os.environ.setdefault("WANDB_DIR", str(opts.out))
    start = functools.partial(
        wandb.init,
        project=os.environ.get("WANDB_PROJECT", "maml-toolkit"),
        name=os.environ.get("WANDB_NAME", name),
        group=os.environ.get("WANDB_RUN_GROUP"),
        dir=str(opts.out),
        id=run_id,
        resume="allow" if run_id else None,
        config=dataclasses.asdict(cfg),
    )
    if opts.wandb != "online":
        return start(mode=opts.wandb)
    url = wandb.setup().settings.base_url
    parts = urllib.parse.urlsplit(url)
    problem, login = None, False
    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if not any(os.environ.get(v) for v in proxies):  # behind a proxy, the proxy connects: leave it to wandb
        try:
            address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
            socket.create_connection(address, timeout=5).close()
        except OSError as e:  # e.g. Connection refused, timed out
            problem = f"cannot reach the W&B server at {url} ({e.strerror or e})"
    if problem is None:
        try:
            return start(mode="online")
        except wandb.errors.Error as e:  # wandb's own retries have run out (init_timeout), or no usable key
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            login = isinstance(e, (wandb.errors.UsageError, wandb.errors.AuthenticationError))
            problem = (
                f"no W&B API key ({detail})"
                if isinstance(e, wandb.errors.UsageError)
                else f"the W&B server at {url} refused the API key ({detail})"
                if login
                else f"cannot reach the W&B server at {url} ({detail})"
            )
            wandb.teardown()
    run = start(mode="offline")
    print(
        f"warning: --wandb online: {problem}; logging offline instead. To upload the run later: "
        f"{'wandb login, then ' if login else ''}wandb sync {run.settings.sync_dir}",
        file=sys.stderr,
    )
    return run


def finish_wandb(run: Any, exit_code: int | None = None) -> None:
    """Finishes the wandb run (marked failed for an ``exit_code`` other than 0 and None)."""
    import wandb

    run.finish(exit_code=exit_code)
    wandb.teardown()  # finish() can return before the offline .wandb file is complete; teardown waits for it
