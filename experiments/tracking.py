"""wandb: the run's default mode (``$WANDB_MODE``, or whether the user is logged in), starting and finishing it.

Rank 0 alone logs to wandb; its files go under ``--out``. A run never waits for wandb: without a
server, a key or a network it logs offline, and says how to upload it later.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from experiments.config import RunOptions

__all__ = ["default_wandb_mode", "init_wandb", "finish_wandb"]


def default_wandb_mode() -> str:
    """$WANDB_MODE if set; online if the user is logged in; offline otherwise (never hangs without network)."""
    if os.environ.get("WANDB_MODE") in ("offline", "online", "disabled", "dryrun", "run"):
        return {"dryrun": "offline", "run": "online"}.get(os.environ["WANDB_MODE"], os.environ["WANDB_MODE"])
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


def init_wandb(opts: RunOptions, cfg: Any, name: str, run_id: str | None) -> Any:
    """Starts (or resumes) the wandb run, its files under ``--out``; never blocks without a network.

    A long run does not die at its start for its logging backend: ``--wandb online`` with no
    server to reach (a TCP connection tried for at most 5 s), no API key, or a server that
    refuses the key logs offline instead, with a warning that gives the ``wandb sync`` command
    that uploads the run later.
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
    problem, login = _unreachable(url), False
    if problem is None:
        try:
            return start(mode="online")
        except wandb.errors.Error as e:  # wandb's own retries have run out (init_timeout), or no usable key
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
            login = isinstance(e, (wandb.errors.UsageError, wandb.errors.AuthenticationError))
            problem = (f"no W&B API key ({detail})" if isinstance(e, wandb.errors.UsageError) else
                       f"the W&B server at {url} refused the API key ({detail})" if login else
                       f"cannot reach the W&B server at {url} ({detail})")  # fmt: skip
            wandb.teardown()
    run = start(mode="offline")
    print(f"warning: --wandb online: {problem}; logging offline instead. To upload the run later: "
          f"{'wandb login, then ' if login else ''}wandb sync {run.settings.sync_dir}", file=sys.stderr)  # fmt: skip
    return run


def _unreachable(url: str) -> str | None:
    """Why nothing answers at ``url`` (one TCP connection, at most 5 s); None if something does, or a proxy decides."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy connects, not this machine: leave it to wandb
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), timeout=5).close()
    except OSError as e:
        return f"cannot reach the W&B server at {url} ({e.strerror or e})"  # e.g. Connection refused, timed out
    return None


def finish_wandb(run: Any, exit_code: int | None = None) -> None:
    """Finishes the wandb run (marked failed for an ``exit_code`` other than 0 and None)."""
    import wandb

    run.finish(exit_code=exit_code)
    # finish() can return before the offline .wandb file is complete; teardown waits for it.
    wandb.teardown()
