"""The Slurm verify engine: one checkpoint's bytes read by shard tasks on many nodes.

The coordinator (this module, on the host that runs the verify) plans the shards, starts one
``srun`` with one task per shard (inside the caller's allocation when there is one, else in an
allocation of its own), follows the tasks' progress notes, and merges their results into the
per-file scans the verifier judges. The structure checks (metadata, coverage, objects, state)
stay with the verifier on the coordinator; only where the bytes are read changes.

A shard whose task fails, writes no result or a malformed one, or straggles (still running at
``straggler_factor`` times the median shard time, once half are done) is retried alone on
another node in service, at most twice; the first result to land wins. A shard that no node could
read leaves the verification without a verdict (``ShardsFailed``): never a pass, never a fail.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint.scan import FileScan, Record, stat_key
from tasks.checkpoint.shards import (
    PLAN,
    Shard,
    ShardPlan,
    ShardResult,
    assign_records,
    merge,
    plan_shards,
    progress_path,
    read_result,
    result_path,
    write_plan,
)
from tasks.cluster import process, slurm
from tasks.errors import CkptopsError, Malformed, Unreadable, UsageError, unreadable
from tasks.storage.digest import Hashing

RETRIES = 2
WORK_DIR = ".ckptops-verify"
_POLL_SECONDS = 0.2
_STOP_GRACE_SECONDS = 10
_RESULT_GRACE_SECONDS = 5
_NO_NODE_BACKOFF_SECONDS = 10
_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-(\d+))?: (.*)")


class ShardsFailed(Unreadable):
    """Some shard could not be read on any node tried: the verification has no verdict."""


@dataclass
class Attempt:
    number: int
    started: float
    node: str | None = None
    state: str = "running"  # running, done, failed, stopped (another attempt won)
    error: str | None = None
    seconds: float = 0.0
    bytes: int = 0


@dataclass
class ShardStatus:
    index: int
    bytes: int
    files: int
    attempts: list[Attempt] = field(default_factory=list)
    result: ShardResult | None = None
    gave_up: bool = False  # no other node was left to retry on
    next_try: float = 0.0  # a straggler with no free node waits until then before asking again

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def running(self) -> list[Attempt]:
        return [a for a in self.attempts if a.state == "running"]

    @property
    def failed(self) -> bool:
        """Every attempt it may have has failed."""
        return not self.done and not self.running and (self.gave_up or len(self.attempts) > RETRIES)

    @property
    def nodes(self) -> list[str]:
        return [a.node or "?" for a in self.attempts]

    @property
    def read(self) -> int:
        return max((a.bytes for a in self.attempts), default=0)

    def state(self) -> str:
        if self.done:
            return "done"
        if self.failed:
            return "failed"
        return "retrying" if len(self.attempts) > 1 else "running"

    def row(self) -> dict:
        """One line of the per-shard table (terminal, UI artifact, manifest)."""
        winner = next((a for a in self.attempts if a.state == "done"), None)
        seconds = winner.seconds if winner else 0.0
        return {
            "shard": self.index,
            "files": self.files,
            "MB": round(self.bytes / 1e6, 1),
            "read %": round(100 * min(1.0, self.read / self.bytes), 1) if self.bytes else 100.0,
            "state": self.state(),
            "nodes": " -> ".join(self.nodes),
            "seconds": round(seconds, 2),
            "MB/s": round(self.bytes / seconds / 1e6, 1) if seconds else 0.0,
            "errors": "; ".join(f"{a.node or '?'}: {a.error}" for a in self.attempts if a.error),
        }


Watch = Callable[[list[ShardStatus], list[str]], None]


def time_limit_seconds(text: str) -> float:
    """Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_NODELIST"))


@dataclass
class _Step:
    """One srun: the first, with every shard, or a retry of one shard."""

    popen: process.subprocess.Popen
    name: str
    log: Path
    attempt: int
    shards: list[int]
    ended: float = 0.0  # when this host first saw the srun gone


