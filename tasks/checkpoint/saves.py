"""Save health: each save's state from the store and the job's log, before anything is verified.

ckptops judges a checkpoint once its save has finished; the saves that go wrong in the field do
not finish cleanly. For each iteration a save touched (a directory in the store, or a save the log
says began) this says:

- ``writing``: shards appearing and no metadata yet, or the log's save began and did not end;
- ``stalled``: no byte written for longer than the stall threshold while writing, or the log's
  save began longer ago than that (the threshold: ``verify.save_stall_seconds``, else
  ``verify.save_stall_factor`` times the p99 of the job's own measured saves);
- ``failed``: the log shows the save's error, or the job ended while it was writing, or a newer
  save finished (Megatron-LM saves in order) or nothing changed for ``verify.abandon_after_seconds``;
- ``complete``: its metadata written, as ``tasks.checkpoint.state.completeness`` judges.

Besides, Megatron-LM's tracker naming an iteration that is not complete (a job killed between
the last shard and the tracker's write, a tracker edited by hand, a writer that published the
pointer first) is an alarm of its own, and the store's free space (``statvfs``) is measured
against the next save: a failed save for lack of space, and a store that cannot hold the next
save, say how much is free and how much is needed.

Cheap: a listing per iteration and one pass over the log; no checkpoint byte is read.
"""

import os
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.state import State, VerifyOptions, completeness
from tasks.errors import CkptopsError, unreadable
from tasks.job.save_log import SaveLog, job_log, p99, read_save_log_file
from tasks.storage.bounded import read_bounded
from tasks.storage.local import list_files

# Without a configured threshold or three measured saves to take a p99 from.
UNMEASURED_STALL_SECONDS = 1800.0
MIN_STALL_SECONDS = 60.0


class SaveState(StrEnum):
    WRITING = "writing"
    STALLED = "stalled"
    FAILED = "failed"
    COMPLETE = "complete"


def size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass(frozen=True)
class Space:
    """The store's free space as ``statvfs`` says, and what the next save needs."""

    path: str
    free_bytes: int
    total_bytes: int
    needed_bytes: int | None  # the newest complete checkpoint's size (None: none complete)
    staging_bytes: int = 0  # the archive's copy, where it is written on the same file system
    margin_bytes: int = 0

    @property
    def short(self) -> bool:
        """The next save (and the archive's staging, and the margin) does not fit."""
        if self.needed_bytes is None:
            return False
        return self.free_bytes < self.needed_bytes + self.staging_bytes + self.margin_bytes

    def line(self) -> str:
        need = "" if self.needed_bytes is None else f"; a checkpoint needs {size(self.needed_bytes)}"
        staging = f", the archive's copy {size(self.staging_bytes)}" if self.staging_bytes else ""
        margin = f", the margin {size(self.margin_bytes)}" if self.margin_bytes else ""
        free = f"{size(self.free_bytes)} free of {size(self.total_bytes)}"
        return f"store {self.path}: {free}{need}{staging}{margin}"


@dataclass
class SaveHealth:
    iteration: int
    state: SaveState
    reason: str
    files: int = 0
    written_bytes: int = 0
    idle_seconds: float | None = None
    missing_ranks: list[int] = field(default_factory=list)  # no shard of theirs (world size known)
    error: str | None = None  # the log's line
    out_of_space: bool = False  # the cause: the store is full (the log says so, or statvfs does)
    blocking_seconds: float | None = None
    background_seconds: float | None = None

    @property
    def alarming(self) -> bool:
        return self.state in (SaveState.STALLED, SaveState.FAILED)

    def line(self, space: Space | None = None) -> str:
        name = layout.iter_dir_name(self.iteration)
        missing = ""
        if self.missing_ranks:
            ranks = ", ".join(map(str, self.missing_ranks[:16])) + (
                " ..." if len(self.missing_ranks) > 16 else ""
            )
            missing = f"; no shard from rank(s) {ranks}"
        written = f"; {self.files} file(s), {size(self.written_bytes)} written"
        full = f"; {space.line()}" if self.out_of_space and space is not None else ""
        return f"save {name} {self.state}: {self.reason}{written}{missing}{full}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SaveReport:
    save_dir: str
    saves: list[SaveHealth]
    tracker: int | None  # what Megatron-LM's tracker names (None: no tracker)
    tracker_problem: str | None  # it names an iteration that is not complete
    space: Space | None
    stall_seconds: float
    stall_source: str

    def current(self) -> list[SaveHealth]:
        """The stalled and failed saves no newer save has completed since: a save that failed and
        was followed by a good one is history (``status`` lists it), not an alarm."""
        newest = max((s.iteration for s in self.saves if s.state is SaveState.COMPLETE), default=-1)
        return [s for s in self.saves if s.alarming and s.iteration > newest]

    def alarm_lines(self) -> dict[str, str]:
        """What a person must know now, by a key that stays the same while the cause does (for
        notifying once): stalled and failed saves, a tracker ahead of the data, a store that
        cannot hold the next save."""
        found = {f"save {s.iteration} {s.state}": f"ALERT {s.line(self.space)}" for s in self.current()}
        if self.tracker_problem:
            found[f"tracker {self.tracker}"] = f"ALERT {self.tracker_problem}"
        full = any(s.out_of_space for s in self.current())
        if self.space is not None and self.space.short and not full:
            found["space"] = f"ALERT the next save will not fit: {self.space.line()}"
        return found

    def alarms(self) -> list[str]:
        return list(self.alarm_lines().values())

    def to_dict(self) -> dict:
        return {
            "save_dir": self.save_dir,
            "saves": [s.to_dict() for s in self.saves],
            "tracker": self.tracker,
            "tracker_problem": self.tracker_problem,
            "space": None if self.space is None else asdict(self.space) | {"short": self.space.short},
            "stall_seconds": self.stall_seconds,
            "stall_source": self.stall_source,
            "alarms": self.alarms(),
        }


