"""The per-job lock: one verify-promote-retain run per save directory at a time.

An advisory ``flock`` on ``<save>/.ckptops.lock``. The kernel drops it when the holder dies, so a
crashed run never leaves the job locked. (On Lustre this needs the ``flock`` mount option; on NFS
v4 it maps to byte-range locks.) The file's content names the holder for the error message only,
and is emptied before the lock is released.

Only ckptops's account can hold it (``tasks.storage.local.held_lock``): the file is created 0600
(whoever can open a file can ``flock`` it, so a 0644 lock could be held by any local user), a
lock file another account owns or may write is refused in one line naming the file and that
account, and a holder of another account (``/proc/locks``) is refused at once, never waited on.
It is opened by ``open_for_writing``: a link or a hard link planted at its name is refused in one
line, never written through (the holder's stamp would overwrite its target).
"""

import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint.layout import LOCK
from tasks.errors import UsageError
from tasks.storage.local import flock_holder, held_lock, user_name

_STAMP_LIMIT = 4096


def _holder(fd: int) -> str:
    """The holder's stamp (pid, host, since) where it wrote one, else its pid from /proc/locks."""
    try:
        info = json.loads(os.pread(fd, _STAMP_LIMIT, 0) or b"null")
    except ValueError:
        info = None
    if isinstance(info, dict):
        return f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')}"
    found = flock_holder(fd)
    return f"pid {found[0]} of {user_name(found[1])}" if found else "an unknown holder"


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
    raise LockTimeout naming the holder after the timeout, and ``Malformed`` at once for a lock
    file or a holder of another account."""
    if not Path(save_dir).is_dir():
        raise UsageError(f"{save_dir}: no such save directory")
    with held_lock(Path(save_dir) / name, timeout_seconds, _stamp, _holder):
        yield Held(Path(save_dir), name)


def _stamp() -> bytes:
    """Who holds the lock, from when: written into the lock file once it is held."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode()
