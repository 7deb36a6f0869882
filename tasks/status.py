"""What ``ckptops status`` reports on one save directory, gathered in one call (``job_status``):
every checkpoint, a pointer that cannot be read, an overdue promotion, the problems a human must
look at, and (where the profile has those sections) the archive's newest copy and the drill scratch
left behind. The CLI renders it and decides nothing.

The trackers a plain ``--load`` resumes from (Megatron-LM's ``latest_checkpointed_iteration.txt``,
Megatron-Bridge's ``latest_train_state.pt``) are held to what ckptops knows of the checkpoint they
name (``tracker_alarms``): missing, invalid, or complete and still not verified (or not trusted)
after ``verify.abandon_after_seconds`` is an ``ALERT``, whatever the tracker or a manifest says. A
save still being written is save health's to judge (``saves``: writing, stalled, failed).
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.catalog import CheckpointInfo, catalog
from tasks.checkpoint.overdue import Overdue, overdue
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.saves import SaveReport, saves_of
from tasks.checkpoint.state import State, VerifyOptions
from tasks.errors import CkptopsError, Malformed
from tasks.storage.bounded import read_bounded

# Megatron-LM's tracker holds an iteration or "release"; anything longer is not one.
_TRACKER_LIMIT = 4096


@dataclass(frozen=True)
class TrackerAlarm:
    """A tracker that names a checkpoint a plain ``--load`` must not resume from."""

    tracker: Path
    iteration: int | None  # None: the tracker itself cannot be read
    why: str
    megatron: bool  # Megatron-LM's tracker (save health keys its own alarm on it), not Bridge's

    def line(self) -> str:
        named = "cannot be read" if self.iteration is None else f"names iteration {self.iteration}"
        return (
            f"ALERT {self.tracker} {named}, {self.why}: a job started with --load would resume from it; "
            "ckptops resumes only from the promoted checkpoint"
        )


@dataclass
class JobStatus:
    save_dir: Path
    checkpoints: list[CheckpointInfo]
    pointer_problem: str | None  # the pointer cannot be read: what is promoted is unknown
    overdue: Overdue | None  # the newest complete checkpoint waits past the alarm's threshold
    saves: SaveReport | None = None  # each save's state, the tracker, the store's space
    archive: list[str] = field(default_factory=list)  # the archive's newest copy, one line each
    stale_scratch: list[tuple[Path, str]] = field(default_factory=list)  # a gone drill's: removable
    foreign_scratch: list[tuple[Path, str]] = field(default_factory=list)  # not provably a drill's
    trackers: list[TrackerAlarm] = field(default_factory=list)  # a --load would take a bad one

    @property
    def alarms(self) -> list[str]:
        """The ``ALERT`` lines of the saves and the trackers (exit 1); Megatron-LM's tracker named
        once: where save health already says it names a save not complete, its line stands."""
        found = self.saves.alarms() if self.saves is not None else []
        return found + [alarm.line() for alarm in self.trackers if not self._told_by_saves(alarm)]

    def _told_by_saves(self, alarm: TrackerAlarm) -> bool:
        saves = self.saves
        if saves is None or not alarm.megatron or not saves.tracker_problem:
            return False
        named = next((s for s in saves.saves if s.iteration == alarm.iteration), None)
        return saves.tracker == alarm.iteration and (named is None or named.state != "complete")

    @property
    def problems(self) -> list[str]:
        """What a human must look at: a garbled pointer, manifests that cannot be trusted."""
        manifests = [i.manifest_error for i in self.checkpoints if i.manifest_error]
        return [self.pointer_problem] * bool(self.pointer_problem) + manifests


def job_status(
    profile, save_dir: Path, options: VerifyOptions, details: bool = True, log: Path | None = None
) -> JobStatus:
    """The status of ``save_dir`` (the profile's own or another job's: only its own has the
    profile's alarm threshold and, without ``log``, the profile's job log); with ``details``, the
    archive's and the drill scratch's lines too."""
    save_dir = Path(save_dir)
    # A garbled pointer must not hide the checkpoints: list them, and say what is wrong.
    try:
        pointer, problem = read_pointer(save_dir), None
    except Malformed as e:
        pointer, problem = None, str(e)
    infos = catalog(save_dir, options, pointer=pointer)
    own = save_dir.resolve() == profile.job.save_dir.resolve()
    # With a garbled pointer what is promoted is unknown: that problem is reported instead.
    late = None if problem else overdue(save_dir, infos, profile.verify.alert_after_seconds if own else None)
    found = JobStatus(save_dir, infos, problem, late, saves_of(profile, save_dir, options, log))
    found.trackers = tracker_alarms(save_dir, infos, options)
    if details and profile.archive:
        from tasks.archive.history import status_lines

        found.archive = status_lines(save_dir)
    if details and profile.drill:
        from tasks.restore.scratch import stale_scratch

        leftovers = stale_scratch(profile.drill.scratch_dir, profile.job.save_dir)
        found.stale_scratch, found.foreign_scratch = leftovers.stale, leftovers.foreign
    return found


def _megatron_tracker(save_dir: Path) -> tuple[int | None, str | None]:
    """The iteration Megatron-LM's tracker names (None: no tracker, or ``release``), or why it
    cannot be read."""
    path = save_dir / layout.MEGATRON_TRACKER
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


def _bridge_tracker(save_dir: Path) -> tuple[int | None, str | None]:
    """The iteration Megatron-Bridge's resume file names (None: there is none), or why it cannot
    be read."""
    path = save_dir / dialect.LATEST_TRAIN_STATE
    if not path.exists() and not path.is_symlink():
        return None, None
    try:
        step = dialect.train_state(path)["step"]
    except (CkptopsError, OSError, ValueError) as e:
        return None, str(e).removeprefix(f"{path}: ")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"its step is {str(step)[:40]!r}, not an iteration"
    return step, None


def _not_resumable(
    info: CheckpointInfo | None, save_dir: Path, options: VerifyOptions, now: float
) -> str | None:
    """Why a plain ``--load`` must not resume from the checkpoint ``info`` describes (None: not in
    the save directory), or None while it may (valid, or a save or verification still due)."""
    if info is None:
        return "which does not exist"
    if info.state is State.INVALID:
        return f"which is invalid ({info.reason})"
    if (info.state is State.VALID and not info.stale) or info.state is State.IN_PROGRESS:
        return None
    try:
        saved = (save_dir / info.directory / layout.METADATA_JSON).stat().st_mtime
    except OSError:
        saved = None
    waited = None if saved is None else now - saved
    if waited is None or waited <= options.abandon_after_seconds:
        return None
    why = info.reason if info.stale else "not verified yet"
    return (
        f"which has been complete for {waited / 3600:.1f} h and is not known valid ({why}); "
        f"verify.abandon_after_seconds is {options.abandon_after_seconds:.0f}"
    )


def tracker_alarms(
    save_dir: Path, infos: list[CheckpointInfo], options: VerifyOptions, now: float | None = None
) -> list[TrackerAlarm]:
    """The trackers a plain ``--load`` resumes from, each naming a checkpoint it must not: one
    that is not there, invalid, or complete and not known valid after the abandon time."""
    save_dir = Path(save_dir)
    now = time.time() if now is None else now
    by_iteration = {i.iteration: i for i in infos}
    found = []
    for reader, name, megatron in (
        (_megatron_tracker, layout.MEGATRON_TRACKER, True),
        (_bridge_tracker, dialect.LATEST_TRAIN_STATE, False),
    ):
        iteration, unreadable = reader(save_dir)
        if unreadable is not None:
            found.append(TrackerAlarm(save_dir / name, None, unreadable, megatron))
            continue
        if iteration is None:
            continue
        why = _not_resumable(by_iteration.get(iteration), save_dir, options, now)
        if why is not None:
            found.append(TrackerAlarm(save_dir / name, iteration, why, megatron))
    return found
