"""Warm start for the test suite's Megatron and ckptops processes (see ``server.py``): the
session starts one server per flavor and puts ``startup/`` on PYTHONPATH, so that each such
process the tests launch (however they launch it) is forked from an interpreter that has already
imported torch and megatron or the libraries ckptops starts with. ``CKPTOPS_WARM=0`` runs the
suite without it: every process then starts cold."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tasks.cluster.process import start
from tests.helpers.poll import until

from .server import FLAVORS

STARTUP = Path(__file__).with_name("startup")


def start_servers(folder: Path) -> list[subprocess.Popen]:
    """Start a server per flavor in ``folder`` (their logs beside the sockets) and set this
    process's environment so that everything it launches from now on asks them."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "CKPTOPS_WARM_DIR")}
    servers = [
        start(
            [sys.executable, "-m", "tests.helpers.warm.server", flavor, str(folder / f"{flavor}.sock")],
            folder / f"{flavor}.log",
            env,
            cwd=Path(__file__).resolve().parents[3],
        )
        for flavor in FLAVORS
    ]
    for flavor in FLAVORS:
        until(lambda f=flavor: (folder / f"{f}.sock").exists(), 60, f"the warm {flavor} server listens")
    path = os.environ.get("PYTHONPATH")
    os.environ.update(
        CKPTOPS_WARM_DIR=str(folder),
        CKPTOPS_WARM_PREFIX=sys.prefix,
        CKPTOPS_WARM_MOUNTS=os.readlink("/proc/self/ns/mnt"),
        PYTHONPATH=f"{STARTUP}{os.pathsep}{path}" if path else str(STARTUP),
    )
    return servers


def stop_servers(servers: list[subprocess.Popen]) -> None:
    for server in servers:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
