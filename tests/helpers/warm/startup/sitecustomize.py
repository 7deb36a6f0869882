"""The requesting side of the test suite's warm start (``tests/helpers/warm/server.py``).

On the test session's PYTHONPATH, Python imports this at every start. In a process that is one
of the entries below (Megatron's: the local job, the other test loop, the drill's loader,
torchrun, the Flight Recorder's hang job; ckptops': the CLI, a shard task, a flow run a worker
starts, Prefect's server and CLI, the promotion tests' child, pytest-xdist's workers), started
by this venv's Python in the servers' mount namespace while they run, it asks the flavor's
server for a forked, already-imported process to run the same command line with its
environment, working directory and standard streams, stands for it until it ends (signals
passed on) and exits as it exited.
Everywhere else, and whenever no server answers, it does nothing and the process starts as
usual.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

ENTRIES = {
    ("script", "pretrain.py"): "training",
    ("script", "core_loop.py"): "core",
    ("module", "tasks.restore.loader"): "core",
    ("module", "torch.distributed.run"): "torchrun",
    ("script", "hang_job.py"): "core",
    ("script", "promote_child.py"): "ckptops",
    ("script", "ckptops"): "ckptops",
    ("module", "tasks.checkpoint.shard_worker"): "ckptops",
    ("module", "prefect.runner._workspace_supervisor"): "ckptops",
    ("module", "prefect.engine"): "ckptops",
    ("module", "prefect"): "ckptops",  # its server and CLI; not its worker (COLD)
    # pytest-xdist's workers: execnet starts each as ``python -u -c BOOTSTRAP`` and sends it its
    # code on stdin. Cold, each imported torch, megatron.core and Prefect again to collect the
    # tests (about 8 of its 11 CPU-s), four at once at the start of every run.
    ("code", "import sys;exec(eval(sys.stdin.readline()))"): "ckptops",
}
# Started cold though their entry is warm: a Prefect worker (``-m prefect worker``). Whoever kills
# a worker with everything it started walks its children (a host that goes away, test_watchdog);
# a warm worker's flow runs would be children of its forked process, not of what stands for it.
COLD = (("prefect", "worker"),)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _flavor(argv: list[str]) -> str | None:
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            if i + 1 >= len(argv) or tuple(argv[i + 1 : i + 3]) in COLD:
                return None
            return ENTRIES.get(("module", argv[i + 1]))
        if arg == "-c":
            return ENTRIES.get(("code", argv[i + 1])) if i + 1 < len(argv) else None
        if arg.startswith("-"):
            i += 2 if arg in ("-W", "-X") else 1
            continue
        return ENTRIES.get(("script", os.path.basename(arg)))
    return None


def _stand_in(path: str) -> None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return  # no server: start as usual
    body = json.dumps({"argv": sys.orig_argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(connection, [struct.pack("!Q", len(body))], [0, 1, 2])
        connection.sendall(body)
    except OSError:
        connection.close()
        return  # the server could not take it: start as usual
    try:
        os._exit(_stand_for(connection))
    finally:  # never go on to start the command here as well
        os._exit(1)


def _stand_for(connection: socket.socket) -> int:
    """Pass signals on until the process ends; its exit status (a signal: ended by that signal)."""

    def forward(sig, frame):
        with contextlib.suppress(OSError):
            connection.sendall(struct.pack("!i", sig))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = b""
    while len(status) < 8:
        chunk = connection.recv(8 - len(status))
        if not chunk:
            os.write(2, b"warm start: the server went away before the process ended\n")
            return 1
        status += chunk
    (code,) = struct.unpack("!q", status)
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _main() -> None:
    folder = os.environ.get("CKPTOPS_WARM_DIR")
    if not folder or sys.prefix != os.environ.get("CKPTOPS_WARM_PREFIX"):
        return
    # A process in another mount namespace (a Slurm node whose file systems differ) sees other
    # files than the servers do: it starts as usual.
    if os.readlink("/proc/self/ns/mnt") != os.environ.get("CKPTOPS_WARM_MOUNTS"):
        return
    flavor = _flavor(sys.orig_argv)
    if flavor:
        _stand_in(os.path.join(folder, f"{flavor}.sock"))


_main()
