"""What triage finds: classified lines and the answer, and the limits on what is kept."""

import bisect
from dataclasses import dataclass, field
from enum import StrEnum


class FailureClass(StrEnum):
    """What a failure was, in the words the ledger, the stop rules and auto-approval use."""

    HARDWARE = "hardware"
    NETWORK = "network"
    NUMERICS = "numerics"
    DATA = "data"  # a rejected result Megatron's rerun state machine reproduced on another GPU
    OOM = "oom"
    SOFTWARE = "software"
    HANG = "hang"
    SAVE_FAILED = (
        "save-failed"  # a checkpoint write failed: no space, over quota, an I/O error, a dead writer
    )
    SAVE_STALLED = "save-stalled"  # the job hung while a save was being written or finalized
    PREEMPTED = "preempted"
    UNKNOWN = "unknown"


APPLICATION_XIDS = frozenset({13, 31, 43})  # an application fault: evidence for software
EVIDENCE_CAP = 50
# What is kept of a log line: an error message is at its start, and a first error is stored in
# the incident ledger and in every JSON answer.
LINE_BYTES = 4096
BLOCK = 1000  # lines screened at once
SPIKE_WINDOW, SPIKE_FACTOR = 20, 3.0
OVERFLOWS_FOR_NUMERICS = 5
OVERFLOW_SCALE_FLOOR = 256.0  # a loss scale this low after 5 overflows in a row: not the initial search
MEGATRON = {16: "exclude-node-and-rerun", 17: "stop"}


@dataclass(frozen=True)
class Line:
    """One classified log line."""

    file: str
    line: int  # 1-based
    text: str  # without the trailing newline
    kind: str  # "root", "cascade" or "info"
    cls: str  # the class this line is evidence for (FailureClass.HANG for cascades)
    at: float | None  # its timestamp (own or inherited from above), epoch seconds
    nodes: tuple[str, ...] = ()  # the nodes this line names as suspects


@dataclass
class Triage:
    cls: str
    suspect_nodes: list[str]
    first_error: Line | None
    evidence: list[Line]
    reason: str
    exit_code: int | None = None
    megatron: str | None = None
    iteration: int | None = None
    anomaly_iteration: int | None = None
    # From the ranks' Flight Recorder dumps, for a hang: the ranks that never entered the
    # collective the others wait in, that collective, and what was read (flight_recorder.Attribution).
    suspect_ranks: list[int] = field(default_factory=list)
    stuck_collective: dict | None = None
    flight_recorder: dict | None = None
    # The scheduler or the cloud took the nodes away (a preemption): the line that says so. Such
    # a failure counts against none of the job's recovery budgets (tasks.recovery.rules).
    infrastructure: str | None = None
    # The GPUs (``node:device``) Megatron's rerun state machine convicted of a transient or
    # persistent fault: what the suspect history records beside the node.
    suspect_gpus: list[str] = field(default_factory=list)
    # The save a save-failed or save-stalled failure was writing, by the job's log.
    save_iteration: int | None = None
    # The earliest time any of the logs states (epoch seconds, read as UTC): when the job began,
    # as far as its logs tell.
    logs_began: float | None = None

    def to_dict(self) -> dict:
        first = self.first_error
        return {
            "class": self.cls,
            "suspect_nodes": list(self.suspect_nodes),
            "first_error": None
            if first is None
            else {"file": first.file, "line": first.line, "text": first.text},
            # The first error is evidence too; its text is given once, above.
            "evidence": [
                {"file": e.file, "line": e.line, "class": e.cls, "kind": e.kind}
                | ({"first_error": True} if e == first else {"text": e.text})
                for e in self.evidence
            ],
            "reason": self.reason,
            "exit_code": self.exit_code,
            "megatron": self.megatron,
            "iteration": self.iteration,
            "anomaly_iteration": self.anomaly_iteration,
            "suspect_ranks": list(self.suspect_ranks),
            "stuck_collective": self.stuck_collective,
            "flight_recorder": self.flight_recorder,
            "infrastructure": self.infrastructure,
            "suspect_gpus": list(self.suspect_gpus),
            "save_iteration": self.save_iteration,
        }

    def line(self) -> str:
        """One line for a human, the class word first."""
        parts = [self.cls, f"suspects {', '.join(self.suspect_nodes) or 'none'}"]
        first = self.first_error
        parts.append(
            f"first error: {first.file}:{first.line}: {first.text.strip()[:240]}"
            if first
            else "no recognised error"
        )
        if self.megatron:
            parts.append(f"megatron: {self.megatron} (exit {self.exit_code})")
        if self.iteration is not None:
            parts.append(f"iteration {self.iteration}")
        if self.flight_recorder is not None:
            parts.append(f"flight recorder: {self.flight_recorder['reason']}")
        return "  ".join(parts)


@dataclass
class Hit:
    """A root or cascade line while the files are read; its time is resolved at the end, when the
    year for timestamps without one is known."""

    file_index: int
    file: str
    line: int
    text: str
    kind: str
    cls: str
    ts: tuple | None  # (year or None, month, day, hour, minute, second)
    nodes: tuple[str, ...] = ()
    tags: frozenset = frozenset()
    anomaly: int | None = None
    exit_code: int | None = None
    order: tuple | None = None  # filled in at the end
    at: float | None = None

    def to_line(self, at: float | None) -> Line:
        return Line(self.file, self.line, self.text, self.kind, self.cls, at, self.nodes)


def keep_first(hits: list[Hit], hit: Hit) -> None:
    """Keep the first EVIDENCE_CAP hits of a file by line (a deferred hit may come in late)."""
    if len(hits) < EVIDENCE_CAP:
        bisect.insort(hits, hit, key=lambda h: h.line)
    elif hit.line < hits[-1].line:
        bisect.insort(hits, hit, key=lambda h: h.line)
        hits.pop()
