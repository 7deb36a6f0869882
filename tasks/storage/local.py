"""POSIX storage primitives that must survive a crash at any instruction, and a planted link.

``atomic_write`` is the only way ckptops writes a file that others read (the promotion pointer,
manifests, NVRx files, raw outputs): a reader sees the old content or the new, never an empty or
partial file. Each step is its own function so the crash tests can kill the process between any
two of them. Its temporary is made by ``mkstemp`` in the target's folder (``O_CREAT | O_EXCL |
O_NOFOLLOW``, a random name), so a link planted at a name ckptops would use is never written
through: the rename replaces a link at the target itself, never what it points to.

``open_for_writing`` is the only way ckptops writes into a file in place (a lock, a JSON-lines
log, a command's log): opened without following links, and refused in one line when what is at
the path is a link, anything but a regular file, or a file with another hard link.

``read_jsonl`` reads ckptops's own logs back and survives bytes it did not write: a line that
does not decode, parse, or hold a JSON object is skipped, with one warning naming the file and
the lines (through ``logging``: the CLI's stderr, the worker's log).

Files ckptops writes get mode 0644 whatever the umask (0600 for anything holding a secret), and
the group of the directory they are written into: a umask of 002 must not make a manifest or the
pointer writable by the whole group, and the job's project group must be able to read them.

What only ckptops's account may touch is 0600 and checked as such. A lock (``held_lock``): whoever
can open a file can ``flock`` it, so a lock file another account owns or may write, or a holder
of another account, is refused at once, and a holder of ours is waited for only up to a timeout.
A log ckptops acts on (a node's history, the drain log, the trash record: ``append_private_jsonl``)
is read only while nobody else can have written it (``read_own_jsonl``; the trash record, in a
folder the job's user owns, by the file alone: ckptops's own, 0600, one link). ``remove_tree`` records
each trash name before its rename, and ``purge_trash`` deletes only what that record proves.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import pwd
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

from tasks.errors import LockTimeout, Malformed, Unreadable, UsageError, unreadable

TEMP_MARK = ".tmp-"
TRASH_PREFIX = ".ckptops-trash-"
# Where ``remove_tree`` records each trash name before the rename (not itself a trash name).
TRASH_RECORD = ".ckptops-trash.jsonl"
# The longest line a log reader keeps: the rest of a longer line is read past, never held.
MAX_LINE = 64 << 10
# The modes of the files ckptops writes: readable by all, or (a secret) by the owner only.
PUBLIC_MODE = 0o644
SECRET_MODE = 0o600

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _set_access(fd: int, directory: Path, mode: int) -> None:
    """Give a file ckptops just created exactly ``mode`` (the umask may have taken bits away, or
    left group write in) and the group of the directory it is in. Changing the group is allowed
    only to a group the writer belongs to: if it is refused the file keeps the writer's group,
    which 0644 gives nothing more than everybody else gets (and 0600 nothing at all)."""
    os.fchmod(fd, mode)
    group = os.stat(directory).st_gid
    if os.fstat(fd).st_gid != group:
        with contextlib.suppress(PermissionError):
            os.fchown(fd, -1, group)


def _write_temp(path: Path, data: bytes, mode: int = PUBLIC_MODE) -> Path:
    # mkstemp: O_EXCL and O_NOFOLLOW on a random name, so a temp is never shared (two writers
    # never interleave in one file) and a link planted where a temp would go is never followed.
    fd, name = tempfile.mkstemp(prefix=f"{path.name}{TEMP_MARK}{os.getpid()}-", dir=path.parent)
    tmp = Path(name)
    try:
        _set_access(fd, path.parent, mode)
        write_all(fd, data, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a file behind
        raise
    os.close(fd)
    return tmp


def write_all(fd: int, data: bytes, path: Path | str | None = None) -> None:
    """Every byte of ``data`` to ``fd`` (one ``os.write`` may take only part of it). A failed
    write (a full disk, a quota) names ``path``, the file it is for: an error on a descriptor
    carries no file name of its own."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        if path is None or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
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


