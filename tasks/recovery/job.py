"""The failed job and its relaunch: what Slurm says about a job, the job's own batch script
checked and resubmitted (or, locally, run) as ``tasks.relaunch.launch`` starts it, Megatron-LM's
printed arguments read from the relaunch's own output as soon as they are there, its progress
watched through its step records, and the job stopped, found again or waited for.

Every Slurm call goes through ``tasks.cluster.slurm.run`` (an argv list with a timeout).
"""

import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.cluster import process, slurm
from tasks.errors import CkptopsError, Unreadable, UsageError
from tasks.job.step_records import Steps, iteration_lines, load_steps
from tasks.relaunch.launch import Launch, job_directory, watch_printed
from tasks.relaunch.precheck import RelaunchRefused, check_script
from tasks.relaunch.printed import PrintedArgs
from tasks.storage.local import open_regular

_POLL_SECONDS = 2.0


@dataclass
class SlurmJob:
    id: str
    name: str
    state: str
    nodes: list[str]
    tasks: int
    stdout: Path | None
    stderr: Path | None
    exit_code: int | None
    reason: str
    partition: str | None = None
    start_time: str | None = None
    end_time: str | None = None
    restarts: int = 0  # Slurm requeued it this often: each start is another attempt, another failure
    work_dir: Path | None = None  # where the batch script starts (relative paths in its arguments)

    def layout(self) -> dict[int, str]:
        """Rank -> node under Slurm's default block distribution (ranks fill a node, then the next)."""
        if not self.nodes:
            return {}
        per_node = max(1, self.tasks // len(self.nodes))
        return {rank: self.nodes[min(rank // per_node, len(self.nodes) - 1)] for rank in range(self.tasks)}


def slurm_job(job_id: str) -> SlurmJob:
    """What slurmctld remembers of ``job_id`` (it forgets finished jobs after MinJobAge)."""
    if not re.fullmatch(r"\d+(_\d+)?", str(job_id)):
        raise UsageError(f"Slurm job {job_id!r}: not a job id")
    try:
        text = slurm.run(["scontrol", "show", "job", "-o", str(job_id)])
    except CkptopsError as e:
        if "Invalid job id" in str(e):
            raise UsageError(f"Slurm job {job_id}: no such job (or slurmctld has forgotten it)") from None
        raise
    f = slurm.fields(text)
    nodelist = f.get("NodeList", "")
    nodes = slurm.expand_nodelist(nodelist) if nodelist and nodelist != "(null)" else []
    code = f.get("ExitCode", "")
    path = lambda key: Path(f[key]) if f.get(key) and f[key] != "(null)" else None  # noqa: E731
    return SlurmJob(
        id=f.get("JobId", str(job_id)),
        name=f.get("JobName", ""),
        state=f.get("JobState", "UNKNOWN"),
        nodes=nodes,
        tasks=int(f.get("NumTasks", "0") or 0) or len(nodes),
        stdout=path("StdOut"),
        stderr=path("StdErr"),
        exit_code=int(code.split(":")[0]) if code[:1].isdigit() else None,
        reason=f.get("Reason", ""),
        partition=f.get("Partition") or None,
        start_time=f.get("StartTime") or None,
        end_time=f.get("EndTime") or None,
        restarts=int(f.get("Restarts", "0") or 0) if f.get("Restarts", "0").isdigit() else 0,
        work_dir=path("WorkDir"),
    )


# Where a relaunch carries its incident's token: a local job's environment, a Slurm job's comment.
TOKEN_ENV = "CKPTOPS_INCIDENT"
JOB_ENV = "CKPTOPS_JOB"
COMMENT_PREFIX = "ckptops:"


def sbatch_command(
    settings,
    job_name: str,
    step: int,
    exclude: list[str],
    log_dir: Path,
    token: str | None = None,
    skip: tuple[int, ...] = (),
) -> list[str]:
    options = [
        f"--job-name={job_name}",
        # One instance of the job at a time: a relaunch never runs beside a straggling original.
        "--dependency=singleton",
    ]
    if token:
        options.append(f"--comment={COMMENT_PREFIX}{token}")
    if exclude:
        options.append(f"--exclude={','.join(sorted(exclude))}")
    if settings.nodes:
        options.append(f"--nodes={settings.nodes}")
    launch = Launch(settings.script, step, settings.pass_step, skip=skip)
    return ["sbatch", "--parsable", *launch.sbatch_arguments(options, log_dir / "%x-%j.out")]


def submit(settings, command: list[str], log_dir: Path) -> str:
    """Run ``command`` (``sbatch_command``'s, whose output goes to ``log_dir``) after checking
    the job's own script again; the new job id."""
    check_script(settings.script)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        out = slurm.run(command)
    except CkptopsError as e:
        raise RelaunchRefused(f"sbatch {settings.script}: {e}") from None
    return out.strip().split(";")[0]


def start_local(
    settings, job: str, step: int, log_dir: Path, token: str, skip: tuple[int, ...] = ()
) -> tuple[str, dict, Path]:
    """Run the job's own script with bash, detached (it outlives the recovery run): its id
    (``local:PID``), its process's identity (so a later recovery never takes another process
    that got the pid for it) and its output file (its own: named by ``token``, the incident).
    The job's name and ``token`` go in its environment; the identity carries the launch's own
    token too (``process.start``'s), by which ``cancel`` finds what left its process group."""
    check_script(settings.script)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"relaunch-{time.strftime('%Y%m%d-%H%M%S')}-{token}.out"
    env = {TOKEN_ENV: token, JOB_ENV: job}
    child = Launch(settings.script, step, settings.pass_step, env, skip).start(log)
    return f"local:{child.pid}", {**process.identity(child.pid), "token": child.token}, log


def _local_pid(job: str) -> int | None:
    return int(job.split(":", 1)[1]) if job.startswith("local:") else None


def relaunch_output(job: str, holder: dict | None, local_log: str | None) -> tuple[Path | None, Path | None]:
    """The relaunched job's own output file (where Megatron-LM's rank 0 prints its arguments:
    a local relaunch's file, a Slurm job's StdOut) and its working directory, as far as they are
    known (None each where not: a job slurmctld forgot, a process that has ended)."""
    pid = _local_pid(job)
    if pid is None:
        try:
            found = slurm_job(job)
        except CkptopsError:
            return None, None
        return found.stdout, found.work_dir
    cwd = job_directory(pid) if process.running(pid, holder) else None
    return (Path(local_log) if local_log else None), cwd


def output_offset(job: str) -> int:
    """The size of a Slurm job's output file now, right after it was submitted (0 when it is not
    there yet or not known): what it holds of earlier runs (``--open-mode=append``, a requeue)
    is not the relaunch's."""
    log, _ = relaunch_output(job, None, None)
    try:
        return log.stat().st_size if log else 0
    except OSError:
        return 0


def logged_iterations(log: Path, start: int = 0) -> int:
    """How many Megatron-LM iteration lines the relaunch's output holds so far, from byte
    ``start`` (0 while it has none, or cannot be read yet). Counted, not parsed: the watch asks
    at every poll."""
    try:
        with open_regular(log) as f:
            f.seek(start)
            return iteration_lines(f.read().decode(errors="replace"))
    except (UsageError, Unreadable):
        return 0


@dataclass
class RelaunchProgress:
    steps: int
    first_step_at: float | None
    last_iteration: int | None


@dataclass(frozen=True)
class Watched:
    """Where a relaunch's steps are read: the job's own step records past the ``before`` that
    were there at relaunch, or Megatron-LM's iteration lines in the relaunch's own output from
    byte ``start`` (what earlier runs wrote there is not the relaunch's)."""

    path: Path
    before: int = 0
    start: int = 0

    def __str__(self) -> str:
        return str(self.path) + (f" (from byte {self.start})" if self.start else "")

    def steps(self) -> Steps:
        """The relaunch's steps so far (an error while there are none to read)."""
        found = load_steps(self.path, self.start)
        return found.take(np.arange(min(self.before, len(found)), len(found)))

    def progress(self) -> RelaunchProgress:
        try:
            found = self.steps()
        except (UsageError, Unreadable):  # not written yet, or torn while the job writes it
            return RelaunchProgress(0, None, None)
        if not len(found):
            return RelaunchProgress(0, None, None)
        times = found.columns.get("time")
        first = float(times[0]) if times is not None and times.size and np.isfinite(times[0]) else None
        return RelaunchProgress(len(found), first, int(found.iteration[-1]))


def wait_printed(
    job: str,
    log: Path,
    sources: list[Watched],
    timeout_seconds: float,
    holder: dict | None = None,
    start: int = 0,
) -> PrintedArgs | None:
    """Megatron-LM's arguments block in the relaunch's output ``log`` as soon as it is complete
    (Megatron-LM prints it before it builds the model or loads the checkpoint); None when the job
    ends, or trains (an iteration line in ``log``, a step in one of ``sources``) without it
    having been printed there, or after ``timeout_seconds``. The log is read at the block's own
    pace; the job's state and its steps at the pace of the other waits."""
    checked, starting = 0.0, True

    def still_starting() -> bool:
        nonlocal checked, starting
        if time.monotonic() - checked >= _POLL_SECONDS:
            checked = time.monotonic()
            starting = alive(job, holder) and ahead(sources, 1)[1].steps == 0
        return starting and not logged_iterations(log, start)

    return watch_printed([log], timeout_seconds, still_starting, start)


# A local relaunch whose process is on another host: it may run, this host cannot tell.
ELSEWHERE = "ELSEWHERE"


def job_state(job: str, holder: dict | None = None) -> str:
    """RUNNING, PENDING, or an end state; a local relaunch is RUNNING while its process (the
    process ``holder`` names, when given) lives, ELSEWHERE when that process is another host's."""
    pid = _local_pid(job)
    if pid is not None:
        if holder is not None and holder.get("host") != socket.gethostname():
            return ELSEWHERE
        return "RUNNING" if process.running(pid, holder) else "ENDED"
    try:
        return slurm_job(job).state
    except UsageError:
        return "ENDED"


ACTIVE = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED", ELSEWHERE)


def alive(job: str, holder: dict | None = None) -> bool:
    """Whether the job may be queued or running (a cancelled or finished one is not; one on
    another host may be)."""
    return job_state(job, holder) in ACTIVE


def cancel(job: str, holder: dict | None = None, timeout_seconds: float = 60.0, hard: bool = False) -> str:
    """Stop a relaunched job and wait until it is gone (a relaunch that must not go on training
    must be gone before the incident says so): ``scancel``, or SIGTERM then SIGKILL to a local
    job's process group. ``hard``: SIGKILL at once (``scancel --signal=KILL --full`` first on
    Slurm), for a job that must not save on its way out (Megatron-LM's
    ``--exit-signal-handler`` saves on SIGTERM). What was done, for the incident's reason;
    never raises."""
    pid = _local_pid(job)
    try:
        if pid is not None:
            if job_state(job, holder) == ELSEWHERE:
                return f"job {job} runs on {holder.get('host')}: not cancelled from here, cancel it there"
            token = _launch_token(holder)
            ended = process.terminate(pid, min(30.0, timeout_seconds / 2), holder, hard, token)
            if not ended and isinstance((holder or {}).get("started"), (int, float)):
                # Its script ended; a child that left its session (setsid -f) may not have. Only
                # processes started since the script are read: never an older one stuck in I/O.
                process.kill_carrying(token, process.ticks_at(holder["started"]))
            return f"job {job} {'stopped' if ended else 'had already ended'}"
        if not alive(job):
            return f"job {job} had already ended"
        if hard:
            slurm.run(["scancel", "--signal=KILL", "--full", job])
        slurm.run(["scancel", job])
        state = wait_ended(job, timeout_seconds)
    except CkptopsError as e:
        return f"job {job} NOT known to be cancelled: {e}"
    return f"job {job} cancelled ({state})"


def _launch_token(holder: dict | None) -> str | None:
    """The launch's own token a local relaunch's identity carries (``start_local``), if it is
    one ``process.start`` makes (the identity comes back from an incident file)."""
    token = (holder or {}).get("token")
    return token if isinstance(token, str) and re.fullmatch(r"[0-9a-f]{16}", token) else None


def find_by_token(job_name: str, token: str, launcher: str) -> tuple[str, dict | None] | None:
    """A relaunch submitted with ``token`` that is still queued or running: its id (and a local
    one's process), found by its Slurm comment or its environment; None if there is none."""
    if launcher == "slurm":
        for line in slurm.run(["squeue", "-h", "--name", job_name, "-o", "%i %k"]).splitlines():
            fields = line.split(maxsplit=1)
            if len(fields) == 2 and fields[1].strip() == f"{COMMENT_PREFIX}{token}":
                return fields[0], None
        return None
    found = _local_jobs(TOKEN_ENV, token)
    return (f"local:{found[0]}", process.identity(found[0])) if found else None


def local_copies(job: str) -> list[int]:
    """The running local relaunches of ``job`` (by the name in their environment)."""
    return _local_jobs(JOB_ENV, job)


def _local_jobs(key: str, value: str) -> list[int]:
    """The outermost local processes whose environment has ``key=value`` (a relaunch's bash,
    not the ranks it started, which inherit it), oldest first."""
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "ppid", "create_time", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(key) == value:
                found[p.info["pid"]] = (p.info["ppid"], p.info["create_time"])
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    top = [pid for pid, (ppid, _) in found.items() if ppid not in found]
    return sorted(top, key=lambda pid: found[pid][1])


def wait_running(job: str, timeout_seconds: float, holder: dict | None = None) -> str:
    """Wait until the job leaves the queue; its state (RUNNING, or how it ended)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        state = job_state(job, holder)
        if state not in ("PENDING", "CONFIGURING", "REQUEUED"):
            return state
        if time.monotonic() > deadline:
            raise CkptopsError(f"job {job}: still {state} after {timeout_seconds:.0f}s")
        time.sleep(_POLL_SECONDS)


def wait_ended(job: str, timeout_seconds: float) -> str:
    """Wait until the job has ended; how it ended (an error past the timeout)."""
    deadline = time.monotonic() + timeout_seconds
    while (state := job_state(job)) in ACTIVE:
        if time.monotonic() > deadline:
            raise CkptopsError(f"job {job}: still {state} after {timeout_seconds:.0f}s")
        time.sleep(_POLL_SECONDS)
    return state


def ahead(sources: list[Watched], steps: int) -> tuple[Watched | None, RelaunchProgress]:
    """The first of ``sources`` that holds ``steps`` of the relaunch's steps, else the one that
    holds the most so far (None with no source)."""
    best: tuple[Watched | None, RelaunchProgress] = (None, RelaunchProgress(0, None, None))
    for source in sources:
        found = source.progress()
        if found.steps >= steps:
            return source, found
        if found.steps > best[1].steps or best[0] is None:
            best = (source, found)
    return best


def wait_progress(
    job: str, sources: list[Watched], steps: int, timeout_seconds: float, holder: dict | None = None
) -> tuple[Watched, RelaunchProgress]:
    """Wait until the relaunched job has ``steps`` steps in one of ``sources`` (its own step
    records, its own output): that source and what it holds. Ends early, with an error naming
    where it looked, when the job ends first."""
    where = " or ".join(map(str, sources))
    deadline = time.monotonic() + timeout_seconds
    while True:
        source, found = ahead(sources, steps)
        if found.steps >= steps:
            return source, found
        state = job_state(job, holder)
        if state not in ACTIVE:
            source, found = ahead(sources, steps)
            if found.steps >= steps:
                return source, found
            raise CkptopsError(
                f"job {job}: ended ({state}) after {found.steps} resumed steps, before {steps}; "
                f"see its output: {where}"
            )
        if time.monotonic() > deadline:
            raise CkptopsError(
                f"job {job}: {found.steps} resumed steps after {timeout_seconds:.0f}s, wanted {steps} "
                f"(read from {where})"
            )
        time.sleep(_POLL_SECONDS)
