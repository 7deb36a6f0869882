"""Running a local command to its end: a time limit, its output kept in a log, and nothing it
started left running afterwards, however it ended.

Training and loading jobs hang rather than crash in many failure modes, and a dead torchrun rank
leaves helpers behind (megatron's checkpoint writer Manager, a process group of its own): every
process the command started is noted while it runs and killed, with its group, at the end. A
process that left the tree before it was noted (``setsid -f``, a double fork: reparented to init)
is found by a variable of the command's own in its environment (``start`` sets it, its children
inherit it; /proc/PID/environ, read bounded) and killed too; one that clears its environment is
not. Only processes that started no earlier than the command are read (their start time in
/proc/PID/stat, which never blocks, unlike environ on a process stuck in uninterruptible I/O), and
each is signalled through a pidfd opened before its environment is read, so a pid the kernel gave
to another process meanwhile is never signalled.
"""

import contextlib
import os
import secrets
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.errors import CkptopsError
from tasks.storage.local import open_for_writing

_POLL_SECONDS = 0.5
# The variable ``start`` adds to a command's environment, a random name each (``TOKEN`` and 16 hex
# digits): a command started inside another keeps its ancestor's too.
TOKEN = "CKPTOPS_STARTED_"
_ENVIRON_BYTES = 4 << 20  # the most read of one process's environment (Linux allows 2 MiB of it at exec)
_SWEEP_SECONDS = 10.0  # the most spent finding a command's processes by their environment
_SWEEPS = 4  # passes over /proc: a process forked while the one before was killed is found by the next


class TimedOut(CkptopsError):
    """The command ran past its time limit (it and everything it started were killed)."""


class Failed(CkptopsError):
    """The command exited non-zero; ``code`` is its exit status and ``log`` where it wrote."""

    def __init__(self, message: str, code: int, log: Path):
        super().__init__(message)
        self.code, self.log = code, log


@dataclass
class Output:
    """What a command printed and how it ended; ``exit_code`` None: it ran past its timeout."""

    argv: list[str]
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


def capture(argv: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> Output:
    """Run a short command to its end and keep what it printed: a time limit, past which it and
    every process of its group are killed; a command that is not installed exits 127, as in a
    shell. Every subprocess ckptops waits on goes through here or ``run``."""
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True
        )
    except FileNotFoundError:
        return Output(argv, 127, "", f"{argv[0]}: command not found", time.monotonic() - started)
    except OSError as e:  # there, but not to be run (no execute permission, not an executable)
        return Output(argv, 126, "", f"{argv[0]}: {e.strerror or e}", time.monotonic() - started)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        code = None
    text = lambda data: data.decode(errors="replace")  # noqa: E731
    return Output(argv, code, text(stdout), text(stderr), time.monotonic() - started)


def identity(pid: int | None = None) -> dict:
    """Who holds something (a lease, a scratch directory): host, pid and the process's start
    time, so that a pid the kernel gave to another process is not taken for the holder."""
    process = psutil.Process(pid or os.getpid())
    return {"host": socket.gethostname(), "pid": process.pid, "started": process.create_time()}


