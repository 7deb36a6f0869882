"""What ``ckptops status`` reports on one save directory, gathered in one call (``job_status``):
every checkpoint, a pointer that cannot be read, an overdue promotion, the problems a human must
look at, and (where the profile has those sections) the archive's newest copy and the drill scratch
left behind. The CLI renders it and decides nothing.

Its alarms are save health's and the trackers' a plain ``--load`` resumes from
(``tasks.checkpoint.trackers``).
"""

from dataclasses import dataclass, field
from pathlib import Path

from tasks.checkpoint.catalog import CheckpointInfo, catalog
from tasks.checkpoint.overdue import Overdue, overdue
from tasks.checkpoint.pointer import read_pointer
from tasks.checkpoint.saves import SaveReport, saves_of
from tasks.checkpoint.state import VerifyOptions
from tasks.checkpoint.trackers import TrackerAlarm, alarm_lines, tracker_alarms
from tasks.errors import Malformed


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
        """The ``ALERT`` lines of the saves and the trackers (exit 1)."""
        return list(alarm_lines(self.saves, self.trackers).values())

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
