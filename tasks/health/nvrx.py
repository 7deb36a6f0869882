"""NVRx's exclusion contract: segment files in ``health.nvrx_segment_dir``, the directory given
to ``ft_launcher --ft-segment-health-check-dir``.

NVRx (nvidia-resiliency-ext, fault_tolerance/segment_health_check.py, and its integration guide
docs/source/fault_tolerance/integration/segment_health_check.rst) reads, before each rendezvous,
``<dir>/segment_health_check.<job_id>.<task_id>`` from the launcher with ``SLURM_PROCID=0`` of
each allocation unit: ``job_id`` is ``SLURM_ARRAY_JOB_ID`` and ``task_id`` ``SLURM_ARRAY_TASK_ID``
for a job array, both ``SLURM_JOB_ID`` for a regular job. A non-empty regular file keeps that
unit out of the rendezvous; a missing or empty one lets it join. NVRx never reads the content:
it is the producer's diagnostic context.

ckptops writes, for each node it judges unhealthy (FAIL_HARDWARE, FAIL_CONFIG, a repeat
suspect), the file of every allocation unit running on it (``squeue -w NODE``), naming the node,
its verdict and why; and removes the node from every file of ours when it passes again (the file
goes when no node is left in it). SUSPECT and TOOL_ERROR change nothing. Files are replaced
whole (``atomic_write``: a temporary with a random name, fsynced, renamed), so NVRx never sees
one half-written or empty and a link planted in the directory is never written through; files
this module did not write (a link among them) are never touched. Writers take turns on
``.ckptops-segments.lock`` (``held_lock``: a file only ckptops's account may open, created 0600;
another account's lock file or holder is refused at once), waiting for another sweep at most
``health.command_timeout_seconds``; either way the sweep goes on, the failure among its errors.
"""

import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks.cluster import slurm
from tasks.errors import CkptopsError
from tasks.health.history import HISTORY, kind, trusted_history
from tasks.outcome import Verdict
from tasks.storage.local import atomic_write, held_lock, open_regular

PREFIX = "segment_health_check."
PRODUCER = "ckptops"
LOCK = ".ckptops-segments.lock"
# Larger than any file of ours (one line per node of a unit); a larger one is another producer's.
_OURS_LIMIT = 1 << 20


@dataclass
class SegmentUpdate:
    written: list[str] = field(default_factory=list)  # file names that now name a node
    removed: list[str] = field(default_factory=list)  # file names deleted (no node left)
    errors: list[str] = field(default_factory=list)  # one line each, naming the node or file

    def message(self) -> str:
        parts = []
        if self.written:
            parts.append(f"NVRx segments written: {', '.join(self.written)}")
        if self.removed:
            parts.append(f"NVRx segments removed: {', '.join(self.removed)}")
        parts += [f"NVRx segments: {e}" for e in self.errors]
        return "; ".join(parts)


def segment_name(job_id: str, task_id: str) -> str:
    return f"{PREFIX}{job_id}.{task_id}"


def allocation_units(node: str) -> list[tuple[str, str]]:
    """(job_id, task_id) of each job running on ``node``, as NVRx names its segment file: the
    array job and task for an array task (``%F``, ``%K``), the job id twice for a regular job."""
    units = []
    for line in slurm.run(["squeue", "-h", "-t", "RUNNING", "-w", node, "-o", "%F %K %A"]).splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        array_job, task, job = fields
        units.append((array_job, task) if task.isdigit() else (job, job))
    return sorted(set(units))


