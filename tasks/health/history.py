"""A node's history: every health verdict on it and every incident that named it a suspect, one
JSON line each in ``<raw_dir>/<node>/history.jsonl``. The one place node health and recovery
both write to, and the one they both read. It decides drains and returns to service, so it is
written 0600 by ckptops's account and read only while nobody else can have written it: the file,
the node's folder and ``raw_dir`` owned by ckptops's account (or root), none writable by its
group or others (a sticky folder excepted).

Lines (``kind``; a line without one is a verdict, as ckptops wrote them before):
- ``verdict``: a check run of the node (its verdict, summary and every check with its raw file);
- ``suspect``: an incident named the node (``incident``, ``at``, ``detail``); one line per
  incident, however often its recovery is run again;
- ``admitted``: the node passed the spare admission set (r3, NCCL, pair test); suspicions from
  before it no longer count;
- ``facts``: what the conformance check read on the node (``at``, ``facts``: fact -> value); the
  latest line is the node's recorded facts, which a spare's admission and a resume's validation
  compare with (tasks.health.fleet);
- ``burn-in``: a drained node's burn-in (``at``, ``level``, ``passed``, ``summary``;
  tasks.health.burn_in); ``returned``: it passed and was resumed in Slurm (``at``, ``why``). A
  burn-in is not an admission: the suspicions before it still count.

The repeat-suspect rule (after NVRx 0.7's node-suspect history): a node named as suspect in
``health.suspect.repeat`` incidents within ``health.suspect.window_days`` (since its last
admission) fails the ``suspect-history`` check, even when its own checks pass: the sweep drains
it (within the drain caps) and a recovery replaces it with a spare.
"""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tasks.errors import Malformed, Unreadable
from tasks.health.verdict import CheckName, Evidence, HealthCheck, result
from tasks.outcome import Verdict
from tasks.storage.local import (
    append_private_jsonl,
    own_folder,
    read_jsonl,
    read_own_jsonl,
    tighten_own_folder,
    written_by_others,
)

HISTORY = "history.jsonl"
VERDICT, SUSPECT, ADMITTED, FACTS = "verdict", "suspect", "admitted", "facts"
BURN_IN, RETURNED = "burn-in", "returned"


def history_path(raw_dir: Path, node: str) -> Path:
    return Path(raw_dir) / node / HISTORY


def _append(raw_dir: Path, node: str, entry: dict) -> None:
    """A line of the node's history, in the node's own folder (never through a link there),
    created 0600; ``raw_dir`` and that folder healed first (``heal``)."""
    folder = own_folder(raw_dir, node)
    heal(raw_dir, node)
    append_private_jsonl(folder / HISTORY, entry)


def heal(raw_dir: Path, node: str) -> None:
    """``raw_dir`` and the node's folder made 0755 where ckptops's own account owns them and an
    older ckptops left them writable by the group (``mkdir`` under a umask of 002): after an
    upgrade, the history reads as ckptops's own again (``tighten_own_folder``; a folder of
    another account, or a link below ``raw_dir``, is left as it is, and stays untrusted)."""
    tighten_own_folder(Path(raw_dir), follow=True)
    tighten_own_folder(Path(raw_dir) / node)


def read_history(raw_dir: Path, node: str) -> list[dict]:
    """The node's lines, oldest first (none for a node never checked or named); a line that is
    not one of ours is skipped with one warning naming the file and line (a byte nobody meant
    never stops the sweep); an unreadable file is an ``Unreadable`` error naming it. Trusted
    only as ckptops's own (``untrusted_history``): otherwise one warning names the file or
    folder, its owner and mode, and the history reads as empty."""
    return read_own_jsonl(history_path(raw_dir, node), _is_entry, root=raw_dir)


def untrusted_history(raw_dir: Path, node: str) -> str | None:
    """Why the node's history may hold lines another account wrote (the file, its folder or
    ``raw_dir`` owned by another account, or writable by its group or others), one line; None
    when only ckptops's account can have written it."""
    return written_by_others(history_path(raw_dir, node), root=raw_dir)


