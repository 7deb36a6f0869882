"""The alarm for the failure nobody sees: saves go on, nothing is promoted.

A wedged pipeline (a dead worker holding the deployment's slot, a flow that fails on every run,
a lock that is never released) is silent: the job trains on, the pointer stays where it was, and
the next recovery resumes from an ever older checkpoint. The newest complete checkpoint waiting
longer than ``verify.alert_after_seconds`` without being promoted is that failure, whatever its
cause. ``ckptops status`` shows it; a server automation (tasks.watchdog) notifies when the
``training.checkpoint.saved`` event of a save is not followed by a promotion in that time.
"""

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.checkpoint import layout
from tasks.checkpoint.catalog import CheckpointInfo
from tasks.checkpoint.state import State

# Without a configured value: twice the job's save interval as its saves show it, at least this
# (a promotion itself takes a trigger, a worker and a verification), and this when there are
# fewer than two saves to measure the interval from.
MIN_ALERT_SECONDS = 300.0
UNMEASURED_ALERT_SECONDS = 7200.0


@dataclass
class Overdue:
    iteration: int
    waited_seconds: float
    alert_after_seconds: float
    alert_source: str
    state: str
    promoted: int | None

    def line(self) -> str:
        why = "" if self.state in (State.VALID, State.UNVERIFIED) else f" (it is {self.state})"
        return (
            f"ALERT {layout.iter_dir_name(self.iteration)}: complete for {self.waited_seconds / 60:.0f} min "
            f"and not promoted{why}; "
            + ("no checkpoint is promoted" if self.promoted is None else f"the pointer is at {self.promoted}")
            + "; verify.alert_after_seconds is "
            f"{self.alert_after_seconds:.0f} ({self.alert_source}): is verify-and-promote running?"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _saved_at(save_dir: Path, iteration: int) -> float | None:
    try:
        return (save_dir / layout.iter_dir_name(iteration) / layout.METADATA_JSON).stat().st_mtime
    except OSError:
        return None


def alert_after(save_dir: Path, infos: list[CheckpointInfo], configured: float | None) -> tuple[float, str]:
    """The alarm's threshold and where it came from."""
    if configured is not None:
        return configured, "configured"
    times = sorted(
        t for i in infos if i.state is not State.IN_PROGRESS if (t := _saved_at(save_dir, i.iteration))
    )
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not gaps:
        return UNMEASURED_ALERT_SECONDS, "fewer than two saves to measure the interval from"
    interval = statistics.median(gaps[-5:])
    return (
        max(MIN_ALERT_SECONDS, 2 * interval),
        f"twice the save interval of {interval:.3g} s the saves show, at least {MIN_ALERT_SECONDS:.0f}",
    )


def overdue(
    save_dir: Path, infos: list[CheckpointInfo], configured: float | None, now: float | None = None
) -> Overdue | None:
    """The newest complete checkpoint, if it has waited past the threshold without being
    promoted (``infos``: the catalog, which knows the pointer)."""
    save_dir = Path(save_dir)
    complete = [i for i in infos if i.state is not State.IN_PROGRESS]
    if not complete:
        return None
    newest = max(complete, key=lambda i: i.iteration)
    promoted = next((i.iteration for i in infos if i.promoted), None)
    if newest.promoted or (promoted is not None and promoted >= newest.iteration):
        return None
    saved = _saved_at(save_dir, newest.iteration)
    if saved is None:
        return None
    threshold, source = alert_after(save_dir, infos, configured)
    waited = (time.time() if now is None else now) - saved
    if waited <= threshold:
        return None
    return Overdue(newest.iteration, waited, threshold, source, str(newest.state), promoted)


def caught_up(infos: list[CheckpointInfo]) -> bool:
    """Whether the pointer names the newest complete checkpoint (nothing complete is waiting):
    what the promotion alarm is told after each verify-and-promote run."""
    promoted = next((i.iteration for i in infos if i.promoted), None)
    complete = [i.iteration for i in infos if i.state is not State.IN_PROGRESS]
    return promoted is not None and max(complete, default=promoted) <= promoted