def atomic_write(path: Path, data: bytes, secret: bool = False) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync of the directory. The file
    gets mode 0644 (0600 if it holds a ``secret``) and its directory's group, set on the temp
    file before the rename, so no reader ever sees it with other permissions."""
    atomic_write_together([(Path(path), data)], secret)


def atomic_write_together(files: list[tuple[Path, bytes]], secret: bool = False) -> None:
    """``atomic_write`` of files in one directory that belong together (a manifest and its
    signature): every temp file written and synced first, then the renames back to back, in the
    order given, so a reader or a crash can find them apart only between two renames."""
    temps = []
    try:
        for path, data in files:
            temps.append(_write_temp(Path(path), data, SECRET_MODE if secret else PUBLIC_MODE))
            _fsync_file(temps[-1])
        for tmp, (path, _) in zip(temps, files):
            _replace(tmp, Path(path))
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(Path(files[0][0]).parent)


def read_state(path: Path) -> bytes | None:
    """A small state file's bytes (a pointer, a hold, a manifest); None if it is not there. The
    environment refusing to read it is ``Unreadable``, never taken for "not there"."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None


def read_json_state(path: Path, what: str):
    """A small JSON state file, parsed; None if it is not there; ``Malformed`` if it does not parse."""
    data = read_state(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise Malformed(f"{path}: {what} does not parse ({e})") from None


def _refusal(path: Path, why: str) -> Malformed:
    return Malformed(
        f"{path}: {why}; ckptops writes in place only a regular file of its own, opened without "
        "following links (remove it)"
    )


def _what_is_there(path: Path) -> str:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "not a regular file"
    return "a symbolic link" if stat.S_ISLNK(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def own_folder(root: Path, *parts: str) -> Path:
    """The folder ``root/parts...`` that ckptops names and keeps in a folder it was given
    (``.ckptops-history`` and its ``drills``, ``.ckptops-pins``, a node's raw folder), made
    where absent, and tightened where an older ckptops left it group-writable
    (``tighten_own_folder``). ``root`` is the operator's and may be a link; below it nothing may be: a
    link, or anything but a folder, at one of these names is ``Malformed`` (one line naming it)
    and never followed, so no file of ckptops's can be steered out of the folder it was given."""
    path = Path(root)
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    for part in parts:
        path = path / part
        with contextlib.suppress(FileExistsError):
            # At a link's name this is EEXIST: the link itself is never followed. 0755: a umask
            # of 002 must not let the group write a folder whose files ckptops trusts.
            path.mkdir(mode=0o755)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise Malformed(
                f"{path}: {_what_is_there(path)} where ckptops keeps a folder of its own; "
                "nothing is written through it (remove it)"
            )
        tighten_own_folder(path)
    return path


def tighten_own_folder(path: Path, follow: bool = False) -> bool:
    """Heal a folder ckptops made before it made them 0755 (``mkdir`` under a umask of 002 left
    it 0775, and nothing in it could be trusted again): a folder owned by ckptops's own account
    that its group or others may write, and not sticky, loses those write bits (0775 -> 0755).
    Anything else (absent, a link unless ``follow``, not a folder, another account's) is left as
    it is. Checked and changed on one descriptor, so nothing can be swapped in between. Whether
    the mode was changed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False  # absent, a link, not a folder, or unreadable: not for us to heal
    try:
        found = os.fstat(fd)
        mode = stat.S_IMODE(found.st_mode)
        loose = mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX
        if found.st_uid != os.geteuid() or not loose:
            return False
        os.fchmod(fd, mode & ~(stat.S_IWGRP | stat.S_IWOTH))
        return True
    finally:
        os.close(fd)


def open_for_writing(
    path: Path, append: bool = False, truncate: bool = False, *, mode: int = PUBLIC_MODE
) -> int:
    """A read-write descriptor on the regular file at ``path`` (``O_APPEND`` with ``append``;
    emptied with ``truncate``), created if absent with ``mode`` (0644 unless the caller says
    0600) and its directory's group; an existing file keeps its mode and group. Never through a
    link: a symbolic link at ``path`` (``O_NOFOLLOW``), a FIFO, device or directory, or a file
    with another hard link (writing it would write that other name too) is ``Malformed``, one
    line naming the path, and nothing is written. Checked on the opened descriptor, so nothing
    can be swapped in between; emptied only after the check."""
    path = Path(path)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
        created = True
    except FileExistsError:
        created = False
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise _refusal(path, _what_is_there(path)) from None
            raise unreadable(path, e) from None
    except OSError as e:
        raise unreadable(path, e) from None
    try:
        if created:
            _set_access(fd, path.parent, mode)
        else:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise _refusal(path, _KINDS.get(stat.S_IFMT(found.st_mode), "not a regular file"))
            if found.st_nlink != 1:
                raise _refusal(path, f"a file with {found.st_nlink} hard links")
            if truncate:
                os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: Path) -> int:
    """A read-write descriptor on a file only ckptops's account may open (a lock: whoever can
    open a file can ``flock`` it): ``open_for_writing``'s, created 0600 if absent. An existing
    one owned by another account, or that its group or others may write, is ``Malformed``, one
    line naming it, its owner's user name and mode, and is never waited on; one of ckptops's that
    others may read (0644, as ckptops made its locks before) is made 0600."""
    fd = open_for_writing(path, mode=SECRET_MODE)
    try:
        found = os.fstat(fd)
        if found.st_uid != os.geteuid():
            why = f"owned by another account than ckptops's ({user_name(os.geteuid())})"
        elif stat.S_IMODE(found.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
            why = "writable by its group or by others"
        else:
            if stat.S_IMODE(found.st_mode) != SECRET_MODE:
                os.fchmod(fd, SECRET_MODE)
            return fd
        raise Malformed(
            f"{path}: {why}: {_mode_and_owner(found)}; ckptops locks only a file of its own account "
            "that no other may open (remove it)"
        )
    except BaseException:
        os.close(fd)
        raise


def flock_holder(fd: int) -> tuple[int, int] | None:
    """The pid and uid of the process of this host that holds the ``flock`` on ``fd``'s file, as
    ``/proc/locks`` names it; None where it names none (another host's holder on a shared file
    system, a process gone, no ``/proc``)."""
    found = os.fstat(fd)
    inode = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
                    pid = int(fields[4])
                    return pid, os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    return None


_LOCK_POLL_SECONDS = 0.1


def wait_for_flock(fd: int, path: Path, timeout_seconds: float, holder: Callable[[int], str]) -> None:
    """Take the exclusive ``flock`` on ``fd`` (the file at ``path``), waiting at most
    ``timeout_seconds`` for its holder (``LockTimeout`` naming it, ``holder(fd)``, after that);
    a holder of another account (``flock_holder``) is ``Malformed`` at once, never waited on."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        other = flock_holder(fd)
        if other is not None and other[1] != os.geteuid():
            raise Malformed(
                f"{path}: locked by pid {other[0]} of {user_name(other[1])}, another account than "
                f"ckptops's ({user_name(os.geteuid())}); not waited on"
            )
        if time.monotonic() >= deadline:
            raise LockTimeout(f"{path}: held by {holder(fd)}; gave up after {timeout_seconds:.0f}s")
        time.sleep(_LOCK_POLL_SECONDS)


@contextlib.contextmanager
def held_lock(
    path: Path,
    timeout_seconds: float,
    stamp: Callable[[], bytes] | None = None,
    holder: Callable[[int], str] | None = None,
) -> Iterator[int]:
    """Hold the exclusive ``flock`` on the private file ``path`` (``open_private``), waited for
    at most ``timeout_seconds`` (``wait_for_flock``; ``holder`` describes a holder from the
    file's descriptor, else its pid from ``/proc/locks``); what ``stamp`` returns (who holds it,
    for another waiter's message) is written into it once held, and the file is emptied before the lock is
    released, so a stamp only ever names a live holder."""
    fd = open_private(path)
    try:
        wait_for_flock(fd, path, timeout_seconds, holder or _pid_holder)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, stamp() if stamp else b"", 0)
        except OSError as e:  # a full store: name the file
            raise OSError(e.errno, e.strerror, str(path)) from None
        try:
            yield fd
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _pid_holder(fd: int) -> str:
    found = flock_holder(fd)
    return f"pid {found[0]} of {user_name(found[1])}" if found else "a process of another host, or one gone"