def trusted_history(raw_dir: Path, node: str) -> list[dict]:
    """``read_history`` for a decision that must never take a history it cannot trust for an
    empty one (NVRx's exclusions: an empty history lifts one): the folders healed first
    (``heal``), then a history still untrusted is ``Malformed``, one line naming the file or
    folder at fault, its owner and mode."""
    heal(raw_dir, node)
    path = history_path(raw_dir, node)
    why = untrusted_history(raw_dir, node)
    if why is not None:
        raise Malformed(f"{why}; nothing in {path} is trusted (only a history of ckptops's own account is)")
    return read_jsonl(path, _is_entry)


def kind(entry: dict) -> str:
    return entry.get("kind", VERDICT)


def _is_entry(entry: dict) -> bool:
    return kind(entry) in (VERDICT, SUSPECT, ADMITTED, FACTS, BURN_IN, RETURNED)


def _now(now: datetime | None) -> datetime:
    return now or datetime.now(UTC)


def record_verdict(raw_dir: Path, report) -> None:
    """One line per check run of the node (``report``: a tasks.health.run.NodeReport)."""
    _append(
        raw_dir,
        report.node,
        {
            "kind": VERDICT,
            "started_at": report.started_at,
            "verdict": report.verdict.value,
            "summary": report.summary,
            "checks": [
                {"check": c.name, "verdict": c.verdict.value, "summary": c.detail, "raw": c.raw}
                for c in report.checks
            ],
        },
    )


def record_suspect(
    raw_dir: Path, node: str, incident: str, detail: str = "", now: datetime | None = None
) -> bool:
    """The node was named a suspect by ``incident``; False if that incident is already recorded
    (a recovery run again counts once)."""
    if any(kind(e) == SUSPECT and e.get("incident") == incident for e in read_history(raw_dir, node)):
        return False
    at = _now(now).isoformat(timespec="seconds")
    _append(raw_dir, node, {"kind": SUSPECT, "at": at, "incident": incident, "detail": detail})
    return True


def record_admitted(raw_dir: Path, node: str, now: datetime | None = None) -> None:
    at = _now(now).isoformat(timespec="seconds")
    _append(raw_dir, node, {"kind": ADMITTED, "at": at})


def record_burn_in(
    raw_dir: Path, node: str, level: int, passed: bool, summary: str, now: datetime | None = None
) -> None:
    at = _now(now).isoformat(timespec="seconds")
    _append(raw_dir, node, {"kind": BURN_IN, "at": at, "level": level, "passed": passed, "summary": summary})


def record_returned(raw_dir: Path, node: str, why: str, now: datetime | None = None) -> None:
    at = _now(now).isoformat(timespec="seconds")
    _append(raw_dir, node, {"kind": RETURNED, "at": at, "why": why})


def record_facts(raw_dir: Path, node: str, facts: dict[str, str], now: datetime | None = None) -> None:
    at = _now(now).isoformat(timespec="seconds")
    _append(raw_dir, node, {"kind": FACTS, "at": at, "facts": facts})


def latest_facts(
    raw_dir: Path, node: str, max_age_days: float | None = None, now: datetime | None = None
) -> dict[str, str] | None:
    """The node's facts as the conformance check last read them; None if never read, read more
    than ``max_age_days`` ago (an upgrade since may have changed them), or its history cannot be
    read: nothing is recorded to compare with."""
    try:
        entries = read_history(raw_dir, node)
    except Unreadable:
        return None
    for entry in reversed(entries):
        if kind(entry) == FACTS and isinstance(entry.get("facts"), dict):
            at = _at(entry)
            if max_age_days is not None and (at is None or _now(now) - at > timedelta(days=max_age_days)):
                return None
            return {str(k): str(v) for k, v in entry["facts"].items()}
    return None


