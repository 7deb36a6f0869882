"""The saves a Megatron-LM log tells of: when each began, when its blocking part ended (an async
save's ``scheduled`` line), when it was finalized (``successfully saved``), the ``save-checkpoint``
timer after it, and the error that ended it.

What Megatron-LM prints (megatron/training/checkpointing.py, 0.19; older releases print no
timestamp and say ``saved checkpoint at iteration``)::

    [2026-12-07 04:50:11.757441] saving checkpoint at iteration       4 to /ck in torch_dist format
      [2026-12-07 04:50:11.980799] scheduled an async checkpoint save at iteration       4 to /ck
    (min, max) time across ranks (ms):
        save-checkpoint ................................: (224.06, 2745.47)
      [2026-12-07 04:50:14.975228] successfully saved checkpoint from iteration       4 to /ck [ t 1/1, ...]

A synchronous save prints its ``successfully saved`` line before the timer; an async one prints
it when a later iteration finalizes the background write, so the timer is the blocking part and
``scheduled`` to ``successfully saved`` bounds the background write from above. Timestamps are
the job host's local time, as Megatron-LM printed them (read as this host's local time).
"""

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from tasks.errors import unreadable
from tasks.job.step_records import configured, is_step_records
from tasks.storage.local import read_lines

_STAMP = r"(?:\[(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?)\]\s*)?"
_BEGAN = re.compile(_STAMP + r"saving checkpoint at iteration\s+(\d+) to (\S+)")
_SCHEDULED = re.compile(_STAMP + r"scheduled an async checkpoint save at iteration\s+(\d+)")
_FINISHED = re.compile(_STAMP + r"successfully saved checkpoint (?:from|at) iteration\s+(\d+) to (\S+)")
# The blocking time across ranks, (min, max) in ms; "save-checkpoint-non-persistent" is another
# kind of save (not in the store) and does not match.
TIMER = re.compile(r"save-checkpoint\s*\.*:\s*\(\s*([0-9.]+),\s*([0-9.]+)\)")
# ckptops's earlier local job printed its own: "saved checkpoint iteration N to DIR in 0.12s".
_LOCAL_SAVED = re.compile(r"saved checkpoint iteration (\d+) to \S+ in ([0-9.]+)s")
# What a failed write prints: the OS's words (ENOSPC, EDQUOT, EIO, EROFS), Megatron-Core's async
# writer's ("Local worker N encountered an error", "Worker failure"), torch DCP's
# CheckpointException, and torch's zip writer's on a full file system, whose words do not say so
# ("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598", seen here on a full
# tmpfs; "PytorchStreamWriter failed writing file data/5: file write failed").
SPACE = re.compile(
    r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded|\[Errno 122\]|\bEDQUOT\b"
)
SAVE_ERROR = re.compile(
    SPACE.pattern + r"|Input/output error|\[Errno 5\]|Read-only file system|\[Errno 30\]"
    r"|Local worker \d+ encountered an error|Worker failure: |CheckpointException"
    r"|An error is caught while starting worker"
    r"|inline_container\.cc:\d+\]. unexpected pos|PytorchStreamWriter failed writing file",
    re.I,
)
# Words that belong to the saving ranks' writer: its own messages and its loggers' names
# (Megatron-Core 0.19's filesystem_async and async_utils, torch DCP, torch's zip writer). The OS's
# words alone (ENOSPC, EDQUOT, EIO, EROFS) are anybody's: a wandb cache, a data loader, a
# profiler; they are a save's error only on a line of the writer's, a line that names the save's
# directory, or the exception that ends a traceback through a writer's frames (WriterTrace).
_WRITER_WORDS = re.compile(
    r"Local worker \d+ encountered an error|Worker failure: |CheckpointException"
    r"|An error is caught while starting worker|inline_container\.cc:\d+\]. unexpected pos"
    r"|PytorchStreamWriter failed writing file"
    r"|megatron\.core\.dist_checkpointing|torch\.distributed\.checkpoint",
    re.I,
)
# A frame of a checkpoint writer's module: Megatron-Core's dist_checkpointing, Megatron-LM's and
# Megatron-Bridge's checkpointing.py, torch DCP, torch.save's serialization, DeepSpeed's checkpoint
# engines, NeMo's checkpoint IO and callbacks. Not any path with "checkpoint" in it:
# torch/utils/checkpoint.py is activation checkpointing (a recompute in the backward pass).
_WRITER_FRAME = re.compile(
    r'File "(?:[^"]*/)?(?:'
    r"megatron/core/dist_checkpointing/[^\"]*"
    r"|megatron/(?:training|bridge/training)/checkpointing\.py"
    r"|torch/distributed/checkpoint/[^\"]*"
    r"|torch/serialization\.py"
    r"|deepspeed/runtime/checkpoint_engine/[^\"]*"
    r"|nemo/utils/callbacks/(?:dist_ckpt_io|nemo_model_checkpoint)\.py"
    r"|nemo/lightning/io/pl\.py|nemo/lightning/pytorch/callbacks/model_checkpoint\.py"
    r')", line \d+'
)
_FRAME = re.compile(r'\bFile "[^"]+", line \d+')
# A training step logged (Megatron-LM's, torchtitan's, nanoGPT's): progress after a save began.
# The step's number: only a later step is progress past a save (the last rank prints the
# iteration line, rank 0 the save's, and the two interleave).
_PROGRESS = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\||\bstep:\s*(\d+)\s+loss:|\biter (\d+): loss")
# Other loops' words for a save under way, and the frames of a process caught inside one (a
# traceback printed at exit, a py-spy dump): torchtitan, Lightning, Megatron-Core's async queue.
_SAVING_ELSEWHERE = re.compile(
    r"Saving the checkpoint|Saving latest checkpoint"
    r"|\bmaybe_finalize_async_calls\b|\bis_current_async_call_done\b"
    r"|\bcheckpointer\.save\(|Trainer\.save_checkpoint|\bin save_checkpoint\b|\bsave_checkpoint \("
)
# Frames of Megatron-Core's async checkpoint writer process (its loop, its tensor preload, its
# file writer): a traceback through them is the writer dying.
_WRITER_FRAMES = re.compile(r"\bin (?:async_loop|preload_tensors|write_preloaded_data)\b")
# The job ended: torchrun's failure summary, Slurm's cancellation, or Megatron-LM's own end.
ENDED = re.compile(
    r"ChildFailedError|Root Cause \(first observed failure\)|\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED"
    r"|\[after training is done\]|exiting program at iteration"
)