def _ours(path: Path) -> dict | None:
    """The content of a segment file ckptops wrote; None for anything else (left alone): a link,
    a FIFO, a file too large or that does not parse as ours."""
    try:
        with open_regular(path, follow=False) as f:
            data = json.loads(f.read(_OURS_LIMIT + 1))
    except (CkptopsError, OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("producer") == PRODUCER and isinstance(data.get("nodes"), dict):
        return data
    return None


def _replace(path: Path, data: dict) -> None:
    """The file replaced whole: written beside it, fsynced, renamed over it."""
    atomic_write(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def publish(reports, settings, units=allocation_units, now: datetime | None = None) -> SegmentUpdate:
    """Bring the segment files in line with ``reports`` (tasks.health.run.NodeReport)."""
    update = SegmentUpdate()
    directory = Path(settings.nvrx_segment_dir)
    if not directory.is_dir():
        update.errors.append(f"health.nvrx_segment_dir {directory}: not a directory")
        return update
    at = (now or datetime.now(UTC)).isoformat(timespec="seconds")
    try:
        # One writer at a time (several sweeps, one directory), waited for no longer than a
        # command may run (health.command_timeout_seconds).
        with held_lock(directory / LOCK, settings.command_timeout_seconds):
            _publish(reports, directory, units, at, update)
    except CkptopsError as e:
        update.errors.append(f"health.nvrx_segment_dir: {e}")
    except OSError as e:
        update.errors.append(f"health.nvrx_segment_dir {directory}: {e.strerror or e}")
    update.written = sorted(set(update.written))
    return update


def _publish(reports, directory: Path, units, at: str, update: SegmentUpdate) -> None:
    for report in reports:
        try:
            if report.verdict.is_failure:
                _exclude(report, directory, units(report.node), at, update)
            elif report.verdict in (Verdict.PASS, Verdict.WARN):
                _readmit(report.node, directory, update)
        except (CkptopsError, OSError) as e:
            update.errors.append(f"{report.node}: {e}")


def _exclude(report, directory: Path, allocation: list[tuple[str, str]], at: str, update) -> None:
    """The node named in the file of every allocation unit running on it. A link at a file's name
    excludes nothing NVRx can count on (it may point nowhere): it is replaced by our file, never
    written through, and said."""
    for job_id, task_id in allocation:
        name = segment_name(job_id, task_id)
        path = directory / name
        data = {"producer": PRODUCER, "nodes": {}}
        if path.is_symlink():
            update.errors.append(f"{name}: a symbolic link; replaced by our file, what it named untouched")
        elif path.exists():
            data = _ours(path)
        if data is None:
            continue  # another producer's file: it already excludes the unit
        data["nodes"][report.node] = {"verdict": report.verdict.value, "why": report.summary, "at": at}
        _replace(path, data)
        update.written.append(name)


def _readmit(node: str, directory: Path, update: SegmentUpdate) -> None:
    """The node taken out of every file of ours; a file left naming no node is removed."""
    for path in sorted(directory.glob(f"{PREFIX}*")):
        data = _ours(path)
        if data is None or node not in data["nodes"]:
            continue
        del data["nodes"][node]
        if data["nodes"]:
            _replace(path, data)
        else:
            path.unlink()
            update.removed.append(path.name)


# NVRx's scheduler-exclusion file (nvidia-resiliency-ext, branch ft-node-state-service, commit
# f7e7f3c2: services/scheduler_exclusions/decision_file.py writes it, fault_tolerance/
# scheduler_exclusion.py reads it; docs/source/fault_tolerance/integration/
# scheduler_exclusion_service.rst, "Decision Artifact"): ``scheduler_exclusion.<job_id>.jsonl`` in
# the directory given to ``ft_launcher --ft-scheduler-exclusion-dir``. Line 1 is the compact JSON
# array of the excluded array tasks' ids (the only line the reader reads, matched exactly, with
# its newline, at most 1 MiB); line 2 the array-task decision, line 3 the node decision, then one
# observation per excluded node, each with ``valid_until``. The reader ignores a file whose mtime
# is 30 minutes old: every sweep rewrites it, and a node that passes is left out.
EXCLUSION_PREFIX = "scheduler_exclusion."
EXCLUSION_TTL_SECONDS = 1800.0


def exclusion_name(job_id: str) -> str:
    return f"{EXCLUSION_PREFIX}{job_id}.jsonl"


def _utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat().replace("+00:00", "Z")


def exclusion_lines(
    job_id: str, excluded: dict[str, tuple[str, str]], tasks: dict[str, list[str]], now: float
) -> bytes:
    """The file of ``job_id``: ``excluded`` node -> (Slurm state, reason), ``tasks`` node -> the
    job's array task ids on it (its own id for a regular job). ckptops does not read Slurm's
    restart count: ``restart_count`` is 0."""
    valid = _utc(now + EXCLUSION_TTL_SECONDS)
    at = _utc(now)
    ids = sorted({t for node in excluded for t in tasks.get(node, [])}, key=int)
    common = {
        "type": "decision",
        "schema_version": 1,
        "job_id": job_id,
        "generated_at": at,
        "producer": PRODUCER,
    }
    lines = [
        json.dumps(ids, separators=(",", ":")),
        json.dumps(
            common
            | {
                "scope": "array_task",
                "excluded_array_tasks": [
                    {"task_id": t, "restart_count": 0, "valid_until": valid} for t in ids
                ],
            }
        ),
        json.dumps(
            common
            | {
                "scope": "node",
                "excluded_nodes": [{"node": n, "valid_until": valid} for n in sorted(excluded)],
            }
        ),
    ]
    for node, (state, reason) in sorted(excluded.items()):
        observed = {"type": "observation", "node": node, "state": state, "reason": reason}
        lines.append(
            json.dumps(
                observed
                | {
                    "observed_at": at,
                    "valid_until": valid,
                    "array_tasks": [{"task_id": t, "restart_count": 0} for t in tasks.get(node, [])],
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


def publish_exclusions(
    directory: Path, excluded: dict[str, tuple[str, str]], jobs: dict[str, dict[str, list[str]]], now: float
) -> SegmentUpdate:
    """One file per job running on an excluded node (``jobs``: job id -> node -> its task ids
    there), each replaced whole; a file of ours that still excludes something but whose job has
    no excluded node left is rewritten empty (``[]``), and one left empty past the reader's 30
    minutes is removed. Another producer's file is never touched."""
    directory, update = Path(directory), SegmentUpdate()
    for job_id, tasks in sorted(jobs.items()):
        path = directory / exclusion_name(job_id)
        if (path.exists() or path.is_symlink()) and _exclusions_of(path) is None:
            update.errors.append(f"{path.name}: not ours (another producer's, or a link): left alone")
            continue
        mine = {n: why for n, why in excluded.items() if n in tasks}
        atomic_write(path, exclusion_lines(job_id, mine, tasks, now))
        update.written.append(path.name)
    for path in sorted(directory.glob(f"{EXCLUSION_PREFIX}*.jsonl")):
        listed = None if path.name in update.written else _exclusions_of(path)
        if listed is None:
            continue
        job_id = path.name.removeprefix(EXCLUSION_PREFIX).removesuffix(".jsonl")
        if listed:
            atomic_write(path, exclusion_lines(job_id, {}, {}, now))
            update.written.append(path.name)
        elif now - path.stat().st_mtime > EXCLUSION_TTL_SECONDS:
            path.unlink()
            update.removed.append(path.name)
    return update


def _exclusions_of(path: Path) -> list | None:
    """The task ids a file of ours excludes (its first line); None for anything not ours (a link,
    another producer's file, one that does not parse)."""
    try:
        with open_regular(path, follow=False) as f:
            lines = f.read(_OURS_LIMIT + 1).splitlines()
        first, second = json.loads(lines[0]), json.loads(lines[1])
    except (CkptopsError, OSError, ValueError, IndexError):
        return None
    ours = (
        isinstance(second, dict) and second.get("producer") == PRODUCER and second.get("type") == "decision"
    )
    return first if ours and isinstance(first, list) else None


def excluded_nodes(settings, nodes: list[str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """The nodes NVRx should keep out, from their history: those whose last word is a failing
    verdict or a failed burn-in (a passing verdict, a passed burn-in or a return clears it; a
    SUSPECT or TOOL_ERROR says nothing), each with Slurm's state and reason now; and one line
    for each node whose history cannot be trusted or read (``trusted_history``): that says
    nothing about the node, and must never be taken for a history that clears it."""
    found, errors = {}, []
    for node in nodes:
        try:
            entries = trusted_history(settings.raw_dir, node)
        except CkptopsError as e:
            errors.append(str(e))
            continue
        if _excluded_by(entries):
            found[node] = slurm.node_status(node)
    return found, errors


def _excluded_by(entries: list[dict]) -> bool:
    out = False
    for entry in entries:
        match kind(entry):
            case "verdict":
                try:
                    verdict = Verdict(entry.get("verdict"))
                except ValueError:
                    continue
                if verdict not in (Verdict.SUSPECT, Verdict.TOOL_ERROR):
                    out = verdict.is_failure
            case "burn-in":
                out = not entry.get("passed")
            case "returned":
                out = False
    return out


def publish_for(settings, now: float | None = None) -> SegmentUpdate:
    """``health.nvrx_exclusion_dir`` brought up to date: every node with a history (every node
    ever checked, not only this sweep's) judged, and a file for each job running on an excluded
    one. Where a node's history cannot be trusted (``trusted_history``, after healing the folders
    an older ckptops left group-writable) no file is written or removed, and each such history is
    one error line: an exclusion it held is never lifted by a history nobody can read.
    (The files then age out of NVRx's 30 minutes until the history is fixed.)"""
    import time

    raw = Path(settings.raw_dir)
    # Whatever is at a history's name (a link too): one that cannot be trusted is an error, not no history.
    known = sorted(p.name for p in raw.iterdir() if os.path.lexists(p / HISTORY)) if raw.is_dir() else []
    directory = Path(settings.nvrx_exclusion_dir)
    if not directory.is_dir():
        return SegmentUpdate(errors=[f"health.nvrx_exclusion_dir {directory}: not a directory"])
    excluded, untrusted = excluded_nodes(settings, known)
    if untrusted:  # an exclusion it held would be lifted: every file is left as it is
        return SegmentUpdate(
            errors=[f"{why}; exclusion files in {directory} left unchanged" for why in untrusted]
        )
    jobs: dict[str, dict[str, list[str]]] = {}
    for node in excluded:
        for job_id, task_id in allocation_units(node):
            jobs.setdefault(job_id, {}).setdefault(node, []).append(task_id)
    try:
        return publish_exclusions(directory, excluded, jobs, time.time() if now is None else now)
    except (CkptopsError, OSError) as e:
        return SegmentUpdate(errors=[f"health.nvrx_exclusion_dir {directory}: {e}"])
