"""Locks only ckptops's account can hold (issue 56): the job lock, the recovery lock and NVRx's
segment lock. Before, each was a 0644 file any local user could open and ``flock``: promotion then
timed out naming a stale holder, a recovery waited, and ``health run`` blocked with no timeout.
Tests run as root; "another account" is ``nobody``, a file chowned to it or a child process
running as it."""

import fcntl
import os
import stat
import subprocess
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.checkpoint import layout
from tasks.checkpoint.lock import job_lock
from tasks.errors import LockTimeout, Malformed
from tasks.health import nvrx
from tasks.health.run import NodeReport
from tasks.outcome import Verdict

NOBODY = 65534  # nobody, a spare account with no business in a save directory
SYSTEM_PYTHON = "/usr/bin/python3"  # one that another account may run (the venv's may not be)


def _save(tmp_path: Path) -> Path:
    save = tmp_path / "save"
    save.mkdir()
    return save


@contextmanager
def flocked(path: Path):
    """This process holds the lock through a descriptor of its own, as another ckptops run does
    (two open files of one file conflict even within one process)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


@contextmanager
def flocked_by_nobody(path: Path):
    """A process of another account holds the lock: it got a descriptor while the file was 0644
    (here handed down, as the test's folder is root's alone), then dropped to ``nobody``."""
    fd = os.open(path, os.O_RDONLY)
    child = subprocess.Popen(
        [
            SYSTEM_PYTHON,
            "-c",
            f"import fcntl, sys; fcntl.flock({fd}, fcntl.LOCK_EX); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        pass_fds=(fd,),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(fd)
    try:
        assert child.stdout.readline().strip() == "held"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=60)


@pytest.mark.parametrize("name", [layout.LOCK, layout.RECOVERY_LOCK, layout.ARCHIVE_LOCK])
def test_a_lock_file_of_another_account_is_refused_naming_it(tmp_path, name):
    """Before: opened and locked as any other; the account that made it could hold it at will."""
    save = _save(tmp_path)
    (save / name).write_text("")
    os.chown(save / name, NOBODY, NOBODY)
    with pytest.raises(Malformed) as refused, job_lock(save, 600, name):
        pass
    line = str(refused.value)
    assert line.startswith(f"{save / name}: owned by another account than ckptops's (root (uid 0))")
    assert "owner nobody (uid 65534)" in line and "\n" not in line


def test_a_lock_file_others_may_write_is_refused(tmp_path):
    save = _save(tmp_path)
    (save / layout.LOCK).write_text("")
    os.chmod(save / layout.LOCK, 0o666)
    refused = pytest.raises(
        Malformed, match=r"\.ckptops\.lock: writable by its group or by others: -rw-rw-rw-"
    )
    with refused, job_lock(save, 600):
        pass


def test_the_lock_is_private_and_its_stamp_is_emptied_on_release(tmp_path):
    """Before: created 0644 (any account could open and flock it) and the stamp outlived the run."""
    save = _save(tmp_path)
    with job_lock(save, 1):
        assert f'"pid": {os.getpid()}' in (save / layout.LOCK).read_text()
    found = os.stat(save / layout.LOCK)
    assert stat.S_IMODE(found.st_mode) == 0o600 and found.st_size == 0
    # A lock an older ckptops made 0644 is made private when next taken.
    os.chmod(save / layout.LOCK, 0o644)
    with job_lock(save, 1):
        assert stat.S_IMODE(os.stat(save / layout.LOCK).st_mode) == 0o600


def test_a_lock_another_run_holds_is_waited_for_only_up_to_the_timeout(tmp_path):
    save = _save(tmp_path)
    with flocked(save / layout.LOCK), pytest.raises(LockTimeout) as late, job_lock(save, 0):
        pass
    # It left no stamp: /proc/locks names the holder.
    assert (
        str(late.value)
        == f"{save / layout.LOCK}: held by pid {os.getpid()} of root (uid 0); gave up after 0s"
    )


def test_a_lock_a_process_of_another_account_holds_is_refused_not_waited_on(tmp_path):
    """Before: waited on for the whole timeout, then a LockTimeout naming a stale stamp."""
    save = _save(tmp_path)
    (save / layout.LOCK).write_text("")
    held = flocked_by_nobody(save / layout.LOCK)
    with held as pid, pytest.raises(Malformed) as refused, job_lock(save, 5):
        pass
    assert str(refused.value) == (
        f"{save / layout.LOCK}: locked by pid {pid} of nobody (uid 65534), another account than "
        "ckptops's (root (uid 0)); not waited on"
    )


def _failing(node: str) -> NodeReport:
    return NodeReport(node, Verdict.FAIL_HARDWARE)


def test_health_runs_nvrx_lock_has_a_timeout(tmp_path):
    """Before: ``flock`` without LOCK_NB, so a held segment lock blocked ``health run`` for ever."""
    directory = tmp_path / "segments"
    directory.mkdir()
    settings = SimpleNamespace(nvrx_segment_dir=directory, command_timeout_seconds=0.01)
    with flocked(directory / nvrx.LOCK):
        update = nvrx.publish([_failing("gpu1")], settings, lambda node: [("100", "100")])
    assert update.written == [] and not (directory / "segment_health_check.100.100").exists()
    assert update.errors == [
        f"health.nvrx_segment_dir: {directory / nvrx.LOCK}: held by pid {os.getpid()} of root (uid 0); "
        "gave up after 0s"
    ]
    # Free again, the same update goes through, and the lock is left private and empty.
    update = nvrx.publish([_failing("gpu1")], settings, lambda node: [("100", "100")])
    assert update.written == ["segment_health_check.100.100"] and not update.errors
    found = os.stat(directory / nvrx.LOCK)
    assert stat.S_IMODE(found.st_mode) == 0o600 and found.st_size == 0


def test_an_nvrx_lock_of_another_account_is_refused_in_one_line(tmp_path):
    directory = tmp_path / "segments"
    directory.mkdir()
    (directory / nvrx.LOCK).write_text("")
    os.chown(directory / nvrx.LOCK, NOBODY, NOBODY)
    settings = SimpleNamespace(nvrx_segment_dir=directory, command_timeout_seconds=600)
    update = nvrx.publish([_failing("gpu1")], settings, lambda node: [("100", "100")])
    assert update.written == [] and len(update.errors) == 1
    assert update.errors[0].startswith(
        f"health.nvrx_segment_dir: {directory / nvrx.LOCK}: owned by another account than ckptops's"
    )
    assert "owner nobody (uid 65534)" in update.errors[0]
