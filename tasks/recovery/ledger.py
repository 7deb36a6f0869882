"""The incident ledger: one JSON line per recovery in ``<save_dir>/.ckptops-history/incidents.jsonl``.

The ledger is the job's memory of its failures: the stop rules read it (tasks.recovery.rules),
``ckptops incidents`` and the UI show it, and goodput is measured from it. It lives beside the
checkpoints it talks about, so it survives a Prefect database reset. One line is appended when an
incident ends, however it ends (crash-safe: one O_APPEND write, fsynced).
"""

import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.checkpoint.layout import HISTORY
from tasks.storage.local import append_jsonl, read_jsonl

INCIDENTS = "incidents.jsonl"

# The phases of an incident, in the order they happen; each is an epoch time in ``times``.
PHASES = (
    "last_progress",
    "first_error",
    "detected",
    "triaged",
    "health_done",
    "approval_requested",
    "approved",
    "relaunch_submitted",
    "job_running",
    "first_resumed_step",
    "validated",
)

# How an incident ended.
COMPLETED = "completed"  # relaunched and the resume validated
WARNED = "warned"  # relaunched; validation rejected it but the profile only warns
STOPPED = "stopped"  # a human must act: a stop rule, no checkpoint, a failed relaunch, a rejected resume
ABORTED = "aborted"  # the approver said no, or nobody answered in time


def new_id(now: float | None = None) -> str:
    """A short incident id that sorts by time: ``20261201-0412-3f9a``."""
    stamp = time.strftime("%Y%m%d-%H%M", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{uuid.uuid4().hex[:4]}"


@dataclass
class Incident:
    id: str
    job: str
    trigger: str  # "manual", "event" or "cli"
    failed_job: str | None = None  # the Slurm job id, or the log paths' first file
    times: dict[str, float] = field(default_factory=dict)
    cls: str | None = None
    exit_code: int | None = None
    first_error: dict | None = None
    suspect_nodes: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    health: str | None = None  # the suspects' health verdicts
    promoted_at_failure: int | None = None  # the pointer when the failure was triaged
    checkpoint: int | None = None  # the iteration relaunched from
    failure_iteration: int | None = None
    recomputed_iterations: int | None = None
    recomputed_tokens: int | None = None
    lost_gpu_hours: float | None = None
    gpus: int | None = None
    rules: list[dict] = field(default_factory=list)
    stop_rule: str | None = None
    relaunched_job: str | None = None
    validation: str | None = None
    outcome: str | None = None
    reason: str | None = None
    flow_run: str | None = None

    def mark(self, phase: str, at: float | None = None) -> None:
        assert phase in PHASES, phase
        self.times[phase] = time.time() if at is None else at

    def to_dict(self) -> dict:
        data = asdict(self)
        data["class"] = data.pop("cls")
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Incident":
        data = dict(data)
        data["cls"] = data.pop("class", None)
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})


def ledger_path(save_dir: Path) -> Path:
    return Path(save_dir) / HISTORY / INCIDENTS


def record(save_dir: Path, incident: Incident) -> None:
    append_jsonl(ledger_path(save_dir), incident.to_dict())


def incidents(save_dir: Path) -> list[Incident]:
    """Every recorded incident, oldest first (torn or foreign lines skipped)."""
    found = []
    for entry in read_jsonl(ledger_path(save_dir)):
        if isinstance(entry, dict) and "id" in entry and "job" in entry:
            found.append(Incident.from_dict(entry))
    return found


def lost_gpu_hours(
    gpus: int, downtime_seconds: float, recomputed_iterations: int, step_seconds: float
) -> float:
    """GPU time the failure cost: every GPU idle while the job was down, plus the work redone
    from the checkpoint up to where the failure struck."""
    return gpus * (max(0.0, downtime_seconds) + max(0, recomputed_iterations) * step_seconds) / 3600