def stall_threshold(configured: float | None, factor: float, log: SaveLog | None) -> tuple[float, str]:
    """How long a save may go without writing a byte (or run, by the log) before it is stalled."""
    if configured is not None:
        return configured, "verify.save_stall_seconds"
    took = [
        s.finished - s.began
        for s in (log.measured() if log else [])
        if s.began is not None and s.finished is not None
    ]
    if len(took) < 3:
        return UNMEASURED_STALL_SECONDS, "fewer than three saves measured in the job's log"
    slowest = p99(took)
    return (
        max(MIN_STALL_SECONDS, factor * slowest),
        f"{factor:g} x the p99 save time of {slowest:.3g} s in the job's log, "
        f"at least {MIN_STALL_SECONDS:.0f} s",
    )


# Megatron-LM's tracker holds an iteration or "release"; anything longer is not one.
_TRACKER_LIMIT = 4096


def megatron_tracker(save_dir: Path) -> tuple[int | None, str | None]:
    """The iteration Megatron-LM's tracker names (None: no tracker, or ``release``), or why it
    cannot be read."""
    path = Path(save_dir) / layout.MEGATRON_TRACKER
    if not path.exists() and not path.is_symlink():
        return None, None
    try:
        text = read_bounded(path, _TRACKER_LIMIT, "Megatron-LM's tracker").decode("ascii").strip()
    except (CkptopsError, OSError, UnicodeDecodeError) as e:
        return None, str(e).removeprefix(f"{path}: ") if isinstance(e, CkptopsError) else str(e)
    if text == "release":
        return None, None
    if not text.isdigit():
        return None, f"not an iteration ({text[:40]!r})"
    return int(text), None


def read_tracker(save_dir: Path) -> int | None:
    """Megatron-LM's tracker: an iteration, or None (absent, ``release``, not a number, or not
    readable as a small regular file: ``megatron_tracker`` says why, and the trackers' alarm
    names it)."""
    return megatron_tracker(save_dir)[0]


def _missing_ranks(files: dict[str, os.stat_result], world_size: int | None) -> list[int]:
    if not world_size:
        return []
    ranks = layout.writing_ranks(files)
    return [r for r in range(world_size) if r not in ranks]


@dataclass(frozen=True)
class _Judge:
    options: VerifyOptions
    log: SaveLog | None
    stall_seconds: float
    world_size: int | None
    now: float


