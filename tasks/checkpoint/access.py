"""Who may write what a promotion trusts, and who may read a key.

A checkpoint of a sensitive run is sensitive data: if anybody but the job can write its save
directory, its manifest or a pointer, anybody can swap in the state a recovery resumes from, and
the checkpoint becomes a back door around the data's permissions. So before the pointer moves,
``unsafe_for_promotion`` checks the save directory, the checkpoint's directory, its manifest,
the data files a resume reads (its shards, ``.metadata``, ``metadata.json`` and an older
Megatron's ``common.pt``), ckptops' pointer, the verdict log that keeps an old manifest from being
put back (``verdicts``) and Megatron's tracker (what a plain relaunch reads), and names
each one that

- is world-writable (always refused),
- is group-writable (refused unless the profile's ``verify.allow_group_write`` says the job's
  group is trusted, as a shared project group on a cluster often is),
- is owned by a user other than the trusted ones: the job's user (``job.user`` in the profile;
  default: the owner of the save directory), root, and the user ckptops runs as. Root is trusted
  as OpenSSH trusts it (StrictModes): root can write any file whatever its owner, so a file a
  root cron job wrote opens no door that was not open; and what ckptops itself wrote is ours.

Each problem is one line: the path, what is wrong, its mode (``drwxrwxrwx``, octal) and owner.

Key files are the other way round: ``refuse_readable_by_others`` refuses one that anybody but
its owner may read or write, as ssh refuses an "UNPROTECTED PRIVATE KEY FILE".
"""

import grp
import os
import pwd
import stat
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.verdicts import VERDICTS
from tasks.errors import CkptopsError, UsageError, unreadable
from tasks.storage.local import list_entries, user_name

COMMON_PT = "common.pt"  # the common state of a checkpoint of core 0.18 or older


class Exposed(CkptopsError):
    """A file that must be private is not: a key others may read. Exit 2, like bad input."""

    exit_code = 2


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def describe_mode(st: os.stat_result) -> str:
    """``drwxrwxr-x (0o775), owner alice (uid 1000), group proj (gid 500)``."""
    return (
        f"{stat.filemode(st.st_mode)} ({oct(stat.S_IMODE(st.st_mode))}), "
        f"owner {user_name(st.st_uid)}, group {_group(st.st_gid)}"
    )


def job_uid(save_dir: Path, user: str | None = None) -> int:
    """The job's user: the profile's ``job.user`` (a name or a uid), else the save directory's owner."""
    if user is None:
        try:
            return os.stat(save_dir).st_uid
        except OSError as e:
            raise unreadable(save_dir, e) from None
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise UsageError(f"job.user: no such user {user!r} on this host") from None


def writable_by_others(path: Path, trusted: set[int], allow_group_write: bool = False) -> str | None:
    """Why ``path`` can be written by somebody not trusted (one line naming it), or None if it
    cannot (or is not there). The entry itself is looked at, not what a symlink points to: a
    symlink where ckptops expects a file or directory is reported as one."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise unreadable(path, e) from None
    why = _why(st, trusted, allow_group_write)
    return None if why is None else f"{path}: {why}: {describe_mode(st)}"


def _why(st: os.stat_result, trusted: set[int], allow_group_write: bool) -> str | None:
    """What lets somebody not trusted write the entry ``st`` describes (its ``lstat``), or None."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (anybody who can write its target, or the target's directory, controls it)"
    if mode & stat.S_IWOTH:
        return "world-writable"
    if mode & stat.S_IWGRP and not allow_group_write:
        return "group-writable (the profile's verify.allow_group_write is off)"
    if st.st_uid not in trusted:
        return "owned by another user than the job's"
    return None


def resume_reads(name: str) -> bool:
    """Whether a resume reads this file of a checkpoint: Megatron's ``torch_dist`` load reads
    ``metadata.json``, ``.metadata`` and the shards, and a checkpoint of core 0.18 or older its
    ``common.pt``."""
    return layout.is_checkpoint_content(name) or name == COMMON_PT


def _entries(directory: Path) -> dict[str, os.stat_result]:
    """``list_entries`` of the checkpoint's directory; none when there is no checkpoint there."""
    try:
        return list_entries(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}  # no checkpoint there: what names it (the pointer) is what is checked
    except OSError as e:
        raise unreadable(directory, e) from None


def unsafe_for_promotion(
    save_dir: Path,
    iteration: int | None,
    job_user: str | None = None,
    allow_group_write: bool = False,
    entries: dict[str, os.stat_result] | None = None,
) -> list[str]:
    """What others could write among the paths promoting ``iteration`` would trust (the save
    directory, the pointer, the verdict log and Megatron's tracker; with an iteration, its
    directory, manifest and every data file a resume reads), one line each; empty if none.
    ``entries``: the iteration directory's ``list_entries`` when the caller has just taken it."""
    save_dir = Path(save_dir).resolve()  # a save directory reached through a symlink is fine
    trusted = {job_uid(save_dir, job_user), 0, os.geteuid()}
    paths = [
        save_dir,
        save_dir / layout.POINTER,
        save_dir / layout.MEGATRON_TRACKER,
        save_dir / layout.HISTORY / VERDICTS,
    ]
    listed: dict[str, os.stat_result] = {}
    if iteration is not None:
        directory = save_dir / layout.iter_dir_name(iteration)
        paths += [directory, directory / layout.MANIFEST]
        listed = _entries(directory) if entries is None else entries
    found = [writable_by_others(p, trusted, allow_group_write) for p in paths]
    # One test an entry for the usual case (a file of the job's own, writable by nobody else),
    # the reasons only for the rest: 5,120 shards are checked at every promotion.
    others = stat.S_IWOTH | (0 if allow_group_write else stat.S_IWGRP)
    suspects = [
        name
        for name, st in listed.items()
        if (st.st_mode & others or st.st_uid not in trusted or stat.S_ISLNK(st.st_mode))
        and resume_reads(name)
    ]
    for name in sorted(suspects):
        why = _why(listed[name], trusted, allow_group_write)
        found.append(f"{directory / name}: {why}: {describe_mode(listed[name])}")
    return [line for line in found if line is not None]


def refuse_readable_by_others(path: Path, what: str) -> os.stat_result:
    """Refuse a key file (``what`` names it: "the signing key") that anybody but its owner may
    read or write, or that another user than the one running ckptops (or root) owns: raises
    ``Exposed`` with one line naming the file, its mode and owner. Symlinks are followed, as
    ssh follows them; the file must be a regular one. Its stat is returned."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: {what} is not there") from None
    except OSError as e:
        raise unreadable(path, e) from None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        why = "readable or writable by others than its owner (UNPROTECTED PRIVATE KEY FILE); chmod 600 it"
    elif st.st_uid not in (os.geteuid(), 0):
        why = f"owned by another user than the one running ckptops ({user_name(os.geteuid())})"
    else:
        return st
    raise Exposed(f"{path}: {what} refused, {why}: {describe_mode(st)}")
