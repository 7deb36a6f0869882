"""Triage of a failed distributed training run from its logs: what class of failure, which nodes
to suspect, and the first line that shows it. A pure function of the log files (read streaming,
line by line: logs can be GBs) and of what the caller knows (the rank -> node layout, the exit code).

Every line is one of: a *root* cause (the class it is evidence for: hardware, network, numerics,
oom, software, preempted), a *cascade* (a consequence of some other rank's failure: a collective
timeout, a closed connection, an exited task, SIGTERM sent to the workers; class ``hang``), or
nothing. The decision:

1. Hardware evidence anywhere wins, even when it is not the earliest line: a GPU fault often shows
   first as an illegal memory access or an NCCL error on the training side, and as a critical XID
   only in the node's kernel log.
2. Megatron's exit code 17 (its result validation failed) means numerics, unless (1).
3. Otherwise the class of the earliest root line. Lines are ordered by timestamp across files;
   a line without one inherits the last timestamp of its file (a traceback below a timestamped
   line), lines before a file's first timestamp take that first one, and a line is never placed
   before an earlier line of its own file (ranks interleaved in one file with skewed clocks). A
   file with no timestamp at all cannot be placed in time: its lines come first, in the order the
   files were given (a rank that died with a bare Python traceback is usually the one that failed).
   dmesg's ``[ 219.470994]`` is uptime, not wall time, and is not a timestamp here.
4. Only cascades: ``hang``; but ``save-stalled`` when the job's log shows a checkpoint save
   that began and never finished (a hang in a save's write or finalization: a dead async writer
   strands its peers, Megatron-LM #6970).
5. Nothing recognised: ``unknown``. No guessing.

A failed checkpoint write (no space, over quota, an I/O error, Megatron-Core's async writer's or
torch DCP's failure) is a root line of class ``save-failed`` when the words are the saving ranks'
writer's (``tasks.job.save_log.writers``: the writer's own line, the save's directory named, or the
exception ending a traceback through a checkpoint writer's frames); another program's full disk (a
wandb cache) is no evidence. The save it was writing, by the log, is ``save_iteration`` for both
save classes.

Within a class, the first error of a preempted job is the scheduler's line that states why (``DUE
TO TIME LIMIT``), if there is one. A step cancelled without a reason after an srun task failed is
``srun --kill-on-bad-exit`` at work, a cascade. DeepSpeed's fp16 overflows are numerics at five in
a row only once the loss scale is down to OVERFLOW_SCALE_FLOOR: the initial loss-scale search from
2^16..2^32 overflows many times in a row and is normal.

Suspect nodes come only from the root lines of the chosen class (never from cascades: the rank
whose collective timed out is a victim), except for a hang where one task exited before the
timeouts (that task's node), and for a task that exited with Megatron's 16 or 17. A preempted job
has no suspects (a preempted node is not faulty), unless Slurm says NODE FAILURE. A root line
names its node itself (Megatron's ``node N``, NCCL's ``host:pid:tid [local rank]``, a kernel log's
host), through its rank and the layout, or else by the file it is in: a per-rank log whose NCCL
lines name exactly one host (``[rank5]: ... uncorrectable ECC error`` in that file is that host's).

Timestamps are taken as UTC. Formats without a year (glog ``E0817 17:40:34``, syslog
``Dec  2 11:38:47``) take the year of the first dated timestamp in any of the files, else the
current year (the previous one for a date later than today).
"""

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from tasks.errors import CkptopsError, UsageError, unreadable
from tasks.health.xids import CRITICAL_XIDS
from tasks.job.save_log import merged, read_save_log, stalled_in
from tasks.recovery.triage import flight_recorder
from tasks.recovery.triage.model import LINE_BYTES, FailureClass, Line, Triage
from tasks.recovery.triage.scan import Scan
from tasks.storage.local import read_lines

__all__ = ["CRITICAL_XIDS", "FailureClass", "Line", "Triage", "attribute_hang", "triage"]


def triage(
    paths: list[Path],
    layout: dict[int, str] | None = None,
    exit_code: int | None = None,
    critical_xids: Iterable[int] | None = None,
) -> Triage:
    """Classify the failure the logs at ``paths`` show. ``layout`` maps a global rank to its node
    (for ``[rankN]:``, ``N: `` and ``[Rank N]`` prefixes); ``exit_code`` is the job's, if known;
    ``critical_xids`` defaults to CRITICAL_XIDS. Raises Unreadable for a file that cannot be read
    and UsageError for a directory."""
    critical = CRITICAL_XIDS if critical_xids is None else frozenset(int(x) for x in critical_xids)
    scan = Scan(dict(layout or {}), critical)
    for index, path in enumerate(paths):
        path = Path(path)
        if path.is_dir():
            raise UsageError(f"{path}: is a directory; triage reads log files")
        try:
            scan.read(index, str(path), read_lines(path, LINE_BYTES))
        except OSError as e:
            raise unreadable(path, e) from e
    return _saving(scan.result(exit_code), paths)