def _judge(save_dir: Path, iteration: int, judge: _Judge) -> SaveHealth:
    directory = save_dir / layout.iter_dir_name(iteration)
    logged = judge.log.saves.get(iteration) if judge.log else None
    try:
        files = list_files(directory) if directory.is_dir() else {}
        data = {n: st for n, st in files.items() if not layout.is_own_file(n)}
        # An empty directory the save made has been idle since it was made.
        made = directory.stat().st_mtime if directory.is_dir() and not data else None
    except FileNotFoundError:
        files, data, made = {}, {}, None  # removed while listed
    except OSError as e:
        raise unreadable(directory, e) from None
    newest = max((st.st_mtime for st in data.values()), default=made)
    health = SaveHealth(
        iteration,
        SaveState.WRITING,
        "",
        files=len(data),
        written_bytes=sum(st.st_size for st in data.values()),
        idle_seconds=None if newest is None else max(0.0, judge.now - newest),
        missing_ranks=_missing_ranks(data, judge.world_size),
        blocking_seconds=logged.blocking_seconds if logged else None,
        background_seconds=logged.background_seconds if logged else None,
    )
    done = completeness(directory, judge.options, files) if files else None
    if logged is not None and logged.error is not None and (done is None or done.state is not None):
        health.state, health.error = SaveState.FAILED, logged.error
        health.out_of_space = logged.out_of_space
        health.reason = f"the job's log says at line {logged.error_line}: {logged.error[:200]}"
    elif done is not None and done.state is None:
        health.state, health.reason = SaveState.COMPLETE, "metadata written"
        health.missing_ranks = []
    elif logged is not None and logged.ended_with_job:
        health.state, health.reason = SaveState.FAILED, "the job ended while it was writing (its log)"
    elif done is not None and done.state is State.INVALID:
        health.state, health.reason = SaveState.FAILED, done.reason
    else:
        _writing_or_stalled(health, logged, judge)
    return health


def _writing_or_stalled(health: SaveHealth, logged, judge: _Judge) -> None:
    began = logged.began if logged is not None else None
    running = None if began is None else judge.now - began
    idle = health.idle_seconds
    if idle is not None and idle > judge.stall_seconds:
        health.state = SaveState.STALLED
        health.reason = f"no byte written for {idle:.0f} s (threshold {judge.stall_seconds:.0f} s)"
    elif idle is None and running is not None and running > judge.stall_seconds:
        health.state = SaveState.STALLED
        health.reason = f"began {running:.0f} s ago by the job's log and nothing written"
    else:
        health.reason = "shards appearing, no metadata yet" if health.files else "began, nothing written yet"


def _needed(save_dir: Path, infos: list[SaveHealth]) -> int | None:
    complete = [s for s in infos if s.state is SaveState.COMPLETE]
    return max(complete, key=lambda s: s.iteration).written_bytes if complete else None


def store_space(save_dir: Path, needed: int | None, staging: int = 0, margin: int = 0) -> Space:
    try:
        st = os.statvfs(save_dir)
    except OSError as e:
        raise unreadable(save_dir, e) from None
    return Space(str(save_dir), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, needed, staging, margin)


def save_report(
    save_dir: Path,
    options: VerifyOptions,
    log: SaveLog | None = None,
    *,
    stall_seconds: float | None = None,
    stall_factor: float = 5.0,
    world_size: int | None = None,
    archive_same_store: bool = False,
    margin_bytes: int = 0,
    now: float | None = None,
) -> SaveReport:
    """Every save's state in ``save_dir`` (with the job's log, if given), Megatron-LM's tracker
    checked against them, and the store's free space against the next save."""
    save_dir = Path(save_dir)
    threshold, source = stall_threshold(stall_seconds, stall_factor, log)
    judge = _Judge(options, log, threshold, world_size, time.time() if now is None else now)
    # A save the log says finished whose directory is gone was removed since (retention): history.
    unfinished = {i for i, s in log.saves.items() if not s.done} if log else set()
    iterations = set(layout.list_iterations(save_dir)) | unfinished
    saves = [_judge(save_dir, i, judge) for i in sorted(iterations)]
    tracker = read_tracker(save_dir)
    problem = None
    if tracker is not None:
        named = next((s for s in saves if s.iteration == tracker), None)
        # Megatron-Bridge writes the tracker before its run_config.yaml and tokenizer/: a save
        # still writing them is finishing, not ahead of its data (stalled, it is an alarm).
        finishing = (
            named is not None
            and named.state is SaveState.WRITING
            and named.files > 0
            and dialect.dialect_of(save_dir / layout.iter_dir_name(tracker)) == dialect.BRIDGE
        )
        if named is None or (named.state is not SaveState.COMPLETE and not finishing):
            what = (
                "no such checkpoint"
                if named is None
                else f"it is {named.state}" + ("" if named.files else ", nothing written")
            )
            problem = (
                f"Megatron-LM's tracker {layout.MEGATRON_TRACKER} names iteration {tracker}, which is not "
                f"complete ({what}): a job started with --load would resume from it; ckptops resumes only "
                "from the promoted checkpoint"
            )
        elif named.state is SaveState.COMPLETE:
            # Megatron-Bridge resumes from its own latest_train_state.pt, written with the tracker.
            problem = dialect.pointer_alarm(save_dir)
    needed = _needed(save_dir, saves)
    space = store_space(save_dir, needed, (needed or 0) if archive_same_store else 0, margin_bytes)
    for health in saves:
        if health.state is SaveState.FAILED and not health.out_of_space and needed and space.short:
            health.out_of_space = True  # the log's words may not say it (torch's zip writer does not)
    return SaveReport(str(save_dir), saves, tracker, problem, space, threshold, source)


