"""The per-job lock: one verify-promote-retain run per save directory at a time.

An advisory ``flock`` on ``<save>/.ckptops.lock``. The kernel drops it when the holder dies, so a
crashed run never leaves the job locked. (On Lustre this needs the ``flock`` mount option; on NFS
v4 it maps to byte-range locks.) The file's content names the holder for the error message only.
It is opened by ``open_for_writing``: a link or a hard link planted at its name is refused in one
line, never written through (the holder's stamp would overwrite its target).
"""

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint.layout import LOCK
from tasks.errors import LockTimeout, UsageError
from tasks.storage.local import open_for_writing

_POLL_SECONDS = 0.1


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
    except ValueError:
        return "an unknown holder"


@dataclass(frozen=True)
class Held:
    """Proof that a lock is held (what ``job_lock`` yields): functions that must run under a
    save directory's lock take one."""

    save_dir: Path
    name: str

    def covers(self, directory: Path) -> bool:
        """Whether this is the job lock of the save directory ``directory`` is in."""
        return self.name == LOCK and Path(directory).parent.resolve() == Path(self.save_dir).resolve()


@contextmanager
def job_lock(save_dir: Path, timeout_seconds: float, name: str = LOCK):
    """Hold the save directory's lock (or another lock file ``name`` in it) and yield ``Held``;
    raise LockTimeout naming the holder after the timeout."""
    path = Path(save_dir) / name
    if not Path(save_dir).is_dir():
        raise UsageError(f"{save_dir}: no such save directory")
    fd = open_for_writing(path)  # a link planted at the lock's name is refused, never followed
    try:
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(
                        f"{path}: held by {_holder(fd)}; gave up after {timeout_seconds:.0f}s"
                    ) from None
                time.sleep(_POLL_SECONDS)
        stamp = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(stamp).encode(), 0)
        except OSError as e:  # a full store: name the file
            raise OSError(e.errno, e.strerror, str(path)) from None
        yield Held(Path(save_dir), name)
    finally:
        os.close(fd)  # closing the descriptor releases the flock
