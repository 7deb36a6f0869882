"""Return to service: a node ckptops drained comes back only through a burn-in, and only one ckptops
drained.

A drained node piles up unless something brings it back; a node brought back on its word fails
again (after a node's first fault another often follows within weeks). So, for each node ckptops
drained (the drain log in ``health.raw_dir`` says with which reason) that Slurm still holds out of
service with that very reason:

- the suspect history decides how hard the proof is (``health.suspect``'s window): fewer than
  ``suspect.repeat`` suspicions, a burn-in at ``burn_in.level`` passed once returns it; a repeat
  suspect needs ``burn_in.repeat_level`` and burn-ins passing without a failure for
  ``burn_in.repeat_hours`` since the first of them; ``burn_in.hold_after`` suspicions within
  ``burn_in.hold_window_days`` hold it for a person, whatever it passes;
- the burn-in is the spare admission set (DCGM at the level, single-node NCCL, the pair test with
  the known-good node) and, when the profile runs it, the conformance check;
- a pass resumes it in Slurm, clears its NVRx exclusions, and says so in its history (``returned``);
  a failure leaves it drained, its history naming the failing check.

Never touched: a node drained by someone else (no drain of ours in the log), or one whose Slurm
reason is no longer ours (a person drained it again, for their own reason), or one Slurm no longer
holds out of service. Nothing in Slurm changes unless ``health.drain.enabled``.

The drain log and a node's history are trusted only from ckptops's own account: a file another
account owns or may write, or one in a folder it may write (a world-writable ``health.raw_dir``),
could hold a line that makes a person's drain look like ours. Such a drain log proves no drain
(nothing is burnt in, a warning names it); such a history holds its node for a person.
"""

import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta

from tasks.cluster import slurm
from tasks.health import nvrx
from tasks.health.actions import DRAIN_LOG, Readiness, spare_readiness
from tasks.health.history import (
    BURN_IN,
    RETURNED,
    counted_suspicions,
    kind,
    read_history,
    record_burn_in,
    record_returned,
    untrusted_history,
)
from tasks.health.run import run_health
from tasks.health.sweep import HELD_STATES
from tasks.storage.local import read_own_jsonl


@dataclass(frozen=True)
class Drained:
    """A node ckptops drained, as its drain log and Slurm have it now."""

    node: str
    reason: str  # ours, as logged
    since: float  # epoch seconds of our drain
    state: str  # Slurm's now
    slurm_reason: str  # Slurm's now

    @property
    def ours(self) -> bool:
        """Still held out of service, and for our reason (nobody re-drained it for theirs)."""
        return self.state in HELD_STATES and self.slurm_reason == self.reason


def drained_by_us(settings) -> dict[str, Drained]:
    """The latest drain of each node in the drain log, with its Slurm state and reason now. The
    log is trusted only as ckptops's own (``read_own_jsonl``): one another account owns or may
    write, or in a folder it may write, proves no drain (a warning names it) and none is listed."""
    latest: dict[str, dict] = {}
    for entry in read_own_jsonl(settings.raw_dir / DRAIN_LOG):
        if isinstance(entry.get("node"), str) and isinstance(entry.get("reason"), str):
            latest[entry["node"]] = entry
    now = slurm.node_statuses(sorted(latest)) if latest else {}
    found = {}
    for node, entry in sorted(latest.items()):
        state, reason = now.get(node, ("unknown", ""))
        found[node] = Drained(node, entry["reason"], float(entry.get("at") or 0), state, reason)
    return found


@dataclass
class Outcome:
    node: str
    action: str  # returned, drained (failed its burn-in), burning-in, held, untouched, planned
    detail: str
    level: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return f"{self.node}: {self.action}: {self.detail}"


@dataclass
class BurnIn:
    outcomes: list[Outcome] = field(default_factory=list)
    exclusions: nvrx.SegmentUpdate | None = None  # NVRx's scheduler-exclusion files, rewritten

    @property
    def returned(self) -> list[str]:
        return [o.node for o in self.outcomes if o.action == "returned"]

    @property
    def exit_code(self) -> int:
        """0 when nothing failed its burn-in; 1 when a node did, or is held for a person."""
        return 1 if any(o.action in ("drained", "held") for o in self.outcomes) else 0