def saves_of(profile, save_dir: Path, options: VerifyOptions, log: Path | None = None) -> SaveReport:
    """The save health of ``save_dir``, with the job's log (``log``, else the profile's, for its
    own save directory) and the profile's stall, layout and space settings for its own."""
    save_dir = Path(save_dir)
    own = save_dir.resolve() == profile.job.save_dir.resolve()
    path = job_log(profile, log) if (own or log is not None) else None
    settings = profile.verify
    return save_report(
        save_dir,
        options,
        read_save_log_file(path) if path is not None else None,
        stall_seconds=settings.save_stall_seconds,
        stall_factor=settings.save_stall_factor,
        world_size=profile.job.layout.world_size if own else None,
        archive_same_store=own and _archive_on(profile, save_dir),
        margin_bytes=int(settings.space_margin_gb * 1e9) if own else 0,
    )


def _archive_on(profile, save_dir: Path) -> bool:
    """Whether the archive's copies are written to the save directory's own file system."""
    if profile.archive is None or "://" in profile.archive.url:
        return False
    archive = Path(profile.archive.url)
    while not archive.exists() and archive != archive.parent:
        archive = archive.parent
    return archive.stat().st_dev == Path(save_dir).stat().st_dev


def room_to_save(profile, options: VerifyOptions) -> str | None:
    """Whether the job's store can take its next save: None if it can (or nothing tells the
    size), else one line with the space free, the space needed (the job's checkpoint size from
    its newest trusted manifest) and what retention could free (and the failed saves hold, which
    are the job's files, for a person to remove)."""
    from tasks.checkpoint.catalog import catalog
    from tasks.checkpoint.manifest import read_manifest
    from tasks.checkpoint.pointer import read_pointer
    from tasks.checkpoint.retention import plan_retention
    from tasks.errors import CkptopsError

    save_dir = profile.job.save_dir
    infos = catalog(save_dir, options)
    needed = None
    for info in sorted(infos, key=lambda i: -i.iteration):
        try:
            manifest = read_manifest(save_dir / info.directory, options.trust)
        except CkptopsError:
            continue
        if manifest is not None and manifest.files:
            needed = sum(f.size for f in manifest.files)
            break
    if needed is None:
        return None
    space = store_space(save_dir, needed, margin=int(profile.verify.space_margin_gb * 1e9))
    if not space.short:
        return None
    plan = plan_retention(infos, read_pointer(save_dir), profile.retention.keep_verified)
    sizes = {i.iteration: i.size_bytes for i in infos}
    freeable = sum(sizes[i] for i in plan.delete)
    failed = [s for s in saves_of(profile, save_dir, options).saves if s.state is SaveState.FAILED]
    held = sum(s.written_bytes for s in failed)
    return (
        f"the store cannot take the next save: {space.line()}; retention (keep_verified "
        f"{plan.keep_verified}) could free {size(freeable)}"
        + (f" (iterations {', '.join(map(str, plan.delete))})" if plan.delete else "")
        + (
            f"; the failed save(s) {', '.join(layout.iter_dir_name(s.iteration) for s in failed)} hold "
            f"{size(held)} (the job's files: a person removes them)"
            if failed
            else ""
        )
        + "; a relaunch into this store would fail at its next save"
    )


def store_save_seconds(save_dir: Path) -> list[float]:
    """Each complete torch_dist save's time on the store, oldest first: its first data file's last
    write to its ``.metadata``. A lower bound (a file's time is its last write, so the first
    file's own writing is not counted), and the whole write: an async save's background part too."""
    found = []
    for iteration in layout.list_iterations(save_dir):
        directory = Path(save_dir) / layout.iter_dir_name(iteration)
        try:
            files = list_files(directory)
        except OSError:
            continue  # removed while listed (retention): not a save to measure
        data = [st.st_mtime for name, st in files.items() if name.endswith(layout.DATA_SUFFIX)]
        done = files.get(layout.DCP_METADATA)
        if data and done is not None and done.st_mtime >= min(data):
            found.append(done.st_mtime - min(data))
    return found
