"""The trackers a plain ``--load`` resumes from (Megatron-LM's ``latest_checkpointed_iteration.txt``,
Megatron-Bridge's ``latest_train_state.pt``), held to what ckptops knows of the checkpoint they
name (``tracker_alarms``): missing, invalid, or complete and still not verified (or not trusted)
after ``verify.abandon_after_seconds`` is an ``ALERT``, whatever the tracker or a manifest says. A
save still being written is save health's to judge (``tasks.checkpoint.saves``: writing, stalled,
failed); ``alarm_lines`` puts the two together, Megatron-LM's tracker named once, for
``ckptops status`` and for verify-and-promote's save health (which notifies each once).
"""

import time
from dataclasses import dataclass
from pathlib import Path

from tasks.checkpoint import dialect, layout
from tasks.checkpoint.catalog import CheckpointInfo
from tasks.checkpoint.saves import SaveReport, megatron_tracker
from tasks.checkpoint.state import State, VerifyOptions
from tasks.errors import CkptopsError


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
        (megatron_tracker, layout.MEGATRON_TRACKER, True),
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


def alarm_lines(saves: SaveReport | None, trackers: list[TrackerAlarm]) -> dict[str, str]:
    """Save health's ``ALERT`` lines and the trackers', by a key that stays the same while the
    cause does (for notifying once). Megatron-LM's tracker is named once: where save health
    already says it names a save not complete, its line stands."""
    found = saves.alarm_lines() if saves is not None else {}
    for alarm in trackers:
        if not _told_by_saves(saves, alarm):
            found[f"resume tracker {alarm.tracker.name} {alarm.iteration}"] = alarm.line()
    return found


def _told_by_saves(saves: SaveReport | None, alarm: TrackerAlarm) -> bool:
    if saves is None or not alarm.megatron or not saves.tracker_problem:
        return False
    named = next((s for s in saves.saves if s.iteration == alarm.iteration), None)
    return saves.tracker == alarm.iteration and (named is None or named.state != "complete")