class SlurmEngine:
    """Reads one checkpoint's files through shard tasks; ``scan`` returns what ``scan_files``
    would on one host, and ``statuses`` says which nodes read what."""

    def __init__(self, settings, progress: Callable[[int], None] | None = None, watch: Watch | None = None):
        self.settings = settings
        self.progress = progress
        self.watch = watch
        self.statuses: list[ShardStatus] = []
        self._steps: list[_Step] = []
        self._reported = 0
        self._job = "ckptops-verify"

    def scan(
        self,
        directory: Path,
        files: dict[str, list[Record]],
        sha256_for: set[str],
        hashing: Hashing,
    ) -> dict[str, FileScan]:
        if shutil.which("srun") is None:
            raise UsageError(
                "srun: not found on this host (verify.engine is slurm): "
                "install Slurm's client commands, or use --engine local"
            )
        nodes = self._nodes()
        stats = {name: _stat(directory / name) for name in files}
        sizes = {name: st[1] if st else 0 for name, st in stats.items()}
        per_node = self.settings.ntasks_per_node
        shards, owned = assign_records(
            plan_shards(sizes, len(nodes) * per_node, hashing.segment_bytes, set(sha256_for)), files
        )
        used_nodes = -(-len(shards) // per_node)
        plan = ShardPlan(
            str(directory),
            hashing.segment_bytes,
            per_node if used_nodes > 1 else 0,
            shards,
            self.settings.max_read_mbps,
            self.settings.drop_cache,
            hashing.algorithm,
        )
        root = Path(self.settings.work_dir or directory.parent / WORK_DIR)
        work = root / f"{directory.name}-{uuid.uuid4().hex[:8]}"
        try:
            work.mkdir(parents=True)
            write_plan(work, plan, owned)
        except OSError as e:
            raise unreadable(work, e) from None
        self._job = f"ckptops-verify-{directory.name}"
        self.statuses = [ShardStatus(s.index, s.bytes, len(s.files)) for s in shards]
        try:
            self._run(plan, work, used_nodes)
        finally:
            self._stop_all(work)
        failed = [s for s in self.statuses if not s.done]
        if failed:
            raise ShardsFailed(self._failure_line(directory, failed, shards, work))
        shutil.rmtree(work, ignore_errors=True)
        return merge(shards, {s.index: s.result for s in self.statuses}, stats, hashing.algorithm)

    # -- nodes

    def _nodes(self) -> list[str]:
        wanted = self.settings.nodes
        if _in_allocation():
            have = slurm.expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
            where = f"this allocation (job {os.environ['SLURM_JOB_ID']})"
        else:
            have = slurm.usable_nodes(self.settings.partition)
            where = f"partition {self.settings.partition}" if self.settings.partition else "the cluster"
        if wanted > len(have):
            raise UsageError(
                f"--nodes {wanted}: {where} has {len(have)} node(s) in service"
                + (f" ({', '.join(have)})" if have else "")
            )
        return have[:wanted]

    def _in_service(self) -> list[str] | None:
        """The nodes a retry may use now, asked afresh (a node may have been drained since the
        run began); None when Slurm does not answer (the retry waits for the next poll)."""
        try:
            if _in_allocation():
                in_service = set(slurm.usable_nodes(None))
                return [n for n in slurm.expand_nodelist(os.environ["SLURM_JOB_NODELIST"]) if n in in_service]
            return slurm.usable_nodes(self.settings.partition)
        except CkptopsError:
            return None

    @staticmethod
    def _retry_node(status: ShardStatus, pool: list[str], busy: set[str]) -> str | None:
        """Another node in service for a shard's retry: not one it already ran on, idle if any."""
        tried = {a.node for a in status.attempts}
        free = [n for n in pool if n not in tried]
        return next((n for n in free if n not in busy), free[0] if free else None)

    # -- running

    def _srun(self, work: Path, name: str, placement: list[str], worker: list[str]) -> list[str]:
        settings = self.settings
        argv = ["srun", f"--job-name={self._job}-{name}", "--kill-on-bad-exit=0", "--no-kill"]
        if _in_allocation():
            argv.append("--overlap")  # a step beside the caller's own, on the allocation's nodes
        else:
            argv.append(f"--time={settings.time_limit}")
            argv += [f"--partition={settings.partition}"] * bool(settings.partition)
            argv += [f"--account={settings.account}"] * bool(settings.account)
        argv += [*placement, f"--error={work}/task-%t-{name}.err", *settings.srun_args]
        python = settings.python or sys.executable
        return argv + [python, "-m", "tasks.checkpoint.shard_worker", str(work / PLAN), *worker]

    def _run(self, plan: ShardPlan, work: Path, nodes: int) -> None:
        count = len(plan.shards)
        started = time.monotonic()
        for status in self.statuses:
            status.attempts.append(Attempt(0, started))
        placement = [
            f"--nodes={nodes}",
            f"--ntasks={count}",
            f"--ntasks-per-node={self.settings.ntasks_per_node}",
        ]
        log = work / "srun-a0.log"
        argv = self._srun(work, "a0", placement, ["--attempt", "0"])
        self._steps.append(_Step(process.start(argv, log), "a0", log, 0, list(range(count))))
        deadline = started + time_limit_seconds(self.settings.time_limit) + 60
        while not all(s.done or s.failed for s in self.statuses):
            events = self._poll(plan, work)
            if time.monotonic() > deadline:
                for status in self.statuses:
                    for attempt in status.running:
                        self._fail(
                            status,
                            attempt,
                            f"still running at the time limit {self.settings.time_limit}",
                            events,
                        )
                self._notify(events)
                return
            self._retry(plan, work, events)
            self._notify(events)
            time.sleep(_POLL_SECONDS)
        self._notify([])

    def _poll(self, plan: ShardPlan, work: Path) -> list[str]:
        """Collect progress notes and results; an attempt whose srun has exited without leaving
        a usable result has failed."""
        self._refuse_if_srun_failed(work)
        events: list[str] = []
        for status in self.statuses:
            for attempt in status.attempts:
                note = _read_progress(progress_path(work, status.index, attempt.number))
                if note:
                    attempt.node = attempt.node or note.get("node")
                    attempt.bytes = max(attempt.bytes, int(note.get("bytes") or 0))
                if attempt.state == "running":
                    self._collect(plan, work, status, attempt, events)
        if self.progress:
            total = sum(s.read for s in self.statuses)
            if total > self._reported:
                self.progress(total - self._reported)
                self._reported = total
        return events

    def _collect(
        self, plan: ShardPlan, work: Path, status: ShardStatus, attempt: Attempt, events: list[str]
    ) -> None:
        path = result_path(work, status.index, attempt.number)
        if not _listed(path) and self._waiting(status.index, attempt.number):
            return
        try:
            result = read_result(path, plan.shards[status.index], plan.hashing)
        except Malformed as e:
            self._fail(status, attempt, self._last_words(work, plan, status.index, attempt, str(e)), events)
            return
        attempt.node, attempt.seconds = result.node, result.seconds
        if result.error:
            self._fail(status, attempt, result.error, events)
            return
        attempt.state, attempt.bytes = "done", result.bytes
        if status.done:
            return
        status.result = result
        rate = result.bytes / result.seconds / 1e6 if result.seconds else 0.0
        events.append(
            f"shard {status.index} on {result.node}: {result.bytes / 1e6:.1f} MB read in "
            f"{result.seconds:.1f}s ({rate:.0f} MB/s)"
        )
        for other in status.running:
            other.state = "stopped"

    def _refuse_if_srun_failed(self, work: Path) -> None:
        """The first srun exited with an error before any task began (a bad partition or
        account, no allocation): that is the setup's fault, and retries would only repeat it."""
        first = self._steps[0]
        code = first.popen.poll()
        if (
            code not in (None, 0)
            and not any((work / "progress").glob("*"))
            and not any((work / "results").glob("*"))
        ):
            raise CkptopsError(
                f"srun: exited {code} before any shard task began: {process.tail(first.log, 3)}"
            )

    def _fail(self, status: ShardStatus, attempt: Attempt, error: str, events: list[str]) -> None:
        attempt.state, attempt.error = "failed", error
        attempt.seconds = time.monotonic() - attempt.started
        events.append(f"shard {status.index} failed on {attempt.node or 'an unknown node'}: {error}")

    def _waiting(self, shard: int, attempt: int) -> bool:
        """Whether a result may still come: the attempt's srun runs, or ended so recently that a
        network file system may not show this host a file created on another node yet."""
        now = time.monotonic()
        for step in self._steps:
            if step.attempt == attempt and shard in step.shards:
                if step.popen.poll() is None:
                    return True
                step.ended = step.ended or now
                return now - step.ended < _RESULT_GRACE_SECONDS
        return False

    def _last_words(self, work: Path, plan: ShardPlan, shard: int, attempt: Attempt, fallback: str) -> str:
        """Why a task left no usable result: its own last line on stderr, else srun's line about
        it (which also names its node when the task never got to say)."""
        step = next(s for s in self._steps if s.attempt == attempt.number and shard in s.shards)
        task = (
            next(t for t in range(len(self.statuses)) if plan.shard_for_task(t) == shard)
            if step.attempt == 0
            else 0
        )
        said = process.tail(work / f"task-{task}-{step.name}.err", 1)
        if said:
            return said.split("shard_worker: ", 1)[-1]
        for line in step.log.read_text(errors="replace").splitlines():
            found = _TASK_ERROR.search(line)
            tasks = range(int(found[2]), int(found[3] or found[2]) + 1) if found else ()
            if any(len(step.shards) == 1 or plan.shard_for_task(t) == shard for t in tasks):
                attempt.node = attempt.node or found[1]
                return f"{found[4].strip()} ({fallback.rsplit(': ', 1)[-1]})"
        return fallback

    def _retry(self, plan: ShardPlan, work: Path, events: list[str]) -> None:
        durations = [s.result.seconds for s in self.statuses if s.done]
        pool = None
        for status in self.statuses:
            if status.done or status.failed or len(status.attempts) > RETRIES:
                continue
            if time.monotonic() < status.next_try:
                continue
            running = status.running
            if running:
                # A straggler gets one more node beside it; the first result wins.
                half_done = len(durations) >= max(1, len(self.statuses) // 2)
                limit = max(
                    self.settings.straggler_min_seconds,
                    self.settings.straggler_factor * statistics.median(durations) if durations else 0,
                )
                if len(running) > 1 or not half_done or time.monotonic() - running[0].started <= limit:
                    continue
                why = f"straggling on {running[0].node or '?'}"
            else:
                why = "failed"
            pool = self._in_service() if pool is None else pool
            if pool is None:
                return  # Slurm did not answer: the next poll asks again, up to the time limit
            node = self._retry_node(status, pool, {a.node for s in self.statuses for a in s.running})
            if node is None:
                if running:
                    status.next_try = time.monotonic() + _NO_NODE_BACKOFF_SECONDS
                else:
                    status.gave_up = True
                    events.append(f"shard {status.index} {why}: no other node in service to retry on")
                continue
            number = len(status.attempts)
            status.attempts.append(Attempt(number, time.monotonic(), node))
            name = f"a{number}-s{status.index}"
            placement = ["--nodes=1", "--ntasks=1", f"--nodelist={node}"]
            log = work / f"srun-{name}.log"
            argv = self._srun(work, name, placement, ["--attempt", str(number), "--shard", str(status.index)])
            self._steps.append(_Step(process.start(argv, log), name, log, number, [status.index]))
            events.append(
                f"shard {status.index} {why}: retrying on {node} (attempt {number + 1} of {RETRIES + 1})"
            )

    def _notify(self, events: list[str]) -> None:
        if self.watch:
            self.watch(self.statuses, events)

    def _stop_all(self, work: Path) -> None:
        """End every srun still running (a straggler whose shard another node finished): srun
        passes SIGTERM on to its tasks and ends its step. Past the grace, the local srun is
        killed and the steps its tasks reported are cancelled in Slurm, so none reads on."""
        for step in self._steps:
            if step.popen.poll() is None:
                step.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        stuck = []
        for step in self._steps:
            try:
                step.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except process.subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(step.popen.pid, signal.SIGKILL)
                step.popen.wait()
                stuck.append(step)
        steps = {
            note["step"]
            for step in stuck
            for shard in step.shards
            if (note := _read_progress(progress_path(work, shard, step.attempt))) and note.get("step")
        }
        if steps:
            process.capture(["scancel", *sorted(steps)], slurm.TIMEOUT_SECONDS)

    @staticmethod
    def _failure_line(directory: Path, failed: list[ShardStatus], shards: list[Shard], work: Path) -> str:
        first = failed[0]
        files = shards[first.index].files
        tried = "; ".join(f"{a.node or '?'}: {a.error}" for a in first.attempts if a.error)
        more = f" (+{len(failed) - 1} more shards)" if len(failed) > 1 else ""
        return (
            f"{directory.name}: no verdict, shard {first.index} ({len(files)} files from {files[0]}) "
            f"could not be read on any node tried: {tried}{more}; logs in {work}"
        )


def _stat(path: Path) -> list[int] | None:
    """A file's inode, size and mtime when planned; None for one gone since it was listed (it
    plans as empty, its task finds it missing, and it counts as changed, as on one host)."""
    try:
        return stat_key(path.stat())
    except FileNotFoundError:
        return None


def _listed(path: Path) -> bool:
    """Whether a result file is there, asked of its directory: a listing revalidates a network
    file system's cached view, where a stat of a file created elsewhere may not yet."""
    try:
        return path.name in os.listdir(path.parent)
    except FileNotFoundError:
        return False


def _read_progress(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
