"""Shared fixtures: real checkpoints from the local training job, and a real Prefect server.

The training job runs once per session (six checkpoints, about 15 s on two cores); each test
that breaks or promotes something works on its own copy.
"""

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest

from infra.local_job.launch import run_local_job
from tasks.checkpoint.state import VerifyOptions

ROOT = Path(__file__).resolve().parent.parent
ITERATIONS = [4, 8, 12, 16, 20, 24]


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A save directory with six real torch_dist checkpoints (iterations 4..24, with Megatron's
    integrity.json), written by the local tiny Megatron-Core job on two CPU ranks."""
    save = tmp_path_factory.mktemp("job") / "checkpoints"
    run_local_job(save, train_iters=24, save_interval=4, timeout_seconds=900, extra=["--verify-integrity"])
    return save


@pytest.fixture
def save_dir(trained, tmp_path) -> Path:
    """A private copy of the trained save directory (mtimes kept) to break, verify and promote."""
    dest = tmp_path / "checkpoints"
    shutil.copytree(trained, dest)
    return dest


@pytest.fixture
def options() -> VerifyOptions:
    return VerifyOptions(job="test", megatron_core_version="0.19.2")


def iter_dir(save_dir: Path, iteration: int) -> Path:
    return save_dir / f"iter_{iteration:07d}"


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit the way bit rot does: the content changes, the file's times do not."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real ``prefect server start`` (SQLite) on a free loopback port, for the whole session."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from tasks.prefect_server import start_server

    home = tmp_path_factory.mktemp("prefect-home")
    url = f"http://127.0.0.1:{free_port()}/api"
    process = start_server(url, home, home / "server.log", timeout_seconds=300)
    # Both: the settings context for this thread, the environment for threads and subprocesses.
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    os.environ.update(PREFECT_API_URL=url, PREFECT_HOME=str(home))
    try:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_HOME: str(home)}):
            yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except Exception:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