def write_output(path: Path, data: bytes) -> None:
    """Write a file the user named (``--plot``) in place, through ``open_for_writing``: a link
    there is refused in one line, never followed and never replaced (``/dev/stdout`` is one)."""
    fd = open_for_writing(path, truncate=True)
    try:
        write_all(fd, data, path)
    finally:
        os.close(fd)


def append_jsonl(path: Path, entry: dict) -> None:
    """Append one line to a JSON-lines log: one write on an O_APPEND file (lines of concurrent
    writers never interleave), after a newline if a torn line ends the file (so a crash mid-append
    costs that line only), fsynced. The log is opened by ``open_for_writing``: a link planted at
    its path is refused, never followed."""
    _append_line(Path(path), entry, PUBLIC_MODE)


def append_private_jsonl(path: Path, entry: dict) -> None:
    """``append_jsonl`` to a log that ckptops later trusts only from its own account
    (``read_own_jsonl``: a node's history, the drain log, the trash record), created 0600."""
    _append_line(Path(path), entry, SECRET_MODE)


def _append_line(path: Path, entry: dict, mode: int) -> None:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    data = (json.dumps(entry) + "\n").encode()
    fd = open_for_writing(path, append=True, mode=mode)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        try:
            written = os.write(fd, data)
            os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None
        if written != len(data):
            raise OSError(errno.EIO, f"short write ({written} of {len(data)} bytes)", str(path))
    finally:
        os.close(fd)