def gone(holder: dict) -> str | None:
    """Why ``holder`` (an ``identity``) no longer runs, if this host can tell: None while it runs,
    and None for another host's process (only its age can retire it)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid < 0:
        return None
    try:
        started = psutil.Process(holder["pid"]).create_time()
    except psutil.NoSuchProcess:
        return f"process {holder['pid']} is gone"
    except psutil.Error:
        return None
    recorded = holder.get("started")
    if not isinstance(recorded, int | float) or isinstance(recorded, bool):
        return f"process {holder['pid']}: no start time recorded, so not provably the holder"
    if abs(started - recorded) > 1.0:
        return f"process {holder['pid']} is gone (the pid now belongs to another process)"
    return None


def start(
    argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None, append: bool = False
) -> subprocess.Popen:
    """Start ``argv`` in a session of its own, stdout and stderr into ``log`` (after what it
    holds, with ``append``). Every process ckptops starts and leaves running starts here. The
    log is opened by ``open_for_writing``: a link planted at its name is refused, never followed.
    Its environment (``env``, else this process's) gets a variable of its own, named by the
    returned process's ``token``, which ``wait`` and ``terminate`` find its escaped children by."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    env = {**(os.environ if env is None else env), f"{TOKEN}{token}": "1"}
    sink = open_for_writing(log, append=append, truncate=not append)
    try:
        started = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    finally:
        os.close(sink)
    started.token = token
    started.start_ticks = start_ticks(started.pid)  # our child, not reaped yet: its stat is there
    return started


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat's 22nd field, read without
    touching the process's memory: it does not block on a process stuck in I/O); None when it
    cannot be read (gone, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # fields after the name, from the 3rd
    except (OSError, ValueError, IndexError):
        return None


def ticks_at(epoch: float) -> int:
    """``start_ticks``'s clock at ``epoch`` (seconds since the epoch, as ``identity`` keeps a
    process's start), one tick early: psutil's start time is boot time plus the ticks, rounded."""
    return max(0, int((epoch - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")) - 1)


def running(pid: int, holder: dict | None = None) -> bool:
    """Whether ``pid`` still runs (a zombie does not, and is reaped if it is our child); with
    ``holder`` (an ``identity``), only if it is still that process and not a reuse of its pid."""
    if holder is not None and gone(holder):
        return False
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return False


def terminate(
    pid: int,
    grace_seconds: float = 30.0,
    holder: dict | None = None,
    hard: bool = False,
    token: str | None = None,
) -> bool:
    """End a process started by ``start`` (a session and a group of its own) and everything it
    started: SIGTERM to its group (a job's launcher passes it on to its ranks), then, whatever is
    left after ``grace_seconds``, SIGKILL to every group and process it started, and with
    ``token`` (its ``start``'s) to every process carrying it. ``hard``: SIGKILL at once, for a
    run that must not do one more thing (Megatron-LM's ``--exit-signal-handler`` turns SIGTERM
    into a save into ``--save``). False when it was not running; returns once all of it is gone
    (or, for a process stuck in I/O the kernel does not interrupt, after another
    ``grace_seconds``, 30 s when ``hard``)."""
    if not running(pid, holder):
        return False
    since = start_ticks(pid)  # what it started started after it: older processes are not read
    descendants: dict[int, int] = {}
    _note_descendants(pid, descendants)
    if not hard:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(running(p) for p in (pid, *descendants)):
            time.sleep(_POLL_SECONDS)
    else:
        grace_seconds = 30.0
    for group in {pid, *descendants.values()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for child in (pid, *descendants):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    kill_carrying(token, since)
    deadline = time.monotonic() + grace_seconds  # a process in uninterruptible I/O may linger
    while time.monotonic() < deadline and any(running(p) for p in (pid, *descendants)):
        time.sleep(0.05)
    return True


def tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(Path(log).read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def wait(process: subprocess.Popen, log: Path, timeout_seconds: float, what: str = "the command") -> None:
    """Wait for ``process``; then kill everything it started, and raise if it failed or timed out."""
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
    if code is None:
        raise TimedOut(f"{log}: {what} timed out after {timeout_seconds:.0f}s: {tail(log)}")
    if code != 0:
        raise Failed(f"{log}: {what} exited {code}: {tail(log)}", code, Path(log))


def run(
    argv: list[str],
    log: Path,
    timeout_seconds: float,
    env: dict | None = None,
    what: str = "the command",
    cwd: Path | None = None,
) -> None:
    """Run ``argv`` to its end with ``wait``'s guarantees."""
    wait(start(argv, log, env, cwd), log, timeout_seconds, what)


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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    kill_carrying(getattr(process, "token", None), getattr(process, "start_ticks", None))
    process.wait()


def carrying(token: str, deadline: float, since: int | None = None) -> list[int]:
    """The processes of this host whose environment holds ``token``'s variable, read from
    /proc/PID/environ (at most ``_ENVIRON_BYTES`` each) until ``deadline`` (``time.monotonic``):
    what ``start`` started, wherever it went since. With ``since`` (``start_ticks`` of the
    command), only those that started no earlier are read. One that cannot be read (gone,
    another user's) is passed over; so is this process."""
    found = _carriers(token, deadline, since, signalled=False)
    return [pid for pid, _ in found]


def _carriers(
    token: str, deadline: float, since: int | None, signalled: bool
) -> list[tuple[int, int | None]]:
    """``carrying``'s processes, each with a pidfd opened before its environment was read
    (``signalled``, where the kernel has pidfds; else None): the process that was read, or one
    gone since, never a later holder of its pid."""
    needle = f"{TOKEN}{token}=".encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if time.monotonic() > deadline:
            break
        if not name.isdigit() or int(name) == os.getpid():
            continue
        started = start_ticks(int(name)) if since is not None else None
        if since is not None and (started is None or started < since):
            continue  # older than the command (never its), or gone: its environment is not read
        fd = _pidfd(int(name)) if signalled else None
        if _holds(name, needle):
            found.append((int(name), fd))
        elif fd is not None:
            os.close(fd)
    return found


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds here (an old kernel), or gone already
        return None


def _holds(name: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{name}/environ", "rb") as f:
            environ = f.read(_ENVIRON_BYTES)
    except OSError:
        return False
    return environ.startswith(needle) or b"\0" + needle in environ


def kill_carrying(token: str | None, since: int | None = None) -> list[int]:
    """SIGKILL every process carrying ``token`` (``carrying``; with ``since``, those started no
    earlier), and the group of each that leads one, pass after pass until none is found (a
    killed process is a zombie with no environment left) or ``_SWEEPS`` passes or
    ``_SWEEP_SECONDS`` are spent; the processes killed. Each is signalled through its pidfd where
    the kernel has them (a pid reused meanwhile is not signalled)."""
    if token is None:
        return []
    deadline = time.monotonic() + _SWEEP_SECONDS
    killed: list[int] = []
    for _ in range(_SWEEPS):
        found = _carriers(token, deadline, since, signalled=True)
        if not found:
            break
        for pid, fd in found:
            _kill(pid, fd, deadline)
        killed += [pid for pid, _ in found]
    return killed


def _kill(pid: int, fd: int | None, deadline: float) -> None:
    """SIGKILL ``pid``'s group where it leads one, then ``pid``: by its pidfd ``fd`` (closed
    here) when there is one, the group only while the pidfd says its leader still runs, and then
    waits for it to be gone (its pidfd readable) until ``deadline`` (``time.monotonic``): a
    signal is delivered when the process is next scheduled, which on a busy host is later."""
    try:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if fd is not None:
                signal.pidfd_send_signal(fd, 0)  # raises once it is gone: its pid may be another's
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        if fd is not None:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        if fd is not None:
            os.close(fd)
