"""A Python that has already imported torch and Megatron: the test suite's way to start its
training runs, drill loads and ckptops commands without importing them again each time.

Every Megatron process of the suite (torchrun's agent, each rank of the local job, each rank of
a drill's loader, under torchrun, srun or sbatch alike) spends most of its life importing torch
and megatron (about 5 CPU seconds per process here, against 1-3 of actual work), and each ckptops
command, shard task and flow run about 3 seconds importing torch and its other libraries. This
server imports them once per session and forks a ready process for each request, the way
multiprocessing's forkserver does. The request comes from the started process itself (a real
``python`` launched by whoever launches it, see ``startup/sitecustomize.py``): it hands over its
command line, environment, working directory and standard streams, then stands for the forked
process until it ends, passing signals on and exiting with its status (or its signal).

    python -m tests.helpers.warm.server FLAVOR SOCKET

Four flavors (``FLAVORS``): ``training`` (Megatron-LM's loop: ``infra/local_job/pretrain.py``),
``core`` (the drill's loader, the other test loop), ``torchrun`` (its agent) and ``ckptops`` (the CLI,
flow runs, Prefect's server and CLI, pytest-xdist's workers). The process
a request gets is a fresh session with the request's argv, environment, cwd, streams, default
signal handlers and warning filters, the repository's own modules not yet imported; what is left
of it (its own children) is killed when it ends, and when its stand-in is killed, so is it.
"""

import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import types
import warnings
from dataclasses import dataclass

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# What each flavor imports before it forks (its entries are in startup/sitecustomize.py), and the
# environment it imports under. Megatron's processes: exactly what their entries import, under
# the environment every launcher of ours gives them (launch.job_env and loader_env, job.sh.in),
# which torch and OpenMP read while they are imported. ckptops' own processes (the CLI, a flow
# run, a shard task) and Prefect's (its server and CLI; its worker starts cold, see
# startup/sitecustomize.py): the libraries they spend their start on. Prefect reads its settings
# from the environment when it is imported, into one global context, which each forked process
# builds again from its own environment (``_run``).
FLAVORS = {
    "training": ("infra.local_job.pretrain",),
    "core": ("tasks.restore.loader", "tests.helpers.core_loop"),
    # torchrun's agent alone: its rendezvous names its callers with inspect.stack(), which walks
    # every imported module for each frame, 0.15 CPU-s an agent beside torch alone, 0.9 s beside
    # the 3,300 modules of Megatron's flavors.
    "torchrun": ("torch.distributed.run",),
    "ckptops": (
        "torch",
        "torch.distributed.checkpoint",
        # The safe loader's allow-list of the common state (tasks/checkpoint/dcp.py), and with it
        # megatron.core's package: importing it costs every verifying process 2-3 s of CPU, ten
        # times its verification, and every pytest-xdist worker as it collects the tests.
        "megatron.core.safe_globals",
        "numpy",
        "sympy",
        "paramiko",
        "pydantic",
        "pydantic_settings",
        "httpx",
        "jsonschema",
        "griffe",
        "typer",
        "rich",
        "fsspec",
        "prefect",
        "boto3",  # the archive's store client, which a pytest-xdist worker imports to collect
    ),
}
# And what the entries import while they run, measured (``sys.modules`` before and after a run of
# the local job, a drill's load, Prefect's server start): imported here, a fork does not pay it
# again. A training rank paid about 1.1 CPU-s for them (TorchDynamo and Inductor, which
# megatron-core reaches for at its first step, the dataset builder, the tokenizers, boto3 for
# object-store datasets), a drill's load as much, a Prefect server 2.7 s. Nothing whose import
# configures logging: Megatron-LM's argument parser sets INFO, and a warm CLI then printed
# Megatron's INFO lines into its JSON (a cold one imports it after its own logging is set).
RUNTIME = {
    "training": (
        "torch._dynamo",
        "torch._inductor",
        "megatron.core.datasets.blended_megatron_dataset_builder",
        "megatron.core.datasets.gpt_dataset",
        "megatron.core.datasets.helpers",
        "megatron.core.tokenizers.text.text_tokenizer",
        "megatron.core.tokenizers.text.models.gpt_tokenizer",
        "megatron.core.tokenizers.text.libraries.null_tokenizer",
        "megatron.core.models.mimo",
        "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
        "boto3",
    ),
    "core": ("torch._dynamo", "torch._inductor", "megatron.core.models.mimo"),
    "torchrun": (),
    "ckptops": ("prefect.server.api.server", "prefect.cli", "prefect.cli.server", "uvicorn", "alembic"),
}
MEGATRON = ("training", "core", "torchrun")
MEGATRON_ENV = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "THP_MEM_ALLOC_ENABLE": "1"}
IMPORT_ENV = {"training": MEGATRON_ENV, "core": MEGATRON_ENV, "torchrun": MEGATRON_ENV, "ckptops": {}}

PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphans of the process come to its supervisor


@dataclass(frozen=True)
class Defaults:
    """What a new interpreter starts with, to give each forked process."""

    warning_filters: list
    threads: int  # torch's, where OMP_NUM_THREADS does not say


# The repository's own top-level packages and modules (tasks, flows, infra, tests, ...).
OURS = frozenset(
    name.removesuffix(".py")
    for name in os.listdir(REPO)
    if name.endswith(".py") or os.path.exists(os.path.join(REPO, name, "__init__.py"))
)


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """One request: a length-prefixed JSON header with the three standard streams' descriptors."""
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    (length,) = struct.unpack("!Q", header)
    body = b""
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            raise EOFError("the requester went away")
        body += chunk
    return json.loads(body), fds


def parse_command(orig_argv: list[str]) -> tuple[str, str, list[str], bool, list[str]]:
    """(kind, target, sys.argv, unbuffered, -W options) of
    ``python [options] (script | -m mod | -c code) args``."""
    unbuffered, warn_options, i = False, [], 1
    while i < len(orig_argv):
        arg = orig_argv[i]
        if arg == "-m":
            module = orig_argv[i + 1]
            return "module", module, [module, *orig_argv[i + 2 :]], unbuffered, warn_options
        if arg == "-c":
            return "code", orig_argv[i + 1], ["-c", *orig_argv[i + 2 :]], unbuffered, warn_options
        if arg in ("-W", "-X"):
            if arg == "-W":
                warn_options.append(orig_argv[i + 1])
            i += 2
            continue
        if arg.startswith("-") and arg != "-":
            unbuffered = unbuffered or ("u" in arg[1:] and not arg.startswith("--"))
            i += 1
            continue
        return "script", arg, orig_argv[i:], unbuffered, warn_options
    raise ValueError(f"no script or module in {orig_argv}")