class WriterTrace:
    """Follows a log's tracebacks, a line at a time: ``feed`` says whether a line is the
    exception that ends a traceback whose frames run through a checkpoint writer's code. A frame's
    source lines are indented two columns past its ``File``; the first other line after the
    frames is the exception."""

    def __init__(self) -> None:
        self.column: int | None = None  # of the last frame's ``File``
        self.writer = False

    def feed(self, line: str) -> bool:
        frame = _FRAME.search(line)
        if frame is not None:
            self.column = frame.start()
            self.writer = self.writer or _WRITER_FRAME.search(line) is not None
            return False
        column = self.column
        if column is not None and line[column : column + 2] == "  " and line[column:].strip():
            return False
        ended = column is not None and self.writer
        self.column, self.writer = None, False
        return ended


def writers(line: str, directories, in_writer_trace: bool) -> bool:
    """Whether a save error's words on ``line`` are the saving ranks' writer's: its own words,
    the name of a save's directory (``directories``), or the end of a traceback through its frames."""
    if _WRITER_WORDS.search(line) or in_writer_trace:
        return True
    return any(d and d in line for d in directories)


def save_directory(line: str) -> str | None:
    """The directory a ``saving checkpoint at iteration N to DIR`` line names."""
    m = _BEGAN.search(line) if "saving checkpoint" in line else None
    return m[3] if m else None


@dataclass
class LoggedSave:
    """One save as the log tells it (times in seconds since the epoch; None: not printed)."""

    iteration: int
    directory: str | None = None
    began: float | None = None
    began_line: int | None = None  # 1-based
    began_text: str = ""
    scheduled: float | None = None  # an async save's blocking part ended
    finished: float | None = None  # finalized (the tracker names it), when the line has a time
    done: bool = False  # the "successfully saved" line came
    blocking_seconds: float | None = None  # the save-checkpoint timer's max across ranks
    error: str | None = None  # the first line of the error that ended it
    error_line: int | None = None  # 1-based
    ended_with_job: bool = False  # the job ended after it began and before it finished
    progress_after: bool = False  # a training step was logged after it began
    overtaken: bool = False  # another save began before this one finished

    @property
    def asynchronous(self) -> bool:
        return self.scheduled is not None

    @property
    def background_seconds(self) -> float | None:
        """An async save's write behind training: scheduled to finalized (an upper bound: the
        loop finalizes between iterations)."""
        if self.scheduled is None or self.finished is None:
            return None
        return max(0.0, self.finished - self.scheduled)

    @property
    def stuck(self) -> bool:
        """Began, never finished, no error, and nothing went on after it but another save: the
        job hung in it (an async save still writing behind logged steps is not stuck)."""
        return (
            self.began_line is not None
            and not self.done
            and self.error is None
            and (not self.progress_after or self.overtaken)
        )

    @property
    def out_of_space(self) -> bool:
        return self.error is not None and SPACE.search(self.error) is not None

    def to_dict(self) -> dict:
        return asdict(self) | {"background_seconds": self.background_seconds}


@dataclass
class SaveLog:
    saves: dict[int, LoggedSave]
    ended: bool  # the job's end is in the log
    source: str = ""
    # Another loop's save under way (its words, or a process's frames inside a save) with no
    # training step logged after it: (line, 1-based, and its text).
    saving_elsewhere: tuple[int, str] | None = None
    writer_died: tuple[int, str] | None = None  # a traceback through the async writer's frames
    # Every blocking save time the log prints, in order (s): each save-checkpoint timer's max
    # across ranks, whether or not its save's own line is in the log, or the local job's line.
    blocking: list[float] = field(default_factory=list)

    def unfinished(self) -> list[LoggedSave]:
        """Saves that began and never finished, oldest first."""
        return [s for s in self.saves.values() if s.began_line is not None and not s.done]

    def measured(self) -> list[LoggedSave]:
        """The saves that finished, with their timer, in order."""
        return [s for s in self.saves.values() if s.done and s.blocking_seconds is not None]