def _since(entry: dict) -> datetime | None:
    try:
        at = datetime.fromisoformat(entry["at"])
    except (KeyError, TypeError, ValueError):
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def proof(settings, node: str, now: datetime) -> tuple[str, int, float]:
    """What the node must show: ("held", ...) for a person, else ("burn-in", level, hours of
    passing burn-ins needed) from its suspect history."""
    entries = read_history(settings.raw_dir, node)
    rule, burn = settings.suspect, settings.burn_in
    held = counted_suspicions(entries, burn.hold_window_days, now)
    if len(held) >= burn.hold_after:
        return "held", 0, 0.0
    if len(counted_suspicions(entries, rule.window_days, now)) >= rule.repeat:
        return "burn-in", burn.repeat_level, burn.repeat_hours
    return "burn-in", burn.level, 0.0


def passing_since(settings, node: str, drained: Drained) -> datetime | None:
    """The first of the burn-ins passed since our drain with no failure after it, or None."""
    first = None
    for entry in read_history(settings.raw_dir, node):
        at = _since(entry)
        if kind(entry) != BURN_IN or at is None or at.timestamp() < drained.since:
            continue
        first = (first or at) if entry.get("passed") else None
    return first


def burn_in(settings, only: list[str] | None = None, now: float | None = None) -> BurnIn:
    """Burn in the nodes ckptops drained (or ``only`` those), each as its history asks, and
    return those that pass to service (see the module's rules)."""
    clock = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    done = BurnIn()
    for node, drained in drained_by_us(settings).items():
        if only and node not in only:
            continue
        if drained.state not in HELD_STATES:
            continue  # in service (returned, or resumed by a person): nothing to do
        if not drained.ours:
            why = f"Slurm holds it for another reason ({drained.slurm_reason!r}; ours: {drained.reason!r})"
            done.outcomes.append(Outcome(node, "untouched", why))
            continue
        done.outcomes.append(_one(settings, drained, clock))
    if settings.nvrx_exclusion_dir and done.outcomes:
        done.exclusions = nvrx.publish_for(settings)
    for node in only or ():
        if node not in {o.node for o in done.outcomes}:
            done.outcomes.append(Outcome(node, "untouched", "not held out of service by a drain of ckptops'"))
    return done


def _one(settings, drained: Drained, now: datetime) -> Outcome:
    node = drained.node
    untrusted = untrusted_history(settings.raw_dir, node)
    if untrusted is not None:
        return Outcome(node, "held", f"its history is not ckptops's own ({untrusted}): a person decides")
    what, level, hours = proof(settings, node, now)
    if what == "held":
        burn = settings.burn_in
        return Outcome(
            node,
            "held",
            f"named as suspect {burn.hold_after} times or more within {burn.hold_window_days:g} days: "
            "a person decides (ckptops burns it in no more)",
        )
    run = run_health(settings, [node], level, admit=True)
    (report,) = run.reports
    passed = spare_readiness(run.reports, [node], run.level).get(node) == Readiness.READY
    record_burn_in(settings.raw_dir, node, level, passed, report.summary, now)
    if not passed:
        return Outcome(node, "drained", f"failed its burn-in at level {level}: {report.summary}", level)
    first = passing_since(settings, node, drained) or now
    waited = (now - first).total_seconds() / 3600
    if waited < hours:
        until = first + timedelta(hours=hours)
        return Outcome(
            node,
            "burning-in",
            f"passed at level {level}; a repeat suspect: passing burn-ins until "
            f"{until.isoformat(timespec='minutes')} ({hours:g} h) before it returns",
            level,
        )
    if not settings.drain.enabled:
        return Outcome(node, "planned", f"passed at level {level}: to resume (health.drain is off)", level)
    slurm.resume(node)
    why = f"passed its burn-in at level {level}" + (f" for {hours:g} h" if hours else "")
    record_returned(settings.raw_dir, node, why, now)
    if settings.nvrx_segment_dir:
        nvrx.publish(run.reports, settings)  # its passing verdict takes it out of NVRx's files
    return Outcome(node, "returned", why, level)


def returned_at(settings, node: str) -> str | None:
    """When the node last came back from a burn-in (its history), or None."""
    found = [e.get("at") for e in read_history(settings.raw_dir, node) if kind(e) == RETURNED]
    return found[-1] if found else None