def _streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2, buffered as a new interpreter would buffer them."""
    for name, fd, mode in (("stdin", 0, "rb"), ("stdout", 1, "wb"), ("stderr", 2, "wb")):
        binary = os.fdopen(fd, mode, buffering=0 if unbuffered and mode == "wb" else -1, closefd=False)
        interactive = os.isatty(fd)
        text = io.TextIOWrapper(
            binary,
            encoding="utf-8",
            errors="backslashreplace" if name == "stderr" else "strict",
            line_buffering=interactive or name == "stderr",
            write_through=unbuffered and mode == "wb",
        )
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run(request: dict, fds: list[int], defaults: Defaults) -> None:
    """Become the requested process (never returns)."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "prefect.context" in sys.modules:
            sys.modules["prefect.context"].refresh_global_settings_context()
        kind, target, argv, unbuffered, warn_options = parse_command(request["argv"])
        unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
        _streams(unbuffered)
        warnings.filters[:] = defaults.warning_filters
        from_env = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
        warnings._processoptions(warn_options + from_env)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        sys.modules["torch"].set_num_threads(int(threads) if threads.isdigit() else defaults.threads)
        for name in list(sys.modules):  # the repository's own code runs afresh, as in a new interpreter
            if name.split(".", 1)[0] in OURS:
                del sys.modules[name]
        sys.argv = argv
        if kind == "module":
            sys.path[0] = request["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "code":  # as ``python -c``: in a new __main__, the working directory first
            sys.path[0] = ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(target)
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _end_all(pid: int) -> None:
    """SIGKILL the process and everything it started and left (its orphans came to this
    supervisor, a subreaper), and reap them: what ``tasks.cluster.process`` does to the
    descendants of a Megatron launch (torchrun's ranks run in sessions of their own) once it
    ends or is killed."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    while True:
        left = psutil.Process().children(recursive=True)
        for child in left:
            with contextlib.suppress(psutil.Error):
                child.kill()
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            if not left:
                return


def _end_group(pid: int) -> None:
    """SIGKILL the process's group, as a SIGKILL to its stand-in's group would have killed it and
    the children it started in its group; children in sessions of their own (a job a recovery
    relaunched) outlive it, as they outlive a process killed outright."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _supervise(connection: socket.socket, defaults: Defaults, megatron: bool) -> None:
    """Fork the requested process and stand between it and its requester (never returns). A
    Megatron process takes everything it started with it when it ends; ckptops' processes leave
    alone what outlives them (a relaunched job), as they would if started cold."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if megatron:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    request, fds = _receive(connection)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run(request, fds, defaults)
    for fd in fds:
        os.close(fd)
    exited = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([connection, exited], [], [])
        if exited in ready:
            _, status = os.waitpid(pid, 0)
            if megatron:
                _end_all(pid)
            with contextlib.suppress(OSError):
                connection.sendall(struct.pack("!q", os.waitstatus_to_exitcode(status)))
            os._exit(0)
        data = connection.recv(64)
        if not data:  # the stand-in was killed outright: so is the process it stood for
            (_end_all if megatron else _end_group)(pid)
            os._exit(0)
        for (sig,) in struct.iter_unpack("!i", data[: len(data) // 4 * 4]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _remember_field_docstrings() -> None:
    """Megatron-LM builds its argument parser twice per rank (fault tolerance's setup, then
    ``parse_args``), each time reading the source of its config dataclasses for their field
    docstrings (``inspect.getsource`` and ``ast.parse``: about 0.3 CPU-s a rank). The result
    depends only on those classes' source, so it is computed here once per class and each fork
    gets it: the parser a rank builds is the same."""
    import functools

    from megatron.training import argument_utils
    from megatron.training.arguments import add_megatron_arguments

    factory = argument_utils.ArgumentGroupFactory
    compute = factory._get_field_docstrings

    @functools.cache
    def by_class(source_class: type) -> dict[str, str]:
        return compute(factory.__new__(factory), source_class)

    factory._get_field_docstrings = lambda self, source_class: dict(by_class(source_class))
    add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def serve(flavor: str, path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(128)
    os.rename(path + ".tmp", path)  # requests queue from here on, while the imports run
    warning_filters = list(warnings.filters)
    for name in FLAVORS[flavor] + RUNTIME[flavor]:
        importlib.import_module(name)
    if flavor == "training":
        _remember_field_docstrings()
    defaults = Defaults(warning_filters, sys.modules["torch"].get_num_threads())
    if threading.active_count() != 1:
        raise SystemExit(f"warm {flavor}: threads left by the imports: {threading.enumerate()}")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    # Objects from the imports are never freed: kept out of every collection, a forked child's
    # collections neither walk them nor dirty their copy-on-write pages.
    gc.collect()
    gc.freeze()
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            try:
                _supervise(connection, defaults, flavor in MEGATRON)
            finally:
                os._exit(1)
        connection.close()


if __name__ == "__main__":
    os.environ.update(IMPORT_ENV[sys.argv[1]])
    serve(sys.argv[1], sys.argv[2])
