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
this module did not write (a link among them) are never touched.
"""

import fcntl
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tasks.cluster import slurm
from tasks.errors import CkptopsError
from tasks.outcome import Verdict
from tasks.storage.local import atomic_write, open_for_writing, open_regular

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
        lock = open_for_writing(directory / LOCK)
    except CkptopsError as e:
        update.errors.append(f"health.nvrx_segment_dir: {e}")
        return update
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer at a time (several sweeps, one directory)
        _publish(reports, directory, units, at, update)
    except OSError as e:
        update.errors.append(f"health.nvrx_segment_dir {directory}: {e.strerror or e}")
    finally:
        os.close(lock)
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