def _when(stamp: str | None) -> float | None:
    if stamp is None:
        return None
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def merged(logs: list[SaveLog]) -> SaveLog:
    """One job's saves from several files (one per rank or node): a save finished in any of them
    is finished; its error is the first file's that has one."""
    saves: dict[int, LoggedSave] = {}
    for log in logs:
        for iteration, save in log.saves.items():
            known = saves.setdefault(iteration, save)
            if known is save:
                continue
            for name in (
                "directory",
                "began",
                "scheduled",
                "finished",
                "blocking_seconds",
                "error",
                "error_line",
            ):
                if getattr(known, name) is None:
                    setattr(known, name, getattr(save, name))
            known.done = known.done or save.done
            known.ended_with_job = (known.ended_with_job or save.ended_with_job) and not known.done
    return SaveLog(
        dict(sorted(saves.items())),
        any(log.ended for log in logs),
        ", ".join(log.source for log in logs),
        next((log.saving_elsewhere for log in logs if log.saving_elsewhere), None),
        next((log.writer_died for log in logs if log.writer_died), None),
    )


def stalled_in(log: SaveLog) -> LoggedSave | None:
    """The save the job hung in, by its log: the oldest stuck one."""
    return next((s for s in log.saves.values() if s.stuck), None)


def read_save_log(lines: Iterable[str], source: str = "") -> SaveLog:
    """The saves in a Megatron-LM log, in one pass. An error line counts for the oldest save
    not finished (Megatron-LM finalizes saves in order), when it is the writer's (``writers``);
    the timer after a save is that save's."""
    saves: dict[int, LoggedSave] = {}
    unfinished: list[LoggedSave] = []  # began and not finished, oldest first (finalized in order)
    timed: LoggedSave | None = None  # the last save whose timer has not been printed yet
    ended, elsewhere, writer = False, None, None
    blocking: list[float] = []
    trace = WriterTrace()
    for number, line in enumerate(lines, 1):
        in_writer = trace.feed(line)
        if m := _PROGRESS.search(line):
            step, elsewhere = int(m[1] or m[2] or m[3]), None
            for save in unfinished:
                save.progress_after = save.progress_after or step > save.iteration
            continue
        if elsewhere is None and _SAVING_ELSEWHERE.search(line):
            elsewhere = (number, line.rstrip("\r\n")[:500])
        if writer is None and _WRITER_FRAMES.search(line):
            writer = (number, line.rstrip("\r\n")[:500])
        if "checkpoint" in line:
            if m := _BEGAN.search(line):
                for earlier in unfinished:
                    earlier.overtaken = True
                text = line.rstrip("\r\n")[:500]
                save = saves[int(m[2])] = LoggedSave(
                    int(m[2]), m[3], began=_when(m[1]), began_line=number, began_text=text
                )
                unfinished.append(save)
                timed = save
                continue
            if m := _SCHEDULED.search(line):
                save = saves.setdefault(int(m[2]), LoggedSave(int(m[2])))
                save.scheduled = _when(m[1])
                continue
            if m := _FINISHED.search(line):
                save = saves.setdefault(int(m[2]), LoggedSave(int(m[2]), m[3]))
                save.finished, save.done = _when(m[1]), True
                if save in unfinished:
                    unfinished.remove(save)
                continue
        if m := TIMER.search(line):
            blocking.append(float(m[2]) / 1000)
            if timed is not None:
                timed.blocking_seconds, timed = blocking[-1], None
            continue
        if m := _LOCAL_SAVED.search(line):
            blocking.append(float(m[2]))
            continue
        oldest = unfinished[0] if unfinished else None
        if (
            oldest is not None
            and oldest.error is None
            and SAVE_ERROR.search(line)
            and writers(line, (oldest.directory,), in_writer)
        ):
            oldest.error, oldest.error_line = line.strip()[:500], number
            continue
        if ENDED.search(line):
            ended = True
            for save in unfinished:
                save.ended_with_job = True
    return SaveLog(saves, ended, source, elsewhere, writer, blocking)


def p99(values: list[float]) -> float:
    """The 99th percentile of save times (the nearest rank below): the slowest save but one in a
    hundred."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def job_log(profile, given: Path | None = None) -> Path | None:
    """The job's Megatron-LM log: the one named (``--log``), else ``recovery.step_records`` where
    that is a log rather than step records; None without either."""
    if given is not None:
        return Path(given)
    path = configured(profile)
    if path is None or not Path(path).is_file():
        return None
    try:
        return None if is_step_records(Path(path)) else Path(path)
    except OSError as e:
        raise unreadable(Path(path), e) from None


def read_save_log_file(path: Path) -> SaveLog:
    try:
        return read_save_log(read_lines(Path(path)), str(path))
    except OSError as e:
        raise unreadable(Path(path), e) from None
