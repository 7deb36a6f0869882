"""Launch the local training job with torchrun, with a timeout and clean-up of every child.

Megatron's failure modes on CPU hang rather than crash, and a dead rank leaves megatron's
writer Manager orphaned: every process the job started is killed when it ends, however it ended.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tasks.errors import CkptopsError

TRAIN = Path(__file__).with_name("train.py")


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(TRAIN), *args]


def job_env() -> dict[str, str]:
    # One thread per rank: two ranks on two cores, no oversubscription. Huge pages for torch's
    # large CPU tensors: on this project's VMs first-touch page faults ran at about 1.2 GB/s and
    # dominated loading (optimizer state is allocated, then filled); with them a 2.6 GB load
    # went from 7.9 s to 5.8 s.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "THP_MEM_ALLOC_ENABLE": "1"}


def start_local_job(save_dir: Path, *, nproc: int = 2, train_iters: int = 8, save_interval: int = 4,
                    log: Path | None = None, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    """Start training into ``save_dir`` in the background; pair with ``wait_local_job``."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    log = Path(log or save_dir.parent / f"{save_dir.name}-train.log")
    args = ["--save", str(save_dir), "--train-iters", str(train_iters), "--save-interval", str(save_interval), *extra]
    with open(log, "wb") as sink:
        process = subprocess.Popen(torchrun_command(nproc, args), stdout=sink, stderr=subprocess.STDOUT,
                                   env=job_env(), start_new_session=True)
    return process, log


class TimedOut(CkptopsError):
    """The command ran past its time limit (it and everything it started were killed)."""


def run_reaped(argv: list[str], log: Path, timeout_seconds: float, env: dict | None = None,
               what: str = "the command") -> None:
    """Run a command to its end with ``wait_local_job``'s guarantees: a time limit, and nothing
    it started left running afterwards."""
    with open(log, "wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wait_local_job(process, log, timeout_seconds, what)


def wait_local_job(process: subprocess.Popen, log: Path, timeout_seconds: float,
                   what: str = "local training job") -> None:
    """Wait for the job; then kill everything it started, and raise if it failed or timed out.

    torchrun starts each rank in a session of its own, and a rank's helpers (megatron's writer
    Manager) outlive it as orphans: the job's descendants are noted while it runs, and every one
    of them (and its process group) is killed at the end, so a failed run leaves nothing behind.
    """
    descendants: dict[int, int] = {}
    deadline = time.monotonic() + timeout_seconds
    code = None
    try:
        while code is None and time.monotonic() < deadline:
            _note_descendants(process.pid, descendants)
            try:
                code = process.wait(timeout=min(_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                continue
    finally:
        _kill_all(process, descendants)
    if code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
        if code is None:
            raise TimedOut(f"{log}: {what} timed out after {timeout_seconds:.0f}s: {tail}")
        raise CkptopsError(f"{log}: {what} exited {code}: {tail}")


def run_local_job(save_dir: Path, *, timeout_seconds: float = 600, **kwargs) -> Path:
    """Train and save into ``save_dir``; return the log path. Raises CkptopsError on failure."""
    process, log = start_local_job(save_dir, **kwargs)
    wait_local_job(process, log, timeout_seconds)
    return log


_POLL_SECONDS = 0.5


def _note_descendants(pid: int, seen: dict[int, int]) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                seen.setdefault(child.pid, os.getpgid(child.pid))
            except (ProcessLookupError, psutil.Error):
                continue
    except psutil.Error:
        pass


def _kill_all(process: subprocess.Popen, descendants: dict[int, int]) -> None:
    for group in {process.pid, *descendants.values()}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in descendants:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()