def _saving(found: Triage, paths: list[Path]) -> Triage:
    """A hang (or a log with nothing else recognised) while a save was being written is
    ``save-stalled``, its first error the line where the save began; an exception through the
    async checkpoint writer's own frames is ``save-failed``; a save failure names its save."""
    if found.cls not in _SAVE_RELATED:
        return found
    try:
        logs = [read_save_log(read_lines(Path(p), LINE_BYTES), str(p)) for p in paths]
    except OSError as e:
        raise unreadable(Path(paths[0]), e) from e
    saves = merged(logs)
    if found.cls == FailureClass.SOFTWARE and saves.writer_died is not None:
        number, text = saves.writer_died
        _reclass(found, FailureClass.SAVE_FAILED, None)
        found.reason = f"the async checkpoint writer died (line {number}: {text[:120]}); {found.reason}"
    if found.cls == FailureClass.SAVE_FAILED:
        failed = next((s for s in saves.saves.values() if s.error is not None), None)
        if failed is not None:
            found.save_iteration = failed.iteration
            found.reason += f"; the save of iteration {failed.iteration} failed"
        return found
    if found.cls == FailureClass.SOFTWARE:
        return found
    stuck = stalled_in(saves)
    if stuck is not None:
        where = next((str(p) for p, log in zip(paths, logs) if stuck.iteration in log.saves), str(paths[0]))
        began = Line(
            where, stuck.began_line, stuck.began_text, "root", FailureClass.SAVE_STALLED, stuck.began
        )
        _reclass(found, FailureClass.SAVE_STALLED, began)
        found.save_iteration = stuck.iteration
        how = "was handed to its async writer" if stuck.asynchronous else "began"
        found.reason = (
            f"the job hung while saving iteration {stuck.iteration}: the save {how} and never finished "
            f"(no 'successfully saved' line, no error); {found.reason}"
        )
        return found
    where = next(
        ((str(p), log.saving_elsewhere) for p, log in zip(paths, logs) if log.saving_elsewhere), None
    )
    if where is not None:
        path, (number, text) = where
        _reclass(
            found,
            FailureClass.SAVE_STALLED,
            Line(path, number, text, "root", FailureClass.SAVE_STALLED, None),
        )
        found.reason = (
            f"the log's last sign of life is a checkpoint save ({path}:{number}: its words, or a process's "
            f"frames inside one), with no training step after it; {found.reason}"
        )
    return found


_SAVE_RELATED = (FailureClass.HANG, FailureClass.UNKNOWN, FailureClass.SAVE_FAILED, FailureClass.SOFTWARE)


def _reclass(found: Triage, cls: str, first: Line | None) -> None:
    """Make ``found`` of class ``cls``: its first error ``first`` (or its own, now of ``cls``), at
    the head of the evidence."""
    old = found.first_error
    first = first or (None if old is None else replace(old, cls=cls))
    found.cls, found.first_error = cls, first
    found.evidence = [first] * (first is not None) + [e for e in found.evidence if e != old and e != first]


def attribute_hang(
    found: Triage,
    dumps: Path,
    layout: dict[int, str] | None = None,
    world_size: int | None = None,
    required: bool = True,
    since: float | None = None,
) -> Triage:
    """For a hang, or logs that show no failure at all, read the ranks' Flight Recorder dumps in
    ``dumps`` and name the ranks that never entered the collective the others wait in (and,
    through ``layout``, their nodes) as suspects beside the logs' own. Ranks waiting in a
    collective are evidence of a hang in themselves: an ``unknown`` failure whose dumps show them
    is a ``hang``. Any other class is left as it is. No dumps there, or a folder that cannot be
    read: UsageError (or Unreadable), or with ``required`` false (a recovery, where the job may not
    have dumped) a note in the reason. A dump that cannot be used is one of the problems.

    Only ``world_size`` (``--world-size``) drops the dumps of another size. ``layout`` is what the
    scheduler knows (one entry a Slurm task: under torchrun a task is a node of many ranks), so it
    is no world size: it counts only where the dumps state none and no dump's rank is past it, and
    names the suspects' nodes only where it has exactly the dumps' ranks. ``since``: the failed
    job's start (epoch seconds); dumps older than it are an earlier run's and ignored."""
    if found.cls not in (FailureClass.HANG, FailureClass.UNKNOWN):
        return found
    try:
        read, problems, files, world = flight_recorder.read_dumps(dumps, world_size, since)
    except CkptopsError as e:
        if required:
            raise
        found.flight_recorder = {"error": str(e), "reason": str(e), "problems": []}
        found.reason += f"; Flight Recorder: {e}"
        return found
    tasks = len(layout) if layout else None
    if world is None and tasks and all(r < tasks for r in files):
        world = tasks
    seen = flight_recorder.attribute(read, problems, files, world)
    found.flight_recorder = seen.to_dict()
    if found.cls == FailureClass.UNKNOWN:
        if not seen.suspect_ranks:
            found.reason += f"; Flight Recorder: {seen.reason}"
            return found
        found.cls = FailureClass.HANG
        found.reason = (
            f"the Flight Recorder dumps show ranks waiting in a collective; the logs alone: {found.reason}"
        )
    found.suspect_ranks = list(seen.suspect_ranks)
    found.stuck_collective = seen.stuck
    nodes = layout if tasks and world == tasks else {}
    for rank in seen.suspect_ranks:
        node = nodes.get(rank)
        if node is not None and node not in found.suspect_nodes:
            found.suspect_nodes.append(node)
    found.reason += f"; Flight Recorder: {seen.reason}"
    if tasks and world != tasks and seen.suspect_ranks:
        found.reason += f" (the job's {tasks} tasks are not its ranks: no rank's node is known)"
    return found
