"""Start, or reuse, the local Prefect server the embedded default talks to.

Never Prefect's per-process ephemeral server: it costs 9-24 s per process and its scheduler
never runs, so deployment schedules would never fire. One ``prefect server start`` (SQLite, API
and UI on one port) keeps running after the demo and is reused by the next command.
"""

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from tasks.cluster.process import start
from tasks.errors import CkptopsError

QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "WARNING",
}


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_env(api_url: str, home: Path | None) -> dict[str, str]:
    env = dict(QUIET, PREFECT_API_URL=api_url)
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env


def start_server(
    api_url: str, home: Path, log: Path, timeout_seconds: float = 180.0, env: dict[str, str] | None = None
) -> subprocess.Popen | None:
    """Start ``prefect server start`` for ``api_url`` unless one already answers there.
    ``env``: the server's own settings (a PostgreSQL URL, an auth string).

    Returns the new process (the caller may leave it running), or None if one was reused.
    """
    if healthy(api_url):
        return None
    parts = urlsplit(api_url)
    if parts.hostname not in ("127.0.0.1", "localhost"):
        raise CkptopsError(f"{api_url}: no Prefect server answers, and ckptops only starts local ones")
    home.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **server_env(api_url, home), **(env or {})}
    env.pop("PREFECT_API_URL")  # the server itself must not act as a client of itself
    # The API the UI in the browser talks to: Prefect's default is port 4200 whatever port this
    # server listens on, so a second server's UI would show the first one's data.
    env.setdefault("PREFECT_UI_API_URL", api_url)
    # The links the server's automations put in notifications ({{ flow_run|ui_url }}).
    env.setdefault("PREFECT_UI_URL", api_url.rstrip("/").removesuffix("/api"))
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", parts.hostname]
    process = start(argv + ["--port", str(parts.port or 4200)], log, env, append=True)
    deadline = time.monotonic() + timeout_seconds
    while not healthy(api_url):
        if process.poll() is not None:
            raise CkptopsError(f"{log}: the Prefect server exited with code {process.returncode}")
        if time.monotonic() > deadline:
            process.kill()
            raise CkptopsError(f"{log}: the Prefect server did not answer within {timeout_seconds:.0f}s")
        time.sleep(0.5)
    return process