def _at(entry: dict) -> datetime | None:
    try:
        at = datetime.fromisoformat(entry.get("at") or entry["started_at"])
    except (KeyError, TypeError, ValueError):
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def counted_suspicions(entries: list[dict], window_days: float, now: datetime | None = None) -> list[dict]:
    """The suspect lines that count now: within the window, and after the last admission."""
    now = _now(now)
    since = now - timedelta(days=window_days)
    admitted = [a for e in entries if kind(e) == ADMITTED and (a := _at(e)) is not None]
    if admitted:
        since = max(since, max(admitted))
    counted = []
    for entry in entries:
        at = _at(entry)
        if kind(entry) == SUSPECT and at is not None and since <= at <= now + timedelta(minutes=5):
            counted.append(entry)
    return counted


@dataclass(frozen=True)
class Standing:
    """A node under the repeat-suspect rule (``health.suspect``): the suspicions that count now,
    and whether they make it a repeat suspect."""

    node: str
    counted: list[dict]
    repeat: int
    window_days: float

    @property
    def repeat_suspect(self) -> bool:
        return len(self.counted) >= self.repeat

    def line(self) -> str:
        """The rule's verdict on the node, as ``ckptops health history`` ends."""
        return (
            f"{self.node}: named as suspect in {len(self.counted)} incidents within {self.window_days:g} "
            f"days (the rule: {self.repeat}): "
            + (
                "a repeat suspect, drained and replaced even when its checks pass"
                if self.repeat_suspect
                else "not a repeat suspect"
            )
        )


def standing(node: str, entries: list[dict], rule, now: datetime | None = None) -> Standing:
    """The node's standing under ``rule`` (``health.suspect``), from its history ``entries``."""
    return Standing(node, counted_suspicions(entries, rule.window_days, now), rule.repeat, rule.window_days)


def suspect_check(raw_dir: Path, node: str, settings, now: datetime | None = None) -> HealthCheck | None:
    """FAIL_HARDWARE (drain and replace) when the node is a repeat suspect (``standing``); None
    otherwise (nothing to add to the node's report); TOOL_ERROR when its history cannot be read
    (the sweep goes on)."""
    try:
        entries = read_history(raw_dir, node)
    except Unreadable as e:
        return result(CheckName.SUSPECT_HISTORY, Verdict.TOOL_ERROR, Evidence(f"history not read: {e}"))
    found = standing(node, entries, settings.suspect, now)
    if not found.repeat_suspect:
        return None
    named = ", ".join(f"{e.get('incident')} ({e.get('at')})" for e in found.counted)
    return result(
        CheckName.SUSPECT_HISTORY,
        Verdict.FAIL_HARDWARE,
        Evidence(
            f"named as suspect in {len(found.counted)} incidents within {found.window_days:g} days: {named}",
            value=len(found.counted),
            gate=found.repeat,
        ),
    )


def describe(entry: dict) -> str:
    """One line for ``ckptops health history``."""
    match kind(entry):
        case "suspect":
            detail = f": {entry['detail']}" if entry.get("detail") else ""
            return f"{entry.get('at')}  suspect   incident {entry.get('incident')}{detail}"
        case "admitted":
            return f"{entry.get('at')}  admitted  passed the spare admission set (earlier suspicions lapse)"
        case "burn-in":
            outcome = "passed" if entry.get("passed") else "FAILED"
            level = entry.get("level")
            return f"{entry.get('at')}  burn-in   level {level} {outcome}: {entry.get('summary', '')}"
        case "returned":
            return f"{entry.get('at')}  returned  resumed in Slurm: {entry.get('why', '')}"
        case "facts":
            facts = entry.get("facts") if isinstance(entry.get("facts"), dict) else {}
            return f"{entry.get('at')}  facts     {', '.join(f'{k} {v}' for k, v in facts.items())}"
        case _:
            return f"{entry.get('started_at')}  {entry.get('verdict', '?'):<9} {entry.get('summary', '')}"