_log = logging.getLogger(__name__)
# Line numbers named in a warning; the rest are counted.
_NAMED_LINES = 10


@cache
def warn_once(line: str) -> None:
    """A warning about a file ckptops reads (one line naming it), given once per process: a
    reader called again (a promotion reads its log several times) does not repeat it."""
    _log.warning(line)


def _warn_skipped(path: Path, lines: list[int]) -> None:
    named = ", ".join(map(str, lines[:_NAMED_LINES]))
    more = f" and {len(lines) - _NAMED_LINES} more" if len(lines) > _NAMED_LINES else ""
    warn_once(
        f"{path}: {'line' if len(lines) == 1 else 'lines'} {named}{more} skipped: not a record "
        "ckptops wrote (bad UTF-8, not JSON, or not an entry of this log); the rest is used"
    )


def read_jsonl(path: Path, fits: Callable[[dict], bool] | None = None) -> list[dict]:
    """Every entry of a JSON-lines log ckptops writes, oldest first; no file is an empty log.
    Bytes ckptops did not write never stop a reader: a line that is not UTF-8, does not parse,
    is not a JSON object, or that ``fits`` (the caller's shape of an entry) rejects is skipped,
    and one warning names the file and those lines (a torn last line, from a crash mid-append,
    among them). An unreadable file, or one that is not a regular file, is one ``Unreadable``
    error naming it."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            data = f.read()
    except UsageError:  # a FIFO, a device or a directory where the log should be
        raise Unreadable(
            f"{path}: {_what_is_there(path)}, not a regular file like every log of ours"
        ) from None
    except Unreadable:
        if not os.path.lexists(path):
            return []
        raise
    entries, skipped = [], []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        entry = _entry(line, fits)
        if entry is None:
            skipped.append(number)
        else:
            entries.append(entry)
    if skipped:
        _warn_skipped(path, skipped)
    return entries


def _entry(line: bytes, fits: Callable[[dict], bool] | None) -> dict | None:
    """One line of a JSON-lines log as an entry, or None where it is not one: not UTF-8, not
    JSON, not an object, or one ``fits`` (the caller's shape of an entry) rejects."""
    try:
        entry = json.loads(line.decode())
        if isinstance(entry, dict) and (fits is None or fits(entry)):
            return entry
    except (ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError among them
        pass
    return None


def user_name(uid: int) -> str:
    """``alice (uid 1000)``; ``uid 1000`` for a uid this host has no name for."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _mode_and_owner(st: os.stat_result) -> str:
    return f"{stat.filemode(st.st_mode)} ({oct(stat.S_IMODE(st.st_mode))}), owner {user_name(st.st_uid)}"


def _others_may_write(st: os.stat_result, folder: bool) -> str | None:
    """What lets another account than ckptops's write the entry ``st`` describes (its
    ``lstat``), or None. Root is trusted whoever ckptops runs as (it can write anything); a
    folder others may write is fine when sticky (as /tmp): nobody else can rename or remove what
    ckptops put in it."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by another account than ckptops's ({user_name(os.geteuid())})"
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (folder and mode & stat.S_ISVTX):
        return "writable by its group or by others"
    return None


def written_by_others(path: Path, root: Path | None = None) -> str | None:
    """Why the file at ``path`` may hold bytes another account wrote, one line naming the file or
    folder at fault, its mode and owner; None when only ckptops's account (or root) can have
    written it: the file, if there, and every folder from its own up to ``root`` (its own only
    without ``root``; ``root`` itself followed if a link, as the operator may give one) are owned
    by ckptops's account or root, are no links, and neither their group nor others may write
    them."""
    path = Path(path)
    folders = [path.parent]
    if root is not None and Path(root) in path.parents:
        while folders[-1] != Path(root):
            folders.append(folders[-1].parent)
    for entry in [path, *folders]:
        try:
            found = os.stat(entry) if entry == folders[-1] else os.lstat(entry)
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{entry}: cannot be examined ({e.strerror or e})"
        why = _others_may_write(found, entry != path)
        if why is not None:
            return f"{entry}: {why}: {_mode_and_owner(found)}"
    return None


def read_own_jsonl(
    path: Path, fits: Callable[[dict], bool] | None = None, root: Path | None = None
) -> list[dict]:
    """``read_jsonl`` of a log ckptops trusts only from its own account (a node's history, the
    drain log): where ``written_by_others`` finds that another account could
    have written it, one warning names the file or folder, its owner and mode, and nothing in it
    is used (an empty log)."""
    why = written_by_others(path, root)
    if why is not None:
        warn_once(f"{why}; nothing in {path} is trusted (only a log of ckptops's own account is)")
        return []
    return read_jsonl(path, fits)


TAIL_BYTES = 64 * 1024


def last_jsonl(path: Path, fits: Callable[[dict], bool] | None = None) -> dict | None:
    """The newest entry of a JSON-lines log (``read_jsonl``'s last), read from the file's end: a
    log that grows by one line a promotion costs the same to ask at its first line as at its
    thousandth. Where the end holds a line that is not an entry (a torn append, bytes ckptops did
    not write), the whole file is read as ``read_jsonl`` reads it, with its warning."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - TAIL_BYTES)
            f.seek(start)
            lines = f.read().split(b"\n")
    except (UsageError, Unreadable):
        entries = read_jsonl(path, fits)  # the same refusal, or no log at all
        return entries[-1] if entries else None
    # The first line of a tail that starts mid-file may be cut: never judged.
    filled = [line for line in (lines[1:] if start else lines) if line.strip()]
    if not filled and not start:
        return None  # an empty log
    entry = _entry(filled[-1], fits) if filled else None
    if entry is not None:
        return entry
    entries = read_jsonl(path, fits)
    return entries[-1] if entries else None


def make_durable(files: list[Path], root: Path) -> None:
    """fsync the files and every directory from theirs up to ``root`` (new entries in each)."""
    root, directories = Path(root), set()
    for path in map(Path, files):
        _fsync_file(path)
        directories.update(d for d in path.parents if d == root or root in d.parents)
    for directory in sorted(directories):
        _fsync_dir(directory)


def remove_file(path: Path) -> None:
    """Remove a file durably (the directory entry's removal is fsynced); absent is fine."""
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)


def remove_stale_temps(path: Path) -> None:
    """Remove temp files a killed ``atomic_write`` of ``path`` left behind. Only for callers that
    hold the lock that serialises writers of ``path``: another writer's temp would go too."""
    path = Path(path)
    for candidate in path.parent.glob(f"{path.name}{TEMP_MARK}*"):
        candidate.unlink(missing_ok=True)


def list_entries(directory: Path) -> dict[str, os.stat_result]:
    """Every entry directly in ``directory`` with its own ``lstat`` (symlinks not followed): one
    listing, one stat per entry. An entry that disappears between the listing and its stat (a
    writer renaming its temp file, as DCP does with ``.metadata.tmp``) is simply not listed."""
    found = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                found[entry.name] = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
    return found


def list_files(
    directory: Path, entries: dict[str, os.stat_result] | None = None
) -> dict[str, os.stat_result]:
    """The regular files directly in ``directory`` with their stats (symlinks are not followed),
    from ``entries`` (its ``list_entries``) when the caller has just taken them."""
    entries = list_entries(directory) if entries is None else entries
    return {name: st for name, st in entries.items() if stat.S_ISREG(st.st_mode)}


def stat_files(directory: Path, names) -> dict[str, os.stat_result]:
    """``list_files`` for these names only: the regular files among them (symlinks not followed)
    with their stats, one ``lstat`` each instead of a listing of the whole directory."""
    found = {}
    for name in names:
        try:
            st = os.lstat(Path(directory) / name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            found[name] = st
    return found


def remove_tree(path: Path) -> None:
    """Delete a directory so that it is never seen half-deleted.

    The directory is first renamed to a trash name in the same parent (atomic), so listings stop
    seeing it at once; the slow recursive delete then works on a name nobody looks for. Before
    the rename, the trash name and the directory's device and inode go into the parent's trash
    record (``TRASH_RECORD``, a log of ckptops's own account): a crash during the delete leaves a
    trash directory ``purge_trash`` can prove is ours, and finishes later.
    """
    path = Path(path)
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise Malformed(f"{path}: {_what_is_there(path)}, not a directory; nothing removed")
    record = path.parent / TRASH_RECORD
    append_private_jsonl(record, {"trash": trash.name, "device": found.st_dev, "inode": found.st_ino})
    os.rename(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash)
    # Gone: its inode may be reused, and a folder made at its name later is not ours.
    append_private_jsonl(record, {"trash": trash.name, "removed": True})


def _is_trash_entry(entry: dict) -> bool:
    return str(entry.get("trash", "")).startswith(TRASH_PREFIX) and (
        entry.get("removed") is True
        or (isinstance(entry.get("device"), int) and isinstance(entry.get("inode"), int))
    )


def _private_file_fault(found: os.stat_result) -> str | None:
    """What lets another account than ckptops's have written the file ``found`` describes (its
    ``fstat``), or None: only a regular file owned by ckptops's account, with no group or other
    bits and no other hard link, can have been written by nobody else."""
    if not stat.S_ISREG(found.st_mode):
        return _KINDS.get(stat.S_IFMT(found.st_mode), "not a regular file")
    if found.st_uid != os.geteuid():
        return f"owned by another account than ckptops's ({user_name(os.geteuid())})"
    if stat.S_IMODE(found.st_mode) & 0o077:
        return "not private to its owner (mode other than 0600)"
    if found.st_nlink != 1:
        return f"a file with {found.st_nlink} hard links"
    return None


def _read_trash_record(record: Path) -> list[dict]:
    """The entries of a trash record, trusted by the file alone: the save directory it lies in
    is normally the job user's, so its folder proves nothing (``read_own_jsonl`` would distrust
    every record there), but a regular file of ckptops's account, 0600, with one link, only
    that account can have written; each entry's device and inode then prove its folder. Any
    other file (a link among them) is one warning naming it, its mode and owner, and proves
    nothing (no entries). Checked on the opened descriptor, so nothing can be swapped in."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise unreadable(record, e) from None
        warn_once(f"{record}: a symbolic link; nothing in it is trusted (only ckptops's own 0600 file is)")
        return []
    with os.fdopen(fd, "rb") as f:
        found = os.fstat(f.fileno())
        why = _private_file_fault(found)
        if why is not None:
            warn_once(
                f"{record}: {why}: {_mode_and_owner(found)}; nothing in it is trusted "
                "(only ckptops's own 0600 file is)"
            )
            return []
        data = f.read()
    entries, skipped = [], []
    for number, line in enumerate(data.split(b"\n"), 1):
        entry = _entry(line, _is_trash_entry) if line.strip() else {}
        if entry is None:
            skipped.append(number)
        elif entry:
            entries.append(entry)
    if skipped:
        _warn_skipped(record, skipped)
    return entries


def purge_trash(directory: Path) -> list[Path]:
    """Finish the deletions a crash interrupted: remove each trash folder ``remove_tree``
    recorded (its name, device and inode in ``directory``'s trash record, trusted only as
    ckptops's own file: ``_read_trash_record``), then drop the record's lines of trash no longer
    there. A ``.ckptops-trash-*`` entry that is not one of those (a user's folder, a link, a
    folder put where ours was) is left alone, named once in a warning, and returned."""
    directory = Path(directory)
    record = directory / TRASH_RECORD
    made, entries = {}, _read_trash_record(record)
    for entry in entries:
        if entry.get("removed") is True:
            made.pop(entry["trash"], None)
        else:
            made[entry["trash"]] = (entry["device"], entry["inode"])
    left = []
    for trash in sorted(directory.glob(f"{TRASH_PREFIX}*")):
        try:
            found = os.lstat(trash)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(found.st_mode) and made.get(trash.name) == (found.st_dev, found.st_ino):
            shutil.rmtree(trash, ignore_errors=True)
        else:
            left.append(trash)
            warn_once(
                f"{trash}: named like ckptops's trash, but no deletion of ckptops's recorded it in "
                f"{record}; left alone"
            )
    if entries:  # a record of ours: the lines of trash still there kept, the rest dropped
        there = [(n, d, i) for n, (d, i) in made.items() if os.path.lexists(directory / n)]
        kept = [{"trash": n, "device": d, "inode": i} for n, d, i in there]
        if kept:
            atomic_write(record, "".join(json.dumps(e) + "\n" for e in kept).encode(), secret=True)
        else:
            remove_file(record)
    return left


def open_regular(path: Path, follow: bool = True):
    """Open a file to read it whole, refusing anything but a regular file: a FIFO with no
    writer would block the reader forever, a device never ends. The check is made on the opened
    descriptor (opened without blocking), so nothing can be swapped in between. ``follow=False``:
    a symbolic link at ``path`` is refused too (a file that must be the one at that name)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise UsageError(f"{path}: a symbolic link, not a regular file; give the file itself") from None
        raise unreadable(path, e) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UsageError(f"{path}: {kind}, not a regular file; give the file itself")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, its whole length noted after the cut."""
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text)} characters in all]"


def read_lines(path: Path, limit: int = MAX_LINE, start: int = 0) -> Iterator[str]:
    """The lines of a text file (a regular one: ``open_regular``) from byte ``start``, decoded
    as UTF-8 with errors replaced, without their line ends. A line longer than ``limit`` bytes is
    cut there, its whole length noted after the cut; the rest is read past in pieces, so a 200 MB
    line costs ``limit`` of memory, not 200 MB."""
    with open_regular(path) as f:
        f.seek(start)
        while True:
            line = f.readline(limit)
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            if len(line) == limit and not line.endswith(b"\n"):
                length = len(line)
                while (rest := f.readline(limit)) and not rest.endswith(b"\n"):
                    length += len(rest)
                length += len(rest.rstrip(b"\r\n"))
                text = f"{text} [... {length} bytes in all]"
            yield text
