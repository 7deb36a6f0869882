"""A drill's scratch directory: made with its owner record inside, removed when the drill ends,
and, when a drill was killed before it could remove its own (SIGKILL, a lost node), removed by
the next drill once its owner is known to be gone.

ckptops deletes only what it provably made. A folder in ``drill.scratch_dir`` is a drill's only
when it holds the owner record ckptops wrote into it (created exclusively, never through a
link) and that record's random token is one the job's drill history recorded for this very
folder (its path, device and inode) before the drill used it. Anything else, whatever its name
or age (a save directory, a user's notes, a copied owner file), is never removed: it is
reported as a leftover that is not ckptops's, and left alone.

The scratch may be a shared file system: the owner is host, pid and start time
(``tasks.cluster.process.identity``); another host's leftovers go only after
``SCRATCH_MAX_AGE_HOURS``, a drill's own timeout being far shorter.
"""

import contextlib
import json
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.cluster.process import gone, identity
from tasks.errors import CkptopsError
from tasks.restore.history import made_scratch, record_scratch
from tasks.storage.local import PUBLIC_MODE, TRASH_PREFIX

OWNER = ".ckptops-owner.json"
PREFIX = "drill-"
SCRATCH_MAX_AGE_HOURS = 48
# An owner record is a few hundred bytes: anything much longer was not written by ckptops.
_OWNER_LIMIT = 4096


@dataclass(frozen=True)
class Scratch:
    """A scratch folder a drill made: where, its owner record's token, and the folder itself
    (device and inode), as the drill history records them."""

    path: Path
    token: str
    device: int
    inode: int


@dataclass
class Leftovers:
    """What the scratch dir holds besides running drills' folders."""

    stale: list[tuple[Path, str]] = field(default_factory=list)  # a drill's, that drill gone: removable
    identities: dict[Path, tuple[int, int]] = field(default_factory=dict)  # a stale one's device, inode
    foreign: list[tuple[Path, str]] = field(default_factory=list)  # not provably a drill's: left alone


def make_scratch(path: Path, save_dir: Path, drill_id: str) -> Scratch:
    """Make the folder ``path`` (never one already there), record it in the job's drill history,
    then write its owner record inside it, exclusively and without following links."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        found = os.fstat(folder)
        made = Scratch(path, secrets.token_hex(16), found.st_dev, found.st_ino)
        entry = {"drill": drill_id, "path": str(path), "token": made.token}
        record_scratch(save_dir, entry | {"device": made.device, "inode": made.inode})
        owner = os.open(
            OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PUBLIC_MODE, dir_fd=folder
        )
        with os.fdopen(owner, "w") as f:
            json.dump({"token": made.token, "drill": drill_id, **identity()}, f)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only while empty: nothing of anyone else's can go
        raise
    finally:
        os.close(folder)
    return made


def _owner_record(path: Path) -> tuple[os.stat_result, dict | None]:
    """The folder at ``path`` (not followed if a link) and the owner record in it, if it holds
    a readable one (a regular file, read through the folder's own descriptor)."""
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        found = os.fstat(folder)
        try:
            fd = os.open(OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except OSError:
            return found, None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return found, None
            data = f.read(_OWNER_LIMIT + 1)
    finally:
        os.close(folder)
    try:
        owner = json.loads(data) if len(data) <= _OWNER_LIMIT else None
    except ValueError:
        owner = None
    return found, owner if isinstance(owner, dict) else None


def _whose(path: Path, recorded: dict[str, dict]) -> tuple[dict | None, os.stat_result | None, str]:
    """The owner record of ``path`` and the folder, if it is provably a drill's (its owner
    record's token recorded in the drill history for this very folder, its device and inode),
    else why it is not."""
    if path.is_symlink():
        return None, None, "a symbolic link"
    try:
        found, owner = _owner_record(path)
    except OSError as e:
        return None, None, f"not a folder ckptops can open ({e.strerror or e})"
    if owner is None:
        return None, None, "no owner record of ckptops in it"
    entry = recorded.get(str(owner.get("token")))
    if entry is None:
        return None, None, "its owner record's token is not in this job's drill history"
    if (entry.get("device"), entry.get("inode")) != (found.st_dev, found.st_ino):
        return None, None, f"its owner record is {entry.get('path')}'s, copied: not that folder"
    return owner, found, ""


def stale_scratch(scratch_dir: Path, save_dir: Path, now: float | None = None) -> Leftovers:
    """The leftovers in ``scratch_dir``: drills' folders whose drill is gone (and why each is
    known to be), and folders named like a drill's (or its removal's) that are not provably one."""
    found = Leftovers()
    root = Path(scratch_dir)
    if not root.is_dir():
        return found
    candidates = sorted(p for p in root.iterdir() if p.name.startswith((PREFIX, TRASH_PREFIX)))
    if not candidates:
        return found
    try:
        recorded = made_scratch(save_dir)
    except CkptopsError as e:
        found.foreign += [(path, f"the drill history cannot be read: {e}") for path in candidates]
        return found
    for path in candidates:
        owner, folder, why_not = _whose(path, recorded)
        if owner is None:
            found.foreign.append((path, why_not))
            continue
        why = gone(owner)
        if why is None:
            age = (now or time.time()) - folder.st_mtime
            if age > SCRATCH_MAX_AGE_HOURS * 3600:
                why = f"untouched for {age / 3600:.0f} h"
        if why:
            found.stale.append((path, why))
            found.identities[path] = (folder.st_dev, folder.st_ino)
    return found


def _remove(path: Path, device: int, inode: int) -> None:
    """Remove the folder at ``path`` if it is still the one with ``device`` and ``inode``: renamed
    to a trash name first (listings stop seeing it at once), checked again under that name, then
    deleted by ``shutil.rmtree``, which follows no link inside it."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    if not path.name.startswith(TRASH_PREFIX):
        os.rename(path, trash)
    else:
        trash = path
    found = os.lstat(trash)
    if (found.st_dev, found.st_ino) != (device, inode) or not stat.S_ISDIR(found.st_mode):
        if trash != path:
            os.rename(trash, path)
        raise OSError(f"{path}: changed while being removed")
    shutil.rmtree(trash)


def remove_scratch(made: Scratch) -> str | None:
    """Remove the drill's own scratch folder, only if it is still the folder it made, holding its
    owner record; why not, if it was not removed."""
    try:
        found, owner = _owner_record(made.path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{made.path} (could not be removed: {e.strerror or e})"
    if (found.st_dev, found.st_ino) != (made.device, made.inode) or (owner or {}).get("token") != made.token:
        return f"{made.path} (not the scratch folder this drill made)"
    try:
        _remove(made.path, made.device, made.inode)
    except OSError as e:
        return f"{made.path} (could not be removed: {e.strerror or e})"
    return None


def clear_stale_scratch(scratch_dir: Path, save_dir: Path) -> tuple[list[str], list[str]]:
    """Remove the drills' folders ``stale_scratch`` finds; what was removed, and the leftovers
    left alone (not provably a drill's, or that could not be removed), each with why."""
    found = stale_scratch(scratch_dir, save_dir)
    removed, left = [], [f"{path} ({why})" for path, why in found.foreign]
    for path, why in found.stale:
        try:
            _remove(path, *found.identities[path])
        except OSError as e:
            left.append(f"{path} (could not be removed: {e.strerror or e})")
            continue
        removed.append(f"{path} ({why})")
    return removed, left
