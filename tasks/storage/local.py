"""POSIX storage primitives that must survive a crash at any instruction.

``atomic_write`` is the only way ckptops writes a file that others read (the promotion pointer,
manifests): a reader sees the old content or the new, never an empty or partial file. Each step
is its own function so the crash tests can kill the process between any two of them.
"""

import os
import secrets
import shutil
import time
from pathlib import Path

TEMP_MARK = ".tmp-"
TRASH_PREFIX = ".ckptops-trash-"


def _write_temp(path: Path, data: bytes) -> Path:
    # O_EXCL: a temp name is never shared, so two writers can never interleave in one file.
    tmp = path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return tmp


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    # Without this the rename itself may be lost on power failure, leaving the old name.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync of the directory."""
    path = Path(path)
    tmp = _write_temp(path, data)
    try:
        _fsync_file(tmp)
        _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_stale_temps(path: Path, older_than_seconds: float = 0.0) -> list[Path]:
    """Remove temp files a crashed ``atomic_write`` of ``path`` left behind."""
    path = Path(path)
    now = time.time()
    removed = []
    for candidate in path.parent.glob(f"{path.name}{TEMP_MARK}*"):
        try:
            if now - candidate.stat().st_mtime >= older_than_seconds:
                candidate.unlink()
                removed.append(candidate)
        except FileNotFoundError:
            continue
    return removed


def remove_tree(path: Path) -> None:
    """Delete a directory so that it is never seen half-deleted.

    The directory is first renamed to a trash name in the same parent (atomic), so listings stop
    seeing it at once; the slow recursive delete then works on a name nobody looks for. A crash
    during the delete leaves only a trash directory, which ``purge_trash`` finishes later.
    """
    path = Path(path)
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash)


def purge_trash(directory: Path) -> list[Path]:
    purged = []
    for trash in Path(directory).glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(trash, ignore_errors=True)
        purged.append(trash)
    return purged
